/* GGUF v2/v3 reader: mmap-backed, hardened against malformed files.
 *
 * Every count, length, size and offset is checked against the bytes that remain before it is
 * used; a malformed file gives MOE_EFORMAT (or MOE_EUNSUPPORTED) and a message naming the field
 * and its byte offset, e.g. "tensor 12 (blk.1.ffn_up_exps): data [1234, 5678) ends past the end
 * of the file (4096 bytes)". Nothing in here aborts on bad input. */
#ifndef MOE_GGUF_H
#define MOE_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum gguf_vtype {
    GGUF_U8 = 0, GGUF_I8 = 1, GGUF_U16 = 2, GGUF_I16 = 3, GGUF_U32 = 4, GGUF_I32 = 5,
    GGUF_F32 = 6, GGUF_BOOL = 7, GGUF_STRING = 8, GGUF_ARRAY = 9, GGUF_U64 = 10,
    GGUF_I64 = 11, GGUF_F64 = 12,
};

#define GGUF_MAX_DIMS 4
#define GGUF_NAME_MAX 64 /* tensor names must be shorter than this (NUL included) */

struct gguf_str {
    const char *p; /* points into the file mapping; not NUL-terminated */
    uint64_t len;
};

struct gguf_kv {
    char *key;          /* NUL-terminated copy */
    uint32_t type;      /* enum gguf_vtype */
    uint64_t offset;    /* byte offset of the KV in the file (for messages) */
    union {
        uint64_t u64;   /* U8, U16, U32, U64, BOOL */
        int64_t i64;    /* I8, I16, I32, I64 */
        double f64;     /* F32, F64 */
        struct gguf_str str;
        struct {
            uint32_t type;       /* element type (never ARRAY) */
            uint64_t n;          /* element count */
            const void *data;    /* numeric elements, packed little-endian, in the mapping */
            struct gguf_str *strs; /* for string arrays: n entries (allocated), else NULL */
        } arr;
    } v;
};

struct gguf_tensor {
    char name[GGUF_NAME_MAX];
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];   /* unused dims are 1 */
    uint32_t type;               /* enum moe_type */
    uint64_t offset;             /* relative to the data section */
    uint64_t nbytes;
    const void *data;            /* in the mapping */
};

struct gguf_file {
    uint32_t version;
    uint64_t n_kv;
    struct gguf_kv *kv;
    uint64_t n_tensors;
    struct gguf_tensor *tensors;
    uint32_t alignment;
    uint64_t data_offset;        /* file offset of the data section */
    const uint8_t *base;         /* whole file */
    uint64_t size;
    int mapped;                  /* 1 if base is our own mmap */
    void *index;                 /* private: name lookup tables */
};

/* Opens and validates a GGUF file (mmap'd read-only). Returns 0, or a negative errno /
 * MOE_EFORMAT / MOE_EUNSUPPORTED with a message in err. *out is set only on success. */
int gguf_open(struct gguf_file **out, const char *path, char *err, size_t errlen);

/* Same over a caller-owned buffer that must outlive the result (tests, fuzzing). */
int gguf_open_mem(struct gguf_file **out, const void *data, size_t size, char *err, size_t errlen);

void gguf_close(struct gguf_file *f);

/* Lookups: NULL when absent. */
const struct gguf_kv *gguf_find_kv(const struct gguf_file *f, const char *key);
const struct gguf_tensor *gguf_find_tensor(const struct gguf_file *f, const char *name);

/* Typed getters. Integers accept any integer KV type whose value fits the result; floats accept
 * F32/F64. Return 0, MOE_ENOTFOUND (absent) or MOE_ETYPE / MOE_ERANGE, with a message in err. */
int gguf_get_u32(const struct gguf_file *f, const char *key, uint32_t *out, char *err, size_t errlen);
int gguf_get_u64(const struct gguf_file *f, const char *key, uint64_t *out, char *err, size_t errlen);
int gguf_get_i64(const struct gguf_file *f, const char *key, int64_t *out, char *err, size_t errlen);
int gguf_get_f32(const struct gguf_file *f, const char *key, float *out, char *err, size_t errlen);
int gguf_get_bool(const struct gguf_file *f, const char *key, bool *out, char *err, size_t errlen);
int gguf_get_str(const struct gguf_file *f, const char *key, struct gguf_str *out, char *err, size_t errlen);
/* Array of the given element type (GGUF_STRING gives arr.strs). */
int gguf_get_arr(const struct gguf_file *f, const char *key, uint32_t elem_type,
                 const struct gguf_kv **out, char *err, size_t errlen);

/* Element i of a numeric array KV as int64 / double (no bounds or type checks beyond asserts). */
int64_t gguf_arr_i64(const struct gguf_kv *kv, uint64_t i);
double gguf_arr_f64(const struct gguf_kv *kv, uint64_t i);

/* Name of a value type ("u32", "string", ...), or "?" */
const char *gguf_vtype_name(uint32_t t);

/* Bytes of one element of a fixed-size value type (1, 2, 4 or 8); 0 for STRING, ARRAY and
 * unknown types, so a 0 also answers "is this a numeric/bool scalar type?". */
uint32_t gguf_vtype_size(uint32_t t);

/* Model fingerprint: a stable 64-bit hash of the metadata and tensor table (not the data). */
uint64_t gguf_fingerprint(const struct gguf_file *f);

#endif
