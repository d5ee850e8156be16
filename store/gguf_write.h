/* GGUF v3 writer, built for writing very large files from many threads.
 *
 * Use in four steps:
 *   1. gguf_writer_new(); declare KVs (gguf_writer_add_*) and tensors (gguf_writer_add_tensor)
 *      in the order they should appear in the file;
 *   2. gguf_writer_layout(): fixes the metadata size and every tensor's offset (aligned to
 *      general.alignment, 32 unless gguf_writer_set_alignment() says otherwise);
 *   3. gguf_writer_create(): writes header, KVs and tensor infos and sizes the file (ftruncate),
 *      so that tensor data regions exist and read as zeros until written;
 *   4. any number of threads call gguf_writer_pwrite() for disjoint (or even overlapping) ranges
 *      of tensor data; then one thread calls gguf_writer_finish().
 * For in-memory files (tests), gguf_writer_meta() serializes steps 1-2 into a buffer instead.
 *
 * Every function returns 0 or a negative error (store/err.h): MOE_EFORMAT for invalid input
 * (duplicate key or tensor name, name too long, bad dims, row not a multiple of the block size),
 * MOE_EUNSUPPORTED for unknown types, MOE_ERANGE for out-of-range sizes/offsets, MOE_EINTERNAL
 * for calls in the wrong step, -ENOMEM, or a negative errno from the file system. Functions that
 * take (err, errlen) describe the failure there. */
#ifndef MOE_GGUF_WRITE_H
#define MOE_GGUF_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/gguf.h"

struct gguf_writer;

/* Where a declared tensor lands (valid after gguf_writer_layout). */
struct gguf_writer_tensor {
    const char *name;
    uint32_t type;
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    uint64_t offset;      /* relative to the data section, as stored in the file */
    uint64_t file_offset; /* absolute: data_offset + offset */
    uint64_t nbytes;
};

/* Returns 0 or -ENOMEM. */
int gguf_writer_new(struct gguf_writer **out);
/* Closes the file if still open (without syncing) and frees everything. NULL is fine. */
void gguf_writer_free(struct gguf_writer *w);

/* Sets the data alignment (a power of two, >= 1) and records it as the u32 KV
 * general.alignment (added at this point in the KV order, or updated if already present).
 * MOE_ERANGE if not a power of two. */
int gguf_writer_set_alignment(struct gguf_writer *w, uint32_t alignment, char *err, size_t errlen);

/* Scalar KV of any non-array, non-string type; val points to a value of that type's size
 * (BOOL: one byte, 0 or 1). Key and value are copied. */
int gguf_writer_add_scalar(struct gguf_writer *w, const char *key, uint32_t type, const void *val,
                           char *err, size_t errlen);
int gguf_writer_add_u32(struct gguf_writer *w, const char *key, uint32_t v, char *err, size_t errlen);
int gguf_writer_add_i32(struct gguf_writer *w, const char *key, int32_t v, char *err, size_t errlen);
int gguf_writer_add_u64(struct gguf_writer *w, const char *key, uint64_t v, char *err, size_t errlen);
int gguf_writer_add_f32(struct gguf_writer *w, const char *key, float v, char *err, size_t errlen);
int gguf_writer_add_bool(struct gguf_writer *w, const char *key, bool v, char *err, size_t errlen);
/* String KV (bytes copied; len bytes, need not be NUL-terminated). */
int gguf_writer_add_str(struct gguf_writer *w, const char *key, const char *s, size_t len,
                        char *err, size_t errlen);
/* Numeric array: n packed little-endian elements of elem_type (any scalar type but STRING). */
int gguf_writer_add_arr(struct gguf_writer *w, const char *key, uint32_t elem_type,
                        const void *data, uint64_t n, char *err, size_t errlen);
/* String array: n strings (copied). */
int gguf_writer_add_arr_str(struct gguf_writer *w, const char *key, const struct gguf_str *strs,
                            uint64_t n, char *err, size_t errlen);
/* Copies a KV read by store/gguf.h (any type, arrays included), under its own key or `key`
 * when non-NULL. */
int gguf_writer_copy_kv(struct gguf_writer *w, const struct gguf_kv *kv, const char *key,
                        char *err, size_t errlen);
/* True when a KV with this key has been declared. */
bool gguf_writer_has_kv(const struct gguf_writer *w, const char *key);

/* Declares a tensor: name shorter than GGUF_NAME_MAX, 1..4 dims, every ne >= 1, ne[0] a
 * multiple of the type's block size. *idx (optional) receives its index, in declaration order. */
int gguf_writer_add_tensor(struct gguf_writer *w, const char *name, uint32_t n_dims,
                           const int64_t *ne, uint32_t type, uint64_t *idx,
                           char *err, size_t errlen);

/* Freezes the declarations and computes the layout. Must come before the calls below. */
int gguf_writer_layout(struct gguf_writer *w, char *err, size_t errlen);

uint64_t gguf_writer_n_tensors(const struct gguf_writer *w);
/* File offset of the data section (metadata size rounded up to the alignment). */
uint64_t gguf_writer_data_offset(const struct gguf_writer *w);
/* Total file size: data section start + every tensor, each padded to the alignment. */
uint64_t gguf_writer_file_size(const struct gguf_writer *w);
/* Describes tensor idx (after layout). MOE_ERANGE for a bad index. */
int gguf_writer_tensor(const struct gguf_writer *w, uint64_t idx, struct gguf_writer_tensor *out);

/* Serializes header, KVs, tensor infos and the padding up to the data section into buf, which
 * must hold gguf_writer_data_offset() bytes. */
int gguf_writer_meta(const struct gguf_writer *w, void *buf, size_t size);

/* Creates (truncates) path, writes the metadata and sizes the file to gguf_writer_file_size().
 * On failure nothing is left open (the partial file stays; callers may unlink it). */
int gguf_writer_create(struct gguf_writer *w, const char *path, char *err, size_t errlen);

/* Writes n bytes at byte `off` of tensor idx's data. Thread-safe: any number of threads may
 * call it at once (pwrite on a shared descriptor, no shared state changed). MOE_ERANGE when
 * [off, off+n) exceeds the tensor. */
int gguf_writer_pwrite(struct gguf_writer *w, uint64_t idx, uint64_t off, const void *buf,
                       size_t n, char *err, size_t errlen);

/* Optionally fsyncs, then closes the file. Reports write-back errors close() returns. */
int gguf_writer_finish(struct gguf_writer *w, bool sync, char *err, size_t errlen);

#endif
