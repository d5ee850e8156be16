/* moectl placement: which experts the current profile makes hot, per layer, and what each GPU
 * worker holds: slots, pinned slots, residency and hit rate per layer. */
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "cli/client.h"
#include "cli/moectl.h"
#include "store/units.h"

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
        printf("\nworker %lld (%s): experts %s of %s in VRAM, hit rate %.1f%% (%.0f hits, "
               "%.0f misses), %s copied from host, %lld read from host, %lld prefetched (%s)\n",
               json_integer_value(json_object_get(l, "worker")),
               json_string_value(json_object_get(l, "device")),
               moe_fmt_size(vram, sizeof vram,
                            (uint64_t)json_integer_value(json_object_get(l, "expert_vram_bytes"))),
               moe_fmt_size(all, sizeof all,
                            (uint64_t)json_integer_value(json_object_get(l, "expert_bytes"))),
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
    json_decref(o);
    return 0;
}

MOECTL_COMMAND(placement, "hot experts per layer under the VRAM budget", cmd_placement)
