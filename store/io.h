/* Small system helpers that several programs need: a monotonic clock and whole-file reads.
 *
 * They live in the store library because every program (moed, moed-worker, moectl, the tests and
 * the fuzz targets) links it. */
#ifndef MOE_IO_H
#define MOE_IO_H

#include <stddef.h>
#include <stdio.h>

/* Seconds on CLOCK_MONOTONIC: for measuring intervals and deadlines, never wall-clock time. */
double moe_now_s(void);

/* Reads the rest of the stream into a malloc'ed buffer that is NUL-terminated (*len excludes the
 * NUL, so text can be used as a C string and binary data by length). The stream is not closed.
 * Returns 0, -ENOMEM, or the negative errno of a read error (-EIO when errno says nothing); on
 * failure *out and *len are untouched. */
int moe_read_stream(FILE *in, char **out, size_t *len);

/* moe_read_stream() on the file at path. Returns 0 or a negative errno (the open's, e.g. -ENOENT,
 * or one of moe_read_stream()'s). */
int moe_read_file(const char *path, char **out, size_t *len);

#endif
