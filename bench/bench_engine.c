/* End-to-end engine benchmark on any backend: prompt processing, time to first token, decode at
 * batch 1 and aggregate decode at several concurrent sequences, through the engine API the worker
 * serves with (moe_engine_forward_sample: the engine samples, on the GPU for CUDA, and returns
 * token ids). Prompt tokens are random (the speed does not depend on them beyond routing);
 * decode feeds back the greedy token, so routing follows the model like real traffic.
 *
 *   build/bench/bench_engine MODEL.gguf [--device cpu|cuda:K] [--prompt 512] [--gen 128]
 *                            [--batches 4,16,64] [--long 4096] [--threads N]
 *
 * Prints one line per measurement and a summary table. Timing is wall clock around whole engine
 * calls (each ends with the step's synchronisation), after one warm-up of every shape. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/io.h"
#include "worker/engine.h"
#include "worker/engine_load.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

/* Prefill of n tokens on seq from position 0, sampling the first token; seconds. */
static double prefill(struct moe_engine *e, int32_t seq, int64_t n, int64_t V, int32_t *first)
{
    int32_t *tok = malloc(sizeof(int32_t) * n), *pos = malloc(sizeof(int32_t) * n),
            *sq = malloc(sizeof(int32_t) * n);
    uint8_t *want = calloc((size_t)n, 1);
    if (!tok || !pos || !sq || !want)
        exit(1);
    for (int64_t i = 0; i < n; i++) {
        tok[i] = (int32_t)(rnd() % V);
        pos[i] = (int32_t)i;
        sq[i] = seq;
    }
    want[n - 1] = 1;
    moe_engine_seq_clear(e, seq);
    struct moe_sampler_params sp;
    moe_sampler_defaults(&sp);
    sp.temperature = 0.0f;
    if (moe_engine_seq_sampler(e, seq, &sp, tok, (size_t)n)) {
        fprintf(stderr, "bench_engine: sampler: %s\n", moe_engine_errmsg(e));
        exit(1);
    }
    struct moe_batch b = {.n = (uint32_t)n, .token = tok, .pos = pos, .seq = sq, .logits = want};
    double t0 = moe_now_s();
    if (moe_engine_forward_sample(e, &b, first)) {
        fprintf(stderr, "bench_engine: prefill: %s\n", moe_engine_errmsg(e));
        exit(1);
    }
    double dt = moe_now_s() - t0;
    free(tok), free(pos), free(sq), free(want);
    return dt;
}

/* steps decode steps of B sequences (0..B-1) that each hold `start` positions; seconds. */
static double decode(struct moe_engine *e, int B, int64_t start, int steps, int32_t *cur)
{
    int32_t pos[1024], sq[1024], nx[1024];
    double t0 = moe_now_s();
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < B; i++) {
            pos[i] = (int32_t)(start + s);
            sq[i] = i;
        }
        struct moe_batch b = {.n = (uint32_t)B, .token = cur, .pos = pos, .seq = sq};
        if (moe_engine_forward_sample(e, &b, nx)) {
            fprintf(stderr, "bench_engine: decode: %s\n", moe_engine_errmsg(e));
            exit(1);
        }
        for (int i = 0; i < B; i++)
            cur[i] = nx[i] >= 0 ? nx[i] : 0;
    }
    return moe_now_s() - t0;
}

/* decode() with each step queued before the tokens of the one before it are back
 * (moe_engine_submit_sample, the tokens MOE_ENGINE_TOKEN_NEXT); seconds. */
static double decode_ahead(struct moe_engine *e, int B, int64_t start, int steps, int32_t *cur)
{
    int32_t pos[1024], sq[1024], nx[1024], next[1024];
    for (int i = 0; i < B; i++)
        next[i] = MOE_ENGINE_TOKEN_NEXT;
    double t0 = moe_now_s();
    for (int s = 0; s <= steps; s++) {
        if (s < steps) {
            for (int i = 0; i < B; i++) {
                pos[i] = (int32_t)(start + s);
                sq[i] = i;
            }
            struct moe_batch b = {.n = (uint32_t)B, .token = s ? next : cur, .pos = pos, .seq = sq};
            if (moe_engine_submit_sample(e, &b)) {
                fprintf(stderr, "bench_engine: decode ahead: %s\n", moe_engine_errmsg(e));
                exit(1);
            }
        }
        if (s > 0 && moe_engine_collect(e, nx, NULL)) {
            fprintf(stderr, "bench_engine: decode ahead: %s\n", moe_engine_errmsg(e));
            exit(1);
        }
    }
    for (int i = 0; i < B; i++)
        cur[i] = nx[i] >= 0 ? nx[i] : 0;
    return moe_now_s() - t0;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *device = "cpu";
    int64_t P = 512, G = 128, LONG = 4096;
    int threads = 0, batches[8] = {4, 16, 64}, nbat = 3, ahead = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--device") && v)
            device = v, i++;
        else if (!strcmp(a, "--prompt") && v)
            P = atoll(v), i++;
        else if (!strcmp(a, "--gen") && v)
            G = atoll(v), i++;
        else if (!strcmp(a, "--long") && v)
            LONG = atoll(v), i++;
        else if (!strcmp(a, "--threads") && v)
            threads = atoi(v), i++;
        else if (!strcmp(a, "--ahead") && v)
            ahead = atoi(v), i++;
        else if (!strcmp(a, "--batches") && v) {
            nbat = 0;
            for (char *s = (char *)v; *s && nbat < 8;) {
                batches[nbat++] = atoi(s);
                while (*s && *s != ',')
                    s++;
                if (*s == ',')
                    s++;
            }
            i++;
        } else if (a[0] != '-')
            model = a;
        else {
            fprintf(stderr, "bench_engine: unknown argument %s\n", a);
            return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0); /* progress shows even when a run is cut short */
    if (!model) {
        fprintf(stderr, "usage: bench_engine MODEL.gguf [--device D] [--prompt N] [--gen N] "
                        "[--batches 4,16,64] [--long N] [--threads N] [--ahead 0|1]\n");
        return 2;
    }
    int maxb = 1;
    for (int i = 0; i < nbat; i++)
        if (batches[i] > maxb)
            maxb = batches[i];
    if (maxb > 1024)
        return 2;
    char err[512];
    struct moe_loaded lm = {0};
    if (moe_loaded_open(&lm, model, false, err, sizeof err)) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    const int64_t V = lm.model.hp.n_vocab;
    int64_t ctx = LONG > P + G ? LONG : P + G;
    if (ctx < 128 + 34)
        ctx = 128 + 34;
    ctx += 8;
    struct moe_engine_opts o = {.n_ctx = (uint32_t)ctx, .n_seq = (uint32_t)maxb, .n_batch = 512,
                                .n_threads = threads, .device = device};
    struct moe_engine *e = NULL;
    double t0 = moe_now_s();
    if (moe_engine_init(&e, &lm.model, &o, err, sizeof err)) {
        fprintf(stderr, "bench_engine: %s\n", err);
        return 1;
    }
    struct moe_engine_info info;
    moe_engine_info(e, &info);
    printf("engine: %s (%s), init %.2f s, model %.2f GiB, n_ctx %" PRId64 ", n_seq %d\n",
           info.device, info.desc, moe_now_s() - t0,
           (double)(lm.model.bytes_dense + lm.model.bytes_experts) / (1 << 30), ctx, maxb);
    int32_t cur[1024];

    /* Warm-up of every shape used below (graphs are recorded on first use). */
    prefill(e, 0, P, V, &cur[0]);
    decode(e, 1, P, 4, cur);
    decode_ahead(e, 1, P, 4, cur);

    double tp = prefill(e, 0, P, V, &cur[0]);
    printf("prompt %" PRId64 ": %.3f s, %.1f tok/s (time to first token %.1f ms)\n", P, tp,
           (double)P / tp, 1e3 * tp);
    double td = decode(e, 1, P, (int)G, cur);
    printf("decode batch 1: %" PRId64 " tokens after %" PRId64 ": %.1f tok/s (%.3f ms/token)\n", G,
           P, (double)G / td, 1e3 * td / (double)G);
    /* The same steps again, each queued before the tokens of the one before are back: the
     * default of the batches below (--ahead 0: one step at a time there too). */
    const double ta = decode_ahead(e, 1, P, (int)G, cur);
    printf("decode ahead batch 1: %" PRId64 " tokens after %" PRId64 ": %.1f tok/s (%.3f "
           "ms/token, %.3fx one step at a time)\n", G, P, (double)G / ta, 1e3 * ta / (double)G,
           td / ta);
    if (ahead)
        td = ta;
    double agg[8] = {0};
    for (int bi = 0; bi < nbat; bi++) {
        int B = batches[bi];
        const int64_t bp = 128;
        for (int i = 0; i < B; i++)
            prefill(e, i, bp, V, &cur[i]);
        decode(e, B, bp, 2, cur); /* warm-up: records the graph of this batch */
        int steps = 32;
        double t = ahead ? decode_ahead(e, B, bp + 2, steps, cur) : decode(e, B, bp + 2, steps, cur);
        agg[bi] = (double)B * steps / t;
        printf("decode batch %d: %d steps after %" PRId64 "-token prompts: %.1f tok/s aggregate "
               "(%.2f ms/step, %.2fx batch 1)\n", B, steps, bp, agg[bi], 1e3 * t / steps,
               agg[bi] / ((double)G / td));
    }
    double tl = 0;
    if (LONG > 0) {
        prefill(e, 0, LONG < 1024 ? LONG : 1024, V, &cur[0]);
        tl = prefill(e, 0, LONG, V, &cur[0]);
        printf("prompt %" PRId64 ": %.3f s, %.1f tok/s\n", LONG, tl, (double)LONG / tl);
    }
    /* The floor of one decode token: every byte it must read once (dense weights, the output
     * head, one embedding row, k experts per layer) over the HBM read rate. */
    const struct moe_model *mm = &lm.model;
    double bytes = (double)mm->output.nbytes +
                   (double)mm->token_embd.nbytes / (double)mm->hp.n_vocab;
    for (uint32_t l = 0; l < mm->hp.n_layer; l++) {
        const struct moe_layer *ly = &mm->layers[l];
        bytes += (double)(ly->attn_q.nbytes + ly->attn_k.nbytes + ly->attn_v.nbytes +
                          ly->attn_output.nbytes + ly->ffn_gate_inp.nbytes + ly->attn_norm.nbytes +
                          ly->ffn_norm.nbytes);
        bytes += (double)mm->hp.n_expert_used * (double)moe_model_expert_bytes(mm, l);
    }
    const double hbm = 4.4e12; /* H200 device copy, measured (docs/benchmarks.md) */
    moe_engine_info(e, &info);
    printf("bytes per decoded token %.2f GB; at %.1f TB/s the floor is %.3f ms (%.0f tok/s); "
           "batch 1 reaches %.1f%% of it\n", bytes / 1e9, hbm / 1e12, 1e3 * bytes / hbm,
           hbm / bytes, 100.0 * ((double)G / td) / (hbm / bytes));
    printf("engine after the run: %s\n", info.desc);
    printf("\n| device | prompt %" PRId64 " tok/s | TTFT ms | decode b1 tok/s |", P);
    for (int bi = 0; bi < nbat; bi++)
        printf(" b%d agg tok/s |", batches[bi]);
    if (LONG > 0)
        printf(" prompt %" PRId64 " tok/s |", LONG);
    printf("\n| %s | %.1f | %.1f | %.1f |", info.device, (double)P / tp, 1e3 * tp,
           (double)G / td);
    for (int bi = 0; bi < nbat; bi++)
        printf(" %.1f |", agg[bi]);
    if (LONG > 0)
        printf(" %.1f |", (double)LONG / tl);
    printf("\n");
    moe_engine_free(e);
    moe_loaded_close(&lm);
    return 0;
}
