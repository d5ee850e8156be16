/* Model description: the golden files' hyperparameters and views, and rejections of files built
 * with tests/gguf_bytes.h (missing/misshapen tensors, bad hyperparameters, other architectures). */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "store/gguf.h"
#include "store/expert_store.h"
#include "store/model.h"
#include "tests/gguf_bytes.h"
#include "tests/harness.h"

static void check_golden(const char *path, uint32_t want_down_type_l0)
{
    char err[512];
    struct gguf_file *f;
    struct moe_model m;
    int rc = gguf_open(&f, path, err, sizeof err);
    CHECK_MSG(rc == 0, "%s: %s", path, err);
    rc = moe_model_from_gguf(&m, f, err, sizeof err);
    CHECK_MSG(rc == 0, "%s: %s", path, err);
    /* tests/golden/models/tiny-qwen3moe.config.json */
    CHECK_EQ(m.arch, MOE_ARCH_QWEN3MOE);
    CHECK_STREQ(m.arch_name, "qwen3moe");
    CHECK_EQ(m.hp.n_layer, 3);
    CHECK_EQ(m.hp.n_embd, 256);
    CHECK_EQ(m.hp.n_head, 4);
    CHECK_EQ(m.hp.n_head_kv, 2);
    CHECK_EQ(m.hp.head_dim, 64);
    CHECK_EQ(m.hp.head_dim_v, 64);
    CHECK_EQ(m.hp.n_expert, 16);
    CHECK_EQ(m.hp.n_expert_used, 4);
    CHECK_EQ(m.hp.expert_ff, 128);
    CHECK_EQ(m.hp.n_vocab, 4160);
    CHECK_EQ(m.hp.n_ctx_train, 4096);
    CHECK_EQ(m.hp.n_ff, 512);
    CHECK_NEAR(m.hp.rope_base, 1e6, 0);
    CHECK_NEAR(m.hp.rms_eps, 1e-6, 1e-12);
    CHECK(m.hp.norm_topk);
    CHECK(m.gguf == f);
    CHECK(m.fingerprint == gguf_fingerprint(f));

    /* Views point at the tensors' data. */
    const struct gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    CHECK(m.token_embd.data == t->data && m.token_embd.ne[0] == 256 && m.token_embd.ne[1] == 4160);
    t = gguf_find_tensor(f, "output.weight");
    CHECK(t && m.output.data == t->data);
    t = gguf_find_tensor(f, "blk.1.attn_k.weight");
    CHECK(m.layers[1].attn_k.data == t->data && m.layers[1].attn_k.ne[1] == 128);
    CHECK_EQ(m.layers[2].attn_q_norm.ne[0], 64);
    CHECK_EQ(m.layers[2].attn_q_norm.type, MOE_TYPE_F32);
    CHECK_EQ(m.layers[0].ffn_gate_inp.ne[1], 16);

    /* Expert views and slices: expert e sits at e * (bytes / n_expert) inside the 3-D tensor. */
    uint64_t sum_experts = 0, sum_all = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        sum_all += f->tensors[i].nbytes;
        if (strstr(f->tensors[i].name, "_exps."))
            sum_experts += f->tensors[i].nbytes;
    }
    CHECK_EQ(m.bytes_experts, sum_experts);
    CHECK_EQ(m.bytes_dense, sum_all - sum_experts);
    const struct gguf_tensor *down = gguf_find_tensor(f, "blk.0.ffn_down_exps.weight");
    const struct gguf_tensor *gate = gguf_find_tensor(f, "blk.0.ffn_gate_exps.weight");
    CHECK_EQ(down->type, want_down_type_l0);
    uint64_t per_layer0 = 0;
    for (uint32_t l = 0; l < 3; l++) {
        uint64_t eb = moe_model_expert_bytes(&m, l);
        for (uint32_t e = 0; e < 16; e++) {
            struct moe_expert_slice s;
            CHECK_EQ(moe_model_expert_slice(&m, l, e, &s), 0);
            CHECK_EQ(s.size[0] + s.size[1] + s.size[2], eb);
            const struct moe_expert *x = &m.layers[l].experts[e];
            CHECK(f->base + s.off[2] == x->down.data);
            CHECK_EQ(x->down.ne[0], 128);
            CHECK_EQ(x->down.ne[1], 256);
            CHECK_EQ(x->gate.ne[0], 256);
            CHECK_EQ(x->gate.ne[1], 128);
        }
        if (l == 0)
            per_layer0 = eb;
        /* The device slot: each part 256-aligned and large enough, in gate, up, down order. */
        uint32_t po[3];
        const uint64_t slot = moe_model_expert_slot(&m, l, po);
        const struct moe_expert *x = &m.layers[l].experts[0];
        CHECK_EQ(po[0], 0u);
        CHECK(po[1] % 256 == 0 && po[1] >= x->gate.nbytes);
        CHECK(po[2] % 256 == 0 && po[2] - po[1] >= x->up.nbytes);
        CHECK(slot % 256 == 0 && slot - po[2] >= x->down.nbytes);
        CHECK(slot >= eb && slot < eb + 3 * 256);
    }
    CHECK_EQ(moe_model_expert_slot(&m, 99, NULL), 0u);
    struct moe_expert_slice s;
    CHECK_EQ(moe_model_expert_slice(&m, 0, 5, &s), 0);
    CHECK_EQ(s.off[2], f->data_offset + down->offset + 5 * (down->nbytes / 16));
    CHECK_EQ(s.off[0], f->data_offset + gate->offset + 5 * (gate->nbytes / 16));
    CHECK_EQ(s.size[2], moe_row_bytes(down->type, 128) * 256);
    CHECK_EQ(s.type[2], want_down_type_l0);
    CHECK_EQ(per_layer0, (down->nbytes + gate->nbytes +
                          gguf_find_tensor(f, "blk.0.ffn_up_exps.weight")->nbytes) / 16);
    CHECK_EQ(moe_model_expert_slice(&m, 3, 0, &s), MOE_ERANGE);
    CHECK_EQ(moe_model_expert_slice(&m, 0, 16, &s), MOE_ERANGE);
    CHECK_EQ(moe_model_expert_bytes(&m, 3), 0);
    moe_model_free(&m);
    CHECK(m.layers == NULL);
    gguf_close(f);
}

TEST(model_golden_f16) { check_golden("tests/golden/models/tiny-qwen3moe-F16.gguf", MOE_TYPE_F16); }
TEST(model_golden_q8_0) { check_golden("tests/golden/models/tiny-qwen3moe-Q8_0.gguf", MOE_TYPE_Q8_0); }
TEST(model_golden_q4_k_m)
{
    check_golden("tests/golden/models/tiny-qwen3moe-Q4_K_M.gguf", MOE_TYPE_Q5_0);
}

/* Builds a file from opts, opens it and describes it; returns the model error code. */
static int try_model(struct gb_model_opts o, char *err, size_t errlen)
{
    struct gb b = {0};
    gb_model(&b, o);
    struct gguf_file *f;
    int rc = gguf_open_mem(&f, b.p, b.n, err, errlen);
    CHECK_MSG(rc == 0, "crafted file does not open: %s", err);
    struct moe_model m;
    rc = moe_model_from_gguf(&m, f, err, errlen);
    if (rc == 0) {
        /* A model that loads must also give consistent views. */
        CHECK_EQ(m.hp.n_vocab, o.n_vocab ? o.n_vocab : 40);
        CHECK(m.bytes_experts > 0 && m.bytes_dense > 0);
        moe_model_free(&m);
    } else {
        CHECK(m.layers == NULL);
    }
    gguf_close(f);
    gb_free(&b);
    return rc;
}

#define EXPECT_FAIL(code, needle, ...)                                                      \
    do {                                                                                    \
        char err_[512] = "";                                                                \
        int rc_ = try_model((struct gb_model_opts){__VA_ARGS__}, err_, sizeof err_);         \
        CHECK_MSG(rc_ == (code), "rc %d (%s), expected %d", rc_, err_, (int)(code));        \
        CHECK_MSG(strstr(err_, needle) != NULL, "message \"%s\" lacks \"%s\"", err_, needle); \
    } while (0)

TEST(model_crafted_valid_shapes)
{
    char err[512];
    /* Defaults, v2, tied output, f16 and q8_0 weights, head_dim * n_head != n_embd. */
    CHECK_MSG(try_model((struct gb_model_opts){0}, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(try_model((struct gb_model_opts){.version = 2}, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(try_model((struct gb_model_opts){.tied = 1}, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(try_model((struct gb_model_opts){.wtype = MOE_TYPE_F16}, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(try_model((struct gb_model_opts){.wtype = MOE_TYPE_Q8_0, .n_embd = 64, .head_dim = 32,
                                               .expert_ff = 32}, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(try_model((struct gb_model_opts){.n_embd = 32, .n_head = 4, .head_dim = 16,
                                               .n_head_kv = 2}, err, sizeof err) == 0, "%s", err);
}

TEST(model_tied_output)
{
    struct gb b = {0};
    gb_model(&b, (struct gb_model_opts){.tied = 1});
    char err[256];
    struct gguf_file *f;
    CHECK_EQ(gguf_open_mem(&f, b.p, b.n, err, sizeof err), 0);
    struct moe_model m;
    CHECK_MSG(moe_model_from_gguf(&m, f, err, sizeof err) == 0, "%s", err);
    CHECK(m.output.data == m.token_embd.data);
    CHECK_EQ(m.output.ne[1], 40);
    moe_model_free(&m);
    gguf_close(f);
    gb_free(&b);
}

TEST(model_rejects_wrong_arch)
{
    EXPECT_FAIL(MOE_EUNSUPPORTED, "architecture 'llama' is not supported (moed serves: qwen3moe)",
                .arch = "llama");
    EXPECT_FAIL(MOE_EUNSUPPORTED, "architecture 'qwen2moe'", .arch = "qwen2moe");
}

TEST(model_rejects_missing_tensor)
{
    EXPECT_FAIL(MOE_ENOTFOUND, "blk.1.ffn_up_exps.weight", .skip_tensor = "blk.1.ffn_up_exps.weight");
    EXPECT_FAIL(MOE_ENOTFOUND, "blk.0.attn_k_norm.weight", .skip_tensor = "blk.0.attn_k_norm.weight");
    EXPECT_FAIL(MOE_ENOTFOUND, "token_embd.weight", .skip_tensor = "token_embd.weight");
    EXPECT_FAIL(MOE_ENOTFOUND, "output_norm.weight", .skip_tensor = "output_norm.weight");
}

TEST(model_rejects_wrong_shape)
{
    EXPECT_FAIL(MOE_EFORMAT, "tensor 'blk.0.attn_q.weight' has shape {32, 8, 1, 1}",
                .odd_tensor = "blk.0.attn_q.weight", .odd_ne = {32, 8});
    /* Expert count in the 3-D tensor differs from expert_count. */
    EXPECT_FAIL(MOE_EFORMAT, "blk.1.ffn_down_exps.weight",
                .odd_tensor = "blk.1.ffn_down_exps.weight", .odd_ne = {16, 32, 3});
    /* A 2-D tensor where a 3-D one belongs. */
    EXPECT_FAIL(MOE_EFORMAT, "blk.0.ffn_gate_exps.weight",
                .odd_tensor = "blk.0.ffn_gate_exps.weight", .odd_n_dims = 2, .odd_ne = {32, 64, 1});
    /* output with a different vocabulary than token_embd. */
    EXPECT_FAIL(MOE_EFORMAT, "output.weight", .odd_tensor = "output.weight", .odd_ne = {32, 41});
}

TEST(model_rejects_uncomputable_type)
{
    /* iq4_nl exists in ggml but moed has no kernel for it; norms must be f32. */
    EXPECT_FAIL(MOE_EUNSUPPORTED, "blk.0.attn_v.weight' has type iq4_nl",
                .odd_tensor = "blk.0.attn_v.weight", .odd_type = MOE_TYPE_IQ4_NL);
    EXPECT_FAIL(MOE_EUNSUPPORTED, "blk.1.ffn_norm.weight' has type f16; it must be f32",
                .odd_tensor = "blk.1.ffn_norm.weight", .odd_type = MOE_TYPE_F16);
}

TEST(model_rejects_bad_hparams)
{
    EXPECT_FAIL(MOE_ENOTFOUND, "qwen3moe.block_count", .skip_key = "qwen3moe.block_count");
    EXPECT_FAIL(MOE_ENOTFOUND, "qwen3moe.attention.layer_norm_rms_epsilon",
                .skip_key = "qwen3moe.attention.layer_norm_rms_epsilon");
    EXPECT_FAIL(MOE_ERANGE, "qwen3moe.expert_used_count", .odd_key = "qwen3moe.expert_used_count",
                .odd_val = 5);
    EXPECT_FAIL(MOE_ERANGE, "qwen3moe.expert_used_count", .odd_key = "qwen3moe.expert_used_count",
                .odd_val = 0);
    EXPECT_FAIL(MOE_ERANGE, "not a multiple of", .n_head = 3, .n_head_kv = 2);
    EXPECT_FAIL(MOE_ERANGE, "must be even", .head_dim = 7);
    EXPECT_FAIL(MOE_ERANGE, "qwen3moe.block_count", .odd_key = "qwen3moe.block_count", .odd_val = 0);
    EXPECT_FAIL(MOE_ERANGE, "qwen3moe.embedding_length", .odd_key = "qwen3moe.embedding_length",
                .odd_val = 1u << 30);
    /* More layers claimed than the file has. */
    EXPECT_FAIL(MOE_ENOTFOUND, "blk.2.attn_norm.weight", .odd_key = "qwen3moe.block_count", .odd_val = 3);
    /* Value length differs from key length. */
    EXPECT_FAIL(MOE_EUNSUPPORTED, "value_length", .odd_key = "qwen3moe.attention.value_length",
                .odd_val = 16);
}

TEST(model_rejects_missing_arch)
{
    struct gb b = {0};
    gb_header(&b, 3, 0, 1);
    gb_kv_u32(&b, "general.alignment", 32);
    char err[256];
    struct gguf_file *f;
    CHECK_EQ(gguf_open_mem(&f, b.p, b.n, err, sizeof err), 0);
    struct moe_model m;
    CHECK_EQ(moe_model_from_gguf(&m, f, err, sizeof err), MOE_EFORMAT);
    CHECK(strstr(err, "general.architecture"));
    gguf_close(f);
    gb_free(&b);
}

/* Runs `moectl --json inspect ARGS`, returns its exit status and (on 0) the parsed JSON. */
static int run_inspect(const char *args, json_t **out)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s --json inspect %s 2>/dev/null", moe_test_bin("moectl"), args);
    int st;
    char *text = moe_test_run_shell(cmd, &st);
    json_error_t je;
    json_t *j = json_loads(text, JSON_DISABLE_EOF_CHECK, &je);
    free(text);
    CHECK(st >= 0 && st < 128);
    if (out)
        *out = j;
    else
        json_decref(j);
    return st;
}

static json_int_t jint(json_t *o, const char *path1, const char *path2)
{
    json_t *v = json_object_get(o, path1);
    if (path2)
        v = json_object_get(v, path2);
    CHECK_MSG(json_is_integer(v), "%s.%s is not an integer", path1, path2 ? path2 : "");
    return json_integer_value(v);
}

TEST(moectl_inspect_json)
{
    const char *path = "tests/golden/models/tiny-qwen3moe-Q4_K_M.gguf";
    char err[256];
    struct gguf_file *f;
    struct moe_model m;
    CHECK_EQ(gguf_open(&f, path, err, sizeof err), 0);
    CHECK_EQ(moe_model_from_gguf(&m, f, err, sizeof err), 0);

    json_t *j = NULL;
    CHECK_EQ(run_inspect(path, &j), 0);
    CHECK(j);
    CHECK_STREQ(json_string_value(json_object_get(j, "architecture")), "qwen3moe");
    CHECK_EQ(jint(j, "hparams", "n_layer"), 3);
    CHECK_EQ(jint(j, "hparams", "head_dim"), 64);
    CHECK_EQ(jint(j, "hparams", "n_expert"), 16);
    CHECK_EQ(jint(j, "hparams", "n_vocab"), 4160);
    CHECK_EQ(jint(j, "n_tensors", NULL), 39);
    CHECK_EQ(jint(json_object_get(j, "tensor_types"), "q6_K", "count"), 2);
    CHECK_EQ(jint(json_object_get(j, "tensor_types"), "q5_0", "count"), 2);
    CHECK_EQ(jint(json_object_get(j, "tensor_types"), "f32", "count"), 16);
    CHECK_EQ(jint(j, "bytes_experts", NULL), m.bytes_experts);
    CHECK_EQ(jint(j, "bytes_dense", NULL), m.bytes_dense);
    json_t *layers = json_object_get(j, "layers");
    CHECK_EQ(json_array_size(layers), 3);
    CHECK_EQ(jint(json_array_get(layers, 2), "expert_bytes", NULL), moe_model_expert_bytes(&m, 2));
    CHECK_STREQ(json_string_value(json_object_get(json_array_get(layers, 2), "down")), "q8_0");
    CHECK_STREQ(json_string_value(json_object_get(json_array_get(layers, 0), "gate")), "q4_K");
    char fp[32];
    snprintf(fp, sizeof fp, "%016" PRIx64, m.fingerprint);
    CHECK_STREQ(json_string_value(json_object_get(j, "fingerprint")), fp);
    CHECK(json_object_get(j, "vram") == NULL);
    json_decref(j);

    /* A budget that leaves room for exactly 5 slots per layer, plus a little. */
    uint64_t kv = 3ull * 2 * 2 * 64 * 1024 * 2; /* n_layer * K,V * n_head_kv * head_dim * ctx * f16 */
    uint64_t slot = 0;
    for (uint32_t l = 0; l < 3; l++)
        slot += moe_model_expert_bytes(&m, l);
    uint64_t budget = m.bytes_dense + kv + (512ull << 20) + 5 * slot + slot / 2;
    char args[512];
    snprintf(args, sizeof args, "%s --ctx 1024 --vram-budget %" PRIu64, path, budget);
    CHECK_EQ(run_inspect(args, &j), 0);
    json_t *v = json_object_get(j, "vram");
    CHECK(v);
    CHECK_EQ(jint(v, "budget", NULL), budget);
    CHECK_EQ(jint(v, "kv_cache", NULL), kv);
    CHECK_EQ(jint(v, "reserve", NULL), 512 << 20);
    CHECK_EQ(jint(v, "experts_available", NULL), 5 * slot + slot / 2);
    CHECK_EQ(jint(v, "slots_per_layer", NULL), 5);
    CHECK_NEAR(json_real_value(json_object_get(v, "residency")), 5.0 / 16, 1e-9);
    json_decref(j);

    /* Room for 10.5 slots per layer: the prompt staging buffers (as the CUDA worker sizes them)
     * take some of it, and slots + buffers fit in what is left. */
    budget = m.bytes_dense + kv + (512ull << 20) + 10 * slot + slot / 2;
    snprintf(args, sizeof args, "%s --ctx 1024 --vram-budget %" PRIu64, path, budget);
    CHECK_EQ(run_inspect(args, &j), 0);
    v = json_object_get(j, "vram");
    CHECK(jint(v, "stage_experts", NULL) >= 1);
    CHECK(jint(v, "slots_per_layer", NULL) < 10);
    CHECK(jint(v, "slots_per_layer", NULL) * jint(v, "slot_bytes_all_layers", NULL) +
              jint(v, "stage_bytes", NULL) <=
          jint(v, "experts_available", NULL));
    json_decref(j);

    /* 24G holds everything; 100M does not even hold the reserve. Suffix forms. */
    snprintf(args, sizeof args, "%s --vram-budget 24GiB", path);
    CHECK_EQ(run_inspect(args, &j), 0);
    v = json_object_get(j, "vram");
    CHECK_EQ(jint(v, "budget", NULL), 24ull << 30);
    CHECK_EQ(jint(v, "kv_cache", NULL), 4 * kv); /* default ctx 4096 */
    CHECK_EQ(jint(v, "slots_per_layer", NULL), 16);
    json_decref(j);
    snprintf(args, sizeof args, "%s --vram-budget 100M", path);
    CHECK_EQ(run_inspect(args, &j), 0);
    v = json_object_get(j, "vram");
    CHECK_EQ(jint(v, "slots_per_layer", NULL), 0);
    CHECK(jint(v, "experts_available", NULL) < 0);
    json_decref(j);

    /* --ram-budget: the tiered store's pool (48 experts; 12 slots is the minimum). */
    snprintf(args, sizeof args, "%s --ram-budget 50%%", path);
    CHECK_EQ(run_inspect(args, &j), 0);
    json_t *r = json_object_get(j, "ram");
    CHECK(r && !json_is_true(json_object_get(r, "all_experts_fit")));
    CHECK_EQ(jint(r, "experts", NULL), 48);
    CHECK_EQ(jint(r, "min_slots", NULL), 12);
    CHECK_EQ(jint(r, "slot_bytes", NULL), moe_store_slot_bytes(&m));
    CHECK_EQ(jint(r, "slots", NULL), (uint64_t)(0.5 * (double)m.bytes_experts) / moe_store_slot_bytes(&m));
    json_decref(j);
    snprintf(args, sizeof args, "%s --ram-budget 1G", path);
    CHECK_EQ(run_inspect(args, &j), 0);
    CHECK(json_is_true(json_object_get(json_object_get(j, "ram"), "all_experts_fit")));
    json_decref(j);
    snprintf(args, sizeof args, "%s --ram-budget 10%%", path); /* 4 slots */
    CHECK_EQ(run_inspect(args, NULL), 2);

    /* Errors: missing file and a non-model GGUF exit 1; bad arguments exit 2. */
    CHECK_EQ(run_inspect("/nonexistent.gguf", NULL), 1);
    CHECK_EQ(run_inspect("tests/golden/tokenizer/qwen3-vocab.gguf", NULL), 1);
    snprintf(args, sizeof args, "%s --vram-budget 12X", path);
    CHECK_EQ(run_inspect(args, NULL), 2);
    snprintf(args, sizeof args, "%s --ctx 0", path);
    CHECK_EQ(run_inspect(args, NULL), 2);
    CHECK_EQ(run_inspect("", NULL), 2);
    moe_model_free(&m);
    gguf_close(f);
}
