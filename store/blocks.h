/* ggml quantized block layouts, defined once.
 *
 * One packed struct per block type that moed reads or writes (docs/kernels.md has the value
 * formulas). Code that decodes or encodes blocks casts a block's address to one of these and
 * uses the fields instead of byte offsets. The structs are packed (alignment 1): inside a row,
 * blocks follow each other with no padding, so a Q8_0 block (34 bytes) can start at any even
 * address and, in a buffer from elsewhere, at any address at all.
 *
 * Multi-byte fields are little-endian in the file and are read in place, so the host must be
 * little-endian too (checked below). `d`, `m`, `dmin` are IEEE half bits (moe_f16_to_f32).
 *
 * Q2_K and Q3_K are here for their size only: moed does not compute with them (yet). Q8_1 and
 * Q8_K (ggml's activation formats) are not used by moed and are not defined.
 *
 * The header is C11 and C++ (nvcc includes it inside extern "C"). */
#ifndef MOE_BLOCKS_H
#define MOE_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#define MOE_BLOCK_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define MOE_BLOCK_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

#define MOE_PACKED __attribute__((packed))

MOE_BLOCK_ASSERT(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
                 "GGUF blocks are read in place: the host must be little-endian");

/* Elements per block: the 32-element types and the 256-element K-quants. */
#define MOE_QK 32
#define MOE_QK_K 256
/* Bytes of the packed 6-bit scales and mins of a Q4_K/Q5_K block (layout in docs/kernels.md). */
#define MOE_K_SCALE_BYTES 12

/* After each struct: its size as in store/ggml_type.c (and ggml), and where its payload starts. */

/* ---- 32-element blocks ---------------------------------------------------------------------- */

/* y[j] = ((qs[j] & 15) - 8)·d, y[j + 16] = ((qs[j] >> 4) - 8)·d */
struct MOE_PACKED moe_block_q4_0 {
    uint16_t d;
    uint8_t qs[MOE_QK / 2];
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q4_0) == 18, "q4_0 block is 18 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q4_0, qs) == 2, "q4_0 qs at 2");

/* y = q·d + m, nibbles as Q4_0 */
struct MOE_PACKED moe_block_q4_1 {
    uint16_t d, m;
    uint8_t qs[MOE_QK / 2];
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q4_1) == 20, "q4_1 block is 20 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q4_1, qs) == 4, "q4_1 qs at 4");

/* The 5th bit of element j is bit j of the little-endian u32 qh; y = (q - 16)·d */
struct MOE_PACKED moe_block_q5_0 {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[MOE_QK / 2];
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q5_0) == 22, "q5_0 block is 22 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q5_0, qs) == 6, "q5_0 qs at 6");

/* y = q·d + m, bits as Q5_0 */
struct MOE_PACKED moe_block_q5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[MOE_QK / 2];
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q5_1) == 24, "q5_1 block is 24 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q5_1, qs) == 8, "q5_1 qs at 8");

/* y = qs·d */
struct MOE_PACKED moe_block_q8_0 {
    uint16_t d;
    int8_t qs[MOE_QK];
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q8_0) == 34, "q8_0 block is 34 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q8_0, qs) == 2, "q8_0 qs at 2");

/* ---- 256-element K-quant blocks ------------------------------------------------------------- */

/* 16 sub-blocks of 16, 2-bit codes, 4-bit scale and min per sub-block. Size only. */
struct MOE_PACKED moe_block_q2_k {
    uint8_t scales[MOE_QK_K / 16];
    uint8_t qs[MOE_QK_K / 4];
    uint16_t d, dmin;
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q2_k) == 84, "q2_K block is 84 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q2_k, d) == 80, "q2_K d at 80");

/* 16 sub-blocks of 16, 2 low bits in qs, the 3rd in hmask, 6-bit scales. Size only. */
struct MOE_PACKED moe_block_q3_k {
    uint8_t hmask[MOE_QK_K / 8];
    uint8_t qs[MOE_QK_K / 4];
    uint8_t scales[MOE_K_SCALE_BYTES];
    uint16_t d;
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q3_k) == 110, "q3_K block is 110 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q3_k, d) == 108, "q3_K d at 108");

/* 8 sub-blocks of 32: y = d·sc_j·q - dmin·m_j; chunk c (64 values) is qs[32c..32c+32), low
 * nibbles sub-block 2c, high nibbles 2c + 1 */
struct MOE_PACKED moe_block_q4_k {
    uint16_t d, dmin;
    uint8_t scales[MOE_K_SCALE_BYTES];
    uint8_t qs[MOE_QK_K / 2];
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q4_k) == 144, "q4_K block is 144 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q4_k, qs) == 16, "q4_K qs at 16");

/* As Q4_K, plus 16 when bit 2c (low half of chunk c) or 2c + 1 (high half) of qh[l] is set */
struct MOE_PACKED moe_block_q5_k {
    uint16_t d, dmin;
    uint8_t scales[MOE_K_SCALE_BYTES];
    uint8_t qh[MOE_QK_K / 8];
    uint8_t qs[MOE_QK_K / 2];
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q5_k) == 176, "q5_K block is 176 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q5_k, qh) == 16, "q5_K qh at 16");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q5_k, qs) == 48, "q5_K qs at 48");

/* 16 sub-blocks of 16: y = d·scales_j·(q - 32), q = 4 bits from ql, 2 from qh */
struct MOE_PACKED moe_block_q6_k {
    uint8_t ql[MOE_QK_K / 2];
    uint8_t qh[MOE_QK_K / 4];
    int8_t scales[MOE_QK_K / 16];
    uint16_t d;
};
MOE_BLOCK_ASSERT(sizeof(struct moe_block_q6_k) == 210, "q6_K block is 210 bytes");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q6_k, qh) == 128, "q6_K qh at 128");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q6_k, scales) == 192, "q6_K scales at 192");
MOE_BLOCK_ASSERT(offsetof(struct moe_block_q6_k, d) == 208, "q6_K d at 208");

#endif
