#include "store/buf.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int moe_buf_reserve(char **p, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    size_t nc = *cap ? *cap : 256;
    while (nc < need)
        nc = nc > SIZE_MAX / 2 ? need : nc * 2;
    char *q = realloc(*p, nc);
    if (!q)
        return -ENOMEM;
    *p = q;
    *cap = nc;
    return 0;
}

int moe_buf_append(char **p, size_t *len, size_t *cap, const void *data, size_t n)
{
    if (n > SIZE_MAX - 1 - *len)
        return -ENOMEM;
    int rc = moe_buf_reserve(p, cap, *len + n + 1);
    if (rc)
        return rc;
    if (n)
        memcpy(*p + *len, data, n);
    *len += n;
    (*p)[*len] = 0;
    return 0;
}

int moe_buf_vprintf(char **p, size_t *len, size_t *cap, const char *fmt, va_list ap)
{
    for (;;) {
        va_list aq;
        va_copy(aq, ap);
        const size_t room = *p ? *cap - *len : 0;
        int n = vsnprintf(*p ? *p + *len : NULL, room, fmt, aq);
        va_end(aq);
        if (n < 0)
            return -ENOMEM;
        if (*p && (size_t)n < room) {
            *len += (size_t)n;
            return 0;
        }
        if ((size_t)n > SIZE_MAX - 1 - *len)
            return -ENOMEM;
        int rc = moe_buf_reserve(p, cap, *len + (size_t)n + 1);
        if (rc)
            return rc;
    }
}

int moe_buf_printf(char **p, size_t *len, size_t *cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = moe_buf_vprintf(p, len, cap, fmt, ap);
    va_end(ap);
    return rc;
}
