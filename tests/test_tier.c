/* The tiered store below the daemon: the pooled store layout (slots hold the file's bytes), the
 * slot table's pin / claim protocol (no slot rewritten under a pin, threads racing), the fill
 * order, and the CPU engine computing from a tiny pool with an in-process stand-in for the
 * daemon: logits bit-identical to the full store. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/tier.h"
#include "store/err.h"
#include "store/expert_store.h"
#include "store/gguf.h"
#include "store/model.h"
#include "store/pool.h"
#include "tests/harness.h"
#include "worker/engine.h"
#include "worker/tier.h"

#define F16_PATH "tests/golden/models/tiny-qwen3moe-F16.gguf"
#define Q4KM_PATH "tests/golden/models/tiny-qwen3moe-Q4_K_M.gguf" /* expert types differ by layer */

struct opened {
    struct gguf_file *f;
    struct moe_model m;
};

static void open_model(struct opened *o, const char *path)
{
    char err[512];
    CHECK_MSG(gguf_open(&o->f, path, err, sizeof err) == 0, "%s: %s", path, err);
    CHECK_MSG(moe_model_from_gguf(&o->m, o->f, err, sizeof err) == 0, "%s: %s", path, err);
}

static void close_model(struct opened *o)
{
    moe_model_free(&o->m);
    gguf_close(o->f);
}

/* A pooled store of n_slots for n_workers, filled in the daemon's order. */
static struct moe_store *pooled(struct opened *o, uint32_t n_slots, uint32_t n_workers)
{
    char err[512];
    uint32_t *fill = calloc(n_slots, sizeof *fill);
    uint32_t n = moed_tier_fill_order(NULL, o->m.hp.n_layer, o->m.hp.n_expert, n_slots, fill);
    CHECK_EQ(n, n_slots);
    struct moe_store *s = NULL;
    int rc = moe_store_create_pool(&s, &o->m, 2, n_slots, n_workers, fill, n, NULL, NULL, err,
                                   sizeof err);
    CHECK_MSG(rc == 0, "create_pool: %s", err);
    free(fill);
    return s;
}

/* Does slot s hold exactly the GGUF bytes of blob b? */
static bool slot_matches(struct moe_store *s, const struct opened *o, int32_t slot, uint32_t b)
{
    struct moe_pool *p = moe_store_pool(s);
    uint32_t l = b / o->m.hp.n_expert, e = b % o->m.hp.n_expert;
    struct moe_expert_slice sl;
    CHECK_EQ(moe_model_expert_slice(&o->m, l, e, &sl), 0);
    const struct moe_store_layer *L = moe_store_layer(s, l);
    const uint8_t *blob = p->slots_base + (uint64_t)slot * p->slot_bytes;
    for (int k = 0; k < 3; k++)
        if (memcmp(blob + L->off[k], o->f->base + sl.off[k], sl.size[k]) != 0)
            return false;
    return true;
}

TEST(tier_pool_store_holds_the_file_bytes)
{
    struct opened o, w;
    open_model(&o, F16_PATH);
    uint32_t nl = o.m.hp.n_layer, ne = o.m.hp.n_expert;
    struct moe_store *s = pooled(&o, 12, 2);
    struct moe_store_info si;
    moe_store_get_info(s, &si);
    CHECK_EQ(si.pool_slots, 12u);
    CHECK_EQ(si.pool_slot_bytes, moe_store_slot_bytes(&o.m));
    CHECK(si.pool_slot_bytes % 4096 == 0);

    /* A worker attaches, maps the table and sees the same slots. */
    open_model(&w, F16_PATH);
    char err[512];
    struct moe_store *ws = NULL;
    CHECK_MSG(moe_store_open_model(&ws, moe_store_fd(s), &w.m, err, sizeof err) == 0, "%s", err);
    struct moe_pool *p = moe_store_pool(ws);
    CHECK(p != NULL);
    CHECK_EQ(p->n_slots, 12u);
    CHECK_EQ(p->n_workers, 2u);
    CHECK_EQ(p->quota, 6u);
    const void *ptr;
    uint64_t sz;
    CHECK_EQ(moe_store_blob(ws, 0, 0, &ptr, &sz), MOE_ENOTFOUND);
    uint32_t present = 0;
    for (uint32_t b = 0; b < nl * ne; b++) {
        int32_t slot = atomic_load(&p->where[b]);
        if (slot < 0)
            continue;
        present++;
        CHECK_MSG(slot_matches(ws, &o, slot, b), "blob %u in slot %d differs from the file", b,
                  slot);
    }
    CHECK_EQ(present, 12u);
    /* Filled evenly without a profile: expert 0..3 of each of the 3 layers. */
    for (uint32_t l = 0; l < nl; l++)
        for (uint32_t e = 0; e < 4; e++)
            CHECK(atomic_load(&p->where[l * ne + e]) >= 0);
    /* The worker's slots are read-only; its table is not. */
    CHECK_EQ(moe_pool_pin(p, 1, 0), atomic_load(&p->where[0]));
    CHECK_EQ(moe_pool_slot_refs(moe_store_pool(s), atomic_load(&p->where[0])), 1u);
    moe_pool_unpin(p, 1, atomic_load(&p->where[0]));
    moe_store_close(ws);
    close_model(&w);
    moe_store_close(s);
    close_model(&o);
}

TEST(tier_pool_pin_claim_publish_reclaim)
{
    struct opened o;
    open_model(&o, F16_PATH);
    struct moe_store *s = pooled(&o, 12, 2);
    struct moe_pool *p = moe_store_pool(s);
    int32_t s0 = moe_pool_pin(p, 0, 0);
    CHECK(s0 >= 0);
    CHECK(!moe_pool_claim(p, s0));          /* pinned: not taken */
    CHECK_EQ(moe_pool_pin(p, 1, 0), s0);     /* still there for everyone */
    moe_pool_unpin(p, 1, s0);
    moe_pool_unpin(p, 0, s0);
    CHECK(moe_pool_claim(p, s0));            /* unpinned: taken, blob 0 gone */
    CHECK_EQ(moe_pool_pin(p, 0, 0), -1);
    CHECK_EQ(atomic_load(&p->where[0]), MOE_POOL_NONE);
    CHECK(!moe_pool_claim(p, s0));           /* LOADING is never taken twice */
    uint32_t b = 47;                         /* layer 2, expert 15: not filled */
    CHECK_EQ(moe_pool_pin(p, 0, b), -1);
    moe_pool_publish(p, s0, b, 1);           /* pinned for worker 1 as ExpertReady says */
    CHECK_EQ(moe_pool_slot_refs(p, s0), 1u);
    CHECK(moe_pool_holds(p, s0, b));
    CHECK(!moe_pool_claim(p, s0));
    CHECK(moe_pool_pin_for(p, s0, b, 1));
    CHECK_EQ(moe_pool_slot_refs(p, s0), 2u);
    CHECK_EQ(moe_pool_reclaim(p, 1), 2u);    /* worker 1 died holding both */
    CHECK_EQ(moe_pool_slot_refs(p, s0), 0u);
    CHECK_EQ(moe_pool_reclaim(p, 1), 0u);
    CHECK(moe_pool_claim(p, s0));
    moe_pool_release_claim(p, s0);
    CHECK_EQ(atomic_load(&p->slot[s0].blob), MOE_POOL_NONE);
    moe_store_close(s);
    close_model(&o);
}

TEST(tier_fill_order_profile_first_then_even)
{
    uint64_t counts[3 * 4] = {0, 5, 0, 0, /* layer 1 */ 9, 0, 0, 1, /* layer 2 */ 0, 0, 0, 0};
    uint32_t out[12];
    CHECK_EQ(moed_tier_fill_order(counts, 3, 4, 5, out), 5u);
    CHECK_EQ(out[0], 4u);  /* (1, 0): 9 */
    CHECK_EQ(out[1], 1u);  /* (0, 1): 5 */
    CHECK_EQ(out[2], 7u);  /* (1, 3): 1 */
    CHECK_EQ(out[3], 0u);  /* then expert 0 of layers 0 and 2 */
    CHECK_EQ(out[4], 8u);
    CHECK_EQ(moed_tier_fill_order(NULL, 3, 4, 100, out), 12u);
    CHECK_EQ(out[0], 0u);
    CHECK_EQ(out[1], 4u);
    CHECK_EQ(out[2], 8u);
    CHECK_EQ(out[3], 1u);
}

/* ---- racing pins and evictions: no slot changes under a pin ---- */

struct race {
    struct moe_pool *p;
    uint32_t n_blobs;
    atomic_bool stop;
    atomic_ulong pinned_reads, evictions, torn;
};

/* A slot's bytes all say which blob it holds (the writer's pattern). */
static void fill_pattern(uint8_t *d, uint64_t n, uint32_t b)
{
    for (uint64_t i = 0; i < n; i += 4)
        memcpy(d + i, &b, 4);
}

static bool check_pattern(const uint8_t *d, uint64_t n, uint32_t b)
{
    for (uint64_t i = 0; i < n; i += 4)
        if (memcmp(d + i, &b, 4) != 0)
            return false;
    return true;
}

struct reader_arg {
    struct race *r;
    uint32_t worker;
};

static void *race_reader(void *arg)
{
    struct reader_arg *a = arg;
    struct race *r = a->r;
    uint32_t seed = a->worker * 7919u + 1;
    while (!atomic_load(&r->stop)) {
        seed = seed * 1103515245u + 12345u;
        uint32_t b = (seed >> 8) % r->n_blobs;
        int32_t s = moe_pool_pin(r->p, a->worker, b);
        if (s < 0)
            continue;
        const uint8_t *d = r->p->slots_base + (uint64_t)s * r->p->slot_bytes;
        if (!check_pattern(d, r->p->slot_bytes, b))
            atomic_fetch_add(&r->torn, 1);
        sched_yield();
        if (!check_pattern(d, r->p->slot_bytes, b))
            atomic_fetch_add(&r->torn, 1);
        moe_pool_unpin(r->p, a->worker, s);
        atomic_fetch_add(&r->pinned_reads, 1);
    }
    return NULL;
}

static void *race_writer(void *arg)
{
    struct race *r = arg;
    uint32_t seed = 99;
    while (!atomic_load(&r->stop)) {
        seed = seed * 1103515245u + 12345u;
        int32_t s = (int32_t)((seed >> 8) % r->p->n_slots);
        uint32_t b = (seed >> 3) % r->n_blobs;
        if (atomic_load(&r->p->where[b]) >= 0 || !moe_pool_claim(r->p, s))
            continue;
        fill_pattern(r->p->slots_base + (uint64_t)s * r->p->slot_bytes, r->p->slot_bytes, b);
        moe_pool_publish(r->p, s, b, UINT32_MAX);
        atomic_fetch_add(&r->evictions, 1);
    }
    return NULL;
}

TEST_TIMEOUT(tier_pool_no_torn_reads_under_racing_evictions, 60)
{
    struct opened o;
    open_model(&o, F16_PATH);
    struct moe_store *s = pooled(&o, 12, 3);
    struct race r = {.p = moe_store_pool(s), .n_blobs = o.m.hp.n_layer * o.m.hp.n_expert};
    /* Every slot gets the pattern of the blob it holds. */
    for (uint32_t i = 0; i < r.p->n_slots; i++)
        fill_pattern(r.p->slots_base + (uint64_t)i * r.p->slot_bytes, r.p->slot_bytes,
                     (uint32_t)atomic_load(&r.p->slot[i].blob));
    pthread_t th[3];
    struct reader_arg ra[2] = {{&r, 0}, {&r, 1}};
    CHECK(pthread_create(&th[0], NULL, race_reader, &ra[0]) == 0);
    CHECK(pthread_create(&th[1], NULL, race_reader, &ra[1]) == 0);
    CHECK(pthread_create(&th[2], NULL, race_writer, &r) == 0);
    usleep(700 * 1000);
    atomic_store(&r.stop, true);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    CHECK_EQ(atomic_load(&r.torn), 0ul);
    CHECK(atomic_load(&r.pinned_reads) > 100);
    CHECK(atomic_load(&r.evictions) > 100);
    for (uint32_t i = 0; i < r.p->n_slots; i++)
        CHECK_EQ(moe_pool_slot_refs(r.p, (int32_t)i), 0u);
    moe_store_close(s);
    close_model(&o);
}

/* ---- the CPU engine on a tiny pool: logits identical to the full store ---- */

/* Plays the daemon inside the test: loads the blob into an unpinned slot at once and answers. */
struct fake_daemon {
    struct moe_store *s;
    struct opened *o;
    struct wtier *t;
    uint32_t worker;
    int requests, prefetches;
    bool fail;             /* answer every request with an error */
    bool corrupt;          /* flip a byte of each blob after hashing it */
};

static void fake_request(void *user, uint32_t layer, uint32_t expert, bool prefetch)
{
    struct fake_daemon *f = user;
    if (prefetch) {
        CHECK(layer >= 1 && layer < f->o->m.hp.n_layer && expert < f->o->m.hp.n_expert);
        f->prefetches++;
        return; /* a read-ahead the daemon drops */
    }
    struct moe_pool *p = moe_store_pool(f->s);
    uint32_t b = layer * f->o->m.hp.n_expert + expert;
    char err[256];
    f->requests++;
    if (f->fail) {
        CHECK_EQ(wtier_ready(f->t, layer, expert, 0, 0, MOE_EFORMAT, "the file shrank", err,
                             sizeof err), 0);
        return;
    }
    int32_t slot = -1;
    for (uint32_t i = 0; i < p->n_slots && slot < 0; i++) {
        uint32_t s = (uint32_t)(f->requests * 5 + (int)i) % p->n_slots; /* wander over slots */
        if (moe_pool_slot_refs(p, (int32_t)s) == 0 && moe_pool_claim(p, (int32_t)s))
            slot = (int32_t)s;
    }
    CHECK_MSG(slot >= 0, "no free slot for (%u, %u)", layer, expert);
    struct moe_expert_slice sl;
    CHECK_EQ(moe_model_expert_slice(&f->o->m, layer, expert, &sl), 0);
    const struct moe_store_layer *L = moe_store_layer(f->s, layer);
    uint8_t *d = p->slots_base + (uint64_t)slot * p->slot_bytes;
    memset(d, 0xA5, p->slot_bytes); /* garbage where the last blob was */
    for (int k = 0; k < 3; k++)
        memcpy(d + L->off[k], f->o->f->base + sl.off[k], sl.size[k]);
    p->slot[slot].hash = moe_pool_slot_hash(p, slot, L->blob_bytes);
    if (f->corrupt)
        d[L->off[1] + 7] ^= 0x40;
    moe_pool_publish(p, slot, b, f->worker);
    CHECK_MSG(wtier_ready(f->t, layer, expert, p->slots_off + (uint64_t)slot * p->slot_bytes,
                          L->blob_bytes, 0, NULL, err, sizeof err) == 0, "%s", err);
}

static float *run_logits(struct moe_model *m, const struct moe_expert_src *src, const int32_t *tok,
                         uint32_t n)
{
    char err[512];
    struct moe_engine *e = NULL;
    struct moe_engine_opts eo = {.n_ctx = 128, .n_seq = 2, .n_batch = 64, .n_threads = 2,
                                 .device = "cpu", .expert_src = src};
    CHECK_MSG(moe_engine_init(&e, m, &eo, err, sizeof err) == 0, "%s", err);
    uint32_t V = m->hp.n_vocab;
    float *out = calloc((size_t)(n + 2) * V, sizeof *out);
    int32_t pos[64], seq[64];
    for (uint32_t i = 0; i < n; i++) {
        pos[i] = (int32_t)i;
        seq[i] = 0;
    }
    /* A prompt (many experts per layer), then two decode steps on two sequences. */
    struct moe_batch b = {.n = n, .token = tok, .pos = pos, .seq = seq};
    CHECK_MSG(moe_engine_forward(e, &b, out) == 0, "%s", moe_engine_errmsg(e));
    int32_t t2[2] = {tok[1], tok[2]}, p2[2] = {(int32_t)n, 0}, s2[2] = {0, 1};
    struct moe_batch b2 = {.n = 2, .token = t2, .pos = p2, .seq = s2};
    CHECK_MSG(moe_engine_forward(e, &b2, out + (size_t)n * V) == 0, "%s", moe_engine_errmsg(e));
    moe_engine_free(e);
    return out;
}

/* From an empty pool, a 40-token step through src fails with code and a message holding want;
 * no pin is left behind. */
static void step_fails_from_empty_pool(struct moe_model *m, const struct moe_expert_src *src,
                                       struct moe_pool *p, const int32_t *tok, int code,
                                       const char *want)
{
    char err[512];
    struct moe_engine *e = NULL;
    struct moe_engine_opts eo = {.n_ctx = 64, .n_seq = 1, .n_batch = 64, .n_threads = 1,
                                 .device = "cpu", .expert_src = src};
    CHECK(moe_engine_init(&e, m, &eo, err, sizeof err) == 0);
    for (uint32_t i = 0; i < p->n_slots; i++)
        if (moe_pool_claim(p, (int32_t)i))
            moe_pool_release_claim(p, (int32_t)i); /* empty: every expert is a miss */
    int32_t pos[40], seq[40] = {0};
    for (int i = 0; i < 40; i++)
        pos[i] = i;
    float *out = calloc((size_t)40 * m->hp.n_vocab, sizeof *out);
    struct moe_batch b = {.n = 40, .token = tok, .pos = pos, .seq = seq};
    CHECK_EQ(moe_engine_forward(e, &b, out), code);
    CHECK_MSG(strstr(moe_engine_errmsg(e), want) != NULL, "%s", moe_engine_errmsg(e));
    for (uint32_t i = 0; i < p->n_slots; i++)
        CHECK_EQ(moe_pool_slot_refs(p, (int32_t)i), 0u);
    free(out);
    moe_engine_free(e);
}

/* A model opened three times (for the stand-in daemon, the full store's engine and the pool's),
 * its full store, a pool of n_slots (0: one layer's experts) for n_workers seen by worker
 * `worker`, and the stand-in daemon, every blob used checked against its hash. */
struct tier_fix {
    struct opened o, full, tiny;
    struct moe_store *fs, *fsw, *ps, *psw;
    struct fake_daemon fd;
};

static void fix_open(struct tier_fix *f, const char *path, uint32_t n_slots, uint32_t n_workers,
                     uint32_t worker)
{
    char err[512];
    memset(f, 0, sizeof *f);
    open_model(&f->o, path);
    open_model(&f->full, path);
    open_model(&f->tiny, path);
    CHECK(moe_store_create(&f->fs, &f->o.m, 2, NULL, NULL, err, sizeof err) == 0);
    CHECK_MSG(moe_store_open_model(&f->fsw, moe_store_fd(f->fs), &f->full.m, err, sizeof err) == 0,
              "%s", err);
    f->ps = pooled(&f->o, n_slots ? n_slots : f->o.m.hp.n_expert, n_workers);
    CHECK_MSG(moe_store_open_model(&f->psw, moe_store_fd(f->ps), &f->tiny.m, err, sizeof err) == 0,
              "%s", err);
    f->fd = (struct fake_daemon){.s = f->ps, .o = &f->o, .worker = worker};
    CHECK(wtier_new(&f->fd.t, f->psw, &f->tiny.m, worker, fake_request, &f->fd, err, sizeof err) ==
          0);
    wtier_set_verify(f->fd.t, true);
}

static void fix_close(struct tier_fix *f)
{
    wtier_free(f->fd.t);
    moe_store_close(f->psw);
    moe_store_close(f->ps);
    moe_store_close(f->fsw);
    moe_store_close(f->fs);
    close_model(&f->tiny);
    close_model(&f->full);
    close_model(&f->o);
}

static void engine_logits_equal(const char *path)
{
    char err[512];
    /* The minimum pool (3 layers x top-4) shared by 3 workers: 4 pins at a time, so a prompt
     * layer's experts come in several parts and slots are rewritten all the time. */
    struct tier_fix f;
    fix_open(&f, path, 12, 3, 2);
    struct opened *o = &f.o;
    struct fake_daemon *fd = &f.fd;
    CHECK_EQ(wtier_source(fd->t)->max_pinned, 4);

    int32_t tok[40];
    for (int i = 0; i < 40; i++)
        tok[i] = (int32_t)((i * 977 + 13) % (int)o->m.hp.n_vocab);
    float *want = run_logits(&f.full.m, NULL, tok, 40);
    float *got = run_logits(&f.tiny.m, wtier_source(fd->t), tok, 40);
    size_t n = (size_t)42 * o->m.hp.n_vocab;
    CHECK_MSG(memcmp(want, got, n * sizeof *want) == 0, "logits differ (rel l2 %g)",
              moe_test_rel_l2(want, got, n));
    struct wtier_stats st;
    wtier_stats(fd->t, &st);
    CHECK(st.misses > 10);
    CHECK(st.hits > 0);
    CHECK_EQ((int)st.misses, fd->requests);
    CHECK(fd->prefetches > 0);
    CHECK_EQ((int)st.prefetches, fd->prefetches);
    struct moe_pool *p = moe_store_pool(f.ps);
    for (uint32_t i = 0; i < p->n_slots; i++)
        CHECK_EQ(moe_pool_slot_refs(p, (int32_t)i), 0u); /* every pin given back */

    /* A slot whose bytes no longer match its hash fails the step (verify mode). */
    fd->corrupt = true;
    step_fails_from_empty_pool(&f.tiny.m, wtier_source(fd->t), p, tok, MOE_EINTERNAL,
                               "do not match the hash");
    fd->corrupt = false;
    /* A request that fails (the file shrank) fails the step with the daemon's message. */
    fd->fail = true;
    step_fails_from_empty_pool(&f.tiny.m, wtier_source(fd->t), p, tok, MOE_EFORMAT, "the file shrank");

    /* An answer nobody asked for, or an offset that is not a slot, is a bad frame. */
    CHECK(wtier_ready(fd->t, 0, 1, p->slots_off + 1, 10, 0, NULL, err, sizeof err) != 0);
    CHECK(wtier_ready(fd->t, 0, 1, p->slots_off + 1000 * p->slot_bytes, 10, 0, NULL, err,
                      sizeof err) != 0);

    free(want);
    free(got);
    fix_close(&f);
}

TEST_TIMEOUT(tier_cpu_engine_logits_equal_the_full_store, 120)
{
    engine_logits_equal(F16_PATH);
    engine_logits_equal(Q4KM_PATH);
}

/* MOE_TEST_DEVICE ("cuda:K" or "K"), or NULL for the CPU. */
static const char *cuda_test_device(void)
{
    static char name[16];
    const char *dev = getenv("MOE_TEST_DEVICE");
    if (!dev || !*dev || !strcmp(dev, "cpu") || strlen(dev) > 7)
        return NULL;
    snprintf(name, sizeof name, "%s%s", strncmp(dev, "cuda:", 5) ? "cuda:" : "", dev);
    return name;
}

/* A CUDA engine at an expert residency over the experts of src (a pool) or the model's views:
 * a 40-token prompt, then 12 decode steps of 2 sequences; the logits of every row. */
static float *run_cuda(struct moe_model *m, const struct moe_expert_src *src, const char *dev,
                       double residency, const int32_t *tok)
{
    char err[512];
    struct moe_engine *e = NULL;
    struct moe_engine_opts eo = {.n_ctx = 128, .n_seq = 2, .n_batch = 64, .device = dev,
                                 .expert_residency = residency, .host_register = true,
                                 .expert_src = src};
    CHECK_MSG(moe_engine_init(&e, m, &eo, err, sizeof err) == 0, "%s", err);
    const uint32_t V = m->hp.n_vocab, n = 40;
    float *out = calloc((size_t)(n + 24) * V, sizeof *out);
    int32_t pos[40], seq[40] = {0};
    for (uint32_t i = 0; i < n; i++)
        pos[i] = (int32_t)i;
    struct moe_batch b = {.n = n, .token = tok, .pos = pos, .seq = seq};
    CHECK_MSG(moe_engine_forward(e, &b, out) == 0, "%s", moe_engine_errmsg(e));
    for (int s = 0; s < 12; s++) {
        int32_t t2[2] = {tok[(s * 7 + 1) % 40], tok[(s * 3 + 2) % 40]};
        int32_t p2[2] = {(int32_t)n + s, s}, s2[2] = {0, 1};
        struct moe_batch b2 = {.n = 2, .token = t2, .pos = p2, .seq = s2};
        CHECK_MSG(moe_engine_forward(e, &b2, out + (size_t)(n + 2 * s) * V) == 0, "%s",
                  moe_engine_errmsg(e));
    }
    moe_engine_free(e);
    return out;
}

/* The CUDA engine over a pool (MOE_TEST_DEVICE=cuda:K; skipped without): experts without a VRAM
 * slot borrowed from the pool inside the step through the backend's channel, missing ones asked
 * of the stand-in daemon while the step waits, predicted ones asked to be read ahead; logits
 * bit-identical to the same device's run from the full store at 50% and 25% residency; every pin
 * given back; a failed request fails its step with the daemon's message and the engine goes on. */
static void cuda_engine_logits_equal(const char *path, const char *dev)
{
    char err[512];
    /* The smallest pool a GPU worker takes: one layer's experts. */
    struct tier_fix f;
    fix_open(&f, path, 0, 1, 0);
    struct fake_daemon *fd = &f.fd;
    struct moe_pool *p = moe_store_pool(f.ps);
    const uint32_t V = f.o.m.hp.n_vocab;
    int32_t tok[40];
    for (int i = 0; i < 40; i++)
        tok[i] = (int32_t)((i * 977 + 13) % (int)V);
    const size_t n = (size_t)64 * V;
    static const double residency[2] = {0.5, 0.25};
    for (int r = 0; r < 2; r++) {
        float *want = run_cuda(&f.full.m, NULL, dev, residency[r], tok);
        const int before = fd->requests;
        float *got = run_cuda(&f.tiny.m, wtier_source(fd->t), dev, residency[r], tok);
        CHECK_MSG(memcmp(want, got, n * sizeof *want) == 0, "%s at %.0f%%: logits differ (rel l2 %g)",
                  path, 100 * residency[r], moe_test_rel_l2(want, got, n));
        CHECK_MSG(fd->requests > before, "no expert was asked of the daemon at %.0f%%",
                  100 * residency[r]);
        for (uint32_t i = 0; i < p->n_slots; i++)
            CHECK_EQ(moe_pool_slot_refs(p, (int32_t)i), 0u);
        free(want);
        free(got);
    }
    struct wtier_stats st;
    wtier_stats(fd->t, &st);
    CHECK(st.hits > 0);
    CHECK_EQ((int)st.misses, fd->requests);
    /* The decode steps' layer-ahead predictions came as read-aheads of experts not in the pool. */
    CHECK(fd->prefetches > 0);
    CHECK_EQ((int)st.prefetches, fd->prefetches);

    /* A request that fails fails the step with the daemon's message; the next step, with the
     * daemon answering again, runs. */
    struct moe_engine *e = NULL;
    struct moe_engine_opts eo = {.n_ctx = 128, .n_seq = 1, .n_batch = 64, .device = dev,
                                 .expert_residency = 0.25, .host_register = true,
                                 .expert_src = wtier_source(fd->t)};
    CHECK_MSG(moe_engine_init(&e, &f.tiny.m, &eo, err, sizeof err) == 0, "%s", err);
    for (uint32_t i = 0; i < p->n_slots; i++)
        if (moe_pool_claim(p, (int32_t)i))
            moe_pool_release_claim(p, (int32_t)i); /* empty: every borrowed expert is a miss */
    int32_t pos[40], seq[40] = {0};
    for (int i = 0; i < 40; i++)
        pos[i] = i;
    float *out = calloc((size_t)40 * V, sizeof *out);
    struct moe_batch b = {.n = 40, .token = tok, .pos = pos, .seq = seq};
    fd->fail = true;
    CHECK_EQ(moe_engine_forward(e, &b, out), MOE_EFORMAT);
    CHECK_MSG(strstr(moe_engine_errmsg(e), "the file shrank") != NULL, "%s", moe_engine_errmsg(e));
    for (uint32_t i = 0; i < p->n_slots; i++)
        CHECK_EQ(moe_pool_slot_refs(p, (int32_t)i), 0u);
    fd->fail = false;
    CHECK_MSG(moe_engine_forward(e, &b, out) == 0, "%s", moe_engine_errmsg(e));
    for (uint32_t i = 0; i < p->n_slots; i++)
        CHECK_EQ(moe_pool_slot_refs(p, (int32_t)i), 0u);
    free(out);
    moe_engine_free(e);
    fix_close(&f);

    /* A pool share smaller than one layer's experts is refused with the minimum. */
    struct tier_fix f2;
    fix_open(&f2, path, 0, 2, 1);
    eo.expert_src = wtier_source(f2.fd.t);
    e = NULL;
    CHECK(moe_engine_init(&e, &f2.tiny.m, &eo, err, sizeof err) != 0);
    CHECK_MSG(strstr(err, "one layer's experts") != NULL, "%s", err);
    fix_close(&f2);
}

TEST_TIMEOUT(tier_cuda_engine_logits_equal_the_full_store, 300)
{
    const char *dev = cuda_test_device();
    if (!dev)
        moe_test_skip("MOE_TEST_DEVICE names no CUDA device");
    cuda_engine_logits_equal(F16_PATH, dev);
    cuda_engine_logits_equal(Q4KM_PATH, dev);
}

/* moe_pool_victim against the plain rule on random tables: the first empty slot, else the
 * unpinned slot holding a blob with the smallest used + bonus (first on ties), else -1; including
 * tables whose oldest slots are all pinned (the fallback scan) and ties. */
TEST(tier_pool_victim_is_the_oldest_unpinned)
{
    moe_test_rng_seed(77);
    const uint32_t n_layer = 4, n_expert = 64;
    uint32_t bonus[4 * 64];
    for (int c = 0; c < 3000; c++) {
        const uint32_t n_slots = 1 + moe_test_rng_u32() % 200, n_workers = 1 + moe_test_rng_u32() % 6;
        const uint64_t bytes = moe_pool_table_bytes(n_layer, n_expert, n_slots, n_workers);
        void *table = calloc(1, bytes);
        CHECK(table);
        moe_pool_init_table(table, n_layer, n_expert, n_slots, n_workers, 4096);
        struct moe_pool p;
        moe_pool_bind(&p, table, NULL, 0);
        const bool with_bonus = c % 2, ties = c % 5 == 0, pin_oldest = c % 3 == 0;
        for (uint32_t b = 0; b < n_layer * n_expert; b++)
            bonus[b] = with_bonus ? moe_test_rng_u32() % 4000 : 0;
        const bool all_full = c % 4 != 0;
        for (uint32_t s = 0; s < n_slots; s++) {
            const uint32_t r = moe_test_rng_u32() % 100;
            int32_t blob = r < 8 ? MOE_POOL_LOADING : (int32_t)((s * 37 + (uint32_t)c) % (n_layer * n_expert));
            if (!all_full && r >= 95)
                blob = MOE_POOL_NONE;
            atomic_store(&p.slot[s].blob, blob);
            const uint64_t used = ties ? 1000 + moe_test_rng_u32() % 3 : moe_test_rng_u32() % 100000;
            atomic_store(&p.slot[s].used, used);
            if (moe_test_rng_u32() % 100 < 30 || (pin_oldest && used < 30000))
                atomic_store(&p.refs[(uint64_t)s * n_workers + moe_test_rng_u32() % n_workers], 1 + moe_test_rng_u32() % 3);
        }
        int32_t want = -1;
        uint64_t best = UINT64_MAX;
        for (uint32_t s = 0; s < n_slots; s++) {
            const int32_t b = atomic_load(&p.slot[s].blob);
            if (b == MOE_POOL_NONE) {
                want = (int32_t)s;
                break;
            }
            if (b < 0 || moe_pool_slot_refs(&p, (int32_t)s))
                continue;
            const uint64_t score = atomic_load(&p.slot[s].used) + (with_bonus ? bonus[b] : 0);
            if (score < best) {
                best = score;
                want = (int32_t)s;
            }
        }
        const int32_t got = moe_pool_victim(&p, with_bonus ? bonus : NULL);
        CHECK_MSG(got == want, "case %d (%u slots, %u workers): got %d, want %d", c, n_slots,
                  n_workers, got, want);
        free(table);
    }
}

/* --ram-budget's slots: a share of the expert bytes in slots of the largest blob; 100% (or any
 * size holding the experts' bytes) is the full store even where blobs differ in size and a
 * pool of those bytes would hold fewer experts (the Q4_K_M file's Q4_K and Q6_K layers); below
 * one step's experts is refused with the minimum. */
TEST(tier_budget_slots_full_store_at_the_experts_bytes)
{
    char err[512];
    static const char *const paths[2] = {F16_PATH, Q4KM_PATH};
    for (int i = 0; i < 2; i++) {
        struct opened o;
        open_model(&o, paths[i]);
        const uint64_t all = (uint64_t)o.m.hp.n_layer * o.m.hp.n_expert;
        const uint64_t slot = moe_store_slot_bytes(&o.m);
        uint64_t slots = 1;
        CHECK_EQ(moe_store_budget_slots(&o.m, "100%", 1, &slots, err, sizeof err), 0);
        CHECK_EQ(slots, 0u);
        char size[32];
        snprintf(size, sizeof size, "%llu", (unsigned long long)o.m.bytes_experts);
        CHECK_EQ(moe_store_budget_slots(&o.m, size, 1, &slots, err, sizeof err), 0);
        CHECK_EQ(slots, 0u);
        if (i == 1)
            CHECK_MSG(o.m.bytes_experts / slot < all, "the Q4_K_M file's blobs should differ");
        CHECK_EQ(moe_store_budget_slots(&o.m, "50%", 1, &slots, err, sizeof err), 0);
        CHECK_EQ(slots, (uint64_t)(0.5 * (double)o.m.bytes_experts) / slot);
        snprintf(size, sizeof size, "%llu", (unsigned long long)(slot * 3));
        CHECK(moe_store_budget_slots(&o.m, size, 1, &slots, err, sizeof err) != 0);
        CHECK_MSG(strstr(err, "one step needs at least"), "%s", err);
        close_model(&o);
    }
}
