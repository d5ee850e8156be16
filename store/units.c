/* Sizes and shares (units.h). */
#include "store/units.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "store/err.h"

/* The non-negative decimal number s starts with (blanks first allowed); *end after it. */
static int leading_number(const char *s, double *v, char **end)
{
    if (!s)
        return MOE_EFORMAT;
    while (isspace((unsigned char)*s))
        s++;
    if (!isdigit((unsigned char)*s) && *s != '.')
        return MOE_EFORMAT;
    errno = 0;
    *v = strtod(s, end);
    if (errno || *end == s || !isfinite(*v) || *v < 0)
        return MOE_EFORMAT;
    return 0;
}

int moe_parse_size(const char *s, uint64_t *out)
{
    char *end;
    double v;
    if (leading_number(s, &v, &end))
        return MOE_EFORMAT;
    double mul = 1;
    switch (tolower((unsigned char)*end)) {
    case 'k': mul = 1024.0; end++; break;
    case 'm': mul = 1024.0 * 1024; end++; break;
    case 'g': mul = 1024.0 * 1024 * 1024; end++; break;
    case 't': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (mul > 1 && (*end == 'i' || *end == 'I'))
        end++;
    if (*end == 'b' || *end == 'B')
        end++;
    while (isspace((unsigned char)*end))
        end++;
    if (*end)
        return MOE_EFORMAT;
    double bytes = v * mul;
    if (bytes >= 18446744073709551615.0)
        return MOE_ERANGE;
    *out = (uint64_t)bytes;
    return 0;
}

int moe_parse_share(const char *s, double *out)
{
    char *end;
    double v;
    if (leading_number(s, &v, &end))
        return MOE_EFORMAT;
    if (*end == '%') {
        v /= 100.0;
        end++;
    }
    while (isspace((unsigned char)*end))
        end++;
    if (*end)
        return MOE_EFORMAT;
    if (!(v > 0.0 && v <= 1.0))
        return MOE_ERANGE;
    *out = v;
    return 0;
}

char *moe_fmt_size(char *buf, unsigned long cap, uint64_t bytes)
{
    const double b = (double)bytes;
    if (bytes >= (1ull << 30))
        snprintf(buf, cap, "%.2f GiB", b / (1ull << 30));
    else if (bytes >= (1ull << 20))
        snprintf(buf, cap, "%.1f MiB", b / (1ull << 20));
    else if (bytes >= 1024)
        snprintf(buf, cap, "%.1f KiB", b / 1024);
    else
        snprintf(buf, cap, "%llu B", (unsigned long long)bytes);
    return buf;
}
