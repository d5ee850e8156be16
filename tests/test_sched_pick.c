/* The scheduler's choice of a worker for a request (sched_pick, daemon/sched_int.h): measured
 * decode rates, prefix affinity, free slots and recency, on made-up worker states. */
#include "daemon/sched_int.h"
#include "tests/harness.h"

#define CAND(fr, aff, nfree, rate, last) ((struct sched_cand){fr, aff, nfree, rate, last})

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
