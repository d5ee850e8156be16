/* How well the next layer's experts can be predicted before its router runs: a measurement aid
 * of the CPU backend (MOE_CPU_PREDICT_STUDY=1, one-token steps), for choosing the layer-ahead
 * prefetch's predictor (docs/offload.md). Each predictor hands in its logits for layer l+1 while
 * layer l runs; when layer l+1 routes, its chosen experts are looked up in each predictor's top
 * k, k+2 and k+4. Plain C, no allocation after create. */
#ifndef MOE_CPU_PSTUDY_H
#define MOE_CPU_PSTUDY_H

#include <stdint.h>
#include <stdio.h>

enum {
    MOE_PS_X,       /* layer l+1's router on layer l's normed MoE input */
    MOE_PS_XW,      /* the same input re-weighted by ffn_norm[l+1] / ffn_norm[l] */
    MOE_PS_POST,    /* on the residual after layer l's experts, normed with ffn_norm[l+1] */
    MOE_PS_PREV,    /* layer l+1's choices at the previous one-token step */
    MOE_PS_XW2,     /* two layers ahead: layer l+2's router on layer l's input, re-weighted */
    MOE_PS_COUNT
};

#define MOE_PS_CUTS 3 /* top k, k + 2, k + 4 */

struct moe_pstudy {
    int L, nexp, kuse;
    int32_t *pred;    /* [L][MOE_PS_COUNT][kuse + 4] predicted ids, best first; -1: none */
    int32_t *prev;    /* [L][kuse] the layer's last choices; -1: none yet */
    uint8_t *taken;   /* [nexp] zero, for the top-k */
    uint64_t hits[MOE_PS_COUNT][MOE_PS_CUTS];
    uint64_t looked;  /* choices compared (kuse per layer and step) */
};

/* 0, or -1 when out of memory. */
int moe_pstudy_init(struct moe_pstudy *ps, int L, int nexp, int kuse);
void moe_pstudy_free(struct moe_pstudy *ps);

/* Predictor p's guess for layer l from its logits [nexp] (the top kuse + 4 kept). */
void moe_pstudy_predict(struct moe_pstudy *ps, int l, int p, const float *logits);

/* Layer l chose sel[0..kuse): scores every predictor's guess for l, then makes the choices
 * MOE_PS_PREV's guess for l's next step. */
void moe_pstudy_actual(struct moe_pstudy *ps, int l, const int32_t *sel);

/* Recall per predictor and cut, one line each. */
void moe_pstudy_report(const struct moe_pstudy *ps, FILE *f);

#endif
