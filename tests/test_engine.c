/* Engine tests: the forward pass against an independent float64 reference on a synthetic model of
 * non-golden shapes (head_dim * n_head != n_embd, GQA 2:1, top-3 of 8, mixed block types), batch
 * layouts (prefill vs decode, interleaved sequences, chunking past n_batch), thread counts,
 * routing counts, and input validation. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "store/quant.h"
#include "tests/engine_test.h"
#include "worker/backend.h"
#include "worker/batcher.h"
#include "worker/cpu/pool.h"

/* ------------------------------------------------------------------ a synthetic model */

struct synth {
    struct moe_model m;
    void *bufs[512];
    int n_bufs;
};

static uint64_t synth_rng;

static double synth_rand(void) /* uniform in [-1, 1) */
{
    synth_rng = synth_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(synth_rng >> 11) * 0x1.0p-52 - 1.0;
}

/* A [ne1][ne0] weight of `type` with values scale * U(-1, 1) (+ offset). */
static struct moe_tensor synth_tensor(struct synth *s, uint32_t type, int64_t ne0, int64_t ne1,
                                      double scale, double offset)
{
    size_t rb = moe_row_bytes(type, ne0);
    CHECK(rb > 0);
    float *tmp = malloc(sizeof(float) * ne0);
    uint8_t *data = malloc(rb * (size_t)ne1);
    CHECK(tmp && data && s->n_bufs < 512);
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t i = 0; i < ne0; i++)
            tmp[i] = (float)(offset + scale * synth_rand());
        CHECK_EQ(moe_quantize(type, tmp, data + rb * (size_t)r, ne0), 0);
    }
    free(tmp);
    s->bufs[s->n_bufs++] = data;
    return (struct moe_tensor){.data = data, .type = type, .ne = {ne0, ne1}, .nbytes = rb * (size_t)ne1};
}

/* 2 layers, n_embd 256, 4 heads of 96 (384 != 256) over 2 KV heads, 8 experts, top-3,
 * expert_ff 64, vocab 300. Types: Q8_0 embedding, F16 head, Q6_K q, Q4_K k, Q5_K v, Q5_0 output
 * projection (row 384), F32 router, Q4_K gate/up, Q8_0 / Q4_1 down (row 64). */
static void synth_build(struct synth *s, bool norm_topk, uint64_t seed)
{
    memset(s, 0, sizeof *s);
    synth_rng = seed;
    struct moe_hparams *hp = &s->m.hp;
    *hp = (struct moe_hparams){
        .n_layer = 2, .n_ctx_train = 512, .n_embd = 256, .n_head = 4, .n_head_kv = 2,
        .head_dim = 96, .head_dim_v = 96, .n_expert = 8, .n_expert_used = 3, .expert_ff = 64,
        .n_ff = 64, .n_vocab = 300, .rms_eps = 1e-6f, .rope_base = 10000.0f, .norm_topk = norm_topk,
    };
    s->m.arch = MOE_ARCH_QWEN3MOE;
    strcpy(s->m.arch_name, "qwen3moe");
    int64_t E = 256, qd = 4 * 96, kd = 2 * 96;
    s->m.token_embd = synth_tensor(s, MOE_TYPE_Q8_0, E, 300, 1.0, 0.0);
    s->m.output_norm = synth_tensor(s, MOE_TYPE_F32, E, 1, 0.2, 1.0);
    s->m.output = synth_tensor(s, MOE_TYPE_F16, E, 300, 0.1, 0.0);
    s->m.layers = calloc(2, sizeof *s->m.layers);
    CHECK(s->m.layers);
    for (int l = 0; l < 2; l++) {
        struct moe_layer *ly = &s->m.layers[l];
        ly->attn_norm = synth_tensor(s, MOE_TYPE_F32, E, 1, 0.2, 1.0);
        ly->attn_q = synth_tensor(s, MOE_TYPE_Q6_K, E, qd, 0.1, 0.0);
        ly->attn_k = synth_tensor(s, MOE_TYPE_Q4_K, E, kd, 0.1, 0.0);
        ly->attn_v = synth_tensor(s, MOE_TYPE_Q5_K, E, kd, 0.1, 0.0);
        ly->attn_output = synth_tensor(s, MOE_TYPE_Q5_0, qd, E, 0.08, 0.0);
        ly->attn_q_norm = synth_tensor(s, MOE_TYPE_F32, 96, 1, 0.2, 1.0);
        ly->attn_k_norm = synth_tensor(s, MOE_TYPE_F32, 96, 1, 0.2, 1.0);
        ly->ffn_norm = synth_tensor(s, MOE_TYPE_F32, E, 1, 0.2, 1.0);
        ly->ffn_gate_inp = synth_tensor(s, MOE_TYPE_F32, E, 8, 0.15, 0.0);
        ly->experts = calloc(8, sizeof *ly->experts);
        CHECK(ly->experts);
        for (int x = 0; x < 8; x++) {
            ly->experts[x].gate = synth_tensor(s, MOE_TYPE_Q4_K, E, 64, 0.1, 0.0);
            ly->experts[x].up = synth_tensor(s, MOE_TYPE_Q4_K, E, 64, 0.1, 0.0);
            ly->experts[x].down = synth_tensor(s, x % 2 ? MOE_TYPE_Q4_1 : MOE_TYPE_Q8_0, 64, E,
                                               0.15, 0.0);
        }
    }
}

static void synth_free(struct synth *s)
{
    for (int l = 0; l < (int)s->m.hp.n_layer; l++)
        free(s->m.layers[l].experts);
    free(s->m.layers);
    for (int i = 0; i < s->n_bufs; i++)
        free(s->bufs[i]);
}

/* ------------------------------------------------------------------ float64 reference */

static double *deq(const struct moe_tensor *t)
{
    size_t n = (size_t)(t->ne[0] * t->ne[1]);
    float *f = malloc(sizeof(float) * n);
    double *d = malloc(sizeof(double) * n);
    CHECK(f && d);
    CHECK_EQ(moe_dequantize(t->type, t->data, f, (int64_t)n), 0);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    free(f);
    return d;
}

/* y[rows] = W[rows][n] x[n] */
static void ref_mv(const double *W, int64_t rows, int64_t n, const double *x, double *y)
{
    for (int64_t r = 0; r < rows; r++) {
        double s = 0.0;
        for (int64_t i = 0; i < n; i++)
            s += W[r * n + i] * x[i];
        y[r] = s;
    }
}

static void ref_norm(double *y, const double *x, const double *w, int64_t n, double eps)
{
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    double sc = 1.0 / sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; i++)
        y[i] = x[i] * sc * w[i];
}

/* Logits of every position of one sequence, written straight from FORMATS.md. */
static void ref_forward(const struct moe_model *m, const int32_t *tok, int64_t n, float *out)
{
    const struct moe_hparams *hp = &m->hp;
    int64_t E = hp->n_embd, H = hp->n_head, Hk = hp->n_head_kv, hd = hp->head_dim, V = hp->n_vocab;
    int64_t NE = hp->n_expert, K = hp->n_expert_used, F = hp->expert_ff;
    double eps = hp->rms_eps;
    double *emb = deq(&m->token_embd), *onw = deq(&m->output_norm), *ow = deq(&m->output);
    double *h = calloc((size_t)(n * E), sizeof(double));
    double *Kc = calloc((size_t)(n * Hk * hd), sizeof(double));
    double *Vc = calloc((size_t)(n * Hk * hd), sizeof(double));
    double *x = malloc(sizeof(double) * E), *q = malloc(sizeof(double) * H * hd);
    double *att = malloc(sizeof(double) * H * hd), *o = malloc(sizeof(double) * E);
    double *sc = malloc(sizeof(double) * n), *p = malloc(sizeof(double) * NE);
    double *g = malloc(sizeof(double) * F), *u = malloc(sizeof(double) * F);
    double *d = malloc(sizeof(double) * E), *lg = malloc(sizeof(double) * V);
    CHECK(h && Kc && Vc && x && q && att && o && sc && p && g && u && d && lg);
    for (int64_t t = 0; t < n; t++)
        memcpy(h + t * E, emb + (int64_t)tok[t] * E, sizeof(double) * E);

    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct moe_layer *ly = &m->layers[l];
        double *an = deq(&ly->attn_norm), *wq = deq(&ly->attn_q), *wk = deq(&ly->attn_k);
        double *wv = deq(&ly->attn_v), *wo = deq(&ly->attn_output), *qn = deq(&ly->attn_q_norm);
        double *kn = deq(&ly->attn_k_norm), *fn = deq(&ly->ffn_norm), *wr = deq(&ly->ffn_gate_inp);
        /* Tokens in order: token t's K/V are in the cache before its attention. */
        for (int64_t t = 0; t < n; t++) {
            double *ht = h + t * E;
            ref_norm(x, ht, an, E, eps);
            ref_mv(wq, H * hd, E, x, q);
            ref_mv(wk, Hk * hd, E, x, Kc + t * Hk * hd);
            ref_mv(wv, Hk * hd, E, x, Vc + t * Hk * hd);
            for (int64_t hh = 0; hh < H + Hk; hh++) {
                double *v = hh < H ? q + hh * hd : Kc + t * Hk * hd + (hh - H) * hd;
                ref_norm(v, v, hh < H ? qn : kn, hd, eps);
                for (int64_t i = 0; i < hd / 2; i++) {
                    double th = (double)t * pow(hp->rope_base, -2.0 * i / hd);
                    double a = v[i], b = v[i + hd / 2];
                    v[i] = a * cos(th) - b * sin(th);
                    v[i + hd / 2] = a * sin(th) + b * cos(th);
                }
            }
            for (int64_t hh = 0; hh < H; hh++) {
                int64_t kh = hh / (H / Hk);
                double mx = -INFINITY, z = 0.0;
                for (int64_t s = 0; s <= t; s++) {
                    double dot = 0.0;
                    for (int64_t i = 0; i < hd; i++)
                        dot += q[hh * hd + i] * Kc[s * Hk * hd + kh * hd + i];
                    sc[s] = dot / sqrt((double)hd);
                    mx = sc[s] > mx ? sc[s] : mx;
                }
                for (int64_t s = 0; s <= t; s++)
                    z += (sc[s] = exp(sc[s] - mx));
                for (int64_t i = 0; i < hd; i++) {
                    double acc = 0.0;
                    for (int64_t s = 0; s <= t; s++)
                        acc += sc[s] / z * Vc[s * Hk * hd + kh * hd + i];
                    att[hh * hd + i] = acc;
                }
            }
            ref_mv(wo, E, H * hd, att, o);
            for (int64_t i = 0; i < E; i++)
                ht[i] += o[i];

            ref_norm(x, ht, fn, E, eps);
            ref_mv(wr, NE, E, x, p);
            double mx = -INFINITY, z = 0.0;
            for (int64_t e = 0; e < NE; e++)
                mx = p[e] > mx ? p[e] : mx;
            for (int64_t e = 0; e < NE; e++)
                z += (p[e] = exp(p[e] - mx));
            for (int64_t e = 0; e < NE; e++)
                p[e] /= z;
            int sel[16];
            double wsum = 0.0;
            for (int64_t j = 0; j < K; j++) {
                int best = -1;
                for (int e = 0; e < NE; e++) {
                    int taken = 0;
                    for (int64_t q2 = 0; q2 < j; q2++)
                        taken |= sel[q2] == e;
                    if (!taken && (best < 0 || p[e] > p[best]))
                        best = e;
                }
                sel[j] = best;
                wsum += p[best];
            }
            for (int64_t i = 0; i < E; i++)
                o[i] = 0.0;
            for (int64_t j = 0; j < K; j++) {
                const struct moe_expert *ex = &ly->experts[sel[j]];
                double *wg = deq(&ex->gate), *wu = deq(&ex->up), *wd = deq(&ex->down);
                ref_mv(wg, F, E, x, g);
                ref_mv(wu, F, E, x, u);
                for (int64_t i = 0; i < F; i++)
                    g[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
                ref_mv(wd, E, F, g, d);
                double w = hp->norm_topk ? p[sel[j]] / wsum : p[sel[j]];
                for (int64_t i = 0; i < E; i++)
                    o[i] += w * d[i];
                free(wg), free(wu), free(wd);
            }
            for (int64_t i = 0; i < E; i++)
                ht[i] += o[i];
        }
        free(an), free(wq), free(wk), free(wv), free(wo), free(qn), free(kn), free(fn), free(wr);
    }
    for (int64_t t = 0; t < n; t++) {
        ref_norm(x, h + t * E, onw, E, eps);
        ref_mv(ow, V, E, x, lg);
        for (int64_t v = 0; v < V; v++)
            out[t * V + v] = (float)lg[v];
    }
    free(emb), free(onw), free(ow), free(h), free(Kc), free(Vc), free(x), free(q), free(att);
    free(o), free(sc), free(p), free(g), free(u), free(d), free(lg);
}

static void synth_tokens(int32_t *tok, int n, uint32_t vocab, uint64_t seed)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((seed >> 33) % vocab);
    }
}

static void synth_vs_reference(bool norm_topk)
{
    struct synth s;
    synth_build(&s, norm_topk, norm_topk ? 11 : 12);
    enum { N = 24 };
    int32_t tok[N];
    synth_tokens(tok, N, s.m.hp.n_vocab, 5);
    uint32_t V = s.m.hp.n_vocab;
    float *ref = malloc(sizeof(float) * N * V), *got = malloc(sizeof(float) * N * V);
    CHECK(ref && got);
    ref_forward(&s.m, tok, N, ref);

    struct moe_engine *e = test_engine(&s.m, 64, 1, 0, 2);
    test_prefill(e, 0, 0, tok, N, got);
    double rel = moe_test_rel_l2(got, ref, (size_t)N * V);
    double top1 = top1_agreement(got, ref, N, V);
    printf("synthetic model (norm_topk %d) vs float64 reference: rel-L2 %.3e, top-1 %.1f%%\n",
           norm_topk, rel, 100 * top1);
    CHECK_MSG(rel < test_consistency_tol(1e-5), "rel-L2 %.3e", rel);
    CHECK(top1 == 1.0);

    /* Routing counts: one per token and chosen expert, in every layer. */
    uint64_t *rc = calloc((size_t)s.m.hp.n_layer * s.m.hp.n_expert, sizeof *rc);
    CHECK(rc);
    CHECK_EQ(moe_engine_routing_counts(e, rc), 0);
    for (uint32_t l = 0; l < s.m.hp.n_layer; l++) {
        uint64_t sum = 0;
        for (uint32_t x = 0; x < s.m.hp.n_expert; x++)
            sum += rc[l * s.m.hp.n_expert + x];
        CHECK_EQ(sum, (uint64_t)N * s.m.hp.n_expert_used);
    }
    free(rc);
    moe_engine_free(e);
    free(ref), free(got);
    synth_free(&s);
}

TEST(engine_synthetic_matches_float64_reference)
{
    synth_vs_reference(true);
}

TEST(engine_synthetic_without_topk_renorm)
{
    synth_vs_reference(false);
}

/* ------------------------------------------------------------------ batch layouts */

/* Prefill in one batch vs one token per call (matmul vs matvec paths), on a golden model. */
static void prefill_vs_decode(const char *model)
{
    struct test_model tm;
    test_model_open_golden(&tm, model);
    struct golden_ref r;
    golden_load(&r, model, "p2");
    uint32_t V = tm.m.hp.n_vocab, n = (uint32_t)r.n_prompt;
    float *a = malloc(sizeof(float) * n * V), *b = malloc(sizeof(float) * n * V);
    CHECK(a && b);
    struct moe_engine *e = test_engine(&tm.m, 128, 2, 0, 2);
    test_prefill(e, 0, 0, r.prompt, n, a);
    for (uint32_t i = 0; i < n; i++)
        test_prefill(e, 1, (int32_t)i, r.prompt + i, 1, b + (size_t)i * V);
    double rel = moe_test_rel_l2(b, a, (size_t)n * V);
    printf("%s: prefill vs token-by-token: rel %.3e\n", model, rel);
    CHECK_MSG(rel <= test_consistency_tol(1e-4), "rel %.3e", rel);
    CHECK_EQ(moe_engine_seq_len(e, 0), n);
    CHECK_EQ(moe_engine_seq_len(e, 1), n);
    moe_engine_free(e);
    free(a), free(b);
    golden_free(&r);
    test_model_close(&tm);
}

TEST(engine_prefill_equals_decode_f16)
{
    prefill_vs_decode("F16");
}

TEST(engine_prefill_equals_decode_q4_k_m)
{
    prefill_vs_decode("Q4_K_M");
}

/* Two prompts interleaved token by token in one batch (plus a logits mask) give what each
 * gives alone. */
TEST(engine_interleaved_sequences)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    struct golden_ref r1, r3;
    golden_load(&r1, "Q8_0", "p1");
    golden_load(&r3, "Q8_0", "p3");
    uint32_t V = tm.m.hp.n_vocab, n1 = (uint32_t)r1.n_prompt, n3 = (uint32_t)r3.n_prompt;
    float *a1 = malloc(sizeof(float) * n1 * V), *a3 = malloc(sizeof(float) * n3 * V);
    float *mix = malloc(sizeof(float) * (n1 + n3) * V);
    int32_t *tok = malloc(sizeof(int32_t) * (n1 + n3)), *pos = malloc(sizeof(int32_t) * (n1 + n3));
    int32_t *seq = malloc(sizeof(int32_t) * (n1 + n3));
    uint8_t *want = malloc(n1 + n3);
    CHECK(a1 && a3 && mix && tok && pos && seq && want);

    struct moe_engine *e = test_engine(&tm.m, 128, 1, 0, 2);
    test_prefill(e, 0, 0, r1.prompt, n1, a1);
    moe_engine_seq_clear(e, 0);
    test_prefill(e, 0, 0, r3.prompt, n3, a3);
    moe_engine_free(e);

    /* Sequence slot 3 and 1 of 4; every third token of p3 skips its logits. */
    uint32_t k = 0, i1 = 0, i3 = 0;
    while (i1 < n1 || i3 < n3) {
        if (i3 < n3) {
            tok[k] = r3.prompt[i3], pos[k] = (int32_t)i3, seq[k] = 3, want[k] = i3 % 3 != 1;
            k++, i3++;
        }
        if (i1 < n1) {
            tok[k] = r1.prompt[i1], pos[k] = (int32_t)i1, seq[k] = 1, want[k] = 1;
            k++, i1++;
        }
    }
    e = test_engine(&tm.m, 128, 4, 0, 2);
    struct moe_batch b = {.n = k, .token = tok, .pos = pos, .seq = seq, .logits = want};
    CHECK_EQ(moe_engine_forward(e, &b, mix), 0);
    double worst = 0.0;
    uint32_t row = 0;
    for (uint32_t j = 0; j < k; j++) {
        if (!want[j])
            continue;
        const float *ref = seq[j] == 1 ? a1 + (size_t)pos[j] * V : a3 + (size_t)pos[j] * V;
        double rel = moe_test_rel_l2(mix + (size_t)row * V, ref, V);
        worst = rel > worst ? rel : worst;
        row++;
    }
    printf("interleaved vs alone: worst per-row rel %.3e over %u rows\n", worst, row);
    CHECK(worst <= test_consistency_tol(1e-4));
    moe_engine_free(e);
    free(a1), free(a3), free(mix), free(tok), free(pos), free(seq), free(want);
    golden_free(&r1);
    golden_free(&r3);
    test_model_close(&tm);
}

/* A batch longer than n_batch is evaluated in chunks with the same result. */
TEST(engine_batch_larger_than_n_batch)
{
    struct test_model tm;
    test_model_open_golden(&tm, "F16");
    struct moe_engine *e = test_engine(&tm.m, 128, 1, 7, 2);
    CHECK_EQ(moe_engine_get_opts(e)->n_batch, 7);
    struct golden_ref r;
    float *a = golden_prefill(e, tm.m.hp.n_vocab, &r, "F16", "p3");
    double rel = moe_test_rel_l2(a, r.logits, r.n_prompt * r.n_vocab);
    printf("n_batch 7: rel-L2 vs reference %.3e\n", rel);
    CHECK(rel <= 2e-3);
    moe_engine_free(e);
    free(a);
    golden_free(&r);
    test_model_close(&tm);
}

/* Thread count changes only which thread computes a row, never how. */
TEST(engine_threads_1_vs_n)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q4_K_M");
    struct golden_ref r;
    golden_load(&r, "Q4_K_M", "p1");
    uint32_t V = tm.m.hp.n_vocab, n = (uint32_t)r.n_prompt;
    float *a = malloc(sizeof(float) * n * V), *b = malloc(sizeof(float) * n * V);
    float *c = malloc(sizeof(float) * V), *d = malloc(sizeof(float) * V);
    CHECK(a && b && c && d);
    const int nth[2] = {1, 5};
    float *outs[2] = {a, b}, *dec[2] = {c, d};
    for (int k = 0; k < 2; k++) {
        struct moe_engine *e = test_engine(&tm.m, 128, 1, 0, nth[k]);
        CHECK_EQ(moe_engine_get_opts(e)->n_threads, nth[k]);
        test_prefill(e, 0, 0, r.prompt, n, outs[k]);
        int32_t next = moe_test_argmax(outs[k] + (size_t)(n - 1) * V, V);
        test_prefill(e, 0, (int32_t)n, &next, 1, dec[k]);
        moe_engine_free(e);
    }
    double rel = moe_test_rel_l2(b, a, (size_t)n * V), rel_dec = moe_test_rel_l2(d, c, V);
    printf("threads 1 vs 5: prefill rel %.3e, decode rel %.3e\n", rel, rel_dec);
    CHECK(rel <= 1e-6);
    CHECK(rel_dec <= 1e-6);
    free(a), free(b), free(c), free(d);
    golden_free(&r);
    test_model_close(&tm);
}

/* Bad batches are refused with a message and change nothing; the engine keeps working. */
TEST(engine_rejects_bad_batches)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    uint32_t V = tm.m.hp.n_vocab;
    struct moe_engine *e = test_engine(&tm.m, 16, 2, 0, 2);
    float *out = malloc(sizeof(float) * 4 * V), *again = malloc(sizeof(float) * 4 * V);
    CHECK(out && again);
    int32_t tok[4] = {1, 2, 3, 4}, pos[4] = {0, 1, 2, 3}, seq[4] = {0, 0, 0, 0};
    struct moe_batch b = {.n = 4, .token = tok, .pos = pos, .seq = seq};

    tok[2] = (int32_t)V;
    CHECK_EQ(moe_engine_forward(e, &b, out), MOE_ERANGE);
    CHECK(strstr(moe_engine_errmsg(e), "vocabulary"));
    tok[2] = -1;
    CHECK_EQ(moe_engine_forward(e, &b, out), MOE_ERANGE);
    tok[2] = 3;
    seq[1] = 2;
    CHECK_EQ(moe_engine_forward(e, &b, out), MOE_ERANGE);
    seq[1] = 0;
    pos[3] = 5; /* gap after position 2 */
    CHECK_EQ(moe_engine_forward(e, &b, out), MOE_ERANGE);
    CHECK(strstr(moe_engine_errmsg(e), "gap"));
    pos[3] = 16; /* past n_ctx */
    CHECK_EQ(moe_engine_forward(e, &b, out), MOE_ERANGE);
    pos[3] = 3;
    CHECK_EQ(moe_engine_seq_len(e, 0), 0); /* nothing was evaluated */
    uint64_t *rc = calloc((size_t)tm.m.hp.n_layer * tm.m.hp.n_expert, sizeof *rc);
    CHECK(rc);
    CHECK_EQ(moe_engine_routing_counts(e, rc), 0);
    for (uint32_t i = 0; i < tm.m.hp.n_layer * tm.m.hp.n_expert; i++)
        CHECK_EQ(rc[i], 0);
    free(rc);

    CHECK_EQ(moe_engine_forward(e, &b, out), 0);
    CHECK_EQ(moe_engine_seq_len(e, 0), 4);
    /* Decoding position 5 before 4 is a gap; re-evaluating position 2 is allowed and rewinds. */
    int32_t t1 = 9, p1 = 5, s1 = 0;
    struct moe_batch one = {.n = 1, .token = &t1, .pos = &p1, .seq = &s1};
    CHECK_EQ(moe_engine_forward(e, &one, out), MOE_ERANGE);
    moe_engine_seq_clear(e, 0);
    CHECK_EQ(moe_engine_seq_len(e, 0), 0);
    CHECK_EQ(moe_engine_forward(e, &b, again), 0);
    CHECK(memcmp(out, again, sizeof(float) * 4 * V) == 0);
    moe_engine_free(e);
    free(out), free(again);
    test_model_close(&tm);
}

/* ------------------------------------------------------------------ thread pool */

struct pool_probe {
    int64_t *hits;
    int *ith_seen;
};

static void probe_task(void *arg, int64_t task, int ith)
{
    struct pool_probe *p = arg;
    __atomic_fetch_add(&p->hits[task], 1, __ATOMIC_RELAXED);
    __atomic_store_n(&p->ith_seen[ith], 1, __ATOMIC_RELAXED);
}

TEST(pool_runs_every_task_once)
{
    for (int nth = 1; nth <= 6; nth += 5) {
        struct moe_pool *pool;
        CHECK_EQ(moe_pool_init(&pool, nth), 0);
        CHECK_EQ(moe_pool_size(pool), nth);
        int64_t hits[1000];
        int seen[8] = {0};
        struct pool_probe pr = {hits, seen};
        for (int round = 0; round < 2000; round++) {
            int64_t n = round % 7 == 0 ? 1 : 1 + round % 1000;
            memset(hits, 0, sizeof hits);
            moe_pool_for(pool, n, probe_task, &pr);
            for (int64_t i = 0; i < n; i++)
                CHECK_EQ(hits[i], 1);
            for (int64_t i = n; i < 1000; i++)
                CHECK_EQ(hits[i], 0);
        }
        CHECK(seen[0]);
        for (int i = nth; i < 8; i++)
            CHECK(!seen[i]);
        moe_pool_free(pool);
    }
}

/* A long prompt (past the default n_batch of 512, so prefill runs in two chunks) agrees with
 * single-token decode at its end. */
TEST(engine_long_prompt)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    enum { N = 700, TAIL = 6 };
    uint32_t V = tm.m.hp.n_vocab;
    int32_t *tok = malloc(sizeof(int32_t) * N);
    float *all = malloc(sizeof(float) * N * V), *one = malloc(sizeof(float) * V);
    CHECK(tok && all && one);
    synth_tokens(tok, N, 4096, 99);
    struct moe_engine *e = test_engine(&tm.m, 1024, 2, 0, 2);
    CHECK_EQ(moe_engine_get_opts(e)->n_batch, 512);
    test_prefill(e, 0, 0, tok, N, all);
    test_prefill(e, 1, 0, tok, N - TAIL, NULL);
    double worst = 0.0;
    for (int i = N - TAIL; i < N; i++) {
        test_prefill(e, 1, i, tok + i, 1, one);
        double rel = moe_test_rel_l2(one, all + (size_t)i * V, V);
        worst = rel > worst ? rel : worst;
    }
    printf("long prompt (%d tokens): decode vs chunked prefill, worst rel %.3e\n", N, worst);
    CHECK(worst <= test_consistency_tol(1e-4));
    moe_engine_free(e);
    free(tok), free(all), free(one);
    test_model_close(&tm);
}

/* Sampling in the engine gives the tokens of worker/sampler.c fed with the engine's logits, for
 * several sequences per step, and refuses what it cannot do. */
/* One sequence's prompt (at most 16 tokens) as a batch that wants the last row's logits. */
struct prompt_batch {
    int32_t pos[16], sq[16];
    uint8_t want[16];
    struct moe_batch b;
};

static void prompt_batch_init(struct prompt_batch *pb, const int32_t *prompt, uint32_t n,
                              int32_t seq)
{
    CHECK(n >= 1 && n <= 16);
    memset(pb->want, 0, sizeof pb->want);
    for (uint32_t k = 0; k < n; k++)
        pb->pos[k] = (int32_t)k, pb->sq[k] = seq;
    pb->want[n - 1] = 1;
    pb->b = (struct moe_batch){.n = n, .token = prompt, .pos = pb->pos, .seq = pb->sq,
                               .logits = pb->want};
}

/* A host sampler with the prompt in its history. */
static struct moe_sampler *primed_sampler(const struct moe_sampler_params *p, uint32_t V,
                                          const int32_t *prompt, uint32_t n)
{
    struct moe_sampler *hs = NULL;
    char err[128];
    CHECK_EQ(moe_sampler_init(&hs, p, V, err, sizeof err), 0);
    for (uint32_t k = 0; k < n; k++)
        moe_sampler_accept(hs, prompt[k]);
    return hs;
}

TEST(engine_sampling_equals_host_sampler)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, S = 3, P = 9, steps = 20;
    struct moe_sampler_params sp[3];
    for (uint32_t i = 0; i < S; i++)
        moe_sampler_defaults(&sp[i]);
    sp[0].temperature = 0.0f;
    sp[1].seed = 42;
    sp[1].repeat_penalty = 1.2f;
    sp[2].seed = 7;
    sp[2].top_k = 0;
    sp[2].top_p = 0.8f;
    sp[2].frequency_penalty = 0.3f;
    int32_t prompt[9];
    for (uint32_t i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 53 + 11) % V);
    struct moe_engine *a = test_engine(&tm.m, 64, S, 0, 2), *b = test_engine(&tm.m, 64, S, 0, 2);
    struct moe_sampler *hs[3];
    float *lg = malloc(sizeof(float) * S * V);
    CHECK(lg);
    int32_t ta[3], tb[3];
    for (uint32_t i = 0; i < S; i++) {
        hs[i] = primed_sampler(&sp[i], V, prompt, P);
        CHECK_EQ(moe_engine_seq_sampler(b, (int32_t)i, &sp[i], prompt, P), 0);
        struct prompt_batch pb;
        prompt_batch_init(&pb, prompt, P, (int32_t)i);
        struct moe_batch bt = pb.b;
        CHECK_EQ(moe_engine_forward(a, &bt, lg), 0);
        ta[i] = moe_sampler_sample(hs[i], lg);
        moe_sampler_accept(hs[i], ta[i]);
        CHECK_EQ(moe_engine_forward_sample(b, &bt, &tb[i]), 0);
        CHECK_EQ(ta[i], tb[i]);
    }
    for (uint32_t s = 0; s < steps; s++) {
        int32_t pos[3], sq[3], na[3], nb[3];
        for (uint32_t i = 0; i < S; i++)
            pos[i] = (int32_t)(P + s), sq[i] = (int32_t)i;
        struct moe_batch bt = {.n = S, .token = ta, .pos = pos, .seq = sq};
        CHECK_EQ(moe_engine_forward(a, &bt, lg), 0);
        for (uint32_t i = 0; i < S; i++) {
            na[i] = moe_sampler_sample(hs[i], lg + (size_t)i * V);
            moe_sampler_accept(hs[i], na[i]);
        }
        bt.token = tb;
        CHECK_EQ(moe_engine_forward_sample(b, &bt, nb), 0);
        for (uint32_t i = 0; i < S; i++)
            CHECK_EQ(na[i], nb[i]);
        memcpy(ta, na, sizeof ta);
        memcpy(tb, nb, sizeof tb);
    }
    /* Two sampled tokens of one sequence in a step, and a sequence without a sampler. */
    int32_t tk[2] = {1, 2}, ps[2] = {(int32_t)(P + steps), (int32_t)(P + steps + 1)},
            sq[2] = {0, 0}, nx[2];
    struct moe_batch two = {.n = 2, .token = tk, .pos = ps, .seq = sq};
    CHECK_EQ(moe_engine_forward_sample(b, &two, nx), MOE_ERANGE);
    CHECK(strstr(moe_engine_errmsg(b), "second sampled token"));
    struct moe_engine *c = test_engine(&tm.m, 64, S, 0, 2);
    struct moe_batch one = {.n = 1, .token = tk, .pos = ps, .seq = sq};
    ps[0] = 0;
    CHECK_EQ(moe_engine_forward_sample(c, &one, nx), MOE_ERANGE);
    CHECK(strstr(moe_engine_errmsg(c), "no sampler"));
    struct moe_sampler_params badp;
    moe_sampler_defaults(&badp);
    badp.top_p = 0.0f;
    CHECK(moe_engine_seq_sampler(c, 0, &badp, NULL, 0) != 0);
    CHECK(moe_engine_seq_sampler(c, 9, &sp[0], NULL, 0) != 0);
    for (uint32_t i = 0; i < S; i++)
        moe_sampler_free(hs[i]);
    free(lg);
    moe_engine_free(a);
    moe_engine_free(b);
    moe_engine_free(c);
    test_model_close(&tm);
}

/* Decode ahead: a step queued before the tokens of the one before it are back, its tokens
 * MOE_ENGINE_TOKEN_NEXT, gives the tokens forward_sample gives for the same steps (seeded
 * samplers with penalties, so every draw depends on the history the device keeps), also when a
 * sequence leaves (its queued step's token dropped, its positions trimmed) and when a new prompt
 * takes its slot; and the queue's misuses are refused without changing anything. */
TEST(engine_decode_ahead_equals_forward_sample)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, S = 3, P = 9;
    struct moe_sampler_params sp[3];
    for (uint32_t i = 0; i < S; i++)
        moe_sampler_defaults(&sp[i]);
    sp[0].temperature = 0.0f;
    sp[1].seed = 42;
    sp[1].repeat_penalty = 1.2f;
    sp[2].seed = 7;
    sp[2].top_p = 0.8f;
    sp[2].frequency_penalty = 0.3f;
    struct moe_engine *a = test_engine(&tm.m, 96, S, 0, 2), *b = test_engine(&tm.m, 96, S, 0, 2);
    int32_t prompt[9], last_a[3], last_b[3], len[3];
    /* The prompts, run alike on both (forward_sample), each sequence's first token. */
    for (uint32_t i = 0; i < S; i++) {
        for (uint32_t k = 0; k < P; k++)
            prompt[k] = (int32_t)((k * 53 + 11 + 17 * i) % V);
        struct prompt_batch pb;
        prompt_batch_init(&pb, prompt, P, (int32_t)i);
        struct moe_batch bt = pb.b;
        CHECK_EQ(moe_engine_seq_sampler(a, (int32_t)i, &sp[i], prompt, P), 0);
        CHECK_EQ(moe_engine_seq_sampler(b, (int32_t)i, &sp[i], prompt, P), 0);
        CHECK_EQ(moe_engine_forward_sample(a, &bt, &last_a[i]), 0);
        CHECK_EQ(moe_engine_forward_sample(b, &bt, &last_b[i]), 0);
        CHECK_EQ(last_a[i], last_b[i]);
        len[i] = (int32_t)P;
    }
    /* Nothing queued: collect refuses; the last step (sequence 2's prompt) drew for sequence 2
     * only, so a NEXT token of sequence 0 is refused and nothing is queued. */
    CHECK_EQ(moe_engine_collect(b, NULL, NULL), MOE_ERANGE);
    int32_t nx_tok[3] = {MOE_ENGINE_TOKEN_NEXT, MOE_ENGINE_TOKEN_NEXT, MOE_ENGINE_TOKEN_NEXT};
    int32_t pos0[1] = {(int32_t)P}, seq0[1] = {0};
    struct moe_batch bad = {.n = 1, .token = nx_tok, .pos = pos0, .seq = seq0};
    CHECK_EQ(moe_engine_submit_sample(b, &bad), MOE_ERANGE);
    CHECK(strstr(moe_engine_errmsg(b), "drew no token"));
    CHECK_EQ(moe_engine_queued(b), 0);

    /* Steps 0..23: every sequence for 12 steps, then sequence 2 leaves; engine a runs the same
     * steps one by one with the tokens it drew. b queues each step before collecting the one
     * before it (the first with the tokens themselves). */
    const int steps = 24, leave = 12;
    int32_t got_b[24][3];
    uint32_t got_n[24];
    for (int s = 0; s <= steps; s++) {
        if (s < steps) {
            const uint32_t n = s < leave ? S : S - 1;
            int32_t pos[3], sq[3], tk[3];
            /* Sequence 2 is in steps 0..leave-1 only. */
            for (uint32_t i = 0; i < n; i++) {
                pos[i] = len[i];
                sq[i] = (int32_t)i;
                tk[i] = s == 0 ? last_b[i] : MOE_ENGINE_TOKEN_NEXT;
            }
            struct moe_batch bt = {.n = n, .token = tk, .pos = pos, .seq = sq};
            CHECK_EQ(moe_engine_submit_sample(b, &bt), 0);
            if (s == 1) {
                /* Two queued: a third, and a plain step, are refused. */
                CHECK_EQ(moe_engine_submit_sample(b, &bt), MOE_ERANGE);
                int32_t out[3];
                CHECK_EQ(moe_engine_forward_sample(b, &bt, out), MOE_ERANGE);
                CHECK(strstr(moe_engine_errmsg(b), "not collected"));
                CHECK_EQ(moe_engine_queued(b), 2);
            }
            for (uint32_t i = 0; i < n; i++)
                len[i]++;
        }
        if (s > 0) {
            CHECK_EQ(moe_engine_collect(b, got_b[s - 1], &got_n[s - 1]), 0);
            CHECK_EQ(got_n[s - 1], s - 1 < leave ? S : S - 1);
        }
    }
    CHECK_EQ(moe_engine_queued(b), 0);
    for (int s = 0; s < steps; s++) {
        const uint32_t n = s < leave ? S : S - 1;
        int32_t pos[3], sq[3], na[3];
        for (uint32_t i = 0; i < n; i++)
            pos[i] = (int32_t)P + s, sq[i] = (int32_t)i;
        struct moe_batch bt = {.n = n, .token = last_a, .pos = pos, .seq = sq};
        CHECK_EQ(moe_engine_forward_sample(a, &bt, na), 0);
        for (uint32_t i = 0; i < n; i++) {
            CHECK_MSG(na[i] == got_b[s][i], "step %d sequence %u: %d forward_sample, %d ahead", s,
                      i, na[i], got_b[s][i]);
            last_a[i] = na[i];
        }
    }
    /* A new prompt in sequence 2's slot, then all three again, ahead on b; the last step
     * before them (the prompt) drew for sequence 2 only, so sequences 0 and 1 give their
     * tokens themselves. */
    for (uint32_t k = 0; k < P; k++)
        prompt[k] = (int32_t)((k * 29 + 5) % V);
    int32_t ppos[9], psq[9], ta, tb;
    uint8_t want[9] = {0};
    for (uint32_t k = 0; k < P; k++)
        ppos[k] = (int32_t)k, psq[k] = 2;
    want[P - 1] = 1;
    struct moe_batch pb = {.n = P, .token = prompt, .pos = ppos, .seq = psq, .logits = want};
    moe_engine_seq_clear(a, 2);
    moe_engine_seq_clear(b, 2);
    CHECK_EQ(moe_engine_seq_sampler(a, 2, &sp[2], prompt, P), 0);
    CHECK_EQ(moe_engine_seq_sampler(b, 2, &sp[2], prompt, P), 0);
    CHECK_EQ(moe_engine_forward_sample(a, &pb, &ta), 0);
    CHECK_EQ(moe_engine_forward_sample(b, &pb, &tb), 0);
    CHECK_EQ(ta, tb);
    last_a[2] = ta;
    len[2] = (int32_t)P;
    int32_t cur_b[3] = {got_b[steps - 1][0], got_b[steps - 1][1], MOE_ENGINE_TOKEN_NEXT};
    for (int s = 0; s < 6; s++) {
        int32_t pos[3], sq[3], na[3], nb[3];
        for (uint32_t i = 0; i < S; i++)
            pos[i] = len[i]++, sq[i] = (int32_t)i;
        struct moe_batch ba = {.n = S, .token = last_a, .pos = pos, .seq = sq};
        CHECK_EQ(moe_engine_forward_sample(a, &ba, na), 0);
        struct moe_batch bb = {.n = S, .token = s == 0 ? cur_b : nx_tok, .pos = pos, .seq = sq};
        CHECK_EQ(moe_engine_submit_sample(b, &bb), 0);
        uint32_t n = 0;
        CHECK_EQ(moe_engine_collect(b, nb, &n), 0);
        CHECK_EQ(n, S);
        for (uint32_t i = 0; i < S; i++) {
            CHECK_MSG(na[i] == nb[i], "after the new prompt, step %d sequence %u: %d, %d", s, i,
                      na[i], nb[i]);
            last_a[i] = na[i];
        }
    }
    /* A NEXT token at the wrong position is refused. */
    int32_t wp[1] = {len[0] + 1};
    struct moe_batch wrong = {.n = 1, .token = nx_tok, .pos = wp, .seq = seq0};
    CHECK_EQ(moe_engine_submit_sample(b, &wrong), MOE_ERANGE);
    CHECK(strstr(moe_engine_errmsg(b), "goes at position"));
    CHECK_EQ(moe_engine_queued(b), 0);
    moe_engine_free(a);
    moe_engine_free(b);
    test_model_close(&tm);
}

/* A sequence's logit bias in the engine's sampler (on the GPU for a CUDA engine) draws what a
 * host sampler draws from the logits with the bias added: a ban on a greedy row's best token, a
 * boost, biases under a temperature with penalties; moe_engine_seq_sampler clears it; bad lists
 * are refused. */
TEST(engine_logit_bias_equals_host_bias)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, S = 3, P = 8, steps = 12;
    struct moe_sampler_params sp[3];
    for (uint32_t i = 0; i < S; i++)
        moe_sampler_defaults(&sp[i]);
    sp[0].temperature = 0.0f;
    sp[1].seed = 3;
    sp[1].repeat_penalty = 1.3f;
    sp[2].seed = 9;
    sp[2].top_k = 0;
    sp[2].min_p = 0.0f;
    struct moe_engine *a = test_engine(&tm.m, 64, S, 0, 2), *b = test_engine(&tm.m, 64, S, 0, 2);
    float *lg = malloc(sizeof(float) * V);
    CHECK(lg);
    /* Sequence 0: the token its prompt's greedy draw would pick is banned; 1: one token
     * boosted, another banned; 2: small biases on many tokens. */
    int32_t prompt[8], bt[3][64], ta[3], tb[3];
    float bv[3][64];
    uint32_t nb[3] = {1, 2, 64};
    struct moe_sampler *hs[3];
    for (uint32_t i = 0; i < S; i++) {
        for (uint32_t k = 0; k < P; k++)
            prompt[k] = (int32_t)((k * 41 + 3 + 11 * i) % V);
        struct prompt_batch pb;
        prompt_batch_init(&pb, prompt, P, (int32_t)i);
        CHECK_EQ(moe_engine_forward(a, &pb.b, lg), 0);
        int32_t best = 0;
        for (uint32_t v = 1; v < V; v++)
            if (lg[v] > lg[best])
                best = (int32_t)v;
        if (i == 0) {
            bt[0][0] = best, bv[0][0] = -100.0f;
        } else if (i == 1) {
            bt[1][0] = (int32_t)((best + 7) % V), bv[1][0] = 8.0f;
            bt[1][1] = best, bv[1][1] = -100.0f;
        } else {
            for (uint32_t k = 0; k < nb[2]; k++)
                bt[2][k] = (int32_t)((k * 13 + 1) % V), bv[2][k] = 0.25f * (float)(k % 9) - 1.0f;
        }
        hs[i] = primed_sampler(&sp[i], V, prompt, P);
        for (uint32_t k = 0; k < nb[i]; k++)
            lg[bt[i][k]] += bv[i][k];
        ta[i] = moe_sampler_sample(hs[i], lg);
        moe_sampler_accept(hs[i], ta[i]);
        CHECK_EQ(moe_engine_seq_sampler(b, (int32_t)i, &sp[i], prompt, P), 0);
        CHECK_EQ(moe_engine_seq_bias(b, (int32_t)i, bt[i], bv[i], nb[i]), 0);
        CHECK_EQ(moe_engine_forward_sample(b, &pb.b, &tb[i]), 0);
        CHECK_MSG(ta[i] == tb[i], "sequence %u prompt: host %d, engine %d", i, ta[i], tb[i]);
        if (i == 0)
            CHECK(tb[0] != best);
    }
    float *rows = malloc(sizeof(float) * S * V);
    CHECK(rows);
    for (uint32_t s = 0; s < steps; s++) {
        int32_t pos[3], sq[3], na[3], nbt[3];
        for (uint32_t i = 0; i < S; i++)
            pos[i] = (int32_t)(P + s), sq[i] = (int32_t)i;
        struct moe_batch ba = {.n = S, .token = ta, .pos = pos, .seq = sq};
        CHECK_EQ(moe_engine_forward(a, &ba, rows), 0);
        for (uint32_t i = 0; i < S; i++) {
            float *r = rows + (size_t)i * V;
            for (uint32_t k = 0; k < nb[i]; k++)
                r[bt[i][k]] += bv[i][k];
            na[i] = moe_sampler_sample(hs[i], r);
            moe_sampler_accept(hs[i], na[i]);
        }
        struct moe_batch bb = {.n = S, .token = tb, .pos = pos, .seq = sq};
        CHECK_EQ(moe_engine_forward_sample(b, &bb, nbt), 0);
        for (uint32_t i = 0; i < S; i++) {
            CHECK_MSG(na[i] == nbt[i], "step %u sequence %u: host %d, engine %d", s, i, na[i],
                      nbt[i]);
            CHECK(i != 1 || nbt[1] != bt[1][1]);
        }
        memcpy(ta, na, sizeof ta);
        memcpy(tb, nbt, sizeof tb);
    }
    /* Refused lists change nothing: a token twice, out of the vocabulary, NaN, too many. */
    int32_t dup[3] = {5, 9, 5}, out[1] = {(int32_t)V};
    float v3[3] = {1, 2, 3}, nan1[1] = {NAN};
    CHECK_EQ(moe_engine_seq_bias(b, 0, dup, v3, 3), MOE_ERANGE);
    CHECK(strstr(moe_engine_errmsg(b), "listed twice"));
    CHECK_EQ(moe_engine_seq_bias(b, 0, out, v3, 1), MOE_ERANGE);
    CHECK_EQ(moe_engine_seq_bias(b, 0, dup, nan1, 1), MOE_ERANGE);
    CHECK_EQ(moe_engine_seq_bias(b, 0, dup, v3, MOE_ENGINE_MAX_BIAS + 1), MOE_ERANGE);
    CHECK_EQ(moe_engine_seq_bias(b, 7, dup, v3, 1), MOE_ERANGE);
    /* A new sampler clears the bias: sequence 0 at temperature 0 draws its unbiased best. */
    CHECK_EQ(moe_engine_seq_sampler(b, 0, &sp[0], NULL, 0), 0);
    int32_t pos1[1] = {(int32_t)(P + steps)}, sq1[1] = {0}, t1[1] = {tb[0]}, got = -1;
    struct moe_batch one = {.n = 1, .token = t1, .pos = pos1, .seq = sq1};
    CHECK_EQ(moe_engine_forward(a, &(struct moe_batch){.n = 1, .token = ta, .pos = pos1, .seq = sq1}, lg), 0);
    int32_t best = 0;
    for (uint32_t v = 1; v < V; v++)
        if (lg[v] > lg[best])
            best = (int32_t)v;
    CHECK_EQ(moe_engine_forward_sample(b, &one, &got), 0);
    CHECK_EQ(got, best);
    for (uint32_t i = 0; i < S; i++)
        moe_sampler_free(hs[i]);
    free(rows);
    free(lg);
    moe_engine_free(a);
    moe_engine_free(b);
    test_model_close(&tm);
}

/* Offload settings are checked at init: a residency outside (0, 1] or too many cache slots is a
 * range error, and on the CPU (which reads every expert where it computes) they are refused. */
TEST(engine_offload_options_checked)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    struct moe_engine *e = NULL;
    char err[512];
    struct moe_engine_opts o = {.n_ctx = 16, .n_seq = 1, .n_batch = 8, .device = "cpu",
                                .expert_residency = 1.5};
    CHECK_EQ(moe_engine_init(&e, &tm.m, &o, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "residency"));
    o.expert_residency = 0;
    o.cache_slots = (int32_t)tm.m.hp.n_expert + 1;
    CHECK_EQ(moe_engine_init(&e, &tm.m, &o, err, sizeof err), MOE_ERANGE);
    o.cache_slots = 0;
    o.expert_residency = 0.5;
    CHECK_EQ(moe_engine_init(&e, &tm.m, &o, err, sizeof err), MOE_EUNSUPPORTED);
    CHECK(strstr(err, "needs a CUDA device"));
    o.expert_residency = 0;
    o.vram_budget = 1u << 30;
    CHECK_EQ(moe_engine_init(&e, &tm.m, &o, err, sizeof err), MOE_EUNSUPPORTED);
    o.vram_budget = 0;
    CHECK_EQ(moe_engine_init(&e, &tm.m, &o, err, sizeof err), 0);
    struct moe_offload_stats s;
    CHECK_EQ(moe_engine_offload_stats(e, &s, NULL), 0);
    CHECK(!s.active);
    moe_engine_free(e);
    test_model_close(&tm);
}

/* The batcher's two sampling paths: a job with logprobs or logit_bias is sampled on the host
 * from the step's logits, the others by the engine, in alternating steps while both run. The
 * host job's tokens equal the engine job's (same prompt, greedy), its logprobs are the
 * log-softmax of the logits an engine of its own computes for the same tokens (up to the last
 * bits: the batcher batches the three sequences together), and a +100 bias
 * makes a sampled job pick its token every time. */
struct bt_seen {
    int32_t tok[3][32];
    struct moe_token_lp lp[3][32];
    uint32_t n[3], done[3], errors;
};

static void bt_token(void *user, uint64_t id, int32_t token, const struct moe_token_lp *lp)
{
    struct bt_seen *s = user;
    CHECK(id >= 1 && id <= 3 && s->n[id - 1] < 32);
    CHECK_EQ(lp != NULL, id == 2);
    s->tok[id - 1][s->n[id - 1]] = token;
    if (lp)
        s->lp[id - 1][s->n[id - 1]] = *lp;
    s->n[id - 1]++;
}

static void bt_done(void *user, uint64_t id, enum moe_finish reason, uint32_t n_prompt,
                    uint32_t n_gen, uint32_t n_cached, const uint32_t *sig)
{
    struct bt_seen *s = user;
    (void)reason, (void)n_prompt, (void)n_cached, (void)sig;
    s->done[id - 1] = n_gen;
}

static void job_error(uint32_t *errors, uint64_t id, int code, const char *msg)
{
    fprintf(stderr, "job %llu: %d %s\n", (unsigned long long)id, code, msg);
    (*errors)++;
}

static void bt_error(void *user, uint64_t id, int code, const char *msg)
{
    job_error(&((struct bt_seen *)user)->errors, id, code, msg);
}

static int bt_report(void *user, const struct moe_batcher_report *r)
{
    (void)user, (void)r;
    return 0;
}

static void batcher_host_sampling(bool all_host)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, P = 7, G = 12;
    struct moe_engine *e = test_engine(&tm.m, 64, 3, 0, 2);
    struct moe_batcher *b = NULL;
    struct bt_seen seen = {0};
    struct moe_batcher_cfg cfg = {.eng = e, .n_vocab = V, .n_layer = tm.m.hp.n_layer,
                                  .n_expert = tm.m.hp.n_expert, .n_ctx = 64, .n_seq = 3, .n_batch = 512,
                                  .host_sample_all = all_host};
    struct moe_batcher_sink sink = {.user = &seen, .token = bt_token, .done = bt_done,
                                    .error = bt_error, .report = bt_report};
    CHECK_EQ(moe_batcher_init(&b, &cfg, &sink), 0);
    int32_t prompt[7];
    for (uint32_t i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 97 + 5) % V);
    const int32_t forced = 321;
    for (uint64_t id = 1; id <= 3; id++) {
        struct moe_job *j = calloc(1, sizeof *j);
        CHECK(j);
        j->id = id;
        j->prompt = malloc(sizeof prompt);
        memcpy(j->prompt, prompt, sizeof prompt);
        j->n_prompt = P;
        j->max_tokens = G;
        j->slot = -1;
        moe_sampler_defaults(&j->sp);
        j->sp.temperature = id == 3 ? 1.0f : 0.0f;
        j->sp.seed = 11;
        if (id == 2) {
            j->logprobs = true;
            j->n_top = 5;
        }
        if (id == 3) {
            j->bias_tok = malloc(sizeof *j->bias_tok);
            j->bias_val = malloc(sizeof *j->bias_val);
            j->bias_tok[0] = forced;
            j->bias_val[0] = 100;
            j->n_bias = 1;
        }
        moe_batcher_add(b, j);
    }
    for (int guard = 0; moe_batcher_busy(b) && guard < 1000; guard++)
        CHECK_EQ(moe_batcher_step(b), 0);
    CHECK_EQ(seen.errors, 0);
    for (int i = 0; i < 3; i++)
        CHECK_EQ(seen.done[i], G);
    for (uint32_t k = 0; k < G; k++) {
        CHECK_EQ(seen.tok[0][k], seen.tok[1][k]);
        CHECK_EQ(seen.tok[2][k], forced);
    }
    /* The reference: the same tokens through an engine of its own, logits of each step. */
    struct moe_engine *r = test_engine(&tm.m, 64, 1, 0, 2);
    float *lg = malloc(sizeof(float) * V);
    CHECK(lg);
    for (uint32_t k = 0; k < G; k++) {
        int32_t tk[7], pos[7], sq[7] = {0};
        uint8_t want[7] = {0};
        uint32_t n = k == 0 ? P : 1;
        for (uint32_t i = 0; i < n; i++) {
            tk[i] = k == 0 ? prompt[i] : seen.tok[1][k - 1];
            pos[i] = (int32_t)(k == 0 ? i : P + k - 1);
        }
        want[n - 1] = 1;
        struct moe_batch bt = {.n = n, .token = tk, .pos = pos, .seq = sq, .logits = want};
        CHECK_EQ(moe_engine_forward(r, &bt, lg), 0);
        float chosen;
        int32_t id[5];
        float lp[5];
        uint32_t nt = moe_logprobs(lg, V, seen.tok[1][k], 5, &chosen, id, lp);
        const struct moe_token_lp *got = &seen.lp[1][k];
        CHECK_EQ(got->n_top, nt);
        CHECK_NEAR(got->logprob, chosen, 1e-4); /* batched with other sequences: last bits */
        CHECK_EQ(got->top_id[0], seen.tok[1][k]);
        for (uint32_t i = 0; i < nt; i++) {
            CHECK_EQ(got->top_id[i], id[i]);
            CHECK_NEAR(got->top_lp[i], lp[i], 1e-4);
        }
    }
    free(lg);
    moe_engine_free(r);
    moe_batcher_free(b);
    moe_engine_free(e);
    test_model_close(&tm);
}

TEST(batcher_host_sampling_logprobs_and_bias)
{
    batcher_host_sampling(false);
}

/* A CPU worker samples every job on the host: the same tokens and logprobs, no alternating. */
TEST(batcher_host_sampling_for_every_job)
{
    batcher_host_sampling(true);
}

/* Prompt logprobs: a job asking for them gets every prompt position after the first, in order
 * and in chunks of MOE_BATCHER_PROMPT_ROWS, with the log-softmax of the logits a plain forward of
 * the prompt gives, then its tokens; it never continues a kept prefix. */
struct plp_seen {
    uint32_t n, next_pos, tokens;
    float lp[80];
    int32_t tok[80];
};

static void plp_prompt(void *user, uint64_t id, uint32_t pos, int32_t token, const struct moe_token_lp *lp)
{
    struct plp_seen *s = user;
    (void)id;
    CHECK_EQ(s->tokens, 0);
    CHECK_EQ(pos, s->next_pos);
    CHECK(pos < 80);
    s->next_pos++;
    s->lp[pos] = lp->logprob;
    s->tok[pos] = token;
    s->n++;
}

static void plp_token(void *user, uint64_t id, int32_t token, const struct moe_token_lp *lp)
{
    struct plp_seen *s = user;
    (void)id, (void)token;
    CHECK(lp != NULL);
    s->tokens++;
}

static void plp_done(void *user, uint64_t id, enum moe_finish reason, uint32_t n_prompt,
                     uint32_t n_gen, uint32_t n_cached, const uint32_t *sig)
{
    (void)user, (void)id, (void)reason, (void)n_prompt, (void)n_gen, (void)sig;
    CHECK_EQ(n_cached, 0);
}

static void plp_error(void *user, uint64_t id, int code, const char *msg)
{
    (void)user;
    CHECK_MSG(0, "job %llu: %d %s", (unsigned long long)id, code, msg);
}

TEST(batcher_prompt_logprobs)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, P = 70;
    struct moe_engine *e = test_engine(&tm.m, 128, 2, 0, 2);
    struct moe_batcher *b = NULL;
    struct plp_seen seen = {.next_pos = 1};
    struct moe_batcher_cfg cfg = {.eng = e, .n_vocab = V, .n_layer = tm.m.hp.n_layer,
                                  .n_expert = tm.m.hp.n_expert, .n_ctx = 128, .n_seq = 2, .n_batch = 512};
    struct moe_batcher_sink sink = {.user = &seen, .token = plp_token, .prompt_lp = plp_prompt,
                                    .done = plp_done, .error = plp_error, .report = bt_report};
    CHECK_EQ(moe_batcher_init(&b, &cfg, &sink), 0);
    int32_t prompt[70];
    for (uint32_t i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 31 + 7) % V);
    for (int round = 0; round < 2; round++) { /* the second time, a kept prefix is not used */
        struct moe_job *j = calloc(1, sizeof *j);
        CHECK(j);
        j->id = 1;
        j->prompt = malloc(sizeof prompt);
        memcpy(j->prompt, prompt, sizeof prompt);
        j->n_prompt = P;
        j->max_tokens = 2;
        j->slot = -1;
        moe_sampler_defaults(&j->sp);
        j->sp.temperature = 0;
        j->logprobs = j->prompt_logprobs = true;
        j->n_top = 1;
        seen.n = seen.tokens = 0;
        seen.next_pos = 1;
        moe_batcher_add(b, j);
        int steps = 0;
        for (; moe_batcher_busy(b) && steps < 100; steps++)
            CHECK_EQ(moe_batcher_step(b), 0);
        CHECK_EQ(seen.n, P - 1);
        CHECK_EQ(seen.tokens, 2);
        CHECK(steps >= (int)((P + MOE_BATCHER_PROMPT_ROWS - 1) / MOE_BATCHER_PROMPT_ROWS));
    }
    struct moe_engine *r = test_engine(&tm.m, 128, 1, 0, 2);
    float *lg = malloc(sizeof(float) * P * V);
    CHECK(lg);
    test_prefill(r, 0, 0, prompt, P, lg);
    for (uint32_t p = 1; p < P; p++) {
        float want;
        int32_t id;
        float top;
        moe_logprobs(lg + (size_t)(p - 1) * V, V, prompt[p], 1, &want, &id, &top);
        CHECK_EQ(seen.tok[p], prompt[p]);
        /* On a GPU the reference's one 70-token step multiplies on tensor cores, the batcher's
         * chunks on the mat-vecs. */
        CHECK_NEAR(seen.lp[p], want, test_consistency_tol(1e-4) * (1.0 + fabs(want)));
    }
    free(lg);
    moe_engine_free(r);
    moe_batcher_free(b);
    moe_engine_free(e);
    test_model_close(&tm);
}

/* moe_engine_seq_copy: a sequence given another's evaluated prefix continues exactly as that one
 * does (the same step, bit for bit, on every backend), and copies past what the source holds or
 * outside the sequences are refused. */
TEST(engine_seq_copy_continues_exactly)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, P = 40;
    struct moe_engine *e = test_engine(&tm.m, 64, 3, 0, 2);
    int32_t prompt[40];
    for (uint32_t i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 53 + 9) % V);
    float *all = malloc(sizeof(float) * P * V), *ref = malloc(sizeof(float) * V),
          *got = malloc(sizeof(float) * V);
    CHECK(all && ref && got);
    test_prefill(e, 0, 0, prompt, P - 1, all);
    CHECK(moe_engine_seq_copy(e, 0, 2, P) != 0); /* more than it holds */
    CHECK(moe_engine_seq_copy(e, 0, 3, 4) != 0); /* no sequence 3 */
    CHECK(moe_engine_seq_copy(e, -1, 2, 4) != 0);
    test_prefill(e, 2, 0, prompt + 7, 5, all); /* something to overwrite */
    CHECK_EQ(moe_engine_seq_copy(e, 0, 2, P - 1), 0);
    CHECK_EQ(moe_engine_seq_len(e, 2), P - 1);
    test_prefill(e, 0, (int32_t)(P - 1), prompt + P - 1, 1, ref);
    test_prefill(e, 2, (int32_t)(P - 1), prompt + P - 1, 1, got);
    CHECK(memcmp(got, ref, sizeof(float) * V) == 0);
    free(all), free(ref), free(got);
    moe_engine_free(e);
    test_model_close(&tm);
}

struct share_seen {
    int32_t tok[4][8];
    uint32_t n[4], cached[4], done, errors;
};

static void sh_token(void *user, uint64_t id, int32_t token, const struct moe_token_lp *lp)
{
    struct share_seen *s = user;
    (void)lp;
    CHECK(id >= 1 && id <= 4 && s->n[id - 1] < 8);
    s->tok[id - 1][s->n[id - 1]++] = token;
}

static void sh_done(void *user, uint64_t id, enum moe_finish reason, uint32_t n_prompt,
                    uint32_t n_gen, uint32_t n_cached, const uint32_t *sig)
{
    struct share_seen *s = user;
    (void)reason, (void)n_prompt, (void)n_gen, (void)sig;
    s->cached[id - 1] = n_cached;
    s->done++;
}

static void sh_error(void *user, uint64_t id, int code, const char *msg)
{
    job_error(&((struct share_seen *)user)->errors, id, code, msg);
}

/* A greedy job of G tokens for the sharing tests. */
static void share_add(struct moe_batcher *b, uint64_t id, const int32_t *prompt, uint32_t P,
                      uint32_t G)
{
    struct moe_job *j = calloc(1, sizeof *j);
    CHECK(j);
    j->id = id;
    j->prompt = malloc(sizeof(int32_t) * P);
    CHECK(j->prompt);
    memcpy(j->prompt, prompt, sizeof(int32_t) * P);
    j->n_prompt = P;
    j->max_tokens = G;
    j->slot = -1;
    moe_sampler_defaults(&j->sp);
    j->sp.temperature = 0.0f;
    moe_batcher_add(b, j);
}

/* On the CPU (whose results do not depend on the batch; a GPU's prompt steps of more than 64
 * tokens round differently): got[0..G) are the greedy tokens of the prompt alone. */
static void share_check_alone(const struct moe_model *m, const int32_t *prompt, uint32_t P,
                              const int32_t *got, uint32_t G, int job)
{
    if (test_consistency_tol(0) != 0)
        return;
    const uint32_t V = m->hp.n_vocab;
    struct moe_engine *r = test_engine(m, 128, 1, 0, 2);
    float *lg = malloc(sizeof(float) * P * V);
    CHECK(lg);
    test_prefill(r, 0, 0, prompt, P, lg);
    int32_t t = moe_test_argmax(lg + (size_t)(P - 1) * V, V);
    for (uint32_t g = 0; g < G; g++) {
        CHECK_MSG(got[g] == t, "job %d token %u: %d, alone %d", job, g, got[g], t);
        test_prefill(r, 0, (int32_t)(P + g), &t, 1, lg);
        t = moe_test_argmax(lg, V);
    }
    free(lg);
    moe_engine_free(r);
}

/* A batcher of n_seq slots and n_batch tokens per step over the sharing tests' sink. */
static struct moe_batcher *share_batcher(struct moe_engine *e, const struct moe_model *m,
                                         uint32_t n_seq, uint32_t n_batch, struct share_seen *seen)
{
    struct moe_batcher *b = NULL;
    struct moe_batcher_cfg cfg = {.eng = e, .n_vocab = m->hp.n_vocab, .n_layer = m->hp.n_layer,
                                  .n_expert = m->hp.n_expert, .n_ctx = 128, .n_seq = n_seq,
                                  .n_batch = n_batch};
    struct moe_batcher_sink sink = {.user = seen, .token = sh_token, .done = sh_done,
                                    .error = sh_error, .report = bt_report};
    CHECK_EQ(moe_batcher_init(&b, &cfg, &sink), 0);
    return b;
}

/* Jobs admitted together with the same long prompt (n > 1 choices, a shared system prompt):
 * the first evaluates it, the others copy its KV once it is there and evaluate only the rest of
 * theirs; greedy, the job that copied all of the first one's prompt gives its tokens, and every
 * job the tokens of its prompt alone. A job whose prompt shares only a short prefix evaluates its
 * own. */
TEST(batcher_shares_a_prompt_being_evaluated)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, P = 60, G = 6;
    struct moe_engine *e = test_engine(&tm.m, 128, 4, 0, 2);
    struct share_seen seen = {0};
    struct moe_batcher *b = share_batcher(e, &tm.m, 4, 512, &seen);
    int32_t prompt[4][60];
    for (uint32_t i = 0; i < P; i++) {
        prompt[0][i] = prompt[1][i] = (int32_t)((i * 31 + 7) % V);
        prompt[2][i] = i < 50 ? prompt[0][i] : (int32_t)((i * 17 + 3) % V); /* 50 shared */
        prompt[3][i] = i < 8 ? prompt[0][i] : (int32_t)((i * 13 + 1) % V);  /* 8: too few */
    }
    for (uint64_t id = 1; id <= 4; id++)
        share_add(b, id, prompt[id - 1], P, G);
    for (int guard = 0; moe_batcher_busy(b) && guard < 1000; guard++)
        CHECK_EQ(moe_batcher_step(b), 0);
    CHECK_EQ(seen.errors, 0);
    CHECK_EQ(seen.done, 4);
    CHECK_EQ(seen.cached[0], 0);
    CHECK_EQ(seen.cached[1], P - 1);
    CHECK_EQ(seen.cached[2], 50);
    CHECK_EQ(seen.cached[3], 0);
    /* The copy is the first job's KV bit for bit, so the second job repeats it exactly. */
    CHECK_EQ(seen.n[1], G);
    CHECK(memcmp(seen.tok[0], seen.tok[1], sizeof(int32_t) * G) == 0);
    for (int k = 0; k < 4; k++) {
        CHECK_EQ(seen.n[k], G);
        share_check_alone(&tm.m, prompt[k], P, seen.tok[k], G, k + 1);
    }
    moe_batcher_free(b);
    moe_engine_free(e);
    test_model_close(&tm);
}

/* The job a sharer waits on goes away before it has evaluated the shared prefix (cancelled after
 * two 16-token chunks): the sharer copies what the ended job's slot kept, evaluates the rest and
 * gives the tokens of its prompt alone. */
TEST(batcher_sharer_outlives_its_source)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, P = 60, G = 6;
    struct moe_engine *e = test_engine(&tm.m, 128, 2, 0, 2);
    struct share_seen seen = {0};
    struct moe_batcher *b = share_batcher(e, &tm.m, 2, 16, &seen);
    int32_t prompt[60];
    for (uint32_t i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 41 + 13) % V);
    share_add(b, 1, prompt, P, G);
    share_add(b, 2, prompt, P, G);
    CHECK_EQ(moe_batcher_step(b), 0);
    CHECK_EQ(moe_batcher_step(b), 0);
    moe_batcher_cancel(b, 1);
    for (int guard = 0; moe_batcher_busy(b) && guard < 1000; guard++)
        CHECK_EQ(moe_batcher_step(b), 0);
    CHECK_EQ(seen.errors, 0);
    CHECK_EQ(seen.n[1], G);
    /* The cancelled job's slot kept the 32 positions it had evaluated. */
    CHECK_MSG(seen.cached[1] == 32, "cached %u", seen.cached[1]);
    share_check_alone(&tm.m, prompt, P, seen.tok[1], G, 2);
    moe_batcher_free(b);
    moe_engine_free(e);
    test_model_close(&tm);
}

/* ---------------------------------------------------------------- routing signatures */

static struct moe_engine *sig_engine(const struct moe_model *m, uint32_t n_ctx, uint32_t n_seq,
                                     uint32_t n_batch)
{
    struct moe_engine_opts o = {.n_ctx = n_ctx, .n_seq = n_seq, .n_batch = n_batch,
                                .n_threads = 2, .device = getenv("MOE_TEST_DEVICE"),
                                .record_routes = true};
    struct moe_engine *e = NULL;
    char err[256] = "";
    int rc = moe_engine_init(&e, m, &o, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_engine_init: %s", err);
    return e;
}

/* Evaluates tokens[0..n) of sequence seq from pos0 in one batch, every token counted into sig
 * (NULL: none). */
static void sig_prefill(struct moe_engine *e, int32_t seq, int32_t pos0, const int32_t *tokens,
                        uint32_t n, uint32_t *sig)
{
    int32_t pos[256], sq[256];
    uint32_t *sp[256];
    CHECK(n <= 256);
    for (uint32_t i = 0; i < n; i++) {
        pos[i] = pos0 + (int32_t)i;
        sq[i] = seq;
        sp[i] = sig;
    }
    uint8_t want[256] = {0};
    want[n - 1] = 1;
    float *lg = malloc(sizeof(float) * (size_t)moe_engine_dims(e)->V);
    CHECK(lg);
    struct moe_batch b = {.n = n, .token = tokens, .pos = pos, .seq = sq, .logits = want,
                          .sig = sig ? (uint32_t *const *)sp : NULL};
    CHECK_MSG(moe_engine_forward(e, &b, lg) == 0, "%s", moe_engine_errmsg(e));
    free(lg);
}

/* A prompt's signature is what the engine's routing counters gained over it: in steps of up to
 * n_batch tokens (a prompt split in chunks), and in a one-token step (the last token of a
 * prompt continued from a kept cache). A decode step after it, which carries no signature,
 * changes nothing, and batches asking for one without record_routes are refused. */
TEST(engine_route_signature_equals_the_routing_counts)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, L = tm.m.hp.n_layer, E = tm.m.hp.n_expert,
                   K = tm.m.hp.n_expert_used, P = 45;
    const size_t n = (size_t)L * E;
    struct moe_engine *e = sig_engine(&tm.m, 128, 1, 16);
    uint64_t *before = calloc(n, 8), *after = calloc(n, 8);
    uint32_t *sig = calloc(n, 4), *sig1 = calloc(n, 4);
    CHECK(before && after && sig && sig1);
    int32_t prompt[45];
    for (uint32_t i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 71 + 13) % V);
    CHECK_EQ(moe_engine_routing_counts(e, before), 0);
    sig_prefill(e, 0, 0, prompt, P - 1, sig); /* three steps: 16, 16, 12 tokens */
    CHECK_EQ(moe_engine_routing_counts(e, after), 0);
    for (size_t i = 0; i < n; i++)
        CHECK_EQ((uint64_t)sig[i], after[i] - before[i]);
    for (uint32_t l = 0; l < L; l++) {
        uint64_t sum = 0;
        for (uint32_t x = 0; x < E; x++)
            sum += sig[(size_t)l * E + x];
        CHECK_EQ(sum, (uint64_t)(P - 1) * K);
    }
    memcpy(before, after, n * 8);
    sig_prefill(e, 0, (int32_t)(P - 1), prompt + P - 1, 1, sig1);
    CHECK_EQ(moe_engine_routing_counts(e, after), 0);
    for (size_t i = 0; i < n; i++)
        CHECK_EQ((uint64_t)sig1[i], after[i] - before[i]);
    memcpy(sig, sig1, n * 4);
    int32_t t = 7;
    sig_prefill(e, 0, (int32_t)P, &t, 1, NULL);
    CHECK(memcmp(sig, sig1, n * 4) == 0);
    struct moe_engine *plain = test_engine(&tm.m, 64, 1, 0, 2);
    int32_t pos = 0, sq = 0;
    uint32_t *sp = sig;
    struct moe_batch b = {.n = 1, .token = &t, .pos = &pos, .seq = &sq, .sig = &sp};
    float *lg = malloc(sizeof(float) * V);
    CHECK(lg);
    CHECK(moe_engine_forward(plain, &b, lg) != 0);
    CHECK(strstr(moe_engine_errmsg(plain), "record_routes"));
    free(lg);
    moe_engine_free(plain);
    free(before), free(after), free(sig), free(sig1);
    moe_engine_free(e);
    test_model_close(&tm);
}

/* Several sequences in one step (prompt chunks of three, a decode token of a fourth that asks
 * for none): each signature is the one its prompt gets alone. */
TEST(engine_route_signatures_of_sequences_sharing_a_step)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, L = tm.m.hp.n_layer, E = tm.m.hp.n_expert;
    const size_t n = (size_t)L * E;
    enum { S = 3, P = 12 };
    int32_t prompt[S][P];
    for (int s = 0; s < S; s++)
        for (int i = 0; i < P; i++)
            prompt[s][i] = (int32_t)(((uint32_t)(s * 977 + i * 131 + 3)) % V);
    uint32_t *alone = calloc(S * n, 4), *mixed = calloc(S * n, 4);
    CHECK(alone && mixed);
    struct moe_engine *r = sig_engine(&tm.m, 64, 1, 64);
    for (int s = 0; s < S; s++) {
        moe_engine_seq_clear(r, 0);
        sig_prefill(r, 0, 0, prompt[s], P, alone + s * n);
    }
    moe_engine_free(r);
    struct moe_engine *e = sig_engine(&tm.m, 64, S + 1, 64);
    int32_t first = 11;
    sig_prefill(e, S, 0, &first, 1, NULL); /* sequence S decodes beside the prompts */
    int32_t tok[S * P + 1], pos[S * P + 1], sq[S * P + 1];
    uint32_t *sp[S * P + 1];
    uint32_t k = 0;
    tok[k] = 5, pos[k] = 1, sq[k] = S, sp[k++] = NULL;
    for (int i = 0; i < P; i++)
        for (int s = 0; s < S; s++) { /* interleaved */
            tok[k] = prompt[s][i], pos[k] = i, sq[k] = s, sp[k++] = mixed + s * n;
        }
    float *lg = malloc(sizeof(float) * (S * P + 1) * V);
    CHECK(lg);
    struct moe_batch b = {.n = k, .token = tok, .pos = pos, .seq = sq,
                          .sig = (uint32_t *const *)sp};
    CHECK_MSG(moe_engine_forward(e, &b, lg) == 0, "%s", moe_engine_errmsg(e));
    for (int s = 0; s < S; s++)
        CHECK_MSG(memcmp(alone + s * n, mixed + s * n, n * 4) == 0, "sequence %d", s);
    free(lg), free(alone), free(mixed);
    moe_engine_free(e);
    test_model_close(&tm);
}

struct sig_seen {
    uint32_t L, E, K;
    uint32_t n_prompt[3], n_cached[3], done;
    uint32_t *sig[3];
};

static void sig_done(void *user, uint64_t id, enum moe_finish reason, uint32_t n_prompt,
                     uint32_t n_gen, uint32_t n_cached, const uint32_t *sig)
{
    struct sig_seen *s = user;
    (void)reason, (void)n_gen;
    CHECK(id >= 1 && id <= 3 && sig);
    s->n_prompt[id - 1] = n_prompt;
    s->n_cached[id - 1] = n_cached;
    s->sig[id - 1] = malloc(sizeof *sig * s->L * s->E);
    CHECK(s->sig[id - 1]);
    memcpy(s->sig[id - 1], sig, sizeof *sig * s->L * s->E);
    s->done++;
}

static void sig_token(void *user, uint64_t id, int32_t token, const struct moe_token_lp *lp)
{
    (void)user, (void)id, (void)token, (void)lp;
}

/* Through the batcher (cfg.signatures): a job's done carries the signature of the prompt tokens
 * it evaluated, in bites while another job decodes; a later job continuing from the kept cache
 * counts only what it evaluated (n_prompt - n_cached tokens per layer, k experts each). The
 * first job's signature equals its prompt's alone. */
TEST(batcher_done_carries_the_route_signature)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    const uint32_t V = tm.m.hp.n_vocab, L = tm.m.hp.n_layer, E = tm.m.hp.n_expert,
                   K = tm.m.hp.n_expert_used;
    struct moe_engine *e = sig_engine(&tm.m, 256, 2, 64);
    struct sig_seen seen = {.L = L, .E = E, .K = K};
    struct moe_batcher *b = NULL;
    struct moe_batcher_cfg cfg = {.eng = e, .n_vocab = V, .n_layer = L, .n_expert = E,
                                  .n_ctx = 256, .n_seq = 2, .n_batch = 64, .signatures = true,
                                  .host_sample_all = true};
    struct moe_batcher_sink sink = {.user = &seen, .token = sig_token, .done = sig_done,
                                    .error = plp_error, .report = bt_report};
    CHECK_EQ(moe_batcher_init(&b, &cfg, &sink), 0);
    int32_t p1[150], p3[160];
    for (int i = 0; i < 150; i++)
        p1[i] = (int32_t)((uint32_t)(i * 37 + 1) % V);
    memcpy(p3, p1, sizeof p1);
    for (int i = 150; i < 160; i++)
        p3[i] = (int32_t)((uint32_t)(i * 19 + 4) % V);
    const int32_t p2[5] = {9, 8, 7, 6, 5};
    share_add(b, 2, p2, 5, 40); /* decodes while job 1's prompt goes in bites */
    CHECK_EQ(moe_batcher_step(b), 0);
    share_add(b, 1, p1, 150, 2);
    for (int guard = 0; moe_batcher_busy(b) && guard < 1000; guard++)
        CHECK_EQ(moe_batcher_step(b), 0);
    share_add(b, 3, p3, 160, 2);
    for (int guard = 0; moe_batcher_busy(b) && guard < 1000; guard++)
        CHECK_EQ(moe_batcher_step(b), 0);
    CHECK_EQ(seen.done, 3);
    CHECK(seen.n_cached[2] >= 150); /* job 3 continued from job 1's kept cache */
    for (int j = 0; j < 3; j++)
        for (uint32_t l = 0; l < L; l++) {
            uint64_t sum = 0;
            for (uint32_t x = 0; x < E; x++)
                sum += seen.sig[j][(size_t)l * E + x];
            CHECK_EQ(sum, (uint64_t)(seen.n_prompt[j] - seen.n_cached[j]) * K);
        }
    uint32_t *ref = calloc((size_t)L * E, 4);
    CHECK(ref);
    struct moe_engine *r = sig_engine(&tm.m, 256, 1, 256);
    sig_prefill(r, 0, 0, p1, 150, ref);
    CHECK(memcmp(ref, seen.sig[0], sizeof *ref * L * E) == 0);
    moe_engine_free(r);
    free(ref);
    for (int j = 0; j < 3; j++)
        free(seen.sig[j]);
    moe_batcher_free(b);
    moe_engine_free(e);
    test_model_close(&tm);
}

/* Decode ahead in the batcher: what each job receives (tokens, end, reason, cached prompt) is
 * what one step at a time gives (MOE_DECODE_AHEAD=0), with jobs that end by length, by the
 * context and by cancellation mid-run, and one that arrives mid-run and copies a running job's
 * prompt; the queue is empty when the batcher is idle. */
struct ah_seen {
    int32_t tok[8][64];
    uint32_t n[8], n_gen[8], n_cached[8];
    int reason[8], done, errors, steps, queued_max;
    bool ended[8];
};

static void ah_token(void *user, uint64_t id, int32_t token, const struct moe_token_lp *lp)
{
    struct ah_seen *s = user;
    (void)lp;
    CHECK(id < 8 && s->n[id] < 64);
    s->tok[id][s->n[id]++] = token;
}

static void ah_done(void *user, uint64_t id, enum moe_finish reason, uint32_t n_prompt,
                    uint32_t n_gen, uint32_t n_cached, const uint32_t *sig)
{
    struct ah_seen *s = user;
    (void)n_prompt, (void)sig;
    s->reason[id] = (int)reason;
    s->ended[id] = true;
    s->n_gen[id] = n_gen;
    s->n_cached[id] = n_cached;
    s->done++;
}

static void ah_error(void *user, uint64_t id, int code, const char *msg)
{
    struct ah_seen *s = user;
    fprintf(stderr, "job %llu: %d %s\n", (unsigned long long)id, code, msg);
    s->errors++;
}

static void ah_add(struct moe_batcher *b, uint64_t id, const int32_t *prompt, uint32_t n,
                   uint32_t max_tokens, uint64_t seed)
{
    struct moe_job *j = calloc(1, sizeof *j);
    CHECK(j);
    j->id = id;
    j->prompt = malloc(sizeof *prompt * n);
    CHECK(j->prompt);
    memcpy(j->prompt, prompt, sizeof *prompt * n);
    j->n_prompt = n;
    j->max_tokens = max_tokens;
    j->slot = -1;
    moe_sampler_defaults(&j->sp);
    j->sp.seed = seed;
    j->sp.repeat_penalty = 1.1f;
    if (id == 3) {
        /* A logit bias (tokens 0..9 banned, 17 raised): the engine's sampler takes it, so the
         * job decodes ahead like the others. */
        j->n_bias = 11;
        j->bias_tok = malloc(sizeof *j->bias_tok * j->n_bias);
        j->bias_val = malloc(sizeof *j->bias_val * j->n_bias);
        CHECK(j->bias_tok && j->bias_val);
        for (uint32_t i = 0; i < 10; i++)
            j->bias_tok[i] = (int32_t)i, j->bias_val[i] = -100.0f;
        j->bias_tok[10] = 17, j->bias_val[10] = 2.0f;
    }
    moe_batcher_add(b, j);
}

static void ah_run(const struct moe_model *m, bool ahead, struct ah_seen *seen)
{
    const uint32_t V = m->hp.n_vocab, n_ctx = 64;
    struct moe_engine *e = test_engine(m, n_ctx, 3, 0, 2);
    struct moe_batcher *b = NULL;
    struct moe_batcher_cfg cfg = {.eng = e, .n_vocab = V, .n_layer = m->hp.n_layer,
                                  .n_expert = m->hp.n_expert, .n_ctx = n_ctx, .n_seq = 3,
                                  .n_batch = 64};
    struct moe_batcher_sink sink = {.user = seen, .token = ah_token, .done = ah_done,
                                    .error = ah_error, .report = bt_report};
    if (!ahead)
        setenv("MOE_DECODE_AHEAD", "0", 1);
    CHECK_EQ(moe_batcher_init(&b, &cfg, &sink), 0);
    unsetenv("MOE_DECODE_AHEAD");
    int32_t p[3][40];
    for (uint32_t i = 0; i < 40; i++)
        for (int k = 0; k < 3; k++)
            p[k][i] = (int32_t)((i * (31 + 6 * k) + 7 + k) % V);
    ah_add(b, 1, p[0], 20, 12, 5);  /* ends by length */
    ah_add(b, 2, p[1], 12, 40, 6);  /* cancelled when job 1 has 6 tokens */
    ah_add(b, 3, p[2], 40, 40, 7);  /* ends by the context: 40 + 24 positions */
    bool added = false, cancelled = false, cont = false;
    int32_t p5[40];
    for (int guard = 0; moe_batcher_busy(b) && guard < 1000; guard++) {
        if (!cont && seen->ended[1]) {
            /* Job 1's conversation goes on: its prompt and answer, from its slot's KV. */
            memcpy(p5, p[0], sizeof *p5 * 20);
            memcpy(p5 + 20, seen->tok[1], sizeof *p5 * 11);
            ah_add(b, 5, p5, 31, 8, 9);
            cont = true;
        }
        if (!cancelled && seen->n[1] >= 6) {
            moe_batcher_cancel(b, 2);
            cancelled = true;
        }
        if (!added && seen->n[1] >= 4) {
            ah_add(b, 4, p[0], 20, 9, 8); /* job 1's prompt: copied from its slot */
            added = true;
        }
        CHECK_EQ(moe_batcher_step(b), 0);
        seen->steps++;
        if (moe_engine_queued(e) > seen->queued_max)
            seen->queued_max = moe_engine_queued(e);
    }
    CHECK(!moe_batcher_busy(b));
    CHECK_EQ(moe_engine_queued(e), 0);
    moe_batcher_free(b);
    moe_engine_free(e);
}

TEST(batcher_decode_ahead_equals_one_step_at_a_time)
{
    struct test_model tm;
    test_model_open_golden(&tm, "Q8_0");
    static struct ah_seen one, ahead;
    memset(&one, 0, sizeof one);
    memset(&ahead, 0, sizeof ahead);
    ah_run(&tm.m, false, &one);
    ah_run(&tm.m, true, &ahead);
    CHECK_EQ(one.errors, 0);
    CHECK_EQ(ahead.errors, 0);
    CHECK_EQ(one.done, 4); /* 1, 3, 4, 5 (a cancelled job is not reported) */
    CHECK_EQ(ahead.done, 4);
    CHECK_EQ(one.n_cached[5], 30);
    CHECK_EQ(one.n[1], 12);
    CHECK_EQ(one.reason[1], MOE_FINISH_LENGTH);
    CHECK_EQ(one.n[3], 64 - 40 + 1); /* the last from position 63 */
    CHECK_EQ(one.reason[3], MOE_FINISH_LENGTH);
    CHECK_EQ(one.n[4], 9);
    CHECK_EQ(one.n_cached[4], 19);
    for (int id = 1; id <= 5; id++) {
        CHECK_MSG(one.n[id] == ahead.n[id], "job %d: %u tokens one step at a time, %u ahead", id,
                  one.n[id], ahead.n[id]);
        if (id == 2)
            continue; /* cancelled: how many it got depends on the timing */
        CHECK_EQ(one.reason[id], ahead.reason[id]);
        CHECK_EQ(one.n_gen[id], ahead.n_gen[id]);
        CHECK_EQ(one.n_cached[id], ahead.n_cached[id]);
        for (uint32_t k = 0; k < one.n[id]; k++)
            CHECK_MSG(one.tok[id][k] == ahead.tok[id][k], "job %d token %u: %d, %d ahead", id, k,
                      one.tok[id][k], ahead.tok[id][k]);
    }
    for (uint32_t k = 0; k < one.n[2] && k < ahead.n[2]; k++)
        CHECK_EQ(one.tok[2][k], ahead.tok[2][k]);
    for (uint32_t k = 0; k < ahead.n[3]; k++)
        CHECK(ahead.tok[3][k] >= 10); /* banned */
    CHECK_EQ(one.queued_max, 0);
    CHECK_EQ(ahead.queued_max, 1); /* between calls: the step whose tokens the next one takes */
    test_model_close(&tm);
}
