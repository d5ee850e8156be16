/* moectl placement: which experts the current profile makes hot, per layer, and what each GPU
 * worker holds: slots, pinned slots, residency and hit rate per layer; the workloads the daemon
 * learned from routing signatures and whether GPU workers hold complementary hot sets. */
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "cli/client.h"
#include "cli/moectl.h"
#include "store/units.h"

/* A JSON array of shares (or nulls) as "12.5% 80.0% -". */
static void print_shares(json_t *a)
{
    size_t i;
    json_t *v;
    json_array_foreach(a, i, v) {
        if (json_is_number(v))
            printf("%s%5.1f%%", i ? " " : "", 100.0 * json_number_value(v));
        else
            printf("%s%6s", i ? " " : "", "-");
    }
}

/* The workload table and the complementary hot sets planned from it. */
static void print_workloads(json_t *o)
{
    json_t *wl = json_object_get(o, "workloads"), *c = json_object_get(o, "complementary");
    if (!json_is_object(wl) || !json_is_integer(json_object_get(wl, "keys")))
        return;
    printf("\nworkloads: %lld keys (of %lld), %lld requests learned (keys: the prompt's first %lld "
           "tokens)\n", json_integer_value(json_object_get(wl, "keys")),
           json_integer_value(json_object_get(wl, "capacity")),
           json_integer_value(json_object_get(wl, "requests")),
           json_integer_value(json_object_get(wl, "key_tokens")));
    size_t i;
    json_t *e;
    if (json_array_size(json_object_get(wl, "entries")))
        printf("%-16s %7s %8s  %-24s %s\n", "key", "traffic", "requests", "served by worker",
               "pinned coverage by worker");
    json_array_foreach(json_object_get(wl, "entries"), i, e) {
        printf("%-16s %6.1f%% %8lld  ", json_string_value(json_object_get(e, "key")),
               100.0 * json_number_value(json_object_get(e, "traffic_share")),
               json_integer_value(json_object_get(e, "requests")));
        print_shares(json_object_get(e, "served"));
        printf("   ");
        print_shares(json_object_get(e, "coverage"));
        putchar('\n');
    }
    if (!json_is_object(c))
        return;
    if (json_is_true(json_object_get(c, "active")))
        printf("complementary hot sets over GPU workers");
    else
        printf("identical hot sets (%s)", json_string_value(json_object_get(c, "why")));
    if (json_is_number(json_object_get(c, "expected_hit_rate_identical")))
        printf("; expected hit rate of recent keyed traffic: %.1f%% identical, %.1f%% "
               "complementary with steering",
               100.0 * json_number_value(json_object_get(c, "expected_hit_rate_identical")),
               100.0 * json_number_value(json_object_get(c, "expected_hit_rate_complementary")));
    putchar('\n');
}

static int cmd_placement(int argc, char **argv)
{
    if (moectl_wants_help(argc, argv)) {
        printf("usage: moectl [--socket PATH] [--json] placement\n");
        return 0;
    }
    if (argc > 1) {
        fprintf(stderr, "usage: moectl [--socket PATH] [--json] placement\n");
        return 2;
    }
    json_t *o;
    int rc = client_get_json("/admin/placement", "placement", &o);
    if (rc || !o)
        return rc;
    char budget[32], used[32];
    printf("budget %s (%s), used %s, floor %lld per layer, profile %lld tokens\n\n",
           moe_fmt_size(budget, sizeof budget,
                        (uint64_t)json_number_value(json_object_get(o, "budget_bytes"))),
           json_string_value(json_object_get(o, "budget_source")),
           moe_fmt_size(used, sizeof used,
                        (uint64_t)json_number_value(json_object_get(o, "bytes_used"))),
           json_integer_value(json_object_get(o, "floor")),
           json_integer_value(json_object_get(o, "profile_tokens")));
    json_t *dr = json_object_get(o, "drift");
    if (json_is_object(dr)) {
        printf("drift check: %lld checks of %lld-token windows",
               json_integer_value(json_object_get(dr, "checks")),
               json_integer_value(json_object_get(dr, "window_tokens")));
        if (json_is_number(json_object_get(dr, "heldout_hit_rate_profile")))
            printf("; held-out hit rate %.1f%% by the profile, %.1f%% by recent traffic",
                   100.0 * json_number_value(json_object_get(dr, "heldout_hit_rate_profile")),
                   100.0 * json_number_value(json_object_get(dr, "heldout_hit_rate_recent")));
        printf("%s\n\n", json_is_true(json_object_get(dr, "drifting"))
                              ? "; drifting: placing by recent traffic"
                              : "");
    }
    printf("%-6s %-6s %-9s %s\n", "layer", "hot", "hit rate", "hot experts");
    size_t i;
    json_t *l;
    json_array_foreach(json_object_get(o, "layers"), i, l) {
        printf("%-6lld %-6lld %7.1f%%  ", json_integer_value(json_object_get(l, "layer")),
               json_integer_value(json_object_get(l, "n_hot")),
               100.0 * json_number_value(json_object_get(l, "hit_rate")));
        size_t k;
        json_t *e;
        json_array_foreach(json_object_get(l, "hot"), k, e)
            printf("%s%lld", k ? "," : "", json_integer_value(e));
        putchar('\n');
    }
    /* What the GPU workers hold now. */
    json_array_foreach(json_object_get(o, "workers"), i, l) {
        if (!json_is_true(json_object_get(l, "offload")))
            continue;
        const double hits = (double)json_integer_value(json_object_get(l, "expert_hits")),
                     misses = (double)json_integer_value(json_object_get(l, "expert_misses"));
        char vram[32], all[32], fill[32], pf[32];
        printf("\nworker %lld (%s): experts %s of %s in VRAM, %lld pinned, hit rate %.1f%% (%.0f "
               "hits, %.0f misses), %s copied from host, %lld read from host, %lld prefetched (%s)\n",
               json_integer_value(json_object_get(l, "worker")),
               json_string_value(json_object_get(l, "device")),
               moe_fmt_size(vram, sizeof vram,
                            (uint64_t)json_integer_value(json_object_get(l, "expert_vram_bytes"))),
               moe_fmt_size(all, sizeof all,
                            (uint64_t)json_integer_value(json_object_get(l, "expert_bytes"))),
               json_integer_value(json_object_get(l, "hot_experts")),
               hits + misses > 0 ? 100.0 * hits / (hits + misses) : 0.0, hits, misses,
               moe_fmt_size(fill, sizeof fill,
                            (uint64_t)json_integer_value(json_object_get(l, "fill_bytes"))),
               json_integer_value(json_object_get(l, "direct")),
               json_integer_value(json_object_get(l, "prefetched")),
               moe_fmt_size(pf, sizeof pf,
                            (uint64_t)json_integer_value(json_object_get(l, "prefetch_bytes"))));
        printf("%-6s %-6s %-6s %-10s %s\n", "layer", "slots", "hot", "residency", "hit rate");
        size_t k;
        json_t *ly;
        json_array_foreach(json_object_get(l, "layers"), k, ly) {
            json_t *hr = json_object_get(ly, "hit_rate");
            printf("%-6lld %-6lld %-6lld %8.1f%%  ", json_integer_value(json_object_get(ly, "layer")),
                   json_integer_value(json_object_get(ly, "slots")),
                   json_integer_value(json_object_get(ly, "hot")),
                   100.0 * json_number_value(json_object_get(ly, "residency")));
            if (json_is_number(hr))
                printf("%7.1f%%\n", 100.0 * json_number_value(hr));
            else
                printf("%8s\n", "-");
        }
    }
    print_workloads(o);
    json_decref(o);
    return 0;
}

MOECTL_COMMAND(placement, "hot experts per layer under the VRAM budget", cmd_placement)
