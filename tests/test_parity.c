/* Golden parity: our forward pass against the float64 reference logits and llama.cpp's greedy
 * tokens (tests/golden/README.md), through the engine API and through bin/moed-worker. */
#include <string.h>

#include "store/tokenizer.h"
#include "tests/engine_test.h"

static const char *const PROMPTS[] = {"p1", "p2", "p3"};

/* Our logits for a golden prompt against the reference. */
static void check_golden(const char *how, const char *model, const char *prompt, const float *got,
                         const struct golden_ref *r, double max_rel, double min_top1)
{
    char label[128];
    snprintf(label, sizeof label, "parity %s %-6s %s:", how, model, prompt);
    check_logits(label, got, r->logits, r->n_prompt, r->n_vocab, max_rel, min_top1);
}

/* Prefill of the golden prompt in one batch; checks rel-L2 and top-1 against the reference and,
 * for F16, the 32 greedy tokens by single-token decode. */
static void parity_engine(const char *model, double max_rel, double min_top1, int check_greedy)
{
    struct test_model tm;
    test_model_open_golden(&tm, model);
    struct moe_engine *e = test_engine(&tm.m, 256, 1, 0, 0);
    for (size_t p = 0; p < 3; p++) {
        struct golden_ref r;
        float *out = golden_prefill(e, tm.m.hp.n_vocab, &r, model, PROMPTS[p]);
        check_golden("engine", model, PROMPTS[p], out, &r, max_rel, min_top1);
        if (check_greedy) {
            /* Greedy continuation, one token per forward call (the decode path). */
            float *lg = malloc(sizeof(float) * r.n_vocab);
            CHECK(lg);
            int32_t tok = moe_test_argmax(out + (r.n_prompt - 1) * r.n_vocab, r.n_vocab);
            size_t match = 0, first_miss = r.n_greedy;
            for (size_t i = 0; i < r.n_greedy; i++) {
                if (tok == r.greedy[i])
                    match++;
                else if (first_miss == r.n_greedy) {
                    printf("  first greedy mismatch at %zu: %d vs %d\n", i, tok, r.greedy[i]);
                    first_miss = i;
                }
                if (i + 1 == r.n_greedy)
                    break;
                test_prefill(e, 0, (int32_t)(r.n_prompt + i), &tok, 1, lg);
                tok = moe_test_argmax(lg, r.n_vocab);
            }
            printf("  greedy %zu/%zu\n", match, r.n_greedy);
            free(lg);
            CHECK_MSG(match == r.n_greedy, "%s %s: greedy tokens differ", model, PROMPTS[p]);
        }
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

/* ------------------------------------------------------------------ through bin/moed-worker */

/* Prompt tokens, dumped logits and (F16) the greedy tokens, all from the real binary. */
static void parity_binary(const char *model, double max_rel, double min_top1, int check_greedy)
{
    char mpath[256], ppath[256], dump[512], out[512], errp[512];
    golden_model_path(mpath, sizeof mpath, model);
    const char *tmp = moe_test_tmpdir();
    for (size_t p = 0; p < 3; p++) {
        struct golden_ref r;
        golden_load(&r, model, PROMPTS[p]);
        snprintf(ppath, sizeof ppath, GOLDEN "/prompts/%s.txt", PROMPTS[p]);
        snprintf(dump, sizeof dump, "%s/%s.%s.f32", tmp, model, PROMPTS[p]);
        snprintf(out, sizeof out, "%s/out.json", tmp);
        snprintf(errp, sizeof errp, "%s/err.txt", tmp);
        char n_str[16];
        snprintf(n_str, sizeof n_str, "%zu", r.n_greedy);
        char *argv[] = {(char *)moe_test_bin("moed-worker"), "--model", mpath, "--prompt-file",
                        ppath, "-n", check_greedy ? n_str : "0", "--temp", "0", "--threads", "2",
                        "--json", "--dump-logits", dump, "--device",
                        getenv("MOE_TEST_DEVICE") ? getenv("MOE_TEST_DEVICE") : "cpu", NULL};
        int st = moe_test_run(argv, out, errp);
        char *errtext = moe_test_read_file_or_fail(errp, NULL);
        CHECK_MSG(st == 0, "moed-worker exited %d: %s", st, errtext);
        free(errtext);

        json_error_t je;
        json_t *j = json_load_file(out, 0, &je);
        CHECK_MSG(j, "bad JSON from moed-worker: %s", je.text);
        size_t n_pt, n_tok;
        int32_t *pt = json_ids(json_object_get(j, "prompt_tokens"), &n_pt);
        int32_t *tok = json_ids(json_object_get(j, "tokens"), &n_tok);
        CHECK(json_is_string(json_object_get(j, "text")));
        CHECK_EQ(n_pt, r.n_prompt);
        CHECK(memcmp(pt, r.prompt, n_pt * sizeof *pt) == 0);

        size_t size;
        float *got = (float *)moe_test_read_file_or_fail(dump, &size);
        CHECK_EQ(size, r.n_prompt * r.n_vocab * sizeof(float));
        check_golden("binary", model, PROMPTS[p], got, &r, max_rel, min_top1);
        if (check_greedy) {
            size_t match = 0;
            for (size_t i = 0; i < n_tok && i < r.n_greedy; i++)
                match += tok[i] == r.greedy[i];
            printf("  greedy %zu/%zu\n", match, r.n_greedy);
            CHECK_EQ(n_tok, r.n_greedy);
            CHECK_EQ(match, r.n_greedy);
        } else {
            CHECK_EQ(n_tok, 0);
        }
        free(got), free(pt), free(tok);
        json_decref(j);
        golden_free(&r);
    }
}

TEST(parity_binary_f16)
{
    parity_binary("F16", 2e-3, 0.95, 1);
}

TEST(parity_binary_q8_0)
{
    parity_binary("Q8_0", 3e-2, 0.95, 0);
}

TEST(parity_binary_q4_k_m)
{
    parity_binary("Q4_K_M", 3e-2, 0.95, 0);
}

/* The worker's tokens and stop reason from one run (--json; extra arguments after the prompt). */
static char *worker_run_tokens(const char *const *extra, char **stop)
{
    char mpath[256], out[512], errp[512];
    golden_model_path(mpath, sizeof mpath, "F16");
    snprintf(out, sizeof out, "%s/ahead.json", moe_test_tmpdir());
    snprintf(errp, sizeof errp, "%s/ahead.err", moe_test_tmpdir());
    const char *argv[24] = {moe_test_bin("moed-worker"), "--model", mpath, "--json", "--device",
                            getenv("MOE_TEST_DEVICE") ? getenv("MOE_TEST_DEVICE") : "cpu"};
    int n = 6;
    for (int i = 0; extra[i] && n < 23; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    const int st = moe_test_run((char **)argv, out, errp);
    char *err = moe_test_read_file_or_fail(errp, NULL);
    CHECK_MSG(st == 0, "moed-worker exited %d: %s", st, err);
    const char *sr = strstr(err, "stop: ");
    *stop = strdup(sr ? sr : "(none)");
    free(err);
    json_t *j = json_load_file(out, 0, NULL);
    CHECK(j);
    char *toks = json_dumps(json_object_get(j, "tokens"), JSON_COMPACT);
    json_decref(j);
    return toks;
}

/* The worker decodes ahead when the engine samples (each step queued before the token it reads
 * is back) and one step at a time when it samples on the host (--dump-logits): the same tokens
 * and the same stop, for a few tokens, at the length limit, at an end-of-generation token (p3)
 * and at a full context, greedy and seeded. */
TEST(worker_decode_ahead_equals_host_sampling)
{
    char dump[512], p1[256], p3[256];
    snprintf(dump, sizeof dump, "%s/ahead.f32", moe_test_tmpdir());
    snprintf(p1, sizeof p1, GOLDEN "/prompts/p1.txt");
    snprintf(p3, sizeof p3, GOLDEN "/prompts/p3.txt");
    const char *cases[][12] = {
        {"--prompt-file", p1, "-n", "1", NULL},
        {"--prompt-file", p1, "-n", "2", NULL},
        {"--prompt-file", p1, "-n", "3", NULL},
        {"--prompt-file", p1, "-n", "40", NULL},
        {"--prompt-file", p3, "-n", "200", NULL},
        {"--prompt-file", p1, "-n", "100", "--ctx", "60", NULL},
        {"--prompt-file", p1, "-n", "7", "--ctx", "60", NULL},
        {"--prompt-file", p1, "-n", "30", "--temp", "0.9", "--seed", "11", NULL},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *with_dump[16];
        size_t n = 0;
        for (; cases[c][n]; n++)
            with_dump[n] = cases[c][n];
        with_dump[n++] = "--dump-logits";
        with_dump[n++] = dump;
        with_dump[n] = NULL;
        char *stop_a, *stop_h;
        char *ahead = worker_run_tokens(cases[c], &stop_a);
        char *host = worker_run_tokens(with_dump, &stop_h);
        printf("  case %zu: %.60s... %s", c, ahead, stop_a);
        CHECK_STREQ(ahead, host);
        CHECK_STREQ(stop_a, stop_h);
        free(ahead), free(host), free(stop_a), free(stop_h);
    }
}

/* The command-line contract around the happy path: errors, -n 0, streaming, routing stats,
 * sampling reproducibility. */
TEST(worker_cli_contract)
{
    char mpath[256], out[512], errp[512], prompt[512];
    golden_model_path(mpath, sizeof mpath, "Q8_0");
    const char *tmp = moe_test_tmpdir();
    snprintf(out, sizeof out, "%s/out", tmp);
    snprintf(errp, sizeof errp, "%s/err", tmp);
    snprintf(prompt, sizeof prompt, GOLDEN "/prompts/p1.txt");
    char *bin = (char *)moe_test_bin("moed-worker");
    char *text;

    char *a_unknown[] = {bin, "--model", mpath, "--prompt-file", prompt, "--bogus", NULL};
    CHECK_EQ(moe_test_run(a_unknown, out, errp), 2);
    text = moe_test_read_file_or_fail(errp, NULL);
    CHECK(strstr(text, "--bogus"));
    free(text);

    char *a_badnum[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "12x", NULL};
    CHECK_EQ(moe_test_run(a_badnum, out, errp), 2);
    char *a_noval[] = {bin, "--model", mpath, "--prompt-file", NULL};
    CHECK_EQ(moe_test_run(a_noval, out, errp), 2);
    char *a_nomodel[] = {bin, "--prompt-file", prompt, NULL};
    CHECK_EQ(moe_test_run(a_nomodel, out, errp), 2);

    char *a_missing[] = {bin, "--model", "/nonexistent/m.gguf", "--prompt-file", prompt, NULL};
    CHECK_EQ(moe_test_run(a_missing, out, errp), 1);
    text = moe_test_read_file_or_fail(errp, NULL);
    CHECK(strstr(text, "/nonexistent/m.gguf"));
    free(text);
    char *a_noprompt[] = {bin, "--model", mpath, "--prompt-file", "/nonexistent/p.txt", NULL};
    CHECK_EQ(moe_test_run(a_noprompt, out, errp), 1);
    /* A file that is not a GGUF is an error, not a crash. */
    char *a_notgguf[] = {bin, "--model", prompt, "--prompt-file", prompt, NULL};
    CHECK_EQ(moe_test_run(a_notgguf, out, errp), 1);

    /* A device that is not there (or a build without CUDA) is an error naming the device. */
    char *a_cuda[] = {bin, "--model", mpath, "--prompt-file", prompt, "--device", "cuda:99", NULL};
    CHECK_EQ(moe_test_run(a_cuda, out, errp), 1);
    text = moe_test_read_file_or_fail(errp, NULL);
    CHECK_MSG(strstr(text, "cuda:99"), "%s", text);
    free(text);

    /* -n 0 with routing stats: no tokens, per-layer counts on stderr summing to n_prompt*k. */
    char *a_n0[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "0", "--json",
                    "--routing-stats", NULL};
    CHECK_EQ(moe_test_run(a_n0, out, errp), 0);
    json_t *j = json_load_file(out, 0, NULL);
    CHECK(j);
    CHECK_EQ(json_array_size(json_object_get(j, "tokens")), 0);
    size_t n_prompt = json_array_size(json_object_get(j, "prompt_tokens"));
    CHECK(n_prompt > 0);
    CHECK_STREQ(json_string_value(json_object_get(j, "text")), "");
    json_decref(j);
    text = moe_test_read_file_or_fail(errp, NULL);
    char *line = strstr(text, "layer   0:");
    CHECK_MSG(line, "no routing stats in: %s", text);
    unsigned long long sum = 0;
    char *p = line + strlen("layer   0:");
    for (int x = 0; x < 16; x++)
        sum += strtoull(p, &p, 10);
    CHECK_EQ(sum, n_prompt * 4);
    CHECK(strstr(text, "top 4/16 experts"));
    free(text);

    /* Streaming text (no --json) equals the JSON "text" of the same greedy run. */
    char *a_stream[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "12", NULL};
    CHECK_EQ(moe_test_run(a_stream, out, errp), 0);
    char *streamed = moe_test_read_file_or_fail(out, NULL);
    char *a_json[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "12", "--json", NULL};
    CHECK_EQ(moe_test_run(a_json, out, errp), 0);
    j = json_load_file(out, 0, NULL);
    CHECK(j);
    const char *jt = json_string_value(json_object_get(j, "text"));
    CHECK(jt);
    size_t sl = strlen(streamed);
    CHECK(sl > 0 && streamed[sl - 1] == '\n');
    CHECK_EQ(sl - 1, strlen(jt));
    CHECK(memcmp(streamed, jt, sl - 1) == 0);
    CHECK_EQ(json_array_size(json_object_get(j, "tokens")), 12);
    json_decref(j);
    free(streamed);

    /* A full context stops generation cleanly: positions 0..ctx-1 are evaluated, and the last
     * one still yields a sampled token. */
    char *a_ctx[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "100", "--ctx",
                     "60", "--json", NULL};
    CHECK_EQ(moe_test_run(a_ctx, out, errp), 0);
    j = json_load_file(out, 0, NULL);
    CHECK(j);
    CHECK_EQ(json_array_size(json_object_get(j, "tokens")),
             60 - json_array_size(json_object_get(j, "prompt_tokens")) + 1);
    json_decref(j);
    char *a_small[] = {bin, "--model", mpath, "--prompt-file", prompt, "--ctx", "10", NULL};
    CHECK_EQ(moe_test_run(a_small, out, errp), 1); /* the prompt does not fit */

    /* End of generation: greedy F16 on p3 ends with an EOG token, which is in "tokens" but
     * whose text is not in "text". */
    char f16[256], p3[256];
    golden_model_path(f16, sizeof f16, "F16");
    snprintf(p3, sizeof p3, GOLDEN "/prompts/p3.txt");
    char *a_eog[] = {bin, "--model", f16, "--prompt-file", p3, "-n", "200", "--json", NULL};
    CHECK_EQ(moe_test_run(a_eog, out, errp), 0);
    j = json_load_file(out, 0, NULL);
    CHECK(j);
    json_t *tk = json_object_get(j, "tokens");
    size_t nt = json_array_size(tk);
    CHECK_MSG(nt > 0 && nt < 200, "expected an EOG stop, got %zu tokens", nt);
    struct gguf_file *gf;
    struct moe_tokenizer *tz;
    char emsg[256];
    CHECK_EQ(gguf_open(&gf, f16, emsg, sizeof emsg), 0);
    CHECK_EQ(moe_tok_load(&tz, gf, emsg, sizeof emsg), 0);
    int32_t last = (int32_t)json_integer_value(json_array_get(tk, nt - 1));
    CHECK(moe_tok_is_eog(tz, last));
    for (size_t i = 0; i + 1 < nt; i++)
        CHECK(!moe_tok_is_eog(tz, (int32_t)json_integer_value(json_array_get(tk, i))));
    char piece[64];
    int pl = moe_tok_piece(tz, last, piece, sizeof piece - 1);
    CHECK(pl > 0 && pl < (int)sizeof piece);
    piece[pl] = 0;
    CHECK(strstr(json_string_value(json_object_get(j, "text")), piece) == NULL);
    text = moe_test_read_file_or_fail(errp, NULL);
    CHECK(strstr(text, "stop: eog"));
    free(text);
    moe_tok_free(tz);
    gguf_close(gf);
    json_decref(j);

    /* Sampling: the same seed gives the same tokens; another seed, other tokens. */
    char *toks[3];
    const char *seeds[3] = {"7", "7", "8"};
    for (int k = 0; k < 3; k++) {
        char *a_s[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "24", "--temp", "1.0",
                       "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed",
                       (char *)seeds[k], "--json", NULL};
        CHECK_EQ(moe_test_run(a_s, out, errp), 0);
        j = json_load_file(out, 0, NULL);
        CHECK(j);
        toks[k] = json_dumps(json_object_get(j, "tokens"), JSON_COMPACT);
        json_decref(j);
    }
    CHECK_STREQ(toks[0], toks[1]);
    CHECK(strcmp(toks[0], toks[2]) != 0);
    for (int k = 0; k < 3; k++)
        free(toks[k]);
}
