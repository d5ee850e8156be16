/* GGUF v2/v3 reader.
 *
 * The whole file is parsed once at open time through a bounds-checked cursor: every read first
 * checks the bytes that remain, every count is compared with what the remaining bytes could hold
 * before anything is allocated for it, and every size is computed with overflow checks. After a
 * successful open, all fields in struct gguf_file can be trusted by callers without re-checking:
 * tensor data lies inside the file, tensors do not overlap, names and keys are unique.
 *
 * Decisions where the format leaves room (documented in docs/gguf.md):
 *  - ne[i] == 0 is accepted (ggml accepts it; the tensor has no data); ne[i] < 0 is rejected.
 *  - BOOL values (scalars and array elements) must be 0 or 1.
 *  - Keys and tensor names must be non-empty and may not contain NUL bytes (they would be
 *    ambiguous once copied into C strings).
 *  - Tensors may appear in any order in the data section but must not overlap.
 *  - general.alignment must be a U32, nonzero, a power of two. */
#include "store/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "store/err.h"
#include "store/ggml_type.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32

/* Smallest encodings, used to reject counts that the remaining bytes cannot possibly hold. */
#define MIN_KV_BYTES 13      /* u64 key length + i32 type + 1-byte value */
#define MIN_TENSOR_BYTES 32  /* u64 name length + u32 n_dims + one i64 ne + i32 type + u64 offset */
#define MIN_STRING_BYTES 8   /* u64 length, empty body */

/* Open-addressing hash table from a name to an index; slots hold index + 1 (0 = empty). */
struct name_table {
    uint64_t cap;      /* power of two */
    uint64_t *hash;
    uint64_t *slot;
};

struct gguf_index {
    struct name_table kv;
    struct name_table tensors;
    uint64_t fingerprint;
};

struct cursor {
    const uint8_t *base;
    uint64_t size;
    uint64_t pos;
    char *err;
    size_t errlen;
};

/* ---- bounds-checked reads ---------------------------------------------------------------- */

static int need(struct cursor *c, uint64_t n, const char *what)
{
    if (n > c->size - c->pos)
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "%s at byte %" PRIu64 ": needs %" PRIu64 " bytes, only %" PRIu64
                        " left (file is %" PRIu64 " bytes, truncated?)",
                        what, c->pos, n, c->size - c->pos, c->size);
    return 0;
}

static int rd(struct cursor *c, void *out, uint64_t n, const char *what)
{
    int rc = need(c, n, what);
    if (rc)
        return rc;
    memcpy(out, c->base + c->pos, n);
    c->pos += n;
    return 0;
}

/* GGUF is little-endian; so is every machine moed targets, so the memcpy above is the decode. */
static int rd_u32(struct cursor *c, uint32_t *v, const char *what) { return rd(c, v, 4, what); }
static int rd_u64(struct cursor *c, uint64_t *v, const char *what) { return rd(c, v, 8, what); }

/* Reads a GGUF string (u64 length + bytes) without copying it. */
static int rd_str(struct cursor *c, struct gguf_str *s, const char *what)
{
    uint64_t start = c->pos, len;
    int rc = rd_u64(c, &len, what);
    if (rc)
        return rc;
    if (len > c->size - c->pos)
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "%s at byte %" PRIu64 ": string length %" PRIu64
                        " exceeds the %" PRIu64 " bytes left in the file",
                        what, start, len, c->size - c->pos);
    s->p = (const char *)c->base + c->pos;
    s->len = len;
    c->pos += len;
    return 0;
}

/* ---- value types ------------------------------------------------------------------------- */

static const char *const vtype_names[] = {
    [GGUF_U8] = "u8",   [GGUF_I8] = "i8",     [GGUF_U16] = "u16",   [GGUF_I16] = "i16",
    [GGUF_U32] = "u32", [GGUF_I32] = "i32",   [GGUF_F32] = "f32",   [GGUF_BOOL] = "bool",
    [GGUF_STRING] = "string", [GGUF_ARRAY] = "array", [GGUF_U64] = "u64", [GGUF_I64] = "i64",
    [GGUF_F64] = "f64",
};

const char *gguf_vtype_name(uint32_t t)
{
    return t < sizeof vtype_names / sizeof vtype_names[0] ? vtype_names[t] : "?";
}

uint32_t gguf_vtype_size(uint32_t t)
{
    switch (t) {
    case GGUF_U8: case GGUF_I8: case GGUF_BOOL: return 1;
    case GGUF_U16: case GGUF_I16: return 2;
    case GGUF_U32: case GGUF_I32: case GGUF_F32: return 4;
    case GGUF_U64: case GGUF_I64: case GGUF_F64: return 8;
    default: return 0;
    }
}

static bool vtype_is_signed(uint32_t t)
{
    return t == GGUF_I8 || t == GGUF_I16 || t == GGUF_I32 || t == GGUF_I64;
}

static bool vtype_is_unsigned(uint32_t t)
{
    return t == GGUF_U8 || t == GGUF_U16 || t == GGUF_U32 || t == GGUF_U64;
}

/* Decodes one fixed-size element at p into the kv union's scalar fields. */
static void decode_scalar(uint32_t t, const uint8_t *p, struct gguf_kv *kv)
{
    uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32;
    uint64_t u64; int64_t i64; float f32; double f64;
    switch (t) {
    case GGUF_U8: case GGUF_BOOL: memcpy(&u8, p, 1); kv->v.u64 = u8; break;
    case GGUF_I8: memcpy(&i8, p, 1); kv->v.i64 = i8; break;
    case GGUF_U16: memcpy(&u16, p, 2); kv->v.u64 = u16; break;
    case GGUF_I16: memcpy(&i16, p, 2); kv->v.i64 = i16; break;
    case GGUF_U32: memcpy(&u32, p, 4); kv->v.u64 = u32; break;
    case GGUF_I32: memcpy(&i32, p, 4); kv->v.i64 = i32; break;
    case GGUF_U64: memcpy(&u64, p, 8); kv->v.u64 = u64; break;
    case GGUF_I64: memcpy(&i64, p, 8); kv->v.i64 = i64; break;
    case GGUF_F32: memcpy(&f32, p, 4); kv->v.f64 = f32; break;
    case GGUF_F64: memcpy(&f64, p, 8); kv->v.f64 = f64; break;
    default: MOE_ASSERT(!"not a scalar type");
    }
}

/* ---- name tables ------------------------------------------------------------------------- */

static int table_init(struct name_table *t, uint64_t n)
{
    uint64_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    t->cap = cap;
    t->hash = calloc(cap, sizeof *t->hash);
    t->slot = calloc(cap, sizeof *t->slot);
    if (!t->hash || !t->slot)
        return -ENOMEM;
    return 0;
}

static void table_free(struct name_table *t)
{
    free(t->hash);
    free(t->slot);
}

/* Returns the slot holding `name`, or the empty slot where it would go. name_of(i) gives the
 * name of entry i. */
typedef const char *(*name_of_fn)(const void *ctx, uint64_t i);

static uint64_t table_probe(const struct name_table *t, const char *name, size_t len, uint64_t h,
                            name_of_fn name_of, const void *ctx)
{
    uint64_t mask = t->cap - 1, i = h & mask;
    for (;;) {
        if (t->slot[i] == 0)
            return i;
        if (t->hash[i] == h) {
            const char *other = name_of(ctx, t->slot[i] - 1);
            if (strlen(other) == len && memcmp(other, name, len) == 0)
                return i;
        }
        i = (i + 1) & mask;
    }
}

static const char *kv_name(const void *ctx, uint64_t i)
{
    return ((const struct gguf_file *)ctx)->kv[i].key;
}

static const char *tensor_name(const void *ctx, uint64_t i)
{
    return ((const struct gguf_file *)ctx)->tensors[i].name;
}

/* ---- parsing ----------------------------------------------------------------------------- */

/* Appends to a growing array so that memory follows what was actually parsed, not what a
 * (possibly forged) count promises. */
static int grow(void **arr, uint64_t *cap, uint64_t need_n, size_t elem)
{
    if (need_n <= *cap)
        return 0;
    uint64_t ncap = *cap ? *cap * 2 : 64;
    while (ncap < need_n)
        ncap *= 2;
    void *p = realloc(*arr, ncap * elem);
    if (!p)
        return -ENOMEM;
    memset((char *)p + *cap * elem, 0, (ncap - *cap) * elem);
    *arr = p;
    *cap = ncap;
    return 0;
}

static int check_name_bytes(struct cursor *c, const struct gguf_str *s, uint64_t at,
                            const char *what)
{
    if (s->len == 0)
        return moe_fail(c->err, c->errlen, MOE_EFORMAT, "%s at byte %" PRIu64 " is empty", what, at);
    if (memchr(s->p, '\0', s->len))
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "%s at byte %" PRIu64 " contains a NUL byte", what, at);
    return 0;
}

static int parse_value(struct cursor *c, struct gguf_kv *kv)
{
    int rc;
    char what[192];
    if (kv->type == GGUF_STRING) {
        snprintf(what, sizeof what, "value of key '%s'", kv->key);
        return rd_str(c, &kv->v.str, what);
    }
    if (kv->type == GGUF_ARRAY) {
        uint64_t at = c->pos;
        uint32_t et;
        uint64_t n;
        snprintf(what, sizeof what, "array type of key '%s'", kv->key);
        if ((rc = rd_u32(c, &et, what)))
            return rc;
        snprintf(what, sizeof what, "array count of key '%s'", kv->key);
        if ((rc = rd_u64(c, &n, what)))
            return rc;
        if (et == GGUF_ARRAY)
            return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                            "key '%s' at byte %" PRIu64 ": nested arrays are not allowed",
                            kv->key, at);
        if (et != GGUF_STRING && gguf_vtype_size(et) == 0)
            return moe_fail(c->err, c->errlen, MOE_EUNSUPPORTED,
                            "key '%s' at byte %" PRIu64 ": unknown array element type %" PRIu32,
                            kv->key, at, et);
        uint64_t left = c->size - c->pos;
        uint64_t minsz = et == GGUF_STRING ? MIN_STRING_BYTES : gguf_vtype_size(et);
        if (n > left / minsz)
            return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                            "key '%s' array count at byte %" PRIu64 ": %" PRIu64 " elements of %s"
                            " need at least %" PRIu64 " bytes each, only %" PRIu64 " bytes left",
                            kv->key, at + 4, n, gguf_vtype_name(et), minsz, left);
        kv->v.arr.type = et;
        kv->v.arr.n = n;
        kv->v.arr.data = c->base + c->pos;
        if (et == GGUF_STRING) {
            /* n is bounded by left/8 above, so this allocation is at most twice the file size. */
            kv->v.arr.strs = n ? malloc(n * sizeof *kv->v.arr.strs) : NULL;
            if (n && !kv->v.arr.strs)
                return moe_fail(c->err, c->errlen, -ENOMEM, "key '%s': out of memory for %" PRIu64
                                " strings", kv->key, n);
            for (uint64_t i = 0; i < n; i++) {
                /* The element's label is formatted only on failure: a vocabulary has 150k
                 * strings, and formatting each label cost more than parsing the file. A failed
                 * read leaves nothing behind, so it is simply read again with the full label. */
                uint64_t at_i = c->pos;
                if (rd_str(c, &kv->v.arr.strs[i], "array element") == 0)
                    continue;
                snprintf(what, sizeof what, "element %" PRIu64 " of key '%s'", i, kv->key);
                c->pos = at_i;
                rc = rd_str(c, &kv->v.arr.strs[i], what);
                return rc ? rc : MOE_EINTERNAL;
            }
            return 0;
        }
        const uint8_t *p = c->base + c->pos;
        if (et == GGUF_BOOL)
            for (uint64_t i = 0; i < n; i++)
                if (p[i] > 1)
                    return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                                    "key '%s' element %" PRIu64 " at byte %" PRIu64
                                    ": bool value %u is not 0 or 1",
                                    kv->key, i, c->pos + i, p[i]);
        c->pos += n * gguf_vtype_size(et);
        return 0;
    }
    uint32_t sz = gguf_vtype_size(kv->type);
    if (sz == 0)
        return moe_fail(c->err, c->errlen, MOE_EUNSUPPORTED,
                        "key '%s' at byte %" PRIu64 ": unknown value type %" PRIu32, kv->key,
                        kv->offset, kv->type);
    snprintf(what, sizeof what, "value of key '%s'", kv->key);
    if ((rc = need(c, sz, what)))
        return rc;
    if (kv->type == GGUF_BOOL && c->base[c->pos] > 1)
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "key '%s' at byte %" PRIu64 ": bool value %u is not 0 or 1", kv->key,
                        c->pos, c->base[c->pos]);
    decode_scalar(kv->type, c->base + c->pos, kv);
    c->pos += sz;
    return 0;
}

static int parse_kvs(struct cursor *c, struct gguf_file *f, uint64_t n_kv, struct gguf_index *ix)
{
    int rc;
    uint64_t cap = 0;
    for (uint64_t i = 0; i < n_kv; i++) {
        if ((rc = grow((void **)&f->kv, &cap, i + 1, sizeof *f->kv)))
            return moe_fail(c->err, c->errlen, rc, "out of memory at key %" PRIu64, i);
        struct gguf_kv *kv = &f->kv[i];
        struct gguf_str key;
        char what[192];
        uint64_t at = c->pos;
        snprintf(what, sizeof what, "key %" PRIu64, i);
        if ((rc = rd_str(c, &key, what)))
            return rc;
        if ((rc = check_name_bytes(c, &key, at, what)))
            return rc;
        kv->key = malloc(key.len + 1);
        if (!kv->key)
            return moe_fail(c->err, c->errlen, -ENOMEM, "out of memory at key %" PRIu64, i);
        memcpy(kv->key, key.p, key.len);
        kv->key[key.len] = '\0';
        kv->offset = at;
        f->n_kv = i + 1; /* from here on gguf_close frees this key */

        int32_t type;
        snprintf(what, sizeof what, "type of key '%.40s'", kv->key);
        if ((rc = rd(c, &type, 4, what)))
            return rc;
        kv->type = (uint32_t)type;
        if ((rc = parse_value(c, kv)))
            return rc;
    }
    /* The table is built once the keys exist, so that its size follows the keys actually
     * present rather than a count from the header. */
    if ((rc = table_init(&ix->kv, f->n_kv)))
        return moe_fail(c->err, c->errlen, rc, "out of memory for %" PRIu64 " keys", f->n_kv);
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const char *key = f->kv[i].key;
        size_t len = strlen(key);
        uint64_t h = XXH3_64bits(key, len);
        uint64_t s = table_probe(&ix->kv, key, len, h, kv_name, f);
        if (ix->kv.slot[s])
            return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                            "duplicate key '%s' at byte %" PRIu64 " (first at byte %" PRIu64 ")",
                            key, f->kv[i].offset, f->kv[ix->kv.slot[s] - 1].offset);
        ix->kv.hash[s] = h;
        ix->kv.slot[s] = i + 1;
    }
    return 0;
}

static int parse_alignment(struct cursor *c, struct gguf_file *f)
{
    const struct gguf_kv *kv = gguf_find_kv(f, "general.alignment");
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    if (!kv)
        return 0;
    if (kv->type != GGUF_U32)
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "key 'general.alignment' at byte %" PRIu64 ": type %s, must be u32",
                        kv->offset, gguf_vtype_name(kv->type));
    if (kv->v.u64 == 0 || (kv->v.u64 & (kv->v.u64 - 1)))
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "key 'general.alignment' at byte %" PRIu64 ": %" PRIu64
                        " is not a nonzero power of two", kv->offset, kv->v.u64);
    f->alignment = (uint32_t)kv->v.u64;
    return 0;
}

static int parse_tensor_info(struct cursor *c, struct gguf_tensor *t, uint64_t i)
{
    int rc;
    char what[192];
    struct gguf_str name;
    uint64_t at = c->pos;
    snprintf(what, sizeof what, "tensor %" PRIu64 " name", i);
    if ((rc = rd_str(c, &name, what)))
        return rc;
    if ((rc = check_name_bytes(c, &name, at, what)))
        return rc;
    if (name.len >= GGUF_NAME_MAX)
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "tensor %" PRIu64 " name at byte %" PRIu64 ": length %" PRIu64
                        " is not below the limit of %d bytes ('%.40s...')",
                        i, at, name.len, GGUF_NAME_MAX, name.p);
    memcpy(t->name, name.p, name.len);
    t->name[name.len] = '\0';

    uint32_t n_dims;
    at = c->pos;
    snprintf(what, sizeof what, "tensor %" PRIu64 " (%s) n_dims", i, t->name);
    if ((rc = rd_u32(c, &n_dims, what)))
        return rc;
    if (n_dims == 0 || n_dims > GGUF_MAX_DIMS)
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "tensor %" PRIu64 " (%s) n_dims at byte %" PRIu64 ": %" PRIu32
                        " is not in 1..%d", i, t->name, at, n_dims, GGUF_MAX_DIMS);
    t->n_dims = n_dims;
    int64_t nelem = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d >= n_dims)
            continue;
        at = c->pos;
        snprintf(what, sizeof what, "tensor %" PRIu64 " (%s) ne[%" PRIu32 "]", i, t->name, d);
        if ((rc = rd(c, &t->ne[d], 8, what)))
            return rc;
        if (t->ne[d] < 0)
            return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                            "%s at byte %" PRIu64 ": %" PRId64 " is negative", what, at, t->ne[d]);
        if (__builtin_mul_overflow(nelem, t->ne[d], &nelem))
            return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                            "tensor %" PRIu64 " (%s) at byte %" PRIu64
                            ": element count overflows int64", i, t->name, at);
    }

    uint32_t type;
    at = c->pos;
    snprintf(what, sizeof what, "tensor %" PRIu64 " (%s) type", i, t->name);
    if ((rc = rd_u32(c, &type, what)))
        return rc;
    const struct moe_type_info *ti = moe_type_get(type);
    if (!ti)
        return moe_fail(c->err, c->errlen, MOE_EUNSUPPORTED,
                        "tensor %" PRIu64 " (%s) type at byte %" PRIu64
                        ": unknown ggml type %" PRIu32, i, t->name, at, type);
    t->type = type;
    if (t->ne[0] % ti->blck != 0)
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "tensor %" PRIu64 " (%s) ne[0] = %" PRId64
                        " is not a multiple of the %s block size %" PRIu32,
                        i, t->name, t->ne[0], ti->name, ti->blck);
    /* nbytes = row bytes * rows; the row count is nelem / ne0 (or 0 when the tensor is empty). */
    uint64_t rows = t->ne[0] ? (uint64_t)nelem / (uint64_t)t->ne[0] : 0;
    uint64_t row_bytes = (uint64_t)(t->ne[0] / ti->blck) * ti->size;
    if (__builtin_mul_overflow(rows, row_bytes, &t->nbytes))
        return moe_fail(c->err, c->errlen, MOE_EFORMAT,
                        "tensor %" PRIu64 " (%s): byte size overflows", i, t->name);

    snprintf(what, sizeof what, "tensor %" PRIu64 " (%s) offset", i, t->name);
    return rd_u64(c, &t->offset, what);
}

struct span {
    uint64_t off, end, i;
};

static int cmp_span(const void *a, const void *b)
{
    const struct span *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off ? 1 : (x->i > y->i) - (x->i < y->i);
}

/* Places tensor data: alignment, bounds and overlap. */
static int check_layout(struct cursor *c, struct gguf_file *f)
{
    int rc = 0;
    if (f->n_tensors == 0)
        return 0;
    uint64_t avail = f->data_offset <= f->size ? f->size - f->data_offset : 0;
    struct span *sp = malloc(f->n_tensors * sizeof *sp);
    if (!sp)
        return moe_fail(c->err, c->errlen, -ENOMEM, "out of memory");
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_tensor *t = &f->tensors[i];
        if (t->offset % f->alignment != 0) {
            rc = moe_fail(c->err, c->errlen, MOE_EFORMAT,
                          "tensor %" PRIu64 " (%s): offset %" PRIu64
                          " is not a multiple of the alignment %" PRIu32,
                          i, t->name, t->offset, f->alignment);
            goto out;
        }
        if (t->offset > avail || t->nbytes > avail - t->offset) {
            rc = moe_fail(c->err, c->errlen, MOE_EFORMAT,
                          "tensor %" PRIu64 " (%s): data [%" PRIu64 ", +%" PRIu64
                          ") at file offset %" PRIu64 " ends past the end of the file (%" PRIu64
                          " bytes)", i, t->name, t->offset, t->nbytes, f->data_offset, f->size);
            goto out;
        }
        /* An empty tensor in a file whose data section would start past its end (possible only
         * when every tensor is empty) gets the end of the file as its address. */
        t->data = f->base + (f->data_offset <= f->size ? f->data_offset + t->offset : f->size);
        sp[i] = (struct span){t->offset, t->offset + t->nbytes, i};
    }
    qsort(sp, f->n_tensors, sizeof *sp, cmp_span);
    for (uint64_t k = 1; k < f->n_tensors; k++) {
        /* Empty tensors occupy no bytes and cannot overlap anything. */
        if (sp[k].off == sp[k].end)
            continue;
        uint64_t j = k;
        while (j > 0 && sp[j - 1].off == sp[j - 1].end)
            j--;
        if (j > 0 && sp[k].off < sp[j - 1].end) {
            const struct gguf_tensor *a = &f->tensors[sp[j - 1].i], *b = &f->tensors[sp[k].i];
            rc = moe_fail(c->err, c->errlen, MOE_EFORMAT,
                          "tensor %" PRIu64 " (%s): data [%" PRIu64 ", %" PRIu64
                          ") overlaps tensor %" PRIu64 " (%s) at [%" PRIu64 ", %" PRIu64 ")",
                          sp[k].i, b->name, sp[k].off, sp[k].end, sp[j - 1].i, a->name,
                          sp[j - 1].off, sp[j - 1].end);
            goto out;
        }
    }
out:
    free(sp);
    return rc;
}

static int parse(struct gguf_file *f, char *err, size_t errlen)
{
    struct cursor c = {f->base, f->size, 0, err, errlen};
    int rc;
    char magic[4];
    if ((rc = rd(&c, magic, 4, "magic")))
        return rc;
    if (memcmp(magic, GGUF_MAGIC, 4) != 0)
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "magic at byte 0: %02x %02x %02x %02x is not \"GGUF\" (not a GGUF file)",
                        (uint8_t)magic[0], (uint8_t)magic[1], (uint8_t)magic[2], (uint8_t)magic[3]);
    if ((rc = rd_u32(&c, &f->version, "version")))
        return rc;
    if (f->version == 1)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "version at byte 4: GGUF v1 is not supported (re-convert the model)");
    if (f->version != 2 && f->version != 3) {
        if ((f->version & 0xffff) == 0)
            return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                            "version at byte 4: 0x%08" PRIx32 " looks like a big-endian GGUF, "
                            "which is not supported", f->version);
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "version at byte 4: GGUF v%" PRIu32 " is not supported (2 and 3 are)",
                        f->version);
    }
    uint64_t n_tensors, n_kv;
    if ((rc = rd_u64(&c, &n_tensors, "n_tensors")) || (rc = rd_u64(&c, &n_kv, "n_kv")))
        return rc;
    uint64_t left = c.size - c.pos;
    if (n_kv > left / MIN_KV_BYTES)
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "n_kv at byte 16: %" PRIu64 " key-value pairs cannot fit in the %" PRIu64
                        " bytes left", n_kv, left);
    if (n_tensors > left / MIN_TENSOR_BYTES)
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "n_tensors at byte 8: %" PRIu64 " tensor infos cannot fit in the %" PRIu64
                        " bytes left", n_tensors, left);

    struct gguf_index *ix = f->index;
    if ((rc = parse_kvs(&c, f, n_kv, ix)))
        return rc;
    if ((rc = parse_alignment(&c, f)))
        return rc;

    /* Where each tensor info starts, kept only for messages about duplicates. */
    uint64_t cap = 0, at_cap = 0, *info_at = NULL;
    for (uint64_t i = 0; i < n_tensors; i++) {
        if ((rc = grow((void **)&f->tensors, &cap, i + 1, sizeof *f->tensors)) ||
            (rc = grow((void **)&info_at, &at_cap, i + 1, sizeof *info_at))) {
            rc = moe_fail(err, errlen, rc, "out of memory at tensor %" PRIu64, i);
            goto out;
        }
        info_at[i] = c.pos;
        if ((rc = parse_tensor_info(&c, &f->tensors[i], i)))
            goto out;
        f->n_tensors = i + 1;
    }
    if ((rc = table_init(&ix->tensors, f->n_tensors))) {
        rc = moe_fail(err, errlen, rc, "out of memory for %" PRIu64 " tensors", n_tensors);
        goto out;
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const char *name = f->tensors[i].name;
        size_t len = strlen(name);
        uint64_t h = XXH3_64bits(name, len);
        uint64_t s = table_probe(&ix->tensors, name, len, h, tensor_name, f);
        if (ix->tensors.slot[s]) {
            rc = moe_fail(err, errlen, MOE_EFORMAT,
                          "tensor %" PRIu64 " at byte %" PRIu64 ": duplicate tensor name '%s' "
                          "(first is tensor %" PRIu64 ")", i, info_at[i], name,
                          ix->tensors.slot[s] - 1);
            goto out;
        }
        ix->tensors.hash[s] = h;
        ix->tensors.slot[s] = i + 1;
    }
    free(info_at);
    info_at = NULL;
    uint64_t info_end = c.pos;
    /* The data section starts at the next multiple of the alignment (it may lie past the end of
     * a file without tensors: vocab-only files end right after the metadata). */
    f->data_offset = info_end + (f->alignment - info_end % f->alignment) % f->alignment;
    if ((rc = check_layout(&c, f)))
        return rc;

    /* The fingerprint covers the counts, the KVs and the tensor table as stored (bytes 8 up to
     * the end of the tensor infos): every key, type, value, name, shape, type and offset. The
     * version is left out so that re-saving a v2 file as v3 keeps its profile. */
    ix->fingerprint = XXH3_64bits(f->base + 8, info_end - 8);
    return 0;
out:
    free(info_at);
    return rc;
}

static int open_common(struct gguf_file **out, struct gguf_file *f, char *err, size_t errlen)
{
    int rc;
    if (err && errlen)
        err[0] = '\0';
    f->index = calloc(1, sizeof(struct gguf_index));
    if (!f->index) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    if ((rc = parse(f, err, errlen)))
        goto fail;
    *out = f;
    return 0;
fail:
    gguf_close(f);
    return rc;
}

int gguf_open_mem(struct gguf_file **out, const void *data, size_t size, char *err, size_t errlen)
{
    struct gguf_file *f = calloc(1, sizeof *f);
    if (!f)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    f->base = data;
    f->size = size;
    f->mapped = 0;
    return open_common(out, f, err, errlen);
}

int gguf_open(struct gguf_file **out, const char *path, char *err, size_t errlen)
{
    int rc, fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = -errno;
        return moe_fail(err, errlen, rc, "%s: %s", path, strerror(-rc));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = -errno;
        close(fd);
        return moe_fail(err, errlen, rc, "%s: %s", path, strerror(-rc));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return moe_fail(err, errlen, MOE_EFORMAT, "%s: not a regular file", path);
    }
    if (st.st_size < 24) {
        close(fd);
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "%s: %lld bytes is too short for a GGUF header (24 bytes)", path,
                        (long long)st.st_size);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    rc = -errno;
    close(fd);
    if (p == MAP_FAILED)
        return moe_fail(err, errlen, rc, "%s: mmap: %s", path, strerror(-rc));
    struct gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        munmap(p, (size_t)st.st_size);
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    }
    f->base = p;
    f->size = (uint64_t)st.st_size;
    f->mapped = 1;
    rc = open_common(out, f, err, errlen);
    if (rc && err && errlen) {
        /* Prefix the path so that messages from the parser say which file. */
        char tmp[512];
        snprintf(tmp, sizeof tmp, "%s", err);
        snprintf(err, errlen, "%s: %s", path, tmp);
    }
    return rc;
}

void gguf_close(struct gguf_file *f)
{
    if (!f)
        return;
    for (uint64_t i = 0; i < f->n_kv; i++) {
        free(f->kv[i].key);
        if (f->kv[i].type == GGUF_ARRAY)
            free(f->kv[i].v.arr.strs);
    }
    free(f->kv);
    free(f->tensors);
    struct gguf_index *ix = f->index;
    if (ix) {
        table_free(&ix->kv);
        table_free(&ix->tensors);
        free(ix);
    }
    if (f->mapped)
        munmap((void *)f->base, f->size);
    free(f);
}

/* ---- lookups ----------------------------------------------------------------------------- */

const struct gguf_kv *gguf_find_kv(const struct gguf_file *f, const char *key)
{
    const struct gguf_index *ix = f->index;
    if (!ix->kv.cap)
        return NULL;
    size_t len = strlen(key);
    uint64_t s = table_probe(&ix->kv, key, len, XXH3_64bits(key, len), kv_name, f);
    return ix->kv.slot[s] ? &f->kv[ix->kv.slot[s] - 1] : NULL;
}

const struct gguf_tensor *gguf_find_tensor(const struct gguf_file *f, const char *name)
{
    const struct gguf_index *ix = f->index;
    if (!ix->tensors.cap)
        return NULL;
    size_t len = strlen(name);
    uint64_t s = table_probe(&ix->tensors, name, len, XXH3_64bits(name, len), tensor_name, f);
    return ix->tensors.slot[s] ? &f->tensors[ix->tensors.slot[s] - 1] : NULL;
}

uint64_t gguf_fingerprint(const struct gguf_file *f)
{
    return ((const struct gguf_index *)f->index)->fingerprint;
}

/* ---- typed getters ----------------------------------------------------------------------- */

static int find_typed(const struct gguf_file *f, const char *key, const struct gguf_kv **kv,
                      char *err, size_t errlen)
{
    *kv = gguf_find_kv(f, key);
    if (!*kv)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "key '%s' not found", key);
    return 0;
}

static int wrong_type(const struct gguf_kv *kv, const char *want, char *err, size_t errlen)
{
    return moe_fail(err, errlen, MOE_ETYPE, "key '%s' at byte %" PRIu64 ": expected %s, found %s",
                    kv->key, kv->offset, want, gguf_vtype_name(kv->type));
}

/* Reads any integer KV as a (negative flag, magnitude) pair so that range checks are exact, and
 * checks it against the target type's range: -max_neg ..= max_pos, named `want` in messages. */
static int get_int(const struct gguf_file *f, const char *key, const char *want, uint64_t max_pos,
                   uint64_t max_neg, bool *neg, uint64_t *mag, char *err, size_t errlen)
{
    const struct gguf_kv *kv;
    int rc = find_typed(f, key, &kv, err, errlen);
    if (rc)
        return rc;
    if (vtype_is_unsigned(kv->type)) {
        *neg = false;
        *mag = kv->v.u64;
    } else if (vtype_is_signed(kv->type)) {
        *neg = kv->v.i64 < 0;
        *mag = *neg ? (uint64_t)0 - (uint64_t)kv->v.i64 : (uint64_t)kv->v.i64;
    } else {
        return wrong_type(kv, "an integer", err, errlen);
    }
    if (*neg ? *mag > max_neg : *mag > max_pos)
        return moe_fail(err, errlen, MOE_ERANGE, "key '%s' at byte %" PRIu64 ": %s%" PRIu64
                        " does not fit %s", kv->key, kv->offset, *neg ? "-" : "", *mag, want);
    return 0;
}

int gguf_get_u32(const struct gguf_file *f, const char *key, uint32_t *out, char *err, size_t errlen)
{
    bool neg;
    uint64_t mag;
    int rc = get_int(f, key, "u32", UINT32_MAX, 0, &neg, &mag, err, errlen);
    if (!rc)
        *out = (uint32_t)mag;
    return rc;
}

int gguf_get_u64(const struct gguf_file *f, const char *key, uint64_t *out, char *err, size_t errlen)
{
    bool neg;
    uint64_t mag;
    int rc = get_int(f, key, "u64", UINT64_MAX, 0, &neg, &mag, err, errlen);
    if (!rc)
        *out = mag;
    return rc;
}

int gguf_get_i64(const struct gguf_file *f, const char *key, int64_t *out, char *err, size_t errlen)
{
    bool neg;
    uint64_t mag;
    int rc = get_int(f, key, "i64", INT64_MAX, (uint64_t)INT64_MAX + 1, &neg, &mag, err, errlen);
    if (!rc)
        *out = neg ? (int64_t)(0 - mag) : (int64_t)mag;
    return rc;
}

int gguf_get_f32(const struct gguf_file *f, const char *key, float *out, char *err, size_t errlen)
{
    const struct gguf_kv *kv;
    int rc = find_typed(f, key, &kv, err, errlen);
    if (rc)
        return rc;
    if (kv->type != GGUF_F32 && kv->type != GGUF_F64)
        return wrong_type(kv, "f32 or f64", err, errlen);
    double v = kv->v.f64;
    if (isfinite(v) && (v > 3.4028234663852886e38 || v < -3.4028234663852886e38))
        return moe_fail(err, errlen, MOE_ERANGE, "key '%s' at byte %" PRIu64 ": %g does not fit f32",
                        kv->key, kv->offset, v);
    *out = (float)v;
    return 0;
}

int gguf_get_bool(const struct gguf_file *f, const char *key, bool *out, char *err, size_t errlen)
{
    const struct gguf_kv *kv;
    int rc = find_typed(f, key, &kv, err, errlen);
    if (rc)
        return rc;
    if (kv->type != GGUF_BOOL)
        return wrong_type(kv, "bool", err, errlen);
    *out = kv->v.u64 != 0;
    return 0;
}

int gguf_get_str(const struct gguf_file *f, const char *key, struct gguf_str *out, char *err,
                 size_t errlen)
{
    const struct gguf_kv *kv;
    int rc = find_typed(f, key, &kv, err, errlen);
    if (rc)
        return rc;
    if (kv->type != GGUF_STRING)
        return wrong_type(kv, "string", err, errlen);
    *out = kv->v.str;
    return 0;
}

int gguf_get_arr(const struct gguf_file *f, const char *key, uint32_t elem_type,
                 const struct gguf_kv **out, char *err, size_t errlen)
{
    const struct gguf_kv *kv;
    int rc = find_typed(f, key, &kv, err, errlen);
    if (rc)
        return rc;
    if (kv->type != GGUF_ARRAY)
        return moe_fail(err, errlen, MOE_ETYPE, "key '%s' at byte %" PRIu64
                        ": expected array of %s, found %s", kv->key, kv->offset,
                        gguf_vtype_name(elem_type), gguf_vtype_name(kv->type));
    if (kv->v.arr.type != elem_type)
        return moe_fail(err, errlen, MOE_ETYPE, "key '%s' at byte %" PRIu64
                        ": expected array of %s, found array of %s", kv->key, kv->offset,
                        gguf_vtype_name(elem_type), gguf_vtype_name(kv->v.arr.type));
    *out = kv;
    return 0;
}

int64_t gguf_arr_i64(const struct gguf_kv *kv, uint64_t i)
{
    MOE_ASSERT(kv->type == GGUF_ARRAY && i < kv->v.arr.n);
    uint32_t t = kv->v.arr.type;
    MOE_ASSERT(vtype_is_signed(t) || vtype_is_unsigned(t) || t == GGUF_BOOL);
    struct gguf_kv tmp;
    decode_scalar(t, (const uint8_t *)kv->v.arr.data + i * gguf_vtype_size(t), &tmp);
    /* u64 values above INT64_MAX wrap; callers needing them read the array as u64 data. */
    return vtype_is_signed(t) ? tmp.v.i64 : (int64_t)tmp.v.u64;
}

double gguf_arr_f64(const struct gguf_kv *kv, uint64_t i)
{
    MOE_ASSERT(kv->type == GGUF_ARRAY && i < kv->v.arr.n);
    uint32_t t = kv->v.arr.type;
    MOE_ASSERT(t != GGUF_STRING && t != GGUF_ARRAY);
    struct gguf_kv tmp;
    decode_scalar(t, (const uint8_t *)kv->v.arr.data + i * gguf_vtype_size(t), &tmp);
    if (t == GGUF_F32 || t == GGUF_F64)
        return tmp.v.f64;
    return vtype_is_signed(t) ? (double)tmp.v.i64 : (double)tmp.v.u64;
}
