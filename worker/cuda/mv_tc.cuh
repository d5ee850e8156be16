/* The pieces of the tensor-core mat-vec (mv_tc.cu) that run on the host too, so that a host
 * build (tests/test_mv_tc_host.cu) checks the decoding and the placement of every weight and
 * input element in the mma fragments.
 *
 * A warp computes 16 rows (a tile) for up to 8 tokens with mma.m16n8k16 (f16 inputs, f32
 * accumulators): the weights are A (16 rows × 16 k), the tokens' inputs B (16 k × 8 columns, one
 * token a column), so one instruction does 256 multiply-adds per token where the float walk
 * spends about seven instructions per weight. The codes become f16 exactly, and in Q4_K the
 * sub-block scale goes into them: A = sc·q (at most 63·15, exact in f16), made from the code's
 * bits by one HFMA2 per two weights. The inputs are split into two f16 parts, x ≈ hi + lo, and
 * each product is taken for both (two mma with the same A), so the products carry about 22 bits
 * of x, against 24 for the float walk; a token's inputs are first scaled by a power of two that
 * brings the largest into [512, 1024) (so that their sub-block sums fit f16 too, and small
 * inputs keep their precision), undone on the result.
 *
 * Lane l of the warp (g = l/4, t = l%4) holds rows g and g+8 of the tile and, of each of the
 * tile's Q4_K blocks, chunk t: qs bytes 32t..32t+31, whose low nibbles are sub-block 2t and high
 * nibbles sub-block 2t+1 (store/blocks.h). So a lane needs the scales of two sub-blocks per row
 * and block, and its loads are two 16-byte words per row. The k order inside an mma is free as
 * long as A and B share it: mma 2i of a block takes, from lane t, the low nibbles of qs bytes
 * 32t + 4i + {0, 2} as k = 2t, 2t+1 and {1, 3} as k = 2t+8, 2t+9; mma 2i+1 the high nibbles of
 * the same bytes (elements 32 further on). The mins: Σ_j m_j·Σx_j of each row by one
 * mma.m16n8k8 per block, with k the block's 8 sub-blocks (lane t holds m_2t and m_2t+1), and
 * the block's result d·C − dmin·C_min. */
#ifndef MOE_CUDA_MV_TC_CUH
#define MOE_CUDA_MV_TC_CUH

#include "worker/cuda/qdot.cuh"

/* Rows of a tile, k of one mma, mma per Q4_K block. */
#define TC_ROWS 16
#define TC_MMA_PER_BLOCK 16
/* Tokens of a launch column group (the n of the mma). */
#define TC_COLS 8
/* Inputs are scaled below 2^TC_XMAX_LOG2 (their sub-block sums of 32 then stay below 2^15). */
#define TC_XMAX_LOG2 10

static HD uint16_t tc_f2h(float f)
{
    return __half_as_ushort(__float2half_rn(f));
}

static HD uint32_t tc_pack(uint16_t lo, uint16_t hi)
{
    return (uint32_t)lo | (uint32_t)hi << 16;
}

static HD float tc_lo_f(uint32_t v)
{
    return h2f((uint16_t)(v & 0xffffu));
}

static HD float tc_hi_f(uint32_t v)
{
    return h2f((uint16_t)(v >> 16));
}

/* a·b + c on each f16 half, one rounding (HFMA2). The host twin is exact wherever the device one
 * is (every use here has an exact result). */
static HD uint32_t tc_hfma2(uint32_t a, uint32_t b, uint32_t c)
{
#ifdef __CUDA_ARCH__
    __half2 r = __hfma2(*(const __half2 *)&a, *(const __half2 *)&b, *(const __half2 *)&c);
    return *(uint32_t *)&r;
#else
    const double lo = (double)tc_lo_f(a) * tc_lo_f(b) + tc_lo_f(c);
    const double hi = (double)tc_hi_f(a) * tc_hi_f(b) + tc_hi_f(c);
    return tc_pack(tc_f2h((float)lo), tc_f2h((float)hi));
#endif
}

/* The per-block constants of one row for lane t: the HFMA2 operands that turn codes into sc·q
 * (low nibbles: (1024 + q)·sc − 1024·sc; high nibbles, read in place as 1024 + 16q:
 * (1024 + 16q)·sc/16 − 64·sc), the A fragment of the mins (m_2t, m_2t+1) and d, dmin. */
struct tc_q4k_row {
    uint32_t sl, nl, sh, nh, am;
    float d, dmin;
};

static HD uint32_t tc_dup(float f)
{
    const uint16_t h = tc_f2h(f);
    return tc_pack(h, h);
}

static HD tc_q4k_row tc_q4k_consts(const uint4 &hdr, int t)
{
    uint32_t sc, m;
    kq_scale_bits(hdr.y, hdr.z, hdr.w, t, &sc, &m);
    const float s0 = (float)(int)(sc & 0xffu), s1 = (float)(int)(sc >> 8 & 0xffu);
    tc_q4k_row r;
    r.sl = tc_dup(s0);
    r.nl = tc_dup(-1024.0f * s0);
    r.sh = tc_dup(s1 * 0.0625f);
    r.nh = tc_dup(-64.0f * s1);
    r.am = tc_pack(tc_f2h((float)(int)(m & 0xffu)), tc_f2h((float)(int)(m >> 8 & 0xffu)));
    r.d = h2f((uint16_t)(hdr.x & 0xffffu));
    r.dmin = h2f((uint16_t)(hdr.x >> 16));
    return r;
}

/* Word w (qs bytes 4i..4i+3 of the lane's chunk) of one row as four f16 pairs of sc·q: lo0 =
 * bytes 0, 2 low nibbles, lo1 = bytes 1, 3 low nibbles, hi0/hi1 the same bytes' high nibbles. */
static HD void tc_q4k_word(uint32_t w, const tc_q4k_row &k, uint32_t *lo0, uint32_t *lo1,
                           uint32_t *hi0, uint32_t *hi1)
{
    const uint32_t w8 = w >> 8;
    *lo0 = tc_hfma2((w & 0x000f000fu) | 0x64006400u, k.sl, k.nl);
    *lo1 = tc_hfma2((w8 & 0x000f000fu) | 0x64006400u, k.sl, k.nl);
    *hi0 = tc_hfma2((w & 0x00f000f0u) | 0x64006400u, k.sh, k.nh);
    *hi1 = tc_hfma2((w8 & 0x00f000f0u) | 0x64006400u, k.sh, k.nh);
}

/* Element offsets, inside a block, of B's pairs for lane t in mma m (0..15): reg 0 holds the
 * elements base+0 (k = 2t) and base+2 (k = 2t+1), reg 1 base+1 and base+3. */
static HD int tc_q4k_base(int m, int t)
{
    return 64 * t + 32 * (m & 1) + 4 * (m >> 1);
}

/* One staged B unit: four inputs x[base..base+3] (already scaled) as the hi and lo f16 pairs of
 * the mma's two B registers: {hi(x0, x2), hi(x1, x3), lo(x0, x2), lo(x1, x3)}. */
static HD uint4 tc_stage4(float x0, float x1, float x2, float x3)
{
    const uint16_t h0 = tc_f2h(x0), h1 = tc_f2h(x1), h2 = tc_f2h(x2), h3 = tc_f2h(x3);
    const uint16_t l0 = tc_f2h(x0 - h2f(h0)), l1 = tc_f2h(x1 - h2f(h1)),
                   l2 = tc_f2h(x2 - h2f(h2)), l3 = tc_f2h(x3 - h2f(h3));
    return make_uint4(tc_pack(h0, h2), tc_pack(h1, h3), tc_pack(l0, l2), tc_pack(l1, l3));
}

/* The mins' B register pair for lane t: {hi(S_2t, S_2t+1), lo(S_2t, S_2t+1)} of the block's
 * sub-block sums. */
static HD uint2 tc_stage_sums(float s0, float s1)
{
    const uint16_t h0 = tc_f2h(s0), h1 = tc_f2h(s1);
    return make_uint2(tc_pack(h0, h1), tc_pack(tc_f2h(s0 - h2f(h0)), tc_f2h(s1 - h2f(h1))));
}

/* Q6_K: a block's 16 scale groups of 16 consecutive elements are one mma each (k = the group),
 * so the int8 scale stays out of A: A = q − 32 (at most 32 in magnitude, exact in f16), and each
 * group's C is scaled by d·sc of its row before it is added (d·sc is exact in f32). Lane t holds
 * elements 4t..4t+3 of a group: group G = 8h + 2j + lh (half h, quarter j, sixteenth lh) is
 * elements 128h + 32j + 16lh + 4t + {0..3}, whose 6-bit codes are byte i of word j of the lane's
 * Q6_K unit u = 8h + 4lh + t (q6k_unit_decode). As for Q4_K, bytes 0 and 2 are k = 2t, 2t+1 and
 * bytes 1 and 3 are k = 2t+8, 2t+9. */
static HD int tc_q6k_base(int grp, int t)
{
    return 128 * (grp >> 3) + 32 * ((grp >> 1) & 3) + 16 * (grp & 1) + 4 * t;
}

/* The unit of group grp for lane t, and the word of that unit's decode that holds its codes. */
static HD int tc_q6k_unit(int grp, int t)
{
    return 8 * (grp >> 3) + 4 * (grp & 1) + t;
}

/* A word of four 6-bit codes as the two A registers of q − 32: bytes 0, 2 (lo) and 1, 3 (hi). */
static HD void tc_q6k_word(uint32_t w, uint32_t *lo, uint32_t *hi)
{
    const uint32_t m = 0xe420e420u; /* −(1024 + 32) in each half */
    const uint32_t one = 0x3c003c00u;
    *lo = tc_hfma2((w & 0x003f003fu) | 0x64006400u, one, m);
    *hi = tc_hfma2(((w >> 8) & 0x003f003fu) | 0x64006400u, one, m);
}

/* The exponent s of the power of two 2^-s that brings max |x| = amax into [2^(TC_XMAX_LOG2-1),
 * 2^TC_XMAX_LOG2): small inputs are scaled up as well as large ones down, so that the f16 parts
 * keep their 22 bits relative to the token's largest input (a tiny token would otherwise sink
 * into f16's subnormals). s stays in [-120, 127] so that 2^-s and 2^s are finite floats; 0 when
 * amax is 0 or not finite (the result is then not finite either, as with floats). */
static HD int tc_scale_exp(float amax)
{
    if (!(amax < 3.0e38f) || !(amax > 0.0f))
        return 0;
    int e = 0;
    frexpf(amax, &e); /* 2^(e-1) <= amax < 2^e */
    const int s = e - TC_XMAX_LOG2;
    return s < -120 ? -120 : s;
}

/* Item r (0 .. nsb·64) of a row's staged fragments: block sb = r/64, mma m = (r/4) % 16 (Q6_K:
 * scale group), lane t = r % 4; and item r (0 .. nsb·4) of its sub-block sums' pairs (block r/4,
 * lane r % 4; Q4_K only). x is the row, sc the power of two 2^-s of its exponent. */
template <int K, class Ld>
static HD uint4 tc_stage_frag_at(const Ld &ld, int r, float sc)
{
    const int sb = r >> 6, m = (r >> 2) & 15, tt = r & 3;
    const int base = K == MOE_TYPE_Q6_K ? tc_q6k_base(m, tt) : tc_q4k_base(m, tt);
    const float4 v = ld(256 * sb + base);
    return tc_stage4(v.x * sc, v.y * sc, v.z * sc, v.w * sc);
}

template <class Ld> static HD uint2 tc_stage_sum_at(const Ld &ld, int r, float sc)
{
    const int xp = 256 * (r >> 2) + 64 * (r & 3);
    float s0 = 0.0f, s1 = 0.0f;
    for (int i = 0; i < 32; i += 4) {
        const float4 a = ld(xp + i), b = ld(xp + 32 + i);
        s0 += a.x * sc + a.y * sc + a.z * sc + a.w * sc;
        s1 += b.x * sc + b.y * sc + b.z * sc + b.w * sc;
    }
    return tc_stage_sums(s0, s1);
}

/* Lane `lane`'s share of the staging of a row's 256-float block sb, done by one warp per block
 * (moe_cuda_router_norm_staged): its items of tc_stage_items, fragments 64·sb + lane and
 * 64·sb + lane + 32 into xs and, for Q4_K and lanes below 4, sub-block sums 4·sb + lane into sxs
 * (the whole row's arrays). The warps of blocks 0 .. nsb - 1 together write every item once. */
template <int K, class Ld>
static HD void tc_stage_block_lane(const Ld &ld, float sc, int sb, int lane, uint4 *xs,
                                   uint2 *sxs)
{
    for (int u = 64 * sb + lane; u < 64 * sb + 64; u += 32)
        xs[u] = tc_stage_frag_at<K>(ld, u, sc);
    if (K == MOE_TYPE_Q4_K && lane < 4)
        sxs[4 * sb + lane] = tc_stage_sum_at(ld, 4 * sb + lane, sc);
}

/* A row staged once for other launches to copy (moe_cuda_router_norm_staged): its fragments
 * [nsb][64] uint4, then its sub-block sums [nsb][4] uint2, then its exponent (an int): the
 * layout of a block's own staging (tc_stage_bytes(1, nsb)) followed by the exponent, which
 * starts at uint4 tc_staged_row_exp(nsb). */
static HD size_t tc_staged_row_exp(int nsb)
{
    return (size_t)nsb * 66;
}

/* A row as tc_stage_frag_at and tc_stage_sum_at read it: the float4 at element o (o % 4 == 0). */
struct tc_row_ld {
    const float *x;
    HD float4 operator()(int o) const { return *(const float4 *)(x + o); }
};

template <int K>
static HD uint4 tc_stage_frag(const float *x, int r, float sc)
{
    return tc_stage_frag_at<K>(tc_row_ld{x}, r, sc);
}

static HD uint2 tc_stage_sum(const float *x, int r, float sc)
{
    return tc_stage_sum_at(tc_row_ld{x}, r, sc);
}

#endif
