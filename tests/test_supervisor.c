/* The supervisor and scheduler with real worker processes on the golden tiny model, driven by a
 * libuv loop in the test: golden greedy tokens, concurrency, kill -9 of a worker mid-generation,
 * a worker that speaks garbage, workers that never start (given up on), queue limits, cancel,
 * drain, and the shared expert store. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <uv.h>

#include "daemon/sched.h"
#include "daemon/supervisor.h"
#include "proto/ipc.h"
#include "store/err.h"
#include "store/expert_store.h"
#include "store/gguf.h"
#include "store/model.h"
#include "store/workload.h"
#include "tests/harness.h"
#include "tests/ipc_test.h"

struct ctx;

struct treq {
    struct ctx *c;
    struct sched_req *r;
    int32_t tok[512];
    int n;
    bool done, failed;
    int status;
    char msg[320];
    enum sched_finish why;
    uint32_t n_prompt, n_gen;
    /* hooks */
    bool kill_on_first_token;
    bool cancel_on_first_token;
};

struct ctx {
    uv_loop_t loop;
    uv_timer_t tick;
    struct moed_workers *ws;
    struct sched *s;
    bool ready, stopped;
    uint64_t routed[3];
    uint64_t routed_tokens;
    int routing_calls;
    int state_changes;
};

static void on_tick(uv_timer_t *t)
{
    (void)t;
}

static void on_routing(void *user, uint32_t worker, const uint64_t *counts, uint32_t n_layer,
                       uint32_t n_expert, uint64_t n_tokens)
{
    struct ctx *c = user;
    (void)worker;
    CHECK_EQ(n_layer, 3);
    CHECK_EQ(n_expert, 16);
    for (uint32_t l = 0; l < n_layer; l++)
        for (uint32_t e = 0; e < n_expert; e++)
            c->routed[l] += counts[l * n_expert + e];
    c->routed_tokens += n_tokens;
    c->routing_calls++;
}

static void on_ready(void *user)
{
    ((struct ctx *)user)->ready = true;
}

static void on_state(void *user, uint32_t worker, enum moed_worker_state st)
{
    (void)worker, (void)st;
    ((struct ctx *)user)->state_changes++;
}

static void on_stopped(void *user)
{
    ((struct ctx *)user)->stopped = true;
}

/* Runs the loop until *flag is true (checked between iterations) or secs pass. */
#define RUN_UNTIL(c, cond, secs)                                                          \
    do {                                                                                  \
        double t_end_ = moe_test_now() + (secs);                                                 \
        while (!(cond) && moe_test_now() < t_end_)                                               \
            uv_run(&(c)->loop, UV_RUN_ONCE);                                              \
        CHECK_MSG((cond), "timed out after %.0f s waiting for %s", (double)(secs), #cond); \
    } while (0)

static void base_opts(struct ctx *c, struct moed_workers_opts *o, uint32_t n_workers, uint32_t n_seq,
                      uint32_t n_ctx)
{
    memset(o, 0, sizeof *o);
    o->model_path = ipc_test_model;
    o->worker_bin = ipc_test_worker_bin();
    CHECK(o->worker_bin);
    o->n_workers = n_workers;
    o->n_ctx = n_ctx;
    o->n_seq = n_seq;
    o->n_threads = 1;
    o->store_fd = -1;
    o->n_vocab = 4160;
    o->n_layer = 3;
    o->n_expert = 16;
    o->on_routing = on_routing;
    o->on_ready = on_ready;
    o->on_worker_state = on_state;
    o->user = c;
}

static void start(struct ctx *c, const struct moed_workers_opts *o, bool wait_ready)
{
    CHECK(uv_loop_init(&c->loop) == 0);
    uv_timer_init(&c->loop, &c->tick);
    uv_timer_start(&c->tick, on_tick, 5, 5);
    char err[256];
    int rc = moed_workers_start(&c->loop, o, &c->ws, err, sizeof err);
    CHECK_MSG(rc == 0, "moed_workers_start: %s", err);
    c->s = moed_workers_sched(c->ws);
    if (wait_ready)
        RUN_UNTIL(c, c->ready, 60);
}

/* After the workers stopped: frees them and checks that every handle was closed. */
static void finish(struct ctx *c)
{
    moed_workers_free(c->ws);
    uv_close((uv_handle_t *)&c->tick, NULL);
    uv_run(&c->loop, UV_RUN_DEFAULT);
    CHECK_EQ(uv_loop_close(&c->loop), 0);
}

static void stop(struct ctx *c)
{
    moed_workers_stop(c->ws, 10000, on_stopped, c);
    RUN_UNTIL(c, c->stopped, 30);
    finish(c);
}

static void load_refs(struct ipc_test_ref ref[3])
{
    CHECK(ipc_test_load_ref("p1", &ref[0]) == 0);
    CHECK(ipc_test_load_ref("p2", &ref[1]) == 0);
    CHECK(ipc_test_load_ref("p3", &ref[2]) == 0);
}

static int worker_pid_running(struct ctx *c, uint32_t *which)
{
    struct moed_worker_info inf;
    uint32_t total;
    moed_workers_ready(c->ws, &total);
    for (uint32_t i = 0; i < total; i++) {
        CHECK_EQ(moed_workers_info(c->ws, i, &inf), 0);
        if (inf.running > 0 && inf.pid > 0) {
            if (which)
                *which = i;
            return inf.pid;
        }
    }
    return 0;
}

static void cb_token(struct sched_req *r, void *user, int32_t token)
{
    struct treq *t = user;
    CHECK(r == t->r);
    CHECK(!t->done && !t->failed);
    CHECK(t->n < 512);
    t->tok[t->n++] = token;
    if (t->n == 1 && t->kill_on_first_token) {
        int pid = worker_pid_running(t->c, NULL);
        CHECK(pid > 0);
        CHECK(kill(pid, SIGKILL) == 0);
    }
    if (t->n == 1 && t->cancel_on_first_token) {
        sched_cancel(t->c->s, r);
        t->r = NULL;
    }
}

static void cb_done(struct sched_req *r, void *user, enum sched_finish why, uint32_t n_prompt,
                    uint32_t n_gen)
{
    struct treq *t = user;
    CHECK(r == t->r);
    CHECK(!t->done && !t->failed);
    t->done = true;
    t->why = why;
    t->n_prompt = n_prompt;
    t->n_gen = n_gen;
    t->r = NULL;
}

static void cb_error(struct sched_req *r, void *user, int http_status, const char *message)
{
    struct treq *t = user;
    CHECK(r == t->r);
    CHECK(!t->done && !t->failed);
    t->failed = true;
    t->status = http_status;
    snprintf(t->msg, sizeof t->msg, "%s", message);
    t->r = NULL;
}

static void submit(struct ctx *c, struct treq *t, const int32_t *prompt, uint32_t n_prompt,
                   uint32_t max_tokens)
{
    memset(t, 0, sizeof *t);
    t->c = c;
    struct sched_params p = {0};
    p.prompt = prompt;
    p.n_prompt = n_prompt;
    p.max_tokens = max_tokens;
    p.sampling.top_p = 1;
    p.sampling.repetition_penalty = 1;
    p.cb = (struct sched_cb){cb_token, cb_done, cb_error, NULL};
    p.user = t;
    int status = 0;
    char msg[256];
    t->r = sched_submit(c->s, &p, &status, msg, sizeof msg);
    CHECK_MSG(t->r, "sched_submit: %d %s", status, msg);
}

static int n_finished(const struct treq *t, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++)
        k += t[i].done || t[i].failed;
    return k;
}

static void check_greedy(const struct treq *t, const struct ipc_test_ref *ref, int n)
{
    CHECK_MSG(t->done, "request failed: %d %s", t->status, t->msg);
    CHECK(t->n >= n);
    for (int i = 0; i < n; i++)
        CHECK_MSG(t->tok[i] == ref->greedy[i], "token %d: %d, golden %d", i, t->tok[i], ref->greedy[i]);
}

TEST_TIMEOUT(supervisor_serves_golden_greedy_tokens, 120)
{
    struct ipc_test_ref ref;
    CHECK(ipc_test_load_ref("p1", &ref) == 0);
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 2, 4, 256);
    start(&c, &o, true);

    uint32_t total;
    CHECK_EQ(moed_workers_ready(c.ws, &total), 2);
    CHECK_EQ(total, 2);
    for (uint32_t i = 0; i < 2; i++) {
        struct moed_worker_info inf;
        CHECK_EQ(moed_workers_info(c.ws, i, &inf), 0);
        CHECK_EQ(inf.state, MOED_WORKER_READY);
        CHECK(inf.pid > 0 && kill(inf.pid, 0) == 0);
        CHECK_EQ(inf.n_seq, 4);
        CHECK_EQ(inf.n_ctx, 256);
        CHECK(inf.weights_bytes > 1000000 && inf.kv_bytes > 0);
        CHECK_STREQ(inf.device, "cpu");
    }

    /* A placement of the wrong size is refused here; a right one goes to every worker, which
     * would drop the connection (and fail the request below) if it did not pass its checks. */
    uint8_t hot[6] = {0xff, 0x0f, 0, 0xf0, 0x33, 0x01};
    CHECK_EQ(moed_workers_set_placement(c.ws, hot, 5, NULL), -EINVAL);
    CHECK_EQ(moed_workers_set_placement(c.ws, hot, 6, NULL), 0);
    /* With the counts a GPU worker re-pins by (a CPU worker keeps them and has nothing to do). */
    uint64_t counts[3 * 16];
    for (int i = 0; i < 48; i++)
        counts[i] = (uint64_t)(i * 7 % 13);
    CHECK_EQ(moed_workers_set_placement(c.ws, hot, 6, counts), 0);

    struct treq t;
    submit(&c, &t, ref.prompt, ref.n_prompt, 32);
    RUN_UNTIL(&c, t.done || t.failed, 60);
    check_greedy(&t, &ref, 32);
    CHECK_EQ(t.n, 32);
    CHECK_EQ(t.why, SCHED_FINISH_LENGTH);
    CHECK_EQ(t.n_prompt, ref.n_prompt);
    CHECK_EQ(t.n_gen, 32);

    /* Routing deltas: each evaluated token (the prompt and 31 fed-back tokens) chose 4 experts
     * in each of the 3 layers. */
    uint64_t evaluated = ref.n_prompt + 31;
    RUN_UNTIL(&c, c.routed_tokens >= evaluated, 10);
    CHECK_EQ(c.routed_tokens, evaluated);
    for (int l = 0; l < 3; l++)
        CHECK_EQ(c.routed[l], 4 * evaluated);

    struct sched_stats st;
    sched_get_stats(c.s, &st);
    CHECK_EQ(st.requests_total, 1);
    CHECK_EQ(st.requests_failed, 0);
    CHECK_EQ(st.gen_tokens_total, 32);
    CHECK_EQ(st.prompt_tokens_total, ref.n_prompt);
    CHECK_EQ(st.workers_ready, 2);
    CHECK_EQ(st.queued + st.running, 0);
    stop(&c);
}

TEST_TIMEOUT(supervisor_runs_8_concurrent_requests, 180)
{
    struct ipc_test_ref ref[3];
    load_refs(ref);
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 2, 4, 256);
    start(&c, &o, true);
    struct treq t[8];
    for (int i = 0; i < 8; i++)
        submit(&c, &t[i], ref[i % 3].prompt, ref[i % 3].n_prompt, 32);
    struct sched_stats st;
    sched_get_stats(c.s, &st);
    CHECK_EQ(st.running, 8); /* 2 workers x 4 slots: nobody waits */
    CHECK_EQ(st.queued, 0);
    RUN_UNTIL(&c, n_finished(t, 8) == 8, 120);
    for (int i = 0; i < 8; i++) {
        check_greedy(&t[i], &ref[i % 3], 32);
        CHECK_EQ(t[i].n_prompt, ref[i % 3].n_prompt);
    }
    /* Both workers took part. */
    for (uint32_t w = 0; w < 2; w++) {
        struct moed_worker_info inf;
        moed_workers_info(c.ws, w, &inf);
        CHECK(inf.tokens_generated >= 32);
    }
    stop(&c);
}

static uint32_t total_restarts(struct ctx *c)
{
    uint32_t n = 0, total;
    moed_workers_ready(c->ws, &total);
    for (uint32_t w = 0; w < total; w++) {
        struct moed_worker_info inf;
        moed_workers_info(c->ws, w, &inf);
        n += inf.restarts;
    }
    return n;
}

/* Small forward steps (n_batch 8) and staggered arrivals: prompts are evaluated in chunks over
 * several steps, in the same batches as other sequences' decode tokens. Greedy output must not
 * change. */
TEST_TIMEOUT(supervisor_continuous_batching_is_exact, 120)
{
    struct ipc_test_ref ref[3];
    load_refs(ref);
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 1, 4, 256);
    o.n_batch = 8;
    start(&c, &o, true);
    struct treq t[5];
    submit(&c, &t[0], ref[0].prompt, ref[0].n_prompt, 32);
    RUN_UNTIL(&c, t[0].n >= 3, 60);
    submit(&c, &t[1], ref[1].prompt, ref[1].n_prompt, 32);
    submit(&c, &t[2], ref[2].prompt, ref[2].n_prompt, 32);
    RUN_UNTIL(&c, t[1].n >= 1, 60);
    submit(&c, &t[3], ref[0].prompt, ref[0].n_prompt, 32);
    submit(&c, &t[4], ref[1].prompt, ref[1].n_prompt, 32); /* waits for a slot */
    RUN_UNTIL(&c, n_finished(t, 5) == 5, 120);
    for (int i = 0; i < 5; i++)
        check_greedy(&t[i], &ref[i == 0 || i == 3 ? 0 : i == 2 ? 2 : 1], 32);
    stop(&c);
}

TEST_TIMEOUT(supervisor_restarts_a_killed_worker, 180)
{
    struct ipc_test_ref ref;
    CHECK(ipc_test_load_ref("p1", &ref) == 0);
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 2, 2, 2048);
    start(&c, &o, true);

    /* kill -9 during generation, after a token was streamed: the client gets an error. The
     * request is long enough (~2000 tokens) that the kill lands well before it could end. */
    struct treq t;
    submit(&c, &t, ref.prompt, ref.n_prompt, 1900);
    t.kill_on_first_token = true;
    RUN_UNTIL(&c, t.done || t.failed, 60);
    fprintf(stderr, "killed after the first token: %s after %d tokens: %d %s\n",
            t.failed ? "failed" : "done", t.n, t.status, t.msg);
    if (t.failed) {
        CHECK_EQ(t.status, 500);
        CHECK_MSG(strstr(t.msg, "killed by signal 9"), "%s", t.msg);
    } else {
        check_greedy(&t, &ref, 32); /* it raced to completion before the kill landed */
    }
    /* The worker comes back. */
    RUN_UNTIL(&c, total_restarts(&c) == 1 && moed_workers_ready(c.ws, NULL) == 2, 30);
    uint32_t restarted = 0;
    for (uint32_t w = 0; w < 2; w++) {
        struct moed_worker_info inf;
        moed_workers_info(c.ws, w, &inf);
        restarted += inf.restarts;
        if (inf.restarts)
            CHECK(inf.last_error[0]);
    }
    CHECK_EQ(restarted, 1);

    /* kill -9 right after dispatch, before any token: the request is retried elsewhere. */
    struct treq t2;
    submit(&c, &t2, ref.prompt, ref.n_prompt, 32);
    int pid = worker_pid_running(&c, NULL);
    CHECK(pid > 0);
    CHECK(kill(pid, SIGKILL) == 0);
    RUN_UNTIL(&c, t2.done || t2.failed, 60);
    fprintf(stderr, "killed before the first token: %s after %d tokens: %d %s\n",
            t2.failed ? "failed" : "done", t2.n, t2.status, t2.msg);
    if (t2.failed)
        CHECK_MSG(t2.status == 500 && t2.n > 0, "no token was streamed, yet: %d %s", t2.status, t2.msg);
    else
        check_greedy(&t2, &ref, 32);

    /* Later requests succeed. */
    RUN_UNTIL(&c, total_restarts(&c) == 2 && moed_workers_ready(c.ws, NULL) == 2, 30);
    struct treq t3[2];
    submit(&c, &t3[0], ref.prompt, ref.n_prompt, 32);
    submit(&c, &t3[1], ref.prompt, ref.n_prompt, 32);
    RUN_UNTIL(&c, (t3[0].done || t3[0].failed) && (t3[1].done || t3[1].failed), 60);
    check_greedy(&t3[0], &ref, 32);
    check_greedy(&t3[1], &ref, 32);
    stop(&c);
}

TEST_TIMEOUT(supervisor_restarts_a_worker_that_speaks_garbage, 60)
{
    /* A "worker" that answers the Hello with garbage and then hangs. */
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 1, 1, 64);
    o.worker_bin = moe_test_script("bad-worker.sh",
                                   "printf 'GARBAGE-GARBAGE-GARBAGE' >&3\nexec sleep 30\n");
    o.queue_wait_ms = 1000;
    start(&c, &o, false);

    int32_t prompt[3] = {1, 2, 3};
    struct treq t;
    submit(&c, &t, prompt, 3, 4);
    /* Rejected, killed, restarted with backoff (100, 200, 400 ms ...); the queued request is
     * answered with 503 instead of waiting forever. */
    RUN_UNTIL(&c, t.failed, 10);
    CHECK_EQ(t.status, 503);
    CHECK(strstr(t.msg, "no worker"));
    struct moed_worker_info inf;
    RUN_UNTIL(&c, (moed_workers_info(c.ws, 0, &inf), inf.restarts >= 3), 10);
    CHECK_MSG(strstr(inf.last_error, "rejected") && strstr(inf.last_error, "limit"), "%s",
              inf.last_error);
    CHECK(!c.ready);
    stop(&c);
}

TEST_TIMEOUT(supervisor_kills_a_worker_that_never_gets_ready, 60)
{
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 1, 1, 64);
    o.worker_bin = moe_test_script("mute-worker.sh", "exec sleep 30\n");
    o.ready_timeout_ms = 200;
    start(&c, &o, false);
    struct moed_worker_info inf;
    RUN_UNTIL(&c, (moed_workers_info(c.ws, 0, &inf), inf.restarts >= 2), 10);
    CHECK_MSG(strstr(inf.last_error, "not ready after 200 ms"), "%s", inf.last_error);
    stop(&c);
}

/* A worker that exits at every start is given up on after max_init_failures starts: FAILED,
 * not restarted again, on_ready never called, queued requests answered. */
TEST_TIMEOUT(supervisor_gives_up_on_a_worker_that_never_starts, 60)
{
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 1, 1, 64);
    /* It reads the start of the Hello first, so that it always dies of its own accord (and not
     * of a Hello that finds it gone). */
    o.worker_bin = moe_test_script("dead-worker.sh", "head -c 1 <&3 >/dev/null\n"
                                                     "echo 'cannot open the device' >&2\nexit 1\n");
    o.max_init_failures = 3;
    o.queue_wait_ms = 500;
    start(&c, &o, false);
    struct moed_worker_info inf;
    RUN_UNTIL(&c, (moed_workers_info(c.ws, 0, &inf), inf.state == MOED_WORKER_FAILED), 20);
    CHECK_EQ(inf.restarts, 2); /* the first start and two restarts */
    CHECK_EQ(inf.pid, 0);
    CHECK_MSG(strstr(inf.last_error, "exited with status 1"), "%s", inf.last_error);
    /* It stays failed: no restart is scheduled. */
    double t_end = moe_test_now() + 1.0;
    while (moe_test_now() < t_end)
        uv_run(&c.loop, UV_RUN_ONCE);
    moed_workers_info(c.ws, 0, &inf);
    CHECK_EQ(inf.state, MOED_WORKER_FAILED);
    CHECK_EQ(inf.restarts, 2);
    CHECK(!c.ready);
    int32_t prompt[3] = {1, 2, 3};
    struct treq t;
    submit(&c, &t, prompt, 3, 4);
    RUN_UNTIL(&c, t.failed, 10);
    CHECK_EQ(t.status, 503);
    stop(&c);
}

/* Of two workers, one keeps failing at start and the other serves: the failed one is given up
 * on, on_ready fires with one worker Ready, and requests run on it. A worker that dies after
 * Ready is restarted as before (supervisor_restarts_a_killed_worker). */
TEST_TIMEOUT(supervisor_serves_with_the_workers_that_start, 60)
{
    struct ipc_test_ref ref;
    CHECK(ipc_test_load_ref("p1", &ref) == 0);
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 2, 1, 256);
    /* The first start to take the lock directory becomes the real worker; every other exits. */
    char body[1024];
    snprintf(body, sizeof body, "mkdir '%s/lock' 2>/dev/null && exec '%s' \"$@\"\nexit 1\n",
             moe_test_tmpdir(), ipc_test_worker_bin());
    o.worker_bin = moe_test_script("one-worker.sh", body);
    o.max_init_failures = 2;
    start(&c, &o, true);
    CHECK_EQ(moed_workers_ready(c.ws, NULL), 1);
    uint32_t failed = 0;
    for (uint32_t i = 0; i < 2; i++) {
        struct moed_worker_info inf;
        moed_workers_info(c.ws, i, &inf);
        failed += inf.state == MOED_WORKER_FAILED;
    }
    CHECK_EQ(failed, 1);
    struct treq t;
    submit(&c, &t, ref.prompt, ref.n_prompt, 32);
    RUN_UNTIL(&c, t.done || t.failed, 60);
    check_greedy(&t, &ref, 32);
    stop(&c);
}

TEST_TIMEOUT(supervisor_refuses_long_prompts_and_a_full_queue, 60)
{
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 1, 1, 64);
    o.queue_max = 2;
    start(&c, &o, false);

    int32_t prompt[65];
    for (int i = 0; i < 65; i++)
        prompt[i] = 100 + i;
    struct sched_params p = {0};
    p.prompt = prompt;
    p.n_prompt = 65;
    p.max_tokens = 4;
    int status = 0;
    char msg[256];
    CHECK(!sched_submit(c.s, &p, &status, msg, sizeof msg));
    CHECK_EQ(status, 400);
    CHECK(strstr(msg, "65") && strstr(msg, "64"));
    p.n_prompt = 0;
    CHECK(!sched_submit(c.s, &p, &status, msg, sizeof msg));
    CHECK_EQ(status, 400);
    p.n_prompt = 64;
    p.max_tokens = 0;
    CHECK(!sched_submit(c.s, &p, &status, msg, sizeof msg));
    CHECK_EQ(status, 400);

    /* Before the worker is ready everything queues: two fit, the third is refused. */
    struct treq t[3];
    submit(&c, &t[0], prompt, 10, 4);
    submit(&c, &t[1], prompt, 10, 4);
    p.n_prompt = 10;
    p.max_tokens = 4;
    status = 0;
    CHECK(!sched_submit(c.s, &p, &status, msg, sizeof msg));
    CHECK_EQ(status, 503);
    struct sched_stats st;
    sched_get_stats(c.s, &st);
    CHECK_EQ(st.queued, 2);
    /* Cancelling a queued request calls nothing and frees its place. */
    sched_cancel(c.s, t[1].r);
    submit(&c, &t[2], prompt, 12, 4);
    RUN_UNTIL(&c, (t[0].done || t[0].failed) && (t[2].done || t[2].failed), 60);
    CHECK(t[0].done && t[2].done);
    CHECK(!t[1].done && !t[1].failed && t[1].n == 0);
    CHECK_EQ(t[0].n, 4);
    CHECK_EQ(t[2].n_prompt, 12);
    stop(&c);
}

TEST_TIMEOUT(supervisor_cancel_frees_the_slot, 60)
{
    struct ipc_test_ref ref;
    CHECK(ipc_test_load_ref("p1", &ref) == 0);
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 1, 1, 256);
    start(&c, &o, true);
    struct treq a, b;
    submit(&c, &a, ref.prompt, ref.n_prompt, 200);
    a.cancel_on_first_token = true;
    submit(&c, &b, ref.prompt, ref.n_prompt, 32); /* waits for the only slot */
    struct sched_stats st;
    sched_get_stats(c.s, &st);
    CHECK_EQ(st.queued, 1);
    RUN_UNTIL(&c, b.done || b.failed, 60);
    check_greedy(&b, &ref, 32);
    CHECK_EQ(a.n, 1); /* nothing after the cancel */
    CHECK(!a.done && !a.failed);
    stop(&c);
}

TEST_TIMEOUT(supervisor_stop_drains_running_requests, 60)
{
    struct ipc_test_ref ref;
    CHECK(ipc_test_load_ref("p2", &ref) == 0);
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 2, 1, 256);
    start(&c, &o, true);
    int pids[2];
    for (uint32_t i = 0; i < 2; i++) {
        struct moed_worker_info inf;
        moed_workers_info(c.ws, i, &inf);
        pids[i] = inf.pid;
    }
    struct treq run[2], queued;
    submit(&c, &run[0], ref.prompt, ref.n_prompt, 32);
    submit(&c, &run[1], ref.prompt, ref.n_prompt, 32);
    submit(&c, &queued, ref.prompt, ref.n_prompt, 32);
    moed_workers_stop(c.ws, 20000, on_stopped, &c);
    /* Queued: refused at once; new: refused; running: finish. */
    CHECK(queued.failed);
    CHECK_EQ(queued.status, 503);
    struct sched_params p = {.prompt = ref.prompt, .n_prompt = 4, .max_tokens = 1};
    int status = 0;
    char msg[128];
    CHECK(!sched_submit(c.s, &p, &status, msg, sizeof msg));
    CHECK_EQ(status, 503);
    RUN_UNTIL(&c, c.stopped, 30);
    check_greedy(&run[0], &ref, 32);
    check_greedy(&run[1], &ref, 32);
    /* The workers exited (and were reaped). */
    for (int i = 0; i < 2; i++)
        CHECK(kill(pids[i], 0) != 0 && errno == ESRCH);
    finish(&c);
}

/* With the expert store, both workers read the weights from the one memfd the daemon made. */
TEST_TIMEOUT(supervisor_workers_share_the_expert_store, 120)
{
    struct ipc_test_ref ref;
    CHECK(ipc_test_load_ref("p3", &ref) == 0);
    char err[256];
    struct gguf_file *g = NULL;
    struct moe_model m;
    CHECK_MSG(gguf_open(&g, ipc_test_model, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(moe_model_from_gguf(&m, g, err, sizeof err) == 0, "%s", err);
    struct moe_store *st = NULL;
    CHECK_MSG(moe_store_create(&st, &m, 2, NULL, NULL, err, sizeof err) == 0, "%s", err);
    struct stat sst;
    CHECK(fstat(moe_store_fd(st), &sst) == 0);

    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 2, 2, 256);
    o.store_fd = moe_store_fd(st);
    o.store_size = moe_store_size(st);
    o.store_fingerprint = m.fingerprint;
    start(&c, &o, true);
    struct treq t[2];
    submit(&c, &t[0], ref.prompt, ref.n_prompt, 32);
    submit(&c, &t[1], ref.prompt, ref.n_prompt, 32);
    RUN_UNTIL(&c, (t[0].done || t[0].failed) && (t[1].done || t[1].failed), 60);
    check_greedy(&t[0], &ref, 32);
    check_greedy(&t[1], &ref, 32);

    /* Each worker maps the daemon's memfd (same inode), not a copy of its own. */
    for (uint32_t i = 0; i < 2; i++) {
        struct moed_worker_info inf;
        moed_workers_info(c.ws, i, &inf);
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/maps", inf.pid);
        char *maps = moe_test_read_file(path, NULL);
        CHECK(maps);
        bool found = false;
        for (char *line = strtok(maps, "\n"); line; line = strtok(NULL, "\n")) {
            unsigned long long ino = 0;
            char dev[32];
            if (strstr(line, "memfd:") && sscanf(line, "%*s %*s %*s %31s %llu", dev, &ino) == 2 &&
                ino == (unsigned long long)sst.st_ino)
                found = true;
        }
        free(maps);
        CHECK_MSG(found, "worker %u (pid %d) does not map the store memfd (inode %llu)", i, inf.pid,
                  (unsigned long long)sst.st_ino);
    }
    stop(&c);
    moe_store_close(st);
    moe_model_free(&m);
    gguf_close(g);
}

/* Routing signatures (route_signatures): each Done carries its request's, and the scheduler's
 * workload table learns the requests' keys (the prompt's first 32 tokens) from them: two
 * workloads, two requests each, both keys with both requests and the prompt tokens the workers
 * evaluated; a prompt shorter than a key teaches nothing. CPU workers pin nothing. */
TEST_TIMEOUT(supervisor_learns_workloads_from_signatures, 120)
{
    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 2, 2, 256);
    o.route_signatures = true;
    start(&c, &o, true);
    int32_t p[2][48], tiny[5] = {1, 2, 3, 4, 5};
    for (int a = 0; a < 2; a++)
        for (int i = 0; i < 48; i++)
            p[a][i] = (int32_t)((a * 1543 + i * 97 + 11) % 4096);
    struct treq t[5];
    for (int r = 0; r < 4; r++) {
        p[r % 2][47] = (int32_t)(100 + r); /* same key, another ending */
        submit(&c, &t[r], p[r % 2], 48, 3);
        RUN_UNTIL(&c, t[r].done || t[r].failed, 60);
        CHECK_MSG(t[r].done, "%s", t[r].msg);
    }
    submit(&c, &t[4], tiny, 5, 3);
    RUN_UNTIL(&c, t[4].done || t[4].failed, 60);
    struct moe_wl_table *wl = sched_workloads(c.s);
    CHECK(wl);
    CHECK_EQ(wl->n, 2);
    CHECK_EQ(wl->requests, 4);
    for (int a = 0; a < 2; a++) {
        const struct moe_wl_entry *e = moe_wl_find(wl, moe_wl_key(p[a], 48));
        CHECK(e);
        CHECK_EQ(e->requests, 2);
        CHECK(e->tokens >= 48 + 1); /* the second continued from the first one's cache, or not */
        CHECK(e->n > 0);
        double sum = 0;
        for (uint32_t x = 0; x < 16; x++)
            sum += e->hist[x];
        CHECK(sum > 0);
    }
    CHECK(!sched_worker_hot_bits(c.s, 0) && !sched_worker_hot_bits(c.s, 1));
    stop(&c);
}

/* A worker whose Done carries a malformed signature, or whose Metrics a malformed hot bitmap,
 * is a protocol violation: its connection is closed with the field named, it is restarted, and
 * the daemon goes on. The "worker" sends a Ready of the model's shape and then the bad frame. */
static void bad_frame_worker(const Moed__Envelope *bad, const char *want)
{
    uint8_t *f1 = NULL, *f2 = NULL;
    size_t n1 = 0, n2 = 0;
    char err[256];
    Moed__Ready r = MOED__READY__INIT;
    r.protocol_version = MOE_IPC_PROTOCOL_VERSION;
    r.n_seq = 1;
    r.n_ctx = 64;
    r.n_vocab = 4160;
    r.n_layer = 3;
    r.n_expert = 16;
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_READY;
    env.ready = &r;
    CHECK_EQ(moe_ipc_encode(&env, 0, &f1, &n1, err, sizeof err), 0);
    CHECK_EQ(moe_ipc_encode(bad, 0, &f2, &n2, err, sizeof err), 0);
    char path[512];
    snprintf(path, sizeof path, "%s/frames.bin", moe_test_tmpdir());
    uint8_t *all = malloc(n1 + n2);
    CHECK(all);
    memcpy(all, f1, n1);
    memcpy(all + n1, f2, n2);
    moe_test_write_file(path, all, n1 + n2);
    free(all), free(f1), free(f2);
    char body[700];
    snprintf(body, sizeof body, "cat '%s' >&3\nexec sleep 30\n", path);

    struct ctx c = {0};
    struct moed_workers_opts o;
    base_opts(&c, &o, 1, 1, 64);
    o.worker_bin = moe_test_script("bad-frame-worker.sh", body);
    start(&c, &o, false);
    struct moed_worker_info inf;
    RUN_UNTIL(&c, (moed_workers_info(c.ws, 0, &inf), inf.restarts >= 2), 20);
    CHECK_MSG(strstr(inf.last_error, "rejected") && strstr(inf.last_error, want), "%s",
              inf.last_error);
    stop(&c);
}

TEST_TIMEOUT(supervisor_rejects_a_malformed_signature_or_hot_bitmap, 90)
{
    uint32_t sig[48] = {0};
    Moed__Done d = MOED__DONE__INIT;
    d.id = 1;
    d.n_prompt = 10;
    d.signature = sig;
    d.n_signature = 47; /* not 3 x 16 */
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_DONE;
    env.done = &d;
    bad_frame_worker(&env, "done.signature has 47 counts");
    d.n_signature = 48;
    sig[20] = 11; /* more than the 10 prompt tokens */
    bad_frame_worker(&env, "done.signature[20] = 11");
    uint8_t hot[7] = {0};
    Moed__Metrics m = MOED__METRICS__INIT;
    m.hot.data = hot;
    m.hot.len = 7; /* 48 bits are 6 bytes */
    env.msg_case = MOED__ENVELOPE__MSG_METRICS;
    env.metrics = &m;
    bad_frame_worker(&env, "metrics.hot has 7 bytes");
}
