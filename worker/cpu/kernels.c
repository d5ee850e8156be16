/* CPU compute kernels: dispatch between the SIMD variants and the portable path.
 *
 * The portable path decodes a stretch of blocks with moe_dequantize() into a small float buffer
 * and takes the dot product with several accumulators, so it is correct by construction for
 * every type the reference decoder knows. The AVX2 variants (kernels_avx2.c) fuse decoding into
 * the dot product for the types that dominate real models. Which one runs is decided per call
 * from a cached CPU check, so the default build (no -march flag) runs on any x86-64 and the file
 * compiles on other architectures with the portable path only. */
#include "worker/cpu/kernels.h"

#include <math.h>
#include <string.h>

#include "store/ggml_type.h"
#include "store/quant.h"
#include "worker/cpu/kernels_impl.h"

/* Elements decoded at a time by the portable vec_dot: a multiple of every block size, small
 * enough to stay in L1 with the matching stretch of x. */
#define DOT_CHUNK 512
/* Matmul tiles: MM_ROWS weight rows of MM_CHUNK elements (a multiple of every block size) are
 * decoded once per block of MM_TOK tokens. */
#define MM_ROWS 16
#define MM_CHUNK 512
#define MM_TOK 64

static int force_scalar;

void moe_kernels_force_scalar(int on)
{
    __atomic_store_n(&force_scalar, on, __ATOMIC_RELAXED);
}

static int use_simd(void)
{
#if defined(MOE_KERNELS_X86)
    return !__atomic_load_n(&force_scalar, __ATOMIC_RELAXED) && moe_kernels_have_avx2();
#else
    return 0;
#endif
}

int moe_kernels_simd(void)
{
    return use_simd();
}

static int type_ok(uint32_t type)
{
    const struct moe_type_info *t = moe_type_get(type);
    return t && t->compute;
}

static float dot_f32(const float *a, const float *b, int64_t n)
{
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; i++)
        s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

static float vec_dot_scalar(uint32_t type, const void *row, const float *x, int64_t n)
{
    const struct moe_type_info *t = moe_type_get(type);
    const uint8_t *p = row;
    float buf[DOT_CHUNK];
    float sum = 0;

    if (type == MOE_TYPE_F32)
        return dot_f32(row, x, n);
    for (int64_t k = 0; k < n; k += DOT_CHUNK) {
        int64_t len = n - k < DOT_CHUNK ? n - k : DOT_CHUNK;
        moe_dequantize(type, p + (size_t)(k / t->blck) * t->size, buf, len);
        sum += dot_f32(buf, x + k, len);
    }
    return sum;
}

float moe_vec_dot(uint32_t type, const void *row, const float *x, int64_t n)
{
    /* An unsupported type is a caller bug (model loading rejects such tensors); a NaN makes it
     * visible in the output without taking the process down. */
    if (!type_ok(type))
        return NAN;
#if defined(MOE_KERNELS_X86)
    moe_dot_fn fn = use_simd() ? moe_dot_fn_avx2(type) : NULL;
    if (fn)
        return fn(row, x, n);
#endif
    return vec_dot_scalar(type, row, x, n);
}

void moe_matvec(uint32_t type, const void *W, int64_t n, const float *x, float *y, int64_t r0,
                int64_t r1)
{
    size_t rb = moe_row_bytes(type, n);
    const uint8_t *w = W;

    if (!type_ok(type)) {
        for (int64_t r = r0; r < r1; r++)
            y[r] = NAN;
        return;
    }
#if defined(MOE_KERNELS_X86)
    /* Resolved once per call, not per row. */
    moe_dot_fn fn = use_simd() ? moe_dot_fn_avx2(type) : NULL;
    if (fn) {
        for (int64_t r = r0; r < r1; r++)
            y[r] = fn(w + (size_t)r * rb, x, n);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++)
        y[r] = vec_dot_scalar(type, w + (size_t)r * rb, x, n);
}

static void decode(uint32_t type, const void *src, float *dst, int64_t n, int simd)
{
#if defined(MOE_KERNELS_X86)
    if (simd && moe_decode_avx2(type, src, dst, n))
        return;
#endif
    (void)simd;
    moe_dequantize(type, src, dst, n);
}

static void dot_rows(const float *Wd, int64_t ldw, int nr, const float *x, int64_t n, float *out,
                     int simd)
{
#if defined(MOE_KERNELS_X86)
    if (simd) {
        for (int i = 0; i < nr; i += 4)
            moe_dot_rows_f32_avx2(Wd + i * ldw, ldw, nr - i < 4 ? nr - i : 4, x, n, out + i);
        return;
    }
#endif
    (void)simd;
    for (int i = 0; i < nr; i++)
        out[i] = dot_f32(Wd + i * ldw, x, n);
}

/* Adds a tile's partial dot products into Y (or stores them, for the first chunk). */
static void put_tile(float *Y, int64_t ldy, const float *out, int ntok, int nr, int first)
{
    for (int t = 0; t < ntok; t++)
        for (int i = 0; i < nr; i++)
            Y[t * ldy + i] = first ? out[t * 4 + i] : Y[t * ldy + i] + out[t * 4 + i];
}

void moe_matmul(uint32_t type, const void *W, int64_t n, const float *X, int64_t ldx,
                int64_t n_tok, float *Y, int64_t ldy, int64_t r0, int64_t r1)
{
    const struct moe_type_info *t = moe_type_get(type);
    size_t rb = moe_row_bytes(type, n);
    const uint8_t *w = W;
    int simd = use_simd();
    /* Per thread: callers run matmul on several threads at once. */
    static _Thread_local float buf[MM_ROWS * MM_CHUNK];

    if (!type_ok(type)) {
        for (int64_t k = 0; k < n_tok; k++)
            for (int64_t r = r0; r < r1; r++)
                Y[k * ldy + r] = NAN;
        return;
    }
    if (n <= 0) {
        /* Empty rows: every dot product is 0 (the chunk loop below would write nothing). */
        for (int64_t k = 0; k < n_tok; k++)
            for (int64_t r = r0; r < r1; r++)
                Y[k * ldy + r] = 0;
        return;
    }
    if (n_tok <= 2) {
        /* Too few tokens to pay for a decode pass: the fused mat-vec is faster. */
        for (int64_t k = 0; k < n_tok; k++)
            moe_matvec(type, W, n, X + k * ldx, Y + k * ldy, r0, r1);
        return;
    }
    /* Loop order: a block of MM_TOK tokens (its activations stay in L2), then a tile of MM_ROWS
     * weight rows decoded MM_CHUNK elements at a time into buf (L1), then groups of 4 rows x 3
     * tokens. Weights are decoded once per token block, which is cheap next to the 2·MM_TOK
     * flops each decoded element feeds. */
    for (int64_t tb = 0; tb < n_tok; tb += MM_TOK) {
        int64_t te = n_tok - tb < MM_TOK ? n_tok : tb + MM_TOK;
        for (int64_t r = r0; r < r1; r += MM_ROWS) {
            int nr = r1 - r < MM_ROWS ? (int)(r1 - r) : MM_ROWS;
            for (int64_t k0 = 0; k0 < n; k0 += MM_CHUNK) {
                int64_t len = n - k0 < MM_CHUNK ? n - k0 : MM_CHUNK;
                size_t off = (size_t)(k0 / t->blck) * t->size;
                for (int i = 0; i < nr; i++)
                    decode(type, w + (size_t)(r + i) * rb + off, buf + i * MM_CHUNK, len, simd);
                for (int i = 0; i < nr; i += 4) {
                    int ri = nr - i < 4 ? nr - i : 4;
                    const float *wd = buf + i * MM_CHUNK;
                    float out[12];
                    int64_t k = tb;
#if defined(MOE_KERNELS_X86)
                    if (simd && ri == 4) {
                        for (; k + 3 <= te; k += 3) {
                            moe_gemm_4x3_f32_avx2(wd, MM_CHUNK, X + k * ldx + k0, ldx, len, out);
                            put_tile(Y + k * ldy + r + i, ldy, out, 3, 4, k0 == 0);
                        }
                    }
#endif
                    for (; k < te; k++) {
                        dot_rows(wd, MM_CHUNK, ri, X + k * ldx + k0, len, out, simd);
                        put_tile(Y + k * ldy + r + i, ldy, out, 1, ri, k0 == 0);
                    }
                }
            }
        }
    }
}

void moe_topk_argmax(const float *r, int64_t n, int64_t k, uint8_t *taken, int32_t *out)
{
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t x = 0; x < n; x++)
            if (!taken[x] && (best < 0 || r[x] > r[best] || isnan(r[best])))
                best = x;
        taken[best] = 1;
        out[j] = (int32_t)best;
    }
    for (int64_t j = 0; j < k; j++)
        taken[out[j]] = 0;
}
