#include "cli/util.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int moectl_read_all(FILE *in, char **out, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf)
        return -ENOMEM;
    for (;;) {
        if (n == cap) {
            char *q = realloc(buf, cap * 2 + 1);
            if (!q) {
                free(buf);
                return -ENOMEM;
            }
            buf = q;
            cap *= 2;
        }
        size_t k = fread(buf + n, 1, cap - n, in);
        n += k;
        if (k == 0) {
            if (ferror(in)) {
                int e = errno ? -errno : -EIO;
                free(buf);
                return e;
            }
            break;
        }
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

int moectl_read_path(const char *path, char **out, size_t *len)
{
    if (!strcmp(path, "-"))
        return moectl_read_all(stdin, out, len);
    FILE *f = fopen(path, "rb");
    if (!f)
        return -errno;
    int rc = moectl_read_all(f, out, len);
    fclose(f);
    return rc;
}
