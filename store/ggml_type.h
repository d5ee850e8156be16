/* ggml tensor types: ids as stored in GGUF, block sizes and byte sizes. */
#ifndef MOE_GGML_TYPE_H
#define MOE_GGML_TYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum moe_type {
    MOE_TYPE_F32 = 0, MOE_TYPE_F16 = 1, MOE_TYPE_Q4_0 = 2, MOE_TYPE_Q4_1 = 3,
    MOE_TYPE_Q5_0 = 6, MOE_TYPE_Q5_1 = 7, MOE_TYPE_Q8_0 = 8, MOE_TYPE_Q8_1 = 9,
    MOE_TYPE_Q2_K = 10, MOE_TYPE_Q3_K = 11, MOE_TYPE_Q4_K = 12, MOE_TYPE_Q5_K = 13,
    MOE_TYPE_Q6_K = 14, MOE_TYPE_Q8_K = 15, MOE_TYPE_IQ2_XXS = 16, MOE_TYPE_IQ2_XS = 17,
    MOE_TYPE_IQ3_XXS = 18, MOE_TYPE_IQ1_S = 19, MOE_TYPE_IQ4_NL = 20, MOE_TYPE_IQ3_S = 21,
    MOE_TYPE_IQ2_S = 22, MOE_TYPE_IQ4_XS = 23, MOE_TYPE_I8 = 24, MOE_TYPE_I16 = 25,
    MOE_TYPE_I32 = 26, MOE_TYPE_I64 = 27, MOE_TYPE_F64 = 28, MOE_TYPE_IQ1_M = 29,
    MOE_TYPE_BF16 = 30, MOE_TYPE_TQ1_0 = 34, MOE_TYPE_TQ2_0 = 35, MOE_TYPE_MXFP4 = 39,
    MOE_TYPE_COUNT = 40,
};

struct moe_type_info {
    const char *name;   /* "q4_K" */
    uint32_t blck;      /* elements per block */
    uint32_t size;      /* bytes per block */
    bool compute;       /* moed can dequantize and compute with it */
};

/* Returns the description of ggml type id `type`, or NULL for ids that do not exist (4, 5, 31..,
 * anything >= MOE_TYPE_COUNT). A GGUF may legally hold types moed cannot compute (compute=false). */
const struct moe_type_info *moe_type_get(uint32_t type);

/* Bytes of a row of ne0 elements; ne0 must be a multiple of the block size (checked by callers). */
size_t moe_row_bytes(uint32_t type, int64_t ne0);

#endif
