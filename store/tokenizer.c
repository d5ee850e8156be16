/* Byte-level BPE tokenizer (GPT-2 style, Qwen2 pre-tokenizer) built from a GGUF vocabulary.
 *
 * Encoding runs in three stages, each matching llama.cpp (and, for ordinary text, Hugging Face
 * tokenizers), because the golden prompt tokens and the model's training both came from them:
 *   1. special tokens are cut out of the text first (see split_specials for the exact order);
 *   2. each remaining fragment is split into pieces by the Qwen2 regex (PCRE2, Unicode mode);
 *   3. each piece is mapped byte by byte onto the GPT-2 byte alphabet and merged by BPE rank.
 * Decoding maps the alphabet back to bytes; the streaming decoder holds back incomplete UTF-8.
 *
 * Tokens and merges are handled as ids: a merge (left id, right id) -> (rank, result id) lives in
 * one open-addressing table, token texts in another, both hashed with XXH3. docs/tokenizer.md
 * describes the decisions in more detail. */
#include "store/tokenizer.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "store/err.h"

/* tokenizer.ggml.token_type values (llama.cpp's llama_token_type). */
enum {
    TT_NORMAL = 1,
    TT_UNKNOWN = 2,
    TT_CONTROL = 3,
    TT_USER = 4,
    TT_UNUSED = 5,
    TT_BYTE = 6,
};

enum { REACH_UNKNOWN = 0, REACH_YES = 1, REACH_NO = 2 };
enum { RUN_UNKNOWN = 0, RUN_OK = 1, RUN_NO = 2 };

/* Per-token flags derived at load time. */
enum {
    TF_CONTROL = 1, /* split out only when parse_special; is_control() */
    TF_USER = 2,    /* always split out */
    TF_EOG = 4,     /* ends generation */
};

/* The Qwen2 pre-tokenizer regex, verbatim from Qwen's tokenizer.json (FORMATS.md). PCRE2 with
 * PCRE2_UCP gives \s, \p{L} and \p{N} their Unicode meanings, and its (?i) folds case the way
 * Oniguruma does in Hugging Face tokenizers. */
static const char QWEN2_REGEX[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct tok_slot {
    uint64_t hash;
    int32_t id; /* -1: empty */
};

struct merge_slot {
    uint64_t key; /* left << 32 | right; UINT64_MAX: empty */
    uint32_t rank;
    int32_t result; /* -1: a merge that never applies (its result does not decode to its parts) */
};

struct moe_tokenizer {
    uint32_t n;             /* vocabulary size */
    char *text;             /* token texts back to back */
    uint64_t *text_off;     /* [n + 1] */
    uint8_t *type;          /* [n] token type as stored */
    uint8_t *flags;         /* [n] TF_* */
    char *piece;            /* decoded bytes of every token back to back */
    uint64_t *piece_off;    /* [n + 1] */
    size_t max_piece;

    struct tok_slot *tmap;  /* token text -> id */
    uint64_t tmask;
    struct merge_slot *mmap; /* (left, right) -> rank, result */
    uint64_t mmask;

    int32_t byte_tok[256];  /* token of each byte's one-character alphabet string */
    /* [n] REACH_*: whether BPE over the token's own bytes gives the token back. A cache filled
     * during encoding (relaxed atomics: racing writers store the same value). */
    _Atomic uint8_t *reach;
    /* Long runs of one byte (RUN_*, per byte value, filled on first use like reach): BPE of
     * b^n for n >= run_base starts with run_tok[b] (run_len[b] bytes) and continues as BPE of
     * b^(n - run_len[b]), checked against the merge loop when first needed. */
    _Atomic uint8_t run_state[256];
    int32_t run_tok[256];
    uint32_t run_len[256];
    bool runs_slow;         /* moe_tok_runs_fast(t, false): long runs take the merge loop too */
    int32_t *specials;      /* ids split out before the regex, longest text first */
    uint32_t n_specials;

    int32_t bos, eos, pad;
    bool add_bos;
    char *chat_template;
    pcre2_code *re;
};

/* ---- GPT-2 byte alphabet --------------------------------------------------------------------
 * Printable Latin-1 bytes stand for themselves; the 68 others (0-32, 127-160, 173) are shifted to
 * U+0100..U+0143 in byte order, so that every byte becomes a visible character. */

static bool byte_is_printable(unsigned b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

static uint32_t byte_to_cp(unsigned b)
{
    if (byte_is_printable(b))
        return b;
    if (b <= 32)
        return 256 + b;
    if (b <= 160)
        return 256 + 33 + (b - 127);
    return 256 + 67; /* 173, the soft hyphen */
}

/* Inverse of byte_to_cp, or -1 for a code point outside the alphabet. */
static int cp_to_byte(uint32_t cp)
{
    if (cp < 256)
        return byte_is_printable(cp) ? (int)cp : -1;
    if (cp < 256 + 33)
        return (int)(cp - 256);
    if (cp < 256 + 67)
        return (int)(cp - 256 - 33 + 127);
    if (cp == 256 + 67)
        return 173;
    return -1;
}

/* Encodes a code point below U+0800 (all the alphabet needs); returns the byte count. */
static int cp_to_utf8_small(uint32_t cp, uint8_t out[2])
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    out[0] = (uint8_t)(0xC0 | (cp >> 6));
    out[1] = (uint8_t)(0x80 | (cp & 0x3F));
    return 2;
}

/* Decodes one UTF-8 sequence at s[0..n); returns its length and sets *cp, or returns 0 when the
 * bytes there are not a valid sequence. */
static size_t utf8_decode(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t b = s[0];
    if (b < 0x80) {
        *cp = b;
        return 1;
    }
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF;
    uint32_t c;
    if (b >= 0xC2 && b <= 0xDF) {
        need = 1;
        c = b & 0x1F;
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 2;
        c = b & 0x0F;
        if (b == 0xE0)
            lo = 0xA0;
        else if (b == 0xED)
            hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3;
        c = b & 0x07;
        if (b == 0xF0)
            lo = 0x90;
        else if (b == 0xF4)
            hi = 0x8F;
    } else {
        return 0;
    }
    if (n < need + 1)
        return 0;
    for (size_t k = 1; k <= need; k++) {
        uint8_t x = s[k];
        if (x < lo || x > hi)
            return 0;
        lo = 0x80;
        hi = 0xBF;
        c = (c << 6) | (x & 0x3F);
    }
    *cp = c;
    return need + 1;
}

/* ---- hash tables ---------------------------------------------------------------------------- */

static uint64_t table_cap(uint64_t n)
{
    uint64_t cap = 16;
    while (cap < 2 * n)
        cap <<= 1;
    return cap;
}

static const char *tok_text(const struct moe_tokenizer *t, int32_t id, size_t *len)
{
    *len = (size_t)(t->text_off[id + 1] - t->text_off[id]);
    return t->text + t->text_off[id];
}

static int32_t tmap_find(const struct moe_tokenizer *t, const void *s, size_t len)
{
    uint64_t h = XXH3_64bits(s, len);
    for (uint64_t i = h & t->tmask;; i = (i + 1) & t->tmask) {
        const struct tok_slot *sl = &t->tmap[i];
        if (sl->id < 0)
            return -1;
        if (sl->hash == h) {
            size_t l;
            const char *p = tok_text(t, sl->id, &l);
            if (l == len && memcmp(p, s, len) == 0)
                return sl->id;
        }
    }
}

/* Inserts id unless its text is already present (the first token with a text wins). */
static void tmap_insert(struct moe_tokenizer *t, int32_t id)
{
    size_t len;
    const char *s = tok_text(t, id, &len);
    uint64_t h = XXH3_64bits(s, len);
    for (uint64_t i = h & t->tmask;; i = (i + 1) & t->tmask) {
        struct tok_slot *sl = &t->tmap[i];
        if (sl->id < 0) {
            sl->hash = h;
            sl->id = id;
            return;
        }
        if (sl->hash == h) {
            size_t l;
            const char *p = tok_text(t, sl->id, &l);
            if (l == len && memcmp(p, s, len) == 0)
                return;
        }
    }
}

static uint64_t pair_key(int32_t a, int32_t b)
{
    return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}

static const struct merge_slot *mmap_find(const struct moe_tokenizer *t, uint64_t key)
{
    uint64_t h = XXH3_64bits(&key, sizeof key);
    for (uint64_t i = h & t->mmask;; i = (i + 1) & t->mmask) {
        const struct merge_slot *sl = &t->mmap[i];
        if (sl->key == key)
            return sl;
        if (sl->key == UINT64_MAX)
            return NULL;
    }
}

/* Inserts a merge unless the pair is already there (the lower rank, seen first, wins). */
static void mmap_insert(struct moe_tokenizer *t, uint64_t key, uint32_t rank, int32_t result)
{
    uint64_t h = XXH3_64bits(&key, sizeof key);
    for (uint64_t i = h & t->mmask;; i = (i + 1) & t->mmask) {
        struct merge_slot *sl = &t->mmap[i];
        if (sl->key == key)
            return;
        if (sl->key == UINT64_MAX) {
            *sl = (struct merge_slot){key, rank, result};
            return;
        }
    }
}

/* ---- loading -------------------------------------------------------------------------------- */

static bool str_is(struct gguf_str s, const char *lit)
{
    size_t n = strlen(lit);
    return s.p && s.len == n && memcmp(s.p, lit, n) == 0;
}

/* Texts that llama.cpp treats as control tokens (end-of-turn and fill-in-the-middle markers)
 * even when a converter stored them as user-defined: Qwen's <|fim_prefix|> and friends are type
 * 4 in the GGUF but are not split out of plain text unless special tokens are parsed. */
static const char *const CONTROL_TEXTS[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<|eom_id|>", "<end_of_utterance>",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
};

/* Texts that end generation (llama.cpp's end-of-generation list, FIM pad/repo/sep included). */
static const char *const EOG_TEXTS[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
};

static bool text_in(const char *s, size_t len, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strlen(list[i]) == len && memcmp(list[i], s, len) == 0)
            return true;
    return false;
}

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const struct moe_tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint64_t lx = t->text_off[x + 1] - t->text_off[x], ly = t->text_off[y + 1] - t->text_off[y];
    if (lx != ly)
        return lx > ly ? -1 : 1;
    return x < y ? -1 : (x > y);
}

/* Decodes token id's text into its raw bytes at out (which has room for the text's length).
 * Characters outside the byte alphabet (not produced by byte-level BPE) are kept as they are. */
static size_t decode_byte_level(const char *s, size_t len, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t k = utf8_decode((const uint8_t *)s + i, len - i, &cp);
        if (k == 0) {
            out[o++] = s[i++];
            continue;
        }
        int b = cp_to_byte(cp);
        if (b >= 0) {
            out[o++] = (char)b;
        } else {
            memcpy(out + o, s + i, k);
            o += k;
        }
        i += k;
    }
    return o;
}

static int check_id(int64_t id, uint32_t n, const char *what, char *err, size_t errlen)
{
    if (id < -1 || id >= (int64_t)n)
        return moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.%s = %" PRId64
                        " is out of range (vocabulary of %u tokens)", what, id, n);
    return 0;
}

int moe_tok_build(struct moe_tokenizer **out, const struct moe_tok_spec *spec, char *err,
                  size_t errlen)
{
    int rc;
    struct moe_tokenizer *t = NULL;
    char *scratch = NULL;

    if (!str_is(spec->model, "gpt2")) {
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "tokenizer.ggml.model '%.*s' is not supported (supported: gpt2)",
                        spec->model.p ? (int)(spec->model.len > 64 ? 64 : spec->model.len) : 6,
                        spec->model.p ? spec->model.p : "(none)");
    }
    if (!str_is(spec->pre, "qwen2")) {
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "pre-tokenizer (tokenizer.ggml.pre) '%.*s' is not supported "
                        "(supported: qwen2)",
                        spec->pre.p ? (int)(spec->pre.len > 64 ? 64 : spec->pre.len) : 6,
                        spec->pre.p ? spec->pre.p : "(none)");
    }
    if (spec->n_tokens < 256 || spec->n_tokens > INT32_MAX - 1)
        return moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.tokens has %" PRIu64
                        " entries; a byte-level vocabulary needs 256 to 2^31-2", spec->n_tokens);
    if (spec->n_merges > UINT32_MAX - 1)
        return moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.merges has %" PRIu64
                        " entries, too many", spec->n_merges);
    uint32_t n = (uint32_t)spec->n_tokens;
    if ((rc = check_id(spec->bos_id, n, "bos_token_id", err, errlen)) ||
        (rc = check_id(spec->eos_id, n, "eos_token_id", err, errlen)) ||
        (rc = check_id(spec->pad_id, n, "padding_token_id", err, errlen)) ||
        (rc = check_id(spec->eot_id, n, "eot_token_id", err, errlen)) ||
        (rc = check_id(spec->eom_id, n, "eom_token_id", err, errlen)))
        return rc;

    t = calloc(1, sizeof *t);
    if (!t)
        return -ENOMEM;
    t->n = n;
    t->bos = (int32_t)spec->bos_id;
    t->eos = (int32_t)spec->eos_id;
    t->pad = (int32_t)spec->pad_id;
    t->add_bos = spec->add_bos;

    /* Token texts, types and flags. */
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (spec->tokens[i].len > (1u << 20)) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "token %u is %" PRIu64 " bytes long "
                          "(the limit is 1 MiB)", i, spec->tokens[i].len);
            goto fail;
        }
        if (spec->tokens[i].len && !spec->tokens[i].p) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "token %u has no text", i);
            goto fail;
        }
        total += spec->tokens[i].len;
    }
    t->text = malloc(total ? total : 1);
    t->text_off = malloc((size_t)(n + 1) * sizeof *t->text_off);
    t->type = malloc(n);
    t->flags = calloc(n, 1);
    t->reach = calloc(n, sizeof *t->reach);
    t->piece = malloc(total ? total : 1); /* decoding never grows a text */
    t->piece_off = malloc((size_t)(n + 1) * sizeof *t->piece_off);
    if (!t->text || !t->text_off || !t->type || !t->flags || !t->reach || !t->piece ||
        !t->piece_off) {
        rc = -ENOMEM;
        goto fail;
    }
    uint64_t off = 0;
    for (uint32_t i = 0; i < n; i++) {
        t->text_off[i] = off;
        if (spec->tokens[i].len)
            memcpy(t->text + off, spec->tokens[i].p, spec->tokens[i].len);
        off += spec->tokens[i].len;
        int32_t ty = spec->token_type ? spec->token_type[i] : TT_NORMAL;
        if (ty < TT_NORMAL || ty > TT_BYTE) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.token_type[%u] = %d is not a "
                          "token type (1 normal .. 6 byte)", i, ty);
            goto fail;
        }
        t->type[i] = (uint8_t)ty;
    }
    t->text_off[n] = off;

    t->tmask = table_cap(n) - 1;
    t->tmap = malloc((t->tmask + 1) * sizeof *t->tmap);
    if (!t->tmap) {
        rc = -ENOMEM;
        goto fail;
    }
    for (uint64_t i = 0; i <= t->tmask; i++)
        t->tmap[i].id = -1;
    for (uint32_t i = 0; i < n; i++)
        tmap_insert(t, (int32_t)i);

    /* Every byte must have its one-character token: BPE starts from them. */
    for (unsigned b = 0; b < 256; b++) {
        uint8_t u[2];
        int k = cp_to_utf8_small(byte_to_cp(b), u);
        t->byte_tok[b] = tmap_find(t, u, (size_t)k);
        if (t->byte_tok[b] < 0) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "the vocabulary has no token for byte 0x%02x "
                          "(U+%04X); not a byte-level BPE vocabulary", b, byte_to_cp(b));
            goto fail;
        }
    }

    /* Merges: rank = index. Both sides and their concatenation must be tokens, so that the merge
     * loop can work on ids alone. */
    uint64_t max_merge = 0;
    for (uint64_t r = 0; r < spec->n_merges; r++)
        if (spec->merges[r].len > max_merge)
            max_merge = spec->merges[r].len;
    if (max_merge > (2u << 20)) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "a merge is %" PRIu64 " bytes long", max_merge);
        goto fail;
    }
    scratch = malloc(max_merge + 1);
    t->mmask = table_cap(spec->n_merges) - 1;
    t->mmap = malloc((t->mmask + 1) * sizeof *t->mmap);
    if (!scratch || !t->mmap) {
        rc = -ENOMEM;
        goto fail;
    }
    for (uint64_t i = 0; i <= t->mmask; i++)
        t->mmap[i].key = UINT64_MAX;
    for (uint64_t r = 0; r < spec->n_merges; r++) {
        const char *m = spec->merges[r].p;
        size_t len = (size_t)spec->merges[r].len;
        const char *sp = len > 1 && m ? memchr(m + 1, ' ', len - 1) : NULL;
        if (!sp) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.merges[%" PRIu64 "] '%.*s' "
                          "is not two tokens separated by a space", r,
                          (int)(len > 64 ? 64 : len), m ? m : "");
            goto fail;
        }
        size_t ll = (size_t)(sp - m), rl = len - ll - 1;
        int32_t a = tmap_find(t, m, ll), b = tmap_find(t, sp + 1, rl);
        memcpy(scratch, m, ll);
        memcpy(scratch + ll, sp + 1, rl);
        int32_t c = tmap_find(t, scratch, ll + rl);
        if (a < 0 || b < 0 || c < 0) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.merges[%" PRIu64 "] '%.*s' "
                          "names %s that is not in the vocabulary", r,
                          (int)(len > 64 ? 64 : len), m,
                          a < 0 ? "a left part" : b < 0 ? "a right part" : "a result");
            goto fail;
        }
        mmap_insert(t, pair_key(a, b), (uint32_t)r, c);
    }

    /* Flags: control-like tokens, always-split user-defined tokens, end-of-generation. */
    uint32_t n_special = 0;
    for (uint32_t i = 0; i < n; i++) {
        size_t len;
        const char *s = tok_text(t, (int32_t)i, &len);
        uint8_t ty = t->type[i];
        if (ty == TT_USER &&
            text_in(s, len, CONTROL_TEXTS, sizeof CONTROL_TEXTS / sizeof *CONTROL_TEXTS))
            ty = TT_CONTROL;
        if (ty == TT_CONTROL || ty == TT_UNKNOWN)
            t->flags[i] |= TF_CONTROL;
        else if (ty == TT_USER)
            t->flags[i] |= TF_USER;
        if (ty != TT_NORMAL && ty != TT_BYTE &&
            text_in(s, len, EOG_TEXTS, sizeof EOG_TEXTS / sizeof *EOG_TEXTS))
            t->flags[i] |= TF_EOG;
        if ((t->flags[i] & (TF_CONTROL | TF_USER)) && len > 0)
            n_special++;
    }
    if (spec->eos_id >= 0)
        t->flags[spec->eos_id] |= TF_EOG;
    if (spec->eot_id >= 0)
        t->flags[spec->eot_id] |= TF_EOG;
    if (spec->eom_id >= 0)
        t->flags[spec->eom_id] |= TF_EOG;

    t->specials = malloc((n_special ? n_special : 1) * sizeof *t->specials);
    if (!t->specials) {
        rc = -ENOMEM;
        goto fail;
    }
    for (uint32_t i = 0; i < n; i++)
        if ((t->flags[i] & (TF_CONTROL | TF_USER)) && t->text_off[i + 1] > t->text_off[i])
            t->specials[t->n_specials++] = (int32_t)i;
    qsort_r(t->specials, t->n_specials, sizeof *t->specials, cmp_special, t);

    /* Decoded bytes of every token, computed once so that moe_tok_piece is a copy. */
    off = 0;
    for (uint32_t i = 0; i < n; i++) {
        size_t len;
        const char *s = tok_text(t, (int32_t)i, &len);
        t->piece_off[i] = off;
        size_t k;
        switch (t->type[i]) {
        case TT_NORMAL:
        case TT_BYTE:
            k = decode_byte_level(s, len, t->piece + off);
            break;
        case TT_UNUSED:
            k = 0;
            break;
        default:
            memcpy(t->piece + off, s, len);
            k = len;
            break;
        }
        off += k;
        if (k > t->max_piece)
            t->max_piece = k;
    }
    t->piece_off[n] = off;

    /* Encoding must give back its text: every byte's token decodes to that byte, and a merge
     * whose result decodes to something else than its two parts (a result of another type than
     * normal or byte: unused tokens decode to nothing, user-defined and control ones to their
     * raw text) never applies, so the encoder never emits a token whose piece differs from the
     * bytes it covers. */
    for (unsigned b = 0; b < 256; b++) {
        const int32_t id = t->byte_tok[b];
        if (t->piece_off[id + 1] - t->piece_off[id] != 1 ||
            (uint8_t)t->piece[t->piece_off[id]] != b) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "the vocabulary's token %d for byte 0x%02x "
                          "does not decode to that byte (token type %u)", (int)id, b,
                          (unsigned)t->type[id]);
            goto fail;
        }
    }
    for (uint64_t i = 0; i <= t->mmask; i++) {
        struct merge_slot *sl = &t->mmap[i];
        if (sl->key == UINT64_MAX)
            continue;
        const int32_t a = (int32_t)(sl->key >> 32), b = (int32_t)(uint32_t)sl->key,
                      c = sl->result;
        const uint64_t la = t->piece_off[a + 1] - t->piece_off[a],
                       lb = t->piece_off[b + 1] - t->piece_off[b],
                       lc = t->piece_off[c + 1] - t->piece_off[c];
        if (lc != la + lb || memcmp(t->piece + t->piece_off[c], t->piece + t->piece_off[a], la) ||
            memcmp(t->piece + t->piece_off[c] + la, t->piece + t->piece_off[b], lb))
            sl->result = -1;
    }

    if (spec->chat_template.p) {
        t->chat_template = malloc(spec->chat_template.len + 1);
        if (!t->chat_template) {
            rc = -ENOMEM;
            goto fail;
        }
        memcpy(t->chat_template, spec->chat_template.p, spec->chat_template.len);
        t->chat_template[spec->chat_template.len] = '\0';
    }

    int errcode;
    PCRE2_SIZE erroff;
    t->re = pcre2_compile((PCRE2_SPTR)QWEN2_REGEX, PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &errcode, &erroff, NULL);
    if (!t->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(errcode, msg, sizeof msg);
        rc = moe_fail(err, errlen, MOE_EINTERNAL, "pre-tokenizer regex: %s at %zu", (char *)msg,
                      (size_t)erroff);
        goto fail;
    }
    /* JIT is an optimisation only: without it pcre2_match interprets the same pattern. */
    (void)pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE);

    free(scratch);
    *out = t;
    return 0;

fail:
    free(scratch);
    moe_tok_free(t);
    return rc;
}

/* Maps a gguf getter's failure to what this module reports: a missing optional key is not an
 * error (returns 1), anything else is malformed tokenizer data. */
static int optional(int rc)
{
    if (rc == MOE_ENOTFOUND)
        return 1;
    return rc ? MOE_EFORMAT : 0;
}

static int load_id(const struct gguf_file *f, const char *key, int64_t *out, char *err,
                   size_t errlen)
{
    int64_t v;
    int rc = optional(gguf_get_i64(f, key, &v, err, errlen));
    if (rc == 1) {
        *out = -1;
        return 0;
    }
    if (rc)
        return rc;
    if (v < 0 || v > INT32_MAX)
        return moe_fail(err, errlen, MOE_EFORMAT, "%s = %" PRId64 " is not a token id", key, v);
    *out = v;
    return 0;
}

int moe_tok_load(struct moe_tokenizer **out, const struct gguf_file *f, char *err, size_t errlen)
{
    struct moe_tok_spec spec = {0};
    int32_t *types = NULL;
    const struct gguf_kv *kv;
    int rc;

    rc = gguf_get_str(f, "tokenizer.ggml.model", &spec.model, err, errlen);
    if (rc == MOE_ENOTFOUND)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "the file has no vocabulary "
                        "(no tokenizer.ggml.model)");
    if (rc)
        return MOE_EFORMAT;
    if (!str_is(spec.model, "gpt2"))
        return moe_tok_build(out, &spec, err, errlen); /* the unsupported-model message */
    rc = gguf_get_str(f, "tokenizer.ggml.pre", &spec.pre, err, errlen);
    if (rc && rc != MOE_ENOTFOUND)
        return MOE_EFORMAT;
    if (!str_is(spec.pre, "qwen2"))
        return moe_tok_build(out, &spec, err, errlen);

    if ((rc = gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_STRING, &kv, err, errlen)))
        return rc == MOE_ENOTFOUND ? rc : MOE_EFORMAT;
    spec.n_tokens = kv->v.arr.n;
    spec.tokens = kv->v.arr.strs;
    if (spec.n_tokens > INT32_MAX - 1)
        return moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.tokens has %" PRIu64
                        " entries, too many", spec.n_tokens);

    kv = gguf_find_kv(f, "tokenizer.ggml.token_type");
    if (kv) {
        uint32_t et = kv->type == GGUF_ARRAY ? kv->v.arr.type : GGUF_ARRAY;
        if (et == GGUF_STRING || et == GGUF_F32 || et == GGUF_F64 ||
            et == GGUF_BOOL || et == GGUF_ARRAY)
            return moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.token_type at byte %" PRIu64
                            " is not an array of integers", kv->offset);
        if (kv->v.arr.n != spec.n_tokens)
            return moe_fail(err, errlen, MOE_EFORMAT, "tokenizer.ggml.token_type has %" PRIu64
                            " entries but tokenizer.ggml.tokens has %" PRIu64, kv->v.arr.n,
                            spec.n_tokens);
        types = malloc((spec.n_tokens ? spec.n_tokens : 1) * sizeof *types);
        if (!types)
            return -ENOMEM;
        for (uint64_t i = 0; i < spec.n_tokens; i++) {
            int64_t v = gguf_arr_i64(kv, i);
            types[i] = v < INT32_MIN || v > INT32_MAX ? 0 : (int32_t)v;
        }
        spec.token_type = types;
    }

    rc = gguf_get_arr(f, "tokenizer.ggml.merges", GGUF_STRING, &kv, err, errlen);
    if (rc) {
        if (rc == MOE_ENOTFOUND)
            rc = moe_fail(err, errlen, MOE_EFORMAT, "a gpt2 vocabulary needs "
                          "tokenizer.ggml.merges, which is missing");
        else
            rc = MOE_EFORMAT;
        goto done;
    }
    spec.n_merges = kv->v.arr.n;
    spec.merges = kv->v.arr.strs;

    if ((rc = load_id(f, "tokenizer.ggml.bos_token_id", &spec.bos_id, err, errlen)) ||
        (rc = load_id(f, "tokenizer.ggml.eos_token_id", &spec.eos_id, err, errlen)) ||
        (rc = load_id(f, "tokenizer.ggml.padding_token_id", &spec.pad_id, err, errlen)) ||
        (rc = load_id(f, "tokenizer.ggml.eot_token_id", &spec.eot_id, err, errlen)) ||
        (rc = load_id(f, "tokenizer.ggml.eom_token_id", &spec.eom_id, err, errlen)))
        goto done;

    rc = optional(gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &spec.add_bos, err, errlen));
    if (rc == 1)
        spec.add_bos = false;
    else if (rc)
        goto done;
    rc = optional(gguf_get_str(f, "tokenizer.chat_template", &spec.chat_template, err, errlen));
    if (rc == 1)
        spec.chat_template.p = NULL;
    else if (rc)
        goto done;

    rc = moe_tok_build(out, &spec, err, errlen);
done:
    free(types);
    return rc;
}

void moe_tok_free(struct moe_tokenizer *t)
{
    if (!t)
        return;
    free(t->text);
    free(t->text_off);
    free(t->type);
    free(t->flags);
    free((void *)t->reach);
    free(t->piece);
    free(t->piece_off);
    free(t->tmap);
    free(t->mmap);
    free(t->specials);
    free(t->chat_template);
    if (t->re)
        pcre2_code_free(t->re);
    free(t);
}

/* ---- encoding ------------------------------------------------------------------------------- */

struct sym {
    int32_t id;         /* -1 once merged into its left neighbour */
    int32_t prev, next; /* indices, -1 at the ends */
};

struct cand {
    uint32_t rank;
    int32_t left, right; /* symbol indices */
    int32_t lid, rid;    /* their ids when queued: a changed id makes the entry stale */
    int32_t result;      /* the merged token */
};

/* Scratch buffers of one encode call (encode is reentrant: nothing lives in the tokenizer). */
struct enc {
    int32_t *ids;
    size_t n, cap;
    uint8_t *bl;          /* piece in the byte alphabet, for the whole-token lookup */
    size_t bl_cap;
    struct sym *sym;
    size_t sym_cap;
    struct cand *heap;
    size_t heap_n, heap_cap;
    pcre2_match_data *md;
};

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q)
        return -ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

static int emit(struct enc *e, int32_t id)
{
    if (e->n == e->cap && grow((void **)&e->ids, &e->cap, e->n + 1, sizeof *e->ids))
        return -ENOMEM;
    e->ids[e->n++] = id;
    return 0;
}

static bool cand_less(const struct cand *a, const struct cand *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(struct enc *e, struct cand c)
{
    size_t i = e->heap_n++;
    e->heap[i] = c;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&e->heap[i], &e->heap[p]))
            break;
        struct cand tmp = e->heap[i];
        e->heap[i] = e->heap[p];
        e->heap[p] = tmp;
        i = p;
    }
}

static struct cand heap_pop(struct enc *e)
{
    struct cand top = e->heap[0];
    e->heap[0] = e->heap[--e->heap_n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < e->heap_n && cand_less(&e->heap[l], &e->heap[m]))
            m = l;
        if (r < e->heap_n && cand_less(&e->heap[r], &e->heap[m]))
            m = r;
        if (m == i)
            break;
        struct cand tmp = e->heap[i];
        e->heap[i] = e->heap[m];
        e->heap[m] = tmp;
        i = m;
    }
    return top;
}

static void queue_pair(const struct moe_tokenizer *t, struct enc *e, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return;
    const struct merge_slot *m = mmap_find(t, pair_key(e->sym[l].id, e->sym[r].id));
    if (m && m->result >= 0)
        heap_push(e, (struct cand){m->rank, l, r, e->sym[l].id, e->sym[r].id, m->result});
}

/* BPE over bytes p[n] with the merge loop: start from one symbol per byte, repeatedly merge the
 * adjacent pair with the lowest rank (leftmost on ties) until no pair has a merge. A priority
 * queue with lazy deletion keeps long pieces at O(n log n). The tokens are appended to e->ids;
 * sym_out (if not NULL) gets whether the result is a single symbol, and which. */
static int bpe_merge(const struct moe_tokenizer *t, struct enc *e, const uint8_t *p, size_t n,
                     int32_t *single)
{
    if (n > INT32_MAX || grow((void **)&e->sym, &e->sym_cap, n, sizeof *e->sym) ||
        grow((void **)&e->heap, &e->heap_cap, 2 * n, sizeof *e->heap))
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        e->sym[i] = (struct sym){t->byte_tok[p[i]], (int32_t)i - 1,
                                 i + 1 < n ? (int32_t)i + 1 : -1};
    e->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++)
        queue_pair(t, e, (int32_t)i, (int32_t)i + 1);

    /* The heap starts with at most n - 1 pairs and each merge pops one and pushes at most two,
     * so after k merges (k < n) it holds at most n - 1 + k < 2n entries; the grow below is only
     * a guard. */
    while (e->heap_n) {
        struct cand c = heap_pop(e);
        struct sym *l = &e->sym[c.left], *r = &e->sym[c.right];
        if (l->id != c.lid || r->id != c.rid || l->next != c.right)
            continue;
        l->id = c.result;
        r->id = -1;
        l->next = r->next;
        if (r->next >= 0)
            e->sym[r->next].prev = c.left;
        if (e->heap_cap < e->heap_n + 2 &&
            grow((void **)&e->heap, &e->heap_cap, e->heap_n + 2, sizeof *e->heap))
            return -ENOMEM;
        queue_pair(t, e, l->prev, c.left);
        queue_pair(t, e, c.left, l->next);
    }
    if (single)
        *single = e->sym[0].next < 0 ? e->sym[0].id : -1;
    for (int32_t i = 0; i >= 0; i = e->sym[i].next)
        if (emit(e, e->sym[i].id))
            return -ENOMEM;
    return 0;
}

/* Runs of one byte (spaces, newlines, '=' rules) are where the merge loop is slowest, and they
 * are regular: the merges of a run pair its symbols from the left, level by level, so far from
 * the run's end the tokens repeat, and what the end does reaches back a bounded distance (a few
 * of the longest tokens). For runs of at least 2 * run_base bytes the leading repeated tokens are
 * emitted directly and only the last run_base .. run_base + period bytes go through the merge
 * loop. Whether the repetition holds for a byte is checked against the merge loop itself, for
 * every length from run_base to run_base + 2 periods + 16, the first time a long run of that
 * byte is seen; where it does not hold, long runs take the merge loop. */
static size_t run_base(const struct moe_tokenizer *t)
{
    size_t b = 16 * t->max_piece;
    return b < 512 ? 512 : b;
}

static bool run_info(const struct moe_tokenizer *t, uint8_t b, int32_t *tok, uint32_t *len)
{
    struct moe_tokenizer *mt = (struct moe_tokenizer *)t; /* caches only */
    uint8_t st = atomic_load_explicit(&mt->run_state[b], memory_order_acquire);
    if (st == RUN_UNKNOWN) {
        const size_t base = run_base(t), span = 2 * t->max_piece + 17;
        struct enc e = {0};
        uint8_t *buf = malloc(base + span + t->max_piece + 1);
        size_t *off = malloc(sizeof *off * (span + 1));
        st = RUN_NO;
        if (buf && off) {
            memset(buf, b, base + span + t->max_piece + 1);
            /* Tokens of b^(base + k), k < span, back to back in e.ids; off[k] where each
             * starts. */
            bool ok = true;
            for (size_t k = 0; k < span && ok; k++) {
                off[k] = e.n;
                ok = bpe_merge(t, &e, buf, base + k, NULL) == 0;
            }
            off[span] = e.n;
            int32_t first = ok && e.n ? e.ids[0] : -1;
            size_t q = 0;
            if (first >= 0 && (uint32_t)first < t->n)
                q = t->piece_off[first + 1] - t->piece_off[first];
            /* b^(base + k + q) = first + b^(base + k) for every k that both lengths cover. */
            if (ok && q > 0 && q <= t->max_piece && q + 17 <= span) {
                bool same = true;
                for (size_t k = 0; k + q < span && same; k++) {
                    const int32_t *lo = e.ids + off[k], *hi = e.ids + off[k + q];
                    const size_t nlo = off[k + 1] - off[k], nhi = off[k + q + 1] - off[k + q];
                    same = nhi == nlo + 1 && hi[0] == first &&
                           memcmp(hi + 1, lo, nlo * sizeof *lo) == 0;
                }
                if (same) {
                    mt->run_tok[b] = first;
                    mt->run_len[b] = (uint32_t)q;
                    st = RUN_OK;
                }
            }
        }
        free(buf);
        free(off);
        free(e.ids);
        free(e.sym);
        free(e.heap);
        free(e.bl);
        atomic_store_explicit(&mt->run_state[b], st, memory_order_release);
    }
    if (st != RUN_OK)
        return false;
    *tok = t->run_tok[b];
    *len = t->run_len[b];
    return true;
}

/* BPE over one piece. */
static int bpe_piece(const struct moe_tokenizer *t, struct enc *e, const uint8_t *p, size_t n)
{
    if (n == 1)
        return emit(e, t->byte_tok[p[0]]);

    if (!t->runs_slow && n >= 2 * run_base(t)) {
        size_t i = 1;
        while (i < n && p[i] == p[0])
            i++;
        int32_t tok;
        uint32_t q;
        if (i == n && run_info(t, p[0], &tok, &q)) {
            const size_t m = (n - run_base(t)) / q;
            if (grow((void **)&e->ids, &e->cap, e->n + m, sizeof *e->ids))
                return -ENOMEM;
            for (size_t k = 0; k < m; k++)
                e->ids[e->n++] = tok;
            return bpe_merge(t, e, p, n - m * q, NULL);
        }
    }

    /* Most pieces are whole tokens (" the", "ing"). Whether BPE really ends in that token is
     * worked out once per token and remembered, so that later pieces skip the merge loop while
     * the result stays exactly what the merges give (a token that the merges cannot reach,
     * which a hand-edited vocabulary may have, is still split as BPE splits it). */
    int32_t whole = -1;
    uint8_t known = REACH_UNKNOWN;
    if (n <= t->max_piece) {
        if (grow((void **)&e->bl, &e->bl_cap, 2 * n, 1))
            return -ENOMEM;
        size_t bl = 0;
        for (size_t i = 0; i < n; i++)
            bl += (size_t)cp_to_utf8_small(byte_to_cp(p[i]), e->bl + bl);
        whole = tmap_find(t, e->bl, bl);
        if (whole >= 0) {
            known = atomic_load_explicit(&t->reach[whole], memory_order_relaxed);
            if (known == REACH_YES)
                return emit(e, whole);
        }
    }
    int32_t single = -1;
    int rc = bpe_merge(t, e, p, n, &single);
    if (!rc && whole >= 0 && known == REACH_UNKNOWN)
        atomic_store_explicit(&t->reach[whole], single == whole ? REACH_YES : REACH_NO,
                              memory_order_relaxed);
    return rc;
}

typedef int (*piece_fn)(void *ctx, const uint8_t *p, size_t n);

/* Splits one text fragment with the pre-tokenizer regex and hands every piece to fn. Bytes the
 * regex does not match (invalid UTF-8, which PCRE2_MATCH_INVALID_UTF never matches) become pieces
 * of their own, so the pieces always cover the fragment. */
static int split_regex(const struct moe_tokenizer *t, pcre2_match_data *md, const uint8_t *s,
                       size_t len, piece_fn fn, void *ctx)
{
    size_t pos = 0;
    while (pos < len) {
        int m = pcre2_match(t->re, s, len, pos, 0, md, NULL);
        if (m == PCRE2_ERROR_JIT_STACKLIMIT || m == PCRE2_ERROR_MATCHLIMIT ||
            m == PCRE2_ERROR_HEAPLIMIT || m == PCRE2_ERROR_NOMEMORY)
            m = pcre2_match(t->re, s, len, pos, PCRE2_NO_JIT, md, NULL);
        size_t ms = len, me = len;
        /* No match, or the matcher gave up (a resource limit on pathological input): the rest
         * becomes one piece rather than an error; BPE handles any length. */
        if (m >= 0) {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            if (ov[0] >= pos && ov[1] >= ov[0] && ov[1] <= len) {
                ms = ov[0];
                me = ov[1];
            }
        }
        int rc;
        if (ms > pos && (rc = fn(ctx, s + pos, ms - pos)))
            return rc;
        if (ms >= len)
            break;
        if (me == ms) /* an empty match (the regex has none): step one byte to make progress */
            me = ms + 1;
        if ((rc = fn(ctx, s + ms, me - ms)))
            return rc;
        pos = me;
    }
    return 0;
}

struct bpe_ctx {
    const struct moe_tokenizer *t;
    struct enc *e;
    size_t max;           /* stop with MOE_ERANGE once more tokens than this */
};

static int bpe_cb(void *ctx, const uint8_t *p, size_t n)
{
    struct bpe_ctx *c = ctx;
    int rc = bpe_piece(c->t, c->e, p, n);
    if (!rc && c->e->n > c->max)
        return MOE_ERANGE; /* past the caller's limit: stop early */
    return rc;
}

struct frag {
    size_t off, len;
    int32_t id; /* -1: raw text */
};

/* Cuts special tokens out of the text the way llama.cpp does: for each special token in order of
 * decreasing text length, every occurrence in every remaining raw fragment is cut out, left to
 * right. Control tokens take part only when parse_special; user-defined ones (<think>) always,
 * as in Hugging Face tokenizers. */
static int split_specials(const struct moe_tokenizer *t, const char *text, size_t len,
                          bool parse_special, struct frag **out, size_t *n_out)
{
    size_t cap = 16, n = 1;
    struct frag *a = malloc(cap * sizeof *a), *b = NULL;
    size_t bcap = 0;
    if (!a)
        return -ENOMEM;
    a[0] = (struct frag){0, len, -1};
    for (uint32_t k = 0; k < t->n_specials; k++) {
        int32_t id = t->specials[k];
        if ((t->flags[id] & TF_CONTROL) && !parse_special)
            continue;
        size_t sl;
        const char *st = tok_text(t, id, &sl);
        size_t bn = 0;
        for (size_t i = 0; i < n; i++) {
            struct frag f = a[i];
            if (f.id < 0) {
                const char *hit;
                while (f.len >= sl && (hit = memmem(text + f.off, f.len, st, sl))) {
                    size_t left = (size_t)(hit - (text + f.off));
                    if (grow((void **)&b, &bcap, bn + 2, sizeof *b))
                        goto nomem;
                    if (left)
                        b[bn++] = (struct frag){f.off, left, -1};
                    b[bn++] = (struct frag){f.off + left, sl, id};
                    f.off += left + sl;
                    f.len -= left + sl;
                }
                if (f.len == 0)
                    continue;
            }
            if (grow((void **)&b, &bcap, bn + 1, sizeof *b))
                goto nomem;
            b[bn++] = f;
        }
        struct frag *tmp = a;
        a = b;
        b = tmp;
        size_t tc = cap;
        cap = bcap;
        bcap = tc;
        n = bn;
    }
    free(b);
    *out = a;
    *n_out = n;
    return 0;
nomem:
    free(a);
    free(b);
    return -ENOMEM;
}

int moe_tok_split_special(const struct moe_tokenizer *t, const char *text, size_t len,
                          struct moe_tok_frag **frags, size_t *n)
{
    struct frag *fr;
    size_t nfr;
    int rc = split_specials(t, text, len, true, &fr, &nfr);
    if (rc)
        return rc;
    struct moe_tok_frag *out = malloc((nfr ? nfr : 1) * sizeof *out);
    if (!out) {
        free(fr);
        return -ENOMEM;
    }
    for (size_t i = 0; i < nfr; i++)
        out[i] = (struct moe_tok_frag){fr[i].off, fr[i].len, fr[i].id};
    free(fr);
    *frags = out;
    *n = nfr;
    return 0;
}

static void enc_free(struct enc *e)
{
    free(e->bl);
    free(e->sym);
    free(e->heap);
    if (e->md)
        pcre2_match_data_free(e->md);
}

int moe_tok_encode(const struct moe_tokenizer *t, const char *text, size_t len, bool parse_special,
                   int32_t **ids, size_t *n)
{
    return moe_tok_encode_max(t, text, len, parse_special, SIZE_MAX, ids, n);
}

int moe_tok_encode_max(const struct moe_tokenizer *t, const char *text, size_t len,
                       bool parse_special, size_t max_tokens, int32_t **ids, size_t *n)
{
    struct enc e = {0};
    struct frag *fr = NULL;
    size_t nfr = 0;
    int rc;

    e.md = pcre2_match_data_create_from_pattern(t->re, NULL);
    if (!e.md) {
        rc = -ENOMEM;
        goto fail;
    }
    if ((rc = split_specials(t, text, len, parse_special, &fr, &nfr)))
        goto fail;
    struct bpe_ctx bc = {t, &e, max_tokens};
    for (size_t i = 0; i < nfr; i++) {
        if (fr[i].id >= 0)
            rc = emit(&e, fr[i].id);
        else
            rc = split_regex(t, e.md, (const uint8_t *)text + fr[i].off, fr[i].len, bpe_cb, &bc);
        if (!rc && e.n > max_tokens)
            rc = MOE_ERANGE;
        if (rc)
            goto fail;
    }
    free(fr);
    enc_free(&e);
    if (!e.ids) {
        e.ids = malloc(sizeof *e.ids); /* a valid pointer even for empty text */
        if (!e.ids)
            return -ENOMEM;
    }
    *ids = e.ids;
    *n = e.n;
    return 0;
fail:
    free(fr);
    enc_free(&e);
    free(e.ids);
    return rc;
}

struct ends_ctx {
    const uint8_t *base;
    size_t *ends;
    size_t n, cap;
};

static int record_piece_end(void *ctx, const uint8_t *p, size_t n)
{
    struct ends_ctx *c = ctx;
    if (c->n == c->cap && grow((void **)&c->ends, &c->cap, c->n + 1, sizeof *c->ends))
        return -ENOMEM;
    c->ends[c->n++] = (size_t)(p + n - c->base);
    return 0;
}

int moe_tok_pretokenize(const struct moe_tokenizer *t, const char *text, size_t len,
                        size_t **ends, size_t *n)
{
    struct ends_ctx c = {(const uint8_t *)text, NULL, 0, 0};
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->re, NULL);
    if (!md)
        return -ENOMEM;
    int rc = split_regex(t, md, (const uint8_t *)text, len, record_piece_end, &c);
    pcre2_match_data_free(md);
    if (!rc && !c.ends && !(c.ends = malloc(sizeof *c.ends)))
        rc = -ENOMEM;
    if (rc) {
        free(c.ends);
        return rc;
    }
    *ends = c.ends;
    *n = c.n;
    return 0;
}

/* ---- lookups and decoding ------------------------------------------------------------------- */

int moe_tok_piece(const struct moe_tokenizer *t, int32_t id, char *buf, size_t cap)
{
    if (id < 0 || (uint32_t)id >= t->n)
        return -1;
    size_t len = (size_t)(t->piece_off[id + 1] - t->piece_off[id]);
    size_t k = len < cap ? len : cap;
    if (k) /* buf may be NULL with cap 0, to ask for the length */
        memcpy(buf, t->piece + t->piece_off[id], k);
    return (int)len;
}

uint32_t moe_tok_n_vocab(const struct moe_tokenizer *t) { return t->n; }
void moe_tok_runs_fast(struct moe_tokenizer *t, bool on)
{
    t->runs_slow = !on;
}

int32_t moe_tok_eos(const struct moe_tokenizer *t) { return t->eos; }
int32_t moe_tok_bos(const struct moe_tokenizer *t) { return t->bos; }
int32_t moe_tok_pad(const struct moe_tokenizer *t) { return t->pad; }
bool moe_tok_add_bos(const struct moe_tokenizer *t) { return t->add_bos; }
size_t moe_tok_max_piece(const struct moe_tokenizer *t) { return t->max_piece; }
const char *moe_tok_chat_template(const struct moe_tokenizer *t) { return t->chat_template; }

bool moe_tok_is_control(const struct moe_tokenizer *t, int32_t id)
{
    return id >= 0 && (uint32_t)id < t->n && (t->flags[id] & TF_CONTROL);
}

bool moe_tok_is_eog(const struct moe_tokenizer *t, int32_t id)
{
    return id >= 0 && (uint32_t)id < t->n && (t->flags[id] & TF_EOG);
}

int32_t moe_tok_lookup(const struct moe_tokenizer *t, const char *text)
{
    return tmap_find(t, text, strlen(text));
}

/* ---- streaming detokenizer ------------------------------------------------------------------ */

void moe_detok_init(struct moe_detok *d)
{
    memset(d, 0, sizeof *d);
}

/* Output with a fixed capacity that keeps room for the terminating NUL. Whole sequences only:
 * one that does not fit is dropped rather than cut. */
struct sink {
    char *out;
    size_t cap, n;
};

static void put(struct sink *s, const uint8_t *p, size_t k)
{
    if (s->cap && s->n + k < s->cap) {
        memcpy(s->out + s->n, p, k);
        s->n += k;
    }
}

static void put_fffd(struct sink *s)
{
    static const uint8_t fffd[3] = {0xEF, 0xBF, 0xBD};
    put(s, fffd, 3);
}

/* Byte i of the held bytes followed by the new piece. */
static uint8_t at(const struct moe_detok *d, const uint8_t *p, size_t i)
{
    return i < (size_t)d->n_held ? (uint8_t)d->held[i] : p[i - (size_t)d->n_held];
}

/* Emits the complete UTF-8 sequences of held + p[0..n); an ill-formed part becomes one U+FFFD per
 * maximal subpart (the Unicode / WHATWG convention) as soon as a byte proves it ill-formed; an
 * incomplete but so far valid tail is held back unless final. */
static void drain(struct moe_detok *d, const uint8_t *p, size_t n, bool final, struct sink *s)
{
    size_t total = (size_t)d->n_held + n, i = 0;
    uint8_t seq[4];
    while (i < total) {
        uint8_t b = at(d, p, i);
        if (b < 0x80) {
            put(s, &b, 1);
            i++;
            continue;
        }
        size_t need;
        uint8_t lo = 0x80, hi = 0xBF;
        if (b >= 0xC2 && b <= 0xDF) {
            need = 1;
        } else if (b >= 0xE0 && b <= 0xEF) {
            need = 2;
            lo = b == 0xE0 ? 0xA0 : 0x80;
            hi = b == 0xED ? 0x9F : 0xBF;
        } else if (b >= 0xF0 && b <= 0xF4) {
            need = 3;
            lo = b == 0xF0 ? 0x90 : 0x80;
            hi = b == 0xF4 ? 0x8F : 0xBF;
        } else {
            put_fffd(s);
            i++;
            continue;
        }
        seq[0] = b;
        size_t k = 1;
        bool bad = false;
        for (; k <= need; k++) {
            if (i + k >= total)
                break;
            uint8_t x = at(d, p, i + k);
            if (x < lo || x > hi) {
                bad = true;
                break;
            }
            seq[k] = x;
            lo = 0x80;
            hi = 0xBF;
        }
        if (bad) {
            put_fffd(s);
            i += k;
            continue;
        }
        if (k <= need) { /* ran out of bytes: incomplete */
            if (final) {
                put_fffd(s);
                i = total;
                break;
            }
            uint8_t keep[4];
            for (size_t j = 0; j < k; j++)
                keep[j] = at(d, p, i + j);
            memcpy(d->held, keep, k);
            d->n_held = (int)k;
            return;
        }
        put(s, seq, need + 1);
        i += need + 1;
    }
    d->n_held = 0;
}

size_t moe_detok_push(struct moe_detok *d, const struct moe_tokenizer *t, int32_t id, char *out,
                      size_t cap)
{
    struct sink s = {out, cap, 0};
    if (id >= 0 && (uint32_t)id < t->n) {
        const uint8_t *p = (const uint8_t *)t->piece + t->piece_off[id];
        size_t n = (size_t)(t->piece_off[id + 1] - t->piece_off[id]);
        drain(d, p, n, false, &s);
    }
    if (cap)
        out[s.n] = '\0';
    return s.n;
}

size_t moe_detok_flush(struct moe_detok *d, char *out, size_t cap)
{
    struct sink s = {out, cap, 0};
    drain(d, NULL, 0, true, &s);
    if (cap)
        out[s.n] = '\0';
    return s.n;
}
