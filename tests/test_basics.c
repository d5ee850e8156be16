/* Checks of the small shared pieces: error strings, the ggml type table and the CUDA backend's
 * environment options. */
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "tests/harness.h"
#include "worker/cuda/env_opts.h"

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

/* worker/cuda/env_opts.h: a number only when the whole value is one in range, else the default;
 * switches on unless "0", or off unless "1". */
TEST(env_options_parse_strictly)
{
    const char *n = "MOE_TEST_ENV_OPT";
    unsetenv(n);
    CHECK_EQ(moe_env_int(n, 1, 64, 7), 7);
    CHECK(moe_env_on(n));
    CHECK(!moe_env_is1(n));
    static const struct {
        const char *v;
        long long want;
    } cases[] = {{"", 7},     {"12", 12},  {"1", 1},    {"64", 64},  {"0", 7},
                 {"65", 7},   {"-3", 7},   {"12abc", 7}, {"abc", 7}, {" 12", 12},
                 {"12 ", 7},  {"0x10", 7}, {"99999999999999999999", 7}, {"+5", 5}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        setenv(n, cases[i].v, 1);
        CHECK_MSG(moe_env_int(n, 1, 64, 7) == cases[i].want, "%s=\"%s\"", n, cases[i].v);
    }
    setenv(n, "-4096", 1);
    CHECK_EQ(moe_env_int(n, -4096, 4096, 0), -4096);
    setenv(n, "0", 1);
    CHECK(!moe_env_on(n));
    CHECK(!moe_env_is1(n));
    setenv(n, "1", 1);
    CHECK(moe_env_on(n));
    CHECK(moe_env_is1(n));
    setenv(n, "", 1);
    CHECK(moe_env_on(n));
    CHECK(!moe_env_is1(n));
    unsetenv(n);
}
