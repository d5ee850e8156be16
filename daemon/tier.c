/* The daemon's side of the tiered store (see tier.h). */
#include "daemon/tier.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "proto/ipc.h"
#include "store/err.h"
#include "store/io.h"
#include "store/pool.h"

#define RETRY_MS 2            /* every slot pinned: look again this often */
#define RETRY_GIVE_UP_MS 60000
#define LAT_BUCKETS 32        /* read latency: bucket i counts reads of [2^(i-1), 2^i) us */

/* One blob's state on the daemon side. */
struct pend {
    uint64_t waiters;         /* workers (bits) waiting for the read under way */
    int32_t slot;             /* slot being written, while reading */
    bool reading;
    bool ahead;               /* the read under way is a read-ahead */
};

struct retry {
    uint32_t worker, blob;
    uint64_t since;
};

struct rd {
    uv_work_t req;
    struct moed_tier *t;
    uint32_t blob;
    int32_t slot;
    bool ahead;
    uint8_t *dst;
    uint64_t off[3], size[3], dst_off[3], blob_bytes;
    int code;
    char msg[200];
    double seconds;
};

struct moed_tier {
    struct moed_tier_opts o;
    struct moe_pool *pool;
    uint32_t n_layer, n_expert, n_blobs;
    int fd;
    int dfd;                  /* the file again with O_DIRECT, or -1: buffered reads */
    /* what the file was when the daemon opened it */
    uint64_t size, head_len, head_hash;
    struct timespec mtime;
    struct pend *pend;        /* [n_blobs] */
    struct retry *retry;
    size_t n_retry, cap_retry;
    uv_timer_t timer;
    bool timer_on;
    uint32_t ahead_in_flight;
    uint32_t *bonus;          /* [n_blobs] ms of recency credit from the profile */
    uint64_t bonus_at;        /* uv_now() of its computation; 0: never */
    struct moed_tier_stats st;
    uint64_t lat[LAT_BUCKETS];
    char direct_error[96];    /* why O_DIRECT was not taken ("" when it was, or not tried) */
};

static void count_latency(struct moed_tier *t, double seconds)
{
    uint64_t us = (uint64_t)(seconds * 1e6);
    int i = 0;
    while (i < LAT_BUCKETS - 1 && us >= (1ull << i))
        i++;
    t->lat[i]++;
}

/* The upper bound (ms) of the bucket holding quantile q of the reads. */
static double latency_quantile(const struct moed_tier *t, double q)
{
    uint64_t total = 0, seen = 0;
    for (int i = 0; i < LAT_BUCKETS; i++)
        total += t->lat[i];
    if (!total)
        return 0;
    for (int i = 0; i < LAT_BUCKETS; i++) {
        seen += t->lat[i];
        if ((double)seen >= q * (double)total)
            return (double)(1ull << i) / 1000.0;
    }
    return (double)(1ull << (LAT_BUCKETS - 1)) / 1000.0;
}

/* Recency credit of each blob from the profile: up to 4 s for an expert its layer routes to at
 * four times the fair share. Recomputed at most once a second (the profile moves slowly). */
static void refresh_bonus(struct moed_tier *t)
{
    uint64_t now = uv_now(t->o.loop);
    if (t->bonus_at && now - t->bonus_at < 1000)
        return;
    t->bonus_at = now ? now : 1;
    const uint64_t *c = t->o.counts ? t->o.counts(t->o.user) : NULL;
    for (uint32_t l = 0; l < t->n_layer; l++) {
        uint64_t sum = 0;
        for (uint32_t e = 0; c && e < t->n_expert; e++)
            sum += c[l * t->n_expert + e];
        for (uint32_t e = 0; e < t->n_expert; e++) {
            uint32_t b = l * t->n_expert + e;
            double fair = sum ? (double)c[b] * t->n_expert / (double)sum : 0.0;
            t->bonus[b] = (uint32_t)(1000.0 * (fair > 4.0 ? 4.0 : fair));
        }
    }
}

/* A slot to load into: an empty one, else the unpinned one with the oldest use (the profile
 * makes popular experts look younger). Claimed (LOADING), or -1 when every slot is pinned. */
static int32_t take_slot(struct moed_tier *t)
{
    struct moe_pool *p = t->pool;
    refresh_bonus(t);
    for (int pass = 0; pass < 2; pass++) {
        int32_t best = moe_pool_victim(p, t->bonus);
        if (best < 0)
            return -1;
        int32_t old = atomic_load(&p->slot[best].blob);
        if (moe_pool_claim(p, best)) {
            if (old >= 0)
                t->st.evictions++;
            return best;
        }
        /* A worker pinned it while we looked: once more, then wait for the retry timer. */
    }
    return -1;
}

static void answer(struct moed_tier *t, uint32_t w, uint32_t blob, int32_t slot, int code,
                   const char *msg)
{
    uint32_t l = blob / t->n_expert, e = blob % t->n_expert;
    uint64_t off = 0, size = 0;
    if (!code) {
        const struct moe_store_layer *L = moe_store_layer(t->o.store, l);
        off = t->pool->slots_off + (uint64_t)slot * t->pool->slot_bytes;
        size = L->blob_bytes;
    }
    t->o.answer(t->o.user, w, l, e, off, size, code, msg);
}

/* The file must still be the one the store was built from: same inode, size and, when it was
 * written to, the same header and tensor table. */
static int check_file(struct moed_tier *t, char *msg, size_t n)
{
    struct stat st;
    if (fstat(t->fd, &st) != 0)
        return moe_fail(msg, n, -errno, "%s: fstat: %s", t->o.path, strerror(errno));
    if ((uint64_t)st.st_size != t->size)
        return moe_fail(msg, n, MOE_EFORMAT, "%s changed under the daemon: %lld bytes, it had %"
                        PRIu64 " (restart moed to serve the new file)", t->o.path,
                        (long long)st.st_size, t->size);
    if (st.st_mtim.tv_sec == t->mtime.tv_sec && st.st_mtim.tv_nsec == t->mtime.tv_nsec)
        return 0;
    uint8_t *head = malloc(t->head_len);
    if (!head)
        return moe_fail(msg, n, -ENOMEM, "out of memory");
    ssize_t got = pread(t->fd, head, t->head_len, 0);
    uint64_t h = got == (ssize_t)t->head_len ? XXH3_64bits(head, t->head_len) : 0;
    free(head);
    if (got != (ssize_t)t->head_len || h != t->head_hash)
        return moe_fail(msg, n, MOE_EFORMAT, "%s changed under the daemon: its header and tensor "
                        "table are not the ones the store was built from (restart moed)",
                        t->o.path);
    return 0;
}

/* n bytes at off into dst (EINTR and short reads retried), or at least `need` of them when the
 * file ends first: 0, or the error (with the offset it stopped at in *at). */
static int read_full(int fd, uint8_t *dst, uint64_t n, uint64_t need, uint64_t off, uint64_t *at)
{
    uint64_t done = 0;
    while (done < n) {
        ssize_t got = pread(fd, dst + done, n - done, (off_t)(off + done));
        if (got < 0 && errno == EINTR)
            continue;
        if (got == 0 && done >= need)
            break;
        if (got <= 0) {
            *at = off + done;
            return got < 0 ? -errno : MOE_EFORMAT;
        }
        done += (uint64_t)got;
    }
    return 0;
}

/* O_DIRECT reads go through an aligned buffer of the thread pool thread: the blocks covering
 * [off, off + n) (the file's last one may come short), then the wanted bytes copied out. */
#define DIRECT_ALIGN 4096u
static _Thread_local uint8_t *direct_buf;
static _Thread_local size_t direct_cap;

static int read_direct(int fd, uint8_t *dst, uint64_t n, uint64_t off, uint64_t *at)
{
    const uint64_t a = off & ~(uint64_t)(DIRECT_ALIGN - 1);
    const uint64_t end = (off + n + DIRECT_ALIGN - 1) & ~(uint64_t)(DIRECT_ALIGN - 1);
    const uint64_t len = end - a;
    if (len > direct_cap) {
        free(direct_buf);
        direct_cap = 0;
        if (!(direct_buf = aligned_alloc(DIRECT_ALIGN, len))) {
            *at = off;
            return -ENOMEM;
        }
        direct_cap = len;
    }
    int rc = read_full(fd, direct_buf, len, off + n - a, a, at);
    if (!rc)
        memcpy(dst, direct_buf + (off - a), n);
    return rc;
}

static void read_work(uv_work_t *req)
{
    struct rd *r = req->data;
    struct moed_tier *t = r->t;
    double t0 = moe_now_s();
    r->code = check_file(t, r->msg, sizeof r->msg);
    for (int k = 0; k < 3 && !r->code; k++) {
        uint64_t at = 0;
        uint8_t *dst = r->dst + r->dst_off[k];
        r->code = t->dfd >= 0 ? read_direct(t->dfd, dst, r->size[k], r->off[k], &at)
                              : read_full(t->fd, dst, r->size[k], r->size[k], r->off[k], &at);
        if (r->code)
            snprintf(r->msg, sizeof r->msg, "%s: reading expert (%u, %u) at %" PRIu64 ": %s",
                     t->o.path, r->blob / t->n_expert, r->blob % t->n_expert, at,
                     r->code == MOE_EFORMAT ? "the file ends early" : strerror(-r->code));
    }
    /* A file that shrank or changed during the read must not leave mixed bytes in a slot. */
    if (!r->code)
        r->code = check_file(t, r->msg, sizeof r->msg);
    if (!r->code)
        t->pool->slot[r->slot].hash = moe_pool_slot_hash(t->pool, r->slot, r->blob_bytes);
    /* The blob now lives in the pool: keeping its pages in the page cache as well would spend
     * the RAM the budget keeps free (O_DIRECT reads leave none). */
    for (int k = 0; k < 3 && !r->code && t->dfd < 0; k++)
        posix_fadvise(t->fd, (off_t)r->off[k], (off_t)r->size[k], POSIX_FADV_DONTNEED);
    r->seconds = moe_now_s() - t0;
}

static void read_done(uv_work_t *req, int status)
{
    struct rd *r = req->data;
    struct moed_tier *t = r->t;
    struct pend *pd = &t->pend[r->blob];
    if (status && !r->code) {
        r->code = MOE_ECANCELED;
        snprintf(r->msg, sizeof r->msg, "read cancelled");
    }
    t->st.read_seconds += r->seconds;
    count_latency(t, r->seconds);
    uint64_t waiters = pd->waiters;
    pd->waiters = 0;
    pd->reading = false;
    pd->ahead = false;
    if (r->ahead)
        t->ahead_in_flight--;
    if (r->code) {
        t->st.read_errors++;
        moe_pool_release_claim(t->pool, r->slot);
        moe_ipc_log(MOE_LOG_ERROR, "tiered store: %s", r->msg);
        for (uint32_t w = 0; w < 64; w++)
            if (waiters >> w & 1)
                answer(t, w, r->blob, -1, r->code, r->msg);
    } else {
        t->st.reads++;
        t->st.prefetch_reads += r->ahead;
        t->st.read_bytes += r->size[0] + r->size[1] + r->size[2];
        moe_pool_publish(t->pool, r->slot, r->blob, UINT32_MAX);
        for (uint32_t w = 0; w < 64; w++)
            if (waiters >> w & 1 && moe_pool_pin_for(t->pool, r->slot, r->blob, w))
                answer(t, w, r->blob, r->slot, 0, NULL);
    }
    free(r);
}

/* Starts the read of blob into a free slot; false when no slot is free now. */
static bool start_read(struct moed_tier *t, uint32_t blob, bool ahead, char *msg, size_t n,
                       int *code)
{
    *code = 0;
    int32_t slot = take_slot(t);
    if (slot < 0)
        return false;
    uint32_t l = blob / t->n_expert, e = blob % t->n_expert;
    struct moe_expert_slice sl;
    struct rd *r = calloc(1, sizeof *r);
    int rc = r ? moe_model_expert_slice(t->o.model, l, e, &sl) : -ENOMEM;
    if (rc) {
        free(r);
        moe_pool_release_claim(t->pool, slot);
        *code = moe_fail(msg, n, rc, "expert (%u, %u): %s", l, e, moe_strerror(rc));
        return true;
    }
    const struct moe_store_layer *L = moe_store_layer(t->o.store, l);
    r->t = t;
    r->blob = blob;
    r->slot = slot;
    r->dst = t->pool->slots_base + (uint64_t)slot * t->pool->slot_bytes;
    r->blob_bytes = L->blob_bytes;
    for (int k = 0; k < 3; k++) {
        r->off[k] = sl.off[k];
        r->size[k] = sl.size[k];
        r->dst_off[k] = L->off[k];
    }
    r->req.data = r;
    if ((rc = uv_queue_work(t->o.loop, &r->req, read_work, read_done))) {
        free(r);
        moe_pool_release_claim(t->pool, slot);
        *code = moe_fail(msg, n, MOE_EINTERNAL, "uv_queue_work: %s", uv_strerror(rc));
        return true;
    }
    r->ahead = ahead;
    t->pend[blob].reading = true;
    t->pend[blob].ahead = ahead;
    t->pend[blob].slot = slot;
    t->ahead_in_flight += ahead;
    return true;
}

static void arm_retry(struct moed_tier *t);

/* Serves (worker, blob) now if it can: in the pool already, a read under way, or a slot free.
 * Returns false when it has to wait for a slot. */
static bool serve(struct moed_tier *t, uint32_t w, uint32_t blob)
{
    struct pend *pd = &t->pend[blob];
    if (pd->reading) {
        pd->waiters |= 1ull << w;
        t->st.merged++;
        t->st.prefetch_used += pd->ahead;
        return true;
    }
    int32_t s = atomic_load(&t->pool->where[blob]);
    if (s >= 0 && moe_pool_pin_for(t->pool, s, blob, w)) {
        answer(t, w, blob, s, 0, NULL); /* it arrived while the request was on its way */
        return true;
    }
    char msg[200];
    int code;
    if (!start_read(t, blob, false, msg, sizeof msg, &code))
        return false;
    if (code)
        answer(t, w, blob, -1, code, msg);
    else
        pd->waiters |= 1ull << w;
    return true;
}

static void on_retry(uv_timer_t *tm)
{
    struct moed_tier *t = tm->data;
    uint64_t now = uv_now(t->o.loop);
    size_t keep = 0;
    for (size_t i = 0; i < t->n_retry; i++) {
        struct retry *q = &t->retry[i];
        if (serve(t, q->worker, q->blob))
            continue;
        if (now - q->since > RETRY_GIVE_UP_MS) {
            answer(t, q->worker, q->blob, -1, MOE_ETOOBIG, "every slot of the expert pool stayed "
                   "pinned for 60 s (raise --ram-budget)");
            continue;
        }
        t->retry[keep++] = *q;
    }
    t->n_retry = keep;
    if (!keep) {
        uv_timer_stop(&t->timer);
        t->timer_on = false;
    }
}

static void arm_retry(struct moed_tier *t)
{
    if (!t->timer_on) {
        uv_timer_start(&t->timer, on_retry, RETRY_MS, RETRY_MS);
        t->timer_on = true;
    }
}

/* A read-ahead: the victim rule of demand reads, at most prefetch_max at a time. */
static void read_ahead(struct moed_tier *t, uint32_t blob)
{
    char msg[200];
    int code;
    t->st.prefetch_requests++;
    if (t->pend[blob].reading || atomic_load(&t->pool->where[blob]) >= 0)
        return;
    if (t->ahead_in_flight >= t->o.prefetch_max || !start_read(t, blob, true, msg, sizeof msg, &code))
        t->st.prefetch_dropped++;
}

void moed_tier_request(struct moed_tier *t, uint32_t worker, uint32_t layer, uint32_t expert,
                       bool prefetch)
{
    uint32_t blob = layer * t->n_expert + expert;
    if (worker >= t->pool->n_workers || blob >= t->n_blobs)
        return; /* validated by the caller */
    if (prefetch) {
        read_ahead(t, blob);
        return;
    }
    t->st.requests++;
    if (serve(t, worker, blob))
        return;
    t->st.no_slot++;
    if (t->n_retry == t->cap_retry) {
        size_t nc = t->cap_retry ? t->cap_retry * 2 : 16;
        struct retry *p = realloc(t->retry, nc * sizeof *p);
        if (!p) {
            answer(t, worker, blob, -1, -ENOMEM, "out of memory");
            return;
        }
        t->retry = p;
        t->cap_retry = nc;
    }
    t->retry[t->n_retry++] = (struct retry){worker, blob, uv_now(t->o.loop)};
    arm_retry(t);
}

void moed_tier_worker_gone(struct moed_tier *t, uint32_t worker)
{
    if (worker >= t->pool->n_workers)
        return;
    for (uint32_t b = 0; b < t->n_blobs; b++)
        t->pend[b].waiters &= ~(1ull << worker);
    size_t keep = 0;
    for (size_t i = 0; i < t->n_retry; i++)
        if (t->retry[i].worker != worker)
            t->retry[keep++] = t->retry[i];
    t->n_retry = keep;
    uint64_t n = moe_pool_reclaim(t->pool, worker);
    t->st.reclaimed += n;
    if (n)
        moe_ipc_log(MOE_LOG_INFO, "tiered store: reclaimed %" PRIu64 " pins of worker %u", n,
                    worker);
}

void moed_tier_stats(const struct moed_tier *t, struct moed_tier_stats *out)
{
    *out = t->st;
    out->read_p50_ms = latency_quantile(t, 0.50);
    out->read_p99_ms = latency_quantile(t, 0.99);
    out->resident = 0;
    out->pinned = 0;
    for (uint32_t s = 0; s < t->pool->n_slots; s++) {
        if (atomic_load(&t->pool->slot[s].blob) >= 0)
            out->resident++;
        out->pinned += moe_pool_slot_refs(t->pool, (int32_t)s);
    }
}

int moed_tier_new(struct moed_tier **out, const struct moed_tier_opts *o, char *err,
                  size_t errlen)
{
    struct moe_pool *p = moe_store_pool(o->store);
    const struct gguf_file *f = o->model->gguf;
    if (!p || !f)
        return moe_fail(err, errlen, MOE_EINTERNAL, "tiered store: no pool or no file");
    struct moed_tier *t = calloc(1, sizeof *t);
    if (!t)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    t->o = *o;
    t->pool = p;
    t->n_layer = o->model->hp.n_layer;
    t->n_expert = o->model->hp.n_expert;
    t->n_blobs = t->n_layer * t->n_expert;
    t->pend = calloc(t->n_blobs, sizeof *t->pend);
    t->bonus = calloc(t->n_blobs, sizeof *t->bonus);
    t->fd = open(o->path, O_RDONLY | O_CLOEXEC);
    t->dfd = -1;
    struct stat st;
    int rc = 0;
    if (!t->pend || !t->bonus)
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
    else if (t->fd < 0 || fstat(t->fd, &st) != 0)
        rc = moe_fail(err, errlen, -errno, "%s: %s", o->path, strerror(errno));
    else if ((uint64_t)st.st_size != f->size)
        rc = moe_fail(err, errlen, MOE_EFORMAT, "%s changed while the daemon opened it", o->path);
    if (rc) {
        moed_tier_free(t);
        return rc;
    }
    t->size = (uint64_t)st.st_size;
    t->mtime = st.st_mtim;
    t->head_len = f->data_offset < f->size ? f->data_offset : f->size;
    t->head_hash = XXH3_64bits(f->base, t->head_len);
    /* O_DIRECT where the file system takes it (a probe read of the first block), unless
     * buffered reads are asked for. */
    t->direct_error[0] = 0;
    if (o->io != MOED_TIER_IO_BUFFERED) {
        t->dfd = open(o->path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        uint8_t *probe = t->dfd >= 0 ? aligned_alloc(DIRECT_ALIGN, DIRECT_ALIGN) : NULL;
        ssize_t got = probe ? pread(t->dfd, probe, DIRECT_ALIGN, 0) : -1;
        if (got < 0 || (got < (ssize_t)DIRECT_ALIGN && (uint64_t)got != t->size)) {
            snprintf(t->direct_error, sizeof t->direct_error, "%s",
                     t->dfd < 0 || got < 0 ? strerror(errno) : "a short read");
            if (t->dfd >= 0)
                close(t->dfd);
            t->dfd = -1;
        }
        free(probe);
        if (t->dfd < 0 && o->io == MOED_TIER_IO_DIRECT) {
            rc = moe_fail(err, errlen, -EINVAL, "--pool-io direct: %s refuses O_DIRECT reads (%s)",
                          o->path, t->direct_error);
            moed_tier_free(t);
            return rc;
        }
    }
    uv_timer_init(o->loop, &t->timer);
    t->timer.data = t;
    t->st.slots = p->n_slots;
    t->st.slot_bytes = p->slot_bytes;
    t->st.n_blobs = t->n_blobs;
    *out = t;
    return 0;
}

void moed_tier_free(struct moed_tier *t)
{
    if (!t)
        return;
    if (t->fd >= 0)
        close(t->fd);
    if (t->dfd >= 0)
        close(t->dfd);
    free(t->pend);
    free(t->bonus);
    free(t->retry);
    free(t);
}

struct rank {
    uint64_t count;
    uint32_t layer, expert;
};

static int cmp_rank(const void *a, const void *b)
{
    const struct rank *x = a, *y = b;
    if (x->count != y->count)
        return x->count > y->count ? -1 : 1;
    if (x->expert != y->expert)
        return x->expert < y->expert ? -1 : 1;
    return x->layer < y->layer ? -1 : x->layer > y->layer;
}

uint32_t moed_tier_fill_order(const uint64_t *counts, uint32_t n_layer, uint32_t n_expert,
                              uint32_t n_slots, uint32_t *out)
{
    uint32_t nb = n_layer * n_expert;
    struct rank *r = malloc(sizeof *r * (nb ? nb : 1));
    if (!r)
        return 0;
    for (uint32_t l = 0; l < n_layer; l++)
        for (uint32_t e = 0; e < n_expert; e++)
            r[l * n_expert + e] = (struct rank){counts ? counts[l * n_expert + e] : 0, l, e};
    qsort(r, nb, sizeof *r, cmp_rank);
    uint32_t n = n_slots < nb ? n_slots : nb;
    for (uint32_t i = 0; i < n; i++)
        out[i] = r[i].layer * n_expert + r[i].expert;
    free(r);
    return n;
}

const char *moed_tier_io(const struct moed_tier *t, const char **why)
{
    if (why)
        *why = t->direct_error;
    return t->dfd >= 0 ? "direct" : "buffered";
}
