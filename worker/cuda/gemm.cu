/* CUDA matrix products on tensor cores for prompt processing (see gemm.h, docs/cuda.md).
 *
 * One thread block computes a tile of BM weight rows × BN tokens (128×128, 128×64, 64×64 or
 * 128×32), walking the reduction in k-tiles of 64 elements with two smem stages:
 *
 *   weights  quantized types: "super-tiles" of raw blocks, 256 elements (one K-quant block) or
 *            128 (four 32-blocks) per row, BM rows × 72..210 bytes, are copied global → smem
 *            with cp.async, two super-tiles in flight, so every warp load is coalesced whatever
 *            the block alignment (Q8_0 blocks are 34 bytes); each k-tile is then decoded
 *            smem → smem into an f16 tile [BM][64] (one or two 32-element units per thread:
 *            codes become f16 by a byte permute into 0x64xx, i.e. 1024 + code, then one f16
 *            subtract and one multiply(-add) by the block scale).
 *            F32/F16/BF16: 8 elements per thread per k-tile through registers, converted to f16.
 *   tokens   X rows (float) through registers, loaded one k-tile ahead, rounded to f16 into a
 *            [BN][64] tile. Rows come from a per-block table of row pointers, which is where the
 *            grouped variant's gather happens.
 *   products warps of 64×32 or 32×32 outputs; ldmatrix.x4 fragments, mma.sync m16n8k16 with
 *            f32 accumulators in registers. Smem rows are padded to 72 halves (144 bytes), so the
 *            eight rows an ldmatrix reads lie in distinct banks, and so do the decoder's stores.
 *
 * Per k-tile: issue the next raw super-tile when one is free, mma on stage k, decode/convert
 * stage k+1 from the registers loaded one iteration earlier, start loading k+2, barrier. Sums are
 * accumulated in a fixed order inside one thread block and stored once: no atomics, so every run
 * gives the same bits.
 *
 * The grouped variant finds its (group, token tile) from d_off inside each block (a prefix sum
 * over the groups' tile counts in smem), so the launch shape depends only on the arguments and
 * the call can be replayed from a CUDA graph with new counts; blocks past the real tile count
 * exit at once.
 *
 * Building with -DMOE_GEMM_HOST_EMU (with a host C++ compiler, or nvcc) makes the block body
 * __host__ __device__, routes the device-only operations (barrier, cp.async, ldmatrix, mma, smem
 * and global accesses) to hooks, and replaces the kernel launch by emu_launch: an emulator that
 * includes this file supplies them and runs each thread block as cooperative host threads (that
 * is how this file was first checked, before any GPU run). The decoders are __host__ __device__
 * in every build. */
#include "worker/cuda/gemm.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include <atomic>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

/* The store headers are plain C without extern "C" guards of their own. */
extern "C" {
#include "store/err.h"
#include "store/ggml_type.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/hd.cuh"
#include "worker/cuda/smem.cuh"

#ifdef MOE_GEMM_HOST_EMU
#define BODY __host__ __device__ __forceinline__
void emu_bar(void);
void emu_cp_async(void *dst, const void *src, int bytes);
void emu_cp_wait(void);
void emu_ldsm_x4(uint32_t r[4], const void *p);
void emu_mma(float c[4], const uint32_t a[4], const uint32_t b[2]);
void emu_touch(const void *p, int bytes, int write);
void emu_gload(const void *p, int bytes);
#else
#define BODY __device__ __forceinline__
#endif
#if defined(MOE_GEMM_HOST_EMU) && !defined(__CUDA_ARCH__)
#define EMU_TOUCH(p, n, w) emu_touch((const void *)(p), (n), (w))
#define EMU_GLOAD(p, n) emu_gload((const void *)(p), (n))
#else
#define EMU_TOUCH(p, n, w) ((void)0)
#define EMU_GLOAD(p, n) ((void)0)
#endif
#ifdef __CUDA_ARCH__
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif

namespace {

/* ---- tile shapes -------------------------------------------------------------------------- */

/* k per tile, and the smem row stride of the f16 tiles in halves (144 bytes: rows 16 bytes
 * apart mod 128, so 8 consecutive rows at one column hit 8 distinct 16-byte bank groups). */
constexpr int BK = 64, SK = BK + 8, SROW = SK * 2;

template <int BM_, int BN_, int WGM_, int WGN_, int MINB_> struct Tile {
    static constexpr int BM = BM_, BN = BN_, WGM = WGM_, WGN = WGN_, MINB = MINB_;
    static constexpr int NT = 32 * WGM * WGN, WM = BM / WGM, WN = BN / WGN;
    static constexpr int MI = WM / 16, NI = WN / 8;
    static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile");
};
/* rows × tokens, warps (rows × tokens), min blocks per SM for __launch_bounds__ (see
 * min_blocks). */
using T0 = Tile<128, 128, 2, 4, 1>; /* 8 warps of 64×32 */
using T1 = Tile<128, 64, 2, 2, 2>;  /* 4 warps of 64×32 */
using T2 = Tile<64, 64, 2, 2, 3>;   /* 4 warps of 32×32 */
using T3 = Tile<128, 32, 4, 1, 3>;  /* 4 warps of 32×32 */
constexpr int N_TILES = 4;

/* ---- block formats ------------------------------------------------------------------------ */

/* QUANT: staged as raw bytes through smem, a "super-tile" of SPB elements per row at a time (one
 * K-quant block, or four 32-blocks), i.e. KPS = SPB/64 k-tiles. SB: bytes of a full super-tile;
 * SBP: its smem row stride (room for a 2-byte phase and the word rounding of 4-byte copies;
 * SBP/4 odd so that 32 lanes reading 16 or 32 bits of 32 different rows hit distinct banks).
 * K16: Q4_K/Q5_K, read with 16-byte smem loads (SBP/16 odd) and copied 16 bytes at a time when
 * the rows are 16-aligned. Plain types: ESIZE bytes per element. */
template <int K> struct Ty;
#define TY(K, Q, E, K16_, BL, BS_, SPB_, SBP_)                                                  \
    template <> struct Ty<K> {                                                                  \
        enum { QUANT = Q, ESIZE = E, K16 = K16_, BLCK = BL, BS = BS_, SPB = SPB_, SBP = SBP_ }; \
        enum { NBS = SPB_ / BL, SB = SPB_ / BL * BS_, LK = SPB_ == 256 ? 2 : SPB_ == 128 ? 1 : 0 }; \
    }
TY(MOE_TYPE_F32, 0, 4, 0, 1, 4, 64, 0);
TY(MOE_TYPE_F16, 0, 2, 0, 1, 2, 64, 0);
TY(MOE_TYPE_BF16, 0, 2, 0, 1, 2, 64, 0);
TY(MOE_TYPE_Q4_0, 1, 0, 0, 32, 18, 128, 76);
TY(MOE_TYPE_Q4_1, 1, 0, 0, 32, 20, 128, 84);
TY(MOE_TYPE_Q5_0, 1, 0, 0, 32, 22, 128, 92);
TY(MOE_TYPE_Q5_1, 1, 0, 0, 32, 24, 128, 100);
TY(MOE_TYPE_Q8_0, 1, 0, 0, 32, 34, 128, 140);
TY(MOE_TYPE_Q4_K, 1, 0, 1, 256, 144, 256, 144);
TY(MOE_TYPE_Q5_K, 1, 0, 1, 256, 176, 256, 176);
TY(MOE_TYPE_Q6_K, 1, 0, 0, 256, 210, 256, 212);
#undef TY
template <int K> constexpr bool ty_ok()
{
    using T = Ty<K>;
    return !T::QUANT || (T::SBP >= (T::K16 ? T::SB : (T::SB + 2 + 3) / 4 * 4) && T::SBP % 4 == 0 &&
                         (T::K16 ? T::SBP % 32 == 16 : (T::SBP / 4) % 2 == 1));
}
static_assert(ty_ok<MOE_TYPE_Q4_0>() && ty_ok<MOE_TYPE_Q4_1>() && ty_ok<MOE_TYPE_Q5_0>() &&
                  ty_ok<MOE_TYPE_Q5_1>() && ty_ok<MOE_TYPE_Q8_0>() && ty_ok<MOE_TYPE_Q4_K>() &&
                  ty_ok<MOE_TYPE_Q5_K>() && ty_ok<MOE_TYPE_Q6_K>(),
              "raw row strides");

/* Dynamic smem of one block: two f16 weight stages, two f16 token stages, two raw super-tiles,
 * the row-pointer tables, the scan scratch of the grouped variant. */
template <int K, class TL> constexpr int smem_bytes()
{
    return 2 * TL::BM * SROW + 2 * TL::BN * SROW + (Ty<K>::QUANT ? 2 * TL::BM * Ty<K>::SBP : 0) +
           TL::BM * 8 + TL::BN * 8 + (TL::NT + 4) * 4;
}

/* ---- device primitives (host twins for the emulator) --------------------------------------- */

HD uint32_t perm(uint32_t x, uint32_t y, uint32_t s)
{
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    uint64_t v = (uint64_t)y << 32 | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++)
        r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
#endif
}

HD __half2 h2_of(uint32_t u)
{
    __half2_raw r;
    r.x = (unsigned short)(u & 0xffff);
    r.y = (unsigned short)(u >> 16);
    return __half2(r);
}

HD uint32_t h2_bits(__half2 h)
{
    __half2_raw r = h;
    return (uint32_t)r.x | (uint32_t)r.y << 16;
}

HD float hf(uint32_t bits16)
{
    __half_raw r;
    r.x = (unsigned short)bits16;
    return __half2float(__half(r));
}

HD uint32_t fh(float f)
{
    __half_raw r = __float2half_rn(f);
    return r.x;
}

/* f16x2 arithmetic on packed words; the host twins round each half once from float. */
HD uint32_t h2_sub(uint32_t a, uint32_t b)
{
#ifdef __CUDA_ARCH__
    return h2_bits(__hsub2(h2_of(a), h2_of(b)));
#else
    return fh(hf(a & 0xffff) - hf(b & 0xffff)) | fh(hf(a >> 16) - hf(b >> 16)) << 16;
#endif
}

HD uint32_t h2_mul(uint32_t a, uint32_t b)
{
#ifdef __CUDA_ARCH__
    return h2_bits(__hmul2(h2_of(a), h2_of(b)));
#else
    return fh(hf(a & 0xffff) * hf(b & 0xffff)) | fh(hf(a >> 16) * hf(b >> 16)) << 16;
#endif
}

HD uint32_t h2_fma(uint32_t a, uint32_t b, uint32_t c)
{
#ifdef __CUDA_ARCH__
    return h2_bits(__hfma2(h2_of(a), h2_of(b), h2_of(c)));
#else
    double lo = (double)hf(a & 0xffff) * hf(b & 0xffff) + hf(c & 0xffff);
    double hi = (double)hf(a >> 16) * hf(b >> 16) + hf(c >> 16);
    return fh((float)lo) | fh((float)hi) << 16;
#endif
}

HD uint32_t f2h2(float lo, float hi)
{
#ifdef __CUDA_ARCH__
    return h2_bits(__floats2half2_rn(lo, hi));
#else
    return fh(lo) | fh(hi) << 16;
#endif
}

/* Shared-memory accesses (the emulator checks them for races). */
HD uint32_t sm_ld8(const uint8_t *p)
{
    EMU_TOUCH(p, 1, 0);
    return *p;
}
HD uint32_t sm_ld16(const uint8_t *p)
{
    EMU_TOUCH(p, 2, 0);
    return *(const uint16_t *)p;
}
/* 32 bits at a 2-byte aligned smem address. */
HD uint32_t sm_ld32a2(const uint8_t *p)
{
    return sm_ld16(p) | sm_ld16(p + 2) << 16;
}
HD uint4 sm_ld128(const uint8_t *p)
{
    EMU_TOUCH(p, 16, 0);
    return *(const uint4 *)p;
}
HD void sm_st16(uint8_t *p, uint32_t v)
{
    EMU_TOUCH(p, 2, 1);
    *(uint16_t *)p = (uint16_t)v;
}
HD void sm_st64(uint8_t *p, uint2 v)
{
    EMU_TOUCH(p, 8, 1);
    *(uint2 *)p = v;
}
HD void sm_st128(uint8_t *p, uint4 v)
{
    EMU_TOUCH(p, 16, 1);
    *(uint4 *)p = v;
}
template <class T> HD T sm_get(const T *p)
{
    EMU_TOUCH(p, (int)sizeof(T), 0);
    return *p;
}
template <class T> HD void sm_put(T *p, T v)
{
    EMU_TOUCH(p, (int)sizeof(T), 1);
    *p = v;
}

HD void bar()
{
#ifdef __CUDA_ARCH__
    __syncthreads();
#elif defined(MOE_GEMM_HOST_EMU)
    emu_bar();
#endif
}

HD void cp_async4(uint8_t *dst, const uint8_t *src)
{
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(__cvta_generic_to_global(src))
                 : "memory");
#elif defined(MOE_GEMM_HOST_EMU)
    emu_cp_async(dst, src, 4);
#else
    (void)dst, (void)src;
#endif
}

HD void cp_async16(uint8_t *dst, const uint8_t *src)
{
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(__cvta_generic_to_global(src))
                 : "memory");
#elif defined(MOE_GEMM_HOST_EMU)
    emu_cp_async(dst, src, 16);
#else
    (void)dst, (void)src;
#endif
}

HD void cp_commit()
{
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/* Waits for this thread's copies; other threads see them after the next barrier. */
HD void cp_wait()
{
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#elif defined(MOE_GEMM_HOST_EMU)
    emu_cp_wait();
#endif
}

HD void ldsm_x4(uint32_t r[4], const uint8_t *p)
{
#ifdef __CUDA_ARCH__
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p))
                 : "memory");
#elif defined(MOE_GEMM_HOST_EMU)
    emu_ldsm_x4(r, p);
#else
    (void)p;
    r[0] = r[1] = r[2] = r[3] = 0;
#endif
}

/* c (16×8 f32) += a (16×16 f16, row-major) · b (16×8 f16, column-major). */
HD void mma16816(float c[4], const uint32_t a[4], const uint32_t b[2])
{
#ifdef __CUDA_ARCH__
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(MOE_GEMM_HOST_EMU)
    emu_mma(c, a, b);
#else
    (void)c, (void)a, (void)b;
#endif
}

/* Global loads of data that no thread writes during the kernel. */
HD float4 ldg_f4(const float *p)
{
#ifdef __CUDA_ARCH__
    return __ldg((const float4 *)p);
#else
    EMU_GLOAD(p, 16);
    return *(const float4 *)p;
#endif
}
HD float ldg_f(const float *p)
{
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    EMU_GLOAD(p, 4);
    return *p;
#endif
}
HD uint4 ldg_u4(const uint8_t *p)
{
#ifdef __CUDA_ARCH__
    return __ldg((const uint4 *)p);
#else
    EMU_GLOAD(p, 16);
    return *(const uint4 *)p;
#endif
}
HD uint32_t ldg_u16(const uint8_t *p)
{
#ifdef __CUDA_ARCH__
    return __ldg((const unsigned short *)p);
#else
    EMU_GLOAD(p, 2);
    return *(const uint16_t *)p;
#endif
}

/* ---- decoders: one unit = 32 elements of one row of a k-tile -------------------------------- */

/* Four code bytes (each < 256) of x as two f16x2 words holding 1024 + code: the byte permute puts
 * each code under the exponent byte 0x64 (1024 has a unit ulp). */
HD void codes_h2(uint32_t x, uint32_t *o)
{
    o[0] = perm(x, 0x64, 0x4140);
    o[1] = perm(x, 0x64, 0x4342);
}

HD uint32_t rep(uint32_t h)
{
    return h | h << 16;
}

/* Bit b (b < 4) of v moved to bit 4 of byte b: the 5th bits of four Q5 codes. */
HD uint32_t spread4(uint32_t v)
{
    return ((v & 1) | (v & 2) << 7 | (v & 4) << 14 | (v & 8) << 21) << 4;
}

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block from its 12 scale bytes, given
 * as three words (layout in docs/kernels.md): sub-blocks 0..3 keep theirs in the low 6 bits of
 * bytes j and j+4; 4..7 split theirs between a nibble of byte j+4 and the top two bits of bytes
 * j-4 (scale) and j (min). Shifts, not an indexed array, so nothing goes to local memory. */
HD void kq_scale_min(uint32_t s0, uint32_t s1, uint32_t s2, int j, int *sc, int *m)
{
    const int sh = 8 * (j & 3);
    const uint32_t b0 = (s0 >> sh) & 0xff, b1 = (s1 >> sh) & 0xff, b2 = (s2 >> sh) & 0xff;
    if (j < 4) {
        *sc = (int)(b0 & 63);
        *m = (int)(b1 & 63);
    } else {
        *sc = (int)((b2 & 15) | (b0 >> 6) << 4);
        *m = (int)((b2 >> 4) | (b1 >> 6) << 4);
    }
}

/* Positions (in halves, within the 64 of the k-tile) of the two 16-element runs of unit u:
 * 32-blocks: unit u is block 2c+u of the super-tile, elements 0..15 then 16..31 of it; K-quants:
 * unit u is bytes 16u..16u+15 of the chunk's codes, whose elements sit at 16u.. and 32+16u... */
template <int K> HD int run_pos(int u, int run)
{
    if constexpr (Ty<K>::BLCK == 32)
        return 32 * u + 16 * run;
    else
        return 16 * u + 32 * run;
}

/* Decodes unit u of chunk c (elements 64c..64c+63 of the super-tile) of one row: rb points at the
 * row's first block of the super-tile in smem, nblk is the number of blocks the super-tile has
 * (32-blocks: up to 4; a short last super-tile has fewer, the missing units decode to zeros).
 * o[0..7] get the f16x2 pairs of run 0, o[8..15] those of run 1, in element order. */
template <int K> HD void decode_q(const uint8_t *rb, int c, int u, int nblk, uint32_t o[16])
{
    if constexpr (Ty<K>::BLCK == 32) {
        const int j = 2 * c + u;
        if (j >= nblk) {
            for (int i = 0; i < 16; i++)
                o[i] = 0;
            return;
        }
        const uint8_t *b = rb + j * Ty<K>::BS;
        if constexpr (K == MOE_TYPE_Q8_0) {
            /* half d; int8 qs[32]: flipping the sign bits maps q to q + 128. */
            const uint32_t d2 = rep(sm_ld16(b));
            UNROLL
            for (int i = 0; i < 8; i++)
                codes_h2(sm_ld32a2(b + 2 + 4 * i) ^ 0x80808080u, o + 2 * i);
            UNROLL
            for (int i = 0; i < 16; i++)
                o[i] = h2_mul(h2_sub(o[i], 0x64806480u), d2);
        } else {
            /* Q4_0: half d; qs[16]. Q4_1: half d, m; qs[16]. Q5_0: half d; u32 qh; qs[16].
             * Q5_1: half d, m; u32 qh; qs[16]. Low nibble of qs[l]: element l, high: l + 16;
             * 5th bits: bit l (l + 16) of qh. */
            constexpr bool AFF = K == MOE_TYPE_Q4_1 || K == MOE_TYPE_Q5_1;
            constexpr bool Q5 = K == MOE_TYPE_Q5_0 || K == MOE_TYPE_Q5_1;
            constexpr int QS = (AFF ? 4 : 2) + (Q5 ? 4 : 0);
            const uint32_t d2 = rep(sm_ld16(b)), m2 = AFF ? rep(sm_ld16(b + 2)) : 0;
            const uint32_t qh = Q5 ? sm_ld32a2(b + (AFF ? 4 : 2)) : 0;
            UNROLL
            for (int i = 0; i < 4; i++) {
                const uint32_t w = sm_ld32a2(b + QS + 4 * i);
                uint32_t lo = w & 0x0f0f0f0fu, hi = (w >> 4) & 0x0f0f0f0fu;
                if constexpr (Q5) {
                    lo |= spread4((qh >> (4 * i)) & 15);
                    hi |= spread4((qh >> (16 + 4 * i)) & 15);
                }
                codes_h2(lo, o + 2 * i);
                codes_h2(hi, o + 8 + 2 * i);
            }
            if constexpr (AFF) {
                UNROLL
                for (int i = 0; i < 16; i++)
                    o[i] = h2_fma(h2_sub(o[i], 0x64006400u), d2, m2);
            } else {
                const uint32_t off = K == MOE_TYPE_Q5_0 ? 0x64106410u : 0x64086408u;
                UNROLL
                for (int i = 0; i < 16; i++)
                    o[i] = h2_mul(h2_sub(o[i], off), d2);
            }
        }
    } else if constexpr (K == MOE_TYPE_Q4_K || K == MOE_TYPE_Q5_K) {
        /* half d, dmin; scales[12]; (Q5_K: qh[32];) qs[128]. Chunk c: codes qs[32c + l], low
         * nibble → element 64c + l (sub-block 2c), high → 64c + 32 + l (sub-block 2c+1); Q5_K
         * adds bit 2c (2c+1) of qh[l] as the 5th bit. Value d·(sc·q) − dmin·m. */
        (void)nblk;
        const uint4 hd = sm_ld128(rb);
        int sc0, m0, sc1, m1;
        kq_scale_min(hd.y, hd.z, hd.w, 2 * c, &sc0, &m0);
        kq_scale_min(hd.y, hd.z, hd.w, 2 * c + 1, &sc1, &m1);
        /* q·sc (at most 31·63) is exact in f16, so only the final fma and −dmin·m round. */
        const float dmin = hf(hd.x >> 16);
        const uint32_t d2 = rep(hd.x & 0xffff), sc2a = rep(fh((float)sc0)), sc2b = rep(fh((float)sc1));
        const uint32_t nm0 = rep(fh(-dmin * (float)m0)), nm1 = rep(fh(-dmin * (float)m1));
        constexpr int QS = K == MOE_TYPE_Q5_K ? 48 : 16;
        const uint4 qv = sm_ld128(rb + QS + 32 * c + 16 * u);
        const uint32_t qs[4] = {qv.x, qv.y, qv.z, qv.w};
        uint32_t hs[4] = {0, 0, 0, 0};
        if constexpr (K == MOE_TYPE_Q5_K) {
            const uint4 hv = sm_ld128(rb + 16 + 16 * u);
            hs[0] = hv.x, hs[1] = hv.y, hs[2] = hv.z, hs[3] = hv.w;
        }
        UNROLL
        for (int i = 0; i < 4; i++) {
            uint32_t lo = qs[i] & 0x0f0f0f0fu, hi = (qs[i] >> 4) & 0x0f0f0f0fu;
            if constexpr (K == MOE_TYPE_Q5_K) {
                lo |= ((hs[i] >> (2 * c)) & 0x01010101u) << 4;
                hi |= ((hs[i] >> (2 * c + 1)) & 0x01010101u) << 4;
            }
            codes_h2(lo, o + 2 * i);
            codes_h2(hi, o + 8 + 2 * i);
        }
        UNROLL
        for (int i = 0; i < 8; i++) {
            o[i] = h2_fma(h2_mul(h2_sub(o[i], 0x64006400u), sc2a), d2, nm0);
            o[8 + i] = h2_fma(h2_mul(h2_sub(o[8 + i], 0x64006400u), sc2b), d2, nm1);
        }
    } else if constexpr (K == MOE_TYPE_Q6_K) {
        /* ql[128]; qh[64]; int8 scales[16]; half d (2-byte aligned). Chunk c = 2h + j covers
         * elements 32g + l of half h for g = 2j (run 0) and 2j + 1 (run 1): low 4 bits from
         * nibble j of ql[64h + l] (run 0) or ql[64h + 32 + l] (run 1), top 2 bits from bits
         * 2g, 2g+1 of qh[32h + l], scale scales[8h + l/16 + 2g]; unit u takes l = 16u..16u+15. */
        (void)nblk;
        const int h = c >> 1, jn = c & 1;
        const float d = hf(sm_ld16(rb + 208));
        const int sa = (int)(int8_t)sm_ld8(rb + 192 + 8 * h + u + 4 * jn);
        const int sb = (int)(int8_t)sm_ld8(rb + 192 + 8 * h + u + 4 * jn + 2);
        const uint32_t d0 = rep(fh(d * (float)sa)), d1 = rep(fh(d * (float)sb));
        const uint8_t *ql = rb + 64 * h + 16 * u, *qh = rb + 128 + 32 * h + 16 * u;
        UNROLL
        for (int i = 0; i < 4; i++) {
            const uint32_t a = sm_ld32a2(ql + 4 * i), b = sm_ld32a2(ql + 32 + 4 * i);
            const uint32_t hh = sm_ld32a2(qh + 4 * i);
            const uint32_t q0 = ((a >> (4 * jn)) & 0x0f0f0f0fu) | ((hh >> (4 * jn)) & 0x03030303u) << 4;
            const uint32_t q1 =
                ((b >> (4 * jn)) & 0x0f0f0f0fu) | ((hh >> (4 * jn + 2)) & 0x03030303u) << 4;
            codes_h2(q0, o + 2 * i);
            codes_h2(q1, o + 8 + 2 * i);
        }
        UNROLL
        for (int i = 0; i < 8; i++) {
            o[i] = h2_mul(h2_sub(o[i], 0x64206420u), d0);
            o[8 + i] = h2_mul(h2_sub(o[8 + i], 0x64206420u), d1);
        }
    }
}

/* Plain types: 8 elements as loaded (F32: 8 words, F16/BF16: 4 words of pairs) → 4 f16x2. */
template <int K> HD void convert_plain(const uint32_t *v, uint32_t o[4])
{
    UNROLL
    for (int i = 0; i < 4; i++) {
        if constexpr (K == MOE_TYPE_F32)
            o[i] = f2h2(hd_u2f(v[2 * i]), hd_u2f(v[2 * i + 1]));
        else if constexpr (K == MOE_TYPE_BF16)
            o[i] = f2h2(hd_u2f(v[i] << 16), hd_u2f(v[i] & 0xffff0000u));
        else
            o[i] = v[i];
    }
}

/* ---- the thread block --------------------------------------------------------------------- */

struct Params {
    const uint8_t *w;           /* dense: the matrix */
    const void *const *wtab;    /* grouped: the matrices */
    const int32_t *off, *xrow;  /* grouped: slot ranges, input rows (NULL: slot s reads row s) */
    const float *x;
    float *y;
    int64_t n, rows, ldx, ldy, n_tok, row_bytes;
    int n_group, max_slots, accumulate;
};

/* One thread's part of the block computing token tile tx (grouped: tile index) × row tile ty. */
template <int K, class TL, bool G>
BODY void gemm_block(const Params &p, const int tid, const int tx, const int ty, uint8_t *smem)
{
    using TT = Ty<K>;
    constexpr int BM = TL::BM, BN = TL::BN, NT = TL::NT, MI = TL::MI, NI = TL::NI;
    constexpr int XQ = BN * 16 / NT;                       /* X quads per thread per k-tile */
    constexpr int QU = TT::QUANT ? 2 * BM / NT : 0;        /* decode units per thread */
    constexpr int PU = TT::QUANT ? 0 : 8 * BM / NT;        /* plain units per thread */
    constexpr int PW = TT::ESIZE == 4 ? 8 : 4;             /* words per plain unit */
    static_assert(BN * 16 % NT == 0 && 2 * BM % NT == 0 && 8 * BM % NT == 0, "thread split");

    uint8_t *const As = smem;
    uint8_t *const Bs = As + 2 * BM * SROW;
    uint8_t *const Rw = Bs + 2 * BN * SROW;
    const uint8_t **const s_wrow =
        (const uint8_t **)(Rw + (TT::QUANT ? 2 * BM * TT::SBP : 0));
    const float **const s_xptr = (const float **)(s_wrow + BM);
    int32_t *const s_scan = (int32_t *)(s_xptr + BN);

    const int64_t row0 = (int64_t)ty * BM;
    int64_t tok0;
    int ntok;
    const uint8_t *W;
    if constexpr (G) {
        /* Tile tx of the list "group 0's token tiles, group 1's, ...": prefix sum of the tiles
         * per group, NT groups at a time. */
        if (tid == 0)
            sm_put(&s_scan[NT], -1);
        bar();
        int base = 0;
        for (int g0 = 0; g0 < p.n_group; g0 += NT) {
            const int g = g0 + tid;
            int lo = 0, cnt = 0;
            if (g < p.n_group) {
                int a = p.off[g], b = p.off[g + 1];
                lo = a < 0 ? 0 : a > p.max_slots ? p.max_slots : a;
                b = b < lo ? lo : b > p.max_slots ? p.max_slots : b;
                cnt = b - lo;
            }
            const int tiles = (cnt + BN - 1) / BN;
            sm_put(&s_scan[tid], tiles);
            bar();
            for (int dd = 1; dd < NT; dd <<= 1) {
                const int v = tid >= dd ? sm_get(&s_scan[tid - dd]) : 0;
                bar();
                if (tid >= dd)
                    sm_put(&s_scan[tid], sm_get(&s_scan[tid]) + v);
                bar();
            }
            const int incl = base + sm_get(&s_scan[tid]), excl = incl - tiles;
            if (tx >= excl && tx < incl) {
                const int k = tx - excl;
                sm_put(&s_scan[NT], g);
                sm_put(&s_scan[NT + 1], lo + k * BN);
                sm_put(&s_scan[NT + 2], cnt - k * BN < BN ? cnt - k * BN : BN);
            }
            base += sm_get(&s_scan[NT - 1]);
            bar();
            if (sm_get(&s_scan[NT]) >= 0)
                break;
        }
        const int g = sm_get(&s_scan[NT]);
        if (g < 0)
            return; /* past the real tile count: the whole block leaves */
        tok0 = sm_get(&s_scan[NT + 1]);
        ntok = sm_get(&s_scan[NT + 2]);
        W = (const uint8_t *)p.wtab[g];
    } else {
        tok0 = (int64_t)tx * BN;
        ntok = p.n_tok - tok0 < BN ? (int)(p.n_tok - tok0) : BN;
        W = p.w;
    }

    /* Row pointers: rows past the end repeat the last one (read, never stored); tokens past the
     * tile's count repeat its last token. */
    for (int r = tid; r < BM; r += NT) {
        const int64_t gr = row0 + r < p.rows ? row0 + r : p.rows - 1;
        sm_put(&s_wrow[r], W + gr * p.row_bytes);
    }
    for (int t = tid; t < BN; t += NT) {
        const int64_t slot = tok0 + (t < ntok ? t : ntok - 1);
        const int64_t xr = G && p.xrow ? (int64_t)p.xrow[slot] : slot;
        sm_put(&s_xptr[t], p.x + xr * p.ldx);
    }
    bar();

    const int n = (int)p.n, KT = (n + BK - 1) / BK;
    const bool xvec = ((uintptr_t)p.x & 15) == 0 && (p.ldx & 3) == 0;
    const bool wvec = ((uintptr_t)W & 15) == 0 && (p.row_bytes & 15) == 0;
    const uint8_t *const wend = W + p.rows * p.row_bytes;
    const int nb = n / TT::BLCK;                 /* blocks per row */
    constexpr int KPS = 1 << TT::LK;             /* quantized: k-tiles per super-tile */
    const int NST = (n + TT::SPB - 1) / TT::SPB; /* quantized: super-tiles per row */

    float4 xr[XQ];
    uint32_t wr[PU > 0 ? PU : 1][PW];
    float acc[MI][NI][4];
    UNROLL
    for (int i = 0; i < MI; i++)
        UNROLL
        for (int j = 0; j < NI; j++)
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    /* X quads of k-tile kt into registers: quad q covers token q/16, elements 4·(q%16)... */
    auto load_x = [&](int kt) {
        UNROLL
        for (int i = 0; i < XQ; i++) {
            const int q = tid + i * NT, t = q >> 4, k = kt * BK + 4 * (q & 15);
            const float *src = sm_get(&s_xptr[t]) + k;
            if (xvec && k + 4 <= n) {
                xr[i] = ldg_f4(src);
            } else {
                xr[i].x = k < n ? ldg_f(src) : 0.0f;
                xr[i].y = k + 1 < n ? ldg_f(src + 1) : 0.0f;
                xr[i].z = k + 2 < n ? ldg_f(src + 2) : 0.0f;
                xr[i].w = k + 3 < n ? ldg_f(src + 3) : 0.0f;
            }
        }
    };
    auto store_x = [&](int buf) {
        UNROLL
        for (int i = 0; i < XQ; i++) {
            const int q = tid + i * NT, t = q >> 4;
            sm_st64(Bs + (buf * BN + t) * SROW + 8 * (q & 15),
                    make_uint2(f2h2(xr[i].x, xr[i].y), f2h2(xr[i].z, xr[i].w)));
        }
    };
    /* Plain weights: unit q = row q/8, elements 8·(q%8)... of the k-tile. */
    auto load_w = [&](int kt) {
        UNROLL
        for (int i = 0; i < PU; i++) {
            const int q = tid + i * NT, r = q >> 3, k = kt * BK + 8 * (q & 7);
            const uint8_t *src = sm_get(&s_wrow[r]) + (size_t)k * TT::ESIZE;
            if (wvec && k + 8 <= n) {
                const uint4 a = ldg_u4(src);
                wr[i][0] = a.x, wr[i][1] = a.y, wr[i][2] = a.z, wr[i][3] = a.w;
                if constexpr (TT::ESIZE == 4) {
                    const uint4 b = ldg_u4(src + 16);
                    wr[i][4] = b.x, wr[i][5] = b.y, wr[i][6] = b.z, wr[i][7] = b.w;
                }
            } else if constexpr (TT::ESIZE == 4) {
                UNROLL
                for (int e = 0; e < 8; e++)
                    wr[i][e] = k + e < n ? (uint32_t)ldg_u16(src + 4 * e) |
                                               (uint32_t)ldg_u16(src + 4 * e + 2) << 16
                                         : 0u;
            } else {
                UNROLL
                for (int e = 0; e < 4; e++)
                    wr[i][e] = (k + 2 * e < n ? ldg_u16(src + 4 * e) : 0u) |
                               (k + 2 * e + 1 < n ? ldg_u16(src + 4 * e + 2) : 0u) << 16;
            }
        }
    };
    auto store_w = [&](int buf) {
        UNROLL
        for (int i = 0; i < PU; i++) {
            const int q = tid + i * NT, r = q >> 3;
            uint32_t o[4];
            convert_plain<K>(wr[i], o);
            sm_st128(As + (buf * BM + r) * SROW + 16 * (q & 7), make_uint4(o[0], o[1], o[2], o[3]));
        }
    };
    /* Raw super-tile s of every row into raw buffer rb. 16-byte copies when the K-quant rows are
     * 16-aligned; otherwise 4-byte words covering the row's bytes [start, start + bytes) from
     * start rounded down to 4 (the row's "phase", 0 or 2, is kept in smem). The words read a few
     * bytes of the neighbouring rows, which are in the matrix, except past the end of the last
     * row: that last partial word is copied 2 bytes at a time. */
    auto issue_raw = [&](int s, int rb) {
        if constexpr (TT::QUANT) {
            uint8_t *R = Rw + rb * BM * TT::SBP;
            const int bytes = (nb - TT::NBS * s < TT::NBS ? nb - TT::NBS * s : TT::NBS) * TT::BS;
            if (TT::K16 && wvec) {
                constexpr int CH = TT::SB / 16;
                for (int f = tid; f < BM * CH; f += NT) {
                    const int r = f / CH, ch = f - r * CH;
                    cp_async16(R + r * TT::SBP + 16 * ch,
                               sm_get(&s_wrow[r]) + (size_t)s * TT::SB + 16 * ch);
                }
            } else {
                constexpr int WR = TT::SBP / 4;
                for (int f = tid; f < BM * WR; f += NT) {
                    const int r = f / WR, wd = f - r * WR;
                    const uint8_t *src = sm_get(&s_wrow[r]) + (size_t)s * TT::SB;
                    const int ph = (int)((uintptr_t)src & 3);
                    if (wd < (ph + bytes + 3) >> 2) {
                        const uint8_t *ws = src - ph + 4 * wd;
                        uint8_t *dst = R + r * TT::SBP + 4 * wd;
                        if (ws + 4 <= wend)
                            cp_async4(dst, ws);
                        else
                            sm_st16(dst, ldg_u16(ws));
                    }
                }
            }
            cp_commit();
        }
    };
    /* Quantized weights: k-tile kt decoded from its super-tile's raw buffer into stage buf. */
    auto decode = [&](int kt, int buf) {
        if constexpr (TT::QUANT) {
            const int s = kt >> TT::LK, c = kt & (KPS - 1);
            const uint8_t *R = Rw + (s & 1) * BM * TT::SBP;
            const int nblk = nb - TT::NBS * s < TT::NBS ? nb - TT::NBS * s : TT::NBS;
            UNROLL
            for (int i = 0; i < QU; i++) {
                const int q = tid + i * NT, r = q % BM, u = q / BM;
                int ph = 0;
                if constexpr (!TT::K16)
                    ph = (int)(((uintptr_t)sm_get(&s_wrow[r]) + (size_t)s * TT::SB) & 3);
                uint32_t o[16];
                decode_q<K>(R + r * TT::SBP + ph, c, u, nblk, o);
                uint8_t *dst = As + (buf * BM + r) * SROW;
                const int p0 = 2 * run_pos<K>(u, 0), p1 = 2 * run_pos<K>(u, 1);
                sm_st128(dst + p0, make_uint4(o[0], o[1], o[2], o[3]));
                sm_st128(dst + p0 + 16, make_uint4(o[4], o[5], o[6], o[7]));
                sm_st128(dst + p1, make_uint4(o[8], o[9], o[10], o[11]));
                sm_st128(dst + p1 + 16, make_uint4(o[12], o[13], o[14], o[15]));
            }
        }
    };
    /* The warp's 64×32 or 32×32 outputs over one k-tile: per 16-deep step, B fragments for all
     * its token columns, then per 16-row block one A fragment and NI mma. */
    const int warp = tid >> 5, lane = tid & 31, wm = warp / TL::WGN, wn = warp % TL::WGN;
    auto mma_tile = [&](int buf) {
        const uint8_t *a0 = As + (buf * BM + wm * TL::WM + (lane & 15)) * SROW + (lane >> 4) * 16;
        const uint8_t *b0 =
            Bs + (buf * BN + wn * TL::WN + (lane & 7) + ((lane >> 4) << 3)) * SROW + ((lane >> 3) & 1) * 16;
        UNROLL
        for (int ks = 0; ks < BK / 16; ks++) {
            uint32_t bf[NI][2];
            UNROLL
            for (int j = 0; j < NI / 2; j++) {
                uint32_t r4[4];
                ldsm_x4(r4, b0 + j * 16 * SROW + ks * 32);
                bf[2 * j][0] = r4[0], bf[2 * j][1] = r4[1];
                bf[2 * j + 1][0] = r4[2], bf[2 * j + 1][1] = r4[3];
            }
            UNROLL
            for (int i = 0; i < MI; i++) {
                uint32_t af[4];
                ldsm_x4(af, a0 + i * 16 * SROW + ks * 32);
                UNROLL
                for (int j = 0; j < NI; j++)
                    mma16816(acc[i][j], af, bf[j]);
            }
        }
    };

    /* Prologue: stage 0 decoded, k-tile 1 in registers, super-tiles 0 and 1 landed. */
    if constexpr (TT::QUANT) {
        issue_raw(0, 0);
        if (NST > 1)
            issue_raw(1, 1);
        cp_wait();
    } else {
        load_w(0);
    }
    load_x(0);
    bar();
    if constexpr (TT::QUANT)
        decode(0, 0);
    else
        store_w(0);
    store_x(0);
    if (KT > 1) {
        load_x(1);
        if constexpr (!TT::QUANT)
            load_w(1);
    }
    bar();

    for (int kt = 0; kt < KT; kt++) {
        const int cur = kt & 1;
        /* Super-tile s is read by the decodes of k-tiles KPS·s .. KPS·s + KPS-1, which run in
         * iterations KPS·s - 1 .. KPS·s + KPS-2. Its buffer held super-tile s-2, last read in
         * iteration KPS·s - KPS - 2, so it is refilled at the top of iteration KPS·(s-1) - 1
         * and waited for at the end of iteration KPS·s - 2: KPS iterations in flight. */
        if constexpr (TT::QUANT) {
            const int sn = ((kt + 1) >> TT::LK) + 1;
            if (((kt + 1) & (KPS - 1)) == 0 && sn < NST)
                issue_raw(sn, sn & 1);
        }
        mma_tile(cur);
        if (kt + 1 < KT) {
            if constexpr (TT::QUANT)
                decode(kt + 1, cur ^ 1);
            else
                store_w(cur ^ 1);
            store_x(cur ^ 1);
            if (kt + 2 < KT) {
                load_x(kt + 2);
                if constexpr (!TT::QUANT)
                    load_w(kt + 2);
                if constexpr (TT::QUANT) {
                    if (((kt + 2) & (KPS - 1)) == 0)
                        cp_wait();
                }
            }
        }
        bar();
    }

    /* Fragment (i, j) element e of this lane: row g (+8 for e >= 2), token 2·t4 (+1 for odd e). */
    const int g = lane >> 2, t4 = lane & 3;
    UNROLL
    for (int i = 0; i < MI; i++) {
        UNROLL
        for (int j = 0; j < NI; j++) {
            UNROLL
            for (int e = 0; e < 4; e++) {
                const int64_t r = row0 + wm * TL::WM + i * 16 + g + 8 * (e >> 1);
                const int t = wn * TL::WN + j * 8 + 2 * t4 + (e & 1);
                if (r < p.rows && t < ntok) {
                    float *yp = p.y + (tok0 + t) * p.ldy + r;
                    float v = acc[i][j][e];
                    if (p.accumulate)
                        v += *yp;
                    *yp = v;
                }
            }
        }
    }
}

/* Blocks per SM asked of the register allocator. The 8-warp tile runs two blocks per SM where
 * their smem fits twice in the 228 KB of an SM (with 1 KB reserved per block): the quantized
 * types then fit 128 registers without spills (the plain types would spill; Q5_K/Q6_K raw tiles
 * are too big), otherwise one. */
template <int K, class TL> constexpr int min_blocks()
{
    return TL::NT == 256 ? (Ty<K>::QUANT && 2 * (smem_bytes<K, TL>() + 1024) <= 233472 ? 2 : 1)
                         : TL::MINB;
}

#ifndef MOE_GEMM_HOST_EMU
template <int K, class TL, bool G>
__global__ void __launch_bounds__(TL::NT, (min_blocks<K, TL>())) gemm_kernel(const Params p)
{
    extern __shared__ __align__(16) uint8_t smem[];
    gemm_block<K, TL, G>(p, (int)threadIdx.x, (int)blockIdx.y, (int)blockIdx.x, smem);
}
#else
/* The emulator runs the grid gx × gy of gemm_block on the host. */
template <int K, class TL, bool G> void emu_launch(const Params &p, int64_t gx, int64_t gy);
#endif

/* ---- host side ---------------------------------------------------------------------------- */

std::atomic<int> g_force_tile{-1};

struct TileInfo {
    int bm, bn;
    double eff; /* relative throughput per block-area, for the shape choice */
};
constexpr TileInfo tile_info[N_TILES] = {
    {T0::BM, T0::BN, 1.0}, {T1::BM, T1::BN, 0.85}, {T2::BM, T2::BN, 0.7}, {T3::BM, T3::BN, 0.6}};

/* Dense: the shape with the least estimated time, time ~ waves × tile area / efficiency, where a
 * wave is one block per SM (a lone block per SM is the common case for the large tiles). */
int pick_dense(int64_t rows, int64_t n_tok, int sms)
{
    int best = 0;
    double best_cost = 0;
    for (int t = 0; t < 3; t++) {
        const TileInfo &ti = tile_info[t];
        const int64_t blocks = ((rows + ti.bm - 1) / ti.bm) * ((n_tok + ti.bn - 1) / ti.bn);
        const double waves = (double)((blocks + sms - 1) / sms);
        const double cost = waves * ti.bm * ti.bn / ti.eff;
        if (t == 0 || cost < best_cost)
            best = t, best_cost = cost;
    }
    return best;
}

/* Grouped: by the mean slots per group (the counts themselves are on the device). */
int pick_grouped(int n_group, int64_t max_slots)
{
    const double mean = (double)max_slots / n_group;
    return mean <= 40 ? 3 : mean <= 96 ? 1 : 0;
}

/* grid.x: row tiles; grid.y: token tiles (dense: n_tok tokens) or the bound of the grouped
 * tile list (Σ_g ceil(count_g / BN) <= n_group + max_slots / BN). */
template <class TL, bool G> void grid_shape(const Params &p, int64_t *gx, int64_t *gy)
{
    *gx = (p.rows + TL::BM - 1) / TL::BM;
    *gy = G ? p.n_group + p.max_slots / TL::BN : (p.n_tok + TL::BN - 1) / TL::BN;
}

template <int K, class TL, bool G> int launch_shape(const Params &p, cudaStream_t s)
{
    constexpr int smem = smem_bytes<K, TL>();
    int64_t gx, gy;
    grid_shape<TL, G>(p, &gx, &gy);
    if (gx > 0x7fffffff || gy > 65535)
        return -EINVAL;
#ifndef MOE_GEMM_HOST_EMU
    MOE_CUDA_TRY((moe_raise_smem<gemm_kernel<K, TL, G>>(smem)));
    gemm_kernel<K, TL, G><<<dim3((unsigned)gx, (unsigned)gy), TL::NT, smem, s>>>(p);
#else
    (void)smem, (void)s;
    emu_launch<K, TL, G>(p, gx, gy);
#endif
    MOE_CUDA_TRY(cudaGetLastError());
    return 0;
}

/* The device's shared memory a block may opt in to (moe_smem_optin); 0: not known. */
static int smem_optin()
{
#ifndef MOE_GEMM_HOST_EMU
    return moe_smem_optin();
#else
    return 0;
#endif
}

/* The tile to launch: the one picked or, where its shared memory does not fit the device (the
 * 128×128 tile of Q8_0 and the K-quants takes 110-128 KB, over the 99 KB of compute capability
 * 8.6 and 8.9; 128×64 and 128×32 of Q5_K/Q6_K 90-109 KB), a smaller one that does; the 64×64 tile
 * takes 64 KB at most. Never a change on Hopper (227 KB). */
template <int K> int fit_tile(int tile)
{
    const int optin = smem_optin();
    if (optin <= 0)
        return tile;
    const int need[N_TILES] = {smem_bytes<K, T0>(), smem_bytes<K, T1>(), smem_bytes<K, T2>(),
                               smem_bytes<K, T3>()};
    if (need[tile] <= optin)
        return tile;
    for (int t : {1, 3, 2})
        if (need[t] <= optin)
            return t;
    return 2;
}

template <int K, bool G> int launch_tile(int tile, const Params &p, cudaStream_t s)
{
    switch (fit_tile<K>(tile)) {
    case 0: return launch_shape<K, T0, G>(p, s);
    case 1: return launch_shape<K, T1, G>(p, s);
    case 2: return launch_shape<K, T2, G>(p, s);
    default: return launch_shape<K, T3, G>(p, s);
    }
}

template <bool G> int dispatch(uint32_t type, int tile, const Params &p, cudaStream_t s)
{
    switch (type) {
    case MOE_TYPE_F32: return launch_tile<MOE_TYPE_F32, G>(tile, p, s);
    case MOE_TYPE_F16: return launch_tile<MOE_TYPE_F16, G>(tile, p, s);
    case MOE_TYPE_BF16: return launch_tile<MOE_TYPE_BF16, G>(tile, p, s);
    case MOE_TYPE_Q8_0: return launch_tile<MOE_TYPE_Q8_0, G>(tile, p, s);
    case MOE_TYPE_Q4_0: return launch_tile<MOE_TYPE_Q4_0, G>(tile, p, s);
    case MOE_TYPE_Q4_1: return launch_tile<MOE_TYPE_Q4_1, G>(tile, p, s);
    case MOE_TYPE_Q5_0: return launch_tile<MOE_TYPE_Q5_0, G>(tile, p, s);
    case MOE_TYPE_Q5_1: return launch_tile<MOE_TYPE_Q5_1, G>(tile, p, s);
    case MOE_TYPE_Q4_K: return launch_tile<MOE_TYPE_Q4_K, G>(tile, p, s);
    case MOE_TYPE_Q5_K: return launch_tile<MOE_TYPE_Q5_K, G>(tile, p, s);
    case MOE_TYPE_Q6_K: return launch_tile<MOE_TYPE_Q6_K, G>(tile, p, s);
    }
    return MOE_EUNSUPPORTED;
}

bool aligned(const void *p, uintptr_t a)
{
    return ((uintptr_t)p & (a - 1)) == 0;
}

/* Checks shared by both entry points. */
int check_common(uint32_t type, int64_t n, int64_t rows, int64_t ldx, int64_t ldy)
{
    if (!moe_cuda_gemm_supported(type))
        return MOE_EUNSUPPORTED;
    const struct moe_type_info *ti = moe_type_get(type);
    if (n <= 0 || n > (1 << 30) || n % ti->blck != 0 || rows < 0 || rows > 0x7fffffff ||
        ldx < n || ldy < rows)
        return -EINVAL;
    return 0;
}

Params dense_params(uint32_t type, const void *d_w, int64_t n, int64_t rows, const float *d_x,
                    int64_t ldx, int64_t n_tok, float *d_y, int64_t ldy, int accumulate)
{
    Params p = {};
    p.w = (const uint8_t *)d_w;
    p.x = d_x;
    p.y = d_y;
    p.n = n, p.rows = rows, p.ldx = ldx, p.ldy = ldy, p.n_tok = n_tok;
    p.row_bytes = (int64_t)moe_row_bytes(type, n);
    p.accumulate = accumulate != 0;
    return p;
}

Params grouped_params(uint32_t type, const void *const *d_wtab, int64_t n, int64_t rows,
                      int n_group, const int32_t *d_off, const int32_t *d_xrow, const float *d_x,
                      int64_t ldx, float *d_y, int64_t ldy, int64_t max_slots)
{
    Params p = {};
    p.wtab = d_wtab;
    p.off = d_off;
    p.xrow = d_xrow;
    p.x = d_x;
    p.y = d_y;
    p.n = n, p.rows = rows, p.ldx = ldx, p.ldy = ldy;
    p.row_bytes = (int64_t)moe_row_bytes(type, n);
    p.n_group = n_group, p.max_slots = (int)max_slots;
    return p;
}

uintptr_t w_align(uint32_t type)
{
    return type == MOE_TYPE_F16 || type == MOE_TYPE_BF16 ? 2 : 4;
}

} /* namespace */

extern "C" int moe_cuda_gemm_supported(uint32_t type)
{
    switch (type) {
    case MOE_TYPE_F32: case MOE_TYPE_F16: case MOE_TYPE_BF16: case MOE_TYPE_Q8_0:
    case MOE_TYPE_Q4_0: case MOE_TYPE_Q4_1: case MOE_TYPE_Q5_0: case MOE_TYPE_Q5_1:
    case MOE_TYPE_Q4_K: case MOE_TYPE_Q5_K: case MOE_TYPE_Q6_K:
        return 1;
    default:
        return 0;
    }
}

extern "C" int moe_cuda_gemm_force_tile(int tile)
{
    if (tile < -1 || tile >= N_TILES)
        return -EINVAL;
    return g_force_tile.exchange(tile);
}

extern "C" int moe_cuda_gemm(uint32_t type, const void *d_w, int64_t n, int64_t rows,
                             const float *d_x, int64_t ldx, int64_t n_tok, float *d_y,
                             int64_t ldy, int accumulate, cudaStream_t s)
{
    int rc = check_common(type, n, rows, ldx, ldy);
    if (rc != 0)
        return rc;
    if (n_tok < 0 || n_tok > 2000000 || !d_w || !d_x || !d_y || !aligned(d_w, w_align(type)) ||
        !aligned(d_x, 4) || !aligned(d_y, 4))
        return -EINVAL;
    if (rows == 0 || n_tok == 0)
        return 0;
    int tile = g_force_tile.load();
    if (tile < 0) {
        int dev = 0, sms = 0;
        MOE_CUDA_TRY(cudaGetDevice(&dev));
        MOE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        tile = pick_dense(rows, n_tok, sms > 0 ? sms : 1);
    }
    const Params p = dense_params(type, d_w, n, rows, d_x, ldx, n_tok, d_y, ldy, accumulate);
    return dispatch<false>(type, tile, p, s);
}

extern "C" int moe_cuda_gemm_grouped(uint32_t type, const void *const *d_wtab, int64_t n,
                                     int64_t rows, int n_group, const int32_t *d_off,
                                     const int32_t *d_xrow, const float *d_x, int64_t ldx,
                                     float *d_y, int64_t ldy, int64_t max_slots, cudaStream_t s)
{
    int rc = check_common(type, n, rows, ldx, ldy);
    if (rc != 0)
        return rc;
    if (n_group < 0 || n_group > 16384 || max_slots < 0 || max_slots > 1000000 || !d_wtab ||
        !d_off || !d_x || !d_y || !aligned(d_x, 4) || !aligned(d_y, 4) ||
        !aligned(d_wtab, sizeof(void *)) || !aligned(d_off, 4) || !aligned(d_xrow, 4))
        return -EINVAL;
    if (n_group == 0 || rows == 0 || max_slots == 0)
        return 0;
    int tile = g_force_tile.load();
    if (tile < 0)
        tile = pick_grouped(n_group, max_slots);
    const Params p = grouped_params(type, d_wtab, n, rows, n_group, d_off, d_xrow, d_x, ldx, d_y,
                                    ldy, max_slots);
    return dispatch<true>(type, tile, p, s);
}
