/* Golden parity: our forward pass against the float64 reference logits and llama.cpp's greedy
 * tokens (tests/golden/README.md), through the engine API and through bin/moed-worker. */
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "store/tokenizer.h"
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

/* ------------------------------------------------------------------ through bin/moed-worker */

/* Runs argv with stdout to out_path and stderr to err_path; returns the exit status (or
 * 128 + signal). */
static int run_prog(char *const argv[], const char *out_path, const char *err_path)
{
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        if (!freopen(out_path, "w", stdout) || !freopen(err_path, "w", stderr))
            _exit(126);
        execv(argv[0], argv);
        _exit(127);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static char *slurp(const char *path)
{
    size_t n;
    return test_read_file(path, &n);
}

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
                        "--json", "--dump-logits", dump, NULL};
        int st = run_prog(argv, out, errp);
        char *errtext = slurp(errp);
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
        float *got = test_read_file(dump, &size);
        CHECK_EQ(size, r.n_prompt * r.n_vocab * sizeof(float));
        double rel = rel_l2(got, r.logits, r.n_prompt * r.n_vocab);
        double top1 = top1_agreement(got, r.logits, r.n_prompt, r.n_vocab);
        printf("parity binary %-6s %s: n_prompt %zu rel-L2 %.3e top-1 %.1f%%", model, PROMPTS[p],
               r.n_prompt, rel, 100.0 * top1);
        if (check_greedy) {
            size_t match = 0;
            for (size_t i = 0; i < n_tok && i < r.n_greedy; i++)
                match += tok[i] == r.greedy[i];
            printf(" greedy %zu/%zu", match, r.n_greedy);
            CHECK_EQ(n_tok, r.n_greedy);
            CHECK_EQ(match, r.n_greedy);
        } else {
            CHECK_EQ(n_tok, 0);
        }
        printf("\n");
        CHECK_MSG(rel <= max_rel, "rel-L2 %.3e > %.1e", rel, max_rel);
        CHECK_MSG(top1 >= min_top1, "top-1 %.3f", top1);
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
    CHECK_EQ(run_prog(a_unknown, out, errp), 2);
    text = slurp(errp);
    CHECK(strstr(text, "--bogus"));
    free(text);

    char *a_badnum[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "12x", NULL};
    CHECK_EQ(run_prog(a_badnum, out, errp), 2);
    char *a_noval[] = {bin, "--model", mpath, "--prompt-file", NULL};
    CHECK_EQ(run_prog(a_noval, out, errp), 2);
    char *a_nomodel[] = {bin, "--prompt-file", prompt, NULL};
    CHECK_EQ(run_prog(a_nomodel, out, errp), 2);

    char *a_missing[] = {bin, "--model", "/nonexistent/m.gguf", "--prompt-file", prompt, NULL};
    CHECK_EQ(run_prog(a_missing, out, errp), 1);
    text = slurp(errp);
    CHECK(strstr(text, "/nonexistent/m.gguf"));
    free(text);
    char *a_noprompt[] = {bin, "--model", mpath, "--prompt-file", "/nonexistent/p.txt", NULL};
    CHECK_EQ(run_prog(a_noprompt, out, errp), 1);
    /* A file that is not a GGUF is an error, not a crash. */
    char *a_notgguf[] = {bin, "--model", prompt, "--prompt-file", prompt, NULL};
    CHECK_EQ(run_prog(a_notgguf, out, errp), 1);

    char *a_cuda[] = {bin, "--model", mpath, "--prompt-file", prompt, "--device", "cuda:0", NULL};
    CHECK_EQ(run_prog(a_cuda, out, errp), 1);
    text = slurp(errp);
    CHECK(strstr(text, "CUDA backend not built/available"));
    free(text);

    /* -n 0 with routing stats: no tokens, per-layer counts on stderr summing to n_prompt*k. */
    char *a_n0[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "0", "--json",
                    "--routing-stats", NULL};
    CHECK_EQ(run_prog(a_n0, out, errp), 0);
    json_t *j = json_load_file(out, 0, NULL);
    CHECK(j);
    CHECK_EQ(json_array_size(json_object_get(j, "tokens")), 0);
    size_t n_prompt = json_array_size(json_object_get(j, "prompt_tokens"));
    CHECK(n_prompt > 0);
    CHECK_STREQ(json_string_value(json_object_get(j, "text")), "");
    json_decref(j);
    text = slurp(errp);
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
    CHECK_EQ(run_prog(a_stream, out, errp), 0);
    char *streamed = slurp(out);
    char *a_json[] = {bin, "--model", mpath, "--prompt-file", prompt, "-n", "12", "--json", NULL};
    CHECK_EQ(run_prog(a_json, out, errp), 0);
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
    CHECK_EQ(run_prog(a_ctx, out, errp), 0);
    j = json_load_file(out, 0, NULL);
    CHECK(j);
    CHECK_EQ(json_array_size(json_object_get(j, "tokens")),
             60 - json_array_size(json_object_get(j, "prompt_tokens")) + 1);
    json_decref(j);
    char *a_small[] = {bin, "--model", mpath, "--prompt-file", prompt, "--ctx", "10", NULL};
    CHECK_EQ(run_prog(a_small, out, errp), 1); /* the prompt does not fit */

    /* End of generation: greedy F16 on p3 ends with an EOG token, which is in "tokens" but
     * whose text is not in "text". */
    char f16[256], p3[256];
    golden_model_path(f16, sizeof f16, "F16");
    snprintf(p3, sizeof p3, GOLDEN "/prompts/p3.txt");
    char *a_eog[] = {bin, "--model", f16, "--prompt-file", p3, "-n", "200", "--json", NULL};
    CHECK_EQ(run_prog(a_eog, out, errp), 0);
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
    text = slurp(errp);
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
        CHECK_EQ(run_prog(a_s, out, errp), 0);
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
