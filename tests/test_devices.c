/* daemon/devices.c, which asks the worker program what it can compute on, against scripts that
 * stand in for it (answers, garbage, failures, a hang), and moed-worker --list-devices itself. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/config.h"
#include "daemon/devices.h"
#include "store/err.h"
#include "store/units.h"
#include "tests/harness.h"

TEST(devices_list_reads_cpu_and_gpus)
{
    const char *w = moe_test_script("w.sh",
                                    "[ \"$1\" = --list-devices ] || exit 9\n"
                                    "echo 'cpu Some CPU, 8 cores'\n"
                                    "echo 'cuda:1   GPU B, 81559 MiB, compute capability 9.0'\n"
                                    "echo 'garbage line'\n"
                                    "echo 'cuda:x not an index'\n"
                                    "echo 'cuda:64 out of range'\n"
                                    "echo 'cudax:0 not cuda'\n"
                                    "printf 'cuda:0 GPU A\\r\\n'\n"
                                    "echo 'cuda:1 a repeat'\n"
                                    "echo ''\n");
    struct devices_found f;
    char err[512];
    CHECK_MSG(devices_list(w, 5000, &f, err, sizeof err) == 0, "%s", err);
    CHECK(f.cpu);
    CHECK_EQ(f.n_gpu, 2);
    CHECK_EQ(f.gpu[0], 1);
    CHECK_STREQ(f.desc[0], "GPU B, 81559 MiB, compute capability 9.0");
    CHECK_EQ(f.gpu[1], 0);
    CHECK_STREQ(f.desc[1], "GPU A");

    w = moe_test_script("cpu.sh", "echo cpu\n");
    CHECK_MSG(devices_list(w, 5000, &f, err, sizeof err) == 0, "%s", err);
    CHECK(f.cpu);
    CHECK_EQ(f.n_gpu, 0);
}

TEST(devices_list_reports_failures)
{
    struct devices_found f;
    char err[512];
    const char *w = moe_test_script("fails.sh", "echo 'cuda:0 GPU'\nexit 3\n");
    CHECK(devices_list(w, 5000, &f, err, sizeof err) != 0);
    CHECK_MSG(strstr(err, "exited with status 3"), "%s", err);

    w = moe_test_script("crashes.sh", "kill -SEGV $$\n");
    CHECK(devices_list(w, 5000, &f, err, sizeof err) != 0);
    CHECK_MSG(strstr(err, "killed by signal 11"), "%s", err);

    w = moe_test_script("nothing.sh", "echo 'usage: something else'\n");
    CHECK(devices_list(w, 5000, &f, err, sizeof err) != 0);
    CHECK_MSG(strstr(err, "listed no device"), "%s", err);

    char missing[512];
    snprintf(missing, sizeof missing, "%s/no-such-worker", moe_test_tmpdir());
    CHECK(devices_list(missing, 5000, &f, err, sizeof err) != 0);
    CHECK_MSG(strstr(err, "no-such-worker") && strstr(err, "No such file"), "%s", err);

    w = moe_test_script("chatty.sh", "yes 'cuda:0 GPU'\n");
    CHECK(devices_list(w, 5000, &f, err, sizeof err) != 0);
    CHECK_MSG(strstr(err, "more than"), "%s", err);
}

/* True while pid runs: it exists and is not a zombie (an orphan waits for whoever reaps it). */
static bool alive(pid_t pid)
{
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *paren = strrchr(buf, ')');
    return paren && paren[1] == ' ' && paren[2] != 'Z' && paren[2] != 'X';
}

/* A probe that hangs, with a child of its own holding stdout open, is killed with its child
 * after the timeout. */
TEST(devices_list_kills_a_hanging_probe)
{
    char pidfile[512], body[1024];
    snprintf(pidfile, sizeof pidfile, "%s/child.pid", moe_test_tmpdir());
    snprintf(body, sizeof body, "echo cpu\nsleep 60 &\necho $! > '%s'\nwait\n", pidfile);
    const char *w = moe_test_script("hangs.sh", body);
    struct devices_found f;
    char err[512];
    double t0 = moe_test_now();
    CHECK(devices_list(w, 300, &f, err, sizeof err) != 0);
    double dt = moe_test_now() - t0;
    CHECK_MSG(strstr(err, "no answer within 300 ms"), "%s", err);
    CHECK_MSG(dt >= 0.25 && dt < 5, "took %.2f s", dt);
    char *pid_text = moe_test_read_file_or_fail(pidfile, NULL);
    pid_t child = (pid_t)atoi(pid_text);
    free(pid_text);
    CHECK(child > 0);
    bool gone = false;
    for (int i = 0; i < 200 && !gone; i++) {
        gone = !alive(child);
        if (!gone)
            usleep(10000);
    }
    CHECK_MSG(gone, "the probe's child %d outlived the timeout", (int)child);
}

/* The real worker: a cpu line first, exit status 0, every line "NAME DESCRIPTION". */
TEST(worker_lists_its_devices)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s --list-devices 2>/dev/null", moe_test_bin("moed-worker"));
    int st;
    char *out = moe_test_run_shell(cmd, &st);
    CHECK_EQ(st, 0);
    CHECK_MSG(!strncmp(out, "cpu ", 4) && strstr(out, "cores"), "%s", out);
    for (char *line = out; *line;) {
        char *nl = strchr(line, '\n');
        CHECK_MSG(nl, "unterminated line: %s", line);
        CHECK_MSG(!strncmp(line, "cpu ", 4) || !strncmp(line, "cuda:", 5), "%.*s",
                  (int)(nl - line), line);
        line = nl + 1;
    }
    free(out);

    struct devices_found f;
    char err[512];
    CHECK_MSG(devices_list(moe_test_bin("moed-worker"), 20000, &f, err, sizeof err) == 0, "%s",
              err);
    CHECK(f.cpu);
}

/* --devices lists: cpu and GPU items mixed, in order; malformed items and too many refused. */
TEST(devices_parse_list_mixes_cpu_and_gpus)
{
    char names[DEVICES_MAX][16];
    uint32_t n;
    CHECK_EQ(devices_parse_list("cpu,0,cuda:3,cpu,63", names, &n), 0);
    CHECK_EQ(n, 5u);
    CHECK(!strcmp(names[0], "cpu") && !strcmp(names[1], "cuda:0") && !strcmp(names[2], "cuda:3"));
    CHECK(!strcmp(names[3], "cpu") && !strcmp(names[4], "cuda:63"));
    CHECK_EQ(devices_parse_list("7", names, &n), 0);
    CHECK(n == 1 && !strcmp(names[0], "cuda:7"));
    static const char *const bad[] = {"", ",", "0,", ",0", "0,,1", "64", "cuda:", "cuda:64",
                                      "cpu0", "gpu", "0x1", "-1", "cuda:1a", " 0", "CPU", "auto",
                                      "cuda:007"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_MSG(devices_parse_list(bad[i], names, &n) == MOE_EFORMAT, "'%s' accepted", bad[i]);
    char many[4 * (DEVICES_MAX + 1) + 1] = "";
    for (int i = 0; i <= DEVICES_MAX; i++)
        strcat(many, i ? ",cpu" : "cpu");
    CHECK_EQ(devices_parse_list(many, NULL, &n), MOE_ERANGE);
    CHECK_EQ(devices_gpu_index("cuda:12"), 12);
    CHECK_EQ(devices_gpu_index("cpu"), -1);
    CHECK_EQ(devices_gpu_index("cuda:99"), -1);
}

/* --devices and --vram-budget as moed parses them: mixed lists, per-GPU budgets with a default. */
TEST(config_devices_and_per_gpu_budgets)
{
    struct moed_config c;
    bool help;
    char err[512];
    CHECK(config_init(&c) == 0);
    char *argv[] = {"moed", "--model", "m", "--devices", "cpu,cuda:1", "--vram-budget",
                    "cuda:0=40G,1=20G,8G", NULL};
    CHECK_MSG(config_parse_args(&c, 7, argv, &help, err, sizeof err) == 0, "%s", err);
    CHECK(!strcmp(c.devices, "cpu,cuda:1"));
    CHECK_EQ(c.vram_budget, 8ull << 30);
    CHECK_EQ(c.vram_budget_dev[0], 40ull << 30);
    CHECK_EQ(c.vram_budget_dev[1], 20ull << 30);
    CHECK(c.vram_budget_set[0] && c.vram_budget_set[1] && !c.vram_budget_set[2]);
    config_free(&c);

    CHECK(config_init(&c) == 0);
    char *argv2[] = {"moed", "--model", "m", "--vram-budget", "cuda:3=0,2=auto", NULL};
    CHECK_MSG(config_parse_args(&c, 5, argv2, &help, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(c.vram_budget, 0ull);
    CHECK(c.vram_budget_set[3] && c.vram_budget_dev[3] == 0); /* no budget for GPU 3 */
    CHECK(c.vram_budget_set[2] && c.vram_budget_dev[2] == MOE_VRAM_AUTO);
    config_free(&c);
    CHECK(config_init(&c) == 0);
    char *argv3[] = {"moed", "--model", "m", "--vram-budget", "auto", NULL};
    CHECK_MSG(config_parse_args(&c, 5, argv3, &help, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(c.vram_budget, MOE_VRAM_AUTO);
    config_free(&c);

    static const char *const bad_budget[] = {"", "12G,13G", "cuda:0=1G,0=2G", "cuda:99=1G",
                                             "foo=1G", "1=", "=1G", "1G,", "cuda:0=lots"};
    for (size_t i = 0; i < sizeof bad_budget / sizeof bad_budget[0]; i++) {
        CHECK(config_init(&c) == 0);
        char *a[] = {"moed", "--model", "m", "--vram-budget", (char *)bad_budget[i], NULL};
        CHECK_MSG(config_parse_args(&c, 5, a, &help, err, sizeof err) != 0, "'%s' accepted",
                  bad_budget[i]);
        CHECK_MSG(strstr(err, "vram-budget"), "%s", err);
        config_free(&c);
    }
    static const char *const bad_dev[] = {"cpu,", "0,gpu", "auto,0", "cuda:64"};
    for (size_t i = 0; i < sizeof bad_dev / sizeof bad_dev[0]; i++) {
        CHECK(config_init(&c) == 0);
        char *a[] = {"moed", "--model", "m", "--devices", (char *)bad_dev[i], NULL};
        CHECK_MSG(config_parse_args(&c, 5, a, &help, err, sizeof err) != 0, "'%s' accepted",
                  bad_dev[i]);
        config_free(&c);
    }
}
