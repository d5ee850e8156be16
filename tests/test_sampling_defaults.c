/* Sampling defaults: the model's general.sampling.* (store/model.c), moed's --temp, --top-p,
 * --top-k, --min-p and --repeat-penalty, and what a request that gives none gets. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "store/gguf.h"
#include "store/gguf_write.h"
#include "store/model.h"
#include "tests/harness.h"

/* A GGUF of metadata only, opened from memory. */
static struct gguf_file *meta_gguf(struct gguf_writer *w, uint8_t **buf)
{
    char err[256];
    CHECK_MSG(gguf_writer_layout(w, err, sizeof err) == 0, "%s", err);
    size_t size = (size_t)gguf_writer_file_size(w);
    *buf = calloc(1, size);
    CHECK(*buf && gguf_writer_meta(w, *buf, size) == 0);
    struct gguf_file *f = NULL;
    CHECK_MSG(gguf_open_mem(&f, *buf, size, err, sizeof err) == 0, "%s", err);
    gguf_writer_free(w);
    return f;
}

TEST(gguf_sampling_hints_any_numeric_type)
{
    char err[256];
    struct gguf_writer *w;
    CHECK_EQ(gguf_writer_new(&w), 0);
    CHECK_EQ(gguf_writer_add_str(w, "general.architecture", "qwen3moe", 8, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_f32(w, "general.sampling.temp", 0.6f, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_i32(w, "general.sampling.top_k", 20, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_f32(w, "general.sampling.top_p", 0.95f, err, sizeof err), 0);
    double mp = 0.0;
    CHECK_EQ(gguf_writer_add_scalar(w, "general.sampling.min_p", GGUF_F64, &mp, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_u32(w, "general.sampling.penalty_last_n", 64, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_str(w, "general.sampling.penalty_repeat", "1.1", 3, err, sizeof err), 0);
    uint8_t *buf;
    struct gguf_file *f = meta_gguf(w, &buf);
    struct moe_sampling_hints h;
    moe_gguf_sampling_hints(f, &h);
    CHECK(fabs(h.temperature - 0.6) < 1e-6 && fabs(h.top_p - 0.95) < 1e-6 && h.min_p == 0.0);
    CHECK_EQ(h.top_k, 20);
    CHECK_EQ(h.penalty_last_n, 64);
    CHECK(isnan(h.repeat_penalty)); /* a string is not a number */
    gguf_close(f);
    free(buf);

    /* Out of range values count as absent. */
    CHECK_EQ(gguf_writer_new(&w), 0);
    CHECK_EQ(gguf_writer_add_str(w, "general.architecture", "qwen3moe", 8, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_f32(w, "general.sampling.temp", -1.0f, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_f32(w, "general.sampling.top_p", 1.5f, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_i32(w, "general.sampling.top_k", -3, err, sizeof err), 0);
    CHECK_EQ(gguf_writer_add_f32(w, "general.sampling.top_k_typo", 3.0f, err, sizeof err), 0);
    f = meta_gguf(w, &buf);
    moe_gguf_sampling_hints(f, &h);
    CHECK(isnan(h.temperature) && isnan(h.top_p) && isnan(h.min_p) && h.top_k == -1);
    gguf_close(f);
    free(buf);
}

TEST(config_sampling_defaults)
{
    struct moed_config c;
    bool help;
    char err[512];
    CHECK(config_init(&c) == 0);
    CHECK(isnan(c.default_temp) && isnan(c.default_top_p) && c.default_top_k == UINT32_MAX);
    char *argv[] = {"moed", "--model", "m", "--temp", "0", "--top-p", "0.9", "--top-k", "40",
                    "--min-p", "0.05", "--repeat-penalty", "1.1", NULL};
    CHECK_MSG(config_parse_args(&c, 13, argv, &help, err, sizeof err) == 0, "%s", err);
    CHECK(c.default_temp == 0.0 && fabs(c.default_top_p - 0.9) < 1e-12 && c.default_top_k == 40);
    CHECK(fabs(c.default_min_p - 0.05) < 1e-12 && fabs(c.default_repeat_penalty - 1.1) < 1e-12);
    config_free(&c);
    static const char *const bad[][2] = {{"--temp", "-0.5"}, {"--temp", "101"}, {"--temp", "hot"},
                                          {"--top-p", "0"},   {"--top-p", "1.5"}, {"--min-p", "2"},
                                          {"--repeat-penalty", "0"}, {"--temp", "nan"},
                                          {"--top-k", "-1"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(config_init(&c) == 0);
        char *a[] = {"moed", "--model", "m", (char *)bad[i][0], (char *)bad[i][1], NULL};
        CHECK_MSG(config_parse_args(&c, 5, a, &help, err, sizeof err) != 0, "%s %s accepted",
                  bad[i][0], bad[i][1]);
        config_free(&c);
    }
}
