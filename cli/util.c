#include "cli/util.h"

#include <ctype.h>
#include <stdbool.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store/err.h"

/* Reads fd to its end, but never more than MOECTL_READ_MAX bytes. */
static int read_capped(int fd, char **out, size_t *len, char *err, size_t errlen)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    for (;;) {
        if (n == cap) {
            if (cap > MOECTL_READ_MAX) {
                free(buf);
                return moe_fail(err, errlen, -EFBIG, "more than %zu MiB (the limit)",
                                MOECTL_READ_MAX >> 20);
            }
            size_t ncap = cap * 2 > MOECTL_READ_MAX ? MOECTL_READ_MAX + 1 : cap * 2;
            char *q = realloc(buf, ncap + 1);
            if (!q) {
                free(buf);
                return moe_fail(err, errlen, -ENOMEM, "out of memory");
            }
            buf = q;
            cap = ncap;
        }
        ssize_t k = read(fd, buf + n, cap - n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0) {
            int e = errno;
            free(buf);
            return moe_fail(err, errlen, -e, "%s", strerror(e));
        }
        if (k == 0)
            break;
        n += (size_t)k;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

int moectl_read_path(const char *path, char **out, size_t *len, char *err, size_t errlen)
{
    bool is_stdin = !strcmp(path, "-");
    int fd = is_stdin ? 0 : open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return moe_fail(err, errlen, -errno, "%s", strerror(errno));
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) != 0) {
        rc = moe_fail(err, errlen, -errno, "%s", strerror(errno));
    } else if (S_ISREG(st.st_mode) && (uint64_t)st.st_size > MOECTL_READ_MAX) {
        rc = moe_fail(err, errlen, -EFBIG, "%lld bytes, more than %zu MiB (the limit)",
                      (long long)st.st_size, MOECTL_READ_MAX >> 20);
    } else if (!is_stdin && !S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode)) {
        rc = moe_fail(err, errlen, -EINVAL, "not a regular file or a pipe");
    } else {
        rc = read_capped(fd, out, len, err, errlen);
    }
    if (!is_stdin)
        close(fd);
    return rc;
}

int moectl_parse_int(const char *opt, const char *s, long long min, long long max, long long *out)
{
    char *end = NULL;
    errno = 0;
    /* strtoll skips leading blanks; a number must start with its sign or a digit. */
    long long v = (isdigit((unsigned char)s[0]) || s[0] == '-' || s[0] == '+') ? strtoll(s, &end, 10) : 0;
    if (!end || end == s || *end || errno == ERANGE || v < min || v > max) {
        fprintf(stderr, "moectl: %s must be an integer in %lld..%lld, not '%s'\n", opt, min, max, s);
        return -1;
    }
    *out = v;
    return 0;
}

int moectl_parse_num(const char *opt, const char *s, double min, double max, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = (isdigit((unsigned char)s[0]) || s[0] == '-' || s[0] == '+' || s[0] == '.')
                   ? strtod(s, &end) : NAN;
    if (!end || end == s || *end || errno == ERANGE || !isfinite(v) || v < min || v > max) {
        fprintf(stderr, "moectl: %s must be a number in %g..%g, not '%s'\n", opt, min, max, s);
        return -1;
    }
    *out = v;
    return 0;
}
