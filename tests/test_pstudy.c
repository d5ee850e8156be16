/* The layer-ahead prediction study (worker/cpu/pstudy.h): each predictor's top k, k+2 and k+4
 * are scored against the choices its layer then makes, only where every predictor had a guess. */
#include <math.h>
#include <string.h>

#include "tests/harness.h"
#include "worker/cpu/pstudy.h"

/* Logits that rank the experts in `order` first (best first), every other expert below. */
static void rank(float *lg, int nexp, const int *order, int n)
{
    for (int x = 0; x < nexp; x++)
        lg[x] = -100.0f - (float)x;
    for (int i = 0; i < n; i++)
        lg[order[i]] = 100.0f - (float)i;
}

TEST(pstudy_scores_each_predictor_at_each_cut)
{
    struct moe_pstudy ps;
    CHECK_EQ(moe_pstudy_init(&ps, 3, 16, 2), 0);
    float lg[16];
    const int32_t sel_a[2] = {5, 9}, sel_b[2] = {5, 11};
    /* Step 1: no predictor has a guess yet (the previous choices are missing): nothing scored. */
    for (int l = 1; l < 3; l++) {
        const int o[6] = {5, 9, 1, 2, 3, 4};
        rank(lg, 16, o, 6);
        for (int p = 0; p < MOE_PS_COUNT; p++)
            moe_pstudy_predict(&ps, l, p, lg);
    }
    moe_pstudy_actual(&ps, 0, sel_a);
    moe_pstudy_actual(&ps, 1, sel_a);
    moe_pstudy_actual(&ps, 2, sel_a);
    CHECK_EQ(ps.looked, 0);
    /* Step 2, layer 1 chooses {5, 11}: X has both in its top 2, XW has 11 at rank 3 (top 4),
     * POST at rank 6 (top 6), and PREV remembers {5, 9}. */
    const int ox[2] = {11, 5}, oxw[4] = {5, 0, 11, 1}, opost[6] = {5, 0, 1, 2, 3, 11};
    rank(lg, 16, ox, 2);
    moe_pstudy_predict(&ps, 1, MOE_PS_X, lg);
    rank(lg, 16, oxw, 4);
    moe_pstudy_predict(&ps, 1, MOE_PS_XW, lg);
    rank(lg, 16, opost, 6);
    moe_pstudy_predict(&ps, 1, MOE_PS_POST, lg);
    rank(lg, 16, oxw, 4);
    moe_pstudy_predict(&ps, 1, MOE_PS_XW2, lg);
    moe_pstudy_actual(&ps, 1, sel_b);
    CHECK_EQ(ps.looked, 2);
    CHECK_EQ(ps.hits[MOE_PS_X][0], 2);
    CHECK_EQ(ps.hits[MOE_PS_XW][0], 1);
    CHECK_EQ(ps.hits[MOE_PS_XW][1], 2);
    CHECK_EQ(ps.hits[MOE_PS_POST][0], 1);
    CHECK_EQ(ps.hits[MOE_PS_POST][1], 1);
    CHECK_EQ(ps.hits[MOE_PS_POST][2], 2);
    CHECK_EQ(ps.hits[MOE_PS_PREV][0], 1);
    CHECK_EQ(ps.hits[MOE_PS_XW2][1], 2);
    /* A guess is used once: layer 1 again without fresh guesses is not scored. */
    moe_pstudy_actual(&ps, 1, sel_b);
    CHECK_EQ(ps.looked, 2);
    /* NaN logits come after every number, the last of them first (the routing's own rule); the
     * report names every predictor. */
    for (int x = 0; x < 16; x++)
        lg[x] = NAN;
    lg[7] = 1.0f;
    moe_pstudy_predict(&ps, 2, MOE_PS_X, lg);
    CHECK_EQ(ps.pred[(2 * MOE_PS_COUNT + MOE_PS_X) * 6], 7);
    CHECK_EQ(ps.pred[(2 * MOE_PS_COUNT + MOE_PS_X) * 6 + 1], 15);
    CHECK_EQ(ps.pred[(2 * MOE_PS_COUNT + MOE_PS_X) * 6 + 2], 14);
    char buf[2048] = {0};
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    CHECK(f != NULL);
    moe_pstudy_report(&ps, f);
    fclose(f);
    CHECK(strstr(buf, "2 choices") && strstr(buf, "top 2: 100.0%") && strstr(buf, "top 4:"));
    moe_pstudy_free(&ps);
    CHECK_EQ(moe_pstudy_init(&ps, 0, 16, 2), -1);
}
