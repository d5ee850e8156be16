/* Complementary hot sets over several GPU workers (see daemon/workloads.h). */
#include "daemon/workloads.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/sched.h"
#include "store/buf.h"
#include "store/placement.h"

void moed_wl_free(struct moed_wl *st)
{
    moe_wl_plan_free(&st->plan);
    st->sent = false;
}

static uint32_t popcount_bits(const uint8_t *b, size_t nbits)
{
    uint32_t n = 0;
    for (size_t i = 0; i < nbits; i++)
        n += (b[i / 8] >> (i % 8)) & 1;
    return n;
}

/* Worker i's placement from its own counts: the hot set store/placement.c picks for its expert
 * VRAM. Returns 0 or an error (logged). */
static int send_own(struct moed_workers *ws, uint32_t i, const struct moe_model *m,
                    const uint64_t *counts, uint64_t vram)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert;
    const size_t nbytes = ((size_t)L * E + 7) / 8;
    uint64_t *eb = calloc(L, sizeof *eb);
    uint8_t *bits = calloc(nbytes, 1);
    struct moe_placement pl;
    char err[256];
    int rc = eb && bits ? 0 : -ENOMEM;
    for (uint32_t l = 0; !rc && l < L; l++)
        eb[l] = moe_model_expert_bytes(m, l);
    if (!rc && (rc = moe_placement_compute(&pl, L, E, m->hp.n_expert_used, eb, counts, vram, err,
                                           sizeof err)) != 0)
        log_warn("placement of worker %u: %s", i, err);
    if (!rc) {
        for (size_t x = 0; x < (size_t)L * E; x++)
            if (pl.hot[x])
                bits[x / 8] |= (uint8_t)(1u << (x % 8));
        moe_placement_free(&pl);
        rc = moed_workers_set_placement_one(ws, i, bits, nbytes, counts);
    }
    free(eb);
    free(bits);
    return rc;
}

bool moed_wl_place(struct moed_wl *st, struct moed_workers *ws, uint32_t n_workers,
                   const struct moe_model *m, const uint64_t *by)
{
    struct sched *s = moed_workers_sched(ws);
    struct moe_wl_table *t = sched_workloads(s);
    const bool was = st->sent;
    moed_wl_free(st);
    if (!t)
        return false;
    /* The GPU workers that offload and have said which experts they pin. */
    const uint8_t *hot[MOE_WL_MAX_WORKERS];
    uint64_t vram[MOE_WL_MAX_WORKERS];
    uint32_t W = 0;
    for (uint32_t i = 0; i < n_workers && W < MOE_WL_MAX_WORKERS; i++) {
        struct moed_worker_offload wo;
        const uint8_t *h = sched_worker_hot_bits(s, i);
        if (!h || moed_workers_offload(ws, i, &wo) || !wo.active)
            continue;
        st->ids[W] = i;
        vram[W] = wo.expert_vram_bytes;
        hot[W++] = h;
    }
    if (!W)
        return false;
    if (moe_wl_plan(&st->plan, t, W, st->ids, hot, by)) {
        moe_wl_plan_free(&st->plan);
        return false;
    }
    if (st->plan.active) {
        st->sent = true;
        for (uint32_t w = 0; w < W; w++)
            if (send_own(ws, st->ids[w], m, st->plan.counts[w], vram[w]))
                st->sent = false;
    }
    if (st->sent != was) {
        if (st->sent)
            log_info("placement: complementary hot sets over %u GPU workers for %u workloads "
                     "(expected hit rate %.1f%%, %.1f%% with identical sets)", W, st->plan.n_keys,
                     100 * st->plan.hit_complementary, 100 * st->plan.hit_identical);
        else
            log_info("placement: identical hot sets on every GPU worker again (%s)",
                     st->plan.active ? "a worker's placement could not be sent" : st->plan.why);
    }
    return st->sent;
}

static json_t *key_json(uint64_t key)
{
    char hex[20];
    snprintf(hex, sizeof hex, "%016" PRIx64, key);
    return json_string(hex);
}

json_t *moed_wl_json(const struct moed_wl *st, struct moed_workers *ws, uint32_t n_workers)
{
    struct sched *s = moed_workers_sched(ws);
    struct moe_wl_table *t = sched_workloads(s);
    json_t *o = json_object();
    json_t *wl = json_object();
    if (t) {
        const double total = moe_wl_traffic(t);
        json_object_set_new(wl, "capacity", json_integer(t->cap));
        json_object_set_new(wl, "keys", json_integer(t->n));
        json_object_set_new(wl, "requests", json_integer((json_int_t)t->requests));
        json_object_set_new(wl, "evictions", json_integer((json_int_t)t->evictions));
        json_object_set_new(wl, "key_tokens", json_integer(MOE_WL_KEY_TOKENS));
        json_t *ents = json_array();
        for (uint32_t k = 0; k < t->n; k++) {
            const struct moe_wl_entry *e = &t->e[k];
            json_t *je = json_object();
            json_object_set_new(je, "key", key_json(e->key));
            json_object_set_new(je, "traffic_share", json_real(total > 0 ? e->traffic / total : 0));
            json_object_set_new(je, "requests", json_integer((json_int_t)e->requests));
            json_object_set_new(je, "prompt_tokens", json_integer((json_int_t)e->tokens));
            json_t *sv = json_array(), *cv = json_array();
            for (uint32_t i = 0; i < n_workers && i < t->n_workers; i++) {
                json_array_append_new(sv, json_real(e->traffic > 0 ? e->served[i] / e->traffic : 0));
                const uint8_t *h = sched_worker_hot_bits(s, i);
                const double c = h ? moe_wl_coverage(t, e, h) : -1.0;
                json_array_append_new(cv, c >= 0 ? json_real(c) : json_null());
            }
            json_object_set_new(je, "served", sv);
            json_object_set_new(je, "coverage", cv);
            json_array_append_new(ents, je);
        }
        json_object_set_new(wl, "entries", ents);
    }
    json_object_set_new(o, "workloads", wl);
    json_t *c = json_object();
    const struct moe_wl_plan *p = &st->plan;
    json_object_set_new(c, "active", json_boolean(st->sent));
    if (!p->n_workers) {
        json_object_set_new(c, "why", json_string(t ? "no GPU worker offloads and reports its pinned "
                                                      "experts"
                                                    : "no workload table"));
    } else {
        if (!p->active)
            json_object_set_new(c, "why", json_string(p->why));
        json_t *ids = json_array(), *load = json_array();
        for (uint32_t w = 0; w < p->n_workers; w++) {
            json_array_append_new(ids, json_integer(st->ids[w]));
            json_array_append_new(load, json_real(p->load[w]));
        }
        json_object_set_new(c, "gpu_workers", ids);
        json_object_set_new(c, "load", load);
        if (p->n_keys) {
            json_object_set_new(c, "expected_hit_rate_identical", json_real(p->hit_identical));
            json_object_set_new(c, "expected_hit_rate_complementary",
                                json_real(p->hit_complementary));
        }
        json_t *keys = json_array();
        for (uint32_t k = 0; p->active && k < p->n_keys; k++) {
            json_t *jk = json_object(), *to = json_array();
            json_object_set_new(jk, "key", key_json(p->key[k]));
            json_object_set_new(jk, "share", json_real(p->key_share[k]));
            for (uint32_t w = 0; w < p->n_workers; w++)
                json_array_append_new(to, json_real(p->assign[(size_t)k * p->n_workers + w]));
            json_object_set_new(jk, "to_workers", to);
            json_array_append_new(keys, jk);
        }
        json_object_set_new(c, "keys", keys);
    }
    json_object_set_new(o, "complementary", c);
    return o;
}

int64_t moed_wl_hot_experts(struct moed_workers *ws, uint32_t i)
{
    struct sched *s = moed_workers_sched(ws);
    const struct moe_wl_table *t = sched_workloads(s);
    const uint8_t *h = sched_worker_hot_bits(s, i);
    return h && t ? (int64_t)popcount_bits(h, (size_t)t->n_layer * t->n_expert) : -1;
}

int moed_wl_metrics(const struct moed_wl *st, struct moed_workers *ws, uint32_t n_workers,
                    char **b, size_t *n, size_t *cap)
{
    struct sched *s = moed_workers_sched(ws);
    struct moe_wl_table *t = sched_workloads(s);
    int rc = 0;
    if (!t)
        return 0;
    bool header = false;
    for (uint32_t i = 0; i < n_workers; i++) {
        const int64_t h = moed_wl_hot_experts(ws, i);
        if (h >= 0 && !header) {
            rc |= moe_buf_printf(b, n, cap, "# HELP moed_worker_hot_experts Experts the GPU worker "
                                 "pins in VRAM (every expert of a layer held whole).\n"
                                 "# TYPE moed_worker_hot_experts gauge\n");
            header = true;
        }
        if (h >= 0)
            rc |= moe_buf_printf(b, n, cap, "moed_worker_hot_experts{worker=\"%u\"} %" PRId64 "\n",
                                 i, h);
    }
    rc |= moe_buf_printf(b, n, cap,
                         "# HELP moed_workload_keys Workload keys the routing table holds.\n"
                         "# TYPE moed_workload_keys gauge\nmoed_workload_keys %u\n"
                         "# HELP moed_workload_requests_total Finished requests whose routing "
                         "signature the table learned.\n"
                         "# TYPE moed_workload_requests_total counter\n"
                         "moed_workload_requests_total %" PRIu64 "\n"
                         "# HELP moed_placement_complementary 1 while GPU workers hold "
                         "complementary hot sets.\n# TYPE moed_placement_complementary gauge\n"
                         "moed_placement_complementary %d\n",
                         t->n, t->requests, st->sent ? 1 : 0);
    if (st->plan.n_workers && st->plan.n_keys)
        rc |= moe_buf_printf(b, n, cap,
                             "# HELP moed_placement_expected_hit_rate Share of recent keyed "
                             "traffic's routings the GPU workers' pinned experts serve: identical "
                             "sets with requests spread evenly, or complementary sets with each "
                             "workload sent to its worker.\n"
                             "# TYPE moed_placement_expected_hit_rate gauge\n"
                             "moed_placement_expected_hit_rate{placement=\"identical\"} %.6f\n"
                             "moed_placement_expected_hit_rate{placement=\"complementary\"} %.6f\n",
                             st->plan.hit_identical, st->plan.hit_complementary);
    return rc ? -ENOMEM : 0;
}
