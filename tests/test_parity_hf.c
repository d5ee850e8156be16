/* Parity against Hugging Face transformers on model shapes the golden files do not have:
 * head_dim 128 with n_head*head_dim != n_embd, 32 experts top-8 and an 832-token prompt; a
 * Q5_K/Q6_K-only file with GQA ratio 4; no GQA with odd sizes, rope base 10000 and F32
 * weights. References are transformers' Qwen3MoeForCausalLM in float64 on the exact stored
 * weights (tools/ref-fixtures/, docs/parity.md); each fixture is checked through a batched
 * prefill of the whole prompt, a token-by-token decode, and a prefill the engine splits into
 * chunks. */
#include <string.h>

#include "store/ggml_type.h"
#include "tests/engine_test.h"

#define HF_DIR "tests/fixtures/hf"

struct hf_fixture {
    char name[64];
    int32_t *prompt;
    size_t n_prompt;
    int32_t *pos;        /* positions whose logits are stored, ascending */
    size_t n_pos;
    uint32_t n_vocab;
    float *logits;       /* [n_pos][n_vocab] */
    json_t *fx;          /* the generator's fixture parameters */
};

static void hf_load(struct hf_fixture *h, const char *name)
{
    char path[256];
    snprintf(h->name, sizeof h->name, "%s", name);
    snprintf(path, sizeof path, HF_DIR "/%s.json", name);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    CHECK_MSG(j, "%s: %s", path, je.text);
    h->prompt = json_ids(json_object_get(j, "prompt_tokens"), &h->n_prompt);
    h->pos = json_ids(json_object_get(j, "positions"), &h->n_pos);
    h->n_vocab = (uint32_t)json_integer_value(json_object_get(j, "n_vocab"));
    h->fx = json_incref(json_object_get(j, "fixture"));
    CHECK(json_is_object(h->fx));
    CHECK_EQ(h->n_prompt, json_integer_value(json_object_get(j, "n_prompt")));
    for (size_t i = 0; i < h->n_pos; i++)
        CHECK(h->pos[i] >= 0 && (size_t)h->pos[i] < h->n_prompt &&
              (i == 0 || h->pos[i] > h->pos[i - 1]));
    for (size_t i = 0; i < h->n_prompt; i++)
        CHECK(h->prompt[i] >= 0 && (uint32_t)h->prompt[i] < h->n_vocab);
    json_decref(j);
    snprintf(path, sizeof path, HF_DIR "/%s.logits.f32", name);
    size_t size;
    h->logits = (float *)moe_test_read_file_or_fail(path, &size);
    CHECK_EQ(size, h->n_pos * h->n_vocab * sizeof(float));
}

static void hf_free(struct hf_fixture *h)
{
    free(h->prompt);
    free(h->pos);
    free(h->logits);
    json_decref(h->fx);
}

static uint32_t fx_u32(const struct hf_fixture *h, const char *key)
{
    json_t *v = json_object_get(h->fx, key);
    CHECK_MSG(json_is_integer(v), "fixture key %s", key);
    return (uint32_t)json_integer_value(v);
}

/* The loader must have read the shape the generator wrote, or a pass below would prove
 * nothing about that shape. */
static void hf_check_hparams(const struct hf_fixture *h, const struct moe_model *m)
{
    const struct moe_hparams *hp = &m->hp;
    CHECK_EQ(hp->n_layer, fx_u32(h, "n_layer"));
    CHECK_EQ(hp->n_embd, fx_u32(h, "n_embd"));
    CHECK_EQ(hp->n_head, fx_u32(h, "n_head"));
    CHECK_EQ(hp->n_head_kv, fx_u32(h, "n_head_kv"));
    CHECK_EQ(hp->head_dim, fx_u32(h, "head_dim"));
    CHECK_EQ(hp->n_expert, fx_u32(h, "n_expert"));
    CHECK_EQ(hp->n_expert_used, fx_u32(h, "n_expert_used"));
    CHECK_EQ(hp->expert_ff, fx_u32(h, "expert_ff"));
    CHECK_EQ(hp->n_vocab, h->n_vocab);
    CHECK(hp->norm_topk);
    CHECK_NEAR(hp->rope_base, json_real_value(json_object_get(h->fx, "rope_base")), 1e-3);
    bool tied = json_is_true(json_object_get(h->fx, "tied"));
    CHECK_EQ(m->output.data == m->token_embd.data, tied);
}

static void hf_report(const struct hf_fixture *h, const char *pass, const float *out,
                      double max_rel, double min_top1)
{
    char label[128];
    snprintf(label, sizeof label, "parity hf %-15s %-7s n_prompt %4zu", h->name, pass,
             h->n_prompt);
    check_logits(label, out, h->logits, h->n_pos, h->n_vocab, max_rel, min_top1);
}

/* Fixture `name`'s reference against the model in `path`, three ways: a prefill of the whole
 * prompt in one forward call (logits requested only at the stored positions) in sequence 0;
 * the same prompt one token per call in sequence 1 while sequence 0 keeps its cache; and a
 * prefill the engine has to split into chunks. */
static void parity_hf_file(const char *name, const char *path, double max_rel, double min_top1)
{
    struct hf_fixture h;
    hf_load(&h, name);
    struct test_model tm;
    test_model_open(&tm, path);
    hf_check_hparams(&h, &tm.m);
    uint32_t n = (uint32_t)h.n_prompt;
    struct moe_engine *e = test_engine(&tm.m, n + 16, 2, n, 0);
    size_t row = h.n_vocab;
    float *out = malloc(sizeof(float) * h.n_pos * row);
    float *lg = malloc(sizeof(float) * row);
    int32_t *pos = malloc(sizeof *pos * n), *seq = malloc(sizeof *seq * n);
    uint8_t *want = calloc(n, 1);
    CHECK(out && lg && pos && seq && want);

    for (uint32_t i = 0; i < n; i++) {
        pos[i] = (int32_t)i;
        seq[i] = 0;
    }
    for (size_t k = 0; k < h.n_pos; k++)
        want[h.pos[k]] = 1;
    struct moe_batch b = {.n = n, .token = h.prompt, .pos = pos, .seq = seq, .logits = want};
    int rc = moe_engine_forward(e, &b, out);
    CHECK_MSG(rc == 0, "%s prefill: %s", name, moe_engine_errmsg(e));
    CHECK_EQ(moe_engine_seq_len(e, 0), n);
    hf_report(&h, "prefill", out, max_rel, min_top1);

    memset(out, 0, sizeof(float) * h.n_pos * row);
    size_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        int32_t p = (int32_t)i, s = 1;
        struct moe_batch d = {.n = 1, .token = &h.prompt[i], .pos = &p, .seq = &s,
                              .logits = NULL};
        rc = moe_engine_forward(e, &d, lg);
        CHECK_MSG(rc == 0, "%s decode at %u: %s", name, i, moe_engine_errmsg(e));
        if (k < h.n_pos && h.pos[k] == p)
            memcpy(out + row * k++, lg, sizeof(float) * row);
    }
    CHECK_EQ(k, h.n_pos);
    CHECK_EQ(moe_engine_seq_len(e, 1), n);
    hf_report(&h, "decode", out, max_rel, min_top1);
    moe_engine_free(e);

    /* The same prompt in one call to an engine whose n_batch is a third of it: the engine runs
     * it in chunks, each attending to the cache the previous ones wrote (a daemon's
     * default n_batch of 512 does this to the 832-token prompt). */
    e = test_engine(&tm.m, n + 16, 1, (n + 2) / 3, 0);
    memset(out, 0, sizeof(float) * h.n_pos * row);
    rc = moe_engine_forward(e, &b, out);
    CHECK_MSG(rc == 0, "%s chunked prefill: %s", name, moe_engine_errmsg(e));
    hf_report(&h, "chunked", out, max_rel, min_top1);

    free(want);
    free(seq);
    free(pos);
    free(lg);
    free(out);
    moe_engine_free(e);
    test_model_close(&tm);
    hf_free(&h);
}

static void parity_hf(const char *name, double max_rel, double min_top1)
{
    char path[256];
    snprintf(path, sizeof path, HF_DIR "/%s.gguf", name);
    parity_hf_file(name, path, max_rel, min_top1);
}

/* head_dim 128, 4 heads (512) over n_embd 128, 2 KV heads, 32 experts top-8, 832 tokens, F16,
 * untied head. */
TEST_TIMEOUT(parity_hf_hd128_e32_long, 300)
{
    parity_hf("hd128-e32-long", 2e-3, 0.0);
}

/* Only Q5_K and Q6_K blocks (moectl quantize q5_k_m), GQA ratio 4, tied Q6_K embedding. */
TEST(parity_hf_q5k_q6k_gqa4)
{
    parity_hf("q5k-q6k-gqa4", 3e-2, 0.95);
}

/* n_head_kv = n_head, rope base 10000, eps 1e-5, n_embd 72, head_dim 24, expert_ff 40,
 * 6 experts top-3, 3 layers, F32, tied head. */
TEST(parity_hf_nogqa_odd_f32)
{
    parity_hf("nogqa-odd-f32", 2e-3, 0.0);
}

static void quantize_fixture(const char *name, const char *type, char *out, size_t n)
{
    snprintf(out, n, "%s/%s-%s.gguf", moe_test_tmpdir(), name, type);
    char in[256];
    snprintf(in, sizeof in, HF_DIR "/%s.gguf", name);
    char *argv[] = {(char *)moe_test_bin("moectl"), "quantize", in, out, (char *)type, NULL};
    int st = moe_test_run(argv, NULL, NULL);
    CHECK_MSG(st == 0, "moectl quantize %s %s failed", name, type);
}

static uint32_t tensor_type(const struct gguf_file *f, const char *name)
{
    const struct gguf_tensor *t = gguf_find_tensor(f, name);
    CHECK_MSG(t, "%s missing", name);
    return t->type;
}

/* moectl quantize on rows that are not multiples of 256 (n_embd 128) or even of 32
 * (expert_ff 16). q8_0 must stay within the quantized tolerance of the F16 model's reference,
 * as the golden Q8_0 does. q4_k_m must take llama.cpp's fallbacks (Q4_K -> Q5_0,
 * Q6_K -> Q8_0, F16 when no block fits) and still run; its distance from the F16 reference is
 * quantization error, not engine error (about 8e-2 for 4-5 bit weights here), so it only gets
 * a sanity bound: the quantized-file criterion proper needs a reference on the dequantized
 * weights, which the q5k-q6k-gqa4 fixture has. */
TEST_TIMEOUT(parity_hf_quantized_by_moectl, 300)
{
    char out[512], err[256];
    quantize_fixture("hd128-e32-long", "q8_0", out, sizeof out);
    parity_hf_file("hd128-e32-long", out, 3e-2, 0.95);

    quantize_fixture("hd128-e32-long", "q4_k_m", out, sizeof out);
    struct gguf_file *f;
    CHECK_MSG(gguf_open(&f, out, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(tensor_type(f, "output.weight"), MOE_TYPE_Q8_0);        /* Q6_K, 128 wide */
    CHECK_EQ(tensor_type(f, "token_embd.weight"), MOE_TYPE_Q5_0);    /* Q4_K, 128 wide */
    CHECK_EQ(tensor_type(f, "blk.0.attn_q.weight"), MOE_TYPE_Q5_0);
    CHECK_EQ(tensor_type(f, "blk.0.attn_output.weight"), MOE_TYPE_Q4_K); /* 512 wide */
    CHECK_EQ(tensor_type(f, "blk.1.attn_v.weight"), MOE_TYPE_Q8_0);  /* Q6_K layer */
    CHECK_EQ(tensor_type(f, "blk.0.ffn_down_exps.weight"), MOE_TYPE_F16); /* 16 wide */
    CHECK_EQ(tensor_type(f, "blk.0.ffn_gate_inp.weight"), MOE_TYPE_F32);
    gguf_close(f);
    parity_hf_file("hd128-e32-long", out, 0.15, 0.80);
}

/* The committed fixtures must stay within the repository budget (6 MB). */
TEST(parity_hf_fixture_budget)
{
    static const char *const names[] = {"hd128-e32-long", "q5k-q6k-gqa4", "nogqa-odd-f32"};
    static const char *const sfx[] = {".gguf", ".json", ".logits.f32"};
    size_t total = 0;
    for (size_t i = 0; i < 3; i++)
        for (size_t j = 0; j < 3; j++) {
            char path[256];
            snprintf(path, sizeof path, HF_DIR "/%s%s", names[i], sfx[j]);
            size_t size;
            free(moe_test_read_file_or_fail(path, &size));
            total += size;
        }
    printf("hf fixtures: %zu bytes\n", total);
    CHECK(total <= 6000000);
}
