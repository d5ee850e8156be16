/* moectl inspect MODEL [--vram-budget SIZE | --expert-residency P] [--ctx N]
 *
 * Describes a GGUF model offline: architecture, hyperparameters, tensors by type, dense vs
 * expert bytes, bytes per expert in each layer, and what a VRAM budget leaves for expert slots:
 *
 *   experts_available = budget - dense weights - KV cache - reserve
 *   KV cache          = n_layer * 2 (K and V) * n_head_kv * head_dim * ctx * 2 bytes (f16)
 *   reserve           = 512 MiB for the CUDA context, cuBLAS workspace and activations
 *   slots_per_layer   = min(n_expert, experts_available / sum over layers of one slot's bytes)
 *   slot              = the layer's largest gate, up and down, each 256-byte aligned (the CUDA
 *                       worker's layout, moe_model_expert_slot)
 *
 * Every layer gets the same number of slots (the placement's uniform split before a profile
 * exists); slot sizes differ per layer because quant mixes do. When experts stay out of VRAM,
 * the two prompt staging buffers come out of the same room, as the CUDA worker sizes them
 * (moe_off_budget_split, worker/cuda/offload_resolve.h). */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/moectl.h"
#include "store/err.h"
#include "store/expert_store.h"
#include "store/ggml_type.h"
#include "store/gguf.h"
#include "store/model.h"
#include "store/units.h"
#include "worker/cuda/offload_resolve.h"

#define INSPECT_RESERVE ((uint64_t)512 << 20)
#define INSPECT_DEFAULT_CTX 4096

static const char *human(uint64_t b, char *buf, size_t n)
{
    if (b >= (1ull << 30))
        snprintf(buf, n, "%.2f GiB", (double)b / (double)(1ull << 30));
    else if (b >= (1ull << 20))
        snprintf(buf, n, "%.2f MiB", (double)b / (double)(1ull << 20));
    else if (b >= (1ull << 10))
        snprintf(buf, n, "%.2f KiB", (double)b / 1024.0);
    else
        snprintf(buf, n, "%" PRIu64 " B", b);
    return buf;
}

static const char *tname(uint32_t t)
{
    const struct moe_type_info *ti = moe_type_get(t);
    return ti ? ti->name : "?";
}

struct vram_plan {
    uint64_t budget, ctx, kv, reserve, per_slot_all_layers;
    int64_t available;      /* may be negative: the budget does not even hold the dense part */
    uint32_t slots;         /* per layer */
    double residency;       /* resident expert bytes / all expert bytes */
    uint64_t max_slot;      /* the largest slot of any layer */
    uint32_t stage;         /* experts a prompt staging buffer holds (two buffers) */
};

/* --ram-budget: the tiered store's pool (docs/store.md). slots = 0: every expert fits. */
struct ram_plan {
    const char *budget;
    uint64_t slots, slot_bytes, experts, min_slots;
};

static void plan_vram(const struct moe_model *m, uint64_t budget, uint64_t ctx, struct vram_plan *p)
{
    const struct moe_hparams *hp = &m->hp;
    p->budget = budget;
    p->ctx = ctx;
    p->kv = (uint64_t)hp->n_layer * 2 * hp->n_head_kv * hp->head_dim * ctx * 2;
    p->reserve = INSPECT_RESERVE;
    p->per_slot_all_layers = 0;
    p->max_slot = 0;
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const uint64_t sb = moe_model_expert_slot(m, l, NULL);
        p->per_slot_all_layers += sb;
        p->max_slot = sb > p->max_slot ? sb : p->max_slot;
    }
    uint64_t fixed = m->bytes_dense + p->kv + p->reserve;
    p->available = budget >= fixed ? (int64_t)(budget - fixed) : -(int64_t)(fixed - budget);
    int64_t S = 0, P = 0;
    if (p->available > 0)
        moe_off_budget_split(hp->n_expert, hp->n_expert_used, (uint64_t)p->available,
                             p->per_slot_all_layers, p->max_slot, -1, &S, &P);
    p->slots = (uint32_t)S;
    p->stage = (uint32_t)P;
    p->residency = (double)p->slots / (double)hp->n_expert;
}

struct type_count {
    uint64_t count, bytes;
};

static int print_json(const char *path, const struct gguf_file *f, const struct moe_model *m,
                      const struct type_count *tc, const struct vram_plan *vp,
                      const struct ram_plan *rp)
{
    const struct moe_hparams *hp = &m->hp;
    json_t *o = json_object();
    char fp[32];
    snprintf(fp, sizeof fp, "%016" PRIx64, m->fingerprint);
    json_object_set_new(o, "file", json_string(path));
    json_object_set_new(o, "gguf_version", json_integer(f->version));
    json_object_set_new(o, "fingerprint", json_string(fp));
    json_object_set_new(o, "architecture", json_string(m->arch_name));
    struct gguf_str name;
    if (gguf_get_str(f, "general.name", &name, NULL, 0) == 0)
        json_object_set_new(o, "name", json_stringn(name.p, name.len));
    json_t *h = json_object();
    json_object_set_new(h, "n_layer", json_integer(hp->n_layer));
    json_object_set_new(h, "n_ctx_train", json_integer(hp->n_ctx_train));
    json_object_set_new(h, "n_embd", json_integer(hp->n_embd));
    json_object_set_new(h, "n_head", json_integer(hp->n_head));
    json_object_set_new(h, "n_head_kv", json_integer(hp->n_head_kv));
    json_object_set_new(h, "head_dim", json_integer(hp->head_dim));
    json_object_set_new(h, "n_expert", json_integer(hp->n_expert));
    json_object_set_new(h, "n_expert_used", json_integer(hp->n_expert_used));
    json_object_set_new(h, "expert_ff", json_integer(hp->expert_ff));
    json_object_set_new(h, "n_ff", json_integer(hp->n_ff));
    json_object_set_new(h, "n_vocab", json_integer(hp->n_vocab));
    json_object_set_new(h, "rms_eps", json_real(hp->rms_eps));
    json_object_set_new(h, "rope_base", json_real(hp->rope_base));
    json_object_set_new(h, "norm_topk", json_boolean(hp->norm_topk));
    json_object_set_new(o, "hparams", h);
    json_object_set_new(o, "n_tensors", json_integer((json_int_t)f->n_tensors));
    json_t *types = json_object();
    for (uint32_t t = 0; t < MOE_TYPE_COUNT; t++) {
        if (!tc[t].count)
            continue;
        json_t *e = json_object();
        json_object_set_new(e, "count", json_integer((json_int_t)tc[t].count));
        json_object_set_new(e, "bytes", json_integer((json_int_t)tc[t].bytes));
        json_object_set_new(types, tname(t), e);
    }
    json_object_set_new(o, "tensor_types", types);
    json_object_set_new(o, "bytes_dense", json_integer((json_int_t)m->bytes_dense));
    json_object_set_new(o, "bytes_experts", json_integer((json_int_t)m->bytes_experts));
    json_t *layers = json_array();
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct moe_expert *x = &m->layers[l].experts[0];
        json_t *e = json_object();
        json_object_set_new(e, "expert_bytes", json_integer((json_int_t)moe_model_expert_bytes(m, l)));
        json_object_set_new(e, "gate", json_string(tname(x->gate.type)));
        json_object_set_new(e, "up", json_string(tname(x->up.type)));
        json_object_set_new(e, "down", json_string(tname(x->down.type)));
        json_array_append_new(layers, e);
    }
    json_object_set_new(o, "layers", layers);
    if (vp) {
        json_t *v = json_object();
        json_object_set_new(v, "budget", json_integer((json_int_t)vp->budget));
        json_object_set_new(v, "ctx", json_integer((json_int_t)vp->ctx));
        json_object_set_new(v, "dense", json_integer((json_int_t)m->bytes_dense));
        json_object_set_new(v, "kv_cache", json_integer((json_int_t)vp->kv));
        json_object_set_new(v, "reserve", json_integer((json_int_t)vp->reserve));
        json_object_set_new(v, "experts_available", json_integer((json_int_t)vp->available));
        json_object_set_new(v, "slot_bytes_all_layers", json_integer((json_int_t)vp->per_slot_all_layers));
        json_object_set_new(v, "slots_per_layer", json_integer(vp->slots));
        json_object_set_new(v, "residency", json_real(vp->residency));
        json_object_set_new(v, "stage_experts", json_integer(vp->stage));
        json_object_set_new(v, "stage_bytes", json_integer((json_int_t)(2 * vp->stage * vp->max_slot)));
        json_object_set_new(o, "vram", v);
    }
    if (rp) {
        json_t *r = json_object();
        json_object_set_new(r, "budget", json_string(rp->budget));
        json_object_set_new(r, "all_experts_fit", json_boolean(rp->slots == 0));
        json_object_set_new(r, "slots", json_integer((json_int_t)(rp->slots ? rp->slots : rp->experts)));
        json_object_set_new(r, "slot_bytes", json_integer((json_int_t)rp->slot_bytes));
        json_object_set_new(r, "experts", json_integer((json_int_t)rp->experts));
        json_object_set_new(r, "min_slots", json_integer((json_int_t)rp->min_slots));
        json_object_set_new(r, "gpu_worker_slots", json_integer((json_int_t)m->hp.n_expert));
        json_object_set_new(o, "ram", r);
    }
    int rc = json_dumpf(o, stdout, JSON_INDENT(2)) == 0 ? 0 : 1;
    fputc('\n', stdout);
    json_decref(o);
    return rc;
}

static void print_ram(const struct moe_model *m, const struct ram_plan *rp)
{
    char a[32], b[32];
    printf("\nRAM budget %s for the experts:\n", rp->budget);
    if (!rp->slots) {
        printf("  every expert fits: the full store (%s)\n", human(m->bytes_experts, a, sizeof a));
        return;
    }
    printf("  pool              %" PRIu64 " of %" PRIu64 " experts in slots of %s (%s)\n", rp->slots,
           rp->experts, human(rp->slot_bytes, a, sizeof a), human(rp->slots * rp->slot_bytes, b, sizeof b));
    printf("  minimum           %" PRIu64 " slots (layers x top-k)\n", rp->min_slots);
    printf("  GPU workers       %" PRIu32 " slots each (one layer's experts): %s\n", m->hp.n_expert,
           rp->slots >= m->hp.n_expert ? "this pool takes one" : "too few, CPU workers only");
    printf("  hit rate          %.1f%% if routing were even; the learned profile fills the hottest first\n",
           100.0 * (double)rp->slots / (double)rp->experts);
    printf("  RAM in the store  %s dense + %s pool\n", human(m->bytes_dense, a, sizeof a),
           human(rp->slots * rp->slot_bytes, b, sizeof b));
}

static void print_text(const char *path, const struct gguf_file *f, const struct moe_model *m,
                       const struct type_count *tc, const struct vram_plan *vp)
{
    const struct moe_hparams *hp = &m->hp;
    char a[32], b[32], c[32];
    struct gguf_str name;
    printf("file          %s (GGUF v%" PRIu32 ", %s)\n", path, f->version, human(f->size, a, sizeof a));
    if (gguf_get_str(f, "general.name", &name, NULL, 0) == 0)
        printf("name          %.*s\n", (int)(name.len > 200 ? 200 : name.len), name.p);
    printf("architecture  %s\n", m->arch_name);
    printf("fingerprint   %016" PRIx64 "\n\n", m->fingerprint);
    printf("layers %" PRIu32 ", n_embd %" PRIu32 ", heads %" PRIu32 " (kv %" PRIu32 "), head_dim %"
           PRIu32 ", vocab %" PRIu32 ", ctx_train %" PRIu32 "\n",
           hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv, hp->head_dim, hp->n_vocab,
           hp->n_ctx_train);
    printf("experts %" PRIu32 ", used %" PRIu32 ", expert_ff %" PRIu32 ", rope_base %g, rms_eps %g%s\n\n",
           hp->n_expert, hp->n_expert_used, hp->expert_ff, (double)hp->rope_base,
           (double)hp->rms_eps, hp->norm_topk ? ", top-k renormalised" : "");
    printf("tensors %" PRIu64 ":\n", f->n_tensors);
    for (uint32_t t = 0; t < MOE_TYPE_COUNT; t++)
        if (tc[t].count)
            printf("  %-8s %5" PRIu64 "  %s\n", tname(t), tc[t].count, human(tc[t].bytes, a, sizeof a));
    printf("\nbytes dense   %s\nbytes experts %s\n\n", human(m->bytes_dense, a, sizeof a),
           human(m->bytes_experts, b, sizeof b));
    printf("layer  bytes/expert  gate/up/down\n");
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct moe_expert *x = &m->layers[l].experts[0];
        printf("%5" PRIu32 "  %12s  %s/%s/%s\n", l, human(moe_model_expert_bytes(m, l), a, sizeof a),
               tname(x->gate.type), tname(x->up.type), tname(x->down.type));
    }
    if (!vp)
        return;
    printf("\nVRAM budget %s at ctx %" PRIu64 ":\n", human(vp->budget, a, sizeof a), vp->ctx);
    printf("  dense weights     %s\n", human(m->bytes_dense, a, sizeof a));
    printf("  KV cache (f16)    %s\n", human(vp->kv, a, sizeof a));
    printf("  reserve           %s (CUDA context, workspace, activations)\n",
           human(vp->reserve, a, sizeof a));
    if (vp->available <= 0) {
        printf("  left for experts  none: the budget is %s short of dense + KV + reserve\n",
               human((uint64_t)-vp->available, a, sizeof a));
        return;
    }
    printf("  left for experts  %s\n", human((uint64_t)vp->available, a, sizeof a));
    printf("  slots per layer   %" PRIu32 " of %" PRIu32 " (one slot in every layer: %s)\n",
           vp->slots, hp->n_expert, human(vp->per_slot_all_layers, c, sizeof c));
    printf("  residency         %.1f%%%s\n", 100.0 * vp->residency,
           vp->slots == hp->n_expert ? " (all experts fit)" : "");
    if (vp->stage)
        printf("  prompt staging    2 x %" PRIu32 " experts (%s)\n", vp->stage,
               human(2 * vp->stage * vp->max_slot, a, sizeof a));
}

static void usage(FILE *fp)
{
    fprintf(fp, "usage: moectl [--json] inspect MODEL [--vram-budget SIZE | --expert-residency P] [--ctx N]\n"
                "                       [--ram-budget SIZE|P%%|auto]\n"
                "  SIZE: bytes, or with K/M/G/T (binary; KiB/GiB/GB also accepted), e.g. 24G\n"
                "  P: the share of each layer's experts to keep in VRAM, e.g. 60%%: shows the budget it needs\n"
                "  --ram-budget: the pool moed --ram-budget would keep (docs/store.md)\n");
}

static int cmd_inspect(int argc, char **argv)
{
    const char *path = NULL;
    uint64_t budget = 0, ctx = INSPECT_DEFAULT_CTX;
    bool have_budget = false;
    double residency = 0;
    const char *ram = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ram-budget") && i + 1 < argc) {
            ram = argv[++i];
            continue;
        }
        if (!strcmp(argv[i], "--vram-budget") && i + 1 < argc) {
            if (moe_parse_size(argv[++i], &budget) != 0) {
                fprintf(stderr, "moectl inspect: bad size '%s'\n", argv[i]);
                usage(stderr);
                return 2;
            }
            have_budget = true;
        } else if (!strcmp(argv[i], "--expert-residency") && i + 1 < argc) {
            if (moe_parse_share(argv[++i], &residency) != 0) {
                fprintf(stderr, "moectl inspect: bad share '%s' (60%% or 0.6)\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) {
            char *end;
            errno = 0;
            unsigned long long v = strtoull(argv[++i], &end, 10);
            if (errno || *end || end == argv[i] || v == 0 || v > (1ull << 24) || argv[i][0] == '-') {
                fprintf(stderr, "moectl inspect: bad context length '%s'\n", argv[i]);
                return 2;
            }
            ctx = v;
        } else if (!strcmp(argv[i], "--json")) {
            moectl_opts.json = true;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (argv[i][0] == '-' || path) {
            fprintf(stderr, "moectl inspect: unexpected argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        } else {
            path = argv[i];
        }
    }
    if (!path) {
        usage(stderr);
        return 2;
    }
    char err[512];
    struct gguf_file *f = NULL;
    struct moe_model m;
    int rc = gguf_open(&f, path, err, sizeof err);
    if (rc) {
        fprintf(stderr, "moectl inspect: %s\n", err);
        return 1;
    }
    rc = moe_model_from_gguf(&m, f, err, sizeof err);
    if (rc) {
        fprintf(stderr, "moectl inspect: %s: %s\n", path, err);
        gguf_close(f);
        return 1;
    }
    struct type_count tc[MOE_TYPE_COUNT] = {{0}};
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        tc[f->tensors[i].type].count++;
        tc[f->tensors[i].type].bytes += f->tensors[i].nbytes;
    }
    if (have_budget && residency > 0) {
        fprintf(stderr, "moectl inspect: give --vram-budget or --expert-residency, not both\n");
        moe_model_free(&m);
        gguf_close(f);
        return 2;
    }
    struct vram_plan vp;
    uint64_t S = 0, P = 0; /* with --expert-residency: the share's slots and staging */
    if (residency > 0) {
        /* The budget that holds this share: S slots in every layer (at least one token's) and
         * the staging the worker sizes for them. */
        const struct moe_hparams *hp = &m.hp;
        S = (uint64_t)(residency * hp->n_expert + 0.5);
        S = S < hp->n_expert_used ? hp->n_expert_used : S > hp->n_expert ? hp->n_expert : S;
        plan_vram(&m, 0, ctx, &vp);
        P = (uint64_t)moe_off_stage_auto(hp->n_expert, (int64_t)S, vp.per_slot_all_layers,
                                         vp.max_slot);
        budget = m.bytes_dense + vp.kv + vp.reserve + S * vp.per_slot_all_layers +
                 2 * P * vp.max_slot;
        have_budget = true;
    }
    if (have_budget)
        plan_vram(&m, budget, ctx, &vp);
    if (residency > 0) {
        /* The worker keeps the share's slots (plan_vram's split of the budget may differ). */
        vp.slots = (uint32_t)S;
        vp.stage = (uint32_t)P;
        vp.residency = (double)S / (double)m.hp.n_expert;
    }
    struct ram_plan rp = {.budget = ram, .slot_bytes = moe_store_slot_bytes(&m),
                          .experts = (uint64_t)m.hp.n_layer * m.hp.n_expert,
                          .min_slots = (uint64_t)m.hp.n_layer * m.hp.n_expert_used};
    if (ram && (rc = moe_store_budget_slots(&m, ram, 1, &rp.slots, err, sizeof err))) {
        fprintf(stderr, "moectl inspect: %s\n", err);
        moe_model_free(&m);
        gguf_close(f);
        return 2;
    }
    if (ram && rp.slots && have_budget && vp.available > 0 && m.hp.n_expert > m.hp.n_expert_used) {
        /* A GPU worker over a pool keeps at least one expert of every layer out of VRAM and
         * stages no prompts (docs/offload.md, "A tiered store"). */
        if (vp.slots >= m.hp.n_expert)
            vp.slots = m.hp.n_expert - 1;
        vp.stage = 0;
        vp.residency = (double)vp.slots / (double)m.hp.n_expert;
    }
    int ret = 0;
    if (moectl_opts.json)
        ret = print_json(path, f, &m, tc, have_budget ? &vp : NULL, ram ? &rp : NULL);
    else
        print_text(path, f, &m, tc, have_budget ? &vp : NULL);
    if (ram && !moectl_opts.json)
        print_ram(&m, &rp);
    moe_model_free(&m);
    gguf_close(f);
    return ret;
}

MOECTL_COMMAND(inspect, "MODEL [--vram-budget SIZE] [--ram-budget B] [--ctx N]  describe a GGUF model", cmd_inspect)
