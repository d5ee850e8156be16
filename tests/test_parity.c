/* Golden parity: our forward pass against the float64 reference logits and llama.cpp's greedy
 * tokens (tests/golden/README.md), through the engine API and through bin/moed-worker. */
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/engine_test.h"

static const char *const PROMPTS[] = {"p1", "p2", "p3"};

/* Prefill of the golden prompt in one batch; checks rel-L2 and top-1 against the reference and,
 * for F16, the 32 greedy tokens by single-token decode. */
static void parity_engine(const char *model, double max_rel, double min_top1, int check_greedy)
{
    char path[256];
    golden_model_path(path, sizeof path, model);
    struct test_model tm;
    test_model_open(&tm, path);
    struct moe_engine *e = test_engine(&tm.m, 256, 1, 0, 0);
    for (size_t p = 0; p < 3; p++) {
        struct golden_ref r;
        golden_load(&r, model, PROMPTS[p]);
        CHECK_EQ(r.n_vocab, tm.m.hp.n_vocab);
        float *out = malloc(sizeof(float) * r.n_prompt * r.n_vocab);
        CHECK(out);
        moe_engine_seq_clear(e, 0);
        test_prefill(e, 0, 0, r.prompt, (uint32_t)r.n_prompt, out);
        double rel = rel_l2(out, r.logits, r.n_prompt * r.n_vocab);
        double top1 = top1_agreement(out, r.logits, r.n_prompt, r.n_vocab);
        printf("parity engine %-6s %s: n_prompt %zu rel-L2 %.3e top-1 %.1f%%", model, PROMPTS[p],
               r.n_prompt, rel, 100.0 * top1);
        int greedy_ok = 1;
        if (check_greedy) {
            /* Greedy continuation, one token per forward call (the decode path). */
            float *lg = malloc(sizeof(float) * r.n_vocab);
            CHECK(lg);
            int32_t tok = argmax_f(out + (r.n_prompt - 1) * r.n_vocab, r.n_vocab);
            size_t match = 0;
            for (size_t i = 0; i < r.n_greedy; i++) {
                if (tok == r.greedy[i])
                    match++;
                else if (greedy_ok) {
                    printf(" [first greedy mismatch at %zu: %d vs %d]", i, tok, r.greedy[i]);
                    greedy_ok = 0;
                }
                if (i + 1 == r.n_greedy)
                    break;
                test_prefill(e, 0, (int32_t)(r.n_prompt + i), &tok, 1, lg);
                tok = argmax_f(lg, r.n_vocab);
            }
            printf(" greedy %zu/%zu", match, r.n_greedy);
            free(lg);
        }
        printf("\n");
        CHECK_MSG(rel <= max_rel, "%s %s: rel-L2 %.3e > %.1e", model, PROMPTS[p], rel, max_rel);
        CHECK_MSG(top1 >= min_top1, "%s %s: top-1 %.3f < %.2f", model, PROMPTS[p], top1, min_top1);
        CHECK_MSG(greedy_ok, "%s %s: greedy tokens differ", model, PROMPTS[p]);
        free(out);
        golden_free(&r);
    }
    moe_engine_free(e);
    test_model_close(&tm);
}

TEST(parity_engine_f16)
{
    parity_engine("F16", 2e-3, 0.95, 1);
}

TEST(parity_engine_q8_0)
{
    parity_engine("Q8_0", 3e-2, 0.95, 0);
}

TEST(parity_engine_q4_k_m)
{
    parity_engine("Q4_K_M", 3e-2, 0.95, 0);
}
