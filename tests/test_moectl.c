/* Tests of moectl's option checking: numbers on the command line are parsed strictly (no NaN or
 * infinity, no overflow clamped to a limit, no trailing garbage) and checked against the ranges
 * the daemon accepts, and input files are read only up to a limit. Every case fails before
 * moectl connects, so no daemon runs: a value that passed would exit 3 (no daemon). */
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/harness.h"

/* Runs bin/moectl --socket DIR/none.sock ARGS (NULL-terminated); returns the exit status and
 * leaves stdout and stderr in DIR/moectl.log. */
static int moectl(char *log, size_t cap, ...)
{
    const char *argv[24];
    int argc = 0;
    static char sock[512];
    snprintf(sock, sizeof sock, "%s/none.sock", moe_test_tmpdir());
    argv[argc++] = moe_test_bin("moectl");
    argv[argc++] = "--socket";
    argv[argc++] = sock;
    va_list ap;
    va_start(ap, cap);
    const char *a;
    while ((a = va_arg(ap, const char *)) && argc < 23)
        argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    char path[512];
    snprintf(path, sizeof path, "%s/moectl.log", moe_test_tmpdir());
    unlink(path);
    int code = moe_test_run((char *const *)argv, path, path);
    CHECK(code >= 0);
    size_t n;
    char *text = moe_test_read_file_or_fail(path, &n);
    snprintf(log, cap, "%s", text);
    free(text);
    return code;
}

TEST(moectl_sampling_numbers_are_strict)
{
    static const struct {
        const char *opt, *val, *want;
    } bad[] = {
        {"--temp", "nan", "--temp must be a number in 0..100, not 'nan'"},
        {"--temp", "inf", "--temp must be a number in 0..100, not 'inf'"},
        {"--temp", "-0.5", "--temp must be a number in 0..100"},
        {"--temp", "0.7x", "--temp must be a number in 0..100, not '0.7x'"},
        {"--temp", "", "--temp must be a number"},
        {"--top-p", "1.5", "--top-p must be a number in 0..1"},
        {"--top-p", "-inf", "--top-p must be a number in 0..1"},
        {"--min-p", "NaN", "--min-p must be a number in 0..1"},
        {"--top-k", "-1", "--top-k must be an integer in 0..2147483647"},
        {"--top-k", "99999999999999999999", "--top-k must be an integer"},
        {"--repeat-penalty", "0", "--repeat-penalty must be a number in 0.01..100"},
        {"--presence-penalty", "nan", "--presence-penalty must be a number in -2..2"},
        {"--frequency-penalty", "2.5", "--frequency-penalty must be a number in -2..2"},
        {"-n", "99999999999999999999", "-n must be an integer in 1..16777216"},
        {"-n", "0", "-n must be an integer in 1..16777216"},
        {"--max-tokens", "5k", "--max-tokens must be an integer"},
        {"--seed", "99999999999999999999", "--seed must be an integer"},
    };
    char log[4096];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = moectl(log, sizeof log, "generate", bad[i].opt, bad[i].val, "hello", NULL);
        CHECK_MSG(rc == 2, "generate %s '%s': exit %d: %s", bad[i].opt, bad[i].val, rc, log);
        CHECK_MSG(strstr(log, bad[i].want), "generate %s '%s': '%s' not in: %s", bad[i].opt,
                  bad[i].val, bad[i].want, log);
        rc = moectl(log, sizeof log, "chat", bad[i].opt, bad[i].val, NULL);
        CHECK_MSG(rc == 2 && strstr(log, bad[i].want), "chat %s '%s': exit %d: %s", bad[i].opt,
                  bad[i].val, rc, log);
    }
    /* Values in range pass the checks and get as far as connecting. */
    int rc = moectl(log, sizeof log, "generate", "--temp", "0.7", "--top-p", "1", "--top-k", "0",
                    "--min-p", "0.05", "--repeat-penalty", "1.1", "--presence-penalty", "-2",
                    "--frequency-penalty", "0.5", "--seed", "-3", "-n", "16777216", "hello", NULL);
    CHECK_MSG(rc == 3 && strstr(log, "moed is not running"), "exit %d: %s", rc, log);
}

TEST(moectl_profile_import_input_is_limited)
{
    char log[4096];
    /* A device is refused without reading from it. */
    int rc = moectl(log, sizeof log, "profile", "import", "/dev/zero", NULL);
    CHECK_MSG(rc == 1 && strstr(log, "/dev/zero: not a regular file or a pipe"), "exit %d: %s", rc,
              log);
    rc = moectl(log, sizeof log, "profile", "import", moe_test_tmpdir(), NULL);
    CHECK_MSG(rc == 1 && strstr(log, "not a regular file"), "exit %d: %s", rc, log);
    /* A file over the limit is refused from its size (sparse: nothing is written). */
    char big[512];
    snprintf(big, sizeof big, "%s/big.json", moe_test_tmpdir());
    int fd = open(big, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, (off_t)(257 << 20)) == 0);
    close(fd);
    rc = moectl(log, sizeof log, "profile", "import", big, NULL);
    CHECK_MSG(rc == 1 && strstr(log, "more than 256 MiB (the limit)"), "exit %d: %s", rc, log);
    /* A pipe is read up to the limit and no further. */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "head -c 300000000 /dev/zero | %s --socket %s/none.sock profile import - 2>&1",
             moe_test_bin("moectl"), moe_test_tmpdir());
    int st;
    char *out = moe_test_run_shell(cmd, &st);
    CHECK_MSG(st == 1 && out && strstr(out, "-: more than 256 MiB (the limit)"), "exit %d: %s", st,
              out ? out : "");
    free(out);
    /* A small file is read and sent: without a daemon that is exit 3. */
    char small[512];
    snprintf(small, sizeof small, "%s/p.json", moe_test_tmpdir());
    FILE *f = fopen(small, "w");
    CHECK(f);
    fputs("{}\n", f);
    fclose(f);
    rc = moectl(log, sizeof log, "profile", "import", small, NULL);
    CHECK_MSG(rc == 3, "exit %d: %s", rc, log);
}

/* Every verb answers --help (and -h) with its usage on stdout and exit 0; --version names the
 * program. */
TEST(moectl_help_on_every_verb_and_version)
{
    static const char *const verbs[] = {"status", "generate", "chat", "inspect", "placement",
                                        "profile", "quantize", "mkmodel", "tokenize", "perplexity"};
    char log[8192];
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++) {
        CHECK_MSG(moectl(log, sizeof log, verbs[i], "--help", NULL) == 0, "%s --help: %s",
                  verbs[i], log);
        CHECK_MSG(strstr(log, "usage"), "%s --help: %s", verbs[i], log);
        CHECK_MSG(moectl(log, sizeof log, verbs[i], "-h", NULL) == 0, "%s -h: %s", verbs[i], log);
    }
    CHECK_EQ(moectl(log, sizeof log, "--version", NULL), 0);
    CHECK(!strncmp(log, "moectl ", 7));
    CHECK_EQ(moectl(log, sizeof log, "--help", NULL), 0);
    CHECK_EQ(moectl(log, sizeof log, "nosuchverb", NULL), 2);
}

/* Every option also takes --name=value. */
TEST(moectl_options_take_equals_values)
{
    char log[8192];
    CHECK_EQ(moectl(log, sizeof log, "generate", "--temp=nan", "hello", NULL), 2);
    CHECK_MSG(strstr(log, "--temp") && strstr(log, "nan"), "%s", log);
    CHECK_EQ(moectl(log, sizeof log, "generate", "--temp=0.5", "-n", "4", "hello", NULL), 3);
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--ctx=0", "models/kjv-demo-F16.gguf", NULL), 2);
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--vram-budget=1G", "models/kjv-demo-F16.gguf",
                    NULL), 0);
    CHECK_MSG(strstr(log, "VRAM budget 1.00 GiB"), "%s", log);
    /* The budget a residency needs: half the demo model's 32 experts in every layer. */
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--expert-residency=50%", "models/kjv-demo-F16.gguf",
                    NULL), 0);
    CHECK_MSG(strstr(log, "slots per layer   16 of 32") && strstr(log, "residency         50.0%"),
              "%s", log);
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--expert-residency", "50%", "--vram-budget", "1G",
                    "models/kjv-demo-F16.gguf", NULL), 2);
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--expert-residency", "150%",
                    "models/kjv-demo-F16.gguf", NULL), 2);
    char sock[600];
    snprintf(sock, sizeof sock, "--socket=%s/other.sock", moe_test_tmpdir());
    CHECK_EQ(moectl(log, sizeof log, sock, "status", NULL), 3);
    CHECK_MSG(strstr(log, "other.sock"), "%s", log);
}

/* moectl inspect --ram-budget: the pool moed would keep, its minimum and whether a GPU worker
 * takes it; with a VRAM budget too, the split a GPU worker over that pool makes (an expert of
 * every layer stays out of VRAM); a budget below one step's experts is refused as moed refuses it. */
TEST(moectl_inspect_ram_budget)
{
    char log[8192];
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--ram-budget", "720K", "--vram-budget", "1G",
                    "models/kjv-demo-F16.gguf", NULL), 0);
    CHECK_MSG(strstr(log, "pool              20 of 128 experts") &&
                  strstr(log, "too few, CPU workers only") && strstr(log, "slots per layer   31 of 32"),
              "%s", log);
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--ram-budget", "50%", "models/kjv-demo-F16.gguf",
                    NULL), 0);
    CHECK_MSG(strstr(log, "64 of 128 experts") && strstr(log, "this pool takes one"), "%s", log);
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--ram-budget", "100%", "--vram-budget", "1G",
                    "models/kjv-demo-F16.gguf", NULL), 0);
    CHECK_MSG(strstr(log, "every expert fits") && strstr(log, "slots per layer   32 of 32"), "%s", log);
    CHECK_EQ(moectl(log, sizeof log, "inspect", "--ram-budget", "540K", "models/kjv-demo-F16.gguf",
                    NULL), 2);
    CHECK_MSG(strstr(log, "one step needs at least 16"), "%s", log);
}
