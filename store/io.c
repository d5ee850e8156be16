#include "store/io.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>

double moe_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Streams have no reliable size (stdin, pipes, /proc files), so the buffer grows by doubling;
 * one byte beyond cap is always kept for the terminating NUL. */
int moe_read_stream(FILE *in, char **out, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    int rc;
    char *buf = malloc(cap + 1);
    if (!buf)
        return -ENOMEM;
    for (;;) {
        if (n == cap) {
            char *q = realloc(buf, cap * 2 + 1);
            if (!q) {
                rc = -ENOMEM;
                goto fail;
            }
            buf = q;
            cap *= 2;
        }
        size_t k = fread(buf + n, 1, cap - n, in);
        n += k;
        if (k == 0) {
            if (ferror(in)) {
                rc = errno ? -errno : -EIO;
                goto fail;
            }
            break;
        }
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
fail:
    free(buf);
    return rc;
}

int moe_read_file(const char *path, char **out, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -errno;
    int rc = moe_read_stream(f, out, len);
    fclose(f);
    return rc;
}
