/* Small helpers shared by moectl subcommands. */
#ifndef MOECTL_UTIL_H
#define MOECTL_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* The most moectl reads from one input file (a profile to import, a text to tokenize). */
#define MOECTL_READ_MAX ((size_t)256 << 20)

/* The largest -n / --max-tokens (the longest context a worker takes). */
#define MOECTL_MAX_TOKENS (1LL << 24)

/* Reads a whole file, or stdin for "-", into a malloc'ed, NUL-terminated buffer (*len excludes the
 * NUL). Only regular files and pipes are read, and at most MOECTL_READ_MAX bytes: a larger input
 * or a device (/dev/zero) is refused without reading it all. Returns 0, or a negative errno with
 * a message in err (without the path). */
int moectl_read_path(const char *path, char **out, size_t *len, char *err, size_t errlen);

/* Strict numbers for command-line options: the whole of s must be a decimal integer (an
 * overflow is an error, not a clamp) or a finite number, in min..max. On error prints
 * "moectl: OPT must be ..., not 'S'" to stderr and returns -1. */
int moectl_parse_int(const char *opt, const char *s, long long min, long long max, long long *out);
int moectl_parse_num(const char *opt, const char *s, double min, double max, double *out);

#endif
