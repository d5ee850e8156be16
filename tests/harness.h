/* Minimal test harness: TEST(name) registers a test at load time; the runner (tests/harness.c)
 * forks each test with a timeout and ends with "N passed, N failed".
 *
 *   TEST(gguf_rejects_truncated_header) { CHECK(x == 1); CHECK_EQ(a, b); }
 *   TEST_TIMEOUT(slow_thing, 300) { ... }
 *
 * Tests run in a child process with the repository root as cwd; a failed CHECK ends the child.
 * moe_test_tmpdir() gives a fresh directory removed after the test. */
#ifndef MOE_TEST_HARNESS_H
#define MOE_TEST_HARNESS_H

#include <stdint.h>
#include <stdio.h>

typedef void (*moe_test_fn)(void);
void moe_test_register(const char *name, const char *file, moe_test_fn fn, int timeout_s);
void moe_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));
/* Marks the current test skipped (with a reason) and ends it. */
void moe_test_skip(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* A per-test temporary directory (created on first call). */
const char *moe_test_tmpdir(void);
/* Path of a program in the build's bin/ folder (MOE_BIN, default "bin"). */
const char *moe_test_bin(const char *prog);

/* Reads a whole file into a malloc'ed, NUL-terminated buffer (len may be NULL); NULL on error. */
char *moe_test_read_file(const char *path, size_t *len);
/* The same, but a file that cannot be read fails the test. */
char *moe_test_read_file_or_fail(const char *path, size_t *len);

/* Writes len bytes to path (created or truncated); a failure fails the test. */
void moe_test_write_file(const char *path, const void *data, size_t len);
/* Writes an executable /bin/sh script with this body into the test's tmpdir; returns its path
 * (valid until the fourth call after this one). */
const char *moe_test_script(const char *name, const char *body);

/* Runs argv (argv[0] a path) with stdout to out_path and stderr to err_path (either may be NULL:
 * inherited; the same path for both interleaves them in one file). Returns the exit status, 128+signal when killed, or -1 when it could not run. */
int moe_test_run(char *const argv[], const char *out_path, const char *err_path);
/* Runs cmd through /bin/sh and returns its whole stdout (malloc'ed, NUL-terminated); *status is
 * the exit status, 128+signal when killed, or -1. A command that cannot be started fails the
 * test. */
char *moe_test_run_shell(const char *cmd, int *status);

/* ||a - b||_2 / ||b||_2 over n floats, in double precision. */
double moe_test_rel_l2(const float *a, const float *b, size_t n);
/* Index of the largest of x[0..n) (the first one on ties). */
int32_t moe_test_argmax(const float *x, size_t n);
/* How many of the rows (each n floats) of a and b have the same argmax. */
size_t moe_test_top1_agree(const float *a, const float *b, size_t rows, size_t n);

/* Seconds on the monotonic clock. */
double moe_test_now(void);

/* A deterministic xorshift64* generator, so that random test data is the same on every run.
 * Its state is per test process; seed it at the start of each test that uses it. */
void moe_test_rng_seed(uint64_t seed);
uint32_t moe_test_rng_u32(void);

#define TEST_TIMEOUT(name, secs)                                                   \
    static void test_##name(void);                                                 \
    __attribute__((constructor)) static void register_##name(void)                 \
    {                                                                              \
        moe_test_register(#name, __FILE__, test_##name, secs);                     \
    }                                                                              \
    static void test_##name(void)
#define TEST(name) TEST_TIMEOUT(name, 120)

#define CHECK(cond)                                                                \
    do {                                                                           \
        if (!(cond))                                                               \
            moe_test_fail(__FILE__, __LINE__, "CHECK(%s)", #cond);                 \
    } while (0)
#define CHECK_MSG(cond, ...)                                                       \
    do {                                                                           \
        if (!(cond))                                                               \
            moe_test_fail(__FILE__, __LINE__, __VA_ARGS__);                        \
    } while (0)
#define CHECK_EQ(a, b)                                                             \
    do {                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                        \
        if (a_ != b_)                                                              \
            moe_test_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, a_, b_); \
    } while (0)
#define CHECK_NEAR(a, b, tol)                                                      \
    do {                                                                           \
        double a_ = (double)(a), b_ = (double)(b);                                 \
        if (!(a_ - b_ <= (tol) && b_ - a_ <= (tol)))                               \
            moe_test_fail(__FILE__, __LINE__, "%s ~ %s: %.9g vs %.9g (tol %g)", #a, #b, a_, b_, (double)(tol)); \
    } while (0)
#define CHECK_STREQ(a, b)                                                          \
    do {                                                                           \
        const char *a_ = (a), *b_ = (b);                                           \
        if (!a_ || !b_ || strcmp(a_, b_) != 0)                                     \
            moe_test_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, #b, a_ ? a_ : "(null)", b_ ? b_ : "(null)"); \
    } while (0)

#endif
