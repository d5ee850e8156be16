/* Test runner: forks every registered test (in parallel with -j), kills it after its timeout,
 * captures its output (shown on failure or with -v) and ends with "N passed, N failed". */
#include "tests/harness.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <ftw.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "store/io.h"

#define MAX_TESTS 2048
#define EXIT_SKIP 77

struct test {
    const char *name, *file;
    moe_test_fn fn;
    int timeout_s;
};

static struct test tests[MAX_TESTS];
static int n_tests;
static char tmpdir[256];

void moe_test_register(const char *name, const char *file, moe_test_fn fn, int timeout_s)
{
    if (n_tests == MAX_TESTS) {
        fprintf(stderr, "harness: too many tests\n");
        abort();
    }
    tests[n_tests++] = (struct test){name, file, fn, timeout_s};
}

void moe_test_fail(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "FAIL %s:%d: ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(NULL);
    _exit(1);
}

void moe_test_skip(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "SKIP: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(NULL);
    _exit(EXIT_SKIP);
}

static void tmpdir_path(pid_t pid, char *buf, size_t n)
{
    const char *base = getenv("TMPDIR");
    snprintf(buf, n, "%s/moe-test-%d", base && *base ? base : "/tmp", (int)pid);
}

const char *moe_test_tmpdir(void)
{
    if (!tmpdir[0]) {
        tmpdir_path(getpid(), tmpdir, sizeof tmpdir);
        if (mkdir(tmpdir, 0700) != 0 && errno != EEXIST)
            moe_test_fail(__FILE__, __LINE__, "mkdir %s: %s", tmpdir, strerror(errno));
    }
    return tmpdir;
}

const char *moe_test_bin(const char *prog)
{
    static char buf[4][512];
    static int k;
    const char *dir = getenv("MOE_BIN");
    char *b = buf[k++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s", dir && *dir ? dir : "bin", prog);
    return b;
}

/* The store library's reader (store/io.h); errno is set on failure for the _or_fail message. */
char *moe_test_read_file(const char *path, size_t *len)
{
    char *buf;
    size_t n;
    int rc = moe_read_file(path, &buf, &n);
    if (rc) {
        errno = -rc;
        return NULL;
    }
    if (len)
        *len = n;
    return buf;
}

char *moe_test_read_file_or_fail(const char *path, size_t *len)
{
    char *buf = moe_test_read_file(path, len);
    if (!buf)
        moe_test_fail(__FILE__, __LINE__, "cannot read %s: %s", path, strerror(errno));
    return buf;
}

void moe_test_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        moe_test_fail(__FILE__, __LINE__, "cannot create %s: %s", path, strerror(errno));
    size_t k = fwrite(data, 1, len, f);
    if (fclose(f) != 0 || k != len)
        moe_test_fail(__FILE__, __LINE__, "cannot write %s: %s", path, strerror(errno));
}

const char *moe_test_script(const char *name, const char *body)
{
    static char buf[4][512];
    static int k;
    char *path = buf[k++ & 3];
    snprintf(path, sizeof buf[0], "%s/%s", moe_test_tmpdir(), name);
    size_t n = strlen(body);
    char *text = malloc(n + 16);
    if (!text)
        moe_test_fail(__FILE__, __LINE__, "out of memory");
    memcpy(text, "#!/bin/sh\n", 10);
    memcpy(text + 10, body, n);
    moe_test_write_file(path, text, n + 10);
    free(text);
    if (chmod(path, 0755) != 0)
        moe_test_fail(__FILE__, __LINE__, "chmod %s: %s", path, strerror(errno));
    return path;
}

char *moe_test_run_shell(const char *cmd, int *status)
{
    fflush(NULL);
    FILE *p = popen(cmd, "r");
    if (!p)
        moe_test_fail(__FILE__, __LINE__, "popen %s: %s", cmd, strerror(errno));
    char *out;
    size_t n;
    int rc = moe_read_stream(p, &out, &n);
    int st = pclose(p);
    if (rc)
        moe_test_fail(__FILE__, __LINE__, "reading the output of %s: %s", cmd, strerror(-rc));
    if (st == -1)
        *status = -1;
    else if (WIFSIGNALED(st))
        *status = 128 + WTERMSIG(st);
    else
        *status = WEXITSTATUS(st);
    return out;
}

int moe_test_run(char *const argv[], const char *out_path, const char *err_path)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        const char *paths[2] = {out_path, err_path};
        for (int i = 0; i < 2; i++) {
            if (!paths[i])
                continue;
            if (i == 1 && paths[0] && !strcmp(paths[0], paths[1])) {
                /* One log for both: share the offset so neither overwrites the other. */
                dup2(1, 2);
                continue;
            }
            int fd = open(paths[i], O_WRONLY | O_CREAT | O_TRUNC, 0600);
            if (fd < 0)
                _exit(126);
            dup2(fd, i + 1);
            close(fd);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return -1;
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return WEXITSTATUS(status);
}

double moe_test_rel_l2(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int32_t moe_test_argmax(const float *x, size_t n)
{
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return (int32_t)best;
}

size_t moe_test_top1_agree(const float *a, const float *b, size_t rows, size_t n)
{
    size_t same = 0;
    for (size_t r = 0; r < rows; r++)
        same += moe_test_argmax(a + r * n, n) == moe_test_argmax(b + r * n, n);
    return same;
}

static uint64_t rng_state;

void moe_test_rng_seed(uint64_t seed)
{
    rng_state = seed * 0x9E3779B97F4A7C15ull + 1;
}

uint32_t moe_test_rng_u32(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

double moe_test_now(void)
{
    return moe_now_s();
}

struct running {
    pid_t pid;
    int idx;
    double start;
    char log[256];
};

static void usage(void)
{
    fprintf(stderr, "usage: moe-tests [-l] [-v] [-j N] [-f SUBSTRING]...\n"
                    "  -l  list tests   -v  show output of passing tests too\n"
                    "  -j  run N tests at once   -f  run tests whose name or file contains SUBSTRING\n");
}

int main(int argc, char **argv)
{
    const char *filters[64];
    int n_filters = 0, jobs = 1, verbose = 0, list = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-f") && i + 1 < argc && n_filters < 64)
            filters[n_filters++] = argv[++i];
        else if (!strcmp(argv[i], "-j") && i + 1 < argc)
            jobs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-v"))
            verbose = 1;
        else if (!strcmp(argv[i], "-l"))
            list = 1;
        else {
            usage();
            return 2;
        }
    }
    if (jobs < 1)
        jobs = 1;
    if (getenv("MOE_TEST_JOBS"))
        jobs = atoi(getenv("MOE_TEST_JOBS")) > 0 ? atoi(getenv("MOE_TEST_JOBS")) : jobs;

    int selected[MAX_TESTS], n_sel = 0;
    for (int i = 0; i < n_tests; i++) {
        int ok = n_filters == 0;
        for (int f = 0; f < n_filters && !ok; f++)
            ok = strstr(tests[i].name, filters[f]) || strstr(tests[i].file, filters[f]);
        if (ok)
            selected[n_sel++] = i;
    }
    if (list) {
        for (int i = 0; i < n_sel; i++)
            printf("%s (%s)\n", tests[selected[i]].name, tests[selected[i]].file);
        return 0;
    }

    setvbuf(stdout, NULL, _IOLBF, 0);
    struct running *run = calloc((size_t)jobs, sizeof *run);
    int next = 0, active = 0, passed = 0, failed = 0, skipped = 0;
    const char *tbase = getenv("TMPDIR");
    double t0 = moe_test_now();
    while (next < n_sel || active > 0) {
        while (active < jobs && next < n_sel) {
            struct running *r = NULL;
            for (int k = 0; k < jobs; k++)
                if (!run[k].pid) {
                    r = &run[k];
                    break;
                }
            r->idx = selected[next++];
            snprintf(r->log, sizeof r->log, "%s/moe-test-log-%d-%d", tbase && *tbase ? tbase : "/tmp",
                     (int)getpid(), r->idx);
            fflush(NULL);
            pid_t pid = fork();
            if (pid == 0) {
                setpgid(0, 0);
                int fd = open(r->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
                if (fd >= 0) {
                    dup2(fd, 1);
                    dup2(fd, 2);
                    close(fd);
                }
                setvbuf(stdout, NULL, _IONBF, 0);
                tests[r->idx].fn();
                fflush(NULL);
                _exit(0);
            }
            r->pid = pid;
            r->start = moe_test_now();
            active++;
        }
        int status;
        pid_t done = waitpid(-1, &status, WNOHANG);
        double t = moe_test_now();
        for (int k = 0; k < jobs; k++) {
            struct running *r = &run[k];
            if (!r->pid)
                continue;
            const struct test *te = &tests[r->idx];
            int finished = 0, timed_out = 0;
            if (done == r->pid)
                finished = 1;
            else if (t - r->start > te->timeout_s) {
                kill(-r->pid, SIGKILL);
                kill(r->pid, SIGKILL);
                waitpid(r->pid, &status, 0);
                finished = timed_out = 1;
            }
            if (!finished)
                continue;
            kill(-r->pid, SIGKILL); /* leftovers of the test's process group */
            const char *verdict;
            int show = verbose;
            if (timed_out) {
                verdict = "FAIL (timeout)";
                failed++, show = 1;
            } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
                verdict = "ok";
                passed++;
            } else if (WIFEXITED(status) && WEXITSTATUS(status) == EXIT_SKIP) {
                verdict = "skip";
                skipped++, show = 1;
            } else {
                static char buf[64];
                if (WIFSIGNALED(status))
                    snprintf(buf, sizeof buf, "FAIL (signal %d)", WTERMSIG(status));
                else
                    snprintf(buf, sizeof buf, "FAIL (exit %d)", WEXITSTATUS(status));
                verdict = buf;
                failed++, show = 1;
            }
            printf("%-6s %-50s %6.2fs\n", verdict, te->name, t - r->start);
            if (show) {
                FILE *lf = fopen(r->log, "r");
                if (lf) {
                    char line[4096];
                    while (fgets(line, sizeof line, lf))
                        printf("    | %s", line);
                    fclose(lf);
                }
            }
            unlink(r->log);
            char td[256];
            tmpdir_path(r->pid, td, sizeof td);
            nftw(td, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
            r->pid = 0;
            active--;
        }
        if (done <= 0)
            usleep(5000);
    }
    printf("unit tests: %.1fs\n", moe_test_now() - t0);
    if (skipped)
        printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    else
        printf("%d passed, %d failed\n", passed, failed);
    free(run);
    return failed ? 1 : 0;
}
