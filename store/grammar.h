/* Constrained sampling: GBNF grammars (llama.cpp's format), an incremental matcher over bytes and
 * the per-step token mask. See docs/grammar.md.
 *
 *   struct moe_grammar *g = moe_grammar_parse(text, len, err, sizeof err);
 *   struct moe_grammar_vocab *v = moe_grammar_vocab_new(tokens, lens, n, eog, err, sizeof err);
 *   struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
 *   loop: moe_grammar_mask(st, v, mask); pick a token t with mask[t];
 *         moe_grammar_state_accept_bytes(st, tokens[t], lens[t]);
 *
 * The grammar matches Unicode code points; bytes are decoded as UTF-8 by the state, so a token
 * may end inside a code point and the next one complete it. A grammar is immutable after parsing
 * and may be shared by any number of states and threads; a state belongs to one thread at a time. */
#ifndef MOE_STORE_GRAMMAR_H
#define MOE_STORE_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Limits against abuse; a grammar or a state past one fails with an error that names it. */
#define MOE_GRAMMAR_MAX_TEXT (1u << 20)    /* bytes of GBNF text */
#define MOE_GRAMMAR_MAX_RULES 8192         /* rules, generated ones included */
#define MOE_GRAMMAR_MAX_ELEMENTS (1u << 20) /* rule elements after repetitions are expanded */
#define MOE_GRAMMAR_MAX_NESTING 64         /* depth of ( ) groups */
#define MOE_GRAMMAR_MAX_REPEAT 10000       /* m and n of {m,n} */
#define MOE_GRAMMAR_MAX_STACKS 4096        /* parse stacks alive at once (ambiguity) */
#define MOE_GRAMMAR_MAX_DEPTH 4096         /* depth of one parse stack (nesting of the text) */
#define MOE_GRAMMAR_MAX_NODES (1u << 23)   /* stack nodes of one state (memory) */
#define MOE_GRAMMAR_MAX_TOKEN 1024         /* bytes of one vocabulary token */
#define MOE_GRAMMAR_MAX_MASK_WORK (1u << 27) /* stack steps of one mask (time) */
#define MOE_GRAMMAR_MASK_CACHE_NODES (1u << 20) /* default of moe_grammar_state_set_mask_cache */

struct moe_grammar;
struct moe_grammar_state;
struct moe_grammar_vocab;

/* Parses GBNF text (len bytes, need not be NUL-terminated). The start rule is `root`. NULL with a
 * message "line L, column C: ..." in err on a malformed grammar, an undefined rule, no root, left
 * recursion (a rule that can reach itself without consuming input) or a limit. */
struct moe_grammar *moe_grammar_parse(const char *text, size_t len, char *err, size_t errlen);
void moe_grammar_free(struct moe_grammar *g);
/* Rules (generated ones for groups and repetitions included) and elements, for tests and logs. */
uint32_t moe_grammar_n_rules(const struct moe_grammar *g);
uint32_t moe_grammar_n_elements(const struct moe_grammar *g);

/* A matcher at the start of the grammar. NULL with err on a limit (or out of memory). */
struct moe_grammar_state *moe_grammar_state_new(const struct moe_grammar *g, char *err,
                                                size_t errlen);
struct moe_grammar_state *moe_grammar_state_clone(const struct moe_grammar_state *st);
void moe_grammar_state_free(struct moe_grammar_state *st);

/* Feeds n bytes (one token's). 1: accepted; 0: the grammar cannot continue with these bytes;
 * -1: a limit was hit (moe_grammar_state_error says which). On 0 and -1 the state is unchanged. */
int moe_grammar_state_accept_bytes(struct moe_grammar_state *st, const void *bytes, size_t n);
/* Whether the text so far is a whole sentence of the grammar (generation may end here). False in
 * the middle of a UTF-8 sequence. */
bool moe_grammar_state_is_accepting(const struct moe_grammar_state *st);
/* Whether any byte can follow (false when the grammar is complete and cannot be extended). */
bool moe_grammar_state_can_continue(const struct moe_grammar_state *st);
/* Parse stacks alive now (1 for an unambiguous grammar at most points). */
size_t moe_grammar_state_n_stacks(const struct moe_grammar_state *st);
/* The last limit hit by this state ("" when none). */
const char *moe_grammar_state_error(const struct moe_grammar_state *st);

/* A vocabulary prepared for masks: token i has lens[i] bytes at tokens[i]; eog (may be NULL)
 * marks the end-of-generation tokens, allowed exactly when the state is accepting. Other tokens
 * with no bytes are never allowed. The bytes are copied. NULL with err on a token longer than
 * MOE_GRAMMAR_MAX_TOKEN or out of memory. */
struct moe_grammar_vocab *moe_grammar_vocab_new(const char *const *tokens, const uint32_t *lens,
                                                uint32_t n, const uint8_t *eog, char *err,
                                                size_t errlen);
void moe_grammar_vocab_free(struct moe_grammar_vocab *v);
uint32_t moe_grammar_vocab_n(const struct moe_grammar_vocab *v);
/* Nodes of the vocabulary's byte trie (for logs). */
uint32_t moe_grammar_vocab_n_nodes(const struct moe_grammar_vocab *v);

/* The mask caches its grammar steps, keeping the stack nodes they make for the rest of the mask:
 * at most max_nodes of them (16 bytes each; default MOE_GRAMMAR_MASK_CACHE_NODES), after which
 * that mask goes on without the cache. 0: no cache. The mask is the same either way. */
void moe_grammar_state_set_mask_cache(struct moe_grammar_state *st, uint32_t max_nodes);

/* mask[i] = 1 for each token whose bytes the state accepts next (eog tokens: when accepting),
 * 0 for the others; mask has moe_grammar_vocab_n(v) entries. Returns the number of tokens
 * allowed, or -1 when a limit was hit (moe_grammar_state_error). The state is not advanced. */
long moe_grammar_mask(struct moe_grammar_state *st, const struct moe_grammar_vocab *v,
                      uint8_t *mask);

#endif
