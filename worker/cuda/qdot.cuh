/* Quantized dot-product building blocks shared by the CUDA kernels (mat-vec, grouped experts,
 * head): the decoders of every block format, one "unit" (the piece of one block that one thread
 * decodes, 8 to 32 elements) at a time. See matvec.cu for how a warp walks a row with them.
 *
 * Codes become floats exactly (byte_f: the integer code; code_f for the K-quants: 0.5 + code/256,
 * which saves a subtraction per element), are multiplied into per-sub-block float sums, and the
 * sums are scaled: for Q4_K/Q5_K d·sc·Σq·x − dmin·m·Σx, for Q4_1/Q5_1 d·Σq·x + m·Σx, for the
 * others d·Σq·x. Everything is __host__ __device__ so that a host build can check a decoder. */
#ifndef MOE_CUDA_QDOT_CUH
#define MOE_CUDA_QDOT_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "store/blocks.h"
#include "store/ggml_type.h"
}
#include "worker/cuda/hd.cuh"

/* Byte offsets of the block fields (store/blocks.h defines the layouts once). */
#define OFF(T, f) ((int)offsetof(struct moe_block_##T, f))

/* Variants of the plain types: the vector forms need 16-byte aligned rows. */
enum { KIND_F32_V = 1000, KIND_F16_V, KIND_BF16_V };

/* The decoders below are __host__ __device__ (HD) so that a host build can single-step them when
 * a GPU result looks wrong; only the few intrinsics differ between the two. */
#ifdef __CUDA_ARCH__
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif

static HD float h2f(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

static HD float bf2f(uint32_t h)
{
    return hd_u2f(h << 16);
}

static HD uint16_t ld16(const uint8_t *p)
{
    return *(const uint16_t *)p;
}

/* A 32-bit little-endian word at a 2-byte aligned address. */
static HD uint32_t ld32a2(const uint8_t *p)
{
    return (uint32_t)ld16(p) | (uint32_t)ld16(p + 2) << 16;
}

/* x may live in global or shared memory (the fused-norm kernels stage it there). */
static HD float4 ldx4(const float *x)
{
    return *(const float4 *)x;
}

/* How unit_dot reads its x elements. XPlain: as they are. XNorm: RMSNorm applied on the way,
 * (x·sc)·g[i] for the element at x0 + i, the float the RMSNorm kernel stores. */
struct XPlain {
    HD float4 ld4(const float *p) const { return ldx4(p); }
    HD float ld1(const float *p) const { return *p; }
};

/* The columns of the inputs the 16-token walk stages at a time (matvec.cu, mv_rows_tile): 32
 * Q4_K / Q5_K units or 64 Q6_K units of a row, so that slices walked one after another give a
 * lane its units in the one-token walk's order. */
#define MOE_TOK_COLS 1024

/* Inputs staged in a padded buffer (the 16-token walk's shared memory): the element at base + v
 * (v a multiple of 4, as every ld4 takes) lies at base + v + 4·(v / 64), 4 floats of padding
 * after every 64, so that the lanes of a warp reading their units' inputs at once (Q4_K and
 * Q5_K units 16 elements apart in pairs 64 apart, Q6_K units 4 apart) hit distinct banks. */
struct XPad {
    const float *base;
    static HD int64_t at(int64_t v) { return v + ((v >> 6) << 2); }
    HD float4 ld4(const float *p) const { return ldx4(base + at(p - base)); }
    HD float ld1(const float *p) const { return base[at(p - base)]; }
};

/* Four elements of the RMSNorm: (x·sc)·g, the floats the RMSNorm kernel stores. */
static HD float4 xnorm4(float4 v, float sc, float4 g)
{
    return make_float4(v.x * sc * g.x, v.y * sc * g.y, v.z * sc * g.z, v.w * sc * g.w);
}

struct XNorm {
    const float *x0, *g;
    float sc;
    HD float4 ld4(const float *p) const { return xnorm4(ldx4(p), sc, ldx4(g + (p - x0))); }
    HD float ld1(const float *p) const { return *p * sc * g[p - x0]; }
};

/* Byte k of w (0..255) minus off, as a float, without an int→float conversion: a byte permute
 * (PRMT) assembles the bits of the float 2^23 + byte, and the subtraction is exact. The
 * conversion unit (16 per clock per SM on Hopper) would otherwise cap the 4-bit types at a
 * fraction of the memory bandwidth. The host twin computes the same permute. */
static HD float byte_f(uint32_t w, int k, float off)
{
#ifdef __CUDA_ARCH__
    uint32_t bits = __byte_perm(w, 0x4b000000u, 0x7440u + (unsigned)k);
    return __uint_as_float(bits) - (8388608.0f + off);
#else
    uint32_t bits = 0x4b000000u | ((w >> (8 * k)) & 0xff);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f - (8388608.0f + off);
#endif
}

/* Byte k of w, a code below 128, as the float 0.5 + code/256, exactly: the byte becomes mantissa
 * bits 16..22 under the exponent of 0.5 (one PRMT with magic = 0x3f000000 in a register, from
 * code_magic(), and the selector as its immediate). A product with x then needs no subtraction
 * of its own: Σ code·x = 256·Σ(0.5 + code/256)·x − 128·Σx, once per sum. */
static HD float code_f(uint32_t w, int k, uint32_t magic)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(__byte_perm(w, magic, 0x7044u | ((unsigned)k << 8)));
#else
    uint32_t bits = magic | ((w >> (8 * k)) & 0xff) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* 0x3f000000, opaque to the compiler so that it stays in one register (otherwise it becomes
 * PRMT's immediate and every selector is moved into a register first). */
static HD uint32_t code_magic()
{
    uint32_t m = 0x3f000000u;
#ifdef __CUDA_ARCH__
    asm volatile("" : "+r"(m));
#endif
    return m;
}

static HD uint32_t byte_of(uint32_t w, int k)
{
    return (w >> (8 * k)) & 0xff;
}

/* The 6-bit scales and mins of sub-blocks 2c and 2c+1 of a Q4_K/Q5_K block (sc, m: 2c's in the
 * low byte, 2c+1's in the next), from the 12 scale bytes as three words (layout in
 * docs/kernels.md): sub-blocks 0..3 keep theirs in the low 6 bits of bytes j and j+4; 4..7 split
 * theirs between a nibble of byte j+4 and the top two bits of bytes j-4 (scale) and j (min).
 * Branch-free, since the lanes of a warp hold different c. */
static HD void kq_scale_bits(uint32_t s0, uint32_t s1, uint32_t s2, int c, uint32_t *sc,
                             uint32_t *m)
{
    /* Sub-blocks 2c and 2c+1 use bytes 2(c & 1) and 2(c & 1) + 1 of each word: both at once, in
     * the low 16 bits, the two bytes' fields assembled side by side. */
    const int sh = 16 * (c & 1);
    const uint32_t h0 = s0 >> sh, h1 = s1 >> sh, h2 = s2 >> sh;
    const uint32_t lo_sc = h0 & 0x3f3fu, lo_m = h1 & 0x3f3fu;
    const uint32_t hi_sc = (h2 & 0x0f0fu) | ((h0 >> 2) & 0x3030u);
    const uint32_t hi_m = ((h2 >> 4) & 0x0f0fu) | ((h1 >> 2) & 0x3030u);
    *sc = c < 2 ? lo_sc : hi_sc;
    *m = c < 2 ? lo_m : hi_m;
}

/* The same as floats: d·sc and dmin·m of sub-blocks 2c (d0, n0) and 2c+1 (d1, n1). */
static HD void kq_scales(uint32_t s0, uint32_t s1, uint32_t s2, int c, float d, float dmin,
                         float *d0, float *n0, float *d1, float *n1)
{
    uint32_t sc, m;
    kq_scale_bits(s0, s1, s2, c, &sc, &m);
    *d0 = d * (float)(int)(sc & 0xffu);
    *n0 = dmin * (float)(int)(m & 0xffu);
    *d1 = d * (float)(int)(sc >> 8 & 0xffu);
    *n1 = dmin * (float)(int)(m >> 8 & 0xffu);
}

/* The x elements of a Q4_K/Q5_K unit t (chunk c = t/2, l0 = 16·(t%2)): the 16 that its low
 * nibbles multiply (elements 64c + l0 + i, sub-block 2c) in xl, the 16 of its high nibbles
 * (64c + 32 + l0 + i, sub-block 2c+1) in xh, and their sums. */
template <class XL>
static HD void kq_unit_x(const XL &xin, const float *xb, int t, float *xl, float *xh, float *sxl,
                         float *sxh)
{
    const int c = t >> 1, l0 = (t & 1) * 16;
    const float *xlp = xb + 64 * c + l0, *xhp = xlp + 32;
    UNROLL
    for (int i = 0; i < 4; i++) {
        float4 a = xin.ld4(xlp + 4 * i), e = xin.ld4(xhp + 4 * i);
        xl[4 * i] = a.x, xl[4 * i + 1] = a.y, xl[4 * i + 2] = a.z, xl[4 * i + 3] = a.w;
        xh[4 * i] = e.x, xh[4 * i + 1] = e.y, xh[4 * i + 2] = e.z, xh[4 * i + 3] = e.w;
    }
    float l = 0.0f, h = 0.0f;
    UNROLL
    for (int i = 0; i < 16; i++) {
        l += xl[i];
        h += xh[i];
    }
    *sxl = l;
    *sxh = h;
}

/* The bytes of block b that Q4_K/Q5_K unit t reads, loaded apart from their decoding
 * (kq_unit_decode) so that a walk of several rows has every row's loads in flight before the
 * first row's arithmetic: the 16-byte header (d, dmin and the 12 scale bytes; the block and so
 * the header are 16-byte aligned), the unit's 16 bytes of qs and, for Q5_K, of qh. */
struct kq_raw {
    uint4 hdr, qv, hv;
};
static_assert(OFF(q4_k, d) == 0 && OFF(q4_k, dmin) == 2 && OFF(q4_k, scales) == 4 &&
                  OFF(q5_k, d) == 0 && OFF(q5_k, dmin) == 2 && OFF(q5_k, scales) == 4,
              "the Q4_K/Q5_K header is d, dmin, scales[12]");

template <int K>
static HD void kq_unit_load(const uint8_t *b, int t, kq_raw *r)
{
    const int c = t >> 1, l0 = (t & 1) * 16;
    r->hdr = *(const uint4 *)b;
    if constexpr (K == MOE_TYPE_Q5_K) {
        r->qv = *(const uint4 *)(b + OFF(q5_k, qs) + 32 * c + l0);
        r->hv = *(const uint4 *)(b + OFF(q5_k, qh) + l0);
    } else {
        r->qv = *(const uint4 *)(b + OFF(q4_k, qs) + 32 * c + l0);
        r->hv = make_uint4(0, 0, 0, 0);
    }
}

/* Unit t's part of a block from its loaded bytes: the scales and mins of sub-blocks 2c and
 * 2c+1 (kq_scales) and their codes, four per word (one per byte): lo[i] for xl[4i..4i+3], hi[i]
 * for xh (Q5_K's fifth bits included). */
template <int K>
static HD void kq_unit_decode(const kq_raw &raw, int t, float *d0, float *n0, float *d1,
                              float *n1, uint32_t *lo, uint32_t *hi)
{
    const int c = t >> 1;
    kq_scales(raw.hdr.y, raw.hdr.z, raw.hdr.w, c, h2f((uint16_t)(raw.hdr.x & 0xffffu)),
              h2f((uint16_t)(raw.hdr.x >> 16)), d0, n0, d1, n1);
    const uint32_t qs[4] = {raw.qv.x, raw.qv.y, raw.qv.z, raw.qv.w},
                   hs[4] = {raw.hv.x, raw.hv.y, raw.hv.z, raw.hv.w};
    UNROLL
    for (int i = 0; i < 4; i++) {
        lo[i] = qs[i] & 0x0f0f0f0fu;
        hi[i] = (qs[i] >> 4) & 0x0f0f0f0fu;
        if constexpr (K == MOE_TYPE_Q5_K) {
            lo[i] |= ((hs[i] >> (2 * c)) & 0x01010101u) << 4;
            hi[i] |= ((hs[i] >> (2 * c + 1)) & 0x01010101u) << 4;
        }
    }
}

/* Block b's part of Q4_K/Q5_K unit t (kq_unit_load, then kq_unit_decode). */
template <int K>
static HD void kq_unit_row(const uint8_t *b, int t, float *d0, float *n0, float *d1, float *n1,
                           uint32_t *lo, uint32_t *hi)
{
    kq_raw raw;
    kq_unit_load<K>(b, t, &raw);
    kq_unit_decode<K>(raw, t, d0, n0, d1, n1, lo, hi);
}

/* The x elements of Q6_K unit t (half h = t/8, l0 = 4·(t%8)): element 128h + 32g + l0 + k in
 * xs[4g + k] for g, k < 4. */
template <class XL>
static HD void q6k_unit_x(const XL &xin, const float *xb, int t, float *xs)
{
    const float *x0 = xb + 128 * (t >> 3) + (t & 7) * 4;
    UNROLL
    for (int g = 0; g < 4; g++) {
        const float4 v = xin.ld4(x0 + 32 * g);
        xs[4 * g] = v.x, xs[4 * g + 1] = v.y, xs[4 * g + 2] = v.z, xs[4 * g + 3] = v.w;
    }
}

/* The bytes of block b that Q6_K unit t reads (h = t/8, l0 = 4·(t%8)), loaded apart from their
 * decoding, as kq_unit_load: four bytes each of ql[l0..], ql[32+l0..] and qh[l0..] (the block is
 * only 2-byte aligned in a row), the four scales of its groups and d. */
struct q6k_raw {
    uint32_t qa, qb, hh;
    int8_t sc[4];
    uint16_t d;
};

static HD void q6k_unit_load(const uint8_t *b, int t, q6k_raw *r)
{
    const int h = t >> 3, l0 = (t & 7) * 4;
    const uint8_t *ql = b + OFF(q6_k, ql) + 64 * h, *qhp = b + OFF(q6_k, qh) + 32 * h;
    r->qa = ld32a2(ql + l0);
    r->qb = ld32a2(ql + 32 + l0);
    r->hh = ld32a2(qhp + l0);
    const int8_t *sc = (const int8_t *)(b + OFF(q6_k, scales) + 8 * h) + l0 / 16;
    UNROLL
    for (int g = 0; g < 4; g++)
        r->sc[g] = sc[2 * g];
    r->d = ld16(b + OFF(q6_k, d));
}

/* Q6_K unit t's 6-bit codes of group g (four per word) in q[g], whose scale is raw.sc[g]. The
 * low 4 bits come from ql[l0+k] (g = 0, 2: low/high nibble) or ql[32+l0+k] (g = 1, 3), the top
 * 2 from bits 2g..2g+1 of qh[l0+k]. */
static HD void q6k_unit_decode(const q6k_raw &raw, uint32_t *q)
{
    const uint32_t qa = raw.qa, qb = raw.qb, hh = raw.hh;
    q[0] = (qa & 0x0f0f0f0fu) | ((hh << 4) & 0x30303030u);
    q[1] = (qb & 0x0f0f0f0fu) | ((hh << 2) & 0x30303030u);
    q[2] = ((qa >> 4) & 0x0f0f0f0fu) | (hh & 0x30303030u);
    q[3] = ((qb >> 4) & 0x0f0f0f0fu) | ((hh >> 2) & 0x30303030u);
}

/* Block b's part of Q6_K unit t: the codes of group g in q[g], whose scale is (*sc)[2g], and
 * the block's d. */
static HD void q6k_unit_row(const uint8_t *b, int t, uint32_t *q, const int8_t **sc, float *d)
{
    const int h = t >> 3, l0 = (t & 7) * 4;
    q6k_raw raw;
    q6k_unit_load(b, t, &raw);
    q6k_unit_decode(raw, q);
    *sc = (const int8_t *)(b + OFF(q6_k, scales) + 8 * h) + l0 / 16;
    *d = h2f(raw.d);
}

/* Units per block and elements per block, by kind. */
template <int K> struct unit_shape;
template <> struct unit_shape<MOE_TYPE_F32> { enum { per_block = 1, blck = 1 }; };
template <> struct unit_shape<KIND_F32_V> { enum { per_block = 1, blck = 4 }; };
template <> struct unit_shape<MOE_TYPE_F16> { enum { per_block = 1, blck = 1 }; };
template <> struct unit_shape<KIND_F16_V> { enum { per_block = 1, blck = 8 }; };
template <> struct unit_shape<MOE_TYPE_BF16> { enum { per_block = 1, blck = 1 }; };
template <> struct unit_shape<KIND_BF16_V> { enum { per_block = 1, blck = 8 }; };
template <> struct unit_shape<MOE_TYPE_Q8_0> { enum { per_block = 4, blck = 32 }; };
template <> struct unit_shape<MOE_TYPE_Q4_0> { enum { per_block = 4, blck = 32 }; };
template <> struct unit_shape<MOE_TYPE_Q5_0> { enum { per_block = 4, blck = 32 }; };
template <> struct unit_shape<MOE_TYPE_Q4_1> { enum { per_block = 4, blck = 32 }; };
template <> struct unit_shape<MOE_TYPE_Q5_1> { enum { per_block = 4, blck = 32 }; };
template <> struct unit_shape<MOE_TYPE_Q4_K> { enum { per_block = 8, blck = 256 }; };
template <> struct unit_shape<MOE_TYPE_Q5_K> { enum { per_block = 8, blck = 256 }; };
template <> struct unit_shape<MOE_TYPE_Q6_K> { enum { per_block = 16, blck = 256 }; };

/* The K-quant walks of up to MOE_ROWS_LOAD_FIRST rows load every row's bytes of a unit before
 * the first row's arithmetic; longer ones load each row's just before its own. 0 by default:
 * loading first (4 or 8) measured 1.6-2% faster at 4 to 64 sequences but 1.3% slower at one
 * (docs/benchmarks.md). The floats are the same either way; a build option for measurements. */
#ifndef MOE_ROWS_LOAD_FIRST
#define MOE_ROWS_LOAD_FIRST 0
#endif
#define MOE_LOAD_FIRST(RW) ((RW) <= MOE_ROWS_LOAD_FIRST)

/* A 16-byte float32 unit's dot product with its four inputs, in one fixed order. */
static HD float f32v_dot(float4 w, float4 x)
{
    return w.x * x.x + w.y * x.y + w.z * x.z + w.w * x.w;
}

/* A Q4_K/Q5_K unit's share of a row's dot product against its inputs (kq_unit_x: xl, xh and
 * their sums): the fma chains of its two halves over the biased codes (wl(j), wh(j): code j of
 * the low and high half as code_f gives it), Σq·x of each half from them, then
 * d0·sc·Σq·x − dmin·m·Σx of each. Every walk of these rows computes a unit here, so a
 * (row, token) gets the same floats whichever walk computes it. */
template <class WL, class WH>
static HD float kq_halves(WL wl, WH wh, float d0, float n0, float d1, float n1, const float *xl,
                          const float *xh, float sxl, float sxh)
{
    float ql = 0.0f, qh = 0.0f;
    UNROLL
    for (int j = 0; j < 16; j++) {
        ql = fmaf(wl(j), xl[j], ql);
        qh = fmaf(wh(j), xh[j], qh);
    }
    const float sl = fmaf(-128.0f, sxl, 256.0f * ql), sh = fmaf(-128.0f, sxh, 256.0f * qh);
    return d0 * sl - n0 * sxl + (d1 * sh - n1 * sxh);
}

/* A Q4_K/Q5_K row's unit t from its loaded bytes against the unit's inputs (kq_unit_x): its
 * share of the row's dot product, d0·sc·Σq·x − dmin·m·Σx of each half. */
template <int K>
static HD float kq_unit_sum(const kq_raw &raw, int t, const float *xl, const float *xh, float sxl,
                            float sxh)
{
    float d0, n0, d1, n1;
    uint32_t lo[4], hi[4];
    kq_unit_decode<K>(raw, t, &d0, &n0, &d1, &n1, lo, hi);
    const uint32_t mg = code_magic();
    return kq_halves([&](int j) { return code_f(lo[j >> 2], j & 3, mg); },
                     [&](int j) { return code_f(hi[j >> 2], j & 3, mg); }, d0, n0, d1, n1, xl, xh,
                     sxl, sxh);
}

/* Q6_K unit t's inputs (q6k_unit_x) and the sums of its four groups. */
template <class XL>
static HD void q6k_unit_xs(const XL &xin, const float *xb, int t, float *xs, float *sx)
{
    q6k_unit_x(xin, xb, t, xs);
    UNROLL
    for (int g = 0; g < 4; g++)
        sx[g] = xs[4 * g] + xs[4 * g + 1] + xs[4 * g + 2] + xs[4 * g + 3];
}

/* A Q6_K group's term added to a unit's sum: Σ(q − 32)·x from the biased codes' fma chain sg
 * (256·sg − (128 + 32)·Σx) times the group's scale. Every walk of Q6_K rows adds its groups
 * here. */
static HD float q6k_group_add(int8_t sc, float sg, float sx, float sum)
{
    return fmaf((float)sc, fmaf(-160.0f, sx, 256.0f * sg), sum);
}

/* A Q6_K unit's four groups against its inputs (q6k_unit_xs), before d: each group's fma chain
 * over its biased codes (w(g, k): code k of group g as code_f gives it), added by
 * q6k_group_add. */
template <class W>
static HD float q6k_groups(W w, const int8_t *sc, const float *xs, const float *sx)
{
    float sum = 0.0f;
    UNROLL
    for (int g = 0; g < 4; g++) {
        float sg = 0.0f;
        UNROLL
        for (int k = 0; k < 4; k++)
            sg = fmaf(w(g, k), xs[4 * g + k], sg);
        sum = q6k_group_add(sc[g], sg, sx[g], sum);
    }
    return sum;
}

/* A Q6_K row's unit from its loaded bytes against the unit's inputs (q6k_unit_xs); mg is
 * code_magic(), taken once for all the rows of a unit. */
static HD float q6k_unit_sum(const q6k_raw &raw, const float *xs, const float *sx, uint32_t mg)
{
    uint32_t q[4];
    q6k_unit_decode(raw, q);
    const float d = h2f(raw.d);
    return d * q6k_groups([&](int g, int k) { return code_f(q[g], k, mg); }, raw.sc, xs, sx);
}

/* Kinds whose units tok_unit_dots takes. */
template <int K> __host__ __device__ constexpr bool tok_kind()
{
    return K == MOE_TYPE_Q4_K || K == MOE_TYPE_Q5_K || K == MOE_TYPE_Q6_K;
}

/* Adds to acc[i][r] unit t of the blocks at bs[r] (r < RW) against token i's x elements of that
 * block (xb + i·ldx, read through xin; tokens from nt on read token 0's), for i < T: each code
 * converted to a float once (code_f) for all T tokens, then the operations of unit_dot for each
 * (row, token): the same fma chains in the same order, the inputs' sums as kq_unit_x and
 * q6k_unit_xs add them, the same chains and tails (kq_halves, q6k_groups). mg is code_magic(). */
template <int K, int RW, int T, class XL = XPlain>
static HD void tok_unit_dots(const uint8_t *const *bs, int t, const float *xb, int64_t ldx, int nt,
                             uint32_t mg, float (*acc)[RW], const XL &xin = XL())
{
    static_assert(tok_kind<K>(), "Q4_K, Q5_K and Q6_K rows");
    if constexpr (K == MOE_TYPE_Q6_K) {
        q6k_raw raw[RW];
        UNROLL
        for (int r = 0; r < RW; r++)
            q6k_unit_load(bs[r], t, &raw[r]);
        float w[RW][16];
        UNROLL
        for (int r = 0; r < RW; r++) {
            uint32_t q[4];
            q6k_unit_decode(raw[r], q);
            UNROLL
            for (int g = 0; g < 4; g++)
                UNROLL
                for (int k = 0; k < 4; k++)
                    w[r][4 * g + k] = code_f(q[g], k, mg);
        }
        UNROLL
        for (int i = 0; i < T; i++) {
            float xs[16], sx[4];
            q6k_unit_xs(xin, xb + (int64_t)(i < nt ? i : 0) * ldx, t, xs, sx);
            UNROLL
            for (int r = 0; r < RW; r++)
                acc[i][r] += h2f(raw[r].d) *
                             q6k_groups([&](int g, int k) { return w[r][4 * g + k]; }, raw[r].sc,
                                        xs, sx);
        }
    } else {
        kq_raw raw[RW];
        UNROLL
        for (int r = 0; r < RW; r++)
            kq_unit_load<K>(bs[r], t, &raw[r]);
        float d0[RW], n0[RW], d1[RW], n1[RW];
        uint32_t lo[RW][4], hi[RW][4];
        UNROLL
        for (int r = 0; r < RW; r++)
            kq_unit_decode<K>(raw[r], t, &d0[r], &n0[r], &d1[r], &n1[r], lo[r], hi[r]);
        float wl[RW][16], wh[RW][16];
        UNROLL
        for (int r = 0; r < RW; r++)
            UNROLL
            for (int j = 0; j < 4; j++)
                UNROLL
                for (int k = 0; k < 4; k++) {
                    wl[r][4 * j + k] = code_f(lo[r][j], k, mg);
                    wh[r][4 * j + k] = code_f(hi[r][j], k, mg);
                }
        UNROLL
        for (int i = 0; i < T; i++) {
            float xl[16], xh[16], sxl, sxh;
            kq_unit_x(xin, xb + (int64_t)(i < nt ? i : 0) * ldx, t, xl, xh, &sxl, &sxh);
            UNROLL
            for (int r = 0; r < RW; r++)
                acc[i][r] += kq_halves([&](int j) { return wl[r][j]; },
                                       [&](int j) { return wh[r][j]; }, d0[r], n0[r], d1[r],
                                       n1[r], xl, xh, sxl, sxh);
        }
    }
}

/* Adds to acc[r], for r < RW, the partial dot product of unit t (0 <= t < per_block) of the
 * block at bs[r] with xb, the x elements of that block (the RW rows may be of one matrix or of
 * several of the same type). The x values (and, for the K-quants,
 * their sums) are loaded once for all RW rows. */
template <int K, int RW, class XL = XPlain>
static HD void unit_dot(const uint8_t *const *bs, int t, const float *xb, float *acc,
                        const XL &xin = XL())
{
    const uint8_t *b0 = bs[0];
    if constexpr (K == MOE_TYPE_F32) {
        acc[0] += *(const float *)b0 * xin.ld1(xb);
    } else if constexpr (K == KIND_F32_V) {
        acc[0] += f32v_dot(*(const float4 *)b0, xin.ld4(xb));
    } else if constexpr (K == MOE_TYPE_F16) {
        acc[0] += h2f(ld16(b0)) * xin.ld1(xb);
    } else if constexpr (K == MOE_TYPE_BF16) {
        acc[0] += bf2f(ld16(b0)) * xin.ld1(xb);
    } else if constexpr (K == KIND_F16_V || K == KIND_BF16_V) {
        uint4 w = *(const uint4 *)b0;
        float4 x0 = xin.ld4(xb), x1 = xin.ld4(xb + 4);
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
        const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        float a = 0.0f;
        UNROLL
        for (int i = 0; i < 4; i++) {
            float lo, hi;
            if constexpr (K == KIND_F16_V) {
                lo = h2f((uint16_t)(ws[i] & 0xffff));
                hi = h2f((uint16_t)(ws[i] >> 16));
            } else {
                lo = bf2f(ws[i] & 0xffff);
                hi = bf2f(ws[i] >> 16);
            }
            a = fmaf(lo, xs[2 * i], a);
            a = fmaf(hi, xs[2 * i + 1], a);
        }
        acc[0] += a;
    } else if constexpr (K == MOE_TYPE_Q8_0) {
        /* half d; int8 qs[32]. Unit t: elements 8t..8t+7. Flipping the sign bits maps each
         * int8 q to q + 128 in 0..255. */
        float4 x0 = xin.ld4(xb + 8 * t), x1 = xin.ld4(xb + 8 * t + 4);
        const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        UNROLL
        for (int r = 0; r < RW; r++) {
            const uint8_t *b = bs[r], *q = b + OFF(q8_0, qs) + 8 * t;
            uint32_t w0 = ld32a2(q) ^ 0x80808080u, w1 = ld32a2(q + 4) ^ 0x80808080u;
            float sq = 0.0f;
            UNROLL
            for (int k = 0; k < 4; k++) {
                sq = fmaf(byte_f(w0, k, 128.0f), xs[k], sq);
                sq = fmaf(byte_f(w1, k, 128.0f), xs[4 + k], sq);
            }
            acc[r] += h2f(ld16(b + OFF(q8_0, d))) * sq;
        }
    } else if constexpr (K == MOE_TYPE_Q4_1 || K == MOE_TYPE_Q5_1) {
        /* Q4_1: half d, m; u8 qs[16]. Q5_1: half d, m; u32 qh; u8 qs[16]. Value d·q + m; units as
         * for Q4_0/Q5_0, the sum is d·Σq·x + m·Σx. */
        float4 xl = xin.ld4(xb + 4 * t), xh = xin.ld4(xb + 16 + 4 * t);
        const float xls[4] = {xl.x, xl.y, xl.z, xl.w}, xhs[4] = {xh.x, xh.y, xh.z, xh.w};
        const float sx = xl.x + xl.y + xl.z + xl.w + (xh.x + xh.y + xh.z + xh.w);
        UNROLL
        for (int r = 0; r < RW; r++) {
            const uint8_t *b = bs[r];
            uint32_t qs, lo, hi;
            if constexpr (K == MOE_TYPE_Q5_1) {
                uint32_t qh = ld32a2(b + OFF(q5_1, qh));
                qs = ld32a2(b + OFF(q5_1, qs) + 4 * t);
                uint32_t bl = (qh >> (4 * t)) & 15, bh = (qh >> (4 * t + 16)) & 15;
                uint32_t sl = (bl & 1) | (bl & 2) << 7 | (bl & 4) << 14 | (bl & 8) << 21;
                uint32_t sh = (bh & 1) | (bh & 2) << 7 | (bh & 4) << 14 | (bh & 8) << 21;
                lo = (qs & 0x0f0f0f0fu) | sl << 4;
                hi = ((qs >> 4) & 0x0f0f0f0fu) | sh << 4;
            } else {
                qs = ld32a2(b + OFF(q4_1, qs) + 4 * t);
                lo = qs & 0x0f0f0f0fu;
                hi = (qs >> 4) & 0x0f0f0f0fu;
            }
            float sq = 0.0f;
            UNROLL
            for (int k = 0; k < 4; k++) {
                sq = fmaf(byte_f(lo, k, 0.0f), xls[k], sq);
                sq = fmaf(byte_f(hi, k, 0.0f), xhs[k], sq);
            }
            acc[r] += h2f(ld16(b + OFF(q4_1, d))) * sq + h2f(ld16(b + OFF(q4_1, m))) * sx;
        }
    } else if constexpr (K == MOE_TYPE_Q4_0 || K == MOE_TYPE_Q5_0) {
        /* Q4_0: half d; u8 qs[16]. Q5_0: half d; u32 qh; u8 qs[16]. Unit t: bytes qs[4t..4t+3],
         * i.e. elements 4t..4t+3 (low nibbles) and 16+4t..16+4t+3 (high nibbles); the 5th bits
         * are bits 4t.. and 4t+16.. of qh, spread here into bit 4 of each byte. */
        float4 xl = xin.ld4(xb + 4 * t), xh = xin.ld4(xb + 16 + 4 * t);
        const float xls[4] = {xl.x, xl.y, xl.z, xl.w}, xhs[4] = {xh.x, xh.y, xh.z, xh.w};
        UNROLL
        for (int r = 0; r < RW; r++) {
            const uint8_t *b = bs[r];
            uint32_t qs, lo, hi;
            float off = 8.0f;
            if constexpr (K == MOE_TYPE_Q5_0) {
                uint32_t qh = ld32a2(b + OFF(q5_0, qh));
                qs = ld32a2(b + OFF(q5_0, qs) + 4 * t);
                uint32_t bl = (qh >> (4 * t)) & 15, bh = (qh >> (4 * t + 16)) & 15;
                uint32_t sl = (bl & 1) | (bl & 2) << 7 | (bl & 4) << 14 | (bl & 8) << 21;
                uint32_t sh = (bh & 1) | (bh & 2) << 7 | (bh & 4) << 14 | (bh & 8) << 21;
                lo = (qs & 0x0f0f0f0fu) | sl << 4;
                hi = ((qs >> 4) & 0x0f0f0f0fu) | sh << 4;
                off = 16.0f;
            } else {
                qs = ld32a2(b + OFF(q4_0, qs) + 4 * t);
                lo = qs & 0x0f0f0f0fu;
                hi = (qs >> 4) & 0x0f0f0f0fu;
            }
            float sq = 0.0f;
            UNROLL
            for (int k = 0; k < 4; k++) {
                sq = fmaf(byte_f(lo, k, off), xls[k], sq);
                sq = fmaf(byte_f(hi, k, off), xhs[k], sq);
            }
            acc[r] += h2f(ld16(b + OFF(q4_0, d))) * sq; /* Q5_0's d is there too */
        }
    } else if constexpr (K == MOE_TYPE_Q4_K || K == MOE_TYPE_Q5_K) {
        /* half d, dmin; u8 scales[12]; (Q5_K: u8 qh[32];) u8 qs[128]. Unit t: 16 bytes of qs
         * (kq_unit_x, kq_unit_load, kq_unit_decode). Per sub-block the sum is d·sc·Σq·x − dmin·m·Σx. */
        /* Every row's bytes are loaded before the first row's arithmetic (else the compiler
         * issues each row's loads after the previous row's products: one memory latency per
         * row instead of one per unit). */
        kq_raw raw[RW];
        UNROLL
        for (int r = 0; r < RW; r++)
            if constexpr (MOE_LOAD_FIRST(RW))
                kq_unit_load<K>(bs[r], t, &raw[r]);
        float xl[16], xh[16], sxl, sxh;
        kq_unit_x(xin, xb, t, xl, xh, &sxl, &sxh);
        UNROLL
        for (int r = 0; r < RW; r++) {
            if constexpr (!MOE_LOAD_FIRST(RW))
                kq_unit_load<K>(bs[r], t, &raw[r]);
            acc[r] += kq_unit_sum<K>(raw[r], t, xl, xh, sxl, sxh);
        }
    } else if constexpr (K == MOE_TYPE_Q6_K) {
        /* u8 ql[128]; u8 qh[64]; i8 scales[16]; half d. Unit t: 16 elements in 4 groups
         * (q6k_unit_x, q6k_unit_load, q6k_unit_decode). */
        q6k_raw raw[RW]; /* every row's loads in flight first, as for Q4_K */
        UNROLL
        for (int r = 0; r < RW; r++)
            if constexpr (MOE_LOAD_FIRST(RW))
                q6k_unit_load(bs[r], t, &raw[r]);
        float xs[16], sx[4];
        q6k_unit_xs(xin, xb, t, xs, sx);
        const uint32_t mg = code_magic();
        UNROLL
        for (int r = 0; r < RW; r++) {
            if constexpr (!MOE_LOAD_FIRST(RW))
                q6k_unit_load(bs[r], t, &raw[r]);
            acc[r] += q6k_unit_sum(raw[r], xs, sx, mg);
        }
    }
}

/* Rows per warp: the quantized types decode each x element into two rows' products, which
 * halves the x traffic through L1 (4 bytes of x per element against 0.56-1.06 bytes of weights)
 * and puts two rows' weight loads in flight per lane. The plain types already run at HBM speed
 * with one. */
template <int K> __host__ __device__ constexpr int rows_per_warp()
{
    return K == MOE_TYPE_F32 || K == MOE_TYPE_F16 || K == MOE_TYPE_BF16 || K >= KIND_F32_V ? 1 : 2;
}


/* The stored type of a kind (the vector kinds read plain types 16 bytes at a time). */
static constexpr uint32_t kind_type(int K)
{
    return K == KIND_F32_V ? MOE_TYPE_F32 : K == KIND_F16_V ? MOE_TYPE_F16
                                          : K == KIND_BF16_V ? MOE_TYPE_BF16 : (uint32_t)K;
}

/* ---------------------------------------------------------------- int8 activations */

/* An opt-in decode for the rows of the expert kernels (MOE_Q8_ROWS, a compile-time setting; 0,
 * the default, keeps every product in float): a lane quantises its unit's x values to int8 with
 * one scale per 16 of them (8 for Q8_0) and multiplies them with the codes four at a time
 * (dp4a), so the per-element work is shared by four elements. It applies to the K-quants and
 * Q8_0 in row walks of at least MOE_Q8_ROWS rows, where the quantisation is spread over the
 * rows: the expert kernels (4 to 8 rows), never the mat-vecs (2). Its floats are no longer the
 * float path's (the activations are rounded to 8 bits, as llama.cpp's CUDA mat-vec does), so a
 * build with it is held to the parity thresholds, not to the float path's 1e-5. */
#ifndef MOE_Q8_ROWS
#define MOE_Q8_ROWS 0
#endif

template <int K> __host__ __device__ constexpr bool q8_kind()
{
    return K == MOE_TYPE_Q4_K || K == MOE_TYPE_Q5_K || K == MOE_TYPE_Q6_K || K == MOE_TYPE_Q8_0;
}

/* The types the int8 walks take in a build with MOE_Q8_ROWS (bits: 1 Q4_K, 2 Q5_K, 4 Q6_K,
 * 8 Q8_0; all by default), to tell one decoder's error from another's. */
#ifndef MOE_Q8_TYPES
#define MOE_Q8_TYPES 15
#endif

template <int K> __host__ __device__ constexpr bool q8_enabled()
{
    return (K == MOE_TYPE_Q4_K && (MOE_Q8_TYPES & 1)) || (K == MOE_TYPE_Q5_K && (MOE_Q8_TYPES & 2)) ||
           (K == MOE_TYPE_Q6_K && (MOE_Q8_TYPES & 4)) || (K == MOE_TYPE_Q8_0 && (MOE_Q8_TYPES & 8));
}

template <int K, int RW> __host__ __device__ constexpr bool q8_rows()
{
    return MOE_Q8_ROWS > 0 && RW >= MOE_Q8_ROWS && q8_kind<K>() && q8_enabled<K>();
}

/* Σ of the four products of the signed bytes of a and b, plus c. */
static HD int dp4a_s8(uint32_t a, uint32_t b, int c)
{
#ifdef __CUDA_ARCH__
    return __dp4a((int)a, (int)b, c);
#else
    for (int k = 0; k < 4; k++)
        c += (int)(int8_t)(uint8_t)(a >> (8 * k)) * (int)(int8_t)(uint8_t)(b >> (8 * k));
    return c;
#endif
}

/* v[0..N) as int8 q = round(v·127/max|v|), packed four to a word (element 4j + k in byte k of
 * w[j]); returns the scale max|v|/127 (v ≈ scale·q; 0 when v is all zero). */
template <int N>
static HD float q8_pack(const float *v, uint32_t *w)
{
    /* max |v| as the largest of the bit patterns without the sign: the order of non-negative
     * floats, and a NaN is larger than any of them, so it makes the scale NaN (fmaxf would drop
     * it and the NaN would vanish from the product). */
    uint32_t abits = 0;
    UNROLL
    for (int i = 0; i < N; i++) {
        uint32_t u;
        memcpy(&u, &v[i], sizeof u);
        u &= 0x7fffffffu;
        abits = u > abits ? u : abits;
    }
    float amax;
    memcpy(&amax, &abits, sizeof amax);
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    /* v·id rounded to the nearest integer (ties to even) by one FMA: adding 1.5·2^23 leaves
     * that integer in the low mantissa bits, so byte 0 of the float's bits is its two's
     * complement; the bytes are then gathered by permutes (no int conversions). */
    UNROLL
    for (int j = 0; j < N / 4; j++) {
        uint32_t b[4];
        UNROLL
        for (int k = 0; k < 4; k++) {
            const float f = fmaf(v[4 * j + k], id, 12582912.0f);
            memcpy(&b[k], &f, sizeof f);
        }
#ifdef __CUDA_ARCH__
        w[j] = __byte_perm(__byte_perm(b[0], b[1], 0x0040u), __byte_perm(b[2], b[3], 0x0040u),
                           0x5410u);
#else
        w[j] = (b[0] & 0xffu) | (b[1] & 0xffu) << 8 | (b[2] & 0xffu) << 16 | (b[3] & 0xffu) << 24;
#endif
    }
    return amax * (1.0f / 127.0f);
}

/* unit_dot's contract (the same units, rows and x) with int8 activations, for q8_kind types. */
template <int K, int RW, class XL = XPlain>
static HD void unit_dot_q8(const uint8_t *const *bs, int t, const float *xb, float *acc,
                           const XL &xin = XL())
{
    static_assert(q8_kind<K>(), "int8 activations are for the K-quants and Q8_0");
    if constexpr (K == MOE_TYPE_Q8_0) {
        const float4 x0 = xin.ld4(xb + 8 * t), x1 = xin.ld4(xb + 8 * t + 4);
        const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        uint32_t xq[2];
        const float dx = q8_pack<8>(xs, xq);
        UNROLL
        for (int r = 0; r < RW; r++) {
            const uint8_t *b = bs[r], *q = b + OFF(q8_0, qs) + 8 * t;
            const int sq = dp4a_s8(ld32a2(q + 4), xq[1], dp4a_s8(ld32a2(q), xq[0], 0));
            acc[r] += h2f(ld16(b + OFF(q8_0, d))) * dx * (float)sq;
        }
    } else if constexpr (K == MOE_TYPE_Q4_K || K == MOE_TYPE_Q5_K) {
        float xl[16], xh[16], sxl, sxh;
        kq_unit_x(xin, xb, t, xl, xh, &sxl, &sxh);
        uint32_t ql8[4], qh8[4];
        const float dl = q8_pack<16>(xl, ql8), dh = q8_pack<16>(xh, qh8);
        /* The mins multiply the sums of the rounded x, as the codes do: the rounding errors then
         * meet the dequantised weights (centred), not the codes alone (all >= 0, whose mean part
         * the exact Σx would leave uncancelled: about twice the error). */
        int il0 = 0, ih0 = 0;
        UNROLL
        for (int i = 0; i < 4; i++) {
            il0 = dp4a_s8(0x01010101u, ql8[i], il0);
            ih0 = dp4a_s8(0x01010101u, qh8[i], ih0);
        }
        sxl = dl * (float)il0;
        sxh = dh * (float)ih0;
        UNROLL
        for (int r = 0; r < RW; r++) {
            float d0, n0, d1, n1;
            uint32_t lo[4], hi[4];
            kq_unit_row<K>(bs[r], t, &d0, &n0, &d1, &n1, lo, hi);
            int il = 0, ih = 0;
            UNROLL
            for (int i = 0; i < 4; i++) {
                il = dp4a_s8(lo[i], ql8[i], il);
                ih = dp4a_s8(hi[i], qh8[i], ih);
            }
            acc[r] += d0 * (dl * (float)il) - n0 * sxl + (d1 * (dh * (float)ih) - n1 * sxh);
        }
    } else {
        /* Q6_K: the unit's 16 elements (4 groups of 4) share one scale; Σ(q − 32)·x per group
         * from Σq·xq − 32·Σxq. */
        float xs[16];
        q6k_unit_x(xin, xb, t, xs);
        uint32_t xq[4];
        const float dx = q8_pack<16>(xs, xq);
        int sxq[4];
        UNROLL
        for (int g = 0; g < 4; g++)
            sxq[g] = dp4a_s8(0x01010101u, xq[g], 0);
        UNROLL
        for (int r = 0; r < RW; r++) {
            uint32_t q[4];
            const int8_t *sc;
            float d;
            q6k_unit_row(bs[r], t, q, &sc, &d);
            int isum = 0;
            UNROLL
            for (int g = 0; g < 4; g++)
                isum += (int)sc[2 * g] * (dp4a_s8(q[g], xq[g], 0) - 32 * sxq[g]);
            acc[r] += d * dx * (float)isum;
        }
    }
}

/* The quantized types unit_dot decodes, as X(type) for each: the cases of a switch that
 * instantiates a template per type. */
#define MOE_QDOT_TYPES(X)                                                                  \
    X(MOE_TYPE_Q8_0) X(MOE_TYPE_Q4_0) X(MOE_TYPE_Q4_1) X(MOE_TYPE_Q5_0) X(MOE_TYPE_Q5_1)   \
    X(MOE_TYPE_Q4_K) X(MOE_TYPE_Q5_K) X(MOE_TYPE_Q6_K)

/* The plain types as cases of a switch on the type: X(kind) for each, with the kind that reads
 * 16 bytes at a time when vec (every row 16-byte aligned), else the type itself. X returns. */
#define MOE_PLAIN_KINDS(X, vec)                                                            \
    case MOE_TYPE_F32: if (vec) { X(KIND_F32_V) } else { X(MOE_TYPE_F32) }                 \
    case MOE_TYPE_F16: if (vec) { X(KIND_F16_V) } else { X(MOE_TYPE_F16) }                 \
    case MOE_TYPE_BF16: if (vec) { X(KIND_BF16_V) } else { X(MOE_TYPE_BF16) }

/* The weight types unit_dot handles: MOE_QDOT_TYPES and the plain F32, F16, BF16. */
static inline bool moe_qdot_supported(uint32_t t)
{
    switch (t) {
#define MOE_QDOT_CASE_(T) case T:
    MOE_QDOT_TYPES(MOE_QDOT_CASE_)
#undef MOE_QDOT_CASE_
    case MOE_TYPE_F32: case MOE_TYPE_F16: case MOE_TYPE_BF16:
        return true;
    default:
        return false;
    }
}

#endif
