/* Checks of store/io.h (monotonic clock, whole-file reads) and store/buf.h (growable buffers),
 * which the daemon, the worker, moectl and the test harness all share. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "store/buf.h"
#include "store/gguf.h"
#include "store/io.h"
#include "tests/harness.h"

TEST(io_now_is_monotonic_seconds)
{
    double a = moe_now_s();
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    double b = moe_now_s();
    /* 20 ms asleep: at least that much passed, and the unit is seconds, not ms or ns. */
    CHECK_MSG(b - a >= 0.019 && b - a < 5.0, "slept 20 ms, clock moved %.6f s", b - a);
    CHECK(moe_now_s() >= b);
}

TEST(io_read_file_contents)
{
    char path[512];
    snprintf(path, sizeof path, "%s/f.bin", moe_test_tmpdir());
    /* Larger than the first 64 KiB buffer, so the doubling path runs, with NULs inside. */
    size_t n = 200000;
    uint8_t *want = malloc(n);
    CHECK(want);
    moe_test_rng_seed(7);
    for (size_t i = 0; i < n; i++)
        want[i] = (uint8_t)(i % 1000 == 0 ? 0 : moe_test_rng_u32());
    moe_test_write_file(path, want, n);
    char *got = NULL;
    size_t len = 0;
    CHECK_EQ(moe_read_file(path, &got, &len), 0);
    CHECK_EQ(len, n);
    CHECK(!memcmp(got, want, n));
    CHECK_EQ(got[n], 0);
    free(got);

    /* An empty file is an empty, NUL-terminated string. */
    moe_test_write_file(path, "", 0);
    CHECK_EQ(moe_read_file(path, &got, &len), 0);
    CHECK_EQ(len, 0);
    CHECK_STREQ(got, "");
    free(got);
    free(want);
}

TEST(io_read_file_errors)
{
    char path[512];
    char *got = (char *)0x1;
    size_t len = 12345;
    snprintf(path, sizeof path, "%s/missing", moe_test_tmpdir());
    CHECK_EQ(moe_read_file(path, &got, &len), -ENOENT);
    /* A directory opens but cannot be read. */
    CHECK_EQ(moe_read_file(moe_test_tmpdir(), &got, &len), -EISDIR);
    /* Nothing was handed back on failure. */
    CHECK(got == (char *)0x1);
    CHECK_EQ(len, 12345);
}

TEST(io_read_stream_pipe)
{
    /* A pipe has no size; the reader must collect everything until EOF. */
    FILE *p = popen("i=0; while [ $i -lt 3000 ]; do echo line$i; i=$((i+1)); done", "r");
    CHECK(p);
    char *got;
    size_t len;
    CHECK_EQ(moe_read_stream(p, &got, &len), 0);
    CHECK_EQ(pclose(p), 0);
    CHECK_EQ(strlen(got), len);
    CHECK(!strncmp(got, "line0\nline1\n", 12));
    CHECK(len > 12 && !strcmp(got + len - 9, "line2999\n"));
    size_t lines = 0;
    for (size_t i = 0; i < len; i++)
        lines += got[i] == '\n';
    CHECK_EQ(lines, 3000);
    free(got);
}

TEST(buf_append_and_reserve)
{
    char *p = NULL;
    size_t len = 0, cap = 0;
    CHECK_EQ(moe_buf_append(&p, &len, &cap, "", 0), 0);
    CHECK(p && len == 0 && p[0] == 0);
    /* Many small appends across several doublings keep every byte and the trailing NUL. */
    for (int i = 0; i < 1000; i++) {
        char piece[16];
        int k = snprintf(piece, sizeof piece, "%d,", i);
        CHECK_EQ(moe_buf_append(&p, &len, &cap, piece, (size_t)k), 0);
        CHECK(cap > len);
        CHECK_EQ(p[len], 0);
    }
    CHECK(!strncmp(p, "0,1,2,", 6));
    CHECK(!strcmp(p + len - 4, "999,"));
    size_t want = 0;
    for (int i = 0; i < 1000; i++)
        want += (size_t)snprintf(NULL, 0, "%d,", i);
    CHECK_EQ(len, want);

    /* reserve never shrinks and keeps the contents. */
    size_t old_cap = cap;
    CHECK_EQ(moe_buf_reserve(&p, &cap, 10), 0);
    CHECK_EQ(cap, old_cap);
    CHECK_EQ(moe_buf_reserve(&p, &cap, old_cap * 3), 0);
    CHECK(cap >= old_cap * 3);
    CHECK(!strncmp(p, "0,1,2,", 6));

    /* A length that would overflow fails cleanly and changes nothing. */
    size_t before_len = len, before_cap = cap;
    char *before_p = p;
    CHECK_EQ(moe_buf_append(&p, &len, &cap, "x", SIZE_MAX - len), -ENOMEM);
    CHECK(p == before_p && len == before_len && cap == before_cap);
    free(p);
}

TEST(gguf_vtype_sizes)
{
    static const struct {
        uint32_t type, size;
    } cases[] = {
        {GGUF_U8, 1},  {GGUF_I8, 1},  {GGUF_BOOL, 1}, {GGUF_U16, 2},    {GGUF_I16, 2},
        {GGUF_U32, 4}, {GGUF_I32, 4}, {GGUF_F32, 4},  {GGUF_U64, 8},    {GGUF_I64, 8},
        {GGUF_F64, 8}, {GGUF_STRING, 0}, {GGUF_ARRAY, 0}, {13, 0}, {UINT32_MAX, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        CHECK_MSG(gguf_vtype_size(cases[i].type) == cases[i].size, "type %u: size %u, want %u",
                  cases[i].type, gguf_vtype_size(cases[i].type), cases[i].size);
}
