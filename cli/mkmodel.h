/* moectl mkmodel internals: vocabulary extraction and random block generation.
 *
 * Shared by cli/mkmodel.c (the command and the parallel writer), cli/mkmodel_vocab.c and
 * cli/mkmodel_blocks.c. Not a public API. */
#ifndef MOE_CLI_MKMODEL_H
#define MOE_CLI_MKMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/gguf_write.h"

/* The value every token embedding holds in channel 0. The router's popularity bias is a weight
 * on this channel, so it acts like a per-expert bias while the hidden state keeps the channel
 * (attn_output and ffn_down never write to it). */
#define MK_BIAS_CHANNEL_VALUE 4.0f

/* Adds the tokenizer.* KVs of the vocabulary GGUF at `path` to w, in that file's order.
 * n_regular == 0: the whole vocabulary, unchanged. n_regular > 0: its first n_regular tokens,
 * the merges among them (both parts and the result kept), then its added (control and
 * user-defined) tokens, then "[PADn]" unused tokens up to a multiple of 64; special token ids
 * are renumbered. *n_vocab receives the resulting token count. */
int mk_vocab_add(struct gguf_writer *w, const char *path, uint32_t n_regular, uint32_t *n_vocab,
                 char *err, size_t errlen);

/* What a tensor's values look like; generation is a pure function of (key, block index). */
enum mk_kind {
    MK_KIND_NORM,   /* RMSNorm weights: 1 + 0.1 z, element 0 = 1 (F32) */
    MK_KIND_ROUTER, /* ffn_gate_inp rows: sigma z, element 0 = bias[row] (F32) */
    MK_KIND_WEIGHT, /* sigma z, in the tensor's block type */
};

struct mk_tensor {
    uint64_t idx;          /* writer index */
    uint32_t type;
    int64_t ne[3];         /* ne[0] row length, ne[1] rows per matrix, ne[2] matrices */
    enum mk_kind kind;
    float sigma;           /* standard deviation of the values */
    bool zero_row0;        /* row 0 of every matrix (output channel 0) is all zeros */
    bool pin0;             /* element 0 of every row is MK_BIAS_CHANNEL_VALUE */
    const float *bias;     /* MK_KIND_ROUTER: [ne[1]] values of element 0 */
    uint64_t key;          /* random stream of this tensor */
    uint32_t gblk;         /* elements per generation block (the type's block, or 32) */
    uint32_t gbytes;       /* bytes per generation block */
    uint64_t n_gblocks;
};

/* Builds the normal-quantile tables; call once before mk_gen_blocks (thread-safe after). */
void mk_tables_init(void);

/* Sets gblk/gbytes/n_gblocks of t from its type and shape. Returns 0, or MOE_EUNSUPPORTED
 * for a type the generator cannot produce (it handles F32, F16, Q8_0, Q5_0, Q4_K, Q6_K). */
int mk_tensor_prepare(struct mk_tensor *t);

/* Writes generation blocks [b0, b0+n) of t to out (n * t->gbytes bytes). */
void mk_gen_blocks(const struct mk_tensor *t, uint64_t b0, uint64_t n, uint8_t *out);

/* splitmix64 finalizer: a bijective 64-bit mix. */
static inline uint64_t mk_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#endif
