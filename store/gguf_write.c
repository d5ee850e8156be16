/* GGUF v3 writer: declarations in memory, one metadata write, then parallel pwrites of data. */
#include "store/gguf_write.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "store/err.h"
#include "store/ggml_type.h"

/* GGUF is little-endian and we serialize with memcpy of host values. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "gguf_write assumes a little-endian host");

#define GGUF_DEFAULT_ALIGNMENT 32

struct wkv {
    char *key;
    uint32_t type;  /* enum gguf_vtype of the KV itself */
    uint8_t *val;   /* the value exactly as serialized after the type field */
    size_t val_len;
};

struct wtensor {
    char name[GGUF_NAME_MAX];
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    uint32_t type;
    uint64_t nbytes;
    uint64_t offset; /* relative to the data section */
};

struct gguf_writer {
    struct wkv *kv;
    size_t n_kv, cap_kv;
    struct wtensor *t;
    uint64_t n_t, cap_t;
    uint64_t *hash;     /* open addressing over tensor names: index + 1, 0 = empty */
    uint64_t hash_cap;
    uint32_t alignment;
    bool laid_out;
    uint64_t meta_size; /* unpadded metadata bytes */
    uint64_t data_offset;
    uint64_t file_size;
    int fd;
};

int gguf_writer_new(struct gguf_writer **out)
{
    struct gguf_writer *w = calloc(1, sizeof *w);
    if (!w)
        return -ENOMEM;
    w->alignment = GGUF_DEFAULT_ALIGNMENT;
    w->fd = -1;
    *out = w;
    return 0;
}

void gguf_writer_free(struct gguf_writer *w)
{
    if (!w)
        return;
    if (w->fd >= 0)
        close(w->fd);
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].val);
    }
    free(w->kv);
    free(w->t);
    free(w->hash);
    free(w);
}

static struct wkv *find_kv(const struct gguf_writer *w, const char *key)
{
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kv[i].key, key))
            return &w->kv[i];
    return NULL;
}

bool gguf_writer_has_kv(const struct gguf_writer *w, const char *key)
{
    return find_kv(w, key) != NULL;
}

/* Takes ownership of val (freed on failure too). */
static int push_kv(struct gguf_writer *w, const char *key, uint32_t type, uint8_t *val,
                   size_t val_len, char *err, size_t errlen)
{
    int rc;
    if (w->laid_out) {
        rc = moe_fail(err, errlen, MOE_EINTERNAL, "KV '%s' added after layout", key);
        goto fail;
    }
    if (!key || !*key) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "empty KV key");
        goto fail;
    }
    if (find_kv(w, key)) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "duplicate KV key '%s'", key);
        goto fail;
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? 2 * w->cap_kv : 32;
        struct wkv *p = realloc(w->kv, cap * sizeof *p);
        if (!p) {
            rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
            goto fail;
        }
        w->kv = p;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (!k) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    w->kv[w->n_kv++] = (struct wkv){.key = k, .type = type, .val = val, .val_len = val_len};
    return 0;
fail:
    free(val);
    return rc;
}

int gguf_writer_add_scalar(struct gguf_writer *w, const char *key, uint32_t type, const void *val,
                           char *err, size_t errlen)
{
    size_t sz = gguf_vtype_size(type);
    if (!sz)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED, "KV '%s': type %u is not a scalar type",
                        key, type);
    if (type == GGUF_BOOL && *(const uint8_t *)val > 1)
        return moe_fail(err, errlen, MOE_ERANGE, "KV '%s': bool value %u", key,
                        *(const uint8_t *)val);
    uint8_t *v = malloc(sz);
    if (!v)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    memcpy(v, val, sz);
    return push_kv(w, key, type, v, sz, err, errlen);
}

int gguf_writer_add_u32(struct gguf_writer *w, const char *key, uint32_t v, char *err, size_t errlen)
{
    return gguf_writer_add_scalar(w, key, GGUF_U32, &v, err, errlen);
}

int gguf_writer_add_i32(struct gguf_writer *w, const char *key, int32_t v, char *err, size_t errlen)
{
    return gguf_writer_add_scalar(w, key, GGUF_I32, &v, err, errlen);
}

int gguf_writer_add_u64(struct gguf_writer *w, const char *key, uint64_t v, char *err, size_t errlen)
{
    return gguf_writer_add_scalar(w, key, GGUF_U64, &v, err, errlen);
}

int gguf_writer_add_f32(struct gguf_writer *w, const char *key, float v, char *err, size_t errlen)
{
    return gguf_writer_add_scalar(w, key, GGUF_F32, &v, err, errlen);
}

int gguf_writer_add_bool(struct gguf_writer *w, const char *key, bool v, char *err, size_t errlen)
{
    uint8_t b = v ? 1 : 0;
    return gguf_writer_add_scalar(w, key, GGUF_BOOL, &b, err, errlen);
}

int gguf_writer_add_str(struct gguf_writer *w, const char *key, const char *s, size_t len,
                        char *err, size_t errlen)
{
    uint8_t *v = malloc(8 + len);
    if (!v)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    uint64_t n = len;
    memcpy(v, &n, 8);
    if (len)
        memcpy(v + 8, s, len);
    return push_kv(w, key, GGUF_STRING, v, 8 + len, err, errlen);
}

int gguf_writer_add_arr(struct gguf_writer *w, const char *key, uint32_t elem_type,
                        const void *data, uint64_t n, char *err, size_t errlen)
{
    size_t esz = gguf_vtype_size(elem_type);
    if (!esz)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "KV '%s': array element type %u is not a numeric type", key, elem_type);
    if (n > (SIZE_MAX - 12) / esz)
        return moe_fail(err, errlen, MOE_ETOOBIG, "KV '%s': array of %llu elements is too big",
                        key, (unsigned long long)n);
    size_t len = 12 + (size_t)n * esz;
    uint8_t *v = malloc(len);
    if (!v)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    int32_t et = (int32_t)elem_type;
    memcpy(v, &et, 4);
    memcpy(v + 4, &n, 8);
    if (n)
        memcpy(v + 12, data, (size_t)n * esz);
    return push_kv(w, key, GGUF_ARRAY, v, len, err, errlen);
}

int gguf_writer_add_arr_str(struct gguf_writer *w, const char *key, const struct gguf_str *strs,
                            uint64_t n, char *err, size_t errlen)
{
    size_t len = 12;
    for (uint64_t i = 0; i < n; i++) {
        if (strs[i].len > SIZE_MAX - len - 8)
            return moe_fail(err, errlen, MOE_ETOOBIG, "KV '%s': string array is too big", key);
        len += 8 + (size_t)strs[i].len;
    }
    uint8_t *v = malloc(len);
    if (!v)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    int32_t et = GGUF_STRING;
    memcpy(v, &et, 4);
    memcpy(v + 4, &n, 8);
    uint8_t *p = v + 12;
    for (uint64_t i = 0; i < n; i++) {
        memcpy(p, &strs[i].len, 8);
        if (strs[i].len)
            memcpy(p + 8, strs[i].p, (size_t)strs[i].len);
        p += 8 + strs[i].len;
    }
    return push_kv(w, key, GGUF_ARRAY, v, len, err, errlen);
}

int gguf_writer_copy_kv(struct gguf_writer *w, const struct gguf_kv *kv, const char *key,
                        char *err, size_t errlen)
{
    const char *k = key ? key : kv->key;
    switch (kv->type) {
    case GGUF_STRING:
        return gguf_writer_add_str(w, k, kv->v.str.p, (size_t)kv->v.str.len, err, errlen);
    case GGUF_ARRAY:
        if (kv->v.arr.type == GGUF_STRING)
            return gguf_writer_add_arr_str(w, k, kv->v.arr.strs, kv->v.arr.n, err, errlen);
        return gguf_writer_add_arr(w, k, kv->v.arr.type, kv->v.arr.data, kv->v.arr.n, err, errlen);
    case GGUF_U8: case GGUF_U16: case GGUF_U32: case GGUF_U64: case GGUF_BOOL:
    case GGUF_I8: case GGUF_I16: case GGUF_I32: case GGUF_I64: {
        /* The reader widened the value; narrow it back (little-endian low bytes). */
        uint64_t u = kv->type == GGUF_I8 || kv->type == GGUF_I16 || kv->type == GGUF_I32 ||
                     kv->type == GGUF_I64 ? (uint64_t)kv->v.i64 : kv->v.u64;
        return gguf_writer_add_scalar(w, k, kv->type, &u, err, errlen);
    }
    case GGUF_F32: {
        float f = (float)kv->v.f64;
        return gguf_writer_add_scalar(w, k, GGUF_F32, &f, err, errlen);
    }
    case GGUF_F64:
        return gguf_writer_add_scalar(w, k, GGUF_F64, &kv->v.f64, err, errlen);
    default:
        return moe_fail(err, errlen, MOE_EUNSUPPORTED, "KV '%s': unknown type %u", k, kv->type);
    }
}

int gguf_writer_set_alignment(struct gguf_writer *w, uint32_t alignment, char *err, size_t errlen)
{
    if (alignment == 0 || (alignment & (alignment - 1)))
        return moe_fail(err, errlen, MOE_ERANGE, "alignment %u is not a power of two", alignment);
    if (w->laid_out)
        return moe_fail(err, errlen, MOE_EINTERNAL, "alignment set after layout");
    struct wkv *kv = find_kv(w, "general.alignment");
    if (kv) {
        if (kv->type != GGUF_U32)
            return moe_fail(err, errlen, MOE_ETYPE, "general.alignment was declared as %s",
                            gguf_vtype_name(kv->type));
        memcpy(kv->val, &alignment, 4);
    } else {
        int rc = gguf_writer_add_u32(w, "general.alignment", alignment, err, errlen);
        if (rc)
            return rc;
    }
    w->alignment = alignment;
    return 0;
}

static uint64_t name_hash(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* Finds the slot for name: either holding an equal name or empty. */
static uint64_t *hash_slot(const struct gguf_writer *w, const char *name)
{
    uint64_t mask = w->hash_cap - 1;
    for (uint64_t i = name_hash(name) & mask;; i = (i + 1) & mask) {
        uint64_t v = w->hash[i];
        if (!v || !strcmp(w->t[v - 1].name, name))
            return &w->hash[i];
    }
}

static int hash_grow(struct gguf_writer *w)
{
    uint64_t cap = w->hash_cap ? 2 * w->hash_cap : 256;
    uint64_t *old = w->hash, old_cap = w->hash_cap;
    w->hash = calloc(cap, sizeof *w->hash);
    if (!w->hash) {
        w->hash = old;
        return -ENOMEM;
    }
    w->hash_cap = cap;
    for (uint64_t i = 0; i < old_cap; i++)
        if (old[i])
            *hash_slot(w, w->t[old[i] - 1].name) = old[i];
    free(old);
    return 0;
}

int gguf_writer_add_tensor(struct gguf_writer *w, const char *name, uint32_t n_dims,
                           const int64_t *ne, uint32_t type, uint64_t *idx,
                           char *err, size_t errlen)
{
    if (w->laid_out)
        return moe_fail(err, errlen, MOE_EINTERNAL, "tensor '%s' added after layout", name);
    size_t nl = strlen(name);
    if (nl == 0 || nl >= GGUF_NAME_MAX)
        return moe_fail(err, errlen, MOE_EFORMAT, "tensor name '%s' must be 1..%d bytes", name,
                        GGUF_NAME_MAX - 1);
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return moe_fail(err, errlen, MOE_EFORMAT, "tensor '%s': %u dims (1..%d allowed)", name,
                        n_dims, GGUF_MAX_DIMS);
    const struct moe_type_info *ti = moe_type_get(type);
    if (!ti)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED, "tensor '%s': unknown ggml type %u", name,
                        type);
    uint64_t nel = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] < 1)
            return moe_fail(err, errlen, MOE_EFORMAT, "tensor '%s': ne[%u] = %lld", name, d,
                            (long long)ne[d]);
        if ((uint64_t)ne[d] > (UINT64_MAX >> 8) / nel)
            return moe_fail(err, errlen, MOE_ETOOBIG, "tensor '%s': element count overflows",
                            name);
        nel *= (uint64_t)ne[d];
    }
    if (ne[0] % ti->blck)
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "tensor '%s': row length %lld is not a multiple of %s's block size %u",
                        name, (long long)ne[0], ti->name, ti->blck);
    if (2 * (w->n_t + 1) > w->hash_cap && hash_grow(w))
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    uint64_t *slot = hash_slot(w, name);
    if (*slot)
        return moe_fail(err, errlen, MOE_EFORMAT, "duplicate tensor name '%s'", name);
    if (w->n_t == w->cap_t) {
        uint64_t cap = w->cap_t ? 2 * w->cap_t : 64;
        struct wtensor *p = realloc(w->t, cap * sizeof *p);
        if (!p)
            return moe_fail(err, errlen, -ENOMEM, "out of memory");
        w->t = p;
        w->cap_t = cap;
    }
    struct wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    memcpy(t->name, name, nl + 1);
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = d < n_dims ? ne[d] : 1;
    t->type = type;
    t->nbytes = nel / ti->blck * ti->size;
    *slot = ++w->n_t;
    if (idx)
        *idx = w->n_t - 1;
    return 0;
}

static uint64_t align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

int gguf_writer_layout(struct gguf_writer *w, char *err, size_t errlen)
{
    if (w->laid_out)
        return 0;
    uint64_t size = 4 + 4 + 8 + 8; /* magic, version, n_tensors, n_kv */
    for (size_t i = 0; i < w->n_kv; i++)
        size += 8 + strlen(w->kv[i].key) + 4 + w->kv[i].val_len;
    for (uint64_t i = 0; i < w->n_t; i++)
        size += 8 + strlen(w->t[i].name) + 4 + 8 * (uint64_t)w->t[i].n_dims + 4 + 8;
    w->meta_size = size;
    w->data_offset = align_up(size, w->alignment);
    uint64_t off = 0;
    for (uint64_t i = 0; i < w->n_t; i++) {
        w->t[i].offset = off;
        uint64_t padded = align_up(w->t[i].nbytes, w->alignment);
        if (padded > UINT64_MAX / 2 - off)
            return moe_fail(err, errlen, MOE_ETOOBIG, "tensor data exceeds 2^63 bytes at '%s'",
                            w->t[i].name);
        off += padded;
    }
    w->file_size = w->data_offset + off;
    w->laid_out = true;
    return 0;
}

uint64_t gguf_writer_n_tensors(const struct gguf_writer *w)
{
    return w->n_t;
}

uint64_t gguf_writer_data_offset(const struct gguf_writer *w)
{
    return w->data_offset;
}

uint64_t gguf_writer_file_size(const struct gguf_writer *w)
{
    return w->file_size;
}

int gguf_writer_tensor(const struct gguf_writer *w, uint64_t idx, struct gguf_writer_tensor *out)
{
    if (!w->laid_out)
        return MOE_EINTERNAL;
    if (idx >= w->n_t)
        return MOE_ERANGE;
    const struct wtensor *t = &w->t[idx];
    *out = (struct gguf_writer_tensor){
        .name = t->name, .type = t->type, .n_dims = t->n_dims,
        .offset = t->offset, .file_offset = w->data_offset + t->offset, .nbytes = t->nbytes,
    };
    memcpy(out->ne, t->ne, sizeof t->ne);
    return 0;
}

static uint8_t *put(uint8_t *p, const void *v, size_t n)
{
    memcpy(p, v, n);
    return p + n;
}

static uint8_t *put_str(uint8_t *p, const char *s)
{
    uint64_t n = strlen(s);
    p = put(p, &n, 8);
    return put(p, s, n);
}

int gguf_writer_meta(const struct gguf_writer *w, void *buf, size_t size)
{
    if (!w->laid_out)
        return MOE_EINTERNAL;
    if (size < w->data_offset)
        return MOE_ERANGE;
    uint8_t *p = buf;
    uint32_t version = 3;
    uint64_t n_t = w->n_t, n_kv = w->n_kv;
    p = put(p, "GGUF", 4);
    p = put(p, &version, 4);
    p = put(p, &n_t, 8);
    p = put(p, &n_kv, 8);
    for (size_t i = 0; i < w->n_kv; i++) {
        int32_t type = (int32_t)w->kv[i].type;
        p = put_str(p, w->kv[i].key);
        p = put(p, &type, 4);
        p = put(p, w->kv[i].val, w->kv[i].val_len);
    }
    for (uint64_t i = 0; i < w->n_t; i++) {
        const struct wtensor *t = &w->t[i];
        int32_t type = (int32_t)t->type;
        p = put_str(p, t->name);
        p = put(p, &t->n_dims, 4);
        p = put(p, t->ne, 8 * (size_t)t->n_dims);
        p = put(p, &type, 4);
        p = put(p, &t->offset, 8);
    }
    MOE_ASSERT((uint64_t)(p - (uint8_t *)buf) == w->meta_size);
    memset(p, 0, w->data_offset - w->meta_size);
    return 0;
}

/* pwrite everything, retrying short writes and EINTR. */
static int pwrite_all(int fd, const void *buf, size_t n, uint64_t off)
{
    const uint8_t *p = buf;
    while (n) {
        /* Linux caps a single write near 2 GiB; ask for at most 1 GiB at a time. */
        size_t chunk = n > (1u << 30) ? (1u << 30) : n;
        ssize_t k = pwrite(fd, p, chunk, (off_t)off);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (k == 0)
            return -EIO;
        p += k;
        off += (uint64_t)k;
        n -= (size_t)k;
    }
    return 0;
}

int gguf_writer_create(struct gguf_writer *w, const char *path, char *err, size_t errlen)
{
    int rc;
    uint8_t *meta = NULL;
    if (!w->laid_out)
        return moe_fail(err, errlen, MOE_EINTERNAL, "gguf_writer_create before layout");
    if (w->fd >= 0)
        return moe_fail(err, errlen, MOE_EINTERNAL, "gguf_writer_create called twice");
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return moe_fail(err, errlen, -errno, "%s: %s", path, moe_strerror(-errno));
    meta = malloc(w->data_offset);
    if (!meta) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    rc = gguf_writer_meta(w, meta, w->data_offset);
    if (rc) {
        moe_fail(err, errlen, rc, "%s: serializing metadata failed", path);
        goto fail;
    }
    rc = pwrite_all(fd, meta, w->data_offset, 0);
    if (rc) {
        moe_fail(err, errlen, rc, "%s: writing metadata: %s", path, moe_strerror(rc));
        goto fail;
    }
    if (ftruncate(fd, (off_t)w->file_size) < 0) {
        rc = moe_fail(err, errlen, -errno, "%s: sizing the file to %llu bytes: %s", path,
                      (unsigned long long)w->file_size, moe_strerror(-errno));
        goto fail;
    }
    free(meta);
    w->fd = fd;
    return 0;
fail:
    free(meta);
    close(fd);
    return rc;
}

int gguf_writer_pwrite(struct gguf_writer *w, uint64_t idx, uint64_t off, const void *buf,
                       size_t n, char *err, size_t errlen)
{
    if (w->fd < 0)
        return moe_fail(err, errlen, MOE_EINTERNAL, "gguf_writer_pwrite without an open file");
    if (idx >= w->n_t)
        return moe_fail(err, errlen, MOE_ERANGE, "tensor index %llu out of range",
                        (unsigned long long)idx);
    const struct wtensor *t = &w->t[idx];
    if (off > t->nbytes || n > t->nbytes - off)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "tensor '%s': write [%llu, +%zu) exceeds its %llu bytes", t->name,
                        (unsigned long long)off, n, (unsigned long long)t->nbytes);
    int rc = pwrite_all(w->fd, buf, n, w->data_offset + t->offset + off);
    if (rc)
        return moe_fail(err, errlen, rc, "tensor '%s': write failed: %s", t->name,
                        moe_strerror(rc));
    return 0;
}

int gguf_writer_finish(struct gguf_writer *w, bool sync, char *err, size_t errlen)
{
    if (w->fd < 0)
        return moe_fail(err, errlen, MOE_EINTERNAL, "gguf_writer_finish without an open file");
    int fd = w->fd, rc = 0;
    w->fd = -1;
    if (sync && fsync(fd) < 0)
        rc = moe_fail(err, errlen, -errno, "fsync: %s", moe_strerror(-errno));
    if (close(fd) < 0 && !rc)
        rc = moe_fail(err, errlen, -errno, "close: %s", moe_strerror(-errno));
    return rc;
}
