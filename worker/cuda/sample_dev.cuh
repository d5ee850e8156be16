/* The sampler's per-row algorithm (worker/cuda/sample.cu has the design, the kernels and the
 * API): __host__ __device__ templates over an executor, the device's (DevExec) or a host
 * emulation's (tests/test_sample_host.cu), in namespace moe_sample. */
#ifndef MOE_CUDA_SAMPLE_DEV_CUH
#define MOE_CUDA_SAMPLE_DEV_CUH

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

extern "C" {
#include "store/err.h"
#include "worker/sampler.h"
}
#include "worker/cuda/argmax_dev.cuh"
#include "worker/cuda/hd.cuh"
#include "worker/cuda/sample.h"

namespace moe_sample {

constexpr int NT = 1024;               /* threads per block = per row */
constexpr int HBITS = 12;
constexpr int HB = 1 << HBITS;         /* histogram bins of the widest digit */
constexpr int RPT = HB / NT;           /* bins per thread in a bin scan */
constexpr int MAXLEV = 6;              /* 3 logit digits + up to 3 id digits */
constexpr uint32_t DEFAULT_LIST_CAP = 8192;
constexpr uint32_t MAX_LIST_CAP = 16384;
constexpr uint32_t MAX_HIST_CAP = 1u << 15;
constexpr uint32_t MAX_VOCAB = 1u << 30;
/* In the z of top-p without top-k, terms below e^-12 of the largest use the fast float exp:
 * their sum's error stays below ~1e-9 of z while most of a real vocabulary skips the double exp. */
constexpr float HEAD_CUT = -12.0f;
/* The float-estimated nucleus of tier A is cut at top_p + this (of the estimated total). */
constexpr double TOPP_MARGIN = 1e-4;
constexpr int32_t NEED_EXACT = -2;

static_assert(NT == 1024 && HB % NT == 0, "block shape");

enum { W_COUNT, W_FMASS, W_DP, W_DQ };

struct Levels {
    int n;
    int shift[MAXLEV];
    int width[MAXLEV];
};

/* One segment of a logits row, from scan_kernel: its largest value (NaNs and -inf skipped), the
 * lowest index holding it (-1: none), how many values were above -inf. */
struct ScanPart {
    float bv;
    int32_t bi;
    uint32_t c;
};
constexpr uint32_t NSEG = 64;  /* segments a row is scanned in by scan_kernel */
constexpr int SCAN_NT = 256;   /* threads of a scan_kernel block */

/* One segment of a tier-C row from csum_kernel: the sum of its candidates' draw weights (its
 * SCAN_NT sub-ranges' sums added in order) and its last candidate (-1: none). */
struct CSum {
    double s;
    int32_t last;
};

struct Args {
    /* part (or NULL): rows' segments from scan_kernel, NSEG a row, which a greedy row without
     * penalties takes instead of its first pass (the same maximum, lowest index and count). */
    const ScanPart *part;
    /* csum (or NULL): rows' segment sums from csum_kernel, NSEG a row, which a tier-C row
     * without penalties (csum_row) draws from instead of summing its whole row in one block. */
    const CSum *csum;
    /* kdone (or NULL): per logits row, 1 when sample_spread_kernel<true> drew it (sample_kernel
     * leaves it), written for every row of the launch before sample_kernel runs. */
    uint8_t *kdone;
    /* tp (or NULL): the spread top-p rows' state between launches (TpRow, one a logits row),
     * their histograms (tph_c, tph_m: HB bins a row, zero between uses) and lists (tpl:
     * list_cap keys a row). */
    struct TpRow *tp;
    uint32_t *tph_c;
    double *tph_m;
    uint64_t *tpl;
    /* pen_done: penalty_kernel has applied every row's penalties to its logits (so the spread
     * passes see the penalised logits and no kernel applies them again). */
    int pen_done;
    float *logits;
    const int32_t *rowmap; /* logits row -> state row; NULL: the same */
    int32_t *tokens;
    float *logprobs;
    const moe_cuda_sample_row *params;
    moe_cuda_sample_state *state;
    int32_t *ring;
    uint32_t n_vocab, hist_cap, list_cap;
    uint32_t chunk; /* sorted-list entries per thread in list scans: ceil(list_cap / NT) */
    int accept;
    Levels lev;
};

/* Shared memory, carved from one dynamic allocation. */
struct Smem {
    double *rd;      /* [72] scratch of the reductions and scans */
    long long *rl;   /* [72] */
    float *rf;       /* [72] */
    double *td0, *td1;
    long long *tl0;
    int *ti0, *ti1, *ti2, *ti3;
    float *tf0, *tf1; /* [NT] per-thread values that outlive a phase */
    uint32_t *cnt;   /* [HB] */
    float *fmass;    /* [HB] */
    double *mass;    /* [HB] */
    uint64_t *list;  /* [list_cap] sorted candidates (keys) */
    uint32_t *win;   /* [win_cap] the penalty window; aliases list (used before it) */
    uint32_t *list_n;
};

static inline uint32_t pow2ceil_host(uint32_t n)
{
    uint32_t p = 1;
    while (p < n)
        p <<= 1;
    return p;
}

HD uint32_t pow2ceil(uint32_t n)
{
    uint32_t p = 1;
    while (p < n)
        p <<= 1;
    return p;
}

/* Byte offsets of the shared arrays; returns the total. */
HD size_t smem_layout(uint32_t list_cap, uint32_t win_cap, size_t off[16])
{
    const size_t sizes[16] = {72 * sizeof(double),
                              72 * sizeof(long long),
                              72 * sizeof(float),
                              NT * sizeof(double),
                              NT * sizeof(double),
                              NT * sizeof(long long),
                              NT * sizeof(int),
                              NT * sizeof(int),
                              NT * sizeof(int),
                              NT * sizeof(int),
                              NT * sizeof(float),
                              NT * sizeof(float),
                              HB * sizeof(uint32_t),
                              HB * sizeof(float),
                              HB * sizeof(double),
                              0};
    size_t o = 0;
    for (int i = 0; i < 15; i++) {
        off[i] = o;
        o += (sizes[i] + 15) & ~(size_t)15;
    }
    size_t lb = (size_t)list_cap * sizeof(uint64_t), wb = (size_t)win_cap * sizeof(uint32_t);
    off[15] = o;
    o += ((lb > wb ? lb : wb) + 15) & ~(size_t)15;
    return o + 16; /* list_n */
}

HD Smem smem_carve(unsigned char *base, uint32_t list_cap, uint32_t win_cap)
{
    size_t off[16];
    size_t total = smem_layout(list_cap, win_cap, off);
    Smem s;
    s.rd = (double *)(base + off[0]);
    s.rl = (long long *)(base + off[1]);
    s.rf = (float *)(base + off[2]);
    s.td0 = (double *)(base + off[3]);
    s.td1 = (double *)(base + off[4]);
    s.tl0 = (long long *)(base + off[5]);
    s.ti0 = (int *)(base + off[6]);
    s.ti1 = (int *)(base + off[7]);
    s.ti2 = (int *)(base + off[8]);
    s.ti3 = (int *)(base + off[9]);
    s.tf0 = (float *)(base + off[10]);
    s.tf1 = (float *)(base + off[11]);
    s.cnt = (uint32_t *)(base + off[12]);
    s.fmass = (float *)(base + off[13]);
    s.mass = (double *)(base + off[14]);
    s.list = (uint64_t *)(base + off[15]);
    s.win = (uint32_t *)(base + off[15]);
    s.list_n = (uint32_t *)(base + total - 16);
    return s;
}

/* The state row of logits row `row` (through the row map, if any). */
HD uint32_t state_row(const Args &a, uint32_t row)
{
    return a.rowmap ? (uint32_t)a.rowmap[row] : row;
}

/* ---- float arithmetic exactly as the CPU's (no contraction) ---- */

#ifdef __CUDA_ARCH__
HD float fadd(float a, float b) { return __fadd_rn(a, b); }
HD float fsub(float a, float b) { return __fsub_rn(a, b); }
HD float fmul(float a, float b) { return __fmul_rn(a, b); }
HD float fdiv(float a, float b) { return __fdiv_rn(a, b); }
/* Estimates only (histogram masses, the tail of a z, logprobs): the fast exp is enough. */
HD float fexp(float a) { return __expf(a); }
#else
HD float fadd(float a, float b) { return a + b; }
HD float fsub(float a, float b) { return a - b; }
HD float fmul(float a, float b) { return a * b; }
HD float fdiv(float a, float b) { return a / b; }
HD float fexp(float a) { return expf(a); }
#endif

/* ---- the order key ---- */

/* Monotone map of a non-NaN float to uint32 (+0 and -0 both map to 0x80000000: the CPU
 * compares them equal, so the id must decide between them). */
HD uint32_t fkey(float l)
{
    if (l == 0.0f)
        return 0x80000000u;
    const uint32_t b = hd_f2u(l);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

HD uint64_t key(float l, uint32_t id, uint32_t nv)
{
    return (uint64_t)fkey(l) << 32 | (uint64_t)(nv - 1 - id);
}

HD float kval(uint64_t k)
{
    const uint32_t f = (uint32_t)(k >> 32);
    return hd_u2f((f & 0x80000000u) ? (f & 0x7fffffffu) : ~f);
}

HD int32_t kid(uint64_t k, uint32_t nv)
{
    return (int32_t)(nv - 1 - (uint32_t)k);
}

/* ---- the generator: worker/sampler.c's xoshiro256** and splitmix64 ---- */

HD uint64_t rotl64(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

HD uint64_t xoshiro_next(uint64_t *r)
{
    const uint64_t result = rotl64(r[1] * 5, 7) * 9;
    const uint64_t t = r[1] << 17;
    r[2] ^= r[0];
    r[3] ^= r[1];
    r[1] ^= r[2];
    r[0] ^= r[3];
    r[2] ^= t;
    r[3] = rotl64(r[3], 45);
    return result;
}

HD double rng_unit(uint64_t *r)
{
    return (double)(xoshiro_next(r) >> 11) * 0x1.0p-53;
}

static void rng_seed(uint64_t seed, uint64_t r[4])
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) {
        uint64_t z = (x += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        r[i] = z ^ (z >> 31);
    }
}

/* ---- the device executor ---- */

#ifdef __CUDA_ARCH__
#define FULL_MASK 0xffffffffu

template <class T> __device__ __forceinline__ T warp_sum(T v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

template <class T> __device__ __forceinline__ T warp_max(T v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        T y = __shfl_xor_sync(FULL_MASK, v, o);
        v = y > v ? y : v;
    }
    return v;
}

template <class T> __device__ __forceinline__ T warp_min(T v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        T y = __shfl_xor_sync(FULL_MASK, v, o);
        v = y < v ? y : v;
    }
    return v;
}

__device__ __forceinline__ float warp_maxf(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

/* op 0: sum, 1: max, 2: min. The result reaches every thread; three barriers (the last one
 * lets the next primitive reuse the scratch). */
template <int OP, class T> __device__ __forceinline__ T block_reduce(T v, T *s)
{
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    v = OP == 0 ? warp_sum(v) : OP == 1 ? warp_max(v) : warp_min(v);
    if (l == 0)
        s[w] = v;
    __syncthreads();
    if (w == 0) {
        T t = s[l];
        t = OP == 0 ? warp_sum(t) : OP == 1 ? warp_max(t) : warp_min(t);
        if (l == 0)
            s[32] = t;
    }
    __syncthreads();
    T r = s[32];
    __syncthreads();
    return r;
}

/* Scan of v over a warp's lanes in lane order: returns the inclusive sum, *ex the exclusive one
 * (the inclusive shifted by a lane, never inclusive - v). */
template <class T> __device__ __forceinline__ T warp_scan(T v, T *ex)
{
    const int l = threadIdx.x & 31;
    T inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_up_sync(FULL_MASK, inc, o);
        if (l >= o)
            inc += y;
    }
    T e = __shfl_up_sync(FULL_MASK, inc, 1);
    *ex = l == 0 ? T(0) : e;
    return inc;
}

/* Exclusive scan in thread order: excl[tid] = Σ of the values of lower threads; returns the
 * total. Exclusive values come from shifted inclusive ones (never incl - v). */
template <class T> __device__ __forceinline__ T block_scan(T v, T *excl, T *s)
{
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    T ex;
    const T inc = warp_scan(v, &ex);
    if (l == 31)
        s[w] = inc;
    __syncthreads();
    if (w == 0) {
        T te;
        const T ti = warp_scan(s[l], &te);
        s[33 + l] = te;
        if (l == 31)
            s[32] = ti;
    }
    __syncthreads();
    excl[threadIdx.x] = s[33 + w] + ex;
    T tot = s[32];
    __syncthreads();
    return tot;
}
#endif

struct DevExec {
    Smem sh;

#ifdef __CUDA_ARCH__
    template <class F> __device__ __forceinline__ void each(F f)
    {
        f((int)threadIdx.x);
        __syncthreads();
    }
    template <class F> __device__ __forceinline__ void single(F f)
    {
        if (threadIdx.x == 0)
            f();
        __syncthreads();
    }
    __device__ __forceinline__ void sync() { __syncthreads(); }
    template <class F> __device__ __forceinline__ double sum_d(F f)
    {
        return block_reduce<0, double>(f((int)threadIdx.x), sh.rd);
    }
    template <class F> __device__ __forceinline__ long long sum_l(F f)
    {
        return block_reduce<0, long long>(f((int)threadIdx.x), sh.rl);
    }
    template <class F> __device__ __forceinline__ long long max_l(F f)
    {
        return block_reduce<1, long long>(f((int)threadIdx.x), sh.rl);
    }
    template <class F> __device__ __forceinline__ long long min_l(F f)
    {
        return block_reduce<2, long long>(f((int)threadIdx.x), sh.rl);
    }
    template <class F> __device__ __forceinline__ float max_f(F f)
    {
        const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
        float v = warp_maxf(f((int)threadIdx.x));
        if (l == 0)
            sh.rf[w] = v;
        __syncthreads();
        if (w == 0) {
            float t = warp_maxf(sh.rf[l]);
            if (l == 0)
                sh.rf[32] = t;
        }
        __syncthreads();
        float r = sh.rf[32];
        __syncthreads();
        return r;
    }
    template <class F> __device__ __forceinline__ double scan_d(F f, double *excl)
    {
        return block_scan<double>(f((int)threadIdx.x), excl, sh.rd);
    }
    template <class F> __device__ __forceinline__ long long scan_l(F f, long long *excl)
    {
        return block_scan<long long>(f((int)threadIdx.x), excl, sh.rl);
    }
    __device__ __forceinline__ void atomic_add(uint32_t *p, uint32_t v) { atomicAdd(p, v); }
    __device__ __forceinline__ void atomic_add(float *p, float v) { atomicAdd(p, v); }
    __device__ __forceinline__ void atomic_add(double *p, double v) { atomicAdd(p, v); }
    __device__ __forceinline__ uint32_t atomic_inc(uint32_t *p) { return atomicAdd(p, 1u); }
#else
    /* Host side of the device executor: never called (the kernel is device code), present so
     * that the __host__ __device__ templates instantiate in nvcc's host pass. */
    template <class F> void each(F) { abort(); }
    template <class F> void single(F) { abort(); }
    void sync() { abort(); }
    template <class F> double sum_d(F) { abort(); }
    template <class F> long long sum_l(F) { abort(); }
    template <class F> long long max_l(F) { abort(); }
    template <class F> long long min_l(F) { abort(); }
    template <class F> float max_f(F) { abort(); }
    template <class F> double scan_d(F, double *) { abort(); }
    template <class F> long long scan_l(F, long long *) { abort(); }
    void atomic_add(uint32_t *, uint32_t) { abort(); }
    void atomic_add(float *, float) { abort(); }
    void atomic_add(double *, double) { abort(); }
    uint32_t atomic_inc(uint32_t *) { abort(); }
#endif
    HD void check(bool, int) {}
    HD void note(int) {}
};

/* Checks and path counters that only the host emulation evaluates. */
enum { NOTE_GREEDY, NOTE_NONE, NOTE_PINF, NOTE_A_TOPK, NOTE_A_TOPP, NOTE_A_TO_B, NOTE_B, NOTE_C,
       NOTE_B_BOUND, NOTE_LEVELS, NOTE_EXH, N_NOTES };
#ifdef __CUDA_ARCH__
#define XCHECK(x, c) ((void)0)
#define XNOTE(x, n) ((void)0)
#else
#define XCHECK(x, c) (x).check(c, __LINE__)
#define XNOTE(x, n) (x).note(n)
#endif

/* ---- loops over a row ---- */

/* Calls f(i, logits[i]) for i = t, t + NT, ... (coalesced; 16-byte loads when aligned). Each
 * thread sees its ids in increasing order. */
template <class F> HD void row_loop(const float *lg, uint32_t nv, int t, F f)
{
    if (((uintptr_t)lg & 15) == 0) {
        const uint32_t n4 = nv >> 2;
        const float4 *v4 = (const float4 *)lg;
        /* RL loads in flight before f sees them, in the same order (a 151936-wide row is 37
         * loads a thread: one at a time they cost a round trip to L2 each). MOE_SAMPLE_RL sets
         * it in a build for measurements. */
#ifndef MOE_SAMPLE_RL
#define MOE_SAMPLE_RL 4
#endif
        constexpr uint32_t RL = MOE_SAMPLE_RL;
        uint32_t q = (uint32_t)t;
        for (; q + (RL - 1) * NT < n4; q += RL * NT) {
            float4 v[RL];
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
            for (uint32_t u = 0; u < RL; u++)
                v[u] = v4[q + u * NT];
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
            for (uint32_t u = 0; u < RL; u++) {
                const uint32_t b = 4 * (q + u * NT);
                f(b, v[u].x);
                f(b + 1, v[u].y);
                f(b + 2, v[u].z);
                f(b + 3, v[u].w);
            }
        }
        for (; q < n4; q += NT) {
            const float4 v = v4[q];
            f(4 * q, v.x);
            f(4 * q + 1, v.y);
            f(4 * q + 2, v.z);
            f(4 * q + 3, v.w);
        }
        for (uint32_t i = 4 * n4 + (uint32_t)t; i < nv; i += NT)
            f(i, lg[i]);
    } else {
        for (uint32_t i = (uint32_t)t; i < nv; i += NT)
            f(i, lg[i]);
    }
}

/* Calls f(i, logits[i]) for the contiguous ids [t·R, t·R + R) ∩ [0, nv) in order, R a multiple
 * of 8: with aligned rows each 32-byte sector is read by two back-to-back 16-byte loads. */
template <class F> HD void range_loop(const float *lg, uint32_t nv, int t, uint32_t R, F f)
{
    const uint32_t lo = (uint32_t)t * R;
    const uint32_t hi = lo + R < nv ? lo + R : nv;
    uint32_t i = lo;
    if (((uintptr_t)lg & 15) == 0) {
        for (; i + 8 <= hi; i += 8) {
            const float4 a = *(const float4 *)(lg + i), b = *(const float4 *)(lg + i + 4);
            f(i, a.x);
            f(i + 1, a.y);
            f(i + 2, a.z);
            f(i + 3, a.w);
            f(i + 4, b.x);
            f(i + 5, b.y);
            f(i + 6, b.z);
            f(i + 7, b.w);
        }
    }
    for (; i < hi; i++)
        f(i, lg[i]);
}

/* ---- shared-memory building blocks ---- */

/* Sorts v[0..n2) (n2 a power of two) into descending order: bitonic, one phase per step. */
template <class X, class T> HD void sort_desc(X &x, T *v, uint32_t n2)
{
    for (uint32_t k = 2; k <= n2; k <<= 1) {
        for (uint32_t j = k >> 1; j > 0; j >>= 1) {
            int lj = 0;
            while ((1u << lj) < j)
                lj++;
            x.each([&](int t) {
                for (uint32_t q = (uint32_t)t; q < n2 / 2; q += NT) {
                    const uint32_t i = ((q >> lj) << (lj + 1)) | (q & (j - 1)), m = i + j;
                    const T a = v[i], b = v[m];
                    const bool desc = (i & k) == 0;
                    if (desc ? a < b : a > b) {
                        v[i] = b;
                        v[m] = a;
                    }
                }
            });
        }
    }
}

struct SetPred {
    uint64_t klo; /* K >= klo */
    float cut;    /* logit >= cut */
};

struct WCtx {
    float M;      /* the row's max */
    double scale; /* W_DP: z (weights exp(l - M) / z); W_DQ: the temperature */
};

HD bool in_set(float l, uint32_t i, uint32_t nv, const SetPred &sp)
{
    return l > -INFINITY && l >= sp.cut && key(l, i, nv) >= sp.klo;
}

/* The CPU's terms: exp((double)(l - mx)) / z for top-p, exp((double)(l - mx) / T) for the draw. */
HD double weight_d(int mode, float l, const WCtx &w)
{
    const double d = (double)fsub(l, w.M);
    return mode == W_DP ? exp(d) / w.scale : exp(d / w.scale);
}

HD bool reach(double c, double target, bool strict)
{
    return strict ? c > target : c >= target;
}

template <class X> HD void clear_hist(X &x, int mode, uint32_t B)
{
    Smem &s = x.sh;
    x.each([&](int t) {
        for (uint32_t b = (uint32_t)t; b < B; b += NT) {
            s.cnt[b] = 0;
            if (mode == W_FMASS)
                s.fmass[b] = 0.0f;
            else if (mode != W_COUNT)
                s.mass[b] = 0.0;
        }
    });
}

HD double mass_of(const Smem &s, int mode, uint32_t b)
{
    return mode == W_COUNT ? 0.0 : mode == W_FMASS ? (double)s.fmass[b] : s.mass[b];
}

/* Histogram by digit (K >> sft) & (B - 1) of the elements of sp whose K has prefix P under mask. */
template <class X>
HD void hist_pass(X &x, const Args &a, const float *lg, int mode, const SetPred &sp,
                  const WCtx &w, uint64_t P, uint64_t mask, int sft, uint32_t B)
{
    Smem &s = x.sh;
    const uint32_t nv = a.n_vocab;
    x.each([&](int t) {
        row_loop(lg, nv, t, [&](uint32_t i, float l) {
            if (!(l > -INFINITY) || !(l >= sp.cut))
                return;
            const uint64_t K = key(l, i, nv);
            if (K < sp.klo || (K & mask) != P)
                return;
            const uint32_t d = (uint32_t)(K >> sft) & (B - 1);
            x.atomic_add(&s.cnt[d], 1u);
            if (mode == W_FMASS)
                x.atomic_add(&s.fmass[d], fexp(fsub(l, w.M)));
            else if (mode != W_COUNT)
                x.atomic_add(&s.mass[d], weight_d(mode, l, w));
        });
    });
}

/* Where a refinement stopped: the elements of the set whose K has prefix P under mask form the
 * final bin (bin of them, above ranked higher, base their weight). */
struct Refine {
    uint64_t P, mask;
    double base;
    uint32_t above, bin, ge; /* ge = above + bin: elements with K >= P */
    bool exh0;               /* level 0 never reached the target (the whole set falls short) */
    bool bound;              /* COUNT, bin mode: the bin is entirely inside the first `target` */
    bool too_big;            /* full mode: the prefix {K >= P} never got below list_cap */
};

/* A refinement before its first level: the whole set, nothing above it. */
HD Refine refine_start()
{
    Refine r;
    r.P = r.mask = 0;
    r.base = 0.0;
    r.above = r.bin = r.ge = 0;
    r.exh0 = r.bound = r.too_big = false;
    return r;
}

/* One level of a refinement, its histogram (cnt, and the masses of mode) built: keeps the highest
 * bin at which the running weight from the top (count for W_COUNT, else the mass of `mode`),
 * added to r's, reaches target (> with strict, else >=; frac at level 0: target is first
 * scaled by the level's total). When no bin reaches it (rounding), the lowest non-empty bin is
 * kept, which walks to the set's last element. Updates r's prefix, counts and base; returns
 * whether no bin reached the target. */
template <class X>
HD bool refine_pick(X &x, const Args &a, int mode, int lv, double &target, bool frac,
                    bool strict, Refine &r)
{
    Smem &s = x.sh;
    const int sft = a.lev.shift[lv];
    const uint32_t B = 1u << a.lev.width[lv];
    /* Thread t owns ranks t·RPT.. (rank 0 = the highest bin). */
    x.scan_l(
        [&](int t) -> long long {
            long long c = 0;
            for (int k = 0; k < RPT; k++) {
                const uint32_t rk = (uint32_t)(t * RPT + k);
                if (rk < B)
                    c += s.cnt[B - 1 - rk];
            }
            return c;
        },
        s.tl0);
    double tot = 0.0;
    if (mode != W_COUNT)
        tot = x.scan_d(
            [&](int t) -> double {
                double m = 0.0;
                for (int k = 0; k < RPT; k++) {
                    const uint32_t rk = (uint32_t)(t * RPT + k);
                    if (rk < B)
                        m += mass_of(s, mode, B - 1 - rk);
                }
                return m;
            },
            s.td0);
    if (lv == 0 && frac)
        target *= tot;
    const double tg = target;
    const long long above0 = r.above;
    const double base0 = r.base;
    x.each([&](int t) {
        long long ac = s.tl0[t];
        double am = mode != W_COUNT ? s.td0[t] : 0.0;
        int first = INT_MAX, last = -1;
        for (int k = 0; k < RPT; k++) {
            const uint32_t rk = (uint32_t)(t * RPT + k);
            if (rk >= B)
                break;
            const uint32_t b = B - 1 - rk, c = s.cnt[b];
            const double m = mass_of(s, mode, b);
            if (c) {
                last = (int)rk;
                if (first == INT_MAX) {
                    const bool meets = mode == W_COUNT ? (double)(above0 + ac + c) >= tg
                                                       : reach(base0 + (am + m), tg, strict);
                    if (meets)
                        first = (int)rk;
                }
            }
            ac += c;
            am += m;
        }
        s.ti2[t] = first;
        s.ti3[t] = last;
    });
    long long rk = x.min_l([&](int t) -> long long { return s.ti2[t]; });
    const bool exh = rk == INT_MAX;
    if (exh)
        rk = x.max_l([&](int t) -> long long { return s.ti3[t]; });
    XCHECK(x, rk >= 0 && rk < (long long)B);
    const int own = (int)(rk / RPT);
    /* The owner repeats its walk up to the chosen bin: the same sums the test above saw. */
    const long long ac = x.sum_l([&](int t) -> long long {
        if (t != own)
            return 0;
        long long v = s.tl0[t];
        for (long long q = (long long)t * RPT; q < rk; q++)
            v += s.cnt[B - 1 - (uint32_t)q];
        return v;
    });
    double am = 0.0;
    if (mode != W_COUNT)
        am = x.sum_d([&](int t) -> double {
            if (t != own)
                return 0.0;
            double v = s.td0[t];
            for (long long q = (long long)t * RPT; q < rk; q++)
                v += mass_of(s, mode, B - 1 - (uint32_t)q);
            return v;
        });
    const long long bc =
        x.sum_l([&](int t) -> long long { return t == own ? s.cnt[B - 1 - (uint32_t)rk] : 0; });
    XNOTE(x, NOTE_LEVELS);
    if (exh)
        XNOTE(x, NOTE_EXH);
    r.P |= (uint64_t)(B - 1 - (uint32_t)rk) << sft;
    r.mask |= (uint64_t)(B - 1) << sft;
    r.above += (uint32_t)ac;
    r.base = base0 + am;
    r.bin = (uint32_t)bc;
    r.ge = r.above + r.bin;
    if (exh && lv == 0)
        r.exh0 = true;
    return exh;
}

/* Radix refinement over K of the set sp, level by level (refine_pick). Stops when the bin
 * (full = false) or the whole prefix {K >= P} (full = true) holds at most list_cap elements.
 * ready: the level-0 histogram is already built. */
template <class X>
HD Refine refine(X &x, const Args &a, const float *lg, int mode, double target, bool frac,
                 bool strict, bool full, const SetPred &sp, const WCtx &w, bool ready)
{
    Refine r = refine_start();
    for (int lv = 0; lv < a.lev.n; lv++) {
        const int sft = a.lev.shift[lv];
        const uint32_t B = 1u << a.lev.width[lv];
        if (!(lv == 0 && ready)) {
            clear_hist(x, mode, B);
            hist_pass(x, a, lg, mode, sp, w, r.P, r.mask, sft, B);
        }
        const bool exh = refine_pick(x, a, mode, lv, target, frac, strict, r);
        if (full) {
            if (r.ge <= a.list_cap)
                return r;
            if (exh) {
                r.too_big = true; /* the lowest bins from here on: the prefix stays the set */
                return r;
            }
        } else {
            if (mode == W_COUNT && (double)r.ge == target) {
                r.bound = true;
                return r;
            }
            if (r.bin <= a.list_cap)
                return r;
        }
    }
    if (full)
        r.too_big = true;
    return r;
}

/* Compacts into the list the n elements of sp with K >= P (full) or K's prefix == P under mask,
 * and sorts them (descending K, padded with zeros to a power of two). */
template <class X>
HD void build_list(X &x, const Args &a, const float *lg, uint32_t n, bool full, uint64_t P,
                   uint64_t mask, const SetPred &sp)
{
    Smem &s = x.sh;
    const uint32_t nv = a.n_vocab, n2 = pow2ceil(n);
    XCHECK(x, n >= 1 && n2 <= a.list_cap);
    x.each([&](int t) {
        if (t == 0)
            *s.list_n = 0;
        for (uint32_t i = n + (uint32_t)t; i < n2; i += NT)
            s.list[i] = 0;
    });
    x.each([&](int t) {
        row_loop(lg, nv, t, [&](uint32_t i, float l) {
            if (!(l > -INFINITY) || !(l >= sp.cut))
                return;
            const uint64_t K = key(l, i, nv);
            if (K < sp.klo || (full ? K < P : (K & mask) != P))
                return;
            const uint32_t j = x.atomic_inc(s.list_n);
            if (j < n)
                s.list[j] = K;
        });
    });
    XCHECK(x, *s.list_n == n);
    sort_desc(x, s.list, n2);
}

/* A list entry read by every thread; the barrier orders the reads before any later rewrite. */
template <class X> HD uint64_t read_list(X &x, uint32_t j)
{
    const uint64_t v = x.sh.list[j];
    x.sync();
    return v;
}

/* Block scan of wf over list[0..n): thread t owns the fixed chunk [t·chunk, t·chunk + chunk),
 * so the association of the sums does not depend on n. Leaves each thread's exclusive prefix
 * in td1; returns the total. */
template <class X, class W> HD double list_scan(X &x, const Args &a, uint32_t n, W wf)
{
    Smem &s = x.sh;
    const uint32_t C = a.chunk;
    return x.scan_d(
        [&](int t) -> double {
            double v = 0.0;
            const uint32_t lo = (uint32_t)t * C, hi = lo + C < n ? lo + C : n;
            for (uint32_t i = lo; i < hi; i++)
                v += wf(s.list[i]);
            return v;
        },
        s.td1);
}

/* After list_scan: the first i < n whose cumulative weight base + prefix reaches target, or -1. */
template <class X, class W>
HD int list_find(X &x, const Args &a, uint32_t n, W wf, double base, double target, bool strict)
{
    Smem &s = x.sh;
    const uint32_t C = a.chunk;
    x.each([&](int t) {
        const uint32_t lo = (uint32_t)t * C, hi = lo + C < n ? lo + C : n;
        const double e = s.td1[t];
        double run = 0.0;
        int f = INT_MAX;
        for (uint32_t i = lo; i < hi; i++) {
            run += wf(s.list[i]);
            if (reach(base + (e + run), target, strict)) {
                f = (int)i;
                break;
            }
        }
        s.ti2[t] = f;
    });
    const long long j = x.min_l([&](int t) -> long long { return s.ti2[t]; });
    return j == INT_MAX ? -1 : (int)j;
}

/* ---- the three ways of finishing a sampling row ---- */

template <class X>
HD int32_t tier_a_list(X &x, const Args &a, const moe_cuda_sample_row &p, float M, uint32_t ncand,
                       double u01, bool tk, bool tp, uint32_t nL, double z1);

/* Tier A: the candidates that matter fit the list. Returns the token or NEED_EXACT. */
template <class X>
HD int32_t tier_a(X &x, const Args &a, const moe_cuda_sample_row &p, const float *lg, float M,
                  uint32_t ncand, double u01, bool tk, bool tp)
{
    Smem &s = x.sh;
    const uint32_t nv = a.n_vocab;
    const SetPred all = {0, -INFINITY};
    const WCtx w1 = {M, 1.0};
    uint32_t nL;
    uint64_t P = 0;
    double z1 = 0.0;
    if (tk) {
        /* Exactly the top k, then those ranked just below within the list's room. */
        const Refine r = refine(x, a, lg, W_COUNT, (double)p.top_k, false, false, true, all, w1, true);
        nL = r.ge;
        P = r.P;
    } else {
        /* The CPU's z over every candidate, and the float mass histogram of digit 0. */
        const int sft = a.lev.shift[0];
        const uint32_t B = 1u << a.lev.width[0];
        clear_hist(x, W_FMASS, B);
        x.each([&](int t) {
            double z = 0.0;
            row_loop(lg, nv, t, [&](uint32_t i, float l) {
                if (!(l > -INFINITY))
                    return;
                const float d = fsub(l, M), e = fexp(d);
                z += d >= HEAD_CUT ? exp((double)d) : (double)e;
                const uint32_t dg = (uint32_t)(key(l, i, nv) >> sft) & (B - 1);
                x.atomic_add(&s.cnt[dg], 1u);
                x.atomic_add(&s.fmass[dg], e);
            });
            s.td0[t] = z;
        });
        z1 = x.sum_d([&](int t) -> double { return s.td0[t]; });
        const double frac = (double)p.top_p + TOPP_MARGIN;
        if (frac >= 1.0) {
            if (ncand > a.list_cap)
                return NEED_EXACT;
            nL = ncand;
        } else {
            const Refine r = refine(x, a, lg, W_FMASS, frac, true, false, true, all, w1, true);
            if (r.too_big)
                return NEED_EXACT;
            nL = r.ge;
            P = r.P;
        }
    }
    build_list(x, a, lg, nL, true, P, 0, all);
    return tier_a_list(x, a, p, M, ncand, u01, tk, tp, nL, z1);
}

/* Tier A once the list holds the candidates in order (nL of them: with tk, the top k first; else
 * the prefix of the nucleus, z1 the CPU's z over every candidate): top-p, min-p and the draw on
 * the list. Returns the token or NEED_EXACT. */
template <class X>
HD int32_t tier_a_list(X &x, const Args &a, const moe_cuda_sample_row &p, float M, uint32_t ncand,
                       double u01, bool tk, bool tp, uint32_t nL, double z1)
{
    Smem &s = x.sh;
    const uint32_t nv = a.n_vocab, C = a.chunk;
    uint32_t n = tk ? (uint32_t)p.top_k : nL;
    const bool covers = tk || nL == ncand; /* the list holds the whole set top-p looks at */
    if (tp) {
        if (tk)
            z1 = x.sum_d([&](int t) -> double {
                double v = 0.0;
                const uint32_t lo = (uint32_t)t * C, hi = lo + C < n ? lo + C : n;
                for (uint32_t i = lo; i < hi; i++)
                    v += exp((double)fsub(kval(s.list[i]), M));
                return v;
            });
        const WCtx wz = {M, z1};
        auto wp = [&](uint64_t K) -> double { return weight_d(W_DP, kval(K), wz); };
        list_scan(x, a, n, wp);
        const int j = list_find(x, a, n, wp, 0.0, (double)p.top_p, false);
        if (j >= 0)
            n = (uint32_t)j + 1;
        else if (!covers)
            return NEED_EXACT; /* the float estimate was short: the nucleus runs past the list */
    }
    if (p.min_p > 0.0f && n > 1) {
        const float cut = fadd(M, p.log_min_p);
        const uint32_t n0 = n;
        n = (uint32_t)x.sum_l([&](int t) -> long long {
            long long c = 0;
            const uint32_t lo = (uint32_t)t * C, hi = lo + C < n0 ? lo + C : n0;
            for (uint32_t i = lo; i < hi; i++)
                c += kval(s.list[i]) >= cut;
            return c;
        });
    }
    const WCtx wt = {M, (double)p.temperature};
    auto wq = [&](uint64_t K) -> double { return weight_d(W_DQ, kval(K), wt); };
    const double z = list_scan(x, a, n, wq);
    int j = list_find(x, a, n, wq, 0.0, u01 * z, true);
    if (j < 0)
        j = (int)n - 1; /* rounding left u just above the total, as on the CPU */
    return kid(read_list(x, (uint32_t)j), nv);
}

/* Sum over the row of f(l) for the elements of sp. */
template <class X, class F>
HD double row_sum(X &x, const float *lg, uint32_t nv, const SetPred &sp, F f)
{
    return x.sum_d([&](int t) -> double {
        double v = 0.0;
        row_loop(lg, nv, t, [&](uint32_t i, float l) {
            if (in_set(l, i, nv, sp))
                v += f(l);
        });
        return v;
    });
}

/* Tier B: exact refinement over the whole row at every step. */
template <class X>
HD int32_t tier_b(X &x, const Args &a, const moe_cuda_sample_row &p, const float *lg, float M,
                  uint32_t ncand, double u01, bool tk, bool tp, bool hist0_ready)
{
    const uint32_t nv = a.n_vocab;
    const SetPred all = {0, -INFINITY};
    uint64_t klo = 0;
    uint32_t nA = ncand;
    if (tk) {
        const WCtx w1 = {M, 1.0};
        const Refine r = refine(x, a, lg, W_COUNT, (double)p.top_k, false, false, false, all, w1, hist0_ready);
        if (r.bound) {
            XNOTE(x, NOTE_B_BOUND);
            klo = r.P;
        } else {
            build_list(x, a, lg, r.bin, false, r.P, r.mask, all);
            klo = read_list(x, (uint32_t)p.top_k - 1 - r.above);
        }
        nA = (uint32_t)p.top_k;
    }
    if (tp) {
        const SetPred A = {klo, -INFINITY};
        const double z1 = row_sum(x, lg, nv, A, [&](float l) { return exp((double)fsub(l, M)); });
        const WCtx wz = {M, z1};
        const Refine r = refine(x, a, lg, W_DP, (double)p.top_p, false, false, false, A, wz, false);
        build_list(x, a, lg, r.bin, false, r.P, r.mask, A);
        auto wp = [&](uint64_t K) -> double { return weight_d(W_DP, kval(K), wz); };
        list_scan(x, a, r.bin, wp);
        int j = list_find(x, a, r.bin, wp, r.base, (double)p.top_p, false);
        if (j < 0 && !r.exh0)
            j = (int)r.bin - 1; /* rounding between levels: the bin's last element */
        if (j >= 0) {
            klo = read_list(x, (uint32_t)j);
            nA = r.above + (uint32_t)j + 1;
        } /* else: the cumulative sum never reaches top_p, the CPU keeps everything */
    }
    float cut = -INFINITY;
    if (p.min_p > 0.0f && nA > 1)
        cut = fadd(M, p.log_min_p);
    const SetPred F = {klo, cut};
    const WCtx wt = {M, (double)p.temperature};
    const double z = row_sum(x, lg, nv, F, [&](float l) { return weight_d(W_DQ, l, wt); });
    const double uu = u01 * z;
    const Refine r = refine(x, a, lg, W_DQ, uu, false, true, false, F, wt, false);
    build_list(x, a, lg, r.bin, false, r.P, r.mask, F);
    auto wq = [&](uint64_t K) -> double { return weight_d(W_DQ, kval(K), wt); };
    list_scan(x, a, r.bin, wq);
    int j = list_find(x, a, r.bin, wq, r.base, uu, true);
    if (j < 0)
        j = (int)r.bin - 1;
    return kid(read_list(x, (uint32_t)j), nv);
}

/* A row whose draw is tier C whatever its logits (a temperature, neither top-k nor top-p): its
 * first pass (scan_kernel) and its weights' sums (csum_kernel) can be spread over the GPU. */
HD bool csum_row(const moe_cuda_sample_row &p)
{
    return p.temperature > 0.0f && p.top_k <= 0 && !(p.top_p < 1.0f);
}

/* A row whose top-k set sample_row_topk can find from scan_kernel's segments (a temperature and
 * 1 <= top_k <= NSEG): at least top_k segments hold a maximum at or above the k-th largest
 * segment maximum, so every logit of the top k is at or above it. */
HD bool topk_row(const moe_cuda_sample_row &p)
{
    return p.temperature > 0.0f && p.top_k > 0 && (uint32_t)p.top_k <= NSEG;
}

/* Segment g of a row of nv logits, [*i0, *i1): scan_kernel's and csum_kernel's. */
HD void seg_range(uint32_t nv, uint32_t g, uint32_t *i0, uint32_t *i1)
{
    const uint32_t per = ((nv + NSEG - 1) / NSEG + 3) & ~3u;
    *i0 = g * per < nv ? g * per : nv;
    *i1 = *i0 + per < nv ? *i0 + per : nv;
}

/* Tier C's min-p cut for a row whose maximum is M among ncand candidates (-inf: none). */
HD float tier_c_cut(const moe_cuda_sample_row &p, float M, uint32_t ncand)
{
    return p.min_p > 0.0f && ncand > 1 ? fadd(M, p.log_min_p) : -INFINITY;
}

/* A segment's CSum from its SCAN_NT sub-ranges' sums v (added in order: tier_c_seg repeats these
 * additions) and last candidates. */
HD CSum csum_add(const double *v, const int *last)
{
    double z = 0.0;
    int lst = -1;
    for (int t = 0; t < SCAN_NT; t++) {
        z += v[t];
        lst = last[t] > lst ? last[t] : lst;
    }
    return CSum{z, lst};
}

/* Sub-range t (of SCAN_NT) of segment [i0, i1): its weights summed in id order (the candidates:
 * above -inf and at or above cut), *last the last candidate (-1: none). The same additions
 * wherever it runs, so a walk that repeats them reaches the same sum. */
HD double csub_sum(const float *lg, uint32_t i0, uint32_t i1, int t, float cut, const WCtx &wt,
                   int *last)
{
    const uint32_t R = (i1 - i0 + SCAN_NT - 1) / SCAN_NT;
    const uint32_t lo = i0 + (uint32_t)t * R < i1 ? i0 + (uint32_t)t * R : i1;
    const uint32_t hi = lo + R < i1 ? lo + R : i1;
    double v = 0.0;
    *last = -1;
    for (uint32_t i = lo; i < hi; i++) {
        const float l = lg[i];
        if (l > -INFINITY && l >= cut) {
            v += weight_d(W_DQ, l, wt);
            *last = (int)i;
        }
    }
    return v;
}

/* Tier C from csum_kernel's segment sums: the segment where the running sum (segments in order)
 * crosses u·z, the sub-range inside it (its SCAN_NT sums recomputed, added in the same order as
 * csum_kernel added them, so the segment's sum is reached bit for bit and the crossing is sure
 * to fall inside), then that sub-range walked again. */
template <class X>
HD int32_t tier_c_seg(X &x, const Args &a, const moe_cuda_sample_row &p, const float *lg,
                      uint32_t row, float M, uint32_t ncand, double u01)
{
    Smem &s = x.sh;
    const uint32_t nv = a.n_vocab;
    const float cut = tier_c_cut(p, M, ncand);
    const WCtx wt = {M, (double)p.temperature};
    const CSum *cs = a.csum + (size_t)row * NSEG;
    /* rl[0]: the segment (-1: none crossed), rl[1]: the row's last candidate; rd[0]: the sum of
     * the segments before it, rd[1]: u·z. */
    x.single([&]() {
        double z = 0.0;
        long long lastc = -1;
        for (uint32_t g = 0; g < NSEG; g++) {
            z += cs[g].s;
            lastc = cs[g].last > lastc ? cs[g].last : lastc;
        }
        const double uu = u01 * z;
        double pre = 0.0;
        long long gs = -1;
        for (uint32_t g = 0; g < NSEG && gs < 0; g++) {
            if (cs[g].s > 0.0 && pre + cs[g].s > uu)
                gs = g;
            else
                pre += cs[g].s;
        }
        s.rl[0] = gs;
        s.rl[1] = lastc;
        s.rd[0] = pre;
        s.rd[1] = uu;
    });
    const long long gs = s.rl[0], lastc = s.rl[1];
    const double base = s.rd[0], uu = s.rd[1];
    x.sync(); /* read by every thread before a reduction reuses the scratch */
    if (gs < 0)
        return (int32_t)lastc;
    uint32_t i0, i1;
    seg_range(nv, (uint32_t)gs, &i0, &i1);
    x.each([&](int t) {
        if (t < SCAN_NT) {
            int last;
            s.td0[t] = csub_sum(lg, i0, i1, t, cut, wt, &last);
            s.ti0[t] = last;
        }
    });
    /* rl[2]: the sub-range (-1: none crossed), rd[2]: the sum of those before it. */
    x.single([&]() {
        double pre = 0.0;
        long long ts = -1;
        for (int t = 0; t < SCAN_NT && ts < 0; t++) {
            if (s.td0[t] > 0.0 && base + (pre + s.td0[t]) > uu)
                ts = t;
            else
                pre += s.td0[t];
        }
        s.rl[2] = ts;
        s.rd[2] = pre;
    });
    const long long ts = s.rl[2];
    const double epre = s.rd[2];
    x.sync();
    if (ts < 0)
        return (int32_t)x.max_l([&](int t) -> long long { return t < SCAN_NT ? s.ti0[t] : -1; });
    return (int32_t)x.max_l([&](int t) -> long long {
        if (t != ts)
            return -1;
        const uint32_t R = (i1 - i0 + SCAN_NT - 1) / SCAN_NT;
        const uint32_t lo = i0 + (uint32_t)t * R < i1 ? i0 + (uint32_t)t * R : i1;
        const uint32_t hi = lo + R < i1 ? lo + R : i1;
        double run = 0.0;
        long long f = -1, last = -1;
        for (uint32_t i = lo; i < hi && f < 0; i++) {
            const float l = lg[i];
            if (!(l > -INFINITY && l >= cut))
                continue;
            run += weight_d(W_DQ, l, wt);
            last = i;
            if (base + (epre + run) > uu)
                f = i;
        }
        return f >= 0 ? f : last;
    });
}

/* Tier C: no sorting truncation, so the draw runs in id order (min-p may still cut). */
template <class X>
HD int32_t tier_c(X &x, const Args &a, const moe_cuda_sample_row &p, const float *lg, float M,
                  uint32_t ncand, double u01)
{
    Smem &s = x.sh;
    const uint32_t nv = a.n_vocab;
    const float cut = tier_c_cut(p, M, ncand);
    const WCtx wt = {M, (double)p.temperature};
    const uint32_t R = (((nv + NT - 1) / NT) + 7) & ~7u;
    x.each([&](int t) {
        double v = 0.0;
        int last = -1;
        range_loop(lg, nv, t, R, [&](uint32_t i, float l) {
            if (l > -INFINITY && l >= cut) {
                v += weight_d(W_DQ, l, wt);
                last = (int)i;
            }
        });
        s.td0[t] = v;
        s.ti0[t] = last;
    });
    const double z = x.scan_d([&](int t) -> double { return s.td0[t]; }, s.td1);
    const double uu = u01 * z;
    /* The first range whose end crosses u; within it, the walk repeats the same additions, so
     * it is sure to cross inside. Earlier ranges cannot cross: their running sums only grow. */
    x.each([&](int t) { s.ti2[t] = s.td0[t] > 0.0 && s.td1[t] + s.td0[t] > uu ? t : INT_MAX; });
    const long long t1 = x.min_l([&](int t) -> long long { return s.ti2[t]; });
    if (t1 == INT_MAX)
        return (int32_t)x.max_l([&](int t) -> long long { return s.ti0[t]; });
    return (int32_t)x.max_l([&](int t) -> long long {
        if (t != t1)
            return -1;
        const double e = s.td1[t];
        double run = 0.0;
        long long f = -1;
        range_loop(lg, nv, t, R, [&](uint32_t i, float l) {
            if (f >= 0 || !(l > -INFINITY && l >= cut))
                return;
            run += weight_d(W_DQ, l, wt);
            if (e + run > uu)
                f = i;
        });
        return f;
    });
}

template <class X>
HD void penalties(X &x, const Args &a, const moe_cuda_sample_row &p,
                  const moe_cuda_sample_state &st, const int32_t *ring, float *lg, uint32_t wn)
{
    Smem &s = x.sh;
    const uint32_t cap = a.hist_cap, n2 = pow2ceil(wn), nv = a.n_vocab;
    const uint32_t start = ((uint32_t)st.hist_head + cap - wn) % cap;
    x.each([&](int t) {
        for (uint32_t j = (uint32_t)t; j < n2; j += NT) {
            uint32_t v = 0;
            if (j < wn) {
                const int32_t id = ring[(start + j) % cap];
                if (id >= 0 && (uint32_t)id < nv)
                    v = (uint32_t)id + 1;
            }
            s.win[j] = v;
        }
    });
    sort_desc(x, s.win, n2);
    /* Each run of one id is handled by the thread at its start; count = run length. */
    x.each([&](int t) {
        for (uint32_t j = (uint32_t)t; j < wn; j += NT) {
            const uint32_t v = s.win[j];
            if (v == 0 || (j > 0 && s.win[j - 1] == v))
                continue;
            uint32_t lo = j, hi = wn; /* win[lo] == v; hi == wn or win[hi] != v */
            while (hi - lo > 1) {
                const uint32_t mid = lo + (hi - lo) / 2;
                if (s.win[mid] == v)
                    lo = mid;
                else
                    hi = mid;
            }
            float l = lg[v - 1];
            if (p.repeat_penalty != 1.0f)
                l = l > 0.0f ? fdiv(l, p.repeat_penalty) : fmul(l, p.repeat_penalty);
            l = fsub(l, fadd(p.presence_penalty, fmul(p.frequency_penalty, (float)(hi - j))));
            lg[v - 1] = l;
        }
    });
}

template <class X>
HD int32_t sample_dist(X &x, const Args &a, const moe_cuda_sample_row &p, const float *lg,
                       float M, uint32_t ncand, double u01, bool hist0_ready)
{
    const bool tk = p.top_k > 0 && (uint32_t)p.top_k < ncand;
    const uint32_t nA = tk ? (uint32_t)p.top_k : ncand;
    const bool tp = p.top_p < 1.0f && nA > 1;
    if (!tk && !tp) {
        XNOTE(x, NOTE_C);
        return tier_c(x, a, p, lg, M, ncand, u01);
    }
    int32_t r = NEED_EXACT;
    if (!tk || (uint32_t)p.top_k <= a.list_cap) {
        XNOTE(x, tk ? NOTE_A_TOPK : NOTE_A_TOPP);
        r = tier_a(x, a, p, lg, M, ncand, u01, tk, tp);
        if (r == NEED_EXACT)
            XNOTE(x, NOTE_A_TO_B);
    }
    if (r == NEED_EXACT) {
        XNOTE(x, NOTE_B);
        r = tier_b(x, a, p, lg, M, ncand, u01, tk, tp, hist0_ready);
    }
    return r;
}

/* One logit i of a row's first pass: false for NaN and -inf (not candidates); else counted, and
 * kept when above the largest so far (so a pass in ascending order keeps its lowest index). */
HD bool first_pass_see(float l, uint32_t i, float *bv, int *bi, int *c)
{
    if (!(l > -INFINITY))
        return false;
    ++*c;
    if (l > *bv) {
        *bv = l;
        *bi = (int)i;
    }
    return true;
}

/* The end of a row's chain: its token (and logprob), its generator if it drew, its history. */
template <class X, bool LP>
HD void row_finish(X &x, const Args &a, uint32_t row, uint32_t sr, const moe_cuda_sample_state &st,
                   int32_t tok, bool drew, const float *lg, float M, double lz)
{
    x.single([&]() {
        a.tokens[row] = tok;
        if (LP) {
            float lp = -INFINITY;
            if (tok >= 0) {
                const float l = lg[tok];
                lp = (float)((l == M ? 0.0 : (double)l - (double)M) - log(lz));
            }
            a.logprobs[row] = lp;
        }
        moe_cuda_sample_state *g = a.state + sr;
        if (drew)
            for (int k = 0; k < 4; k++)
                g->rng[k] = st.rng[k];
        if (a.accept && tok >= 0 && a.hist_cap) {
            a.ring[(size_t)sr * a.hist_cap + (uint32_t)st.hist_head] = tok;
            g->hist_head = (int32_t)(((uint32_t)st.hist_head + 1) % a.hist_cap);
            if ((uint32_t)st.hist_len < a.hist_cap)
                g->hist_len = st.hist_len + 1;
        }
    });
}

/* Whether a row's penalties can change its logits now (its window holds tokens). */
HD bool row_penalized(const moe_cuda_sample_row &p, const moe_cuda_sample_state &st,
                      uint32_t hist_cap, uint32_t *wn_out)
{
    uint32_t wn = hist_cap ? (uint32_t)st.hist_len : 0;
    if (p.penalty_last_n >= 0 && (uint32_t)p.penalty_last_n < wn)
        wn = (uint32_t)p.penalty_last_n;
    *wn_out = wn;
    return wn > 0 && (p.repeat_penalty != 1.0f || p.presence_penalty != 0.0f ||
                      p.frequency_penalty != 0.0f);
}

/* Whether the row's penalties are still to be applied by the kernel that draws it (not when
 * penalty_kernel applied them first). */
HD bool row_pen_due(const Args &a, const moe_cuda_sample_row &p, const moe_cuda_sample_state &st,
                    uint32_t *wn)
{
    return row_penalized(p, st, a.hist_cap, wn) && !a.pen_done;
}

/* A row's penalties applied to its logits ahead of every other pass (penalty_kernel's block). */
template <class X> HD void pen_row(X &x, const Args &a, uint32_t row)
{
    const uint32_t sr = state_row(a, row);
    const moe_cuda_sample_row p = a.params[sr];
    const moe_cuda_sample_state st = a.state[sr];
    uint32_t wn;
    if (row_penalized(p, st, a.hist_cap, &wn))
        penalties(x, a, p, st, a.ring + (size_t)sr * a.hist_cap, a.logits + (size_t)row * a.n_vocab,
                  wn);
}

/* Whether csum_kernel summed the row for sample_spread_kernel<false> (sample_kernel leaves it). */
HD bool row_cseg(const Args &a, const moe_cuda_sample_row &p, bool penalized)
{
    return a.csum && a.part && !penalized && csum_row(p);
}

/* After a first pass (per thread: tf0 its maximum, ti0 the lowest index holding it, -1 if none),
 * the lowest index holding the row's maximum M. */
template <class X> HD int32_t pass_argmax(X &x, float M)
{
    Smem &s = x.sh;
    return (int32_t)x.min_l([&](int t) -> long long {
        return s.ti0[t] >= 0 && s.tf0[t] == M ? s.ti0[t] : INT_MAX;
    });
}

/* scan_kernel's segments of a row as the per-thread results of a first pass (threads < NSEG:
 * tf0 the maximum, ti0 the lowest index holding it, ti1 the count; tf1 and td0 as a pass
 * without logprobs leaves them). */
template <class X> HD void load_parts(X &x, const Args &a, uint32_t row)
{
    Smem &s = x.sh;
    x.each([&](int t) {
        const bool in = (uint32_t)t < NSEG;
        const ScanPart sp = in ? a.part[(size_t)row * NSEG + (uint32_t)t] : ScanPart{};
        s.tf0[t] = in ? sp.bv : -INFINITY;
        s.ti0[t] = in ? sp.bi : -1;
        s.ti1[t] = in ? (int)sp.c : 0;
        s.tf1[t] = -INFINITY;
        s.td0[t] = 0.0;
    });
}

/* A row's first pass from scan_kernel's segments: the maximum (returned), the candidate count,
 * and per segment (threads < NSEG) its maximum in tf0 and the lowest index holding it in ti0. */
template <class X> HD float parts_pass(X &x, const Args &a, uint32_t row, uint32_t *ncand)
{
    Smem &s = x.sh;
    load_parts(x, a, row);
    const float M = x.max_f([&](int t) -> float { return s.tf0[t]; });
    *ncand = (uint32_t)x.sum_l([&](int t) -> long long { return s.ti1[t]; });
    return M;
}

/* sample_row for a row that csum_kernel summed (no penalty changed its logits, no logprob): the
 * first pass's maximum, lowest index holding it and count from scan_kernel's segments, then the
 * draw of tier C from csum_kernel's (tier_c_seg). The same draw as sample_row's tier C, whose
 * sums add the same terms in another order. */
template <class X>
HD void sample_row_cseg(X &x, const Args &a, const moe_cuda_sample_row &p,
                        moe_cuda_sample_state st, uint32_t row, uint32_t sr, const float *lg)
{
    Smem &s = x.sh;
    uint32_t ncand;
    const float M = parts_pass(x, a, row, &ncand);
    int32_t tok = -1;
    bool drew = false;
    if (ncand == 0)
        XNOTE(x, NOTE_NONE);
    if (ncand > 0) {
        const int32_t am = pass_argmax(x, M);
        drew = true;
        const double u01 = rng_unit(st.rng);
        if (M == INFINITY)
            XNOTE(x, NOTE_PINF);
        else
            XNOTE(x, NOTE_C);
        tok = M == INFINITY ? am : tier_c_seg(x, a, p, lg, row, M, ncand, u01);
    }
    row_finish<X, false>(x, a, row, sr, st, tok, drew, lg, M, 0.0);
}

/* sample_row for a top-k row whose logits no penalty changed (topk_row): the first pass from
 * scan_kernel's segments, then the candidates at or above the k-th largest segment maximum,
 * which hold the top k, counted and sorted into the list in one pass each, and tier A's rest
 * on it (tier_a_list). The list's first k entries are tier A's, so the draw is the same. Returns
 * false, having written nothing, where the row's chain is not that (top_k not below the
 * candidate count, or more such candidates than the list holds): sample_kernel draws it. */
template <class X>
HD bool sample_row_topk(X &x, const Args &a, const moe_cuda_sample_row &p,
                        moe_cuda_sample_state st, uint32_t row, uint32_t sr, const float *lg)
{
    Smem &s = x.sh;
    const uint32_t nv = a.n_vocab, k = (uint32_t)p.top_k;
    uint32_t ncand;
    const float M = parts_pass(x, a, row, &ncand);
    if (!(k < ncand) || M == INFINITY)
        return false;
    /* The k-th largest segment maximum: the one with k - 1 ranked above it (ties by index). */
    const float mk = x.max_f([&](int t) -> float {
        if ((uint32_t)t >= NSEG)
            return -INFINITY;
        const float v = s.tf0[t];
        uint32_t above = 0;
        for (uint32_t u = 0; u < NSEG; u++)
            above += s.tf0[u] > v || (s.tf0[u] == v && u < (uint32_t)t);
        return above == k - 1 ? v : -INFINITY;
    });
    const SetPred sp = {0, mk};
    const uint32_t nL = (uint32_t)x.sum_l([&](int t) -> long long {
        long long c = 0;
        row_loop(lg, nv, t, [&](uint32_t, float l) { c += l > -INFINITY && l >= mk; });
        return c;
    });
    if (nL > a.list_cap)
        return false;
    const double u01 = rng_unit(st.rng);
    build_list(x, a, lg, nL, true, 0, 0, sp);
    const bool tp = p.top_p < 1.0f && k > 1;
    const int32_t tok = tier_a_list(x, a, p, M, ncand, u01, true, tp, nL, 0.0);
    row_finish<X, false>(x, a, row, sr, st, tok, true, lg, M, 0.0);
    return true;
}

/* ---- top-p rows spread over the GPU ---- */

/* A row whose chain is a top-p cut of its whole candidate set and a draw (a temperature and
 * top-p without top-k: what an OpenAI request with a top_p gets): tier B's two refinements, the
 * nucleus bound (exact weights exp(l - M), target top_p of their total) and the draw
 * (exp((l - M) / T) over the nucleus, min-p's cut applied, target u of their total, strictly),
 * with each level's histogram built by NSEG blocks a row into global memory (tp_hist_kernel,
 * tp_elem), its bin chosen by one block (tp_pick, refine_pick), the final bin compacted by NSEG
 * blocks (tp_collect_kernel) and sorted and scanned by one (tp_final). The weights are tier B's,
 * unnormalised (tier B divides each by the total z first), and their sums are added in another
 * order, so a draw can differ from the CPU's only within a rounding of a boundary, as tier B's. */
HD bool topp_row(const moe_cuda_sample_row &p)
{
    return p.temperature > 0.0f && p.top_k <= 0 && p.top_p < 1.0f;
}

/* Levels a spread top-p refinement takes (the logit's digits); a row whose bin still holds more
 * than list_cap elements after them (that many equal logits) is left to sample_kernel. */
constexpr int TP_LEVELS = 3;

struct TpRow {
    Refine f;        /* the phase's refinement so far: its bin, the weight and count above it */
    uint64_t klo;    /* phase 1: the nucleus, keys >= klo, and logits >= cut (min-p) */
    double target;   /* top_p, then u (fractions of the level-0 total), scaled at level 0 */
    uint64_t rng[4]; /* the generator after the draw */
    float M, cut;
    uint32_t ncand, list_n;
    int live;  /* 1 while the spread chain draws the row */
    int phase; /* 0: the nucleus, 1: the draw */
    int lev;   /* the level the next histogram is for; -1: the bin is collected next */
};

/* Shared memory of a tp_hist_kernel block: HB double masses, then HB counts. */
constexpr size_t TP_HIST_SMEM = HB * (sizeof(double) + sizeof(uint32_t));

/* Whether logit l (index i) is in row state r's current bin (and, in phase 1, the nucleus above
 * min-p's cut); its digit at level lv (lv >= 0) and its weight. */
HD bool tp_elem(const TpRow &r, const moe_cuda_sample_row &p, const Levels &L, int lv, float l,
                uint32_t i, uint32_t nv, uint32_t *dg, double *w)
{
    if (!(l > -INFINITY))
        return false;
    const uint64_t K = key(l, i, nv);
    if (K < r.klo || !(l >= r.cut) || (K & r.f.mask) != r.f.P)
        return false;
    if (lv >= 0)
        *dg = (uint32_t)(K >> L.shift[lv]) & ((1u << L.width[lv]) - 1u);
    const WCtx wc = {r.M, r.phase == 0 ? 1.0 : (double)p.temperature};
    *w = weight_d(W_DQ, l, wc);
    return true;
}

/* f(i, l, digit, weight) for the elements of segment g of logits row `row` that are in row state
 * r's bin (tp_elem; digit at level lv), thread t of nt taking i0 + t, i0 + t + nt, ...: the walk
 * of tp_hist_kernel and tp_collect_kernel (and of their host emulation, one thread). */
#pragma nv_exec_check_disable /* f: a device lambda in the kernels, a host one in the tests */
template <class F>
HD void tp_seg_elems(const Args &a, uint32_t row, const TpRow &r, int lv, uint32_t g, uint32_t t,
                     uint32_t nt, F f)
{
    const uint32_t nv = a.n_vocab;
    const moe_cuda_sample_row &p = a.params[state_row(a, row)];
    const float *lg = a.logits + (size_t)row * nv;
    uint32_t i0, i1;
    seg_range(nv, g, &i0, &i1);
    for (uint32_t i = i0 + t; i < i1; i += nt) {
        const float l = lg[i];
        uint32_t d = 0;
        double w;
        if (tp_elem(r, p, a.lev, lv, l, i, nv, &d, &w))
            f(i, l, d, w);
    }
}

/* The largest of a row's segment maxima and its candidate count (scan_kernel's segments). */
HD float parts_max(const ScanPart *pr, uint32_t *ncand)
{
    float M = -INFINITY;
    uint32_t nc = 0;
    for (uint32_t g = 0; g < NSEG; g++) {
        M = pr[g].bv > M ? pr[g].bv : M;
        nc += pr[g].c;
    }
    *ncand = nc;
    return M;
}

/* Row row's state before its chain (tp_init_kernel's thread for the row): live for a topp_row
 * whose logits no penalty changes, with more than one candidate and a finite maximum (from
 * scan_kernel's segments); kdone[row] cleared when the top-k kernel did not write it. */
HD void tp_init_row(const Args &a, uint32_t row, bool write_kdone)
{
    const uint32_t sr = state_row(a, row);
    const moe_cuda_sample_row p = a.params[sr];
    const moe_cuda_sample_state st = a.state[sr];
    TpRow r = {};
    uint32_t wn;
    if (topp_row(p) && !row_pen_due(a, p, st, &wn)) {
        uint32_t nc;
        const float M = parts_max(a.part + (size_t)row * NSEG, &nc);
        if (nc > 1 && M < INFINITY) {
            r.live = 1;
            r.M = M;
            r.cut = -INFINITY;
            r.ncand = nc;
            r.target = (double)p.top_p;
        }
    }
    a.tp[row] = r;
    if (write_kdone)
        a.kdone[row] = 0;
}

/* One level of a spread top-p refinement for row (tp_pick_kernel's block): the histogram that
 * tp_hist_kernel built for level lv taken into shared memory (and zeroed for its next use), its
 * bin chosen by refine_pick, the state advanced: to the next level, to the bin's collection
 * once it fits the list, or, past TP_LEVELS, handed back to sample_kernel. */
template <class X> HD void tp_pick(X &x, const Args &a, uint32_t row, int lv)
{
    Smem &s = x.sh;
    TpRow r = a.tp[row];
    if (!r.live || r.lev != lv)
        return;
    const uint32_t B = 1u << a.lev.width[lv];
    uint32_t *gc = a.tph_c + (size_t)row * HB;
    double *gm = a.tph_m + (size_t)row * HB;
    x.each([&](int t) {
        for (uint32_t b = (uint32_t)t; b < B; b += NT) {
            s.cnt[b] = gc[b];
            s.mass[b] = gm[b];
            gc[b] = 0;
            gm[b] = 0.0;
        }
    });
    refine_pick(x, a, W_DQ, lv, r.target, true, r.phase == 1, r.f);
    if (r.f.bin <= a.list_cap) {
        r.lev = -1;
        r.list_n = 0;
    } else if (lv + 1 < TP_LEVELS && lv + 1 < a.lev.n) {
        r.lev = lv + 1;
    } else {
        r.live = 0;
    }
    x.single([&]() { a.tp[row] = r; });
}

/* The end of a phase for row (tp_final_kernel's block): the collected bin sorted, its elements'
 * weights scanned from r.base. Phase 0: the nucleus bound (the first element at which the sum
 * reaches top_p of the total; the bin's last after a rounding between levels; every candidate
 * where level 0 never reached it), then the draw's u from the generator and phase 1. Phase 1:
 * the first element at which the sum passes u of the total (the bin's last after a rounding) is
 * the token; the row is finished as sample_kernel would and marked done. */
template <class X> HD void tp_final(X &x, const Args &a, uint32_t row)
{
    Smem &s = x.sh;
    TpRow r = a.tp[row];
    if (!r.live || r.lev != -1)
        return;
    const uint32_t sr = state_row(a, row), nv = a.n_vocab;
    const moe_cuda_sample_row p = a.params[sr];
    const uint32_t n = r.f.bin, n2 = pow2ceil(n);
    XCHECK(x, r.list_n == n && n >= 1 && n2 <= a.list_cap);
    const uint64_t *gl = a.tpl + (size_t)row * a.list_cap;
    x.each([&](int t) {
        for (uint32_t i = (uint32_t)t; i < n2; i += NT)
            s.list[i] = i < n ? gl[i] : 0;
    });
    sort_desc(x, s.list, n2);
    const WCtx wc = {r.M, r.phase == 0 ? 1.0 : (double)p.temperature};
    auto wf = [&](uint64_t K) -> double { return weight_d(W_DQ, kval(K), wc); };
    list_scan(x, a, n, wf);
    int j = list_find(x, a, n, wf, r.f.base, r.target, r.phase == 1);
    moe_cuda_sample_state st = a.state[sr];
    if (r.phase == 0) {
        if (j < 0 && !r.f.exh0)
            j = (int)n - 1; /* rounding between levels: the bin's last element */
        r.klo = j >= 0 ? read_list(x, (uint32_t)j) : 0;
        /* min-p on the nucleus when it holds more than one candidate, as tier B */
        const uint32_t nA = j >= 0 ? r.f.above + (uint32_t)j + 1 : r.ncand;
        if (p.min_p > 0.0f && nA > 1)
            r.cut = fadd(r.M, p.log_min_p);
        r.target = rng_unit(st.rng);
        for (int k = 0; k < 4; k++)
            r.rng[k] = st.rng[k];
        r.phase = 1;
        r.lev = 0;
        r.f = refine_start();
        x.single([&]() { a.tp[row] = r; });
        return;
    }
    if (j < 0)
        j = (int)n - 1; /* rounding left u just above the total, as on the CPU */
    const int32_t tok = kid(read_list(x, (uint32_t)j), nv);
    for (int k = 0; k < 4; k++)
        st.rng[k] = r.rng[k];
    row_finish<X, false>(x, a, row, sr, st, tok, true, a.logits + (size_t)row * nv, r.M, 0.0);
    x.single([&]() {
        a.kdone[row] = 1;
        a.tp[row].live = 0;
    });
}

/* The whole chain for one row. LP: also the logprob. */
template <class X, bool LP> HD void sample_row(X &x, const Args &a, uint32_t row)
{
    Smem &s = x.sh;
    const uint32_t nv = a.n_vocab;
    float *lg = a.logits + (size_t)row * nv;
    const uint32_t sr = state_row(a, row);
    const moe_cuda_sample_row p = a.params[sr];
    moe_cuda_sample_state st = a.state[sr];
    const int32_t *ring = a.ring + (size_t)sr * a.hist_cap;

    if (!LP && a.kdone && a.kdone[row])
        return; /* sample_spread_kernel<true> drew it */
    uint32_t wn;
    const bool penalized = row_pen_due(a, p, st, &wn);
    /* A tier-C row whose logits no penalty changed: sample_spread_kernel<false>'s (a kernel of
     * its own, whose registers stay out of this one's). */
    if (!LP && row_cseg(a, p, penalized))
        return;
    if (penalized)
        penalties(x, a, p, st, ring, lg, wn);

    const bool greedy = !(p.temperature > 0.0f);
    /* A greedy row whose logits no penalty changed takes scan_kernel's segments. */
    const bool seg = a.part && greedy && !penalized && !LP;
    /* top-k: the first pass over the row also builds the level-0 histogram refine() starts from */
    const bool hist0_ready = !greedy && p.top_k > 0;
    const int sft0 = a.lev.shift[0];
    const uint32_t B0 = 1u << a.lev.width[0];
    if (hist0_ready)
        clear_hist(x, W_COUNT, B0);
    if (seg)
        load_parts(x, a, row);
    else
        x.each([&](int t) {
            float bv = -INFINITY, lm = -INFINITY, ls = 0.0f;
            int bi = -1, c = 0;
            row_loop(lg, nv, t, [&](uint32_t i, float l) {
                if (!first_pass_see(l, i, &bv, &bi, &c))
                    return;
                if (LP) {
                    if (l > lm) {
                        ls = ls * fexp(fsub(lm, l)) + 1.0f;
                        lm = l;
                    } else {
                        ls += l == lm ? 1.0f : fexp(fsub(l, lm));
                    }
                }
                if (hist0_ready)
                    x.atomic_add(&s.cnt[(uint32_t)(key(l, i, nv) >> sft0) & (B0 - 1)], 1u);
            });
            s.tf0[t] = bv;
            s.ti0[t] = bi;
            s.ti1[t] = c;
            s.tf1[t] = lm;
            s.td0[t] = ls;
        });
    const float M = x.max_f([&](int t) -> float { return s.tf0[t]; });
    const uint32_t ncand = (uint32_t)x.sum_l([&](int t) -> long long { return s.ti1[t]; });
    int32_t tok = -1;
    double lz = 0.0;
    bool drew = false;
    if (ncand == 0)
        XNOTE(x, NOTE_NONE);
    if (ncand > 0) {
        const int32_t am = pass_argmax(x, M);
        if (LP)
            lz = x.sum_d([&](int t) -> double {
                const double sm = s.td0[t];
                const float m = s.tf1[t];
                return sm == 0.0 ? 0.0 : m == M ? sm : sm * exp((double)m - (double)M);
            });
        if (greedy) {
            XNOTE(x, NOTE_GREEDY);
            tok = am;
        } else {
            drew = true;
            const double u01 = rng_unit(st.rng);
            if (M == INFINITY)
                XNOTE(x, NOTE_PINF);
            tok = M == INFINITY ? am : sample_dist(x, a, p, lg, M, ncand, u01, hist0_ready);
        }
    }
    row_finish<X, LP>(x, a, row, sr, st, tok, drew, lg, M, lz);
}

/* ---- host-side set-up ---- */

/* A launch's arguments without the spread passes' buffers (part, csum, kdone: NULL). */
static Args launch_args(float *logits, const int32_t *rowmap, int32_t *tokens, float *logprobs,
                        const moe_cuda_sample_row *params, moe_cuda_sample_state *state,
                        int32_t *ring, uint32_t n_vocab, uint32_t hist_cap, uint32_t list_cap,
                        bool accept, const Levels &lev)
{
    Args a = {};
    a.logits = logits;
    a.rowmap = rowmap;
    a.tokens = tokens;
    a.logprobs = logprobs;
    a.params = params;
    a.state = state;
    a.ring = ring;
    a.n_vocab = n_vocab;
    a.hist_cap = hist_cap;
    a.list_cap = list_cap;
    a.chunk = (list_cap + NT - 1) / NT;
    a.accept = accept;
    a.lev = lev;
    return a;
}

/* Digits of K: 12, 12, 8 bits of the logit key, then the id part from its top bit down. */
static Levels make_levels(uint32_t n_vocab)
{
    Levels L;
    L.n = 0;
    const int fl[3][2] = {{52, 12}, {40, 12}, {32, 8}};
    for (int i = 0; i < 3; i++) {
        L.shift[L.n] = fl[i][0];
        L.width[L.n++] = fl[i][1];
    }
    int nb = 0;
    while (nb < 32 && ((uint64_t)(n_vocab - 1) >> nb) != 0)
        nb++;
    for (int rem = nb; rem > 0;) {
        const int w = rem < HBITS ? rem : HBITS;
        rem -= w;
        L.shift[L.n] = rem;
        L.width[L.n++] = w;
    }
    return L;
}

/* struct moe_sampler_params -> the kernel's row, with moe_sampler_init's checks. */
static int fill_row(const struct moe_sampler_params *p, uint32_t hist_cap,
                    moe_cuda_sample_row *row, char *err, size_t errlen)
{
    int rc = moe_sampler_params_check(p, err, errlen);
    if (rc)
        return rc;
    if (p->penalty_last_n > 0 && (uint32_t)p->penalty_last_n > hist_cap)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "sampler: penalty_last_n %d exceeds the device history of %u tokens",
                        (int)p->penalty_last_n, (unsigned)hist_cap);
    memset(row, 0, sizeof *row);
    row->temperature = p->temperature;
    row->top_k = p->top_k;
    row->top_p = p->top_p;
    row->min_p = p->min_p;
    row->log_min_p = p->min_p > 0.0f ? logf(p->min_p) : 0.0f;
    row->repeat_penalty = p->repeat_penalty;
    row->presence_penalty = p->presence_penalty;
    row->frequency_penalty = p->frequency_penalty;
    row->penalty_last_n = p->penalty_last_n;
    return 0;
}

} /* namespace moe_sample */

#endif
