/* Vocabulary for moectl mkmodel: the tokenizer.* KVs of a vocabulary GGUF, whole or cut down.
 *
 * The cut-down form is what the golden tiny model carries: the first N regular tokens of the
 * real Qwen3 BPE vocabulary, the merges that stay inside them, then the added tokens, padded,
 * so that the tokenizer still behaves like the real one on common text. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/mkmodel.h"
#include "store/err.h"
#include "store/gguf.h"

enum { TOKEN_NORMAL = 1, TOKEN_CONTROL = 3, TOKEN_USER_DEFINED = 4, TOKEN_UNUSED = 5 };

/* Open-addressing set of byte strings (pointers into the vocabulary file's mapping). */
struct strset {
    const struct gguf_str **slot;
    size_t cap;
};

static uint64_t bytes_hash(const char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)p[i]) * 0x100000001b3ull;
    return h;
}

static int strset_init(struct strset *s, size_t n)
{
    s->cap = 16;
    while (s->cap < 2 * n)
        s->cap *= 2;
    s->slot = calloc(s->cap, sizeof *s->slot);
    return s->slot ? 0 : -ENOMEM;
}

static bool strset_has2(const struct strset *s, const char *a, size_t na, const char *b, size_t nb)
{
    /* Hash of the concatenation a+b without building it. */
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < na; i++)
        h = (h ^ (uint8_t)a[i]) * 0x100000001b3ull;
    for (size_t i = 0; i < nb; i++)
        h = (h ^ (uint8_t)b[i]) * 0x100000001b3ull;
    for (size_t i = h & (s->cap - 1);; i = (i + 1) & (s->cap - 1)) {
        const struct gguf_str *e = s->slot[i];
        if (!e)
            return false;
        if (e->len == na + nb && !memcmp(e->p, a, na) && !memcmp(e->p + na, b, nb))
            return true;
    }
}

static void strset_add(struct strset *s, const struct gguf_str *str)
{
    if (strset_has2(s, str->p, (size_t)str->len, "", 0))
        return;
    for (size_t i = bytes_hash(str->p, (size_t)str->len) & (s->cap - 1);;
         i = (i + 1) & (s->cap - 1))
        if (!s->slot[i]) {
            s->slot[i] = str;
            return;
        }
}

static bool is_token_id_key(const char *key)
{
    size_t n = strlen(key), k = strlen("_token_id");
    return !strncmp(key, "tokenizer.ggml.", 15) && n > k && !strcmp(key + n - k, "_token_id");
}

/* Writes the cut-down vocabulary's tokens, types and merges and renumbered special ids. */
static int add_cut(struct gguf_writer *w, const struct gguf_file *f, uint32_t n_regular,
                   uint32_t *n_vocab, char *err, size_t errlen)
{
    const struct gguf_kv *tok, *typ, *mrg;
    struct gguf_str *strs = NULL;
    int32_t *types = NULL;
    int64_t *remap = NULL; /* old id -> new id, -1 when dropped */
    struct gguf_str *merges = NULL;
    char (*pads)[24] = NULL;
    struct strset set = {0};
    int rc;

    if ((rc = gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_STRING, &tok, err, errlen)) ||
        (rc = gguf_get_arr(f, "tokenizer.ggml.token_type", GGUF_I32, &typ, err, errlen)))
        return rc;
    uint64_t n = tok->v.arr.n;
    if (typ->v.arr.n != n)
        return moe_fail(err, errlen, MOE_EFORMAT, "vocabulary: %llu tokens but %llu token types",
                        (unsigned long long)n, (unsigned long long)typ->v.arr.n);
    if (n_regular > n)
        return moe_fail(err, errlen, MOE_ERANGE, "vocabulary has %llu tokens, fewer than %u",
                        (unsigned long long)n, n_regular);
    for (uint32_t i = 0; i < n_regular; i++) {
        int64_t t = gguf_arr_i64(typ, i);
        if (t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED || t == TOKEN_UNUSED)
            return moe_fail(err, errlen, MOE_EFORMAT,
                            "vocabulary token %u has type %lld; the first %u must be regular",
                            i, (long long)t, n_regular);
    }
    uint64_t n_added = 0;
    for (uint64_t i = n_regular; i < n; i++) {
        int64_t t = gguf_arr_i64(typ, i);
        n_added += t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED;
    }
    uint64_t n_new = (n_regular + n_added + 63) / 64 * 64;
    if (n_new > INT32_MAX)
        return moe_fail(err, errlen, MOE_ETOOBIG, "vocabulary too large");
    strs = calloc(n_new, sizeof *strs);
    types = calloc(n_new, sizeof *types);
    remap = malloc(n * sizeof *remap);
    pads = calloc(n_new, sizeof *pads);
    if (!strs || !types || !remap || !pads) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        int64_t t = gguf_arr_i64(typ, i);
        remap[i] = -1;
        if (i < n_regular || t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED) {
            strs[k] = tok->v.arr.strs[i];
            types[k] = (int32_t)t;
            remap[i] = (int64_t)k++;
        }
    }
    for (; k < n_new; k++) {
        int len = snprintf(pads[k], sizeof pads[k], "[PAD%llu]", (unsigned long long)k);
        strs[k] = (struct gguf_str){pads[k], (uint64_t)len};
        types[k] = TOKEN_UNUSED;
    }

    /* Merges whose two parts and result are all kept regular tokens, in rank order. */
    uint64_t n_merges = 0;
    if ((rc = gguf_get_arr(f, "tokenizer.ggml.merges", GGUF_STRING, &mrg, err, errlen)) == 0) {
        if ((rc = strset_init(&set, n_regular)) ||
            !(merges = malloc((mrg->v.arr.n ? mrg->v.arr.n : 1) * sizeof *merges))) {
            rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
            goto fail;
        }
        for (uint32_t i = 0; i < n_regular; i++)
            strset_add(&set, &tok->v.arr.strs[i]);
        for (uint64_t i = 0; i < mrg->v.arr.n; i++) {
            const struct gguf_str *m = &mrg->v.arr.strs[i];
            const char *sp = m->len > 1 ? memchr(m->p + 1, ' ', (size_t)m->len - 1) : NULL;
            if (!sp)
                continue;
            size_t na = (size_t)(sp - m->p), nb = (size_t)m->len - na - 1;
            if (strset_has2(&set, m->p, na, "", 0) && strset_has2(&set, sp + 1, nb, "", 0) &&
                strset_has2(&set, m->p, na, sp + 1, nb))
                merges[n_merges++] = *m;
        }
    } else if (rc != MOE_ENOTFOUND) {
        goto fail;
    }

    /* Everything under tokenizer.*, in the source order, with the cut arrays in place. */
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const struct gguf_kv *kv = &f->kv[i];
        if (strncmp(kv->key, "tokenizer.", 10))
            continue;
        if (!strcmp(kv->key, "tokenizer.ggml.tokens"))
            rc = gguf_writer_add_arr_str(w, kv->key, strs, n_new, err, errlen);
        else if (!strcmp(kv->key, "tokenizer.ggml.token_type"))
            rc = gguf_writer_add_arr(w, kv->key, GGUF_I32, types, n_new, err, errlen);
        else if (!strcmp(kv->key, "tokenizer.ggml.merges"))
            rc = gguf_writer_add_arr_str(w, kv->key, merges, n_merges, err, errlen);
        else if (is_token_id_key(kv->key) && kv->type != GGUF_ARRAY && kv->type != GGUF_STRING) {
            uint32_t id;
            if ((rc = gguf_get_u32(f, kv->key, &id, err, errlen)))
                goto fail;
            if (id >= n || remap[id] < 0) {
                fprintf(stderr, "mkmodel: dropping %s: token %u is not in the cut vocabulary\n",
                        kv->key, id);
                continue;
            }
            rc = gguf_writer_add_u32(w, kv->key, (uint32_t)remap[id], err, errlen);
        } else
            rc = gguf_writer_copy_kv(w, kv, NULL, err, errlen);
        if (rc)
            goto fail;
    }
    *n_vocab = (uint32_t)n_new;
    rc = 0;
fail:
    free(set.slot);
    free(merges);
    free(pads);
    free(remap);
    free(types);
    free(strs);
    return rc;
}

int mk_vocab_add(struct gguf_writer *w, const char *path, uint32_t n_regular, uint32_t *n_vocab,
                 char *err, size_t errlen)
{
    struct gguf_file *f = NULL;
    char sub[256];
    int rc = gguf_open(&f, path, sub, sizeof sub);
    if (rc)
        return moe_fail(err, errlen, rc, "vocabulary %s: %s", path, sub);
    const struct gguf_kv *tok;
    if ((rc = gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_STRING, &tok, sub, sizeof sub))) {
        rc = moe_fail(err, errlen, rc, "vocabulary %s: %s", path, sub);
        goto out;
    }
    if (tok->v.arr.n == 0 || tok->v.arr.n > INT32_MAX) {
        rc = moe_fail(err, errlen, MOE_ERANGE, "vocabulary %s: %llu tokens", path,
                      (unsigned long long)tok->v.arr.n);
        goto out;
    }
    if (n_regular) {
        rc = add_cut(w, f, n_regular, n_vocab, sub, sizeof sub);
        if (rc)
            rc = moe_fail(err, errlen, rc, "vocabulary %s: %s", path, sub);
        goto out;
    }
    for (uint64_t i = 0; i < f->n_kv; i++) {
        if (strncmp(f->kv[i].key, "tokenizer.", 10))
            continue;
        if ((rc = gguf_writer_copy_kv(w, &f->kv[i], NULL, sub, sizeof sub))) {
            rc = moe_fail(err, errlen, rc, "vocabulary %s: %s", path, sub);
            goto out;
        }
    }
    *n_vocab = (uint32_t)tok->v.arr.n;
out:
    gguf_close(f);
    return rc;
}
