/* Tokenizer tests: the byte alphabet, the regex pre-tokenizer and the BPE loop on hand-made
 * vocabularies; the 66 golden cases on the full Qwen3 vocabulary; the golden prompts on the tiny
 * model's vocabulary; streaming decoding; rejection of unsupported and malformed vocabularies;
 * speed; and `moectl tokenize` end to end. */
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/gguf.h"
#include "store/tokenizer.h"
#include "tests/gguf_bytes.h"
#include "tests/harness.h"

#define QWEN3_VOCAB "tests/golden/tokenizer/qwen3-vocab.gguf"
#define TINY_MODEL "tests/golden/models/tiny-qwen3moe-F16.gguf"
#define CASES "tests/golden/tokenizer/tokenizer-cases.json"

/* ---- helpers -------------------------------------------------------------------------------- */

static struct moe_tokenizer *load_file(const char *path)
{
    char err[512] = "";
    struct gguf_file *f = NULL;
    int rc = gguf_open(&f, path, err, sizeof err);
    CHECK_MSG(rc == 0, "gguf_open %s: %s (%d)", path, err, rc);
    struct moe_tokenizer *t = NULL;
    rc = moe_tok_load(&t, f, err, sizeof err);
    gguf_close(f);
    CHECK_MSG(rc == 0, "moe_tok_load %s: %s (%d)", path, err, rc);
    return t;
}

static struct gguf_str S(const char *s)
{
    return (struct gguf_str){s, strlen(s)};
}

/* The GPT-2 byte alphabet written independently of the tokenizer (from the GPT-2 definition:
 * printable Latin-1 stays, the rest is numbered from U+0100 in byte order), as UTF-8. */
static void alphabet_char(unsigned b, char out[3])
{
    unsigned cp;
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) {
        cp = b;
    } else {
        unsigned k = 0;
        for (unsigned x = 0; x < b; x++)
            if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE)))
                k++;
        cp = 256 + k;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        out[2] = 0;
    }
}

/* A hand-made vocabulary: the 256 byte tokens (ids 0..255, byte order), then extra tokens, then
 * merges given as "a b" in the byte alphabet. */
struct mini {
    char bytes[256][3];
    const char *texts[300];
    struct gguf_str toks[300];
    int32_t types[300];
    struct gguf_str merges[64];
    uint32_t n, n_merges;
};

static void mini_init(struct mini *m)
{
    memset(m, 0, sizeof *m);
    for (unsigned b = 0; b < 256; b++) {
        alphabet_char(b, m->bytes[b]);
        m->toks[b] = S(m->bytes[b]);
        m->types[b] = 1;
    }
    m->n = 256;
}

static int32_t mini_add(struct mini *m, const char *text, int32_t type)
{
    m->toks[m->n] = S(text);
    m->types[m->n] = type;
    return (int32_t)m->n++;
}

static void mini_merge(struct mini *m, const char *merge)
{
    m->merges[m->n_merges++] = S(merge);
}

static struct moe_tok_spec mini_spec(struct mini *m)
{
    return (struct moe_tok_spec){
        .model = S("gpt2"), .pre = S("qwen2"), .n_tokens = m->n, .tokens = m->toks,
        .token_type = m->types, .n_merges = m->n_merges, .merges = m->merges,
        .bos_id = -1, .eos_id = -1, .pad_id = -1, .eot_id = -1, .eom_id = -1,
    };
}

static struct moe_tokenizer *mini_build(struct mini *m)
{
    struct moe_tok_spec spec = mini_spec(m);
    struct moe_tokenizer *t = NULL;
    char err[256] = "";
    int rc = moe_tok_build(&t, &spec, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_tok_build: %s (%d)", err, rc);
    return t;
}

static size_t encode(const struct moe_tokenizer *t, const char *s, size_t len, bool special,
                     int32_t *out, size_t cap)
{
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK_EQ(moe_tok_encode(t, s, len, special, &ids, &n), 0);
    CHECK_MSG(n <= cap, "%zu tokens, room for %zu", n, cap);
    memcpy(out, ids, n * sizeof *ids);
    free(ids);
    return n;
}

/* Concatenated pieces of ids, malloc'ed (NUL-terminated), length in *len. */
static char *decode(const struct moe_tokenizer *t, const int32_t *ids, size_t n, size_t *len)
{
    size_t cap = 64, o = 0;
    char *s = malloc(cap);
    CHECK(s);
    for (size_t i = 0; i < n; i++) {
        int k = moe_tok_piece(t, ids[i], NULL, 0);
        CHECK(k >= 0);
        while (o + (size_t)k + 1 > cap)
            CHECK((s = realloc(s, cap *= 2)) != NULL);
        CHECK_EQ(moe_tok_piece(t, ids[i], s + o, (size_t)k), k);
        o += (size_t)k;
    }
    s[o] = 0;
    *len = o;
    return s;
}

static bool valid_utf8(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = p[i], need, lo = 0x80, hi = 0xBF;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c >= 0xE0 && c <= 0xEF) { need = 2; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
        else if (c >= 0xF0 && c <= 0xF4) { need = 3; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
        else return false;
        if (i + need >= n)
            return false;
        for (unsigned k = 1; k <= need; k++) {
            if (p[i + k] < lo || p[i + k] > hi)
                return false;
            lo = 0x80;
            hi = 0xBF;
        }
        i += need + 1;
    }
    return true;
}

/* ---- hand-made vocabularies ----------------------------------------------------------------- */

TEST(tok_byte_alphabet_roundtrip)
{
    struct mini m;
    mini_init(&m);
    struct moe_tokenizer *t = mini_build(&m);
    /* Every byte, alone, is its own byte token and decodes back to itself. */
    for (unsigned b = 0; b < 256; b++) {
        char c = (char)b;
        int32_t ids[4];
        CHECK_EQ(encode(t, &c, 1, false, ids, 4), 1);
        CHECK_EQ(ids[0], (int32_t)b);
        char out[4];
        CHECK_EQ(moe_tok_piece(t, ids[0], out, sizeof out), 1);
        CHECK_EQ((unsigned char)out[0], b);
    }
    /* Spot checks of the alphabet itself. */
    CHECK_EQ(moe_tok_lookup(t, "\xC4\xA0"), ' ');   /* U+0120 'Ġ' is the space */
    CHECK_EQ(moe_tok_lookup(t, "\xC4\x8A"), '\n');  /* U+010A 'Ċ' is the newline */
    CHECK_EQ(moe_tok_lookup(t, "\xC5\x83"), 0xAD);  /* U+0143 is the soft hyphen, the last */
    CHECK_EQ(moe_tok_lookup(t, "A"), 'A');
    CHECK_EQ(moe_tok_lookup(t, "\xC3\xA9"), 0xE9);  /* 'é' stands for itself */
    CHECK_EQ(moe_tok_lookup(t, "zz"), -1);
    CHECK_EQ(moe_tok_n_vocab(t), 256);
    CHECK_EQ(moe_tok_max_piece(t), 1);
    moe_tok_free(t);
}

TEST(tok_bpe_merge_order)
{
    struct mini m;
    mini_init(&m);
    int32_t aa = mini_add(&m, "aa", 1);
    int32_t bc = mini_add(&m, "bc", 1);
    int32_t ab = mini_add(&m, "ab", 1);
    int32_t abc = mini_add(&m, "abc", 1);
    int32_t aab = mini_add(&m, "aab", 1);
    int32_t sp_x = mini_add(&m, "\xC4\xA0x", 1); /* " x" */
    mini_merge(&m, "b c");   /* rank 0 */
    mini_merge(&m, "a b");   /* rank 1 */
    mini_merge(&m, "a a");   /* rank 2 */
    mini_merge(&m, "a bc");  /* rank 3 */
    mini_merge(&m, "aa b");  /* rank 4 */
    mini_merge(&m, "\xC4\xA0 x");
    struct moe_tokenizer *t = mini_build(&m);
    int32_t ids[16];

    /* "abc": "b c" has the lower rank, so a|bc, then "a bc" -> abc. */
    CHECK_EQ(encode(t, "abc", 3, false, ids, 16), 1);
    CHECK_EQ(ids[0], abc);
    /* "ab" alone: a direct token. */
    CHECK_EQ(encode(t, "ab", 2, false, ids, 16), 1);
    CHECK_EQ(ids[0], ab);
    /* "aaa": one rank, leftmost first: aa|a. */
    CHECK_EQ(encode(t, "aaa", 3, false, ids, 16), 2);
    CHECK_EQ(ids[0], aa);
    CHECK_EQ(ids[1], 'a');
    /* "aab": "a b" (rank 1) beats "a a" (rank 2): a|ab, and no merge joins a+ab. */
    CHECK_EQ(encode(t, "aab", 3, false, ids, 16), 2);
    CHECK_EQ(ids[0], 'a');
    CHECK_EQ(ids[1], ab);
    /* "aab" is a token the merges cannot reach: BPE's answer wins over the whole-token lookup,
     * also the second time (when the tokenizer remembers that it is unreachable). */
    CHECK_EQ(encode(t, "aab", 3, false, ids, 16), 2);
    CHECK_EQ(ids[1], ab);
    CHECK(aab != ids[0]);
    /* "aabc": b c first -> a a bc; then "a a" (2) before "a bc" (3) -> aa|bc. */
    CHECK_EQ(encode(t, "aabc", 4, false, ids, 16), 2);
    CHECK_EQ(ids[0], aa);
    CHECK_EQ(ids[1], bc);
    /* The regex keeps a leading space with a word: " x" is one piece and one token. */
    CHECK_EQ(encode(t, "x x", 3, false, ids, 16), 2);
    CHECK_EQ(ids[0], 'x');
    CHECK_EQ(ids[1], sp_x);
    /* A long run takes the heap path and still merges left to right. */
    char run[1001];
    memset(run, 'a', 1000);
    int32_t *big = NULL;
    size_t n = 0;
    CHECK_EQ(moe_tok_encode(t, run, 1000, false, &big, &n), 0);
    CHECK_EQ(n, 500);
    for (size_t i = 0; i < n; i++)
        CHECK_EQ(big[i], aa);
    free(big);
    moe_tok_free(t);
}

/* Runs the pre-tokenizer and compares the pieces with a '|'-separated expectation. */
static void check_split(const struct moe_tokenizer *t, const char *text, size_t len,
                        const char *want)
{
    size_t *ends = NULL, n = 0;
    CHECK_EQ(moe_tok_pretokenize(t, text, len, &ends, &n), 0);
    char got[512];
    size_t o = 0, prev = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK(ends[i] > prev && ends[i] <= len);
        if (i)
            got[o++] = '|';
        memcpy(got + o, text + prev, ends[i] - prev);
        o += ends[i] - prev;
        prev = ends[i];
    }
    got[o] = 0;
    CHECK_EQ(prev, len);
    CHECK_MSG(strcmp(got, want) == 0, "split of \"%s\": got \"%s\", want \"%s\"", text, got, want);
    free(ends);
}

TEST(tok_pretokenize_regex)
{
    struct mini m;
    mini_init(&m);
    struct moe_tokenizer *t = mini_build(&m);
#define SPLIT(text, want) check_split(t, text, sizeof(text) - 1, want)
    SPLIT("Hello world", "Hello| world");
    SPLIT("I'm 42", "I|'m| |4|2");              /* contractions; digits one by one */
    SPLIT("WON'T we'll", "WON|'T| we|'ll");      /* contractions are case-insensitive */
    SPLIT("a  b", "a| | b");                     /* \s+(?!\S) leaves the last space to the word */
    SPLIT("x\n\n y", "x|\n\n| y");
    SPLIT("f(x);\n", "f|(x|);\n");               /* a non-letter joins the word; newlines join punctuation */
    SPLIT("end   ", "end|   ");
    SPLIT("\t\tif", "\t|\tif");
    SPLIT("3.14", "3|.|1|4");
    SPLIT("caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC", "caf\xC3\xA9| \xE6\x97\xA5\xE6\x9C\xAC");
    /* Invalid UTF-8 is never matched by the regex but still becomes pieces. */
    SPLIT("a\xFF" "b", "a|\xFF|b");
    SPLIT("\xC3", "\xC3");
#undef SPLIT
    /* And encodes byte-wise, and decodes back to the same bytes. */
    int32_t ids[8];
    CHECK_EQ(encode(t, "a\xFF\xC3", 3, false, ids, 8), 3);
    CHECK_EQ(ids[1], 0xFF);
    CHECK_EQ(ids[2], 0xC3);
    moe_tok_free(t);
}

TEST(tok_special_tokens_hand_made)
{
    struct mini m;
    mini_init(&m);
    int32_t im_start = mini_add(&m, "<|im_start|>", 3);
    int32_t think = mini_add(&m, "<think>", 4);
    int32_t fim = mini_add(&m, "<|fim_prefix|>", 4); /* user-defined, but control by its text */
    int32_t eot = mini_add(&m, "<|endoftext|>", 3);
    int32_t im = mini_add(&m, "<|im", 3);            /* a shorter special overlapping a longer */
    int32_t pad = mini_add(&m, "[PAD300]", 5);
    struct moe_tok_spec spec = mini_spec(&m);
    spec.eos_id = eot;
    struct moe_tokenizer *t = NULL;
    char err[256];
    CHECK_EQ(moe_tok_build(&t, &spec, err, sizeof err), 0);
    int32_t ids[64];
    size_t n;

    static const char txt[] = "<|im_start|>x<think>y<|fim_prefix|><|im[PAD300]";
    n = encode(t, txt, sizeof txt - 1, true, ids, 64);
    /* Longest first: <|im_start|> is cut before <|im could split it. [PAD300] is unused: text. */
    CHECK(n >= 7);
    CHECK_EQ(ids[0], im_start);
    CHECK_EQ(ids[1], 'x');
    CHECK_EQ(ids[2], think);
    CHECK_EQ(ids[3], 'y');
    CHECK_EQ(ids[4], fim);
    CHECK_EQ(ids[5], im);
    CHECK_EQ(ids[6], '[');
    /* Without special parsing only the user-defined <think> is cut out. */
    n = encode(t, txt, sizeof txt - 1, false, ids, 64);
    int found_think = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK(ids[i] != im_start && ids[i] != fim && ids[i] != im);
        found_think += ids[i] == think;
    }
    CHECK_EQ(found_think, 1);
    size_t len;
    char *back = decode(t, ids, n, &len);
    CHECK_EQ(len, sizeof txt - 1);
    CHECK(memcmp(back, txt, len) == 0);
    free(back);

    CHECK(moe_tok_is_control(t, im_start));
    CHECK(moe_tok_is_control(t, fim));
    CHECK(!moe_tok_is_control(t, think));
    CHECK(!moe_tok_is_control(t, 'a'));
    CHECK(moe_tok_is_eog(t, eot));
    CHECK(!moe_tok_is_eog(t, im_start));
    CHECK(!moe_tok_is_eog(t, -5));
    CHECK_EQ(moe_tok_eos(t), eot);
    CHECK_EQ(moe_tok_bos(t), -1);
    /* Pieces: specials give their text, unused tokens nothing, bad ids -1. */
    char buf[32];
    CHECK_EQ(moe_tok_piece(t, think, buf, sizeof buf), 7);
    CHECK(memcmp(buf, "<think>", 7) == 0);
    CHECK_EQ(moe_tok_piece(t, pad, buf, sizeof buf), 0);
    CHECK_EQ(moe_tok_piece(t, -1, buf, sizeof buf), -1);
    CHECK_EQ(moe_tok_piece(t, 10000, buf, sizeof buf), -1);
    /* A short buffer gets a prefix and the full length back. */
    CHECK_EQ(moe_tok_piece(t, im_start, buf, 3), 12);
    CHECK(memcmp(buf, "<|i", 3) == 0);
    moe_tok_free(t);
}

/* Encoding gives back its text whatever the token types: a merge whose result decodes to
 * something else than its parts (an unused token decodes to nothing, a user-defined one to its
 * raw text: "\xC4\xA0y" there is those two characters, not " y") never applies, so the parts
 * stay; a vocabulary whose byte token decodes to something else than its byte is refused. Found
 * by fuzz_tokenizer ("a b" merging into an unused "ab"). */
TEST(tok_merges_never_change_the_text)
{
    struct mini m;
    mini_init(&m);
    const int32_t ab = mini_add(&m, "ab", 5);             /* unused */
    const int32_t sp_y = mini_add(&m, "\xC4\xA0y", 4);   /* user-defined, raw text */
    const int32_t cd = mini_add(&m, "cd", 1);
    mini_merge(&m, "a b");
    mini_merge(&m, "\xC4\xA0 y");
    mini_merge(&m, "c d");
    struct moe_tokenizer *t = mini_build(&m);
    int32_t ids[16];
    char buf[16];
    CHECK_EQ(encode(t, "ab", 2, false, ids, 16), 2);
    CHECK_EQ(ids[0], 'a');
    CHECK_EQ(ids[1], 'b');
    CHECK(ids[0] != ab);
    CHECK_EQ(encode(t, "x y", 3, false, ids, 16), 3);
    CHECK(ids[1] != sp_y && ids[2] == 'y');
    CHECK_EQ(encode(t, "cd", 2, false, ids, 16), 1); /* a normal result still merges */
    CHECK_EQ(ids[0], cd);
    CHECK_EQ(moe_tok_piece(t, cd, buf, sizeof buf), 2);
    moe_tok_free(t);

    mini_init(&m);
    m.types['q'] = 5; /* the token of byte 'q' unused: it would decode to nothing */
    struct moe_tok_spec s = mini_spec(&m);
    struct moe_tokenizer *bad = NULL;
    char err[256] = "";
    CHECK_EQ(moe_tok_build(&bad, &s, err, sizeof err), MOE_EFORMAT);
    CHECK(bad == NULL);
    CHECK_MSG(strstr(err, "byte 0x71"), "message: %s", err);
}

/* ---- malformed and unsupported vocabularies ------------------------------------------------- */

static int build_err(struct moe_tok_spec *spec, char *err, size_t errlen)
{
    struct moe_tokenizer *t = NULL;
    err[0] = 0;
    int rc = moe_tok_build(&t, spec, err, errlen);
    CHECK(rc != 0 || t != NULL);
    moe_tok_free(t);
    return rc;
}

TEST(tok_rejects_bad_specs)
{
    struct mini m;
    mini_init(&m);
    mini_add(&m, "ab", 1);
    mini_merge(&m, "a b");
    char err[256];
    struct moe_tok_spec s;

    s = mini_spec(&m);
    s.model = S("llama");
    CHECK_EQ(build_err(&s, err, sizeof err), MOE_EUNSUPPORTED);
    CHECK_MSG(strstr(err, "llama") && strstr(err, "gpt2"), "message: %s", err);

    s = mini_spec(&m);
    s.pre = S("llama3");
    CHECK_EQ(build_err(&s, err, sizeof err), MOE_EUNSUPPORTED);
    CHECK_MSG(strstr(err, "llama3") && strstr(err, "qwen2"), "message: %s", err);

    s = mini_spec(&m);
    s.eos_id = 257;
    CHECK_EQ(build_err(&s, err, sizeof err), MOE_EFORMAT);
    CHECK_MSG(strstr(err, "eos_token_id"), "message: %s", err);

    s = mini_spec(&m);
    m.types[5] = 9;
    CHECK_EQ(build_err(&s, err, sizeof err), MOE_EFORMAT);
    CHECK_MSG(strstr(err, "token_type[5]"), "message: %s", err);
    m.types[5] = 1;

    struct gguf_str bad_merges[3][1] = {{S("ab")}, {S("a z")}, {S(" ")}};
    for (int i = 0; i < 3; i++) {
        s = mini_spec(&m);
        s.merges = bad_merges[i];
        s.n_merges = 1;
        CHECK_EQ(build_err(&s, err, sizeof err), MOE_EFORMAT);
        CHECK_MSG(strstr(err, "merges[0]"), "message: %s", err);
    }
    /* "a z" fails because "az" is no token; " " because there is no right part. */

    /* A vocabulary without all 256 byte tokens is not byte-level. */
    s = mini_spec(&m);
    m.toks[' '] = S("space");
    CHECK_EQ(build_err(&s, err, sizeof err), MOE_EFORMAT);
    CHECK_MSG(strstr(err, "0x20"), "message: %s", err);
    m.toks[' '] = S(m.bytes[' ']);

    s = mini_spec(&m);
    s.n_tokens = 100;
    CHECK_EQ(build_err(&s, err, sizeof err), MOE_EFORMAT);

    s = mini_spec(&m);
    CHECK_EQ(build_err(&s, err, sizeof err), 0);
}

/* A vocab-only GGUF in memory with the given model/pre and, optionally, odd arrays. */
struct vocab_opts {
    const char *model, *pre;
    int n_types;        /* token_type entries (default: as many as tokens) */
    int64_t eos;        /* -1: leave out */
    int merges_as_int;  /* write merges with the wrong element type */
};

static int load_mem_vocab(const struct vocab_opts *o, char *err, size_t errlen)
{
    struct gb b = {0};
    int n_tok = 256 + 1;
    int n_kv = 5 + (o->eos >= 0);
    gb_header(&b, 3, 0, (uint64_t)n_kv);
    gb_kv_str(&b, "tokenizer.ggml.model", o->model);
    gb_kv_str(&b, "tokenizer.ggml.pre", o->pre);
    gb_arr(&b, "tokenizer.ggml.tokens", GGUF_STRING, (uint64_t)n_tok);
    for (unsigned i = 0; i < 256; i++) {
        char c[3];
        alphabet_char(i, c);
        gb_str(&b, c);
    }
    gb_str(&b, "ab");
    int nt = o->n_types ? o->n_types : n_tok;
    gb_arr(&b, "tokenizer.ggml.token_type", GGUF_I32, (uint64_t)nt);
    for (int i = 0; i < nt; i++)
        gb_i32(&b, 1);
    if (o->merges_as_int) {
        gb_arr(&b, "tokenizer.ggml.merges", GGUF_I32, 1);
        gb_i32(&b, 7);
    } else {
        gb_arr(&b, "tokenizer.ggml.merges", GGUF_STRING, 1);
        gb_str(&b, "a b");
    }
    if (o->eos >= 0)
        gb_kv_u32(&b, "tokenizer.ggml.eos_token_id", (uint32_t)o->eos);

    struct gguf_file *f = NULL;
    int rc = gguf_open_mem(&f, b.p, b.n, err, errlen);
    CHECK_MSG(rc == 0, "gguf_open_mem: %s", err);
    struct moe_tokenizer *t = NULL;
    err[0] = 0;
    rc = moe_tok_load(&t, f, err, errlen);
    if (rc == 0) {
        int32_t *ids = NULL;
        size_t n = 0;
        CHECK_EQ(moe_tok_encode(t, "ab", 2, false, &ids, &n), 0);
        CHECK_EQ(n, 1);
        CHECK_EQ(ids[0], 256);
        free(ids);
    }
    moe_tok_free(t);
    gguf_close(f);
    gb_free(&b);
    return rc;
}

TEST(tok_gguf_pre_llama3_rejected)
{
    char err[512];
    struct vocab_opts o = {.model = "gpt2", .pre = "llama3", .eos = -1};
    CHECK_EQ(load_mem_vocab(&o, err, sizeof err), MOE_EUNSUPPORTED);
    CHECK_MSG(strstr(err, "llama3") && strstr(err, "supported: qwen2"), "message: %s", err);

    o = (struct vocab_opts){.model = "llama", .pre = "qwen2", .eos = -1};
    CHECK_EQ(load_mem_vocab(&o, err, sizeof err), MOE_EUNSUPPORTED);

    o = (struct vocab_opts){.model = "gpt2", .pre = "qwen2", .eos = 256};
    CHECK_EQ(load_mem_vocab(&o, err, sizeof err), 0);
}

TEST(tok_gguf_malformed_vocab)
{
    char err[512];
    struct vocab_opts o = {.model = "gpt2", .pre = "qwen2", .eos = 400};
    CHECK_EQ(load_mem_vocab(&o, err, sizeof err), MOE_EFORMAT);
    CHECK_MSG(strstr(err, "eos_token_id"), "message: %s", err);

    o = (struct vocab_opts){.model = "gpt2", .pre = "qwen2", .eos = -1, .n_types = 10};
    CHECK_EQ(load_mem_vocab(&o, err, sizeof err), MOE_EFORMAT);
    CHECK_MSG(strstr(err, "token_type"), "message: %s", err);

    o = (struct vocab_opts){.model = "gpt2", .pre = "qwen2", .eos = -1, .merges_as_int = 1};
    CHECK_EQ(load_mem_vocab(&o, err, sizeof err), MOE_EFORMAT);
    CHECK_MSG(strstr(err, "merges"), "message: %s", err);
}

/* ---- golden data ---------------------------------------------------------------------------- */

TEST(tok_golden_cases)
{
    struct moe_tokenizer *t = load_file(QWEN3_VOCAB);
    CHECK_EQ(moe_tok_n_vocab(t), 151936);
    json_error_t jerr;
    json_t *cases = json_load_file(CASES, 0, &jerr);
    CHECK_MSG(cases && json_is_array(cases), "%s: %s", CASES, jerr.text);
    CHECK_EQ(json_array_size(cases), 66);
    int failed = 0;
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        json_t *jt = json_object_get(c, "text"), *jids = json_object_get(c, "ids");
        CHECK(json_is_string(jt) && json_is_array(jids));
        const char *text = json_string_value(jt);
        size_t len = json_string_length(jt);
        bool special = json_is_true(json_object_get(c, "parse_special"));
        int32_t *ids = NULL;
        size_t n = 0;
        CHECK_EQ(moe_tok_encode(t, text, len, special, &ids, &n), 0);
        bool same = n == json_array_size(jids);
        for (size_t k = 0; same && k < n; k++)
            same = ids[k] == json_integer_value(json_array_get(jids, k));
        if (!same) {
            failed++;
            fprintf(stderr, "case %zu (special %d) \"%.60s\": got", i, special, text);
            for (size_t k = 0; k < n; k++)
                fprintf(stderr, " %d", ids[k]);
            fprintf(stderr, "\n  want");
            for (size_t k = 0; k < json_array_size(jids); k++)
                fprintf(stderr, " %lld", (long long)json_integer_value(json_array_get(jids, k)));
            fprintf(stderr, "\n");
        }
        /* Round trip: the pieces give the text back, byte for byte. */
        size_t blen;
        char *back = decode(t, ids, n, &blen);
        if (blen != len || memcmp(back, text, len) != 0) {
            failed++;
            fprintf(stderr, "case %zu: round trip gave \"%.60s\"\n", i, back);
        }
        free(back);
        free(ids);
    }
    CHECK_MSG(failed == 0, "%d golden tokenizer checks failed", failed);
    json_decref(cases);
    moe_tok_free(t);
}

TEST(tok_golden_prompts)
{
    struct moe_tokenizer *t = load_file(TINY_MODEL);
    CHECK_EQ(moe_tok_n_vocab(t), 4160);
    for (int p = 1; p <= 3; p++) {
        char path[256];
        snprintf(path, sizeof path, "tests/golden/prompts/p%d.txt", p);
        size_t len;
        char *text = moe_test_read_file_or_fail(path, &len);
        snprintf(path, sizeof path, "tests/golden/refs/tiny-qwen3moe-F16.p%d.json", p);
        json_error_t jerr;
        json_t *ref = json_load_file(path, 0, &jerr);
        CHECK_MSG(ref, "%s: %s", path, jerr.text);
        json_t *want = json_object_get(ref, "prompt_tokens");
        CHECK(json_is_array(want));
        int32_t *ids = NULL;
        size_t n = 0;
        CHECK_EQ(moe_tok_encode(t, text, len, true, &ids, &n), 0);
        CHECK_MSG(n == json_array_size(want), "p%d: %zu tokens, want %zu", p, n,
                  json_array_size(want));
        for (size_t k = 0; k < n; k++)
            CHECK_MSG(ids[k] == json_integer_value(json_array_get(want, k)),
                      "p%d token %zu: %d, want %lld", p, k, ids[k],
                      (long long)json_integer_value(json_array_get(want, k)));
        size_t blen;
        char *back = decode(t, ids, n, &blen);
        CHECK(blen == len && memcmp(back, text, len) == 0);
        free(back);
        free(ids);
        free(text);
        json_decref(ref);
    }
    /* The tiny vocabulary's specials and end-of-generation set. */
    CHECK_EQ(moe_tok_eos(t), 4098);
    CHECK_EQ(moe_tok_bos(t), 4096);
    CHECK_EQ(moe_tok_pad(t), 4096);
    CHECK(!moe_tok_add_bos(t));
    CHECK_EQ(moe_tok_lookup(t, "<|im_end|>"), 4098);
    CHECK(moe_tok_is_eog(t, 4098));
    CHECK(moe_tok_is_eog(t, 4096));          /* <|endoftext|> */
    CHECK(!moe_tok_is_eog(t, 4097));         /* <|im_start|> */
    CHECK(!moe_tok_is_eog(t, 4120));         /* <think> */
    CHECK(moe_tok_is_control(t, 4097));
    CHECK(!moe_tok_is_control(t, 4120));
    const char *tmpl = moe_tok_chat_template(t);
    CHECK(tmpl && strstr(tmpl, "<|im_start|>"));
    moe_tok_free(t);
}

/* ---- streaming detokenizer ------------------------------------------------------------------ */

/* Pushes the text byte by byte (one byte token each) and checks that every emitted chunk is
 * valid UTF-8 and that all chunks together give the text back. */
static void stream_bytes(const struct moe_tokenizer *t, const int32_t *byte_tok, const char *text)
{
    struct moe_detok d;
    moe_detok_init(&d);
    size_t len = strlen(text), o = 0;
    char *all = malloc(len + 64);
    CHECK(all);
    for (size_t i = 0; i < len; i++) {
        char out[64];
        size_t k = moe_detok_push(&d, t, byte_tok[(unsigned char)text[i]], out, sizeof out);
        CHECK_EQ(out[k], 0);
        CHECK_MSG(valid_utf8(out, k), "chunk after byte %zu is not valid UTF-8", i);
        memcpy(all + o, out, k);
        o += k;
    }
    char out[64];
    size_t k = moe_detok_flush(&d, out, sizeof out);
    CHECK_EQ(k, 0);
    CHECK_EQ(o, len);
    CHECK(memcmp(all, text, len) == 0);
    free(all);
}

TEST(tok_detok_streaming)
{
    struct moe_tokenizer *t = load_file(QWEN3_VOCAB);
    int32_t byte_tok[256];
    for (unsigned b = 0; b < 256; b++) {
        char c[3];
        alphabet_char(b, c);
        byte_tok[b] = moe_tok_lookup(t, c);
        CHECK(byte_tok[b] >= 0);
        char p[4];
        CHECK_EQ(moe_tok_piece(t, byte_tok[b], p, sizeof p), 1);
        CHECK_EQ((unsigned char)p[0], b);
    }
    stream_bytes(t, byte_tok, "日本語のテキスト、中文字符");
    stream_bytes(t, byte_tok, "emoji 🦙🔥 and ZWJ 👩‍👩‍👧 ✅");
    stream_bytes(t, byte_tok, "Ελληνικά русский العربية한국어 ½ Äpfel");

    /* Real tokens of a mixed text, pushed one by one, give the text back. */
    static const char mixed[] = "Hi 😁 我想在apple工作1314151天～ <|im_end|>";
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK_EQ(moe_tok_encode(t, mixed, sizeof mixed - 1, true, &ids, &n), 0);
    struct moe_detok d;
    moe_detok_init(&d);
    char all[256];
    size_t o = 0;
    size_t need = 3 * (moe_tok_max_piece(t) + 4) + 1;
    char *out = malloc(need);
    for (size_t i = 0; i < n; i++) {
        size_t k = moe_detok_push(&d, t, ids[i], out, need);
        CHECK(valid_utf8(out, k));
        memcpy(all + o, out, k);
        o += k;
    }
    o += moe_detok_flush(&d, all + o, sizeof all - o);
    CHECK_EQ(o, sizeof mixed - 1);
    CHECK(memcmp(all, mixed, o) == 0);
    free(out);
    free(ids);

    /* Invalid input: replaced by U+FFFD as soon as it is certainly invalid. */
    char buf[64];
    moe_detok_init(&d);
    CHECK_EQ(moe_detok_push(&d, t, byte_tok[0xFF], buf, sizeof buf), 3);
    CHECK_STREQ(buf, "\xEF\xBF\xBD");
    CHECK_EQ(moe_detok_push(&d, t, byte_tok[0xE6], buf, sizeof buf), 0); /* a lead byte: wait */
    CHECK_EQ(moe_detok_push(&d, t, byte_tok['a'], buf, sizeof buf), 4);  /* 'a' proves it bad */
    CHECK_STREQ(buf, "\xEF\xBF\xBD" "a");
    CHECK_EQ(moe_detok_push(&d, t, byte_tok[0xF0], buf, sizeof buf), 0);
    CHECK_EQ(moe_detok_push(&d, t, byte_tok[0x9F], buf, sizeof buf), 0);
    CHECK_EQ(moe_detok_flush(&d, buf, sizeof buf), 3);                    /* one FFFD per subpart */
    CHECK_STREQ(buf, "\xEF\xBF\xBD");
    CHECK_EQ(moe_detok_flush(&d, buf, sizeof buf), 0);
    CHECK_EQ(moe_detok_push(&d, t, byte_tok[0xED], buf, sizeof buf), 0);
    CHECK_EQ(moe_detok_push(&d, t, byte_tok[0xA0], buf, sizeof buf), 6); /* a surrogate: 2 x FFFD */
    CHECK_EQ(moe_detok_push(&d, t, -1, buf, sizeof buf), 0);             /* bad id: nothing */
    moe_tok_free(t);
}

/* ---- speed ---------------------------------------------------------------------------------- */

TEST_TIMEOUT(tok_encode_speed, 60)
{
    struct moe_tokenizer *t = load_file(QWEN3_VOCAB);
    size_t l1, l2, l3;
    char *p1 = moe_test_read_file_or_fail("tests/golden/prompts/p1.txt", &l1);
    char *p2 = moe_test_read_file_or_fail("tests/golden/prompts/p2.txt", &l2);
    char *p3 = moe_test_read_file_or_fail("tests/golden/prompts/p3.txt", &l3);
    size_t target = 200 * 1024, len = 0;
    char *text = malloc(target + l1 + l2 + l3);
    CHECK(text);
    /* Varied text, numbered so that not every piece repeats. */
    for (int i = 0; len < target; i++) {
        len += (size_t)sprintf(text + len, "\n%d. ", i);
        const char *src = i % 3 == 0 ? p1 : i % 3 == 1 ? p2 : p3;
        size_t sl = i % 3 == 0 ? l1 : i % 3 == 1 ? l2 : l3;
        memcpy(text + len, src, sl);
        len += sl;
    }
    double t0 = moe_test_now();
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK_EQ(moe_tok_encode(t, text, len, true, &ids, &n), 0);
    double s = moe_test_now() - t0;
    fprintf(stderr, "encoded %zu bytes into %zu tokens in %.3f s\n", len, n, s);
    CHECK(n > len / 8);
    CHECK_MSG(s < 2.0, "encoding %zu bytes took %.3f s", len, s);
    size_t blen;
    char *back = decode(t, ids, n, &blen);
    CHECK(blen == len && memcmp(back, text, len) == 0);
    free(back);
    free(ids);
    free(text);
    free(p1);
    free(p2);
    free(p3);
    moe_tok_free(t);
}

/* ---- moectl tokenize ------------------------------------------------------------------------ */

static void ids_line(json_t *arr, char *out, size_t cap)
{
    size_t o = 0;
    for (size_t k = 0; k < json_array_size(arr); k++)
        o += (size_t)snprintf(out + o, cap - o, k ? " %lld" : "%lld",
                              (long long)json_integer_value(json_array_get(arr, k)));
    snprintf(out + o, cap - o, "\n");
}

TEST(tok_moectl_tokenize)
{
    const char *moectl = moe_test_bin("moectl");
    char cmd[1024], want[8192];
    int st;
    json_error_t jerr;
    json_t *ref = json_load_file("tests/golden/refs/tiny-qwen3moe-F16.p3.json", 0, &jerr);
    CHECK(ref);
    ids_line(json_object_get(ref, "prompt_tokens"), want, sizeof want);

    snprintf(cmd, sizeof cmd, "%s tokenize -m %s -f tests/golden/prompts/p3.txt", moectl,
             TINY_MODEL);
    char *out = moe_test_run_shell(cmd, &st);
    CHECK_EQ(st, 0);
    CHECK_MSG(strcmp(out, want) == 0, "got: %s\nwant: %s", out, want);
    free(out);

    /* stdin */
    snprintf(cmd, sizeof cmd, "%s tokenize -m %s -f - < tests/golden/prompts/p3.txt", moectl,
             TINY_MODEL);
    out = moe_test_run_shell(cmd, &st);
    CHECK_EQ(st, 0);
    CHECK_STREQ(out, want);
    free(out);
    json_decref(ref);

    /* --no-special on the full vocabulary: the golden case with ChatML text as plain text. */
    json_t *cases = json_load_file(CASES, 0, &jerr);
    CHECK(cases);
    json_t *c = json_array_get(cases, 47);
    CHECK(!json_is_true(json_object_get(c, "parse_special")));
    const char *text = json_string_value(json_object_get(c, "text"));
    char path[512];
    snprintf(path, sizeof path, "%s/in.txt", moe_test_tmpdir());
    moe_test_write_file(path, text, strlen(text));
    ids_line(json_object_get(c, "ids"), want, sizeof want);
    snprintf(cmd, sizeof cmd, "%s tokenize -m %s --no-special -f %s", moectl, QWEN3_VOCAB, path);
    out = moe_test_run_shell(cmd, &st);
    CHECK_EQ(st, 0);
    CHECK_MSG(strcmp(out, want) == 0, "got: %s\nwant: %s", out, want);
    free(out);
    json_decref(cases);

    /* --pieces */
    snprintf(cmd, sizeof cmd, "printf 'Hi<|im_end|>\\n' | %s tokenize -m %s --pieces -f -",
             moectl, TINY_MODEL);
    out = moe_test_run_shell(cmd, &st);
    CHECK_EQ(st, 0);
    CHECK_MSG(strstr(out, "4098:<|im_end|>\n") && strstr(out, ":\\n\n"), "got: %s", out);
    free(out);

    /* Usage errors and bad files. */
    snprintf(cmd, sizeof cmd, "%s tokenize -m %s 2>/dev/null", moectl, TINY_MODEL);
    free(moe_test_run_shell(cmd, &st));
    CHECK_EQ(st, 2);
    snprintf(cmd, sizeof cmd, "%s tokenize -m /nonexistent.gguf -f - </dev/null 2>/dev/null",
             moectl);
    out = moe_test_run_shell(cmd, &st);
    CHECK_EQ(st, 1);
    CHECK_STREQ(out, "");
    free(out);
    /* An empty input prints an empty line. */
    snprintf(cmd, sizeof cmd, "%s tokenize -m %s -f - </dev/null", moectl, TINY_MODEL);
    out = moe_test_run_shell(cmd, &st);
    CHECK_EQ(st, 0);
    CHECK_STREQ(out, "\n");
    free(out);
}

/* Long runs that make single huge pieces or stress the regex's backtracking: each must finish
 * quickly (no quadratic merge loop, no regex resource failure) and round-trip exactly. */
TEST_TIMEOUT(tok_pathological_inputs, 60)
{
    struct moe_tokenizer *t = load_file(QWEN3_VOCAB);
    size_t n = 64 * 1024;
    char *s = malloc(n + 1);
    CHECK(s);
    for (int kind = 0; kind < 7; kind++) {
        uint32_t x = 12345;
        for (size_t i = 0; i < n; i++) {
            x = x * 1103515245u + 12345u;
            switch (kind) {
            case 0: s[i] = ' '; break;
            case 1: s[i] = 'a'; break;
            case 2: s[i] = '!'; break;
            case 3: s[i] = i % 2 ? '\n' : ' '; break;
            case 4: s[i] = (char)(x >> 24); break;                 /* random bytes */
            case 5: s[i] = i % 1001 == 1000 ? 'x' : ' '; break;    /* long spaces then a word */
            case 6: s[i] = "<|im_start|>"[i % 12]; break;          /* specials back to back */
            }
        }
        double t0 = moe_test_now();
        int32_t *ids = NULL;
        size_t m = 0;
        CHECK_EQ(moe_tok_encode(t, s, n, kind != 6, &ids, &m), 0);
        double sec = moe_test_now() - t0;
        CHECK_MSG(sec < 5.0, "kind %d: %.2f s", kind, sec);
        CHECK(m > 0 && m <= n);
        size_t blen;
        char *back = decode(t, ids, m, &blen);
        CHECK_MSG(blen == n && memcmp(back, s, n) == 0, "kind %d does not round-trip", kind);
        free(back);
        free(ids);
    }
    free(s);
    moe_tok_free(t);
}

/* Every normal token of the full Qwen3 vocabulary whose text the regex keeps as one piece encodes
 * to itself: BPE reaches every token, so the whole-token shortcut never changes a result there. */
TEST_TIMEOUT(tok_every_token_reachable, 60)
{
    struct moe_tokenizer *t = load_file(QWEN3_VOCAB);
    size_t checked = 0, bad = 0;
    char buf[1024];
    for (int32_t id = 0; id < (int32_t)moe_tok_n_vocab(t); id++) {
        if (moe_tok_is_control(t, id))
            continue;
        int k = moe_tok_piece(t, id, buf, sizeof buf);
        CHECK(k >= 0 && k < (int)sizeof buf);
        if (k == 0 || buf[0] == '<' || buf[0] == '[') /* specials and unused tokens */
            continue;
        size_t *ends = NULL, np = 0;
        CHECK_EQ(moe_tok_pretokenize(t, buf, (size_t)k, &ends, &np), 0);
        free(ends);
        if (np != 1)
            continue;
        int32_t ids[256];
        size_t n = encode(t, buf, (size_t)k, false, ids, 256);
        checked++;
        if (n != 1 || ids[0] != id) {
            if (bad++ < 5)
                fprintf(stderr, "token %d '%.*s' encodes to %zu tokens\n", id, k, buf, n);
        }
    }
    fprintf(stderr, "%zu tokens checked\n", checked);
    CHECK(checked > 140000);
    CHECK_EQ(bad, 0);
    moe_tok_free(t);
}

/* Random mixtures of ASCII, multi-byte characters, invalid bytes and special-token texts: both
 * encodings round-trip, and streaming the ids always yields valid UTF-8 that equals the input
 * whenever the input is valid UTF-8. */
TEST_TIMEOUT(tok_random_roundtrip, 60)
{
    static const char *const parts[] = {
        "a", "Z", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "3", "42", ".", "!?", "é", "ß",
        "日本", "語", "🦙", "👩‍👧", "ﬁ", "\xC3", "\xE6\x97", "\xFF", "\x80", "\xED\xA0\x80",
        "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|fim_prefix|>", "<|", "|>",
        "[PAD151700]", "hello", " world", "don't", "\xF0\x9F", "\0",
    };
    struct moe_tokenizer *t = load_file(QWEN3_VOCAB);
    size_t need = 3 * (moe_tok_max_piece(t) + 4) + 1;
    char *chunk = malloc(need), *text = malloc(4096), *stream = malloc(4 * 4096 + 64);
    CHECK(chunk && text && stream);
    uint32_t x = 777;
    for (int iter = 0; iter < 1500; iter++) {
        size_t len = 0;
        int n_parts = 1 + iter % 40;
        for (int k = 0; k < n_parts; k++) {
            x = x * 1664525u + 1013904223u;
            size_t p = (x >> 8) % (sizeof parts / sizeof *parts);
            size_t pl = parts[p][0] ? strlen(parts[p]) : 1; /* "\0" is one NUL byte */
            memcpy(text + len, parts[p], pl);
            len += pl;
        }
        for (int special = 0; special < 2; special++) {
            int32_t *ids = NULL;
            size_t n = 0;
            CHECK_EQ(moe_tok_encode(t, text, len, special, &ids, &n), 0);
            size_t blen;
            char *back = decode(t, ids, n, &blen);
            CHECK_MSG(blen == len && memcmp(back, text, len) == 0, "iteration %d", iter);
            free(back);
            struct moe_detok d;
            moe_detok_init(&d);
            size_t o = 0;
            for (size_t i = 0; i < n; i++) {
                size_t k = moe_detok_push(&d, t, ids[i], chunk, need);
                CHECK(valid_utf8(chunk, k));
                memcpy(stream + o, chunk, k);
                o += k;
            }
            size_t k = moe_detok_flush(&d, chunk, need);
            CHECK(valid_utf8(chunk, k));
            memcpy(stream + o, chunk, k);
            o += k;
            if (valid_utf8(text, len))
                CHECK_MSG(o == len && memcmp(stream, text, len) == 0, "iteration %d", iter);
            free(ids);
        }
    }
    free(chunk);
    free(text);
    free(stream);
    moe_tok_free(t);
}

/* Several threads encoding with one tokenizer (its whole-token cache is filled concurrently) get
 * the same ids as one thread does. */
struct tok_thread {
    const struct moe_tokenizer *t;
    const char *text;
    size_t len;
    int32_t *ids;
    size_t n;
    int rc;
};

static void *tok_thread_main(void *arg)
{
    struct tok_thread *a = arg;
    a->rc = moe_tok_encode(a->t, a->text, a->len, true, &a->ids, &a->n);
    return NULL;
}

TEST(tok_concurrent_encode)
{
    struct moe_tokenizer *t = load_file(QWEN3_VOCAB);
    size_t l1;
    char *p1 = moe_test_read_file_or_fail("tests/golden/prompts/p1.txt", &l1);
    struct tok_thread th[4];
    pthread_t tid[4];
    for (int i = 0; i < 4; i++) {
        th[i] = (struct tok_thread){.t = t, .text = p1, .len = l1};
        CHECK_EQ(pthread_create(&tid[i], NULL, tok_thread_main, &th[i]), 0);
    }
    for (int i = 0; i < 4; i++)
        CHECK_EQ(pthread_join(tid[i], NULL), 0);
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK_EQ(moe_tok_encode(t, p1, l1, true, &ids, &n), 0);
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(th[i].rc, 0);
        CHECK_EQ(th[i].n, n);
        CHECK(memcmp(th[i].ids, ids, n * sizeof *ids) == 0);
        free(th[i].ids);
    }
    free(ids);
    free(p1);
    moe_tok_free(t);
}

/* moe_tok_encode_max gives the same ids as moe_tok_encode up to its limit, and MOE_ERANGE (with
 * nothing returned) once the text gives more. */
TEST(tok_encode_max_stops_past_the_limit)
{
    struct moe_tokenizer *t = NULL;
    struct gguf_file *f = NULL;
    char err[256];
    CHECK_MSG(gguf_open(&f, "models/kjv-demo-F16.gguf", err, sizeof err) == 0, "%s", err);
    CHECK_MSG(moe_tok_load(&t, f, err, sizeof err) == 0, "%s", err);
    const char *text = "In the beginning God created the heaven and the earth. And the earth was "
                       "without form, and void; and darkness was upon the face of the deep.";
    int32_t *all = NULL, *some = NULL;
    size_t n_all = 0, n_some = 0;
    CHECK_EQ(moe_tok_encode(t, text, strlen(text), true, &all, &n_all), 0);
    CHECK(n_all > 10);
    CHECK_EQ(moe_tok_encode_max(t, text, strlen(text), true, n_all, &some, &n_some), 0);
    CHECK_EQ(n_some, n_all);
    CHECK(memcmp(all, some, n_all * sizeof *all) == 0);
    free(some);
    some = NULL;
    CHECK_EQ(moe_tok_encode_max(t, text, strlen(text), true, n_all - 1, &some, &n_some), MOE_ERANGE);
    CHECK(some == NULL);
    CHECK_EQ(moe_tok_encode_max(t, text, strlen(text), true, 0, &some, &n_some), MOE_ERANGE);
    free(all);
    moe_tok_free(t);
    gguf_close(f);
}

/* Long runs of one byte take a shortcut (leading repeated tokens emitted directly); the tokens
 * are the merge loop's, for every run length around the shortcut's threshold and well past it,
 * for the bytes real text repeats, on the Qwen3 vocabulary and the demo model's; and the
 * shortcut makes megabytes of spaces fast. */
TEST_TIMEOUT(tokenizer_long_runs_equal_the_merge_loop, 300)
{
    static const char *const paths[] = {QWEN3_VOCAB, "models/kjv-demo-F16.gguf"};
    static const char bytes[] = {' ', '\n', '=', '-', '\t', 'a', '0', '*'};
    for (size_t pi = 0; pi < sizeof paths / sizeof paths[0]; pi++) {
        struct moe_tokenizer *fast = load_file(paths[pi]), *slow = load_file(paths[pi]);
        moe_tok_runs_fast(slow, false);
        const size_t maxp = moe_tok_max_piece(fast);
        const size_t base = 16 * maxp < 512 ? 512 : 16 * maxp;
        char *s = malloc(8 * base + 64);
        CHECK(s);
        for (size_t bi = 0; bi < sizeof bytes; bi++) {
            memset(s, bytes[bi], 8 * base + 64);
            /* Every length near 2 * base (where the shortcut starts), then a spread past it. */
            for (size_t n = 2 * base - 3; n < 8 * base + 64; n += n < 2 * base + 2 * maxp + 40 ? 1 : 97) {
                int32_t *a = NULL, *b = NULL;
                size_t na = 0, nb = 0;
                CHECK_EQ(moe_tok_encode(fast, s, n, false, &a, &na), 0);
                CHECK_EQ(moe_tok_encode(slow, s, n, false, &b, &nb), 0);
                CHECK_MSG(na == nb && memcmp(a, b, na * sizeof *a) == 0,
                          "%s: %zu x 0x%02x: %zu vs %zu tokens", paths[pi], n,
                          (unsigned)(uint8_t)bytes[bi], na, nb);
                free(a);
                free(b);
            }
        }
        free(s);
        /* 8 MB of spaces, then a word. */
        const size_t big = 8u << 20;
        char *sp = malloc(big + 8);
        CHECK(sp);
        memset(sp, ' ', big);
        memcpy(sp + big, " word", 5);
        double t0 = moe_test_now();
        int32_t *ids = NULL;
        size_t m = 0;
        CHECK_EQ(moe_tok_encode(fast, sp, big + 5, false, &ids, &m), 0);
        double dt = moe_test_now() - t0;
        printf("  %s: 8 MiB of spaces and a word in %.3f s, %zu tokens\n", paths[pi], dt, m);
        CHECK_MSG(dt < 2.0, "%.2f s", dt);
        size_t blen;
        char *back = decode(fast, ids, m, &blen);
        CHECK(blen == big + 5 && memcmp(back, sp, big + 5) == 0);
        free(back);
        free(ids);
        free(sp);
        moe_tok_free(fast);
        moe_tok_free(slow);
    }
}
