/* Small helpers shared by moectl subcommands. */
#ifndef MOECTL_UTIL_H
#define MOECTL_UTIL_H

#include <stddef.h>
#include <stdio.h>

/* Reads the whole stream into a malloc'ed buffer (NUL-terminated, *len excludes the NUL).
 * Returns 0 or a negative errno. */
int moectl_read_all(FILE *in, char **out, size_t *len);

/* Reads a file, or stdin for "-". Returns 0 or a negative errno. */
int moectl_read_path(const char *path, char **out, size_t *len);

#endif
