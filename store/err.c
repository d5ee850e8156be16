#include "store/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *moe_strerror(int err)
{
    switch (err) {
    case 0: return "success";
    case MOE_EFORMAT: return "malformed input";
    case MOE_EUNSUPPORTED: return "unsupported";
    case MOE_ENOTFOUND: return "not found";
    case MOE_ETYPE: return "wrong type";
    case MOE_ERANGE: return "value out of range";
    case MOE_ETOOBIG: return "too big";
    case MOE_ECANCELED: return "cancelled";
    case MOE_EINTERNAL: return "internal error";
    case MOE_EBACKEND: return "compute backend error";
    }
    if (err < 0 && err > -4096)
        return strerror(-err);
    return "unknown error";
}

int moe_fail(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

void moe_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}
