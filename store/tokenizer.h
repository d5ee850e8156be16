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

/* The same, but stops with MOE_ERANGE (nothing returned) as soon as the text has given more than
 * max_tokens tokens: a prompt longer than the context costs no more than the context's worth of
 * work (the pre-token being worked on when the limit passes is finished first). */
int moe_tok_encode_max(const struct moe_tokenizer *t, const char *text, size_t len,
                       bool parse_special, size_t max_tokens, int32_t **ids, size_t *n);

/* Special tokens (control and user-defined) cut out of text[0..len) exactly as moe_tok_encode
 * with parse_special cuts them: *frags (malloc'ed, caller frees) gets *n fragments that cover the
 * text in order, id the token of a special one and -1 for the text between. Returns 0 or
 * -ENOMEM. For renderers that keep a template's own markers apart from message text. */
struct moe_tok_frag {
    size_t off, len;
    int32_t id;
};
int moe_tok_split_special(const struct moe_tokenizer *t, const char *text, size_t len,
                          struct moe_tok_frag **frags, size_t *n);

/* The raw bytes a token stands for (byte-level decoding applied; special tokens give their text).
 * Returns the byte count (may exceed cap: then only cap bytes were written), or -1 for a bad id. */
int moe_tok_piece(const struct moe_tokenizer *t, int32_t id, char *buf, size_t cap);

uint32_t moe_tok_n_vocab(const struct moe_tokenizer *t);

/* The shortcut for long runs of one byte (on by default; the tokens are the same either way,
 * checked per byte against the merge loop): off, every piece takes the merge loop. For tests and
 * benchmarks that compare the two. */
void moe_tok_runs_fast(struct moe_tokenizer *t, bool on);

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

/* ---- An array-based constructor for tests and tools, and small accessors. ---- */

/* Everything moe_tok_load reads from a GGUF, as plain arrays. Strings need not be NUL-terminated
 * (struct gguf_str); the tokenizer copies what it keeps, so the spec may be freed afterwards. */
struct moe_tok_spec {
    struct gguf_str model;           /* tokenizer.ggml.model: must be "gpt2" */
    struct gguf_str pre;             /* tokenizer.ggml.pre: must be "qwen2" */
    uint64_t n_tokens;
    const struct gguf_str *tokens;   /* [n_tokens] token texts (byte-level alphabet for normal ones) */
    const int32_t *token_type;       /* [n_tokens] 1 normal, 2 unknown, 3 control, 4 user-defined,
                                        5 unused, 6 byte; NULL means all normal */
    uint64_t n_merges;
    const struct gguf_str *merges;   /* [n_merges] "left right", rank = index */
    int64_t bos_id, eos_id, pad_id, eot_id, eom_id; /* -1 when absent */
    bool add_bos;
    struct gguf_str chat_template;   /* .p NULL when absent */
};

/* Builds a tokenizer from a spec. Errors: MOE_EUNSUPPORTED (model / pre-tokenizer),
 * MOE_EFORMAT (inconsistent counts, a bad token type, a merge without a space or naming unknown
 * tokens, an id out of range, a missing byte token), -ENOMEM; a message in err. */
int moe_tok_build(struct moe_tokenizer **out, const struct moe_tok_spec *spec, char *err,
                  size_t errlen);

int32_t moe_tok_pad(const struct moe_tokenizer *t);   /* -1 when none */
bool moe_tok_add_bos(const struct moe_tokenizer *t);  /* tokenizer.ggml.add_bos_token */
/* Longest moe_tok_piece in bytes. moe_detok_push never writes more than
 * 3 * (moe_tok_max_piece + 4) + 1 bytes (invalid bytes each become a 3-byte U+FFFD), so an out
 * buffer of that size never truncates; a smaller one may drop text. */
size_t moe_tok_max_piece(const struct moe_tokenizer *t);

/* The pre-tokenizer alone (no special-token splitting): splits text[0..len) with the regex and
 * stores the end offset of each piece in *ends (malloc'ed, caller frees), *n pieces. The pieces
 * cover the text exactly. Returns 0 or -ENOMEM. For tests and debugging. */
int moe_tok_pretokenize(const struct moe_tokenizer *t, const char *text, size_t len,
                        size_t **ends, size_t *n);

#endif
