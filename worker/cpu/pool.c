/* Thread pool with caller participation and late-join-safe helpers (see pool.h).
 *
 * Publishing a region: the caller stores fn/ctx/n_tasks, resets the task counter, opens the
 * region (closed = 0) and bumps `gen`. Helpers notice the bump by spinning briefly, then by a
 * condition variable (only signalled when someone sleeps).
 *
 * Closing it: when the caller finds no task left, it sets closed = 1 and waits until no helper
 * is inside the region (`active` == 0). A helper increments `active` before it checks `closed`;
 * both sides use sequentially consistent atomics, so either the caller sees the helper in
 * `active` (and waits for it), or the helper sees the region closed (and leaves without touching
 * fn/ctx, which may be gone). The caller spins briefly for stragglers, then sleeps on done_cv;
 * the helper that brings `active` to zero signals it when the caller said it is waiting (the
 * same store-then-load pairing: caller sets caller_waiting then reads active, helper decrements
 * active then reads caller_waiting). */
#include "worker/cpu/pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#define POOL_MAX_THREADS 256
/* Pause iterations before a helper sleeps: about 50-100 us, long enough to bridge the serial
 * gaps between the regions of one forward step, short enough not to steal much CPU from other
 * processes when the machine is oversubscribed. */
#define POOL_SPIN 2000

struct pool_thread {
    struct moe_pool *pool;
    int ith;
    pthread_t tid;
};

struct moe_pool {
    int nth;
    struct pool_thread *threads;   /* [nth - 1] helpers */
    int n_started;

    moe_pool_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_llong next;             /* next task to claim */
    atomic_int closed;
    atomic_int active;             /* helpers inside the current region */
    atomic_uint gen;               /* region counter */
    atomic_int n_sleeping;
    atomic_int caller_waiting;     /* the caller sleeps on done_cv until active == 0 */
    atomic_int stop;

    pthread_mutex_t mu;
    pthread_cond_t cv;             /* helpers wait here for a region */
    pthread_cond_t done_cv;        /* the caller waits here for the last helper */
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void run_tasks(struct moe_pool *p, int ith)
{
    moe_pool_task_fn fn = p->fn;
    void *ctx = p->ctx;
    int64_t n = p->n_tasks;
    for (;;) {
        int64_t i = atomic_fetch_add(&p->next, 1);
        if (i >= n)
            return;
        fn(ctx, i, ith);
    }
}

static void *pool_main(void *arg)
{
    struct pool_thread *t = arg;
    struct moe_pool *p = t->pool;
    /* Regions are only published after moe_pool_init returned, so the baseline is 0 even if
     * this thread first runs after the first region was published. */
    unsigned seen = 0;

    for (;;) {
        int spins = 0;
        while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop) && spins < POOL_SPIN) {
            cpu_relax();
            spins++;
        }
        if (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->n_sleeping, 1);
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->n_sleeping, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = atomic_load(&p->gen);
        atomic_fetch_add(&p->active, 1);
        if (!atomic_load(&p->closed))
            run_tasks(p, t->ith);
        if (atomic_fetch_sub(&p->active, 1) == 1 && atomic_load(&p->caller_waiting)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_broadcast(&p->done_cv);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

int moe_pool_init(struct moe_pool **out, int n_threads)
{
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > POOL_MAX_THREADS)
        n_threads = POOL_MAX_THREADS;

    struct moe_pool *p = calloc(1, sizeof *p);
    if (!p)
        return -ENOMEM;
    p->nth = n_threads;
    atomic_init(&p->next, 0);
    atomic_init(&p->closed, 1);
    atomic_init(&p->active, 0);
    atomic_init(&p->gen, 0);
    atomic_init(&p->n_sleeping, 0);
    atomic_init(&p->caller_waiting, 0);
    atomic_init(&p->stop, 0);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        if (!p->threads) {
            moe_pool_free(p);
            return -ENOMEM;
        }
    }
    for (int i = 1; i < n_threads; i++) {
        struct pool_thread *t = &p->threads[i - 1];
        t->pool = p;
        t->ith = i;
        int rc = pthread_create(&t->tid, NULL, pool_main, t);
        if (rc != 0) {
            moe_pool_free(p);
            return -rc;
        }
        p->n_started++;
    }
    *out = p;
    return 0;
}

void moe_pool_free(struct moe_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++)
        pthread_join(p->threads[i].tid, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p);
}

int moe_pool_size(const struct moe_pool *p)
{
    return p->nth;
}

void moe_pool_for(struct moe_pool *p, int64_t n_tasks, moe_pool_task_fn fn, void *ctx)
{
    if (n_tasks <= 0)
        return;
    if (p->nth == 1 || n_tasks == 1) {
        for (int64_t i = 0; i < n_tasks; i++)
            fn(ctx, i, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    atomic_store(&p->closed, 0);
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->n_sleeping) > 0) {
        /* Taking the mutex orders the broadcast after any helper that counted itself as
         * sleeping has actually started waiting. */
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }

    run_tasks(p, 0);

    atomic_store(&p->closed, 1);
    for (int spins = 0; atomic_load(&p->active) > 0 && spins < POOL_SPIN; spins++)
        cpu_relax();
    if (atomic_load(&p->active) > 0) {
        /* A helper is still inside a task, probably preempted: sleep instead of spinning so
         * that it gets the CPU back sooner on an oversubscribed machine. */
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_waiting, 1);
        while (atomic_load(&p->active) > 0)
            pthread_cond_wait(&p->done_cv, &p->mu);
        atomic_store(&p->caller_waiting, 0);
        pthread_mutex_unlock(&p->mu);
    }
}
