/* Device parts of the tensor-core Q4_K products (the fragment scheme is in mv_tc.cuh): the mma
 * instructions, a lane's loads of one block of its two rows, one block's contribution to a
 * warp's 16-row tile, and the staging of the inputs in fragment order. Shared by the mat-vec
 * (mv_tc.cu) and the expert kernels (experts.cu), so a row's result is the same floats whichever
 * computes it. */
#ifndef MOE_CUDA_MV_TC_DEV_CUH
#define MOE_CUDA_MV_TC_DEV_CUH

#include "worker/cuda/mv_tc.cuh"

/* c (16×8 f32) += a (16×16 f16, row-major) · b (16×8 f16, column-major). */
static __device__ __forceinline__ void tc_mma16816(float c[4], uint32_t a0, uint32_t a1,
                                                   uint32_t a2, uint32_t a3, uint32_t b0,
                                                   uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* c (16×8 f32) += a (16×8 f16) · b (8×8 f16). */
static __device__ __forceinline__ void tc_mma1688(float c[4], uint32_t a0, uint32_t a1,
                                                  uint32_t b0)
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

/* 16 bytes from global to shared memory without passing through registers (cp.async, sm_80+;
 * a plain copy before), then the waits. smem and gmem 16-byte aligned. */
static __device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
#else
    *(uint4 *)smem = *(const uint4 *)gmem;
#endif
}

/* Every cp_async16 of this thread has landed (other threads' copies: a barrier after it). */
static __device__ __forceinline__ void cp_async_wait_all()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

/* The cp_async16 calls of this thread since the last commit as one group; waiting until at most
 * N of its groups are still in flight. */
static __device__ __forceinline__ void cp_async_commit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N> static __device__ __forceinline__ void cp_async_wait_group()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* n bytes from src (global) to dst (shared, 16-byte aligned) by threads i0, i0 + step, ...:
 * 16-byte cp_async16 chunks where src is aligned, the tail and a misaligned src by plain byte
 * copies (visible after the callers' cp_async_wait_* and a barrier of the threads). */
static __device__ __forceinline__ void copy_async(uint8_t *dst, const uint8_t *src, size_t n,
                                                  unsigned i0, unsigned step)
{
    const size_t n16 = ((uintptr_t)src & 15) == 0 ? n / 16 : 0;
    for (size_t i = i0; i < n16; i += step)
        cp_async16(dst + 16 * i, src + 16 * i);
    for (size_t i = n16 * 16 + i0; i < n; i += step)
        dst[i] = src[i];
}

/* copy_async by the whole block. */
static __device__ __forceinline__ void block_copy_async(uint8_t *dst, const uint8_t *src, size_t n)
{
    copy_async(dst, src, n, threadIdx.x, blockDim.x);
}

/* A lane's bytes of one Q4_K block of its two rows: headers and chunk t of qs. */
struct tc_raw {
    uint4 h0, h1, a0, b0, a1, b1;
};

/* Plain loads (not the read-only path): the expert kernels may have copied these bytes into
 * place earlier in the same launch. */
static __device__ __forceinline__ tc_raw tc_load(const uint8_t *p0, const uint8_t *p1, int t)
{
    tc_raw r;
    r.h0 = *(const uint4 *)p0;
    r.h1 = *(const uint4 *)p1;
    r.a0 = *(const uint4 *)(p0 + OFF(q4_k, qs) + 32 * t);
    r.b0 = *(const uint4 *)(p0 + OFF(q4_k, qs) + 32 * t + 16);
    r.a1 = *(const uint4 *)(p1 + OFF(q4_k, qs) + 32 * t);
    r.b1 = *(const uint4 *)(p1 + OFF(q4_k, qs) + 32 * t + 16);
    return r;
}

/* The chains of dependent mma a lane's Q4_K block is summed in (tc_block): 1 (the default) or 4,
 * a build-time setting (the floats differ between the two; every kernel of a build uses the
 * same). */
#ifndef MOE_TC_Q4K_CHAINS
#define MOE_TC_Q4K_CHAINS 1
#endif

/* Word w of the lane's qs chunk in both its rows (wa, wb) against its staged inputs xw (xw[0]:
 * the low nibbles', xw[4]: the high nibbles'): four mma into C, in tc_block's order. */
static __device__ __forceinline__ void tc_q4k_word_mma(uint32_t wa, uint32_t wb,
                                                       const tc_q4k_row &k0, const tc_q4k_row &k1,
                                                       const uint4 *xw, float C[4])
{
    uint32_t l0a, l1a, h0a, h1a, l0b, l1b, h0b, h1b;
    tc_q4k_word(wa, k0, &l0a, &l1a, &h0a, &h1a);
    tc_q4k_word(wb, k1, &l0b, &l1b, &h0b, &h1b);
    uint4 xb = xw[0];
    tc_mma16816(C, l0a, l0b, l1a, l1b, xb.x, xb.y);
    tc_mma16816(C, l0a, l0b, l1a, l1b, xb.z, xb.w);
    xb = xw[4];
    tc_mma16816(C, h0a, h0b, h1a, h1b, xb.x, xb.y);
    tc_mma16816(C, h0a, h0b, h1a, h1b, xb.z, xb.w);
}

/* The end of a Q4_K block: the mins' products from the sub-block sums sv, then acc += d·C −
 * dmin·M per row. */
static __device__ __forceinline__ void tc_q4k_block_end(const tc_q4k_row &k0, const tc_q4k_row &k1,
                                                        uint2 sv, const float C[4], float acc[4])
{
    float M[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tc_mma1688(M, k0.am, k1.am, sv.x);
    tc_mma1688(M, k0.am, k1.am, sv.y);
    acc[0] = fmaf(-k0.dmin, M[0], fmaf(k0.d, C[0], acc[0]));
    acc[1] = fmaf(-k0.dmin, M[1], fmaf(k0.d, C[1], acc[1]));
    acc[2] = fmaf(-k1.dmin, M[2], fmaf(k1.d, C[2], acc[2]));
    acc[3] = fmaf(-k1.dmin, M[3], fmaf(k1.d, C[3], acc[3]));
}

/* One Q4_K block of a warp's tile: acc (the lane's C fragment: rows g, g+8, columns 2t, 2t+1)
 * += d·C − dmin·C_min. xp: the staged inputs of the block for the lane's column and t (stride 4
 * uint4 between the block's 16 mma), sv: the lane's pair of sub-block sums. */
static __device__ __forceinline__ void tc_block(const tc_raw &raw, int t, const uint4 *xp,
                                                uint2 sv, float acc[4])
{
    const tc_q4k_row k0 = tc_q4k_consts(raw.h0, t), k1 = tc_q4k_consts(raw.h1, t);
    const uint32_t wa[8] = {raw.a0.x, raw.a0.y, raw.a0.z, raw.a0.w,
                            raw.b0.x, raw.b0.y, raw.b0.z, raw.b0.w};
    const uint32_t wb[8] = {raw.a1.x, raw.a1.y, raw.a1.z, raw.a1.w,
                            raw.b1.x, raw.b1.y, raw.b1.z, raw.b1.w};
    float C[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if MOE_TC_Q4K_CHAINS == 4
    /* Four chains of 8 mma (low / high nibbles × the inputs' high / low parts) instead of one
     * of 32, added at the end: the same products, the sums in another order. */
    float C1[4] = {0.0f, 0.0f, 0.0f, 0.0f}, C2[4] = {0.0f, 0.0f, 0.0f, 0.0f},
          C3[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    UNROLL
    for (int i = 0; i < 8; i++) {
        uint32_t l0a, l1a, h0a, h1a, l0b, l1b, h0b, h1b;
        tc_q4k_word(wa[i], k0, &l0a, &l1a, &h0a, &h1a);
        tc_q4k_word(wb[i], k1, &l0b, &l1b, &h0b, &h1b);
        const uint4 xl = xp[4 * (2 * i)], xh = xp[4 * (2 * i + 1)];
        tc_mma16816(C, l0a, l0b, l1a, l1b, xl.x, xl.y);
        tc_mma16816(C1, l0a, l0b, l1a, l1b, xl.z, xl.w);
        tc_mma16816(C2, h0a, h0b, h1a, h1b, xh.x, xh.y);
        tc_mma16816(C3, h0a, h0b, h1a, h1b, xh.z, xh.w);
    }
    UNROLL
    for (int k = 0; k < 4; k++)
        C[k] = (C[k] + C1[k]) + (C2[k] + C3[k]);
#else
    UNROLL
    for (int i = 0; i < 8; i++)
        tc_q4k_word_mma(wa[i], wb[i], k0, k1, xp + 4 * (2 * i), C);
#endif
    tc_q4k_block_end(k0, k1, sv, C, acc);
}

/* tc_block through a loop over the two halves of the lane's qs chunk that is not unrolled: the
 * same mma in the same order, so the same floats, in half the code, for launches whose warps run
 * it a few times only and wait for its instructions' fetches (the one-token gate/up). */
static __device__ __forceinline__ void tc_block_rolled(const tc_raw &raw, int t, const uint4 *xp,
                                                       uint2 sv, float acc[4])
{
#if MOE_TC_Q4K_CHAINS == 4
    tc_block(raw, t, xp, sv, acc);
#else
    const tc_q4k_row k0 = tc_q4k_consts(raw.h0, t), k1 = tc_q4k_consts(raw.h1, t);
    float C[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int h = 0; h < 2; h++) {
        const uint4 A = h ? raw.b0 : raw.a0, B = h ? raw.b1 : raw.a1;
        const uint32_t wa[4] = {A.x, A.y, A.z, A.w}, wb[4] = {B.x, B.y, B.z, B.w};
        UNROLL
        for (int i = 0; i < 4; i++)
            tc_q4k_word_mma(wa[i], wb[i], k0, k1, xp + 32 * h + 4 * (2 * i), C);
    }
    tc_q4k_block_end(k0, k1, sv, C, acc);
#endif
}

/* A lane's bytes of one Q6_K block of its two rows: its four units of each (tc_q6k_unit). */
struct tc_raw6 {
    q6k_raw r0[4], r1[4];
};

static __device__ __forceinline__ tc_raw6 tc_load6(const uint8_t *p0, const uint8_t *p1, int t)
{
    tc_raw6 r;
    UNROLL
    for (int i = 0; i < 4; i++) {
        q6k_unit_load(p0, 8 * (i >> 1) + 4 * (i & 1) + t, &r.r0[i]);
        q6k_unit_load(p1, 8 * (i >> 1) + 4 * (i & 1) + t, &r.r1[i]);
    }
    return r;
}

/* One Q6_K block of a warp's tile: acc += Σ over the 16 scale groups, in group order within each
 * unit, of d·sc·C (mv_tc.cuh). xp: the staged inputs of the block for the lane's column and t. */
static __device__ __forceinline__ void tc_block6(const tc_raw6 &raw, int t, const uint4 *xp,
                                                 float acc[4])
{
    UNROLL
    for (int i = 0; i < 4; i++) {
        uint32_t q0[4], q1[4];
        q6k_unit_decode(raw.r0[i], q0);
        q6k_unit_decode(raw.r1[i], q1);
        const float d0 = h2f(raw.r0[i].d), d1 = h2f(raw.r1[i].d);
        UNROLL
        for (int j = 0; j < 4; j++) {
            const int grp = 8 * (i >> 1) + 2 * j + (i & 1);
            uint32_t lo0, hi0, lo1, hi1;
            tc_q6k_word(q0[j], &lo0, &hi0);
            tc_q6k_word(q1[j], &lo1, &hi1);
            const uint4 xb = xp[4 * grp];
            float C[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tc_mma16816(C, lo0, lo1, hi0, hi1, xb.x, xb.y);
            tc_mma16816(C, lo0, lo1, hi0, hi1, xb.z, xb.w);
            const float s0 = d0 * (float)raw.r0[i].sc[j], s1 = d1 * (float)raw.r1[i].sc[j];
            acc[0] = fmaf(s0, C[0], acc[0]);
            acc[1] = fmaf(s0, C[1], acc[1]);
            acc[2] = fmaf(s1, C[2], acc[2]);
            acc[3] = fmaf(s1, C[3], acc[3]);
        }
    }
}

/* The types the tensor-core products take (moe_cuda_matvec_tc_supported at run time). */
template <int K> constexpr bool tc_takes()
{
    return K == MOE_TYPE_Q4_K || K == MOE_TYPE_Q6_K;
}

/* The type-generic face of the above: raw bytes, loads and a block's product for K = Q4_K or
 * Q6_K (sv, the Q4_K mins' sums, is not read for Q6_K). */
template <int K> struct tc_kind;
template <> struct tc_kind<MOE_TYPE_Q4_K> {
    using raw = tc_raw;
    static constexpr size_t block_bytes = sizeof(struct moe_block_q4_k);
    static __device__ __forceinline__ raw load(const uint8_t *p0, const uint8_t *p1, int t)
    {
        return tc_load(p0, p1, t);
    }
    template <bool ROLL = false>
    static __device__ __forceinline__ void block(const raw &r, int t, const uint4 *xp, uint2 sv,
                                                 float acc[4])
    {
        if constexpr (ROLL)
            tc_block_rolled(r, t, xp, sv, acc);
        else
            tc_block(r, t, xp, sv, acc);
    }
};
template <> struct tc_kind<MOE_TYPE_Q6_K> {
    using raw = tc_raw6;
    static constexpr size_t block_bytes = sizeof(struct moe_block_q6_k);
    static __device__ __forceinline__ raw load(const uint8_t *p0, const uint8_t *p1, int t)
    {
        return tc_load6(p0, p1, t);
    }
    template <bool ROLL = false>
    static __device__ __forceinline__ void block(const raw &r, int t, const uint4 *xp, uint2,
                                                 float acc[4])
    {
        tc_block6(r, t, xp, acc);
    }
};

/* A lane's dot-product contribution of rows p0 and p1 (its tile rows g, g+8), blocks sb0, sb0 +
 * step, ... < nsb, against the staged inputs xs/sxs of its column gx: the next block's loads
 * are in flight while one is computed. first: the bytes of block sb0, loaded before. ROLL: a
 * Q4_K block through tc_block_rolled (the same floats). */
template <int K, bool ROLL = false>
static __device__ __forceinline__ void tc_rows(const uint8_t *p0, const uint8_t *p1, int t,
                                               int sb0, int step, int nsb,
                                               typename tc_kind<K>::raw first, const uint4 *xs,
                                               const uint2 *sxs, int gx, float acc[4])
{
    using TK = tc_kind<K>;
    typename TK::raw raw = first;
    for (int sb = sb0; sb < nsb; sb += step) {
        const typename TK::raw cur = raw;
        if (sb + step < nsb)
            raw = TK::load(p0 + (size_t)(sb + step) * TK::block_bytes,
                           p1 + (size_t)(sb + step) * TK::block_bytes, t);
        const size_t i = (size_t)gx * nsb + sb;
        TK::template block<ROLL>(cur, t, xs + i * 64 + t, sxs[i * 4 + t], acc);
    }
}

static __device__ __forceinline__ unsigned abs_bits(float v)
{
    return __float_as_uint(v) & 0x7fffffffu;
}

/* Shared memory of tc_stage for nt tokens of rows of nsb blocks: xs [nt][nsb][16][4] uint4, then
 * sxs [nt][nsb][4] uint2. */
static __host__ __device__ __forceinline__ size_t tc_stage_bytes(int nt, int nsb)
{
    return (size_t)nt * nsb * (64 * sizeof(uint4) + 4 * sizeof(uint2));
}

/* The bit pattern of max |x| over this thread's float4s i0, i0 + step, ... of a row of n. */
static __device__ __forceinline__ unsigned tc_amax_part(const float *x, int64_t n, int64_t i0,
                                                        int64_t step)
{
    unsigned m = 0;
    for (int64_t i = 4 * i0; i < n; i += 4 * step) {
        const float4 v = *(const float4 *)(x + i);
        m = max(max(m, abs_bits(v.x)), max(abs_bits(v.y), max(abs_bits(v.z), abs_bits(v.w))));
    }
    return m;
}

/* The whole block stages NT tokens' inputs (xr[c]: token c's row of nsb·256 floats) in fragment
 * order into xs and sxs (tc_stage_bytes): each token's max |x| (bit patterns, so a NaN wins and
 * leaves the scale at 1), its exponent s_exp[c] (tc_scale_exp), then the scaled fragments and
 * sub-block sums (Q4_K). s_amax: NT words of shared memory. Ends with a barrier; every thread of
 * the block must call it. */
template <int NT, int K>
static __device__ __forceinline__ void tc_stage(const float *const *xr, int nsb, uint4 *xs,
                                                uint2 *sxs, int *s_exp, unsigned *s_amax)
{
    const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31;
    const int64_t n = (int64_t)nsb * 256;
    if (tid < NT)
        s_amax[tid] = 0;
    __syncthreads();
    UNROLL
    for (int c = 0; c < NT; c++) {
        const unsigned m = __reduce_max_sync(0xffffffffu, tc_amax_part(xr[c], n, tid, nthr));
        if (lane == 0)
            atomicMax(&s_amax[c], m);
    }
    __syncthreads();
    if (tid < NT)
        s_exp[tid] = tc_scale_exp(__uint_as_float(s_amax[tid]));
    __syncthreads();
    for (int u = tid; u < NT * nsb * 64; u += nthr) {
        const int c = u / (nsb * 64);
        xs[u] = tc_stage_frag<K>(xr[c], u % (nsb * 64), ldexpf(1.0f, -s_exp[c]));
    }
    for (int u = tid; K == MOE_TYPE_Q4_K && u < NT * nsb * 4; u += nthr) {
        const int c = u / (nsb * 4);
        sxs[u] = tc_stage_sum(xr[c], u % (nsb * 4), ldexpf(1.0f, -s_exp[c]));
    }
    __syncthreads();
}

/* One row's fragments and sub-block sums (Q4_K), scaled by sc, by threads i0, i0 + step, ...,
 * the row read through ld. */
template <int K, class Ld>
static __device__ __forceinline__ void tc_stage_items(const Ld &ld, float sc, int nsb, uint4 *xs,
                                                      uint2 *sxs, int i0, int step)
{
    for (int u = i0; u < nsb * 64; u += step)
        xs[u] = tc_stage_frag_at<K>(ld, u, sc);
    for (int u = i0; K == MOE_TYPE_Q4_K && u < nsb * 4; u += step)
        sxs[u] = tc_stage_sum_at(ld, u, sc);
}

/* The rest of a warp's staging once the row's max |x| (bit pattern amax) is known, the row read
 * through ld (tc_row_ld, tc_raw_ld): returns the row's exponent. */
template <int K, class Ld>
static __device__ __forceinline__ int tc_stage_warp_from(const Ld &ld, unsigned amax, int nsb,
                                                         uint4 *xs, uint2 *sxs)
{
    const int e = tc_scale_exp(__uint_as_float(amax));
    tc_stage_items<K>(ld, ldexpf(1.0f, -e), nsb, xs, sxs, threadIdx.x & 31, 32);
    __syncwarp();
    return e;
}

/* tc_stage for one row by one warp (the same floats): returns the row's exponent. */
template <int K>
static __device__ __forceinline__ int tc_stage_warp(const float *x, int nsb, uint4 *xs, uint2 *sxs)
{
    const unsigned m =
        __reduce_max_sync(0xffffffffu, tc_amax_part(x, (int64_t)nsb * 256, threadIdx.x & 31, 32));
    return tc_stage_warp_from<K>(tc_row_ld{x}, m, nsb, xs, sxs);
}

/* The raw copy of a row that tc_stage_raw and tc_stage_warp_raw stage from, in shared memory:
 * float4 q of the row at float4 q + q/8 (one float4 of padding after every eight), so that the
 * eight float4 a quarter of a warp reads for consecutive fragments (64 floats apart) fall in
 * different banks. tc_raw_floats(n): its size in floats for a row of n. */
static __host__ __device__ __forceinline__ int64_t tc_raw_floats(int64_t n)
{
    return n / 32 * 36;
}

struct tc_raw_ld {
    const float *raw;
    __device__ float4 operator()(int o) const
    {
        const int q = o >> 2;
        return *(const float4 *)(raw + 4 * (q + (q >> 3)));
    }
};

/* The n floats of x (global, n % 32 == 0) put in flight into raw (tc_raw_floats(n), 16-byte
 * aligned) by threads i0, i0 + step, ...: 16-byte cp.async pieces where x is 16-byte aligned,
 * plain copies otherwise. Issued before the weights' loads, so that the row does not wait behind
 * them; visible after cp_async_wait_all and a barrier. */
static __device__ __forceinline__ void tc_raw_copy(float *raw, const float *x, int64_t n, int i0,
                                                   int step)
{
    if (((uintptr_t)x & 15) == 0) {
        for (int64_t q = i0; q < n / 4; q += step)
            cp_async16(raw + 4 * (q + (q >> 3)), x + 4 * q);
    } else {
        for (int64_t i = i0; i < n; i += step) {
            const int64_t q = i >> 2;
            raw[4 * (q + (q >> 3)) + (i & 3)] = x[i];
        }
    }
}

/* The bit pattern of max |x| over the raw copy's float4s q0, q0 + step, ... of a row of n. */
static __device__ __forceinline__ unsigned tc_raw_amax_part(const float *raw, int64_t n, int q0,
                                                            int step)
{
    unsigned m = 0;
    const tc_raw_ld ld{raw};
    for (int64_t q = q0; q < n / 4; q += step) {
        const float4 v = ld((int)(4 * q));
        m = max(max(m, abs_bits(v.x)), max(abs_bits(v.y), max(abs_bits(v.z), abs_bits(v.w))));
    }
    return m;
}

/* The block's staging of one row read through ld, once every thread has the largest magnitude
 * of its part of the row (m, bit patterns; *s_amax zeroed before a barrier all threads passed):
 * the row's max into *s_amax, its exponent into *s_exp (tc_scale_exp), then the scaled fragments
 * and sub-block sums (tc_stage_items). Ends with a barrier; every thread of the block calls it. */
template <int K, class Ld>
static __device__ __forceinline__ void tc_stage_block_from(const Ld &ld, unsigned m, int nsb,
                                                           uint4 *xs, uint2 *sxs, int *s_exp,
                                                           unsigned *s_amax)
{
    const int tid = threadIdx.x;
    m = __reduce_max_sync(0xffffffffu, m);
    if ((tid & 31) == 0)
        atomicMax(s_amax, m);
    __syncthreads();
    const int e = tc_scale_exp(__uint_as_float(*s_amax));
    if (tid == 0)
        *s_exp = e;
    tc_stage_items<K>(ld, ldexpf(1.0f, -e), nsb, xs, sxs, tid, (int)blockDim.x);
    __syncthreads();
}

/* tc_stage<1, K> from the raw copy of the row (tc_raw_copy by this block's threads, not yet
 * waited for): the same floats, without reading global memory again. */
template <int K>
static __device__ __forceinline__ void tc_stage_raw(const float *raw, int nsb, uint4 *xs,
                                                    uint2 *sxs, int *s_exp, unsigned *s_amax)
{
    const int tid = threadIdx.x, nthr = blockDim.x;
    const int64_t n = (int64_t)nsb * 256;
    if (tid == 0)
        *s_amax = 0;
    cp_async_wait_all();
    __syncthreads();
    tc_stage_block_from<K>(tc_raw_ld{raw}, tc_raw_amax_part(raw, n, tid, nthr), nsb, xs, sxs,
                           s_exp, s_amax);
}

/* tc_stage_warp from the raw copy of the row (tc_raw_copy by this warp's lanes, not yet waited
 * for): the same floats. PENDING > 0: the copy was committed as a group with PENDING groups
 * after it, which are left in flight. */
template <int K, int PENDING = 0>
static __device__ __forceinline__ int tc_stage_warp_raw(const float *raw, int nsb, uint4 *xs,
                                                        uint2 *sxs)
{
    if constexpr (PENDING == 0)
        cp_async_wait_all();
    else
        cp_async_wait_group<PENDING>();
    __syncwarp();
    const unsigned m = __reduce_max_sync(
        0xffffffffu, tc_raw_amax_part(raw, (int64_t)nsb * 256, threadIdx.x & 31, 32));
    return tc_stage_warp_from<K>(tc_raw_ld{raw}, m, nsb, xs, sxs);
}

/* Inputs staged once for every tile (moe_cuda_tc_stage, moe_cuda_matvec_tc_multi_ws): per token
 * its fragments [nsb][16 mma][4 t], its sub-block sums [nsb][4 t] and its exponent, in three
 * arrays, each token's as tc_stage<1, K> makes them. */
struct tc_staged {
    uint4 *xs;
    uint2 *sxs;
    int *exp;
};

static __host__ __device__ __forceinline__ tc_staged tc_ws_split(void *ws, int nsb, int64_t n_tok)
{
    uint4 *xs = (uint4 *)ws;
    uint2 *sxs = (uint2 *)(xs + (size_t)n_tok * nsb * 64);
    return tc_staged{xs, sxs, (int *)(sxs + (size_t)n_tok * nsb * 4)};
}

#endif
