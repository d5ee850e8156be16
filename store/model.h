/* Model description: architecture, hyperparameters and a view of every weight.
 *
 * A moe_model holds no weights of its own; its tensor views point into wherever the weights
 * live: a GGUF mapping (standalone worker, moectl) or the shared expert store (daemon-spawned
 * workers). Routed experts are reached through per-(layer, expert) views so that the store can
 * repack them as one blob each. */
#ifndef MOE_MODEL_H
#define MOE_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/gguf.h"

enum moe_arch { MOE_ARCH_QWEN3MOE = 1 };

/* A 2-D (or 1-D) weight: ne[0] is the row length (contiguous), ne[1] the row count. */
struct moe_tensor {
    const void *data;
    uint32_t type;          /* enum moe_type */
    int64_t ne[2];
    size_t nbytes;
};

/* One routed expert: three matrices, in ggml order. */
struct moe_expert {
    struct moe_tensor gate; /* [expert_ff][n_embd]: ne = {n_embd, expert_ff} */
    struct moe_tensor up;   /* [expert_ff][n_embd] */
    struct moe_tensor down; /* [n_embd][expert_ff]: ne = {expert_ff, n_embd} */
};

struct moe_layer {
    struct moe_tensor attn_norm;    /* [n_embd] f32 */
    struct moe_tensor attn_q;       /* [n_head*head_dim][n_embd] */
    struct moe_tensor attn_k;       /* [n_head_kv*head_dim][n_embd] */
    struct moe_tensor attn_v;       /* [n_head_kv*head_dim][n_embd] */
    struct moe_tensor attn_output;  /* [n_embd][n_head*head_dim] */
    struct moe_tensor attn_q_norm;  /* [head_dim] */
    struct moe_tensor attn_k_norm;  /* [head_dim] */
    struct moe_tensor ffn_norm;     /* [n_embd] */
    struct moe_tensor ffn_gate_inp; /* router: [n_expert][n_embd] */
    struct moe_expert *experts;     /* [n_expert] */
};

struct moe_hparams {
    uint32_t n_layer;
    uint32_t n_ctx_train;
    uint32_t n_embd;
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t head_dim;      /* attention.key_length (not n_embd/n_head) */
    uint32_t head_dim_v;    /* attention.value_length */
    uint32_t n_expert;
    uint32_t n_expert_used;
    uint32_t expert_ff;
    uint32_t n_ff;          /* feed_forward_length (dense ffn; informational for qwen3moe) */
    uint32_t n_vocab;
    float rms_eps;
    float rope_base;
    bool norm_topk;         /* renormalise the top-k router weights (qwen3moe: true) */
};

/* Where an expert's three slices live in the GGUF, relative to the file start. */
struct moe_expert_slice {
    uint64_t off[3];   /* gate, up, down */
    uint64_t size[3];
    uint32_t type[3];
};

struct moe_model {
    enum moe_arch arch;
    char arch_name[32];
    struct moe_hparams hp;
    struct moe_tensor token_embd;   /* [n_vocab][n_embd] */
    struct moe_tensor output_norm;  /* [n_embd] */
    struct moe_tensor output;       /* [n_vocab][n_embd]; equals token_embd when tied */
    struct moe_layer *layers;       /* [n_layer] */
    uint64_t fingerprint;           /* gguf_fingerprint() of the source file */
    uint64_t bytes_dense;           /* every tensor that is not a routed expert */
    uint64_t bytes_experts;         /* all routed experts */
    const struct gguf_file *gguf;   /* source, not owned; NULL when built from the store */
};

/* Describes a GGUF: checks the architecture, every hyperparameter and every tensor's shape and
 * type (types must be computable), and points all views into the file mapping. Unsupported
 * architectures give MOE_EUNSUPPORTED ("architecture 'llama' is not supported; moed serves:
 * qwen3moe"). Returns 0 or an error with a message naming the key or tensor. */
int moe_model_from_gguf(struct moe_model *m, const struct gguf_file *f, char *err, size_t errlen);

/* The sampling settings a model's publisher recommends, as llama.cpp's converter writes them
 * (general.sampling.temp, top_k, top_p, min_p, penalty_repeat, penalty_last_n; any numeric
 * type). A field is NaN (top_k, penalty_last_n: -1) when the file does not have it or has a value
 * out of range (a negative temperature, top_p outside (0, 1], ...). */
struct moe_sampling_hints {
    double temperature, top_p, min_p, repeat_penalty;
    int64_t top_k, penalty_last_n;
};
void moe_gguf_sampling_hints(const struct gguf_file *f, struct moe_sampling_hints *out);

/* File location of an expert's gate/up/down slices (valid after moe_model_from_gguf). */
int moe_model_expert_slice(const struct moe_model *m, uint32_t layer, uint32_t expert,
                           struct moe_expert_slice *out);

/* Bytes of one expert (gate+up+down) in a layer. */
uint64_t moe_model_expert_bytes(const struct moe_model *m, uint32_t layer);

/* A device slot that holds any expert of the layer: its gate, up and down at part_off[0..2]
 * (each the largest of the layer's experts, 256-byte aligned). Returns the slot's bytes. */
uint64_t moe_model_expert_slot(const struct moe_model *m, uint32_t layer, uint32_t part_off[3]);

void moe_model_free(struct moe_model *m);

#endif
