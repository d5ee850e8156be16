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

#include <stdbool.h>
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

/* The held-out check of a placement against recent routing. Per layer with fewer slots[l] than
 * n_expert, the slots[l] experts `profile` ranks highest ("current") and the slots[l] that
 * `older` ranks highest ("fresh") are scored on `newer`, traffic neither ranking saw: the share
 * of newer's routings they would serve. *current and *fresh: those shares over every such layer
 * (weighted by routings); both 1 when no layer offloads or newer is empty. Rankings by count,
 * ties by lower id. Returns 0 or -ENOMEM. */
int moe_placement_heldout(uint32_t n_layer, uint32_t n_expert, const uint32_t *slots,
                          const uint64_t *profile, const uint64_t *older, const uint64_t *newer,
                          double *current, double *fresh);

/* Drift: routing counts are collected in windows of `window` tokens; each full window is
 * scored (moe_placement_heldout, the window before it as `older`) against the profile's
 * placement. When a placement from recent traffic would serve `margin` (a share, e.g. 0.05) more
 * of it, the placement drifts: it should follow the last two windows until the profile catches
 * up (the gap falls under margin / 4). The profile itself keeps its own decayed history. */
struct moe_drift {
    uint32_t n_layer, n_expert;
    uint64_t window;               /* tokens per window */
    double margin;
    uint64_t *win[2];              /* [2][n_layer][n_expert]: older, newer (filling) */
    uint64_t tokens[2];
    uint64_t *recent;              /* [n_layer][n_expert]: older + newer at the last check */
    bool drifting;
    double current, fresh;         /* the last check's shares (when checks > 0) */
    uint64_t checks, changes;
};
int moe_drift_init(struct moe_drift *d, uint32_t n_layer, uint32_t n_expert, uint64_t window,
                   double margin);
void moe_drift_free(struct moe_drift *d);
/* Adds a RoutingStats delta of n_tokens tokens. When that fills the newer window and an older
 * one exists, runs the check with slots[n_layer] (NULL: no check, the windows just turn).
 * Returns 1 when `drifting` changed (the caller re-places), else 0, or -ENOMEM. */
int moe_drift_add(struct moe_drift *d, const uint64_t *counts, uint64_t n_tokens,
                  const uint64_t *profile, const uint32_t *slots);
/* Counts to place by: the recent windows while drifting, else NULL (the profile). */
const uint64_t *moe_drift_counts(const struct moe_drift *d);

#endif
