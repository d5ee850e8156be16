/* worker/cuda/sample.cu against worker/sampler.c, step by step in lockstep: each step makes new
 * random logits for every row, samples them on the GPU (accepting the tokens into the device
 * history) and with one CPU sampler per row (moe_sampler_sample, then moe_sampler_accept).
 *
 *   greedy rows, rows with nothing to sample: the GPU token must equal the CPU's, every time;
 *   seeded rows: the same token for >= 99.9% of the draws (sums run in another order, so a draw
 *     whose uniform number lands within rounding of a cumulative boundary may differ; the count
 *     is printed), and after the run every row's generator state must equal the CPU's exactly;
 *   the penalised logits the kernel leaves in place must equal moe_sampler_apply_penalties' bit
 *     for bit; the device history must equal the CPU's; logprobs must match a double log-softmax.
 *
 * Tokens and logprobs are poisoned before every launch. Vocabularies of 33, 1000, 4097 (rows not
 * 16-byte aligned) and 151936 logits; logits Gaussian of several scales, quantized (ties),
 * peaked, flat, LLM-like, sprinkled with -inf and NaN, all -inf / NaN, all equal, -0/+0, +inf.
 * Each configuration also runs with an 8-entry sort list, which sends most rows down the exact
 * large-set path. A CUDA graph of the launch must replay to the same tokens as direct launches.
 * Without a GPU every test skips. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "store/err.h"
#include "tests/gpu/gpu_test.h"
#include "tests/harness.h"
#include "worker/cuda/sample.h"
#include "worker/sampler.h"
#include "tests/sample_cases.h"

/* One GPU sampler with `rows` rows against one CPU sampler per row. */
struct run {
    uint32_t nv, rows, hist_cap;
    struct moe_cuda_sampler *g;
    struct moe_sampler **cpu;
    struct moe_sampler_params *p;
    int greedy_row[64];
    const char *name[64];
    int32_t **hist; /* each row's accepted tokens, as the CPU saw them */
    size_t *n_hist;
    float *h_logits, *h_pen, *h_back, *d_logits, *h_lp, *d_lp;
    int32_t *h_tok, *d_tok;
    cudaStream_t st;
    long draws, disagree, exact;
};

static void hist_push(struct run *r, uint32_t row, int32_t t)
{
    if (t < 0)
        return;
    r->hist[row][r->n_hist[row]++] = t;
}

/* Sets every row's parameters (combo of row + offset), seed, and a random prompt history. */
static void run_init(struct run *r, uint32_t nv, uint32_t rows, uint32_t list_cap, size_t max_steps,
                     int offset, uint64_t seed)
{
    memset(r, 0, sizeof *r);
    r->nv = nv;
    r->rows = rows;
    /* Large enough for the whole run: rows with penalty_last_n < 0 use every accepted token, and
     * the device ring equals that only while it holds them all. */
    r->hist_cap = max_steps + 64 > 256 ? (uint32_t)max_steps + 64 : 256;
    char err[256] = "";
    int rc = moe_cuda_sampler_init(&r->g, rows, nv, r->hist_cap, list_cap, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_cuda_sampler_init: %s (%s)", moe_strerror(rc), err);
    CU(cudaStreamCreateWithFlags(&r->st, cudaStreamNonBlocking));
    r->cpu = calloc(rows, sizeof *r->cpu);
    r->p = calloc(rows, sizeof *r->p);
    r->hist = calloc(rows, sizeof *r->hist);
    r->n_hist = calloc(rows, sizeof *r->n_hist);
    size_t n = (size_t)rows * nv;
    r->h_logits = malloc(n * sizeof(float));
    r->h_pen = malloc(n * sizeof(float));
    r->h_back = malloc(n * sizeof(float));
    r->h_lp = malloc(rows * sizeof(float));
    r->h_tok = malloc(rows * sizeof(int32_t));
    CHECK(r->cpu && r->p && r->hist && r->n_hist && r->h_logits && r->h_pen && r->h_back &&
          r->h_lp && r->h_tok);
    CU(cudaMalloc((void **)&r->d_logits, n * sizeof(float)));
    CU(cudaMalloc((void **)&r->d_lp, rows * sizeof(float)));
    CU(cudaMalloc((void **)&r->d_tok, rows * sizeof(int32_t)));
    for (uint32_t row = 0; row < rows; row++) {
        const struct combo *c = &combos[(row + (uint32_t)offset) % N_COMBO];
        struct moe_sampler_params *p = &r->p[row];
        moe_sampler_defaults(p);
        p->temperature = c->t;
        p->top_k = c->k;
        p->top_p = c->top_p;
        p->min_p = c->min_p;
        p->repeat_penalty = c->rep;
        p->presence_penalty = c->pres;
        p->frequency_penalty = c->freq;
        p->penalty_last_n = c->last_n;
        p->seed = seed + row * 7919u;
        r->greedy_row[row] = !(c->t > 0.0f);
        r->name[row] = c->name;
        rc = moe_sampler_init(&r->cpu[row], p, nv, err, sizeof err);
        CHECK_MSG(rc == 0, "moe_sampler_init: %s", err);
        rc = moe_cuda_sampler_set_row(r->g, row, p, r->st, err, sizeof err);
        CHECK_MSG(rc == 0, "moe_cuda_sampler_set_row: %s (%s)", moe_strerror(rc), err);
        r->hist[row] = malloc((max_steps + 64) * sizeof(int32_t));
        CHECK(r->hist[row]);
        int32_t prompt[40];
        for (int i = 0; i < 40; i++)
            prompt[i] = (int32_t)(moe_test_rng_u32() % nv);
        prompt[5] = -3;                 /* outside the vocabulary: both skip it */
        prompt[9] = (int32_t)nv + 11;
        for (int i = 0; i < 40; i++) {
            moe_sampler_accept(r->cpu[row], prompt[i]);
            if (prompt[i] >= 0 && (uint32_t)prompt[i] < nv)
                hist_push(r, row, prompt[i]);
        }
        CHECK_EQ(moe_cuda_sampler_set_history(r->g, row, prompt, 40, r->st), 0);
    }
    CU(cudaStreamSynchronize(r->st));
}

static void run_free(struct run *r)
{
    for (uint32_t row = 0; row < r->rows; row++) {
        moe_sampler_free(r->cpu[row]);
        free(r->hist[row]);
    }
    moe_cuda_sampler_free(r->g);
    CU(cudaFree(r->d_logits));
    CU(cudaFree(r->d_lp));
    CU(cudaFree(r->d_tok));
    CU(cudaStreamDestroy(r->st));
    free(r->cpu);
    free(r->p);
    free(r->hist);
    free(r->n_hist);
    free(r->h_logits);
    free(r->h_pen);
    free(r->h_back);
    free(r->h_lp);
    free(r->h_tok);
}

static int same_float(float a, float b)
{
    uint32_t x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    return x == y || (isnan(a) && isnan(b));
}

/* One step: logits of generator gen(row, step) for every row, one launch, the CPU per row. */
static void run_step(struct run *r, int step, int (*gen)(uint32_t row, int step), int check_pen)
{
    const uint32_t nv = r->nv;
    const size_t n = (size_t)r->rows * nv;
    int g_of[64];
    for (uint32_t row = 0; row < r->rows; row++) {
        g_of[row] = gen(row, step);
        make_logits(g_of[row], r->h_logits + (size_t)row * nv, nv);
    }
    CU(cudaMemcpyAsync(r->d_logits, r->h_logits, n * sizeof(float), cudaMemcpyHostToDevice, r->st));
    CU(cudaMemsetAsync(r->d_tok, 0x7f, r->rows * sizeof(int32_t), r->st));
    CU(cudaMemsetAsync(r->d_lp, 0xff, r->rows * sizeof(float), r->st)); /* NaN */
    CHECK_EQ(moe_cuda_sample(r->g, r->d_logits, r->rows, r->d_tok, r->d_lp, 1, r->st), 0);
    CU(cudaMemcpyAsync(r->h_tok, r->d_tok, r->rows * sizeof(int32_t), cudaMemcpyDeviceToHost, r->st));
    CU(cudaMemcpyAsync(r->h_lp, r->d_lp, r->rows * sizeof(float), cudaMemcpyDeviceToHost, r->st));
    if (check_pen)
        CU(cudaMemcpyAsync(r->h_back, r->d_logits, n * sizeof(float), cudaMemcpyDeviceToHost, r->st));
    CU(cudaStreamSynchronize(r->st));

    for (uint32_t row = 0; row < r->rows; row++) {
        const float *l = r->h_logits + (size_t)row * nv;
        float *pen = r->h_pen + (size_t)row * nv;
        memcpy(pen, l, nv * sizeof(float));
        moe_sampler_apply_penalties(r->cpu[row], pen);
        if (check_pen)
            for (uint32_t i = 0; i < nv; i++)
                CHECK_MSG(same_float(r->h_back[(size_t)row * nv + i], pen[i]),
                          "nv=%u row %u (%s) step %d: penalised logit %u gpu %.9g cpu %.9g", nv, row,
                          gen_name[g_of[row]], step, i, (double)r->h_back[(size_t)row * nv + i],
                          (double)pen[i]);
        const int32_t tc = moe_sampler_sample(r->cpu[row], l), tg = r->h_tok[row];
        CHECK_MSG(tg >= -1 && tg < (int32_t)nv, "nv=%u row %u step %d: token %d not written", nv,
                  row, step, tg);
        if (g_of[row] == G_PINF && !r->greedy_row[row]) {
            /* The CPU's arithmetic degenerates on +inf; the device picks the lowest +inf id. */
            int32_t want = -1;
            for (uint32_t i = 0; i < nv && want < 0; i++)
                if (pen[i] == INFINITY)
                    want = (int32_t)i;
            CHECK_MSG(tg == want, "nv=%u row %u: +inf row gave %d, want %d", nv, row, tg, want);
        } else if (r->greedy_row[row] || tc < 0 || tg < 0) {
            CHECK_MSG(tg == tc, "nv=%u row %u (%s, %s) step %d: gpu %d cpu %d", nv, row,
                      r->name[row], gen_name[g_of[row]], step, tg, tc);
            r->exact++;
        } else {
            r->draws++;
            if (tg != tc) {
                r->disagree++;
                if (r->disagree <= 5)
                    printf("  disagreement nv=%u row %u (%s, %s) step %d: gpu %d (%.9g) cpu %d "
                           "(%.9g)\n", nv, row, r->name[row], gen_name[g_of[row]], step, tg,
                           (double)pen[tg], tc, (double)pen[tc]);
            }
        }
        /* logprob of the GPU's token under the penalised logits at temperature 1 */
        if (tg >= 0 && g_of[row] != G_PINF) {
            double mx = -INFINITY, z = 0.0;
            for (uint32_t i = 0; i < nv; i++)
                if (pen[i] > mx)
                    mx = pen[i];
            for (uint32_t i = 0; i < nv; i++)
                if (pen[i] > -INFINITY)
                    z += exp((double)pen[i] - mx);
            double want = (double)pen[tg] - mx - log(z);
            CHECK_MSG(fabs((double)r->h_lp[row] - want) <= 1e-3 + 1e-5 * fabs(want),
                      "nv=%u row %u: logprob gpu %.9g want %.9g", nv, row, (double)r->h_lp[row], want);
        } else if (tg < 0) {
            CHECK_MSG(r->h_lp[row] == -INFINITY, "logprob of -1 is %g", (double)r->h_lp[row]);
        }
        moe_sampler_accept(r->cpu[row], tc);
        hist_push(r, row, tc);
        if (tg != tc)
            CHECK_EQ(moe_cuda_sampler_set_history(r->g, row, r->hist[row], r->n_hist[row], r->st), 0);
    }
}

/* After a run: generator states and histories equal the CPU's. */
static void run_check_state(struct run *r)
{
    int32_t *h = malloc(r->hist_cap * sizeof *h);
    CHECK(h);
    for (uint32_t row = 0; row < r->rows; row++) {
        uint64_t a[4], b[4];
        moe_sampler_rng_state(r->cpu[row], a);
        CHECK_EQ(moe_cuda_sampler_rng_state(r->g, row, b, r->st), 0);
        CHECK_MSG(memcmp(a, b, sizeof a) == 0, "nv=%u row %u: generator state differs", r->nv, row);
        int got = moe_cuda_sampler_history(r->g, row, h, r->hist_cap, r->st);
        size_t want = r->n_hist[row] < r->hist_cap ? r->n_hist[row] : r->hist_cap;
        CHECK_EQ(got, want);
        CHECK(memcmp(h, r->hist[row] + r->n_hist[row] - want, want * sizeof *h) == 0);
    }
    free(h);
}

static int gen_real(uint32_t row, int step)
{
    static const int g[] = {G_GAUSS1, G_GAUSS3, G_GAUSS8, G_QUANT, G_PEAK, G_FLAT, G_LLM,
                            G_SPARSE_INF, G_NAN, G_ZEROS, G_LLM, G_GAUSS3};
    return g[(row * 5 + (uint32_t)step) % (sizeof g / sizeof g[0])];
}

static int gen_edge(uint32_t row, int step)
{
    static const int g[] = {G_ALLINF, G_EQUAL, G_PINF, G_NAN, G_ZEROS, G_QUANT};
    return g[(row + (uint32_t)step * 3) % (sizeof g / sizeof g[0])];
}

static void check_vocab(uint32_t nv, int steps, uint64_t seed)
{
    need_gpu();
    moe_test_rng_seed(seed);
    const uint32_t caps[2] = {0, 8};
    long draws = 0, disagree = 0;
    for (int c = 0; c < 2; c++) {
        for (int half = 0; half < 2; half++) {
            struct run r;
            run_init(&r, nv, 8, caps[c], (size_t)steps + 8, half * 8, seed + (uint64_t)c * 100);
            for (int s = 0; s < steps; s++)
                run_step(&r, s, s % 7 == 6 ? gen_edge : gen_real, nv < 10000 || s % 8 == 0);
            run_check_state(&r);
            printf("nv=%u list %s combos %d-%d: %ld seeded draws, %ld disagree, %ld exact rows\n", nv,
                   caps[c] ? "8" : "default", half * 8, half * 8 + 7, r.draws, r.disagree, r.exact);
            CHECK(r.exact > 0 && r.draws > 0);
            draws += r.draws;
            disagree += r.disagree;
            run_free(&r);
        }
    }
    printf("nv=%u: %ld of %ld seeded draws disagree with the CPU\n", nv, disagree, draws);
    CHECK_MSG(disagree * 1000 <= draws, "nv=%u: %ld of %ld draws disagree", nv, disagree, draws);
}

TEST_TIMEOUT(cuda_sample_vocab_33, 300) { check_vocab(33, 1500, 11); }
TEST_TIMEOUT(cuda_sample_vocab_1000, 300) { check_vocab(1000, 1000, 12); }
TEST_TIMEOUT(cuda_sample_vocab_4097, 300) { check_vocab(4097, 300, 13); }
TEST_TIMEOUT(cuda_sample_vocab_151936, 600) { check_vocab(151936, 80, 14); }

/* Greedy and empty rows over many steps with 16 rows: exact every time, generator untouched. */
TEST_TIMEOUT(cuda_sample_greedy_exact, 300)
{
    need_gpu();
    moe_test_rng_seed(21);
    static const uint32_t nvs[] = {33, 1000, 4097, 151936};
    for (size_t v = 0; v < sizeof nvs / sizeof nvs[0]; v++) {
        struct run r;
        int steps = nvs[v] > 100000 ? 30 : 200;
        run_init(&r, nvs[v], 16, 0, (size_t)steps + 8, 0, 5);
        for (uint32_t row = 0; row < 16; row++) {
            char err[128];
            r.p[row].temperature = 0.0f;
            r.p[row].repeat_penalty = row % 2 ? 1.4f : 1.0f;
            r.p[row].presence_penalty = row % 3 ? 0.3f : 0.0f;
            r.p[row].frequency_penalty = row % 4 ? 0.1f : 0.0f;
            r.p[row].penalty_last_n = row % 5 ? 64 : -1;
            r.greedy_row[row] = 1;
            r.name[row] = "greedy+penalties";
            moe_sampler_free(r.cpu[row]);
            CHECK_EQ(moe_sampler_init(&r.cpu[row], &r.p[row], nvs[v], err, sizeof err), 0);
            CHECK_EQ(moe_cuda_sampler_set_row(r.g, row, &r.p[row], r.st, err, sizeof err), 0);
            r.n_hist[row] = 0;
            CHECK_EQ(moe_cuda_sampler_set_history(r.g, row, NULL, 0, r.st), 0);
        }
        for (int s = 0; s < steps; s++)
            run_step(&r, s, s % 3 == 2 ? gen_edge : gen_real, 1);
        CHECK_EQ(r.draws, 0);
        run_check_state(&r);
        printf("nv=%u: %ld greedy/empty rows exact\n", nvs[v], r.exact);
        run_free(&r);
    }
}

/* A graph of (copy logits in, sample) replayed step after step gives the tokens of direct
 * launches; also times both. */
TEST_TIMEOUT(cuda_sample_graph_replay, 300)
{
    need_gpu();
    static const uint32_t nvs[] = {1000, 151936};
    for (size_t v = 0; v < 2; v++) {
        const uint32_t nv = nvs[v], rows = 16;
        const int steps = 50;
        moe_test_rng_seed(31);
        struct run r;
        run_init(&r, nv, rows, 0, steps + 8, 2, 99);
        size_t n = (size_t)rows * nv;
        float *all = malloc(n * sizeof(float) * steps);
        int32_t *direct = malloc(sizeof(int32_t) * rows * steps);
        CHECK(all && direct);
        for (int s = 0; s < steps; s++)
            for (uint32_t row = 0; row < rows; row++)
                make_logits(gen_real(row, s), all + (size_t)s * n + (size_t)row * nv, nv);
        float *d_src;
        CU(cudaMalloc((void **)&d_src, n * sizeof(float)));
        int32_t *prompt = malloc(sizeof(int32_t) * 40);
        for (int i = 0; i < 40; i++)
            prompt[i] = (int32_t)(i * 37 % nv);
        for (int pass = 0; pass < 2; pass++) {
            char err[128];
            for (uint32_t row = 0; row < rows; row++) {
                CHECK_EQ(moe_cuda_sampler_set_row(r.g, row, &r.p[row], r.st, err, sizeof err), 0);
                CHECK_EQ(moe_cuda_sampler_set_history(r.g, row, prompt, 40, r.st), 0);
            }
            cudaGraphExec_t exec = NULL;
            cudaGraph_t graph = NULL;
            if (pass == 1) {
                CU(cudaStreamBeginCapture(r.st, cudaStreamCaptureModeThreadLocal));
                CU(cudaMemcpyAsync(r.d_logits, d_src, n * sizeof(float), cudaMemcpyDeviceToDevice, r.st));
                CHECK_EQ(moe_cuda_sample(r.g, r.d_logits, rows, r.d_tok, r.d_lp, 1, r.st), 0);
                CU(cudaStreamEndCapture(r.st, &graph));
                CU(cudaGraphInstantiate(&exec, graph, 0));
            }
            for (int s = 0; s < steps; s++) {
                CU(cudaMemcpyAsync(d_src, all + (size_t)s * n, n * sizeof(float),
                                   cudaMemcpyHostToDevice, r.st));
                CU(cudaMemsetAsync(r.d_tok, 0x7f, rows * sizeof(int32_t), r.st));
                if (pass == 0) {
                    CU(cudaMemcpyAsync(r.d_logits, d_src, n * sizeof(float),
                                       cudaMemcpyDeviceToDevice, r.st));
                    CHECK_EQ(moe_cuda_sample(r.g, r.d_logits, rows, r.d_tok, r.d_lp, 1, r.st), 0);
                } else {
                    CU(cudaGraphLaunch(exec, r.st));
                }
                CU(cudaMemcpyAsync(r.h_tok, r.d_tok, rows * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                   r.st));
                CU(cudaStreamSynchronize(r.st));
                for (uint32_t row = 0; row < rows; row++) {
                    if (pass == 0)
                        direct[s * rows + row] = r.h_tok[row];
                    else
                        CHECK_MSG(direct[s * rows + row] == r.h_tok[row],
                                  "nv=%u step %d row %u: replay %d direct %d", nv, s, row,
                                  r.h_tok[row], direct[s * rows + row]);
                }
            }
            if (pass == 1) {
                /* Timing: replays of the captured step (copy + sample) vs the copy alone. */
                cudaEvent_t e0, e1;
                CU(cudaEventCreate(&e0));
                CU(cudaEventCreate(&e1));
                const int reps = 200;
                float ms = 0.0f, ms_copy = 0.0f;
                CU(cudaEventRecord(e0, r.st));
                for (int i = 0; i < reps; i++)
                    CU(cudaGraphLaunch(exec, r.st));
                CU(cudaEventRecord(e1, r.st));
                CU(cudaEventSynchronize(e1));
                CU(cudaEventElapsedTime(&ms, e0, e1));
                CU(cudaEventRecord(e0, r.st));
                for (int i = 0; i < reps; i++)
                    CU(cudaMemcpyAsync(r.d_logits, d_src, n * sizeof(float),
                                       cudaMemcpyDeviceToDevice, r.st));
                CU(cudaEventRecord(e1, r.st));
                CU(cudaEventSynchronize(e1));
                CU(cudaEventElapsedTime(&ms_copy, e0, e1));
                printf("nv=%u rows=%u mixed combos: graph step %.1f us (of which logits copy %.1f us)\n",
                       nv, rows, 1000.0 * ms / reps, 1000.0 * ms_copy / reps);
                CU(cudaEventDestroy(e0));
                CU(cudaEventDestroy(e1));
                CU(cudaGraphExecDestroy(exec));
                CU(cudaGraphDestroy(graph));
            }
        }
        CU(cudaFree(d_src));
        free(prompt);
        free(all);
        free(direct);
        run_free(&r);
    }
}

/* The passes spread over the GPU are an optimisation only: two samplers set up alike, one
 * launched with every spread pass and one with none, draw the same tokens (the tier-C rows' sums
 * add the same terms in another order, so a draw could part only within a rounding of a
 * boundary; top-k rows find the same sorted top k another way), keep the same generators and leave the same penalised logits, row by row over
 * every parameter combination (greedy, with penalties, top-k, top-p, min-p, temperature alone),
 * through a row map; moe_cuda_sampler_row_spread says which rows take which pass. */
TEST_TIMEOUT(cuda_sample_spread_passes_are_an_optimisation, 300)
{
    need_gpu();
    static const uint32_t nvs[] = {33, 4097, 151936};
    for (size_t v = 0; v < sizeof nvs / sizeof nvs[0]; v++) {
        const uint32_t nv = nvs[v], rows = (uint32_t)N_COMBO, steps = nv > 100000 ? 12 : 40;
        moe_test_rng_seed(41 + (uint64_t)v);
        struct moe_cuda_sampler *g[2] = {NULL, NULL};
        char err[128];
        cudaStream_t st;
        CU(cudaStreamCreate(&st));
        const size_t n = (size_t)rows * nv;
        float *h = malloc(n * sizeof(float)), *out[2] = {malloc(n * sizeof(float)),
                                                          malloc(n * sizeof(float))};
        int32_t map[N_COMBO], tok[2][N_COMBO];
        CHECK(h && out[0] && out[1]);
        for (uint32_t r = 0; r < rows; r++)
            map[r] = (int32_t)((r * 7 + 3) % rows); /* logits row r -> state row map[r] */
        float *d_l[2];
        int32_t *d_tok, *d_map;
        CU(cudaMalloc((void **)&d_l[0], n * sizeof(float)));
        CU(cudaMalloc((void **)&d_l[1], n * sizeof(float)));
        CU(cudaMalloc((void **)&d_tok, 2 * rows * sizeof(int32_t)));
        CU(cudaMalloc((void **)&d_map, rows * sizeof(int32_t)));
        CU(cudaMemcpy(d_map, map, sizeof map, cudaMemcpyHostToDevice));
        for (int k = 0; k < 2; k++) {
            CHECK_EQ(moe_cuda_sampler_init(&g[k], rows, nv, 64, 0, err, sizeof err), 0);
            for (uint32_t r = 0; r < rows; r++) {
                const struct combo *c = &combos[r];
                struct moe_sampler_params p;
                moe_sampler_defaults(&p);
                p.temperature = c->t, p.top_k = c->k, p.top_p = c->top_p, p.min_p = c->min_p;
                p.repeat_penalty = c->rep, p.presence_penalty = c->pres;
                p.frequency_penalty = c->freq, p.penalty_last_n = c->last_n;
                p.seed = 1000 + r;
                CHECK_EQ(moe_cuda_sampler_set_row(g[k], r, &p, st, err, sizeof err), 0);
                const int nopen = c->rep == 1.0f && c->pres == 0.0f && c->freq == 0.0f;
                const int kind = !(c->t > 0.0f)                 ? MOE_CUDA_SPREAD_GREEDY
                                 : c->k <= 0 && !(c->top_p < 1.0f) ? MOE_CUDA_SPREAD_TIER_C
                                 : c->k >= 1 && c->k <= 64        ? MOE_CUDA_SPREAD_TOPK
                                 : c->k <= 0                      ? MOE_CUDA_SPREAD_TOPP
                                                                  : 0;
                const int want = kind && !nopen ? kind | MOE_CUDA_SPREAD_PENALTY : kind;
                CHECK_EQ(moe_cuda_sampler_row_spread(g[k], r), want);
            }
        }
        CHECK_EQ(moe_cuda_sampler_row_spread(g[0], rows), 0);
        for (uint32_t s = 0; s < steps; s++) {
            for (uint32_t r = 0; r < rows; r++)
                make_logits((int)((r + s) % N_GEN), h + (size_t)r * nv, nv);
            for (int k = 0; k < 2; k++) {
                CU(cudaMemcpyAsync(d_l[k], h, n * sizeof(float), cudaMemcpyHostToDevice, st));
                CU(cudaMemsetAsync(d_tok + k * rows, 0x7f, rows * sizeof(int32_t), st));
                const int spread = k ? MOE_CUDA_SPREAD_ALL : 0;
                CHECK_EQ(moe_cuda_sample_rows(g[k], d_l[k], rows, d_map, d_tok + k * rows, NULL,
                                              1, spread, st),
                         0);
            }
            CU(cudaMemcpyAsync(tok, d_tok, sizeof tok, cudaMemcpyDeviceToHost, st));
            CU(cudaMemcpyAsync(out[0], d_l[0], n * sizeof(float), cudaMemcpyDeviceToHost, st));
            CU(cudaMemcpyAsync(out[1], d_l[1], n * sizeof(float), cudaMemcpyDeviceToHost, st));
            CU(cudaStreamSynchronize(st));
            for (uint32_t r = 0; r < rows; r++)
                CHECK_MSG(tok[0][r] == tok[1][r], "nv=%u step %u row %u (%s): scan %d, none %d",
                          nv, s, r, combos[map[r]].name, tok[1][r], tok[0][r]);
            CHECK(memcmp(out[0], out[1], n * sizeof(float)) == 0);
        }
        for (uint32_t r = 0; r < rows; r++) {
            uint64_t r0[4], r1[4];
            CHECK_EQ(moe_cuda_sampler_rng_state(g[0], r, r0, st), 0);
            CHECK_EQ(moe_cuda_sampler_rng_state(g[1], r, r1, st), 0);
            CHECK(memcmp(r0, r1, sizeof r0) == 0);
        }
        printf("nv=%u: %u steps of %u rows, the same tokens with and without the spread passes\n",
               nv, steps, rows);
        moe_cuda_sampler_free(g[0]);
        moe_cuda_sampler_free(g[1]);
        CU(cudaFree(d_l[0]));
        CU(cudaFree(d_l[1]));
        CU(cudaFree(d_tok));
        CU(cudaFree(d_map));
        CU(cudaStreamDestroy(st));
        free(h);
        free(out[0]);
        free(out[1]);
    }
}

/* Bad sizes, parameters and pointers are error returns; n_rows 0 launches nothing. */
TEST(cuda_sample_rejects_bad_arguments)
{
    need_gpu();
    struct moe_cuda_sampler *g = NULL;
    char err[256];
    CHECK_EQ(moe_cuda_sampler_init(&g, 0, 100, 64, 0, err, sizeof err), -EINVAL);
    CHECK_EQ(moe_cuda_sampler_init(&g, 4, 0, 64, 0, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(moe_cuda_sampler_init(&g, 4, 100, 64, 1u << 20, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(moe_cuda_sampler_init(&g, 4, 100, 1u << 20, 0, err, sizeof err), MOE_ERANGE);
    CHECK(g == NULL);
    CHECK_EQ(moe_cuda_sampler_init(&g, 4, 100, 64, 0, err, sizeof err), 0);

    struct moe_sampler_params p;
    moe_sampler_defaults(&p);
    CHECK_EQ(moe_cuda_sampler_set_row(g, 4, &p, 0, err, sizeof err), -EINVAL);
    p.top_p = 0.0f;
    CHECK_EQ(moe_cuda_sampler_set_row(g, 0, &p, 0, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "top_p"));
    moe_sampler_defaults(&p);
    p.temperature = NAN;
    CHECK_EQ(moe_cuda_sampler_set_row(g, 0, &p, 0, err, sizeof err), MOE_ERANGE);
    moe_sampler_defaults(&p);
    p.penalty_last_n = 65;
    CHECK_EQ(moe_cuda_sampler_set_row(g, 0, &p, 0, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "penalty_last_n"));
    moe_sampler_defaults(&p);
    p.min_p = 1.5f;
    CHECK_EQ(moe_cuda_sampler_set_row(g, 0, &p, 0, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(moe_cuda_sampler_set_history(g, 4, NULL, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_sampler_set_history(g, 0, NULL, 3, 0), -EINVAL);

    float *dl;
    int32_t *dt, ht[4] = {7, 7, 7, 7};
    CU(cudaMalloc((void **)&dl, 4 * 100 * sizeof(float) + 16));
    CU(cudaMalloc((void **)&dt, 4 * sizeof(int32_t)));
    CU(cudaMemcpy(dt, ht, sizeof ht, cudaMemcpyHostToDevice));
    CHECK_EQ(moe_cuda_sample(g, dl, 5, dt, NULL, 1, 0), -EINVAL);
    CHECK_EQ(moe_cuda_sample(g, NULL, 1, dt, NULL, 1, 0), -EINVAL);
    CHECK_EQ(moe_cuda_sample(g, dl, 1, NULL, NULL, 1, 0), -EINVAL);
    CHECK_EQ(moe_cuda_sample(g, (float *)((char *)dl + 2), 1, dt, NULL, 1, 0), -EINVAL);
    CHECK_EQ(moe_cuda_sample(g, dl, 0, dt, NULL, 1, 0), 0);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(ht, dt, sizeof ht, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 4; i++)
        CHECK_EQ(ht[i], 7);
    /* The defaults row: a fresh device sampler is seeded with seed 0 like a CPU one. */
    uint64_t a[4], b[4];
    struct moe_sampler *cpu;
    moe_sampler_defaults(&p);
    CHECK_EQ(moe_sampler_init(&cpu, &p, 100, err, sizeof err), 0);
    moe_sampler_rng_state(cpu, a);
    CHECK_EQ(moe_cuda_sampler_rng_state(g, 3, b, 0), 0);
    CHECK(memcmp(a, b, sizeof a) == 0);
    moe_sampler_free(cpu);
    CU(cudaFree(dl));
    CU(cudaFree(dt));
    moe_cuda_sampler_free(g);
}
