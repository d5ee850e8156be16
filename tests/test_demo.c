/* The bundled demo model (models/kjv-demo-*.gguf, trained by tools/train-demo): moed computes
 * what PyTorch computed, its held-out perplexity matches, its greedy text is made of KJV words,
 * and its recorded routing traces show a placement learned from calibration traffic beating a
 * uniform one on held-out traffic. */
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "store/err.h"
#include "store/placement.h"
#include "tests/harness.h"

#define DEMO_F16 "models/kjv-demo-F16.gguf"
#define FIX "tests/fixtures/demo/"
#define N_VOCAB 4160
#define N_REF_ROWS 64 /* passage.logits64.f32 holds the first 64 positions */

/* The repository carries the F16 file only; the Q8_0 one is made from it with moectl quantize,
 * as a user would. Returns its path in the test's temporary directory. */
static const char *demo_q8_0(void)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/kjv-demo-Q8_0.gguf", moe_test_tmpdir());
    char *argv[] = {(char *)moe_test_bin("moectl"), "quantize", DEMO_F16, path, "q8_0", NULL};
    CHECK_EQ(moe_test_run(argv, "/dev/null", "/dev/null"), 0);
    return path;
}

static void parity(const char *model, double max_rel, double min_top1)
{
    char out[512], log[512];
    snprintf(out, sizeof out, "%s/logits.f32", moe_test_tmpdir());
    snprintf(log, sizeof log, "%s/stderr", moe_test_tmpdir());
    char *argv[] = {(char *)moe_test_bin("moed-worker"), "--model", (char *)model, "--prompt-file",
                    FIX "passage.txt", "-n", "0", "--dump-logits", out, NULL};
    CHECK_EQ(moe_test_run(argv, "/dev/null", log), 0);
    size_t n_ours = 0, n_ref = 0;
    float *ours = (float *)moe_test_read_file(out, &n_ours);
    float *ref = (float *)moe_test_read_file(FIX "passage.logits64.f32", &n_ref);
    CHECK(ours && ref);
    CHECK_EQ(n_ref, (size_t)N_REF_ROWS * N_VOCAB * 4);
    CHECK(n_ours >= n_ref); /* the prompt has more than 64 tokens; causal, so rows compare */
    size_t n = n_ref / 4;
    double rel = moe_test_rel_l2(ours, ref, n);
    int agree = (int)moe_test_top1_agree(ours, ref, N_REF_ROWS, N_VOCAB);
    printf("%s: rel-L2 %.3g vs PyTorch, top-1 agreement %d/%d\n", model, rel, agree, N_REF_ROWS);
    CHECK_MSG(rel <= max_rel, "rel-L2 %.3g > %.3g", rel, max_rel);
    CHECK_MSG(agree >= min_top1 * N_REF_ROWS, "top-1 agreement %d/%d", agree, N_REF_ROWS);
    free(ours);
    free(ref);
}

TEST(demo_parity_f16_vs_pytorch) { parity(DEMO_F16, 2e-3, 1.0); }
TEST(demo_parity_q8_0_vs_pytorch) { parity(demo_q8_0(), 3e-2, 0.95); }

/* Held-out perplexity through `moectl perplexity` equals PyTorch's (tools/train-demo/run/eval.json,
 * same windows, same weights) within 0.5%. */
TEST_TIMEOUT(demo_heldout_perplexity_matches_pytorch, 600)
{
    char out[512];
    snprintf(out, sizeof out, "%s/ppl.json", moe_test_tmpdir());
    char *argv[] = {(char *)moe_test_bin("moectl"), "perplexity", "-m", DEMO_F16, "-f",
                    FIX "heldout.txt", "--no-special", "--ctx", "512", "--json", NULL};
    CHECK_EQ(moe_test_run(argv, out, NULL), 0);
    json_error_t je;
    json_t *ours = json_load_file(out, 0, &je);
    json_t *ref = json_load_file("tools/train-demo/run/eval.json", 0, &je);
    CHECK(ours && ref);
    double p = json_real_value(json_object_get(ours, "ppl"));
    double q = json_real_value(json_object_get(ref, "heldout_ppl"));
    json_int_t n = json_integer_value(json_object_get(ours, "scored"));
    printf("held-out perplexity: moed %.5f, PyTorch %.5f over %lld tokens\n", p, q, (long long)n);
    CHECK_EQ(n, json_integer_value(json_object_get(ref, "heldout_tokens")));
    CHECK_MSG(fabs(p - q) <= 0.005 * q, "moed %.5f vs PyTorch %.5f", p, q);
    json_decref(ours);
    json_decref(ref);
}

/* Greedy text after "In the beginning God" is made of words of the KJV (a random-weight model
 * gives fragments that are not). */
TEST(demo_greedy_reads_like_kjv)
{
    char prompt[512], out[512];
    snprintf(prompt, sizeof prompt, "%s/prompt.txt", moe_test_tmpdir());
    snprintf(out, sizeof out, "%s/out.json", moe_test_tmpdir());
    moe_test_write_file(prompt, "In the beginning God", 20);
    char *argv[] = {(char *)moe_test_bin("moed-worker"), "--model", DEMO_F16, "--prompt-file", prompt,
                    "-n", "48", "--json", NULL};
    CHECK_EQ(moe_test_run(argv, out, "/dev/null"), 0);
    json_error_t je;
    json_t *o = json_load_file(out, 0, &je);
    CHECK(o);
    const char *text = json_string_value(json_object_get(o, "text"));
    CHECK(text && strlen(text) > 40);
    printf("greedy: In the beginning God%s\n", text);

    /* Every word of the continuation must occur in the held-out books. */
    char *held = moe_test_read_file(FIX "heldout.txt", NULL);
    CHECK(held);
    int words = 0, known = 0;
    const char *p = text;
    while (*p) {
        while (*p && !isalpha((unsigned char)*p))
            p++;
        const char *s = p;
        while (isalpha((unsigned char)*p))
            p++;
        if (p == s)
            break;
        char w[64];
        size_t len = (size_t)(p - s) < sizeof w - 1 ? (size_t)(p - s) : sizeof w - 1;
        memcpy(w, s, len);
        w[len] = 0;
        words++;
        /* a whole-word match: not preceded or followed by a letter */
        for (const char *h = strstr(held, w); h; h = strstr(h + 1, w))
            if ((h == held || !isalpha((unsigned char)h[-1])) && !isalpha((unsigned char)h[len])) {
                known++;
                break;
            }
    }
    printf("%d of %d words found in the held-out books\n", known, words);
    CHECK(words >= 8);
    CHECK_MSG(known >= words * 9 / 10, "only %d of %d words are KJV words", known, words);
    free(held);
    json_decref(o);
}

static uint64_t *trace_counts(const char *path, uint32_t n_layer, uint32_t k, uint32_t n_expert,
                              size_t *n_tok, uint8_t **raw)
{
    size_t len = 0;
    uint8_t *t = (uint8_t *)moe_test_read_file(path, &len);
    CHECK(t && len % (n_layer * k) == 0);
    *n_tok = len / (n_layer * k);
    uint64_t *c = calloc((size_t)n_layer * n_expert, sizeof *c);
    for (size_t i = 0; i < len; i++) {
        uint32_t l = (uint32_t)(i / k) % n_layer;
        CHECK(t[i] < n_expert);
        c[l * n_expert + t[i]]++;
    }
    *raw = t;
    return c;
}

/* Placement from calibration counts, judged on held-out routing: with room for a quarter of the
 * experts, it must serve clearly more routings than a uniform placement. */
TEST(demo_trace_placement_beats_uniform)
{
    const uint32_t L = 4, K = 4, E = 32;
    size_t n_cal, n_held;
    uint8_t *raw_cal, *raw_held;
    uint64_t *cal = trace_counts(FIX "trace-calib.u8", L, K, E, &n_cal, &raw_cal);
    uint64_t *held = trace_counts(FIX "trace-heldout.u8", L, K, E, &n_held, &raw_held);
    uint64_t bytes[4] = {1000, 1000, 1000, 1000};
    uint64_t budget = 1000 * (E / 4) * L;
    struct moe_placement learned, uniform;
    char err[256];
    CHECK_EQ(moe_placement_compute(&learned, L, E, K, bytes, cal, budget, err, sizeof err), 0);
    CHECK_EQ(moe_placement_compute(&uniform, L, E, K, bytes, NULL, budget, err, sizeof err), 0);
    uint64_t total = 0, hit_l = 0, hit_u = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t e = 0; e < E; e++) {
            total += held[l * E + e];
            hit_l += learned.hot[l * E + e] ? held[l * E + e] : 0;
            hit_u += uniform.hot[l * E + e] ? held[l * E + e] : 0;
        }
    double rl = (double)hit_l / total, ru = (double)hit_u / total;
    printf("held-out hit rate with 25%% of experts hot: learned %.3f, uniform %.3f (%zu calibration, %zu held-out tokens)\n",
           rl, ru, n_cal, n_held);
    CHECK(rl > ru + 0.05);
    moe_placement_free(&learned);
    moe_placement_free(&uniform);
    free(cal);
    free(held);
    free(raw_cal);
    free(raw_held);
}
