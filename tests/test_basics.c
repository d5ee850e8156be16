/* Checks of the small shared pieces: error strings and the ggml type table. */
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "tests/harness.h"

TEST(err_strings)
{
    CHECK_STREQ(moe_strerror(MOE_EFORMAT), "malformed input");
    CHECK(strlen(moe_strerror(-2)) > 0); /* ENOENT */
    CHECK_STREQ(moe_strerror(-99999), "unknown error");
}

TEST(ggml_type_table)
{
    CHECK(moe_type_get(4) == NULL);
    CHECK(moe_type_get(5) == NULL);
    CHECK(moe_type_get(31) == NULL);
    CHECK(moe_type_get(1000) == NULL);
    CHECK_EQ(moe_type_get(MOE_TYPE_Q4_K)->size, 144);
    CHECK_EQ(moe_type_get(MOE_TYPE_Q6_K)->size, 210);
    CHECK_EQ(moe_type_get(MOE_TYPE_Q5_0)->size, 22);
    CHECK_EQ(moe_type_get(MOE_TYPE_MXFP4)->size, 17);
    CHECK_EQ(moe_row_bytes(MOE_TYPE_Q8_0, 256), 8 * 34);
    CHECK_EQ(moe_row_bytes(MOE_TYPE_BF16, 10), 20);
}
