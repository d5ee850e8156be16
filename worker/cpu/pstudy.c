/* The layer-ahead predictors measured against the router's choices (pstudy.h). */
#include "worker/cpu/pstudy.h"

#include <stdlib.h>
#include <string.h>

#include "worker/cpu/kernels.h"

static const char *const ps_name[MOE_PS_COUNT] = {
    "router(l+1) on layer l's normed input",
    "the same, re-weighted by ffn_norm[l+1]/ffn_norm[l]",
    "router(l+1) on the residual after layer l's experts",
    "layer l+1's choices at the previous token",
    "router(l+2) on layer l's input, re-weighted",
};

int moe_pstudy_init(struct moe_pstudy *ps, int L, int nexp, int kuse)
{
    memset(ps, 0, sizeof *ps);
    if (L <= 0 || nexp <= 0 || kuse <= 0)
        return -1;
    ps->L = L;
    ps->nexp = nexp;
    ps->kuse = kuse;
    const size_t np = (size_t)L * MOE_PS_COUNT * (size_t)(kuse + 4);
    ps->pred = malloc(sizeof *ps->pred * np);
    ps->prev = malloc(sizeof *ps->prev * (size_t)L * (size_t)kuse);
    ps->taken = calloc((size_t)nexp, 1);
    if (!ps->pred || !ps->prev || !ps->taken) {
        moe_pstudy_free(ps);
        return -1;
    }
    for (size_t i = 0; i < np; i++)
        ps->pred[i] = -1;
    for (size_t i = 0; i < (size_t)L * (size_t)kuse; i++)
        ps->prev[i] = -1;
    return 0;
}

void moe_pstudy_free(struct moe_pstudy *ps)
{
    free(ps->pred);
    free(ps->prev);
    free(ps->taken);
    memset(ps, 0, sizeof *ps);
}

static int32_t *slot(const struct moe_pstudy *ps, int l, int p)
{
    return ps->pred + ((size_t)l * MOE_PS_COUNT + (size_t)p) * (size_t)(ps->kuse + 4);
}

void moe_pstudy_predict(struct moe_pstudy *ps, int l, int p, const float *logits)
{
    if (l < 0 || l >= ps->L || p < 0 || p >= MOE_PS_COUNT)
        return;
    int32_t *out = slot(ps, l, p);
    const int want = ps->kuse + 4 < ps->nexp ? ps->kuse + 4 : ps->nexp;
    /* The routing's own rule (ties to the lower id, NaN never beats a number). */
    moe_topk_argmax(logits, ps->nexp, want, ps->taken, out);
    for (int j = want; j < ps->kuse + 4; j++)
        out[j] = -1; /* fewer experts than guesses */
}

void moe_pstudy_actual(struct moe_pstudy *ps, int l, const int32_t *sel)
{
    if (l < 0 || l >= ps->L)
        return;
    const int K = ps->kuse;
    const int cut[MOE_PS_CUTS] = {K, K + 2, K + 4};
    /* Scored only where every predictor had a guess (the first layer and the first step have
     * none), so that the predictors are compared over the same choices. */
    for (int p = 0; p < MOE_PS_COUNT; p++)
        if (p != MOE_PS_PREV && slot(ps, l, p)[0] < 0)
            goto remember;
    if (ps->prev[(size_t)l * K] < 0)
        goto remember;
    for (int p = 0; p < MOE_PS_COUNT; p++) {
        const int32_t *g = p == MOE_PS_PREV ? ps->prev + (size_t)l * K : slot(ps, l, p);
        const int have = p == MOE_PS_PREV ? K : K + 4;
        for (int c = 0; c < MOE_PS_CUTS; c++) {
            const int n = cut[c] < have ? cut[c] : have;
            for (int j = 0; j < K; j++)
                for (int i = 0; i < n; i++)
                    if (g[i] == sel[j]) {
                        ps->hits[p][c]++;
                        break;
                    }
        }
    }
    ps->looked += (uint64_t)K;
remember:
    memcpy(ps->prev + (size_t)l * K, sel, sizeof *sel * (size_t)K);
    for (int p = 0; p < MOE_PS_COUNT; p++)
        if (p != MOE_PS_PREV)
            slot(ps, l, p)[0] = -1; /* used: the next guess must be made afresh */
}

void moe_pstudy_report(const struct moe_pstudy *ps, FILE *f)
{
    fprintf(f, "layer-ahead prediction, %llu choices of one-token steps (layers 2..%d):\n",
            (unsigned long long)ps->looked, ps->L - 1);
    for (int p = 0; p < MOE_PS_COUNT; p++) {
        fprintf(f, "  %-52s", ps_name[p]);
        for (int c = 0; c < MOE_PS_CUTS; c++) {
            if (p == MOE_PS_PREV && c > 0)
                break;
            fprintf(f, "  top %d: %5.1f%%", ps->kuse + 2 * c,
                    ps->looked ? 100.0 * (double)ps->hits[p][c] / (double)ps->looked : 0.0);
        }
        fputc('\n', f);
    }
}
