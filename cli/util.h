/* Small helpers shared by moectl subcommands. */
#ifndef MOECTL_UTIL_H
#define MOECTL_UTIL_H

#include <stddef.h>

/* Reads a whole file, or stdin for "-", into a malloc'ed, NUL-terminated buffer (*len excludes the
 * NUL); see moe_read_file() in store/io.h. Returns 0 or a negative errno. */
int moectl_read_path(const char *path, char **out, size_t *len);

#endif
