/* A fixed thread pool for the CPU backend: parallel loops over independent tasks.
 *
 * moe_pool_for() runs fn(ctx, task, ith) for every task in [0, n_tasks). The caller works on
 * the tasks itself (as thread 0); helpers join when they wake up and claim tasks from a shared
 * counter. A helper that wakes after every task was claimed does nothing, so the caller never
 * waits for a thread that has not started: on an oversubscribed machine (tests in parallel on
 * 2 cores) a region degrades to serial speed instead of stalling on the scheduler.
 *
 * Which thread runs a task is not deterministic; results are, as long as every task writes its
 * own outputs. `ith` (0..nth-1, unique among the threads running at a time) indexes per-thread
 * scratch. */
#ifndef MOE_CPU_POOL_H
#define MOE_CPU_POOL_H

#include <stdint.h>

struct moe_pool;

typedef void (*moe_pool_task_fn)(void *ctx, int64_t task, int ith);

/* Starts n_threads - 1 helper threads (n_threads <= 0: one per online CPU; capped at 256).
 * Returns 0 or a negative errno. */
int moe_pool_init(struct moe_pool **out, int n_threads);

/* Stops and joins the helpers. NULL is allowed. */
void moe_pool_free(struct moe_pool *p);

/* Thread count, the caller included. */
int moe_pool_size(const struct moe_pool *p);

/* Runs every task and returns when all have finished. One or zero tasks run inline. Not
 * reentrant: fn must not call moe_pool_for, and only one thread may call it at a time. */
void moe_pool_for(struct moe_pool *p, int64_t n_tasks, moe_pool_task_fn fn, void *ctx);

#endif
