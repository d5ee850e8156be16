/* Placement: which experts get hot (never evicted) device slots under a byte budget.
 *
 * Every token visits every layer and picks n_expert_used experts there, so an expert's value is
 * its share of its layer's routings; its cost is the layer's bytes per expert. The choice:
 *   1. floor: every layer gets the same number of its most-used experts, f = min(n_expert_used,
 *      n_expert, the largest count that fits the budget for all layers at once). With a budget
 *      too small for one expert in every layer, f = 0 and step 2 alone decides;
 *   2. greedy: the remaining budget goes, one expert at a time, to the candidate (the next most-used
 *      expert of some layer) with the highest share per byte; a layer whose next expert no longer
 *      fits drops out, smaller layers may still fill the rest. Ties go to the layer with fewer hot
 *      experts, then to the lower layer id.
 * Within a layer experts are taken by count, ties by lower id. With no profile (counts NULL), or
 * for a layer that has seen no routings, every expert of that layer counts the same; with no
 * profile at all the split is uniform in slots, not bytes: layers take turns (fewest hot first,
 * lower layer id on ties) and each takes its lowest free id. The result never uses more than the
 * budget. */
#ifndef MOE_PLACEMENT_H
#define MOE_PLACEMENT_H

#include <stddef.h>
#include <stdint.h>

struct moe_placement {
    uint32_t n_layer;
    uint32_t n_expert;
    uint8_t *hot;          /* [n_layer][n_expert]: 1 = hot */
    uint32_t *n_hot;       /* [n_layer] */
    double *hit_rate;      /* [n_layer]: expected share of routings served by hot experts */
    uint32_t floor;        /* slots every layer got in step 1 */
    uint64_t bytes_used;   /* <= budget */
};

/* Computes a placement. expert_bytes[n_layer]: bytes of one expert (gate+up+down, or the blob
 * size the device slot needs) per layer, each > 0. counts[n_layer][n_expert] or NULL. Returns 0,
 * MOE_ERANGE (zero dimensions or a zero expert size) or -ENOMEM; *out is set only on success. */
int moe_placement_compute(struct moe_placement *out, uint32_t n_layer, uint32_t n_expert,
                          uint32_t n_expert_used, const uint64_t *expert_bytes,
                          const uint64_t *counts, uint64_t budget, char *err, size_t errlen);

void moe_placement_free(struct moe_placement *p);

#endif
