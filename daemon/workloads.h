/* Complementary hot sets over several GPU workers, as the daemon runs them: the plan of
 * store/workload.h made from the scheduler's workload table and the pinned experts each GPU
 * worker reports, each worker's own placement sent to it, and what /admin/placement and
 * /metrics show of it. Everything runs on the daemon's loop. */
#ifndef MOED_WORKLOADS_H
#define MOED_WORKLOADS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "daemon/supervisor.h"
#include "store/model.h"
#include "store/workload.h"

struct moed_wl {
    struct moe_wl_plan plan;    /* the last plan (plan.n_workers 0: none made) */
    uint32_t ids[MOE_WL_MAX_WORKERS]; /* the plan's workers' indexes */
    bool sent;                  /* the workers hold the plan's own placements */
};

/* Plans with the GPU workers that offload and report their pinned experts, the scheduler's
 * table and the global counts `by` ([n_layer][n_expert]); when the plan is active, sends each
 * of those workers its own placement (its counts, and the hot set store/placement.c picks from
 * them for its expert VRAM) and returns true: the caller sends no common placement then. A
 * change between complementary and identical sets is logged. */
bool moed_wl_place(struct moed_wl *st, struct moed_workers *ws, uint32_t n_workers,
                   const struct moe_model *m, const uint64_t *by);

/* For /admin/placement: {"workloads": the table, "complementary": the last plan}. */
json_t *moed_wl_json(const struct moed_wl *st, struct moed_workers *ws, uint32_t n_workers);

/* How many experts worker i pins (every expert of a layer held whole), or -1 when it has not
 * said (a CPU worker, a GPU worker without offload). */
int64_t moed_wl_hot_experts(struct moed_workers *ws, uint32_t i);

/* The same for /metrics, appended to *b (moe_buf_printf). Returns 0 or -ENOMEM. */
int moed_wl_metrics(const struct moed_wl *st, struct moed_workers *ws, uint32_t n_workers,
                    char **b, size_t *n, size_t *cap);

void moed_wl_free(struct moed_wl *st);

#endif
