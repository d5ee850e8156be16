/* The ggml half of ggml-check (see ggml_side.h): calls ggml's loader and type traits exactly as
 * llama.cpp and llama-quantize do, and hands plain values back. Nothing here interprets a file;
 * all comparisons happen in ggml_check.c. */
#include "ggml_side.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "gguf.h"

struct gx_file {
    struct gguf_context *gguf;
    struct ggml_context *ctx;
    struct ggml_tensor **tensors; /* [n_tensors], in gguf order; NULL entries without data */
};

/* ggml reports why a file is rejected only through its log callback; keep the last lines so
 * that the caller can print ggml's own words next to ours. */
static char log_buf[2048];
static size_t log_len;

static void log_capture(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (level == GGML_LOG_LEVEL_DEBUG)
        return;
    size_t n = strlen(text);
    if (n >= sizeof log_buf)
        n = sizeof log_buf - 1;
    if (log_len + n >= sizeof log_buf)
        log_len = 0; /* keep the newest lines */
    memcpy(log_buf + log_len, text, n);
    log_len += n;
    log_buf[log_len] = 0;
}

int gx_open(struct gx_file **out, const char *path, bool with_data, char *err, size_t errlen)
{
    struct gx_file *f = calloc(1, sizeof *f);
    if (!f) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    log_len = 0;
    log_buf[0] = 0;
    ggml_log_set(log_capture, NULL);
    struct gguf_init_params params = {.no_alloc = !with_data, .ctx = &f->ctx};
    f->gguf = gguf_init_from_file(path, params);
    ggml_log_set(NULL, NULL);
    if (!f->gguf) {
        /* Strip the trailing newline of ggml's last message for a one-line report. */
        while (log_len && (log_buf[log_len - 1] == '\n'))
            log_buf[--log_len] = 0;
        for (char *p = log_buf; *p; p++)
            if (*p == '\n')
                *p = '|';
        snprintf(err, errlen, "gguf_init_from_file(no_alloc=%s) failed: %s",
                 with_data ? "false" : "true", log_len ? log_buf : "(no message)");
        free(f);
        return -1;
    }
    int64_t n = gguf_get_n_tensors(f->gguf);
    f->tensors = calloc(n ? (size_t)n : 1, sizeof *f->tensors);
    if (!f->tensors) {
        gx_close(f);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    /* The context holds the tensors in gguf order (plus, with data, one blob tensor first). */
    if (f->ctx) {
        int64_t i = 0;
        for (struct ggml_tensor *t = ggml_get_first_tensor(f->ctx); t && i < n;
             t = ggml_get_next_tensor(f->ctx, t)) {
            if (strcmp(t->name, gguf_get_tensor_name(f->gguf, i)) == 0)
                f->tensors[i++] = t;
        }
    }
    *out = f;
    return 0;
}

void gx_close(struct gx_file *f)
{
    if (!f)
        return;
    if (f->gguf)
        gguf_free(f->gguf);
    if (f->ctx)
        ggml_free(f->ctx);
    free(f->tensors);
    free(f);
}

uint32_t gx_version(const struct gx_file *f) { return gguf_get_version(f->gguf); }
size_t gx_alignment(const struct gx_file *f) { return gguf_get_alignment(f->gguf); }
size_t gx_data_offset(const struct gx_file *f) { return gguf_get_data_offset(f->gguf); }

int64_t gx_n_kv(const struct gx_file *f) { return gguf_get_n_kv(f->gguf); }
int64_t gx_find_kv(const struct gx_file *f, const char *key) { return gguf_find_key(f->gguf, key); }
const char *gx_kv_key(const struct gx_file *f, int64_t i) { return gguf_get_key(f->gguf, i); }
int gx_kv_type(const struct gx_file *f, int64_t i) { return (int)gguf_get_kv_type(f->gguf, i); }

int gx_kv_arr_type(const struct gx_file *f, int64_t i)
{
    if (gguf_get_kv_type(f->gguf, i) != GGUF_TYPE_ARRAY)
        return -1;
    return (int)gguf_get_arr_type(f->gguf, i);
}

size_t gx_kv_arr_n(const struct gx_file *f, int64_t i)
{
    return gguf_get_kv_type(f->gguf, i) == GGUF_TYPE_ARRAY ? gguf_get_arr_n(f->gguf, i) : 1;
}

const void *gx_kv_data(const struct gx_file *f, int64_t i)
{
    enum gguf_type t = gguf_get_kv_type(f->gguf, i);
    if (t == GGUF_TYPE_STRING)
        return NULL;
    if (t == GGUF_TYPE_ARRAY)
        return gguf_get_arr_type(f->gguf, i) == GGUF_TYPE_STRING ? NULL
                                                                  : gguf_get_arr_data(f->gguf, i);
    return gguf_get_val_data(f->gguf, i);
}

const char *gx_kv_str(const struct gx_file *f, int64_t i)
{
    return gguf_get_kv_type(f->gguf, i) == GGUF_TYPE_STRING ? gguf_get_val_str(f->gguf, i) : NULL;
}

const char *gx_kv_arr_str(const struct gx_file *f, int64_t i, size_t j)
{
    return gx_kv_arr_type(f, i) == GGUF_TYPE_STRING ? gguf_get_arr_str(f->gguf, i, j) : NULL;
}

const char *gx_kv_type_name(int type) { return gguf_type_name((enum gguf_type)type); }

int64_t gx_n_tensors(const struct gx_file *f) { return gguf_get_n_tensors(f->gguf); }
const char *gx_tensor_name(const struct gx_file *f, int64_t i)
{
    return gguf_get_tensor_name(f->gguf, i);
}

int gx_tensor_type(const struct gx_file *f, int64_t i)
{
    return (int)gguf_get_tensor_type(f->gguf, i);
}

void gx_tensor_ne(const struct gx_file *f, int64_t i, int64_t ne[4])
{
    const int64_t *g = gguf_get_tensor_ne(f->gguf, i);
    for (int d = 0; d < 4; d++)
        ne[d] = g[d];
}

size_t gx_tensor_offset(const struct gx_file *f, int64_t i)
{
    return gguf_get_tensor_offset(f->gguf, i);
}

size_t gx_tensor_size(const struct gx_file *f, int64_t i)
{
    return gguf_get_tensor_size(f->gguf, i);
}

const void *gx_tensor_data(const struct gx_file *f, int64_t i)
{
    return f->tensors[i] ? f->tensors[i]->data : NULL;
}

int gx_type_count(void) { return GGML_TYPE_COUNT; }

bool gx_type_info(int type, const char **name, int64_t *blck, size_t *size, bool *quantized)
{
    if (type < 0 || type >= GGML_TYPE_COUNT)
        return false;
    const struct ggml_type_traits *tr = ggml_get_type_traits((enum ggml_type)type);
    if (tr->blck_size == 0)
        return false;
    *name = tr->type_name;
    *blck = tr->blck_size;
    *size = tr->type_size;
    *quantized = tr->is_quantized;
    return true;
}

int gx_dequantize(int type, const void *src, float *dst, int64_t n)
{
    if (type == GGML_TYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return 0;
    }
    if (type < 0 || type >= GGML_TYPE_COUNT)
        return -1;
    const struct ggml_type_traits *tr = ggml_get_type_traits((enum ggml_type)type);
    if (!tr->to_float)
        return -1;
    tr->to_float(src, dst, n);
    return 0;
}

size_t gx_quantize(int type, const float *src, void *dst, int64_t nrows, int64_t n_per_row)
{
    return ggml_quantize_chunk((enum ggml_type)type, src, dst, 0, nrows, n_per_row, NULL);
}
