/* The scheduler's choice of a worker for a request (sched_pick, daemon/sched_int.h): measured
 * decode rates, prefix affinity, free slots and recency, on made-up worker states. */
#include "daemon/sched_int.h"
#include "tests/harness.h"

#define CAND(fr, aff, nfree, rate, last) ((struct sched_cand){fr, aff, nfree, rate, last, -1.0})

TEST(sched_pick_none_free)
{
    const struct sched_cand c[2] = {CAND(false, 0, 0, 100.0, 1), CAND(false, 3, 0, 0.0, 0)};
    CHECK_EQ(sched_pick(c, 2), -1);
    CHECK_EQ(sched_pick(c, 0), -1);
}

/* A worker not measured yet counts as fast: on equal affinity it goes first (the one unused
 * longest), but a measured worker holding the prompt's prefix keeps it. */
TEST(sched_pick_measures_every_worker)
{
    struct sched_cand c[3] = {CAND(true, 0, 4, 200.0, 7), CAND(true, 0, 4, 0.0, 3),
                              CAND(true, 0, 4, 0.0, 2)};
    CHECK_EQ(sched_pick(c, 3), 2);
    c[0].affinity = 5;
    CHECK_EQ(sched_pick(c, 3), 0);
    /* A busy unmeasured worker does not count. */
    const struct sched_cand d[2] = {CAND(true, 0, 1, 200.0, 7), CAND(false, 0, 0, 0.0, 1)};
    CHECK_EQ(sched_pick(d, 2), 0);
}

/* A GPU worker (300 tok/s a sequence) and a CPU worker (15): the GPU while it has a free slot,
 * even when the CPU worker holds the prompt's prefix; the CPU worker once the GPU is full. */
TEST(sched_pick_prefers_the_fast_worker)
{
    struct sched_cand c[2] = {CAND(true, 0, 1, 300.0, 9), CAND(true, 8, 4, 15.0, 1)};
    CHECK_EQ(sched_pick(c, 2), 0);
    c[0].free = false, c[0].n_free = 0;
    CHECK_EQ(sched_pick(c, 2), 1);
    /* A loaded GPU worker whose sequences now run at 20 tok/s shares with the CPU worker. */
    c[0] = CAND(true, 0, 1, 20.0, 9);
    CHECK_EQ(sched_pick(c, 2), 1); /* affinity 8 wins among rates within the band (4x) */
}

/* Among equally fast workers (measured within 4x: noise between equal workers on a loaded
 * machine) the old rule: longest affinity, then most free slots, then the one unused longest. */
TEST(sched_pick_equal_workers_keep_affinity_then_spread)
{
    struct sched_cand c[3] = {CAND(true, 2, 1, 100.0, 5), CAND(true, 4, 1, 80.0, 6),
                              CAND(true, 4, 3, 120.0, 7)};
    CHECK_EQ(sched_pick(c, 3), 2); /* affinity 4 twice: more free slots */
    c[2].n_free = 1;
    CHECK_EQ(sched_pick(c, 3), 1); /* and on equal slots: unused longer */
    c[1].affinity = c[2].affinity = 0;
    c[0].affinity = 0;
    CHECK_EQ(sched_pick(c, 3), 0);
    /* Within the band (120 < 4 x 50) affinity still wins; outside it (120 > 4 x 25) the slow
     * one is left out even with the longest prefix. */
    c[0] = CAND(true, 9, 4, 50.0, 1);
    CHECK_EQ(sched_pick(c, 3), 0);
    c[0].rate = 25.0;
    CHECK_EQ(sched_pick(c, 3), 1);
}

/* Expected coverage (the share of the request's routed experts a worker pins): after prefix
 * affinity, a worker whose coverage is more than SCHED_COVERAGE_MARGIN below the best known is
 * left out; within the margin, and for workers whose coverage is unknown, the old tie-breakers
 * decide. */
TEST(sched_pick_prefers_the_worker_pinning_the_request_experts)
{
    struct sched_cand c[3] = {CAND(true, 0, 4, 100.0, 1), CAND(true, 0, 1, 100.0, 9),
                              CAND(true, 0, 2, 100.0, 5)};
    CHECK_EQ(sched_pick(c, 3), 0); /* unknown everywhere: most free slots */
    c[0].coverage = 0.5, c[1].coverage = 0.9, c[2].coverage = 0.3;
    CHECK_EQ(sched_pick(c, 3), 1); /* though it has the fewest free slots */
    c[0].coverage = 0.87;          /* within the margin: the tie-breakers again */
    CHECK_EQ(sched_pick(c, 3), 0);
    c[0].coverage = -1.0; /* unknown stays in; the known 0.3 goes */
    c[1].n_free = 4;
    CHECK_EQ(sched_pick(c, 3), 0); /* 0 and 1 tie on slots: unused longest */
    c[2].n_free = 9;
    CHECK_EQ(sched_pick(c, 3), 0);
    /* Prefix affinity first: the KV cache saves more than the placement. */
    c[2] = CAND(true, 3, 1, 100.0, 5);
    c[2].coverage = 0.1;
    CHECK_EQ(sched_pick(c, 3), 2);
    /* Among the longest affinity only: the worker with 0.99 and no prefix does not count. */
    c[0] = CAND(true, 3, 4, 100.0, 1);
    c[0].coverage = 0.3;
    c[1].coverage = 0.99;
    c[2].coverage = 0.4;
    CHECK_EQ(sched_pick(c, 3), 2);
    /* An affinity of the workload key's block alone (SCHED_WEAK_AFFINITY) does not outrank
     * coverage: the worker pinning the workload's experts takes the next request of that
     * application; one more shared block (a conversation going on) does. */
    c[0] = CAND(true, 1, 4, 100.0, 1);
    c[0].coverage = 0.4;
    c[1] = CAND(true, 0, 1, 100.0, 9);
    c[1].coverage = 0.8;
    c[2] = CAND(true, 1, 4, 100.0, 2);
    c[2].coverage = 0.3;
    CHECK_EQ(sched_pick(c, 3), 1);
    c[1].coverage = 0.43; /* within the margin: the longer affinity breaks the tie */
    CHECK_EQ(sched_pick(c, 3), 0);
    c[1].coverage = 0.8;
    c[0].affinity = 2;
    CHECK_EQ(sched_pick(c, 3), 0);
    /* Coverage unknown everywhere: affinity, however short, first, as without placements. */
    c[0].affinity = 1, c[0].coverage = -1.0, c[1].coverage = -1.0;
    c[2].affinity = 0, c[2].coverage = -1.0;
    CHECK_EQ(sched_pick(c, 3), 0);
    /* Speed before both: a CPU worker beside a GPU worker that pins little. */
    struct sched_cand d[2] = {CAND(true, 0, 1, 300.0, 9), CAND(true, 0, 4, 15.0, 1)};
    d[0].coverage = 0.2;
    CHECK_EQ(sched_pick(d, 2), 0);
    /* A full worker's coverage counts for nothing. */
    d[1] = CAND(false, 0, 0, 300.0, 1);
    d[1].coverage = 0.9;
    CHECK_EQ(sched_pick(d, 2), 0);
}
