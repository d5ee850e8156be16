/* moectl profile show|export FILE|import FILE|reset: the daemon's routing profile. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli/client.h"
#include "cli/moectl.h"
#include "cli/util.h"
#include "store/err.h"

static int usage_to(FILE *f)
{
    fprintf(f, "usage: moectl [--socket PATH] [--json] profile show | export FILE | import FILE | reset\n");
    return f == stdout ? 0 : 2;
}

static int usage(void)
{
    return usage_to(stderr);
}

static int cmp_desc(const void *a, const void *b)
{
    const long long *x = a, *y = b;
    return x[0] < y[0] ? 1 : x[0] > y[0] ? -1 : (x[1] > y[1]) - (x[1] < y[1]);
}

/* Per layer: share of the routings taken by its top quarter of experts, and the top experts.
 * Consumes the reference to o. */
static int show(json_t *o)
{
    printf("fingerprint %s, %lld layers x %lld experts, %lld tokens counted\n\n",
           json_string_value(json_object_get(o, "fingerprint")),
           json_integer_value(json_object_get(o, "n_layer")),
           json_integer_value(json_object_get(o, "n_expert")),
           json_integer_value(json_object_get(o, "tokens")));
    printf("%-6s %-12s %-14s %s\n", "layer", "routings", "top-25% share", "most used (expert:share)");
    size_t l;
    json_t *row;
    json_array_foreach(json_object_get(o, "counts"), l, row) {
        size_t n = json_array_size(row);
        long long(*v)[2] = calloc(n ? n : 1, sizeof *v);
        if (!v)
            break;
        long long total = 0;
        for (size_t e = 0; e < n; e++) {
            v[e][0] = json_integer_value(json_array_get(row, e));
            v[e][1] = (long long)e;
            total += v[e][0];
        }
        qsort(v, n, sizeof *v, cmp_desc);
        long long top = 0;
        size_t q = n / 4 ? n / 4 : 1;
        for (size_t e = 0; e < q && e < n; e++)
            top += v[e][0];
        printf("%-6zu %-12lld %12.1f%%  ", l, total, total ? 100.0 * top / total : 0.0);
        for (size_t e = 0; e < n && e < 6; e++)
            printf(" %lld:%.1f%%", v[e][1], total ? 100.0 * v[e][0] / total : 0.0);
        putchar('\n');
        free(v);
    }
    json_decref(o);
    return 0;
}

static int cmd_profile(int argc, char **argv)
{
    if (moectl_wants_help(argc, argv))
        return usage_to(stdout);
    if (argc < 2)
        return usage();
    const char *sub = argv[1];
    struct client_resp r;
    int rc;
    if (!strcmp(sub, "show") && argc == 2) {
        json_t *o;
        if ((rc = client_get_json("/admin/profile", "profile", &o)) || !o)
            return rc;
        return show(o);
    }
    if (!strcmp(sub, "export") && argc == 3) {
        if ((rc = client_call("GET", "/admin/profile", NULL, 0, &r)))
            return rc;
        FILE *f = !strcmp(argv[2], "-") ? stdout : fopen(argv[2], "w");
        if (!f) {
            fprintf(stderr, "moectl: %s: %s\n", argv[2], strerror(errno));
            client_resp_free(&r);
            return 1;
        }
        bool ok = fwrite(r.body, 1, r.len, f) == r.len;
        if (r.len && r.body[r.len - 1] != '\n')
            fputc('\n', f);
        if (f != stdout)
            ok = (fclose(f) == 0) && ok;
        client_resp_free(&r);
        if (!ok) {
            fprintf(stderr, "moectl: writing %s failed\n", argv[2]);
            return 1;
        }
        if (f != stdout && !moectl_opts.json)
            fprintf(stderr, "profile written to %s\n", argv[2]);
        return 0;
    }
    if (!strcmp(sub, "import") && argc == 3) {
        char *buf = NULL;
        size_t len = 0;
        char err[256];
        if ((rc = moectl_read_path(argv[2], &buf, &len, err, sizeof err))) {
            fprintf(stderr, "moectl: profile import %s: %s\n", argv[2], err);
            return 1;
        }
        rc = client_call("PUT", "/admin/profile", buf, len, &r);
        free(buf);
        if (rc)
            return rc;
        if (moectl_opts.json)
            printf("%s", r.body);
        else
            printf("profile imported from %s\n", argv[2]);
        client_resp_free(&r);
        return 0;
    }
    if (!strcmp(sub, "reset") && argc == 2) {
        if ((rc = client_call("DELETE", "/admin/profile", NULL, 0, &r)))
            return rc;
        if (moectl_opts.json)
            printf("%s", r.body);
        else
            printf("profile reset\n");
        client_resp_free(&r);
        return 0;
    }
    return usage();
}

MOECTL_COMMAND(profile, "show|export FILE|import FILE|reset  the routing profile", cmd_profile)
