/* libFuzzer target for the GBNF parser, the matcher, the token mask and the JSON Schema
 * converter. `make fuzz` builds it into build/fuzz/fuzz_grammar.
 *
 * Input: a first byte choosing the mode, then text up to the first NUL, then bytes for the
 * matcher. Mode even: the text is GBNF. Mode odd: the text is a JSON schema; its conversion must
 * either fail with a message or give a grammar that parses (short of the grammar limits). The
 * matcher then takes the bytes in chunks (sizes from the bytes themselves), and the mask over a
 * small vocabulary is checked against feeding each token to a clone (the mask with its step
 * cache on, off, or small enough to run out, by the last byte). */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "store/grammar.h"
#include "store/json_schema.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *vocab_text[] = {"{", "}", "\"", "a", "ab", " ", "\n", "1", "é", "\xc3",
                                   "\xa9", "\xf0\x9f\x98", "\x80", "null", ",", ":", "[", "]",
                                   "\\", "x\"", ""};
#define N_VOCAB (sizeof vocab_text / sizeof *vocab_text)

static struct moe_grammar_vocab *vocab(uint32_t *lens, uint8_t *eog)
{
    static struct moe_grammar_vocab *v;
    for (uint32_t i = 0; i < N_VOCAB; i++) {
        lens[i] = (uint32_t)strlen(vocab_text[i]);
        eog[i] = i + 1 == N_VOCAB;
    }
    if (!v) {
        char err[128];
        v = moe_grammar_vocab_new(vocab_text, lens, N_VOCAB, eog, err, sizeof err);
        if (!v)
            abort();
    }
    return v;
}

static void run(const struct moe_grammar *g, const uint8_t *in, size_t n)
{
    char err[256];
    uint32_t lens[N_VOCAB];
    uint8_t eog[N_VOCAB], mask[N_VOCAB];
    struct moe_grammar_vocab *v = vocab(lens, eog);
    struct moe_grammar_state *st = moe_grammar_state_new(g, err, sizeof err);
    if (!st)
        return;
    /* the mask with its step cache, without, and with one that runs out along the way */
    static const uint32_t cache_sizes[] = {MOE_GRAMMAR_MASK_CACHE_NODES, 0, 24};
    moe_grammar_state_set_mask_cache(st, cache_sizes[n ? in[n - 1] % 3 : 0]);
    size_t i = 0;
    for (int round = 0; round < 64 && i <= n; round++) {
        long allowed = moe_grammar_mask(st, v, mask);
        if (allowed >= 0) {
            long count = 0;
            for (uint32_t t = 0; t < N_VOCAB; t++) {
                int want;
                if (eog[t]) {
                    want = moe_grammar_state_is_accepting(st);
                } else {
                    struct moe_grammar_state *c = moe_grammar_state_clone(st);
                    if (!c)
                        abort();
                    int rc = moe_grammar_state_accept_bytes(c, vocab_text[t], lens[t]);
                    moe_grammar_state_free(c);
                    if (rc < 0)
                        goto done; /* a limit: the mask may have stopped elsewhere */
                    want = lens[t] && rc == 1;
                }
                if (mask[t] != want)
                    abort();
                count += want;
            }
            if (count != allowed)
                abort();
        }
        if (i == n)
            break;
        size_t k = 1 + in[i] % 4;
        if (k > n - i)
            k = n - i;
        int rc = moe_grammar_state_accept_bytes(st, in + i, k);
        if (rc == 1)
            i += k;
        else
            i++; /* skip a byte the grammar refuses */
    }
done:
    (void)moe_grammar_state_is_accepting(st);
    moe_grammar_state_free(st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int mode = data[0] & 1;
    data++, size--;
    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    const uint8_t *in = nul ? nul + 1 : data + size;
    size_t n = (size_t)(data + size - in);
    char *text = malloc(tlen ? tlen : 1); /* exact size, so that ASan sees reads past it */
    if (!text)
        return 0;
    memcpy(text, data, tlen);
    char err[512];
    struct moe_grammar *g = NULL;
    if (mode == 0) {
        err[0] = '\0';
        g = moe_grammar_parse(text, tlen, err, sizeof err);
        if (!g && !err[0])
            abort(); /* a refusal must say why */
    } else {
        json_error_t je;
        json_t *schema = json_loadb(text, tlen, JSON_DECODE_ANY, &je);
        char *gbnf = NULL;
        if (schema && moe_json_schema_to_gbnf(schema, &gbnf, err, sizeof err) == 0) {
            g = moe_grammar_parse(gbnf, strlen(gbnf), err, sizeof err);
            if (!g && !strstr(err, "more than") && !strstr(err, "too large"))
                abort(); /* the converter wrote a grammar the parser refuses */
            free(gbnf);
        } else if (schema && (gbnf || !err[0])) {
            abort();
        }
        json_decref(schema);
    }
    if (g)
        run(g, in, n);
    moe_grammar_free(g);
    free(text);
    return 0;
}
