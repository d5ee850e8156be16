/* The ggml half of ggml-check: a thin wrapper over ggml's own GGUF loader and type traits.
 *
 * ggml's gguf.h and our store/gguf.h both declare gguf_find_tensor() (with different argument
 * types), so no translation unit may include both. This header is the neutral meeting point:
 * it mentions neither library's types. Only ggml_side.c includes ggml headers; only
 * ggml_check.c includes ours. */
#ifndef GGML_CHECK_SIDE_H
#define GGML_CHECK_SIDE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gx_file;

/* Opens path with gguf_init_from_file(), as llama.cpp's loader does. with_data: no_alloc=false,
 * so ggml also reads the whole data section into a ggml context (tensor data pointers valid);
 * otherwise only the header and tensor infos. Returns 0, or -1 with ggml's own log lines in err. */
int gx_open(struct gx_file **out, const char *path, bool with_data, char *err, size_t errlen);
void gx_close(struct gx_file *f);

uint32_t gx_version(const struct gx_file *f);
size_t gx_alignment(const struct gx_file *f);
size_t gx_data_offset(const struct gx_file *f);

/* KVs, in file order. Types are GGUF value type ids (the same numbers in both libraries). */
int64_t gx_n_kv(const struct gx_file *f);
int64_t gx_find_kv(const struct gx_file *f, const char *key); /* -1 when absent */
const char *gx_kv_key(const struct gx_file *f, int64_t i);
int gx_kv_type(const struct gx_file *f, int64_t i);
int gx_kv_arr_type(const struct gx_file *f, int64_t i);
size_t gx_kv_arr_n(const struct gx_file *f, int64_t i);
/* Raw bytes of a non-string scalar or numeric array, as ggml stores them. */
const void *gx_kv_data(const struct gx_file *f, int64_t i);
const char *gx_kv_str(const struct gx_file *f, int64_t i);
const char *gx_kv_arr_str(const struct gx_file *f, int64_t i, size_t j);
const char *gx_kv_type_name(int type);

/* Tensor infos, in file order. ne has 4 entries (1 past n_dims). data is NULL without data. */
int64_t gx_n_tensors(const struct gx_file *f);
const char *gx_tensor_name(const struct gx_file *f, int64_t i);
int gx_tensor_type(const struct gx_file *f, int64_t i);
void gx_tensor_ne(const struct gx_file *f, int64_t i, int64_t ne[4]);
size_t gx_tensor_offset(const struct gx_file *f, int64_t i);
size_t gx_tensor_size(const struct gx_file *f, int64_t i);
const void *gx_tensor_data(const struct gx_file *f, int64_t i);

/* ggml's type table: false for ids ggml does not define (blck 0, or >= GGML_TYPE_COUNT). */
bool gx_type_info(int type, const char **name, int64_t *blck, size_t *size, bool *quantized);
int gx_type_count(void);

/* Dequantizes n elements with ggml_get_type_traits(type)->to_float (F32: a copy, as ggml has
 * no converter for it). Returns 0, or -1 when ggml has no to_float for the type. */
int gx_dequantize(int type, const void *src, float *dst, int64_t n);

/* ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row, NULL): what llama-quantize does
 * without an importance matrix. Returns the bytes written. */
size_t gx_quantize(int type, const float *src, void *dst, int64_t nrows, int64_t n_per_row);

#endif
