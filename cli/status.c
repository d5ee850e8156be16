/* moectl status: the daemon's state from /admin/status, as a table or JSON. */
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "cli/client.h"
#include "cli/moectl.h"

static double gib(json_t *v)
{
    return json_number_value(v) / 1073741824.0;
}

/* Human size of a JSON number of bytes; buf holds the text. */
static const char *hsize(json_t *v, char *buf, size_t cap)
{
    double n = json_number_value(v);
    if (n >= 1073741824.0)
        snprintf(buf, cap, "%.2f GiB", n / 1073741824.0);
    else if (n >= 1048576.0)
        snprintf(buf, cap, "%.1f MiB", n / 1048576.0);
    else
        snprintf(buf, cap, "%.0f KiB", n / 1024.0);
    return buf;
}

static int cmd_status(int argc, char **argv)
{
    if (moectl_wants_help(argc, argv)) {
        printf("usage: moectl [--socket PATH] [--json] status\n");
        return 0;
    }
    if (argc > 1) {
        fprintf(stderr, "usage: moectl [--socket PATH] [--json] status\n");
        return 2;
    }
    json_t *o;
    int rc = client_get_json("/admin/status", "status", &o);
    if (rc || !o)
        return rc;
    json_t *m = json_object_get(o, "model"), *s = json_object_get(o, "scheduler");
    printf("moed       %s (pid %lld, up %lld s)\n", json_string_value(json_object_get(o, "status")),
           json_integer_value(json_object_get(o, "pid")), json_integer_value(json_object_get(o, "uptime_s")));
    char h1[32], h2[32];
    printf("model      %s  %s  %lld layers x %lld experts (top-%lld)  ctx %lld  dense %s  experts %s\n",
           json_string_value(json_object_get(m, "id")), json_string_value(json_object_get(m, "arch")),
           json_integer_value(json_object_get(m, "n_layer")), json_integer_value(json_object_get(m, "n_expert")),
           json_integer_value(json_object_get(m, "n_expert_used")), json_integer_value(json_object_get(m, "n_ctx")),
           hsize(json_object_get(m, "bytes_dense"), h1, sizeof h1),
           hsize(json_object_get(m, "bytes_experts"), h2, sizeof h2));
    printf("requests   %lld total, %lld failed, %lld running, %lld queued;  %.1f tok/s\n",
           json_integer_value(json_object_get(s, "requests_total")),
           json_integer_value(json_object_get(s, "requests_failed")),
           json_integer_value(json_object_get(s, "running")), json_integer_value(json_object_get(s, "queued")),
           json_number_value(json_object_get(s, "tokens_per_second")));
    printf("tokens     %lld prompt, %lld generated\n",
           json_integer_value(json_object_get(s, "prompt_tokens_total")),
           json_integer_value(json_object_get(s, "gen_tokens_total")));
    json_t *p = json_object_get(o, "profile");
    if (p)
        printf("profile    %lld tokens counted (state dir %s)\n", json_integer_value(json_object_get(p, "tokens")),
               json_string_value(json_object_get(p, "state_dir")));
    json_t *st = json_object_get(o, "store");
    if (st)
        printf("store      %s shared (%s on huge pages), built in %.2f s\n",
               hsize(json_object_get(st, "bytes"), h1, sizeof h1),
               hsize(json_object_get(st, "huge_page_bytes"), h2, sizeof h2),
               json_number_value(json_object_get(st, "load_seconds")));
    json_t *pl = json_object_get(st, "pool");
    if (pl) {
        char h3[32];
        printf("pool       %lld of %lld experts in %lld slots of %s;  hit rate %.1f%%, %lld waits "
               "(%.2f per token, %.2f s);  disk %s in %lld %s reads (p50 %.2f ms, p99 %.2f ms), %lld errors;  %lld "
               "evictions, %lld pinned;  %lld read ahead (%lld used)\n",
               json_integer_value(json_object_get(pl, "resident")),
               json_integer_value(json_object_get(pl, "experts")),
               json_integer_value(json_object_get(pl, "slots")),
               hsize(json_object_get(pl, "slot_bytes"), h1, sizeof h1),
               100.0 * json_number_value(json_object_get(pl, "hit_rate")),
               json_integer_value(json_object_get(pl, "waits")),
               json_number_value(json_object_get(pl, "waits_per_token")),
               json_number_value(json_object_get(pl, "wait_seconds")),
               hsize(json_object_get(pl, "read_bytes"), h3, sizeof h3),
               json_integer_value(json_object_get(pl, "reads")),
               json_string_value(json_object_get(pl, "io")) ? json_string_value(json_object_get(pl, "io"))
                                                            : "?",
               json_number_value(json_object_get(pl, "read_p50_ms")),
               json_number_value(json_object_get(pl, "read_p99_ms")),
               json_integer_value(json_object_get(pl, "read_errors")),
               json_integer_value(json_object_get(pl, "evictions")),
               json_integer_value(json_object_get(pl, "pinned")),
               json_integer_value(json_object_get(pl, "prefetch_reads")),
               json_integer_value(json_object_get(pl, "prefetch_used")));
    }
    json_t *ws = json_object_get(o, "workers");
    if (json_array_size(ws)) {
        printf("\n%-3s %-10s %-8s %-8s %-8s %-7s %-9s %-11s %-10s %s\n", "#", "state", "pid",
               "device", "restarts", "running", "tok/s", "seq tok/s", "vram GiB", "last error");
        size_t i;
        json_t *w;
        json_array_foreach(ws, i, w) {
            printf("%-3lld %-10s %-8lld %-8s %-8lld %-7lld %-9.1f %-11.1f %-10.2f %s\n",
                   json_integer_value(json_object_get(w, "index")),
                   json_string_value(json_object_get(w, "state")),
                   json_integer_value(json_object_get(w, "pid")),
                   json_string_value(json_object_get(w, "device")),
                   json_integer_value(json_object_get(w, "restarts")),
                   json_integer_value(json_object_get(w, "running")),
                   json_number_value(json_object_get(w, "tokens_per_second")),
                   json_number_value(json_object_get(w, "sequence_tokens_per_second")),
                   gib(json_object_get(w, "vram_used")),
                   json_string_value(json_object_get(w, "last_error")));
        }
    }
    json_decref(o);
    return 0;
}

MOECTL_COMMAND(status, "daemon, model, workers and request counters", cmd_status)
