/* The shared-memory expert store (see expert_store.h and docs/store.md). */
#include "store/expert_store.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "store/err.h"
#include "store/gguf.h"
#include "store/io.h"
#include "store/units.h"

_Static_assert(sizeof(struct moe_store_header) == 136, "store header layout changed");
_Static_assert(sizeof(struct moe_store_layer) == 88, "store layer entry layout changed");
_Static_assert(sizeof(struct moe_store_dense) == 96, "store dense entry layout changed");

/* Work items bigger than this are split so that one huge tensor (token_embd of a big vocabulary)
 * does not leave the other threads idle, and so progress moves smoothly. */
#define COPY_CHUNK (8u << 20)

struct moe_store {
    int fd;
    uint8_t *base;
    uint64_t size;
    const struct moe_store_header *hdr;
    const struct moe_store_layer *layers;
    const struct moe_store_dense *dense;
    struct moe_store_info info;
    uint8_t *table;          /* tiered store: the slot table mapping (workers map it apart) */
    uint64_t table_size;
    struct moe_pool pool;
    bool pooled;
};

static uint64_t align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

static double gib(uint64_t b)
{
    return (double)b / (double)(1ull << 30);
}

int moe_store_progress_format(char *buf, size_t n, uint64_t done, uint64_t total, double elapsed)
{
    double rate = elapsed > 0 ? gib(done) / elapsed : 0;
    int pct = total ? (int)(done * 100.0 / (double)total) : 100;
    if (done >= total)
        return snprintf(buf, n, "loading experts: %.2f GiB done in %.1fs (%.1f GiB/s)", gib(total),
                        elapsed, rate);
    if (rate <= 0)
        return snprintf(buf, n, "loading experts: %.2f/%.2f GiB (%d%%)", gib(done), gib(total), pct);
    double eta = gib(total - done) / rate;
    return snprintf(buf, n, "loading experts: %.2f/%.2f GiB (%d%%), %.1f GiB/s, ETA %.0fs",
                    gib(done), gib(total), pct, rate, eta);
}

/* ---- small system helpers ---------------------------------------------------------------- */

static void read_thp_mode(char *out, size_t n)
{
    char buf[256];
    out[0] = '\0';
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
    if (!f)
        return;
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[got] = '\0';
    char *a = strchr(buf, '['), *b = a ? strchr(a, ']') : NULL;
    if (a && b && (size_t)(b - a - 1) < n) {
        memcpy(out, a + 1, (size_t)(b - a - 1));
        out[b - a - 1] = '\0';
    }
}

/* MemAvailable in bytes, or 0 when unknown. */
static uint64_t mem_available(void)
{
    char line[256];
    uint64_t kb = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %" SCNu64 " kB", &kb) == 1)
            break;
    fclose(f);
    return kb * 1024;
}

int moe_store_huge_bytes(const void *addr, uint64_t len, uint64_t *out)
{
    char line[512];
    uint64_t lo = (uint64_t)(uintptr_t)addr, hi = lo + len, total = 0;
    bool in = false;
    *out = 0;
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f)
        return -errno;
    while (fgets(line, sizeof line, f)) {
        unsigned long long a, b, kb;
        char name[64];
        char *sp = strchr(line, ' ');
        char *dash = strchr(line, '-');
        if (dash && sp && dash < sp && sscanf(line, "%llx-%llx", &a, &b) == 2) {
            in = a < hi && b > lo;
            continue;
        }
        if (in && sscanf(line, "%63[^:]: %llu kB", name, &kb) == 2 &&
            (!strcmp(name, "ShmemPmdMapped") || !strcmp(name, "FilePmdMapped") ||
             !strcmp(name, "AnonHugePages")))
            total += (uint64_t)kb * 1024;
    }
    fclose(f);
    *out = total;
    return 0;
}

/* ---- layout ------------------------------------------------------------------------------- */

struct copy_item {
    const uint8_t *src;
    uint64_t dst;   /* store offset */
    uint64_t len;
};

struct copy_job {
    uint8_t *base;
    const struct copy_item *items;
    size_t n_items;
    atomic_size_t next;
    atomic_uint_fast64_t done;
    atomic_int cancel;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int finished;
};

static int cmp_dense(const void *a, const void *b)
{
    const struct moe_store_dense *x = a, *y = b;
    return x->src_off < y->src_off ? -1 : x->src_off > y->src_off;
}

/* A GGUF tensor is a routed-expert tensor when its data holds expert 0's slice of some layer;
 * this keeps the dense/expert split independent of tensor names (and so of the architecture). */
static bool is_expert_tensor(const struct gguf_file *f, const struct gguf_tensor *t,
                             const uint64_t *e0_off, size_t n_e0)
{
    uint64_t lo = f->data_offset + t->offset, hi = lo + t->nbytes;
    for (size_t i = 0; i < n_e0; i++)
        if (e0_off[i] >= lo && e0_off[i] < hi)
            return true;
    return false;
}

static int push_item(struct copy_item **items, size_t *n, size_t *cap, const uint8_t *src,
                     uint64_t dst, uint64_t len)
{
    while (len > 0) {
        uint64_t part = len > COPY_CHUNK ? COPY_CHUNK : len;
        if (*n == *cap) {
            size_t nc = *cap ? *cap * 2 : 1024;
            struct copy_item *p = realloc(*items, nc * sizeof *p);
            if (!p)
                return -ENOMEM;
            *items = p;
            *cap = nc;
        }
        (*items)[(*n)++] = (struct copy_item){src, dst, part};
        src += part;
        dst += part;
        len -= part;
    }
    return 0;
}

static void *copy_thread(void *arg)
{
    struct copy_job *j = arg;
    for (;;) {
        if (atomic_load_explicit(&j->cancel, memory_order_relaxed))
            break;
        size_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n_items)
            break;
        const struct copy_item *it = &j->items[i];
        memcpy(j->base + it->dst, it->src, it->len);
        atomic_fetch_add_explicit(&j->done, it->len, memory_order_relaxed);
    }
    pthread_mutex_lock(&j->mu);
    j->finished++;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

/* Runs the copy on n_threads threads while this thread reports progress. Returns 0 or
 * MOE_ECANCELED; *used gets the number of threads that ran. */
static int run_copy(struct copy_job *j, int n_threads, moe_store_progress_fn progress, void *user,
                    uint64_t total, int *used)
{
    pthread_t *tids = calloc((size_t)n_threads, sizeof *tids);
    int started = 0;
    if (tids)
        for (; started < n_threads; started++)
            if (pthread_create(&tids[started], NULL, copy_thread, j) != 0)
                break;
    *used = started;
    if (started == 0) {
        /* No threads to be had: copy here; slower, still correct. */
        *used = 1;
        j->finished = -1;
        copy_thread(j);
    } else {
        pthread_mutex_lock(&j->mu);
        while (j->finished < started) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&j->cv, &j->mu, &ts);
            if (j->finished >= started)
                break;
            pthread_mutex_unlock(&j->mu);
            if (progress && progress(atomic_load(&j->done), total, user))
                atomic_store(&j->cancel, 1);
            pthread_mutex_lock(&j->mu);
        }
        pthread_mutex_unlock(&j->mu);
        for (int i = 0; i < started; i++)
            pthread_join(tids[i], NULL);
    }
    free(tids);
    if (atomic_load(&j->cancel))
        return MOE_ECANCELED;
    if (progress && progress(total, total, user))
        return MOE_ECANCELED;
    return 0;
}

uint64_t moe_store_slot_bytes(const struct moe_model *m)
{
    uint64_t best = 0;
    for (uint32_t l = 0; l < m->hp.n_layer; l++) {
        const struct moe_expert *x = &m->layers[l].experts[0];
        uint64_t at = 0;
        const struct moe_tensor *v[3] = {&x->gate, &x->up, &x->down};
        for (int k = 0; k < 3; k++)
            at = align_up(at, MOE_STORE_SLICE_ALIGN) + v[k]->nbytes;
        at = align_up(at, MOE_STORE_BLOB_ALIGN);
        if (at > best)
            best = at;
    }
    return best;
}

int moe_store_budget_slots(const struct moe_model *m, const char *v, uint32_t n_workers,
                           uint64_t *slots, char *err, size_t errlen)
{
    const struct moe_hparams *hp = &m->hp;
    uint64_t all = (uint64_t)hp->n_layer * hp->n_expert, budget;
    *slots = 0;
    if (!strcmp(v, "auto")) {
        uint64_t use = mem_available() / 4 * 3;
        budget = use > m->bytes_dense ? use - m->bytes_dense : 0;
    } else if (strchr(v, '%')) {
        double share;
        if (moe_parse_share(v, &share))
            return moe_fail(err, errlen, MOE_EFORMAT, "--ram-budget '%s': a share must be in (0%%, "
                            "100%%]", v);
        budget = (uint64_t)(share * (double)m->bytes_experts);
    } else if (moe_parse_size(v, &budget)) {
        return moe_fail(err, errlen, MOE_EFORMAT, "--ram-budget '%s' is not a size (512M, 20G), a "
                        "share of the experts (50%%) or auto", v);
    }
    uint64_t slot = moe_store_slot_bytes(m);
    uint64_t n = slot ? budget / slot : 0;
    /* The experts' own bytes (100%) are the full store: its blobs take their own sizes, the
     * pool's slots the largest blob's (in a quant mix that differ, fewer than every expert). */
    if (n >= all || budget >= m->bytes_experts)
        return 0;
    uint64_t need = (uint64_t)hp->n_layer * hp->n_expert_used;
    if (need < (uint64_t)n_workers * hp->n_expert_used)
        need = (uint64_t)n_workers * hp->n_expert_used;
    if (n < need) {
        char b1[32], b2[32];
        return moe_fail(err, errlen, MOE_ERANGE, "--ram-budget %s gives %" PRIu64 " expert slots of "
                        "%s; one step needs at least %" PRIu64 " (%u layers x top-%u, and top-%u "
                        "per worker): give at least %s", v, n, moe_fmt_size(b1, sizeof b1, slot),
                        need, hp->n_layer, hp->n_expert_used, hp->n_expert_used,
                        moe_fmt_size(b2, sizeof b2, need * slot));
    }
    *slots = n;
    return 0;
}

static int store_create(struct moe_store **out, const struct moe_model *m, int n_threads,
                        uint32_t n_slots, uint32_t n_workers, const uint32_t *fill,
                        uint32_t n_fill, moe_store_progress_fn progress, void *user, char *err,
                        size_t errlen)
{
    int rc = 0;
    struct moe_store *s = NULL;
    struct moe_store_layer *lt = NULL;
    struct moe_store_dense *dt = NULL;
    uint64_t *e0 = NULL;
    struct copy_item *items = NULL;
    size_t n_items = 0, cap_items = 0, n_dense = 0;
    const struct gguf_file *f = m ? m->gguf : NULL;
    uint32_t nl = m ? m->hp.n_layer : 0, ne = m ? m->hp.n_expert : 0;

    if (err && errlen)
        err[0] = '\0';
    if (!m || !f || !m->layers)
        return moe_fail(err, errlen, MOE_EINTERNAL,
                        "expert store: the model must be described from its GGUF first");
    if (nl == 0 || ne == 0)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: model has %u layers and %u experts",
                        nl, ne);
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)c : 1;
    }
    if (n_threads > 256)
        n_threads = 256;

    s = calloc(1, sizeof *s);
    if (s) {
        s->fd = -1;
        s->base = MAP_FAILED;
    }
    lt = calloc(nl, sizeof *lt);
    e0 = calloc((size_t)nl * 3, sizeof *e0);
    dt = calloc(f->n_tensors ? f->n_tensors : 1, sizeof *dt);
    if (!s || !lt || !e0 || !dt) {
        rc = moe_fail(err, errlen, -ENOMEM, "expert store: out of memory");
        goto fail;
    }

    /* One blob layout per layer: every expert of a layer has the same slice sizes and types. */
    uint64_t expert_payload = 0;
    for (uint32_t l = 0; l < nl; l++) {
        struct moe_expert_slice sl;
        if ((rc = moe_model_expert_slice(m, l, 0, &sl))) {
            rc = moe_fail(err, errlen, rc, "expert store: layer %u: no expert slices (%s)", l,
                          moe_strerror(rc));
            goto fail;
        }
        struct moe_store_layer *L = &lt[l];
        uint64_t at = 0;
        for (int k = 0; k < 3; k++) {
            at = align_up(at, MOE_STORE_SLICE_ALIGN);
            L->off[k] = at;
            L->size[k] = sl.size[k];
            L->type[k] = sl.type[k];
            at += sl.size[k];
            e0[l * 3 + k] = sl.off[k];
        }
        L->blob_bytes = at;
        L->blob_stride = align_up(at, MOE_STORE_BLOB_ALIGN);
        expert_payload += (sl.size[0] + sl.size[1] + sl.size[2]) * ne;
    }

    uint64_t dense_payload = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor *t = &f->tensors[i];
        if (is_expert_tensor(f, t, e0, (size_t)nl * 3))
            continue;
        struct moe_store_dense *d = &dt[n_dense++];
        snprintf(d->name, sizeof d->name, "%s", t->name);
        d->src_off = f->data_offset + t->offset;
        d->size = t->nbytes;
        d->type = t->type;
        dense_payload += t->nbytes;
    }
    qsort(dt, n_dense, sizeof *dt, cmp_dense);

    /* Layout: header, layer table, dense table, then the dense region and the expert region,
     * each starting on a huge-page boundary so THP (when the kernel allows it) can back them. */
    struct moe_store_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, MOE_STORE_MAGIC, 8);
    h.version = MOE_STORE_VERSION;
    h.header_size = sizeof h;
    h.fingerprint = m->fingerprint;
    h.n_layer = nl;
    h.n_expert = ne;
    h.layer_table_off = align_up(sizeof h, 64);
    h.dense_table_off = h.layer_table_off + (uint64_t)nl * sizeof *lt;
    h.n_dense = n_dense;
    uint64_t at = h.dense_table_off + n_dense * sizeof *dt;
    h.dense_off = align_up(at, MOE_STORE_REGION_ALIGN);
    at = h.dense_off;
    for (size_t i = 0; i < n_dense; i++) {
        at = align_up(at, MOE_STORE_DENSE_ALIGN);
        dt[i].off = at;
        at += dt[i].size;
    }
    h.dense_size = at - h.dense_off;
    h.experts_off = align_up(at, MOE_STORE_REGION_ALIGN);
    at = h.experts_off;
    uint64_t slot_bytes = 0;
    if (n_slots) {
        /* Tiered: slots of the largest blob; the layer entries keep the slice layout only. */
        for (uint32_t l = 0; l < nl; l++)
            if (lt[l].blob_stride > slot_bytes)
                slot_bytes = lt[l].blob_stride;
        for (uint32_t l = 0; l < nl; l++) {
            lt[l].blobs_off = at;
            lt[l].blob_stride = slot_bytes;
        }
        at += slot_bytes * n_slots;
        h.experts_size = at - h.experts_off;
        h.pool_table_off = align_up(at, MOE_STORE_BLOB_ALIGN);
        h.pool_table_size =
            align_up(moe_pool_table_bytes(nl, ne, n_slots, n_workers), MOE_STORE_BLOB_ALIGN);
        h.pool_slots = n_slots;
        h.pool_slot_bytes = slot_bytes;
        at = h.pool_table_off + h.pool_table_size;
        expert_payload = 0;
        for (uint32_t i = 0; i < n_fill; i++) {
            uint32_t l = fill[i] / ne;
            expert_payload += lt[l].size[0] + lt[l].size[1] + lt[l].size[2];
        }
    } else {
        for (uint32_t l = 0; l < nl; l++) {
            lt[l].blobs_off = at;
            at += lt[l].blob_stride * ne;
        }
        h.experts_size = at - h.experts_off;
    }
    h.total_size = align_up(at, MOE_STORE_REGION_ALIGN);

    uint64_t avail = mem_available();
    if (avail && h.total_size > avail) {
        rc = moe_fail(err, errlen, MOE_ETOOBIG,
                      "expert store needs %.2f GiB of RAM, only %.2f GiB is available",
                      gib(h.total_size), gib(avail));
        goto fail;
    }

    s->fd = memfd_create("moe-store", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (s->fd < 0) {
        rc = moe_fail(err, errlen, -errno, "expert store: memfd_create: %s", strerror(errno));
        goto fail;
    }
    if (ftruncate(s->fd, (off_t)h.total_size) != 0) {
        rc = moe_fail(err, errlen, -errno, "expert store: ftruncate to %" PRIu64 " bytes: %s",
                      h.total_size, strerror(errno));
        goto fail;
    }
    s->base = mmap(NULL, h.total_size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (s->base == MAP_FAILED) {
        rc = moe_fail(err, errlen, -errno, "expert store: mmap %" PRIu64 " bytes: %s",
                      h.total_size, strerror(errno));
        goto fail;
    }
    s->size = h.total_size;
    /* Huge pages for a memfd depend on shmem_enabled; the advice is what "advise" mode wants
     * and is harmless otherwise, so a failure here is only reported, never fatal. */
    s->info.thp_advised = madvise(s->base, s->size, MADV_HUGEPAGE) == 0;
    read_thp_mode(s->info.thp_shmem_mode, sizeof s->info.thp_shmem_mode);

    memcpy(s->base + h.layer_table_off, lt, (size_t)nl * sizeof *lt);
    memcpy(s->base + h.dense_table_off, dt, n_dense * sizeof *dt);
    h.tables_hash = XXH3_64bits(s->base + h.layer_table_off,
                                (size_t)nl * sizeof *lt + n_dense * sizeof *dt);
    memcpy(s->base, &h, sizeof h);

    for (size_t i = 0; i < n_dense && rc == 0; i++)
        rc = push_item(&items, &n_items, &cap_items, f->base + dt[i].src_off, dt[i].off,
                       dt[i].size);
    if (n_slots) {
        moe_pool_init_table(s->base + h.pool_table_off, nl, ne, n_slots, n_workers, slot_bytes);
        moe_pool_bind(&s->pool, s->base + h.pool_table_off, s->base + h.experts_off,
                      h.experts_off);
        s->pooled = true;
    }
    uint64_t n_blobs = n_slots ? n_fill : (uint64_t)nl * ne;
    for (uint64_t i = 0; i < n_blobs && rc == 0; i++) {
        uint32_t b = n_slots ? fill[i] : (uint32_t)i, l = b / ne, e = b % ne;
        struct moe_expert_slice sl;
        if (b >= nl * ne || (rc = moe_model_expert_slice(m, l, e, &sl))) {
            rc = rc ? rc : MOE_ERANGE;
            break;
        }
        uint64_t blob = n_slots ? h.experts_off + i * slot_bytes
                                : lt[l].blobs_off + (uint64_t)e * lt[l].blob_stride;
        for (int k = 0; k < 3 && rc == 0; k++) {
            if (sl.size[k] != lt[l].size[k] || sl.type[k] != lt[l].type[k] ||
                sl.off[k] + sl.size[k] > f->size) {
                rc = MOE_EFORMAT;
                break;
            }
            rc = push_item(&items, &n_items, &cap_items, f->base + sl.off[k],
                           blob + lt[l].off[k], sl.size[k]);
        }
    }
    if (rc) {
        rc = moe_fail(err, errlen, rc, "expert store: building the copy list: %s",
                      moe_strerror(rc));
        goto fail;
    }

    struct copy_job job = {.base = s->base, .items = items, .n_items = n_items};
    atomic_init(&job.next, 0);
    atomic_init(&job.done, 0);
    atomic_init(&job.cancel, 0);
    pthread_mutex_init(&job.mu, NULL);
    pthread_cond_init(&job.cv, NULL);
    double t0 = moe_now_s();
    rc = run_copy(&job, n_threads, progress, user, dense_payload + expert_payload,
                  &s->info.threads);
    s->info.seconds = moe_now_s() - t0;
    pthread_mutex_destroy(&job.mu);
    pthread_cond_destroy(&job.cv);
    if (rc) {
        moe_fail(err, errlen, rc, "expert store: loading cancelled");
        goto fail;
    }

    if (n_slots)
        for (uint32_t i = 0; i < n_fill; i++) {
            s->pool.slot[i].hash =
                moe_pool_slot_hash(&s->pool, (int32_t)i, lt[fill[i] / ne].blob_bytes);
            moe_pool_publish(&s->pool, (int32_t)i, fill[i], UINT32_MAX);
        }

    /* The daemon keeps a read-only view: a stray write would silently change every worker's
     * weights. A tiered store's slots and table stay writable: the daemon loads blobs there. */
    if (mprotect(s->base, n_slots ? h.experts_off : s->size, PROT_READ) != 0) {
        rc = moe_fail(err, errlen, -errno, "expert store: mprotect: %s", strerror(errno));
        goto fail;
    }
    if (fcntl(s->fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
        rc = moe_fail(err, errlen, -errno, "expert store: sealing the memfd: %s", strerror(errno));
        goto fail;
    }

    s->hdr = (const struct moe_store_header *)s->base;
    s->layers = (const struct moe_store_layer *)(s->base + h.layer_table_off);
    s->dense = (const struct moe_store_dense *)(s->base + h.dense_table_off);
    s->info.size = s->size;
    s->info.dense_bytes = dense_payload;
    s->info.expert_bytes = expert_payload;
    s->info.fingerprint = h.fingerprint;
    s->info.n_layer = nl;
    s->info.n_expert = ne;
    s->info.n_dense = (uint32_t)n_dense;
    s->info.pool_slots = n_slots;
    s->info.pool_slot_bytes = slot_bytes;
    moe_store_huge_bytes(s->base, s->size, &s->info.huge_bytes);

    free(items);
    free(lt);
    free(dt);
    free(e0);
    *out = s;
    return 0;
fail:
    free(items);
    free(lt);
    free(dt);
    free(e0);
    moe_store_close(s);
    return rc;
}

int moe_store_create(struct moe_store **out, const struct moe_model *m, int n_threads,
                     moe_store_progress_fn progress, void *user, char *err, size_t errlen)
{
    return store_create(out, m, n_threads, 0, 0, NULL, 0, progress, user, err, errlen);
}

int moe_store_create_pool(struct moe_store **out, const struct moe_model *m, int n_threads,
                          uint32_t n_slots, uint32_t n_workers, const uint32_t *fill,
                          uint32_t n_fill, moe_store_progress_fn progress, void *user, char *err,
                          size_t errlen)
{
    if (n_slots == 0 || n_fill > n_slots || n_workers == 0 || n_workers > MOE_POOL_MAX_WORKERS ||
        n_slots > (uint32_t)INT32_MAX)
        return moe_fail(err, errlen, MOE_ERANGE, "expert store: a pool of %u slots for %u workers "
                        "filled with %u blobs", n_slots, n_workers, n_fill);
    return store_create(out, m, n_threads, n_slots, n_workers, fill, n_fill, progress, user, err,
                        errlen);
}

struct moe_pool *moe_store_pool(struct moe_store *s)
{
    return s && s->pooled ? &s->pool : NULL;
}

/* ---- worker side ---------------------------------------------------------------------------- */

static const struct moe_tensor *expert_view(const struct moe_expert *x, int k)
{
    return k == 0 ? &x->gate : k == 1 ? &x->up : &x->down;
}

static int check_store(struct moe_store *s, const struct moe_model *m, char *err, size_t errlen)
{
    const struct moe_store_header *h = s->hdr;
    static const char *const kn[3] = {"gate", "up", "down"};

    if (memcmp(h->magic, MOE_STORE_MAGIC, 8) != 0)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: bad magic (not a moed store)");
    if (h->version != MOE_STORE_VERSION)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: version %u, this build reads %u",
                        h->version, MOE_STORE_VERSION);
    if (h->header_size != sizeof *h)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: header_size %u, expected %zu",
                        h->header_size, sizeof *h);
    if (h->total_size != s->size)
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "expert store: header says %" PRIu64 " bytes, the fd has %" PRIu64,
                        h->total_size, s->size);
    if (h->fingerprint != m->fingerprint)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "expert store: fingerprint %016" PRIx64 " does not match the model's %016"
                        PRIx64 " (built from another GGUF)", h->fingerprint, m->fingerprint);
    if (h->n_layer != m->hp.n_layer || h->n_expert != m->hp.n_expert)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "expert store: %u layers x %u experts, the model has %u x %u", h->n_layer,
                        h->n_expert, m->hp.n_layer, m->hp.n_expert);

    /* Tables: inside the file, contiguous, after the header, before the dense region. */
    uint64_t size = s->size;
    if (h->layer_table_off < sizeof *h || h->layer_table_off % 8 || h->layer_table_off > size ||
        (uint64_t)h->n_layer * sizeof(struct moe_store_layer) > size - h->layer_table_off)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: layer table at %" PRIu64
                        " does not fit", h->layer_table_off);
    if (h->dense_table_off != h->layer_table_off + (uint64_t)h->n_layer * sizeof(struct moe_store_layer) ||
        h->n_dense > (size - h->dense_table_off) / sizeof(struct moe_store_dense))
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: dense table (%" PRIu64
                        " entries at %" PRIu64 ") does not fit", h->n_dense, h->dense_table_off);
    uint64_t tables_end = h->dense_table_off + h->n_dense * sizeof(struct moe_store_dense);
    uint64_t hash = XXH3_64bits(s->base + h->layer_table_off, tables_end - h->layer_table_off);
    if (hash != h->tables_hash)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: table hash %016" PRIx64
                        " != %016" PRIx64 " in the header (damaged)", hash, h->tables_hash);
    s->layers = (const struct moe_store_layer *)(s->base + h->layer_table_off);
    s->dense = (const struct moe_store_dense *)(s->base + h->dense_table_off);
    if (h->dense_off < tables_end || h->dense_off > size || h->dense_size > size - h->dense_off)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: dense region [%" PRIu64 ", +%"
                        PRIu64 ") is outside the store", h->dense_off, h->dense_size);
    if (h->experts_off < h->dense_off + h->dense_size || h->experts_off > size ||
        h->experts_size > size - h->experts_off)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert store: expert region [%" PRIu64 ", +%"
                        PRIu64 ") is outside the store", h->experts_off, h->experts_size);

    bool pooled = h->pool_table_off != 0;
    if (pooled) {
        if (h->pool_slot_bytes == 0 || h->pool_slot_bytes % MOE_STORE_BLOB_ALIGN ||
            h->pool_slots == 0 || h->pool_slots > INT32_MAX ||
            h->pool_slots > h->experts_size / h->pool_slot_bytes ||
            h->pool_table_off % MOE_STORE_BLOB_ALIGN ||
            h->pool_table_off < h->experts_off + h->experts_size || h->pool_table_off > size ||
            h->pool_table_size > size - h->pool_table_off ||
            h->pool_table_size < sizeof(struct moe_pool_head))
            return moe_fail(err, errlen, MOE_EFORMAT, "expert store: pool of %" PRIu64 " slots of %"
                            PRIu64 " bytes, table at %" PRIu64 " (+%" PRIu64 ") does not fit",
                            h->pool_slots, h->pool_slot_bytes, h->pool_table_off,
                            h->pool_table_size);
    }
    uint64_t prev_end = h->experts_off;
    for (uint32_t l = 0; l < h->n_layer; l++) {
        const struct moe_store_layer *L = &s->layers[l];
        const struct moe_expert *x = &m->layers[l].experts[0];
        uint64_t end_region = h->experts_off + h->experts_size;
        if (pooled) {
            if (L->blobs_off != h->experts_off || L->blob_stride != h->pool_slot_bytes ||
                L->blob_bytes > L->blob_stride)
                return moe_fail(err, errlen, MOE_EFORMAT, "expert store: layer %u: blobs of %"
                                PRIu64 " bytes do not fit the pool's slots", l, L->blob_bytes);
        } else if (L->blob_stride == 0 || L->blob_stride % MOE_STORE_BLOB_ALIGN ||
            L->blobs_off % MOE_STORE_BLOB_ALIGN || L->blob_bytes > L->blob_stride ||
            L->blobs_off < prev_end || L->blobs_off > end_region ||
            L->blob_stride > (end_region - L->blobs_off) / h->n_expert)
            return moe_fail(err, errlen, MOE_EFORMAT, "expert store: layer %u: blobs at %" PRIu64
                            " stride %" PRIu64 " do not fit the expert region", l, L->blobs_off,
                            L->blob_stride);
        else
            prev_end = L->blobs_off + L->blob_stride * h->n_expert;
        for (int k = 0; k < 3; k++) {
            const struct moe_tensor *v = expert_view(x, k);
            if (L->off[k] > L->blob_bytes || L->size[k] > L->blob_bytes - L->off[k])
                return moe_fail(err, errlen, MOE_EFORMAT, "expert store: layer %u %s slice [%"
                                PRIu64 ", +%" PRIu64 ") is outside its blob (%" PRIu64 " bytes)",
                                l, kn[k], L->off[k], L->size[k], L->blob_bytes);
            if (L->size[k] != v->nbytes || L->type[k] != v->type)
                return moe_fail(err, errlen, MOE_ERANGE, "expert store: layer %u %s: %" PRIu64
                                " bytes of type %u, the model has %zu bytes of type %u", l, kn[k],
                                L->size[k], L->type[k], v->nbytes, v->type);
        }
    }

    for (uint64_t i = 0; i < h->n_dense; i++) {
        const struct moe_store_dense *d = &s->dense[i];
        if (!memchr(d->name, '\0', sizeof d->name))
            return moe_fail(err, errlen, MOE_EFORMAT, "expert store: dense entry %" PRIu64
                            ": name is not terminated", i);
        if (d->off < h->dense_off || d->off > h->dense_off + h->dense_size ||
            d->size > h->dense_off + h->dense_size - d->off)
            return moe_fail(err, errlen, MOE_EFORMAT, "expert store: dense %s [%" PRIu64 ", +%"
                            PRIu64 ") is outside the dense region", d->name, d->off, d->size);
        if (i > 0 && d->src_off < s->dense[i - 1].src_off + s->dense[i - 1].size)
            return moe_fail(err, errlen, MOE_EFORMAT, "expert store: dense %s: source ranges are "
                            "unsorted or overlap", d->name);
        if (m->gguf) {
            const struct gguf_tensor *t = gguf_find_tensor(m->gguf, d->name);
            if (!t || m->gguf->data_offset + t->offset != d->src_off || t->nbytes != d->size ||
                t->type != d->type)
                return moe_fail(err, errlen, MOE_ERANGE, "expert store: dense %s (%" PRIu64
                                " bytes at file offset %" PRIu64 ") does not match the GGUF",
                                d->name, d->size, d->src_off);
        }
    }
    return 0;
}

int moe_store_attach(struct moe_store **out, int fd, const struct moe_model *m, char *err,
                     size_t errlen)
{
    int rc;
    struct stat st;
    struct moe_store *s = calloc(1, sizeof *s);
    if (err && errlen)
        err[0] = '\0';
    if (!s)
        return moe_fail(err, errlen, -ENOMEM, "expert store: out of memory");
    s->base = MAP_FAILED;
    s->fd = -1;
    if (!m || !m->layers || m->hp.n_layer == 0 || m->hp.n_expert == 0) {
        rc = moe_fail(err, errlen, MOE_EINTERNAL, "expert store: attach needs a described model");
        goto fail;
    }
    s->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (s->fd < 0) {
        rc = moe_fail(err, errlen, -errno, "expert store: fd %d: %s", fd, strerror(errno));
        goto fail;
    }
    /* Without these seals the daemon (or anyone holding the fd) could shrink the file under our
     * mapping and turn weight reads into SIGBUS. */
    int seals = fcntl(s->fd, F_GET_SEALS);
    if (seals < 0) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "expert store: fd %d is not a sealable memfd (%s)",
                      fd, strerror(errno));
        goto fail;
    }
    if ((seals & (F_SEAL_GROW | F_SEAL_SHRINK)) != (F_SEAL_GROW | F_SEAL_SHRINK)) {
        rc = moe_fail(err, errlen, MOE_EFORMAT,
                      "expert store: fd %d is not sealed against growing and shrinking", fd);
        goto fail;
    }
    if (fstat(s->fd, &st) != 0) {
        rc = moe_fail(err, errlen, -errno, "expert store: fstat: %s", strerror(errno));
        goto fail;
    }
    if ((uint64_t)st.st_size < sizeof(struct moe_store_header)) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "expert store: %lld bytes, smaller than a header",
                      (long long)st.st_size);
        goto fail;
    }
    s->size = (uint64_t)st.st_size;
    s->base = mmap(NULL, s->size, PROT_READ, MAP_SHARED, s->fd, 0);
    if (s->base == MAP_FAILED) {
        rc = moe_fail(err, errlen, -errno, "expert store: mmap %" PRIu64 " bytes: %s", s->size,
                      strerror(errno));
        goto fail;
    }
    s->info.thp_advised = madvise(s->base, s->size, MADV_HUGEPAGE) == 0;
    read_thp_mode(s->info.thp_shmem_mode, sizeof s->info.thp_shmem_mode);
    s->hdr = (const struct moe_store_header *)s->base;
    if ((rc = check_store(s, m, err, errlen)))
        goto fail;
    if (s->hdr->pool_table_off) {
        /* The slot table is where workers pin slots: it is the one writable part. */
        const struct moe_store_header *h = s->hdr;
        s->table_size = h->pool_table_size;
        s->table = mmap(NULL, s->table_size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd,
                        (off_t)h->pool_table_off);
        if (s->table == MAP_FAILED) {
            s->table = NULL;
            rc = moe_fail(err, errlen, -errno, "expert store: mapping the slot table: %s",
                          strerror(errno));
            goto fail;
        }
        const struct moe_pool_head *ph = (const struct moe_pool_head *)s->table;
        if (ph->n_slots != h->pool_slots || ph->slot_bytes != h->pool_slot_bytes ||
            ph->n_layer != h->n_layer || ph->n_expert != h->n_expert || ph->n_workers == 0 ||
            ph->n_workers > MOE_POOL_MAX_WORKERS || ph->quota == 0 ||
            moe_pool_table_bytes(ph->n_layer, ph->n_expert, ph->n_slots, ph->n_workers) >
                s->table_size) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "expert store: the slot table does not match "
                          "the header (%u slots, %u workers)", ph->n_slots, ph->n_workers);
            goto fail;
        }
        moe_pool_bind(&s->pool, s->table, (uint8_t *)s->base + h->experts_off, h->experts_off);
        s->pooled = true;
        s->info.pool_slots = (uint32_t)h->pool_slots;
        s->info.pool_slot_bytes = h->pool_slot_bytes;
    }
    s->info.size = s->size;
    s->info.fingerprint = s->hdr->fingerprint;
    s->info.n_layer = s->hdr->n_layer;
    s->info.n_expert = s->hdr->n_expert;
    s->info.n_dense = (uint32_t)s->hdr->n_dense;
    s->info.dense_bytes = 0;
    for (uint64_t i = 0; i < s->hdr->n_dense; i++)
        s->info.dense_bytes += s->dense[i].size;
    for (uint32_t l = 0; l < s->hdr->n_layer; l++)
        s->info.expert_bytes += (s->layers[l].size[0] + s->layers[l].size[1] +
                                 s->layers[l].size[2]) * s->hdr->n_expert;
    *out = s;
    return 0;
fail:
    moe_store_close(s);
    return rc;
}

/* Every dense view of a model with the GGUF name it stands for (for messages). Adding a field to
 * struct moe_layer or moe_model means adding it here, or apply leaves it pointing at the GGUF. */
struct view_ref {
    struct moe_tensor *t;
    char name[GGUF_NAME_MAX];
};

static size_t dense_views(struct moe_model *m, struct view_ref *v)
{
    size_t n = 0;
#define VIEW(field, ...)                                                                       \
    do {                                                                                       \
        v[n].t = &(field);                                                                     \
        snprintf(v[n].name, sizeof v[n].name, __VA_ARGS__);                                    \
        n++;                                                                                   \
    } while (0)
    VIEW(m->token_embd, "token_embd");
    VIEW(m->output_norm, "output_norm");
    VIEW(m->output, "output");
    for (uint32_t l = 0; l < m->hp.n_layer; l++) {
        struct moe_layer *L = &m->layers[l];
        VIEW(L->attn_norm, "blk.%u.attn_norm", l);
        VIEW(L->attn_q, "blk.%u.attn_q", l);
        VIEW(L->attn_k, "blk.%u.attn_k", l);
        VIEW(L->attn_v, "blk.%u.attn_v", l);
        VIEW(L->attn_output, "blk.%u.attn_output", l);
        VIEW(L->attn_q_norm, "blk.%u.attn_q_norm", l);
        VIEW(L->attn_k_norm, "blk.%u.attn_k_norm", l);
        VIEW(L->ffn_norm, "blk.%u.ffn_norm", l);
        VIEW(L->ffn_gate_inp, "blk.%u.ffn_gate_inp", l);
    }
#undef VIEW
    return n;
}
#define DENSE_VIEWS_PER_LAYER 9
#define DENSE_VIEWS_GLOBAL 3

/* The dense entry whose source range holds [off, off + len), or NULL. */
static const struct moe_store_dense *find_dense(const struct moe_store *s, uint64_t off,
                                                uint64_t len)
{
    uint64_t lo = 0, hi = s->hdr->n_dense;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (s->dense[mid].src_off <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return NULL;
    const struct moe_store_dense *d = &s->dense[lo - 1];
    if (off - d->src_off > d->size || len > d->size - (off - d->src_off))
        return NULL;
    return d;
}

int moe_store_apply(const struct moe_store *s, struct moe_model *m, char *err, size_t errlen)
{
    int rc = 0;
    const struct moe_store_header *h = s->hdr;
    if (err && errlen)
        err[0] = '\0';
    if (h->fingerprint != m->fingerprint || h->n_layer != m->hp.n_layer ||
        h->n_expert != m->hp.n_expert || !m->layers)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "expert store: store %016" PRIx64 " (%u x %u) is for another model than %016"
                        PRIx64 " (%u x %u)", h->fingerprint, h->n_layer, h->n_expert,
                        m->fingerprint, m->hp.n_layer, m->hp.n_expert);

    size_t nv = DENSE_VIEWS_GLOBAL + (size_t)m->hp.n_layer * DENSE_VIEWS_PER_LAYER;
    struct view_ref *v = calloc(nv, sizeof *v);
    if (!v)
        return moe_fail(err, errlen, -ENOMEM, "expert store: out of memory");
    nv = dense_views(m, v);
    const uint8_t *fb = m->gguf ? m->gguf->base : NULL;
    uint64_t fsize = m->gguf ? m->gguf->size : 0;
    for (size_t i = 0; i < nv; i++) {
        struct moe_tensor *t = v[i].t;
        const uint8_t *p = t->data;
        if (!p)
            continue; /* optional tensor the model does not have */
        if (p >= s->base && p < s->base + s->size)
            continue;
        if (!fb || p < fb || p >= fb + fsize) {
            rc = moe_fail(err, errlen, MOE_ENOTFOUND, "expert store: %s points neither into the "
                          "GGUF nor into the store", v[i].name);
            goto fail;
        }
        uint64_t off = (uint64_t)(p - fb);
        const struct moe_store_dense *d = find_dense(s, off, t->nbytes);
        if (!d) {
            rc = moe_fail(err, errlen, MOE_ENOTFOUND, "expert store: %s (%zu bytes at file offset %"
                          PRIu64 ") is not in the store's dense region", v[i].name, t->nbytes, off);
            goto fail;
        }
        t->data = s->base + d->off + (off - d->src_off);
    }
    for (uint32_t l = 0; l < h->n_layer; l++) {
        const struct moe_store_layer *L = &s->layers[l];
        for (uint32_t e = 0; e < h->n_expert; e++) {
            struct moe_expert *x = &m->layers[l].experts[e];
            struct moe_tensor *views[3] = {&x->gate, &x->up, &x->down};
            /* Tiered: blobs move between slots; views name slot 0 until the compute asks the
             * pool where the expert is (the engine's expert source). */
            const uint8_t *blob = s->base + L->blobs_off +
                                  (s->pooled ? 0 : (uint64_t)e * L->blob_stride);
            for (int k = 0; k < 3; k++) {
                if (views[k]->nbytes != L->size[k] || views[k]->type != L->type[k]) {
                    rc = moe_fail(err, errlen, MOE_ERANGE, "expert store: layer %u expert %u "
                                  "slice %d: %zu bytes of type %u, the store has %" PRIu64
                                  " of type %u", l, e, k, views[k]->nbytes, views[k]->type,
                                  L->size[k], L->type[k]);
                    goto fail;
                }
                views[k]->data = blob + L->off[k];
            }
        }
    }
    m->gguf = NULL;
fail:
    free(v);
    return rc;
}

int moe_store_open_model(struct moe_store **out, int fd, struct moe_model *m, char *err,
                         size_t errlen)
{
    struct moe_store *s;
    int rc = moe_store_attach(&s, fd, m, err, errlen);
    if (rc)
        return rc;
    if ((rc = moe_store_apply(s, m, err, errlen))) {
        moe_store_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

int moe_store_fd(const struct moe_store *s)
{
    return s->fd;
}

uint64_t moe_store_size(const struct moe_store *s)
{
    return s->size;
}

const void *moe_store_base(const struct moe_store *s)
{
    return s->base;
}

int moe_store_blob(const struct moe_store *s, uint32_t layer, uint32_t expert, const void **ptr,
                   uint64_t *size)
{
    if (layer >= s->hdr->n_layer || expert >= s->hdr->n_expert)
        return MOE_ERANGE;
    if (s->pooled)
        return MOE_ENOTFOUND;
    const struct moe_store_layer *L = &s->layers[layer];
    *ptr = s->base + L->blobs_off + (uint64_t)expert * L->blob_stride;
    *size = L->blob_bytes;
    return 0;
}

const struct moe_store_layer *moe_store_layer(const struct moe_store *s, uint32_t layer)
{
    return layer < s->hdr->n_layer ? &s->layers[layer] : NULL;
}

int moe_store_dense(const struct moe_store *s, const char *name, const void **ptr,
                    uint64_t *size)
{
    for (uint64_t i = 0; i < s->hdr->n_dense; i++)
        if (!strcmp(s->dense[i].name, name)) {
            *ptr = s->base + s->dense[i].off;
            *size = s->dense[i].size;
            return 0;
        }
    return MOE_ENOTFOUND;
}

void moe_store_get_info(const struct moe_store *s, struct moe_store_info *out)
{
    *out = s->info;
}

void moe_store_close(struct moe_store *s)
{
    if (!s)
        return;
    if (s->base != MAP_FAILED && s->base)
        munmap(s->base, s->size);
    if (s->table)
        munmap(s->table, s->table_size);
    if (s->fd >= 0)
        close(s->fd);
    free(s);
}
