/* Growable byte buffers: the (pointer, length, capacity) triples that the HTTP parser, the chat
 * renderer, generated text and moectl's client fill a piece at a time.
 *
 * The triple lives in the caller's struct (start it at {NULL, 0, 0}); the caller frees the pointer.
 * Capacity grows by doubling from 256 bytes, so appending n bytes at a time costs O(total). */
#ifndef MOE_BUF_H
#define MOE_BUF_H

#include <stdarg.h>
#include <stddef.h>

/* Makes *cap at least need bytes, reallocating *p. Returns 0 or -ENOMEM; on failure *p and *cap
 * are unchanged and still valid. */
int moe_buf_reserve(char **p, size_t *cap, size_t need);

/* Appends n bytes of data at *p + *len and keeps a NUL after them (so the buffer is always a
 * C string when it holds text; *len excludes the NUL). Returns 0 or -ENOMEM (out of memory, or a
 * length that would overflow size_t); on failure nothing changes. */
int moe_buf_append(char **p, size_t *len, size_t *cap, const void *data, size_t n);

/* Appends printf output the same way. Returns 0 or -ENOMEM (also for a format error); on
 * failure nothing changes. */
int moe_buf_printf(char **p, size_t *len, size_t *cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int moe_buf_vprintf(char **p, size_t *len, size_t *cap, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));

#endif
