#include "store/buf.h"

#include <errno.h>
#include <stdint.h>
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
