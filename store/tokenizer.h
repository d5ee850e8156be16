/* Byte-level BPE tokenizer (tokenizer.ggml.model = "gpt2", pre-tokenizer "qwen2") from a GGUF
 * vocabulary. Special/control tokens are split out first when parse_special is set. */
#ifndef MOE_TOKENIZER_H
#define MOE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/gguf.h"

struct moe_tokenizer;

/* Builds the tokenizer from the tokenizer.ggml.* keys of f (f may be closed afterwards).
 * Unknown model or pre-tokenizer gives MOE_EUNSUPPORTED with a message. */
int moe_tok_load(struct moe_tokenizer **out, const struct gguf_file *f, char *err, size_t errlen);
void moe_tok_free(struct moe_tokenizer *t);

/* Tokenizes text[0..len) (no BOS is added). *ids is malloc'ed (caller frees), *n its length.
 * Returns 0 or -ENOMEM. Invalid UTF-8 is tokenized byte-wise, never rejected. */
int moe_tok_encode(const struct moe_tokenizer *t, const char *text, size_t len, bool parse_special,
                   int32_t **ids, size_t *n);

/* The raw bytes a token stands for (byte-level decoding applied; special tokens give their text).
 * Returns the byte count (may exceed cap: then only cap bytes were written), or -1 for a bad id. */
int moe_tok_piece(const struct moe_tokenizer *t, int32_t id, char *buf, size_t cap);

uint32_t moe_tok_n_vocab(const struct moe_tokenizer *t);
int32_t moe_tok_eos(const struct moe_tokenizer *t);   /* -1 when none */
int32_t moe_tok_bos(const struct moe_tokenizer *t);   /* -1 when none */
bool moe_tok_is_control(const struct moe_tokenizer *t, int32_t id);
/* Token id for an exact token text ("<|im_end|>"), or -1. */
int32_t moe_tok_lookup(const struct moe_tokenizer *t, const char *text);
/* End-of-generation tokens (eos, eot, <|im_end|>, <|endoftext|> ...): true for any of them. */
bool moe_tok_is_eog(const struct moe_tokenizer *t, int32_t id);
/* tokenizer.chat_template, or NULL. */
const char *moe_tok_chat_template(const struct moe_tokenizer *t);

/* Streaming detokenizer: emits only complete UTF-8 sequences, holding back a partial one until
 * the bytes that finish it arrive (or flush, which emits what is held, replacing invalid bytes
 * with U+FFFD). */
struct moe_detok {
    char held[8];
    int n_held;
};
void moe_detok_init(struct moe_detok *d);
/* Appends the text of token id to out (capacity cap, NUL-terminated); returns bytes written. */
size_t moe_detok_push(struct moe_detok *d, const struct moe_tokenizer *t, int32_t id,
                      char *out, size_t cap);
size_t moe_detok_flush(struct moe_detok *d, char *out, size_t cap);

#endif
