/* moectl placement: which experts the current profile makes hot, per layer. */
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "cli/client.h"
#include "cli/moectl.h"

static int cmd_placement(int argc, char **argv)
{
    (void)argv;
    if (argc > 1) {
        fprintf(stderr, "usage: moectl [--socket PATH] [--json] placement\n");
        return 2;
    }
    json_t *o;
    int rc = client_get_json("/admin/placement", "placement", &o);
    if (rc || !o)
        return rc;
    printf("budget %.3f GiB (%s), used %.3f GiB, floor %lld per layer, profile %lld tokens\n\n",
           json_number_value(json_object_get(o, "budget_bytes")) / 1073741824.0,
           json_string_value(json_object_get(o, "budget_source")),
           json_number_value(json_object_get(o, "bytes_used")) / 1073741824.0,
           json_integer_value(json_object_get(o, "floor")),
           json_integer_value(json_object_get(o, "profile_tokens")));
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
    json_decref(o);
    return 0;
}

MOECTL_COMMAND(placement, "hot experts per layer under the VRAM budget", cmd_placement)
