#include "store/ggml_type.h"

static const struct moe_type_info types[MOE_TYPE_COUNT] = {
    [MOE_TYPE_F32] = {"f32", 1, 4, true},
    [MOE_TYPE_F16] = {"f16", 1, 2, true},
    [MOE_TYPE_Q4_0] = {"q4_0", 32, 18, true},
    [MOE_TYPE_Q4_1] = {"q4_1", 32, 20, true},
    [MOE_TYPE_Q5_0] = {"q5_0", 32, 22, true},
    [MOE_TYPE_Q5_1] = {"q5_1", 32, 24, true},
    [MOE_TYPE_Q8_0] = {"q8_0", 32, 34, true},
    [MOE_TYPE_Q8_1] = {"q8_1", 32, 36, false},
    [MOE_TYPE_Q2_K] = {"q2_K", 256, 84, false},
    [MOE_TYPE_Q3_K] = {"q3_K", 256, 110, false},
    [MOE_TYPE_Q4_K] = {"q4_K", 256, 144, true},
    [MOE_TYPE_Q5_K] = {"q5_K", 256, 176, true},
    [MOE_TYPE_Q6_K] = {"q6_K", 256, 210, true},
    [MOE_TYPE_Q8_K] = {"q8_K", 256, 292, false},
    [MOE_TYPE_IQ2_XXS] = {"iq2_xxs", 256, 66, false},
    [MOE_TYPE_IQ2_XS] = {"iq2_xs", 256, 74, false},
    [MOE_TYPE_IQ3_XXS] = {"iq3_xxs", 256, 98, false},
    [MOE_TYPE_IQ1_S] = {"iq1_s", 256, 50, false},
    [MOE_TYPE_IQ4_NL] = {"iq4_nl", 32, 18, false},
    [MOE_TYPE_IQ3_S] = {"iq3_s", 256, 110, false},
    [MOE_TYPE_IQ2_S] = {"iq2_s", 256, 82, false},
    [MOE_TYPE_IQ4_XS] = {"iq4_xs", 256, 136, false},
    [MOE_TYPE_I8] = {"i8", 1, 1, false},
    [MOE_TYPE_I16] = {"i16", 1, 2, false},
    [MOE_TYPE_I32] = {"i32", 1, 4, false},
    [MOE_TYPE_I64] = {"i64", 1, 8, false},
    [MOE_TYPE_F64] = {"f64", 1, 8, false},
    [MOE_TYPE_IQ1_M] = {"iq1_m", 256, 56, false},
    [MOE_TYPE_BF16] = {"bf16", 1, 2, true},
    [MOE_TYPE_TQ1_0] = {"tq1_0", 256, 54, false},
    [MOE_TYPE_TQ2_0] = {"tq2_0", 256, 66, false},
    [MOE_TYPE_MXFP4] = {"mxfp4", 32, 17, false},
};

const struct moe_type_info *moe_type_get(uint32_t type)
{
    if (type >= MOE_TYPE_COUNT || types[type].name == NULL)
        return NULL;
    return &types[type];
}

size_t moe_row_bytes(uint32_t type, int64_t ne0)
{
    const struct moe_type_info *t = moe_type_get(type);
    return t ? (size_t)(ne0 / t->blck) * t->size : 0;
}
