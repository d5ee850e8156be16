/* libFuzzer target for the tokenizer.
 *
 * The first input byte picks the mode; the rest is data.
 *   bit 1 clear: the data is text, encoded with the tiny golden model's vocabulary (4160 tokens,
 *     26 special tokens; MOE_FUZZ_VOCAB overrides the path) with parse_special = bit 0. The ids
 *     must decode to the text again, and streaming them must give valid UTF-8 that equals the text
 *     when the text is valid UTF-8.
 *   bit 1 set: the data describes a vocabulary: the 256 byte tokens plus extra tokens and merges
 *     cut from the data at '\n' (lines with a space become merges, the others tokens, the first
 *     byte of each line its type), built with moe_tok_build; on success the last line is encoded
 *     and must round-trip. Invalid vocabularies must give an error, never a crash.
 * Any violation aborts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/gguf.h"
#include "store/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static struct moe_tokenizer *vocab;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *path = getenv("MOE_FUZZ_VOCAB");
    if (!path)
        path = "tests/golden/models/tiny-qwen3moe-F16.gguf";
    char err[256];
    struct gguf_file *f;
    if (gguf_open(&f, path, err, sizeof err) || moe_tok_load(&vocab, f, err, sizeof err)) {
        fprintf(stderr, "fuzz_tokenizer: %s: %s\n", path, err);
        exit(1);
    }
    gguf_close(f);
    return 0;
}

static int valid_utf8(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = p[i], need, lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) {
            need = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return 0;
        }
        if (i + need >= n)
            return 0;
        for (unsigned k = 1; k <= need; k++) {
            if (p[i + k] < lo || p[i + k] > hi)
                return 0;
            lo = 0x80;
            hi = 0xBF;
        }
        i += need + 1;
    }
    return 1;
}

static void check_roundtrip(const struct moe_tokenizer *t, const char *text, size_t len,
                            bool special)
{
    int32_t *ids = NULL;
    size_t n = 0;
    if (moe_tok_encode(t, text, len, special, &ids, &n))
        abort();
    char *back = malloc(len + 1);
    size_t need = 3 * (moe_tok_max_piece(t) + 4) + 1;
    char *chunk = malloc(need), *stream = malloc(3 * len + 16);
    if (!back || !chunk || !stream)
        abort();
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int k = moe_tok_piece(t, ids[i], NULL, 0);
        if (k < 0 || o + (size_t)k > len)
            abort();
        moe_tok_piece(t, ids[i], back + o, (size_t)k);
        o += (size_t)k;
    }
    if (o != len || (len && memcmp(back, text, len) != 0))
        abort();
    struct moe_detok d;
    moe_detok_init(&d);
    size_t so = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = moe_detok_push(&d, t, ids[i], chunk, need);
        if (!valid_utf8(chunk, k) || so + k > 3 * len + 16)
            abort();
        memcpy(stream + so, chunk, k);
        so += k;
    }
    size_t k = moe_detok_flush(&d, chunk, need);
    if (!valid_utf8(chunk, k) || so + k > 3 * len + 16)
        abort();
    memcpy(stream + so, chunk, k);
    so += k;
    if (valid_utf8(text, len) && (so != len || (len && memcmp(stream, text, len) != 0)))
        abort();
    free(ids);
    free(back);
    free(chunk);
    free(stream);
}

/* The GPT-2 alphabet character of byte b, as UTF-8. */
static struct gguf_str byte_char(unsigned b, char store[3])
{
    unsigned cp = b;
    int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    if (!printable)
        cp = 256 + (b <= 32 ? b : b <= 160 ? 33 + (b - 127) : 67);
    if (cp < 0x80) {
        store[0] = (char)cp;
        return (struct gguf_str){store, 1};
    }
    store[0] = (char)(0xC0 | (cp >> 6));
    store[1] = (char)(0x80 | (cp & 0x3F));
    return (struct gguf_str){store, 2};
}

static void fuzz_vocab(const char *d, size_t size)
{
    enum { MAX_EXTRA = 64 };
    static char bytes[256][3];
    struct gguf_str toks[256 + MAX_EXTRA], merges[MAX_EXTRA];
    int32_t types[256 + MAX_EXTRA];
    size_t nt = 256, nm = 0;
    for (unsigned b = 0; b < 256; b++) {
        toks[b] = byte_char(b, bytes[b]);
        types[b] = 1;
    }
    const char *last = d;
    size_t last_len = size;
    for (size_t i = 0; i < size;) {
        const char *nl = memchr(d + i, '\n', size - i);
        size_t end = nl ? (size_t)(nl - d) : size;
        const char *line = d + i;
        size_t len = end - i;
        last = line;
        last_len = len;
        if (len >= 1 && memchr(line, ' ', len) && nm < MAX_EXTRA) {
            merges[nm++] = (struct gguf_str){line, len};
        } else if (len >= 2 && nt < 256 + MAX_EXTRA) {
            types[nt] = (unsigned char)line[0] % 8;
            toks[nt++] = (struct gguf_str){line + 1, len - 1};
        }
        i = end + 1;
    }
    struct moe_tok_spec spec = {
        .model = {"gpt2", 4}, .pre = {"qwen2", 5}, .n_tokens = nt, .tokens = toks,
        .token_type = types, .n_merges = nm, .merges = merges,
        .bos_id = -1, .eos_id = -1, .pad_id = -1, .eot_id = -1, .eom_id = -1,
    };
    struct moe_tokenizer *t = NULL;
    char err[256];
    int rc = moe_tok_build(&t, &spec, err, sizeof err);
    if (rc == 0) {
        check_roundtrip(t, last, last_len, true);
        check_roundtrip(t, last, last_len, false);
        moe_tok_free(t);
    } else if (t || (rc != MOE_EFORMAT && rc != -12 /* ENOMEM */)) {
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    /* An exact-size copy, so that ASan sees any read past the end. */
    char *buf = malloc(size - 1 ? size - 1 : 1);
    if (!buf)
        return 0;
    memcpy(buf, data + 1, size - 1);
    if (data[0] & 2)
        fuzz_vocab(buf, size - 1);
    else
        check_roundtrip(vocab, buf, size - 1, data[0] & 1);
    free(buf);
    return 0;
}
