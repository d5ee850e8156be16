/* System tests of bin/moed: the real daemon on the golden tiny model in a temp dir, talked to
 * through its real Unix socket (and loopback TCP). Startup errors, request validation, admin
 * access control (TCP, another uid), SIGTERM, then — with CPU workers — generations compared to
 * the standalone worker, SSE streaming, stop strings, a worker killed mid-generation, and the
 * routing profile surviving SIGTERM and kill -9 of the daemon. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "store/gguf.h"
#include "store/tokenizer.h"
#include "tests/harness.h"
#include "tests/httpc.h"

#define MODEL "tests/golden/models/tiny-qwen3moe-Q8_0.gguf"

struct moed {
    pid_t pid;
    char dir[256];
    char sock[320];
    char log[320];
    char state[320];
};

/* Starts bin/moed with the given extra arguments (NULL-terminated); stderr goes to dir/moed.log.
 * The daemon dies with the test (PR_SET_PDEATHSIG). */
static const char *spawn_notify_socket; /* NOTIFY_SOCKET for the next spawn (watchdog too) */
/* When set, moed starts in a process group of its own (as a shell's foreground job would). */
static bool spawn_new_pgrp;

/* The device the tests' "--devices cpu" workers run on: MOE_TEST_DEVICE ("cuda:K" or "K"), or
 * "cpu". */
static const char *test_device(void)
{
    static char name[16];
    const char *dev = getenv("MOE_TEST_DEVICE");
    if (!dev || !*dev || !strcmp(dev, "cpu") || strlen(dev) > 7)
        return "cpu";
    snprintf(name, sizeof name, "%s%s", strncmp(dev, "cuda:", 5) ? "cuda:" : "", dev);
    return name;
}

static void moed_spawn(struct moed *d, const char *dir, const char *const *extra)
{
    memset(d, 0, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "%s", dir);
    snprintf(d->sock, sizeof d->sock, "%s/moed.sock", dir);
    snprintf(d->log, sizeof d->log, "%s/moed.log", dir);
    snprintf(d->state, sizeof d->state, "%s/state", dir);
    const char *argv[64];
    int n = 0;
    argv[n++] = moe_test_bin("moed");
    argv[n++] = "--socket";
    argv[n++] = d->sock;
    argv[n++] = "--state-dir";
    argv[n++] = d->state;
    argv[n++] = "--worker-bin";
    argv[n++] = moe_test_bin("moed-worker");
    bool has_model = false;
    /* MOE_TEST_DEVICE (e.g. "cuda:0" on a GPU machine) replaces "--devices cpu": as many
     * workers on that device as the test's --workers, so the same tests run the daemon with
     * other workers. */
    static char devlist[64 * 8];
    const char *dev = strcmp(test_device(), "cpu") ? test_device() : NULL;
    int nw = 1;
    for (int i = 0; dev && extra && extra[i] && extra[i + 1]; i++)
        if (!strcmp(extra[i], "--workers"))
            nw = atoi(extra[i + 1]) > 0 && atoi(extra[i + 1]) <= 64 ? atoi(extra[i + 1]) : 1;
    for (int i = 0; extra && extra[i] && n < 60; i++) {
        if (!strcmp(extra[i], "--model"))
            has_model = true;
        if (i > 0 && dev && !strcmp(extra[i - 1], "--devices") && !strcmp(extra[i], "cpu")) {
            devlist[0] = 0;
            for (int w = 0; w < nw; w++)
                snprintf(devlist + strlen(devlist), sizeof devlist - strlen(devlist), "%s%s",
                         w ? "," : "", dev);
            argv[n++] = devlist;
            continue;
        }
        argv[n++] = extra[i];
    }
    if (!has_model) {
        argv[n++] = "--model";
        argv[n++] = MODEL;
    }
    argv[n] = NULL;
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (spawn_new_pgrp)
            setpgid(0, 0);
        int fd = open(d->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        if (spawn_notify_socket) {
            char pid_s[32];
            snprintf(pid_s, sizeof pid_s, "%d", (int)getpid());
            setenv("NOTIFY_SOCKET", spawn_notify_socket, 1);
            setenv("WATCHDOG_USEC", "400000", 1);
            setenv("WATCHDOG_PID", pid_s, 1);
        }
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    d->pid = pid;
}

static void dump_log(const struct moed *d)
{
    FILE *f = fopen(d->log, "r");
    if (!f)
        return;
    char line[1024];
    fprintf(stderr, "---- %s ----\n", d->log);
    while (fgets(line, sizeof line, f))
        fputs(line, stderr);
    fclose(f);
}

/* Waits until the socket answers /health (any status). */
static void moed_wait_socket(struct moed *d, double timeout)
{
    double t0 = moe_test_now();
    while (moe_test_now() - t0 < timeout) {
        struct hc_resp r;
        if (hc_request_unix(d->sock, "GET", "/health", NULL, &r, 2000) == 0) {
            hc_resp_free(&r);
            return;
        }
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            dump_log(d);
            moe_test_fail(__FILE__, __LINE__, "moed exited early (status %d)", st);
        }
        usleep(20000);
    }
    dump_log(d);
    moe_test_fail(__FILE__, __LINE__, "moed did not open %s in %.0f s", d->sock, timeout);
}

/* True once /health answers 200 (every worker ready). */
static bool moed_wait_ready(struct moed *d, double timeout)
{
    double t0 = moe_test_now();
    while (moe_test_now() - t0 < timeout) {
        struct hc_resp r;
        if (hc_request_unix(d->sock, "GET", "/health", NULL, &r, 2000) == 0) {
            int st = r.status;
            hc_resp_free(&r);
            if (st == 200)
                return true;
        }
        usleep(50000);
    }
    return false;
}

/* Restarts of worker 0 so far (from /admin/status), or -1. */
static int worker_restarts(const char *sock)
{
    struct hc_resp r;
    if (hc_request_unix(sock, "GET", "/admin/status", NULL, &r, 5000) != 0)
        return -1;
    json_t *o = json_loads(r.body ? r.body : "", 0, NULL);
    hc_resp_free(&r);
    json_t *w = json_array_get(json_object_get(o, "workers"), 0);
    int n = w ? (int)json_integer_value(json_object_get(w, "restarts")) : -1;
    json_decref(o);
    return n;
}

/* The generation tests need daemon-spawned workers; when they cannot start at all (a worker
 * that keeps dying before its first Ready), the test is skipped with the reason. */
static void moed_require_ready(struct moed *d, double timeout)
{
    double t0 = moe_test_now();
    bool ready = false;
    while (!ready && moe_test_now() - t0 < timeout) {
        ready = moed_wait_ready(d, 1.0);
        if (!ready && worker_restarts(d->sock) >= 3)
            break;
    }
    if (!ready) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, NULL, 0);
        FILE *f = fopen(d->log, "r");
        char line[512] = "", last[512] = "";
        while (f && fgets(line, sizeof line, f))
            if (strstr(line, "worker"))
                snprintf(last, sizeof last, "%s", line);
        if (f)
            fclose(f);
        moe_test_skip("moed's workers did not become ready within %.0f s (last worker log: %s)", moe_test_now() - t0,
                      last);
    }
}

/* moed_spawn, then waits for the socket and for every worker to be ready. */
static void moed_start(struct moed *d, const char *dir, const char *const *args)
{
    moed_spawn(d, dir, args);
    moed_wait_socket(d, 30);
    moed_require_ready(d, 60);
}

/* Waits up to timeout s for d to exit: its exit status, or -1 (after SIGKILL) when it did not. */
static int moed_wait_exit(struct moed *d, double timeout)
{
    double t0 = moe_test_now();
    int st;
    while (moe_test_now() - t0 < timeout) {
        if (waitpid(d->pid, &st, WNOHANG) == d->pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        usleep(20000);
    }
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
    dump_log(d);
    return -1;
}

/* SIGTERM and wait; returns the exit status (or -1 on a timeout, after SIGKILL). */
static int moed_stop(struct moed *d, double timeout)
{
    kill(d->pid, SIGTERM);
    return moed_wait_exit(d, timeout);
}

static bool log_contains(const struct moed *d, const char *s)
{
    FILE *f = fopen(d->log, "r");
    if (!f)
        return false;
    char line[2048];
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, s) != NULL;
    fclose(f);
    return found;
}

static json_t *post_json(const char *sock, const char *path, const char *body, int *status)
{
    struct hc_resp r;
    int rc = hc_request_unix(sock, "POST", path, body, &r, 60000);
    CHECK_MSG(rc == 0, "POST %s: %d", path, rc);
    *status = r.status;
    json_t *j = json_loads(r.body ? r.body : "", 0, NULL);
    CHECK_MSG(j != NULL, "POST %s: not JSON: %s", path, r.body ? r.body : "");
    hc_resp_free(&r);
    return j;
}

static const char *err_msg(json_t *j)
{
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    return m ? m : "";
}

/* The TCP port moed's log names (the kernel picked it for 127.0.0.1:0), or 0. */
static int moed_tcp_port(const struct moed *d)
{
    int port = 0;
    FILE *f = fopen(d->log, "r");
    char line[2048];
    while (f && fgets(line, sizeof line, f)) {
        char *p = strstr(line, "(tcp port ");
        if (p)
            port = atoi(p + 10);
    }
    if (f)
        fclose(f);
    return port;
}

/* An API key file in dir (for --listen); returns its path (static storage). */
#define TEST_API_KEY "test-key-0123456789abcdef"
static const char *api_key_file(const char *dir)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/api.key", dir);
    moe_test_write_file(path, TEST_API_KEY "\n", strlen(TEST_API_KEY) + 1);
    return path;
}

/* ---- no workers needed ---- */

TEST(daemon_bad_model_and_options)
{
    const char *dir = moe_test_tmpdir();
    char bad[512];
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    FILE *f = fopen(bad, "w");
    fputs("GGUF but not really a gguf file", f);
    fclose(f);
    struct moed d;
    const char *a1[] = {"--model", bad, NULL};
    moed_spawn(&d, dir, a1);
    int st;
    waitpid(d.pid, &st, 0);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d", st);
    CHECK(log_contains(&d, "bad.gguf"));
    CHECK(access(d.sock, F_OK) != 0);   /* failed before creating the socket */

    const char *a2[] = {"--model", "/nonexistent/model.gguf", NULL};
    moed_spawn(&d, dir, a2);
    waitpid(d.pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    CHECK(log_contains(&d, "/nonexistent/model.gguf"));

    const char *a3[] = {"--listen", "0.0.0.0:8080", NULL};
    moed_spawn(&d, dir, a3);
    waitpid(d.pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 2);
    CHECK(log_contains(&d, "loopback"));

    const char *a4[] = {"--bogus", "1", NULL};
    moed_spawn(&d, dir, a4);
    waitpid(d.pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 2);
    CHECK(log_contains(&d, "--bogus"));
}

/* Numbers that make no sense fail at start with exit status 2 and one line naming the option
 * and its range, before the model is opened; in a config file the line names file and line. */
TEST(daemon_rejects_out_of_range_options)
{
    const char *dir = moe_test_tmpdir();
    static const struct {
        const char *opt, *val, *want;
    } cases[] = {
        {"--idle-timeout", "0", "--idle-timeout must be 1..86400, not 0"},
        {"--profile-interval", "0", "--profile-interval must be 1..86400, not 0"},
        {"--workers", "0", "--workers must be 1..64, not 0"},
        {"--workers", "65", "--workers must be 1..64, not 65"},
        {"--workers", "-1", "--workers must be a whole number in 1..64, not '-1'"},
        {"--threads", "1025", "--threads must be 0..1024, not 1025"},
        {"--threads", "99999999999999999999", "--threads must be 0..1024"},
        {"--parallel", "0", "--parallel must be 1..256, not 0"},
        {"--ctx", "16777217", "--ctx must be 0..16777216, not 16777217"},
        {"--queue-max", "0", "--queue-max must be 1..1000000, not 0"},
        {"--max-tokens-default", "x", "--max-tokens-default must be a whole number in 0..16777216"},
        {"--max-body", "10", "--max-body must be 1K..1G, not 10"},
        {"--vram-budget", "-1G", "--vram-budget: '-1G' is not a size"},
        {"--pool-io", "fast", "--pool-io must be auto, direct or buffered, not 'fast'"},
        {"--devices", "0,x", "--devices must be cpu, auto or a list of devices like 0,1 or cpu,cuda:0 (GPU indexes in 0..63"},
        {"--devices", "64", "--devices must be cpu, auto or a list of devices like 0,1 or cpu,cuda:0 (GPU indexes in 0..63"},
        {"--devices", "0,", "not '0,'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct moed d;
        const char *args[] = {"--devices", "cpu", cases[i].opt, cases[i].val, NULL};
        moed_spawn(&d, dir, args);
        int st;
        waitpid(d.pid, &st, 0);
        CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 2, "%s %s: status %d", cases[i].opt,
                  cases[i].val, st);
        CHECK_MSG(log_contains(&d, cases[i].want), "%s %s: log lacks '%s'", cases[i].opt,
                  cases[i].val, cases[i].want);
        CHECK_MSG(!log_contains(&d, "opening"), "%s %s: the model was opened", cases[i].opt,
                  cases[i].val);
        CHECK(access(d.sock, F_OK) != 0);
        unlink(d.log);
    }

    /* The same in a config file: the message names the file and the line. */
    char conf[512];
    snprintf(conf, sizeof conf, "%s/moed.conf", dir);
    FILE *f = fopen(conf, "w");
    CHECK(f);
    fputs("devices = cpu\n# threads per worker\nthreads = 5000\n", f);
    fclose(f);
    struct moed d;
    const char *args[] = {"--config", conf, NULL};
    moed_spawn(&d, dir, args);
    int st;
    waitpid(d.pid, &st, 0);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d", st);
    char want[600];
    snprintf(want, sizeof want, "%s:3: threads must be 0..1024, not 5000", conf);
    CHECK_MSG(log_contains(&d, want), "log lacks '%s'", want);
    CHECK(!log_contains(&d, "opening"));
}

TEST(daemon_rejects_bad_requests)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--ctx", "64", "--max-body", "4K",
                          "--listen", "127.0.0.1:0", "--api-key-file", api_key_file(dir), NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    /* Requests are parsed once the model is served (before that every one is 503). */
    CHECK(moed_wait_ready(&d, 60));
    struct stat st;
    CHECK(stat(d.sock, &st) == 0);
    CHECK_EQ(st.st_mode & 0777, 0660);

    int status;
    json_t *j;
    const char *cp = "/v1/completions", *cc = "/v1/chat/completions", *cr = "/v1/responses";
    struct {
        const char *path, *body, *needle;
        int status;
    } cases[] = {
        {cp, "{\"prompt\": \"hi\"", "not valid JSON", 400},
        {cp, "[1, 2]", "must be a JSON object", 400},
        {cp, "{\"prompt\": \"hi\", \"temperature\": \"hot\"}", "'temperature' must be a number", 400},
        {cp, "{\"prompt\": \"hi\", \"max_tokens\": \"5\"}", "'max_tokens' must be an integer", 400},
        {cp, "{\"prompt\": \"hi\", \"max_tokens\": 0}", "'max_tokens' must be between", 400},
        {cp, "{\"prompt\": \"hi\", \"max_tokens\": 100000}", "'max_tokens' must be between", 400},
        {cp, "{\"prompt\": \"hi\", \"max_completion_tokens\": -3}", "'max_completion_tokens'", 400},
        {cp, "{\"prompt\": \"hi\", \"n\": 0}", "'n' must be between 1 and 16", 400},
        {cp, "{\"prompt\": \"hi\", \"n\": 17}", "'n' must be between 1 and 16", 400},
        {cp, "{\"prompt\": \"hi\", \"stream\": 1}", "'stream' must be a boolean", 400},
        {cp, "{\"prompt\": \"hi\", \"stop\": 5}", "'stop' must be a string", 400},
        {cp, "{\"prompt\": \"hi\", \"stop\": [\"a\", 1]}", "'stop[1]' must be a string", 400},
        {cp, "{\"prompt\": \"hi\", \"top_p\": 1.5}", "'top_p' must be between", 400},
        {cp, "{\"prompt\": \"hi\", \"seed\": 1.5}", "'seed' must be an integer", 400},
        {cp, "{\"prompt\": \"hi\", \"logprobs\": 21}", "'logprobs' must be between 0 and 20", 400},
        {cp, "{\"prompt\": \"hi\", \"logit_bias\": {\"x1\": 2}}", "key \"x1\" is not a token id", 400},
        {cp, "{\"prompt\": \"hi\", \"logit_bias\": {\"1\": -100.5}}", "between -100 and 100", 400},
        {cp, "{\"prompt\": \"hi\", \"echo\": 1}", "'echo' must be a boolean", 400},
        {cp, "{\"prompt\": \"hi\", \"model\": \"other\"}", "'other' does not exist", 404},
        {cc, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_logprobs\": 3}", "needs 'logprobs': true", 400},
        {cp, "{\"prompt\": \"hi\", \"tools\": [{}]}", "'tools' is not supported", 400},
        {cp, "{\"prompt\": 7}", "'prompt' must be a string", 400},
        {cp, "{\"prompt\": []}", "'prompt' is empty", 400},
        {cp, "{\"prompt\": [\"a\", \"\"]}", "'prompt[1]' is empty", 400},
        {cp, "{\"prompt\": [[1], []]}", "'prompt[1]' is empty", 400},
        {cp, "{\"prompt\": [\"a\", 3]}", "'prompt[1]' must be a string or an array of token ids, not an integer", 400},
        {cp, "{\"prompt\": [\"a\", {}]}", "'prompt[1]' must be a string or an array of token ids, not an object", 400},
        {cp, "{\"prompt\": [null]}", "'prompt[0]' must be a string or an array of token ids, not null", 400},
        {cp, "{\"prompt\": [[1, 2], [3, \"x\"]]}", "'prompt[1][1]' must be a token id", 400},
        {cp, "{\"prompt\": [\"a\", \"b\", [1, 999999]]}", "'prompt[2][1]': token id 999999 is out of range", 400},
        {cp, "{\"prompt\": [1, \"a\"]}", "'prompt[1]' must be a token id", 400},
        {cp, "{\"prompt\": [\"a\", [1, [2]]]}", "'prompt[1][1]' must be a token id", 400},
        {cp, "{\"prompt\": [\"a\", \"b\", \"c\", \"d\", \"e\", \"f\", \"g\", \"h\", \"i\"], \"n\": 15}", "at most 128 (prompts x n)", 400},
        {cp, "{\"prompt\": [1, 999999]}", "out of range", 400},
        {cp, "{\"prompt\": \"\"}", "empty", 400},
        {cp, "{}", "'prompt' is required", 400},
        {cp, "{\"prompt\": \"a\", \"prompt\": \"b\"}", "duplicate", 400},
        {cc, "{\"messages\": \"hi\"}", "'messages' must be an array", 400},
        {cc, "{\"messages\": []}", "must not be empty", 400},
        {cc, "{\"messages\": [{\"role\": \"user\"}], \"temperature\": []}", "'temperature' must be a number", 400},
        {cc, "{\"messages\": [{\"role\": 1, \"content\": \"x\"}]}", "role' must be a string", 400},
        {cc, "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", "must be system, developer, user, assistant or tool", 400},
        {cc, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": \"required\"}", "needs 'tools'", 400},
        {cc, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": \"always\"}", "tool_choice must be", 400},
        {cc, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"x\"}]}", "'tools[0]' must be", 400},
        {cc, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": 1}", "must be an object", 400},
        {cc, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", "only parts of type", 400},
        /* The Responses API: its own fields checked, what moed cannot honour refused. */
        {cr, "{\"input\": \"hi\"", "not valid JSON", 400},
        {cr, "{}", "'input' is required", 400},
        {cr, "{\"input\": 5}", "'input' must be a string or an array", 400},
        {cr, "{\"input\": [7]}", "'input[0]' must be an object", 400},
        {cr, "{\"input\": [{\"role\": \"tool\", \"content\": \"x\"}]}", "'input[0].role' must be", 400},
        {cr, "{\"input\": [{\"role\": \"user\"}]}", "'input[0].content' must be a string", 400},
        {cr, "{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_image\"}]}]}", "only input_text and output_text", 400},
        {cr, "{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_text\"}]}]}", "'input[0].content[0].text' must be", 400},
        {cr, "{\"input\": [{\"type\": \"item_reference\", \"id\": \"msg_1\"}]}", "does not store responses", 400},
        {cr, "{\"input\": [{\"type\": \"function_call\", \"name\": \"f\"}]}", "needs string 'call_id'", 400},
        {cr, "{\"input\": [{\"type\": \"function_call_output\", \"call_id\": \"c\", \"output\": 1}]}", "'input[0].output' must be", 400},
        {cr, "{\"input\": \"hi\", \"instructions\": 1}", "'instructions' must be a string", 400},
        {cr, "{\"input\": \"hi\", \"previous_response_id\": \"resp_1\"}", "does not store responses", 400},
        {cr, "{\"input\": \"hi\", \"conversation\": \"conv_1\"}", "does not store conversations", 400},
        {cr, "{\"input\": \"hi\", \"background\": true}", "background responses are not supported", 400},
        {cr, "{\"input\": \"hi\", \"store\": \"yes\"}", "'store' must be a boolean", 400},
        {cr, "{\"input\": \"hi\", \"include\": [\"reasoning.encrypted_content\"]}", "'reasoning.encrypted_content' is not supported", 400},
        {cr, "{\"input\": \"hi\", \"include\": [\"message.output_text.logprobs\", \"file_search_call.results\"]}", "'file_search_call.results' is not supported", 400},
        {cr, "{\"input\": \"hi\", \"include\": \"message.output_text.logprobs\"}", "'include' must be an array", 400},
        {cr, "{\"input\": \"hi\", \"include\": [3]}", "'include[0]' must be a string", 400},
        {cr, "{\"input\": \"hi\", \"include\": [\"message.output_text.logprobs\"], \"top_logprobs\": 21}", "'top_logprobs' must be between 0 and 20", 400},
        {cr, "{\"input\": \"hi\", \"include\": [\"message.output_text.logprobs\"], \"top_logprobs\": -1}", "'top_logprobs' must be between 0 and 20", 400},
        {cr, "{\"input\": \"hi\", \"include\": [\"message.output_text.logprobs\"], \"top_logprobs\": \"3\"}", "'top_logprobs' must be an integer", 400},
        {cr, "{\"input\": \"hi\", \"include\": [\"message.output_text.logprobs\"], \"top_logprobs\": 2.5}", "'top_logprobs' must be an integer", 400},
        {cr, "{\"input\": \"hi\", \"top_logprobs\": 3}", "'top_logprobs' needs 'include'", 400},
        {cr, "{\"input\": \"hi\", \"max_output_tokens\": 0}", "'max_output_tokens' must be between", 400},
        {cr, "{\"input\": \"hi\", \"max_output_tokens\": \"8\"}", "'max_output_tokens' must be an integer", 400},
        {cr, "{\"input\": \"hi\", \"temperature\": \"hot\"}", "'temperature' must be a number", 400},
        {cr, "{\"input\": \"hi\", \"stream\": 1}", "'stream' must be a boolean", 400},
        {cr, "{\"input\": \"hi\", \"tools\": [{\"type\": \"web_search\"}]}", "only function tools", 400},
        {cr, "{\"input\": \"hi\", \"tools\": [{\"type\": \"function\"}]}", "'tools[0].name' must be", 400},
        {cr, "{\"input\": \"hi\", \"tools\": {}}", "'tools' must be an array", 400},
        {cr, "{\"input\": \"hi\", \"tool_choice\": {\"type\": \"file_search\"}}", "'tool_choice' must be", 400},
        {cr, "{\"input\": \"hi\", \"tool_choice\": \"required\"}", "needs 'tools'", 400},
        {cr, "{\"input\": \"hi\", \"text\": {\"format\": {\"type\": \"xml\"}}}", "'text.format.type' must be", 400},
        {cr, "{\"input\": \"hi\", \"text\": {\"format\": {\"type\": \"json_schema\"}}}", "'text.format.schema' must be", 400},
        {cr, "{\"input\": \"hi\", \"text\": 3}", "'text' must be an object", 400},
        {cr, "{\"input\": \"hi\", \"reasoning\": {\"summary\": \"auto\"}}", "summaries are not supported", 400},
        {cr, "{\"input\": \"hi\", \"model\": \"other\"}", "'other' does not exist", 404},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        j = post_json(d.sock, cases[i].path, cases[i].body, &status);
        CHECK_MSG(status == cases[i].status, "case %zu (%s): status %d: %s", i, cases[i].body, status,
                  err_msg(j));
        CHECK_MSG(strstr(err_msg(j), cases[i].needle) != NULL, "case %zu (%s): message '%s' lacks '%s'",
                  i, cases[i].body, err_msg(j), cases[i].needle);
        json_t *e = json_object_get(j, "error");
        CHECK(json_is_string(json_object_get(e, "type")) && json_is_string(json_object_get(e, "code")));
        json_decref(j);
    }

    /* A prompt longer than the context (64 tokens): 400 with both numbers. */
    char prompt[4096] = "{\"prompt\": \"";
    for (int i = 0; i < 100; i++)
        strcat(prompt, "word ");
    strcat(prompt, "\"}");
    j = post_json(d.sock, cp, prompt, &status);
    CHECK_EQ(status, 400);
    json_t *e = json_object_get(j, "error");
    CHECK(json_integer_value(json_object_get(e, "n_prompt_tokens")) >= 100);
    CHECK_EQ(json_integer_value(json_object_get(e, "n_ctx")), 64);
    CHECK_STREQ(json_string_value(json_object_get(e, "code")), "context_length_exceeded");
    json_decref(j);
    /* The same as the third of several prompts: the message names it. */
    snprintf(prompt, sizeof prompt, "{\"prompt\": [\"a\", [1, 2], \"");
    for (int i = 0; i < 100; i++)
        strcat(prompt, "word ");
    strcat(prompt, "\", \"b\"]}");
    j = post_json(d.sock, cp, prompt, &status);
    CHECK_EQ(status, 400);
    e = json_object_get(j, "error");
    CHECK_MSG(strstr(err_msg(j), "'prompt[2]' has ") && strstr(err_msg(j), "the context holds 64"),
              "%s", err_msg(j));
    CHECK(json_integer_value(json_object_get(e, "n_prompt_tokens")) >= 100);
    CHECK_STREQ(json_string_value(json_object_get(e, "code")), "context_length_exceeded");
    CHECK_STREQ(json_string_value(json_object_get(e, "param")), "prompt");
    json_decref(j);
    /* At most 64 prompts in one request. */
    strcpy(prompt, "{\"prompt\": [\"a\"");
    for (int i = 1; i < 65; i++)
        strcat(prompt, ", \"a\"");
    strcat(prompt, "]}");
    j = post_json(d.sock, cp, prompt, &status);
    CHECK_EQ(status, 400);
    CHECK_MSG(strstr(err_msg(j), "holds 65 prompts; a request may hold at most 64"), "%s", err_msg(j));
    json_decref(j);

    /* Body over --max-body (4 KiB): 413. */
    char *big = malloc(8192);
    memset(big, ' ', 8191);
    big[0] = '{';
    big[8190] = '}';
    big[8191] = 0;
    j = post_json(d.sock, cp, big, &status);
    CHECK_EQ(status, 413);
    json_decref(j);
    free(big);

    /* Unknown path, wrong method. */
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/v2/nothing", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 404);
    CHECK(strstr(r.body, "\"error\""));
    hc_resp_free(&r);
    /* A path that is not UTF-8 is quoted in the message with U+FFFD for its bad bytes (the
     * message was left out of the error object). */
    const char *bad_paths[] = {"/v2/\xff\xfe/x", "/v1/models/\xc3"};
    for (size_t i = 0; i < 2; i++) {
        CHECK(hc_request_unix(d.sock, "GET", bad_paths[i], NULL, &r, 5000) == 0);
        CHECK_EQ(r.status, 404);
        j = json_loads(r.body, 0, NULL);
        CHECK_MSG(strstr(err_msg(j), i ? "is not served here" : "no such endpoint") &&
                  strstr(err_msg(j), "\xef\xbf\xbd"), "%s", r.body);
        json_decref(j);
        hc_resp_free(&r);
    }
    CHECK(hc_request_unix(d.sock, "GET", "/v1/completions", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 405);
    hc_resp_free(&r);
    CHECK(hc_request_unix(d.sock, "GET", "/v1/responses", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 405);
    hc_resp_free(&r);
    CHECK(hc_request_unix(d.sock, "POST", "/v1/models", "{}", &r, 5000) == 0);
    CHECK_EQ(r.status, 405);
    hc_resp_free(&r);

    /* Malformed HTTP. */
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, d.sock) == 0);
    CHECK(hc_send(&c, "HELLO THERE\r\n\r\n", 15) == 0);
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK_EQ(r.status, 400);
    hc_resp_free(&r);
    hc_close(&c);

    /* The informational endpoints. */
    CHECK(hc_request_unix(d.sock, "GET", "/v1/models", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    j = json_loads(r.body, 0, NULL);
    CHECK_STREQ(json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id")),
                "tiny-qwen3moe-Q8_0");
    json_decref(j);
    hc_resp_free(&r);
    CHECK(hc_request_unix(d.sock, "GET", "/metrics", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    CHECK(strstr(r.body, "# TYPE moed_requests_total counter"));
    CHECK(strstr(r.body, "moed_queue_depth "));
    CHECK(strstr(r.body, "moed_workers 1"));
    CHECK(strstr(r.body, "moed_expert_routings_total{layer=\"2\",expert=\"15\"}"));
    CHECK(strstr(r.body, "moed_http_responses_total{code=\"4xx\"}"));
    hc_resp_free(&r);

    /* The daemon is still alive and well after all that. */
    CHECK(waitpid(d.pid, NULL, WNOHANG) == 0);
    CHECK_EQ(moed_stop(&d, 20), 0);
    CHECK(access(d.sock, F_OK) != 0);   /* the socket is removed on exit */
}

/* Runs moectl with args as uid (or as ourselves when uid < 0); returns its exit code and its
 * stderr+stdout in out. */
static int run_moectl(const char *sock, uid_t uid, gid_t gid, bool as_other, const char *const *args,
                      char *out, size_t cap)
{
    int pfd[2];
    CHECK(pipe(pfd) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        dup2(pfd[1], 1);
        dup2(pfd[1], 2);
        if (as_other && (setgid(gid) != 0 || setuid(uid) != 0))
            _exit(99);
        const char *argv[16];
        int n = 0;
        argv[n++] = moe_test_bin("moectl");
        argv[n++] = "--socket";
        argv[n++] = sock;
        for (int i = 0; args[i] && n < 15; i++)
            argv[n++] = args[i];
        argv[n] = NULL;
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(pfd[1]);
    size_t n = 0;
    ssize_t k;
    while ((k = read(pfd[0], out + n, cap - 1 - n)) > 0)
        n += (size_t)k;
    out[n] = 0;
    close(pfd[0]);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(daemon_admin_access)
{
    /* A world-traversable directory, so that another uid can reach the socket once we open it up. */
    char dir[] = "/tmp/moe-admin-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    chmod(dir, 0755);
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--listen", "127.0.0.1:0",
                          "--admin-group", "moe-test-no-such-group", "--api-key-file",
                          api_key_file(dir), NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    moed_require_ready(&d, 60); /* /admin/placement lists the workers once they are started */

    /* Over the Unix socket as ourselves (the daemon's own uid): allowed. */
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/admin/status", NULL, &r, 5000) == 0);
    CHECK_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    json_t *j = json_loads(r.body, 0, NULL);
    CHECK_STREQ(json_string_value(json_object_get(json_object_get(j, "model"), "arch")), "qwen3moe");
    CHECK(json_is_array(json_object_get(j, "workers")));
    /* The scheduler's measure of each worker (0: nothing decoded yet). */
    CHECK(json_is_number(json_object_get(json_array_get(json_object_get(j, "workers"), 0),
                                         "sequence_tokens_per_second")));
    json_decref(j);
    hc_resp_free(&r);
    CHECK(hc_request_unix(d.sock, "GET", "/admin/profile", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    CHECK(strstr(r.body, "\"counts\""));
    hc_resp_free(&r);
    CHECK(hc_request_unix(d.sock, "GET", "/admin/placement", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    j = json_loads(r.body, 0, NULL);
    /* Every worker is listed with what it holds; CPU workers offload nothing. */
    json_t *pw = json_object_get(j, "workers");
    CHECK(json_is_array(pw) && json_array_size(pw) >= 1);
    CHECK(json_is_false(json_object_get(json_array_get(pw, 0), "offload")));
    CHECK_STREQ(json_string_value(json_object_get(json_array_get(pw, 0), "device")), test_device());
    /* The held-out drift check is reported (it only scores when a GPU worker offloads). */
    json_t *dr = json_object_get(j, "drift");
    CHECK(json_is_object(dr) && json_integer_value(json_object_get(dr, "window_tokens")) == 4096);
    CHECK(json_is_false(json_object_get(dr, "drifting")));
    json_decref(j);
    hc_resp_free(&r);
    CHECK(hc_request_unix(d.sock, "POST", "/admin/placement", "{}", &r, 5000) == 0);
    CHECK_EQ(r.status, 405);
    hc_resp_free(&r);
    CHECK(hc_request_unix(d.sock, "PUT", "/admin/profile", "{\"counts\": 5}", &r, 5000) == 0);
    CHECK_MSG(r.status == 400, "status %d: %s", r.status, r.body);
    hc_resp_free(&r);

    /* Over TCP: always refused, even for root. The kernel picked the port; the log names it. */
    int port = moed_tcp_port(&d);
    CHECK(port > 0);
    {
        struct hc_conn c;
        CHECK(hc_connect_tcp(&c, port) == 0);
        const char *q = "GET /admin/status HTTP/1.1\r\nAuthorization: Bearer " TEST_API_KEY "\r\n\r\n";
        CHECK(hc_send(&c, q, strlen(q)) == 0);
        CHECK(hc_read(&c, &r, 5000) == 0);
        CHECK_EQ(r.status, 403);
        CHECK(strstr(r.body, "only served on the Unix socket"));
        hc_resp_free(&r);
        /* The public endpoints work over TCP, with the key. */
        const char *q2 = "GET /v1/models HTTP/1.1\r\nAuthorization: Bearer " TEST_API_KEY "\r\n\r\n";
        CHECK(hc_send(&c, q2, strlen(q2)) == 0);
        CHECK(hc_read(&c, &r, 5000) == 0);
        CHECK_EQ(r.status, 200);
        hc_resp_free(&r);
        hc_close(&c);
    }

    /* Another uid over the Unix socket: 403 (and moectl exits 4). */
    if (geteuid() == 0) {
        struct passwd *pw = getpwnam("nobody");
        CHECK(pw != NULL);
        chmod(d.sock, 0666);
        char out[4096];
        const char *st_args[] = {"status", NULL};
        int rc = run_moectl(d.sock, pw->pw_uid, pw->pw_gid, true, st_args, out, sizeof out);
        CHECK_MSG(rc == 4, "moectl as nobody: exit %d: %s", rc, out);
        CHECK_MSG(strstr(out, "access denied") != NULL, "%s", out);
        const char *pr_args[] = {"profile", "reset", NULL};
        rc = run_moectl(d.sock, pw->pw_uid, pw->pw_gid, true, pr_args, out, sizeof out);
        CHECK_EQ(rc, 4);
        /* Non-admin endpoints stay open to them. */
        pid_t pid = fork();
        if (pid == 0) {
            if (setgid(pw->pw_gid) != 0 || setuid(pw->pw_uid) != 0)
                _exit(99);
            struct hc_resp rr;
            if (hc_request_unix(d.sock, "GET", "/v1/models", NULL, &rr, 5000) != 0)
                _exit(3);
            _exit(rr.status == 200 ? 0 : 4);
        }
        int st;
        waitpid(pid, &st, 0);
        CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "nobody GET /v1/models: %d", st);
        /* And as ourselves moectl works. */
        rc = run_moectl(d.sock, 0, 0, false, st_args, out, sizeof out);
        CHECK_MSG(rc == 0, "moectl status: exit %d: %s", rc, out);
        CHECK(strstr(out, "tiny-qwen3moe-Q8_0") != NULL);
    }
    CHECK_EQ(moed_stop(&d, 20), 0);
    /* moectl against a daemon that is gone: exit 3 with a clear message. */
    char out[1024];
    const char *st_args[] = {"status", NULL};
    CHECK_EQ(run_moectl(d.sock, 0, 0, false, st_args, out, sizeof out), 3);
    CHECK_MSG(strstr(out, "moed is not running (no socket at ") != NULL, "%s", out);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

TEST(daemon_sigterm_and_stale_socket)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    /* A second daemon on the same socket refuses to start. */
    struct moed d2;
    moed_spawn(&d2, dir, args);
    int st;
    waitpid(d2.pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    CHECK(log_contains(&d2, "already running"));
    /* The first still serves. */
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/v1/models", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    hc_resp_free(&r);
    CHECK_EQ(moed_stop(&d, 20), 0);
    CHECK(access(d.sock, F_OK) != 0);
    /* kill -9 leaves the socket file behind; the next start replaces it. */
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    kill(d.pid, SIGKILL);
    waitpid(d.pid, NULL, 0);
    CHECK(access(d.sock, F_OK) == 0);
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    CHECK_EQ(moed_stop(&d, 20), 0);
}

/* sd_notify: STATUS= while loading, WATCHDOG=1 (WATCHDOG_USEC set), READY=1 once the workers
 * are ready (when they can start here), STOPPING=1 on SIGTERM. The messages are read as they
 * come, as systemd does (a full datagram queue would block the daemon). */
struct notify_reader {
    int fd;
    _Atomic int stop;
    char all[1 << 16];
    size_t n;
};

static void *notify_thread(void *arg)
{
    struct notify_reader *nr = arg;
    while (!nr->stop) {
        struct pollfd pfd = {.fd = nr->fd, .events = POLLIN};
        if (poll(&pfd, 1, 100) <= 0)
            continue;
        char msg[4096];
        ssize_t k = recv(nr->fd, msg, sizeof msg - 1, 0);
        if (k <= 0)
            continue;
        if (nr->n + (size_t)k + 2 < sizeof nr->all) {
            memcpy(nr->all + nr->n, msg, (size_t)k);
            nr->n += (size_t)k;
            nr->all[nr->n++] = '\n';
            nr->all[nr->n] = 0;
        }
    }
    return NULL;
}

TEST(daemon_sd_notify)
{
    const char *dir = moe_test_tmpdir();
    char path[300];
    snprintf(path, sizeof path, "%s/notify.sock", dir);
    static struct notify_reader nr;
    nr.fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    CHECK(nr.fd >= 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    CHECK(strlen(path) < sizeof a.sun_path);
    memcpy(a.sun_path, path, strlen(path) + 1);
    CHECK(bind(nr.fd, (struct sockaddr *)&a, sizeof a) == 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, notify_thread, &nr) == 0);
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", NULL};
    spawn_notify_socket = path;
    moed_spawn(&d, dir, args);
    spawn_notify_socket = NULL;
    moed_wait_socket(&d, 30);
    bool ready = moed_wait_ready(&d, 20);
    usleep(500000);
    CHECK_EQ(moed_stop(&d, 30), 0);
    usleep(200000);
    nr.stop = 1;
    pthread_join(th, NULL);
    close(nr.fd);
    const char *all = nr.all;
    CHECK_MSG(strstr(all, "STATUS=opening ") != NULL, "%s", all);
    CHECK_MSG(strstr(all, "STATUS=loading experts") != NULL, "%s", all);
    CHECK_MSG(strstr(all, "WATCHDOG=1") != NULL, "%s", all);
    CHECK_MSG(strstr(all, "STOPPING=1") != NULL, "%s", all);
    CHECK_MSG(!ready || strstr(all, "READY=1") != NULL, "%s", all);
    /* READY=1 must not come before the workers are ready. */
    CHECK_MSG(ready || strstr(all, "READY=1") == NULL, "%s", all);
}

/* ---- with workers ---- */

/* The standalone worker's greedy output for a prompt file (its --json text). */
static char *worker_text(const char *prompt_file, int n)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s --model %s --prompt-file %s -n %d --temp 0 --json 2>/dev/null",
             moe_test_bin("moed-worker"), MODEL, prompt_file, n);
    int status;
    char *buf = moe_test_run_shell(cmd, &status);
    CHECK(status == 0);
    json_t *j = json_loads(buf, 0, NULL);
    CHECK_MSG(j != NULL, "moed-worker --json: %s", buf);
    char *text = strdup(json_string_value(json_object_get(j, "text")));
    json_decref(j);
    free(buf);
    return text;
}

struct client_job {
    const char *sock;
    char *body;
    char *text;        /* result */
    int status;
    int n_gen;
};

static void *client_thread(void *arg)
{
    struct client_job *j = arg;
    struct hc_resp r;
    if (hc_request_unix(j->sock, "POST", "/v1/completions", j->body, &r, 120000) != 0) {
        j->status = -1;
        return NULL;
    }
    j->status = r.status;
    json_t *o = json_loads(r.body ? r.body : "", 0, NULL);
    json_t *t = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "text");
    j->text = json_is_string(t) ? strdup(json_string_value(t)) : NULL;
    j->n_gen = (int)json_integer_value(json_object_get(json_object_get(o, "usage"), "completion_tokens"));
    json_decref(o);
    hc_resp_free(&r);
    return NULL;
}

static char *completion_body(const char *prompt, int n, bool stream)
{
    json_t *o = json_pack("{s:s, s:i, s:f, s:b}", "prompt", prompt, "max_tokens", n, "temperature", 0.0,
                          "stream", stream);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* Connects to sock and sends POST path with body, without waiting for the answer. */
static void start_post(struct hc_conn *c, const char *sock, const char *path, const char *body)
{
    CHECK(hc_connect_unix(c, sock) == 0);
    char head[256];
    int hn = snprintf(head, sizeof head, "POST %s HTTP/1.1\r\nContent-Length: %zu\r\n\r\n", path,
                      strlen(body));
    CHECK(hc_send(c, head, (size_t)hn) == 0);
    CHECK(hc_send(c, body, strlen(body)) == 0);
}

/* Connects to sock and sends a streaming greedy completion of n tokens for prompt. */
static void start_stream(struct hc_conn *c, const char *sock, const char *prompt, int n)
{
    char *body = completion_body(prompt, n, true);
    start_post(c, sock, "/v1/completions", body);
    free(body);
}

TEST_TIMEOUT(daemon_concurrent_clients_match_worker, 300)
{
    const char *dir = moe_test_tmpdir();
    const char *prompts[3] = {"tests/golden/prompts/p1.txt", "tests/golden/prompts/p2.txt",
                              "tests/golden/prompts/p3.txt"};
    const int n = 16;
    char *want[3], *ptext[3];
    for (int i = 0; i < 3; i++) {
        want[i] = worker_text(prompts[i], n);
        ptext[i] = moe_test_read_file_or_fail(prompts[i], NULL);
    }
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "2", "--parallel", "4", "--threads", "1", NULL};
    moed_start(&d, dir, args);

    struct client_job jobs[8];
    pthread_t th[8];
    for (int i = 0; i < 8; i++) {
        jobs[i] = (struct client_job){.sock = d.sock, .body = completion_body(ptext[i % 3], n, false)};
        CHECK(pthread_create(&th[i], NULL, client_thread, &jobs[i]) == 0);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        CHECK_MSG(jobs[i].status == 200, "client %d: status %d", i, jobs[i].status);
        CHECK_MSG(jobs[i].text && !strcmp(jobs[i].text, want[i % 3]),
                  "client %d: '%s' != worker's '%s'", i, jobs[i].text ? jobs[i].text : "(null)", want[i % 3]);
        free(jobs[i].text);
        free(jobs[i].body);
    }

    /* Streaming: SSE chunks that concatenate to the same text, then [DONE]. */
    char *body = completion_body(ptext[0], n, true);
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "POST", "/v1/completions", body, &r, 60000) == 0);
    free(body);
    CHECK_EQ(r.status, 200);
    char ct[64];
    CHECK(hc_header(&r, "content-type", ct, sizeof ct) && !strcmp(ct, "text/event-stream"));
    char *text = calloc(1, r.body_len + 1);
    int events = 0;
    bool done = false;
    const char *finish = NULL;
    for (char *line = strtok(r.body, "\n"); line; line = strtok(NULL, "\n")) {
        CHECK_MSG(!strncmp(line, "data: ", 6), "not an SSE data line: %s", line);
        CHECK(!done);
        if (!strcmp(line + 6, "[DONE]")) {
            done = true;
            continue;
        }
        json_t *o = json_loads(line + 6, 0, NULL);
        CHECK(o != NULL);
        CHECK_STREQ(json_string_value(json_object_get(o, "object")), "text_completion");
        json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        strcat(text, json_string_value(json_object_get(ch, "text")));
        if (json_is_string(json_object_get(ch, "finish_reason")))
            finish = strdup(json_string_value(json_object_get(ch, "finish_reason")));
        json_decref(o);
        events++;
    }
    CHECK(done);
    CHECK(events >= 2);
    CHECK_STREQ(text, want[0]);
    CHECK(finish != NULL);
    hc_resp_free(&r);
    free(text);

    /* A stop string cuts the text before it (and is not included). */
    /* Two printable ASCII bytes from the middle of the expected text (not a UTF-8 fragment). */
    size_t si = 3;
    while (want[0][si] && want[0][si + 1] &&
           !(want[0][si] >= 0x20 && want[0][si] < 0x7f && want[0][si + 1] >= 0x20 && want[0][si + 1] < 0x7f))
        si++;
    if (want[0][si] && want[0][si + 1]) {
        char stop[4];
        memcpy(stop, want[0] + si, 2);
        stop[2] = 0;
        json_t *o = json_pack("{s:s, s:i, s:f, s:[s]}", "prompt", ptext[0], "max_tokens", n,
                              "temperature", 0.0, "stop", stop);
        char *b = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        int status;
        json_t *res = post_json(d.sock, "/v1/completions", b, &status);
        free(b);
        CHECK_EQ(status, 200);
        const char *got = json_string_value(json_object_get(json_array_get(json_object_get(res, "choices"), 0), "text"));
        char *at = strstr(want[0], stop);
        CHECK(at != NULL);
        CHECK_EQ(strlen(got), (size_t)(at - want[0]));
        CHECK(!strncmp(got, want[0], strlen(got)));
        CHECK_STREQ(json_string_value(json_object_get(json_array_get(json_object_get(res, "choices"), 0), "finish_reason")), "stop");
        json_decref(res);
    }

    /* moectl generate streams the same text. */
    {
        char out[65536];
        const char *gen_args[] = {"generate", "-n", "16", "--temp", "0", ptext[0], NULL};
        int rc = run_moectl(d.sock, 0, 0, false, gen_args, out, sizeof out);
        CHECK_MSG(rc == 0, "moectl generate: exit %d: %s", rc, out);
        size_t wl = strlen(want[0]);
        CHECK_MSG(strlen(out) == wl + 1 && !strncmp(out, want[0], wl) && out[wl] == '\n',
                  "moectl generate printed '%s', want '%s'", out, want[0]);
        /* moectl chat: one line in, the reply out. */
        const char *chat_args[] = {"chat", "-n", "4", "--temp", "0", NULL};
        int pin[2];
        CHECK(pipe(pin) == 0);
        CHECK(write(pin[1], "Hello\n", 6) == 6);
        close(pin[1]);
        int saved = dup(0);
        dup2(pin[0], 0);
        close(pin[0]);
        rc = run_moectl(d.sock, 0, 0, false, chat_args, out, sizeof out);
        dup2(saved, 0);
        close(saved);
        CHECK_MSG(rc == 0, "moectl chat: exit %d: %s", rc, out);
    }

    /* Chat: a ChatML prompt and usage counts. */
    int status;
    json_t *res = post_json(d.sock, "/v1/chat/completions",
                            "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 5, \"temperature\": 0}",
                            &status);
    CHECK_MSG(status == 200, "%s", err_msg(res));
    json_t *u = json_object_get(res, "usage");
    CHECK(json_integer_value(json_object_get(u, "prompt_tokens")) > 3);
    CHECK(json_integer_value(json_object_get(u, "completion_tokens")) <= 5);
    CHECK_EQ(json_integer_value(json_object_get(u, "total_tokens")),
             json_integer_value(json_object_get(u, "prompt_tokens")) +
                 json_integer_value(json_object_get(u, "completion_tokens")));
    CHECK_STREQ(json_string_value(json_object_get(json_object_get(json_array_get(json_object_get(res, "choices"), 0), "message"), "role")),
                "assistant");
    json_decref(res);

    CHECK_EQ(moed_stop(&d, 30), 0);
    for (int i = 0; i < 3; i++) {
        free(want[i]);
        free(ptext[i]);
    }
}

/* Disconnecting clients free their slots: after many abandoned streams, requests still run. */
TEST_TIMEOUT(daemon_client_disconnect_frees_slot, 180)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--parallel", "2", "--threads", "1", NULL};
    moed_start(&d, dir, args);
    char *body = completion_body("Once upon a time", 2000, true);
    for (int i = 0; i < 6; i++) {
        struct hc_conn c;
        CHECK(hc_connect_unix(&c, d.sock) == 0);
        char head[256];
        int hn = snprintf(head, sizeof head, "POST /v1/completions HTTP/1.1\r\nContent-Length: %zu\r\n\r\n",
                          strlen(body));
        hc_send(&c, head, (size_t)hn);
        hc_send(&c, body, strlen(body));
        usleep(100000);
        hc_close(&c);
    }
    free(body);
    /* Both slots must be free again: two short requests complete. */
    for (int i = 0; i < 2; i++) {
        int status;
        json_t *res = post_json(d.sock, "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 3, \"temperature\": 0}",
                                &status);
        CHECK_MSG(status == 200, "%s", err_msg(res));
        json_decref(res);
    }
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/metrics", NULL, &r, 5000) == 0);
    /* Abandoned generations would still be running or queued (6 x 2000 tokens). */
    CHECK_MSG(strstr(r.body, "moed_requests_running 0") && strstr(r.body, "moed_queue_depth 0"), "%s",
              r.body);
    CHECK(strstr(r.body, "moed_generations_in_flight 0"));
    hc_resp_free(&r);
    CHECK_EQ(moed_stop(&d, 30), 0);
}

static int worker_pid(const char *sock, int idx)
{
    struct hc_resp r;
    if (hc_request_unix(sock, "GET", "/admin/status", NULL, &r, 5000) != 0)
        return 0;
    json_t *o = json_loads(r.body, 0, NULL);
    hc_resp_free(&r);
    int pid = (int)json_integer_value(json_object_get(json_array_get(json_object_get(o, "workers"), (size_t)idx), "pid"));
    json_decref(o);
    return pid;
}

/* Sends a long streaming generation (POST path with body), kills the only worker once tokens
 * flow and checks that the stream ends with an error event (error_mark) or a finished retry
 * (end_mark), never a hang; then that the worker comes back and serves again. */
static void kill_worker_while_streaming(struct moed *d, const char *path, const char *body,
                                        const char *error_mark, const char *end_mark)
{
    int pid = worker_pid(d->sock, 0);
    CHECK(pid > 0);
    struct hc_conn c;
    start_post(&c, d->sock, path, body);
    /* Wait for a few streamed tokens (they stay in c.buf for hc_read below). */
    for (int tries = 0; tries < 200; tries++) {
        struct pollfd pfd = {.fd = c.fd, .events = POLLIN};
        if (poll(&pfd, 1, 100) > 0) {
            ssize_t k = recv(c.fd, c.buf + c.len, sizeof c.buf - c.len - 1, 0);
            CHECK(k > 0);
            c.len += (size_t)k;
            c.buf[c.len] = 0;
        }
        int events = 0;
        for (const char *p = c.buf; (p = strstr(p, "data: ")) != NULL; p += 6)
            events++;
        if (events >= 6)
            break;
    }
    CHECK_MSG(strstr(c.buf, "data: {") != NULL, "no tokens streamed");
    CHECK(strstr(c.buf, end_mark) == NULL);
    CHECK(kill(pid, SIGKILL) == 0);
    struct hc_resp r;
    int rc = hc_read(&c, &r, 60000);
    hc_close(&c);
    CHECK_MSG(rc == 0 || rc == -ECONNRESET, "read: %d", rc);
    CHECK_EQ(r.status, 200);
    CHECK_MSG(r.body && (strstr(r.body, error_mark) || strstr(r.body, end_mark)), "body end: %s",
              r.body ? r.body + (r.body_len > 300 ? r.body_len - 300 : 0) : "");
    hc_resp_free(&r);
    CHECK(moed_wait_ready(d, 60));
    int pid2 = worker_pid(d->sock, 0);
    CHECK(pid2 > 0 && pid2 != pid);
    int status;
    json_t *res = post_json(d->sock, "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 4, \"temperature\": 0}",
                            &status);
    CHECK_MSG(status == 200, "%s", err_msg(res));
    json_decref(res);
}

TEST_TIMEOUT(daemon_worker_killed_during_generation, 240)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--threads", "1", NULL};
    moed_start(&d, dir, args);
    char *body = completion_body("The history of the world", 3000, true);
    kill_worker_while_streaming(&d, "/v1/completions", body, "\"error\"", "data: [DONE]");
    free(body);
    /* A Responses stream: an error event and response.failed (or the retry's final Response). */
    kill_worker_while_streaming(&d, "/v1/responses",
                                "{\"input\": \"The history of the world\", \"max_output_tokens\": 3000, "
                                "\"temperature\": 0, \"stream\": true}",
                                "event: response.failed", "\"usage\":{\"input_tokens\"");
    CHECK_EQ(moed_stop(&d, 30), 0);
}

static long long profile_tokens(const char *sock)
{
    struct hc_resp r;
    if (hc_request_unix(sock, "GET", "/admin/profile", NULL, &r, 5000) != 0 || r.status != 200)
        return -1;
    json_t *o = json_loads(r.body, 0, NULL);
    long long t = json_integer_value(json_object_get(o, "tokens"));
    json_decref(o);
    hc_resp_free(&r);
    return t;
}

/* Whether process pid has a file descriptor open on a path ending in suffix. */
static bool has_fd_on(pid_t pid, const char *suffix)
{
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
    DIR *dp = opendir(dir);
    bool found = false;
    for (struct dirent *e; dp && !found && (e = readdir(dp)) != NULL;) {
        char link[320], target[PATH_MAX];
        snprintf(link, sizeof link, "%s/%s", dir, e->d_name);
        ssize_t k = readlink(link, target, sizeof target - 1);
        if (k <= 0)
            continue;
        target[k] = 0;
        size_t n = strlen(target), m = strlen(suffix);
        found = n >= m && strcmp(target + n - m, suffix) == 0;
    }
    if (dp)
        closedir(dp);
    return found;
}

/* The pid of worker 0 (from /admin/status), waiting up to 10 s for it to exist; 0 if none. */
static pid_t worker0_pid(const char *sock)
{
    for (int i = 0; i < 200; i++) {
        struct hc_resp r;
        if (hc_request_unix(sock, "GET", "/admin/status", NULL, &r, 5000) == 0) {
            json_t *o = json_loads(r.body ? r.body : "", 0, NULL);
            hc_resp_free(&r);
            json_t *w = json_array_get(json_object_get(o, "workers"), 0);
            pid_t pid = w ? (pid_t)json_integer_value(json_object_get(w, "pid")) : 0;
            json_decref(o);
            if (pid > 0)
                return pid;
        }
        usleep(50000);
    }
    return 0;
}

static void check_serves(const char *sock)
{
    struct hc_resp r;
    CHECK_MSG(hc_request_unix(sock, "GET", "/v1/models", NULL, &r, 5000) == 0, "%s does not answer", sock);
    CHECK_EQ(r.status, 200);
    hc_resp_free(&r);
}

/* A second daemon on the state dir of a running one (another socket) exits 1 at once, before
 * opening the model, naming the directory and the running daemon's pid; one on the socket of a
 * running one (another state dir) does too. The first keeps serving and keeps its profile. */
TEST(daemon_second_daemon_on_state_dir_or_socket_fails_fast)
{
    char dir1[512], dir2[512];
    snprintf(dir1, sizeof dir1, "%s/one", moe_test_tmpdir());
    snprintf(dir2, sizeof dir2, "%s/two", moe_test_tmpdir());
    CHECK_EQ(mkdir(dir1, 0700), 0);
    CHECK_EQ(mkdir(dir2, 0700), 0);
    struct moed d, d2;
    const char *args[] = {"--devices", "cpu", "--workers", "1", NULL};
    moed_spawn(&d, dir1, args);
    moed_wait_socket(&d, 30);

    const char *same_state[] = {"--devices", "cpu", "--workers", "1", "--state-dir", d.state, NULL};
    double t0 = moe_test_now();
    moed_spawn(&d2, dir2, same_state);
    CHECK_EQ(moed_wait_exit(&d2, 10), 1);
    CHECK_MSG(moe_test_now() - t0 < 5, "took %.1f s", moe_test_now() - t0);
    char needle[512];
    snprintf(needle, sizeof needle, "state dir %s is in use by another moed (pid %d)", d.state, (int)d.pid);
    if (!log_contains(&d2, needle)) {
        dump_log(&d2);
        CHECK_MSG(false, "log lacks '%s'", needle);
    }
    CHECK(!log_contains(&d2, "opening")); /* refused before the model */
    CHECK(access(d2.sock, F_OK) != 0);
    check_serves(d.sock);
    /* The daemon holds the lock; its workers do not inherit it. */
    CHECK(has_fd_on(d.pid, "/state/moed.lock"));
    pid_t wpid = worker0_pid(d.sock);
    CHECK(wpid > 0);
    CHECK(!has_fd_on(wpid, "/state/moed.lock"));

    unlink(d2.log);
    const char *same_socket[] = {"--devices", "cpu", "--workers", "1", "--socket", d.sock, NULL};
    moed_spawn(&d2, dir2, same_socket);
    CHECK_EQ(moed_wait_exit(&d2, 10), 1);
    CHECK(log_contains(&d2, "another process is listening on this socket"));
    CHECK(!log_contains(&d2, "opening"));
    check_serves(d.sock);
    CHECK(profile_tokens(d.sock) >= 0);
    CHECK_EQ(moed_stop(&d, 20), 0);
    CHECK(access(d.sock, F_OK) != 0);

    /* Once the first has stopped, the state dir is free again. */
    moed_spawn(&d2, dir2, same_state);
    moed_wait_socket(&d2, 30);
    CHECK_EQ(moed_stop(&d2, 20), 0);
}

/* A daemon whose socket file was removed and bound again by a newer daemon leaves that socket in
 * place when it stops: the newer one keeps answering on the path. */
TEST(daemon_sigterm_leaves_a_newer_daemons_socket)
{
    char dir1[512], dir2[512];
    snprintf(dir1, sizeof dir1, "%s/old", moe_test_tmpdir());
    snprintf(dir2, sizeof dir2, "%s/new", moe_test_tmpdir());
    CHECK_EQ(mkdir(dir1, 0700), 0);
    CHECK_EQ(mkdir(dir2, 0700), 0);
    struct moed old, new;
    const char *args[] = {"--devices", "cpu", "--workers", "1", NULL};
    moed_spawn(&old, dir1, args);
    moed_wait_socket(&old, 30);
    CHECK_EQ(unlink(old.sock), 0);
    const char *args2[] = {"--devices", "cpu", "--workers", "1", "--socket", old.sock, NULL};
    moed_spawn(&new, dir2, args2);
    snprintf(new.sock, sizeof new.sock, "%s", old.sock);
    moed_wait_socket(&new, 30);
    struct stat before, after;
    CHECK_EQ(stat(old.sock, &before), 0);

    CHECK_EQ(moed_stop(&old, 20), 0);
    CHECK_MSG(stat(old.sock, &after) == 0, "the old daemon removed the new daemon's socket");
    CHECK(after.st_ino == before.st_ino && after.st_dev == before.st_dev);
    check_serves(new.sock);
    /* The newer one removes its own socket. */
    CHECK_EQ(moed_stop(&new, 20), 0);
    CHECK(access(new.sock, F_OK) != 0);
}

/* A profile database that cannot be opened for a reason other than damage (here a directory
 * where the file should be) is not moved aside: moed exits 1 naming it. */
TEST(daemon_profile_db_system_error_still_fails)
{
    const char *dir = moe_test_tmpdir();
    char state[512], path[600];
    snprintf(state, sizeof state, "%s/state", dir);
    snprintf(path, sizeof path, "%s/profiles.mdb", state);
    CHECK_EQ(mkdir(state, 0700), 0);
    CHECK_EQ(mkdir(path, 0700), 0);
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", NULL};
    moed_spawn(&d, dir, args);
    CHECK_EQ(moed_wait_exit(&d, 20), 1);
    CHECK(log_contains(&d, "profiles.mdb"));
    CHECK(!log_contains(&d, "damaged"));
    struct stat st;
    CHECK(stat(path, &st) == 0 && S_ISDIR(st.st_mode));
    CHECK(access(d.sock, F_OK) != 0);
}

/* A profiles.mdb of random bytes is moved aside with a warning and the daemon starts with an
 * empty profile, which then learns and is saved as usual. */
TEST_TIMEOUT(daemon_damaged_profile_db_is_moved_aside, 180)
{
    const char *dir = moe_test_tmpdir();
    char state[512], path[600];
    snprintf(state, sizeof state, "%s/state", dir);
    snprintf(path, sizeof path, "%s/profiles.mdb", state);
    CHECK_EQ(mkdir(state, 0700), 0);
    unsigned char junk[12288];
    srand(11);
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (unsigned char)(rand() & 0xff);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    CHECK_EQ(fwrite(junk, 1, sizeof junk, f), sizeof junk);
    fclose(f);

    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--threads", "1", "--profile-interval", "1", NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/health", NULL, &r, 5000) == 0);
    CHECK(r.status == 200 || r.status == 503);
    hc_resp_free(&r);
    char needle[700];
    snprintf(needle, sizeof needle, "profile database in %s is damaged", state);
    CHECK(log_contains(&d, needle));
    CHECK(log_contains(&d, "MDB_INVALID"));
    CHECK(log_contains(&d, "WARN"));
    /* The damaged bytes are kept, under the name the log gives. */
    snprintf(needle, sizeof needle, "moved it to %s/profiles.mdb.corrupt-", state);
    CHECK(log_contains(&d, needle));
    char kept[700] = "";
    {
        FILE *lf = fopen(d.log, "r");
        char line[2048];
        while (lf && fgets(line, sizeof line, lf)) {
            char *p = strstr(line, "moved it to ");
            if (p) {
                p += strlen("moved it to ");
                char *e = strstr(p, " and starting");
                if (e)
                    snprintf(kept, sizeof kept, "%.*s", (int)(e - p), p);
            }
        }
        if (lf)
            fclose(lf);
    }
    f = fopen(kept, "r");
    CHECK_MSG(f != NULL, "no file %s", kept);
    unsigned char back[sizeof junk + 1];
    CHECK_EQ(fread(back, 1, sizeof back, f), sizeof junk);
    fclose(f);
    CHECK(memcmp(back, junk, sizeof junk) == 0);

    /* The new profile starts empty, learns, and survives a restart. */
    CHECK_EQ(profile_tokens(d.sock), 0);
    moed_require_ready(&d, 60);
    int status;
    json_t *res = post_json(d.sock, "/v1/completions",
                            "{\"prompt\": \"In the beginning\", \"max_tokens\": 8, \"temperature\": 0}", &status);
    CHECK_EQ(status, 200);
    json_decref(res);
    long long t1 = 0;
    for (int i = 0; i < 100 && (t1 = profile_tokens(d.sock)) <= 0; i++)
        usleep(100000);
    CHECK_MSG(t1 > 0, "no routing counts after 10 s");
    CHECK_EQ(moed_stop(&d, 30), 0);
    unlink(d.log);
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    CHECK(profile_tokens(d.sock) >= t1);
    CHECK(!log_contains(&d, "damaged"));
    CHECK_EQ(moed_stop(&d, 30), 0);
}

TEST_TIMEOUT(daemon_profile_survives_restart_and_kill9, 300)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--threads", "1", "--profile-interval", "1", NULL};
    moed_start(&d, dir, args);
    CHECK_EQ(profile_tokens(d.sock), 0);
    for (int i = 0; i < 3; i++) {
        int status;
        json_t *res = post_json(d.sock, "/v1/completions",
                                "{\"prompt\": \"In the beginning\", \"max_tokens\": 20, \"temperature\": 0}", &status);
        CHECK_EQ(status, 200);
        json_decref(res);
    }
    /* Routing stats reach the daemon periodically; wait for them. */
    long long t1 = 0;
    for (int i = 0; i < 100 && (t1 = profile_tokens(d.sock)) <= 0; i++)
        usleep(100000);
    CHECK_MSG(t1 > 0, "no routing counts after 10 s");
    /* The same routing shows in /metrics, per layer and expert. */
    {
        struct hc_resp r;
        CHECK(hc_request_unix(d.sock, "GET", "/metrics", NULL, &r, 5000) == 0);
        const char *p = strstr(r.body, "\nmoed_routed_tokens_total ");
        CHECK(p != NULL);
        CHECK(atof(p + 26) > 0);
        /* The scheduler measured the worker's decode rate from the requests' token gaps. */
        const char *sr = strstr(r.body, "\nmoed_worker_sequence_tokens_per_second{worker=\"0\"} ");
        CHECK(sr != NULL);
        CHECK(atof(strchr(sr, '}') + 2) > 0);
        unsigned long long layer0 = 0;
        for (const char *q = r.body; (q = strstr(q, "moed_expert_routings_total{layer=\"0\",")) != NULL; q++) {
            const char *v = strchr(q, '}');
            layer0 += strtoull(v + 2, NULL, 10);
        }
        /* Every counted token chose n_expert_used (4) experts in layer 0. */
        CHECK(layer0 > 0);
        CHECK_EQ(layer0 % 4, 0);
        hc_resp_free(&r);
    }
    /* The same numbers are exported as they would be saved. */
    CHECK_EQ(moed_stop(&d, 30), 0);

    /* SIGTERM saved the profile: a restarted daemon shows at least those counts. */
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    long long t2 = profile_tokens(d.sock);
    CHECK_MSG(t2 >= t1, "after restart: %lld tokens, before: %lld", t2, t1);
    moed_require_ready(&d, 60);
    int status;
    json_t *res = post_json(d.sock, "/v1/completions",
                            "{\"prompt\": \"And God said\", \"max_tokens\": 20, \"temperature\": 0}", &status);
    CHECK_EQ(status, 200);
    json_decref(res);
    long long t3 = 0;
    for (int i = 0; i < 100 && (t3 = profile_tokens(d.sock)) <= t2; i++)
        usleep(100000);
    CHECK(t3 > t2);
    /* Wait until the counts stop changing for longer than the 1 s save interval: then the
     * database holds exactly them. Then kill -9 the daemon. */
    for (int i = 0; i < 10; i++) {
        usleep(2500000);
        long long again = profile_tokens(d.sock);
        if (again == t3)
            break;
        t3 = again;
    }
    kill(d.pid, SIGKILL);
    waitpid(d.pid, NULL, 0);
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    long long t4 = profile_tokens(d.sock);
    CHECK_MSG(t4 >= t2 && t4 <= t3, "after kill -9: %lld (before the kill: %lld, last save >= %lld)", t4, t3, t2);
    CHECK_MSG(t4 == t3, "counts stable for 2.5 s were not all saved: %lld vs %lld", t4, t3);
    CHECK_EQ(moed_stop(&d, 30), 0);
}

/* SIGTERM while a generation streams: the socket goes away at once (no new clients), the running
 * request still ends properly (finished, or an error event when cut at the drain timeout), and
 * the daemon exits 0. */
TEST_TIMEOUT(daemon_sigterm_drains_inflight, 180)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--threads", "1", NULL};
    moed_start(&d, dir, args);
    struct hc_conn c;
    start_stream(&c, d.sock, "Let there be light", 200);
    /* Wait for the first token, then SIGTERM. */
    struct pollfd pfd = {.fd = c.fd, .events = POLLIN};
    CHECK(poll(&pfd, 1, 30000) == 1);
    kill(d.pid, SIGTERM);
    /* New connections are refused right away. */
    bool gone = false;
    for (int i = 0; i < 100 && !gone; i++) {
        struct hc_conn c2;
        gone = hc_connect_unix(&c2, d.sock) != 0;
        if (!gone) {
            hc_close(&c2);
            usleep(20000);
        }
    }
    CHECK(gone);
    struct hc_resp r;
    int rc = hc_read(&c, &r, 60000);
    CHECK_MSG(rc == 0, "read: %d", rc);
    CHECK_EQ(r.status, 200);
    CHECK_MSG(strstr(r.body, "data: [DONE]") || strstr(r.body, "\"error\""), "%s", r.body);
    hc_resp_free(&r);
    hc_close(&c);
    int st;
    double t0 = moe_test_now();
    while (waitpid(d.pid, &st, WNOHANG) != d.pid) {
        CHECK_MSG(moe_test_now() - t0 < 60, "moed did not exit after SIGTERM");
        usleep(20000);
    }
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(log_contains(&d, "SIGTERM: draining"));
}

/* A metric's value from /metrics text (the first line starting with `name `), or -1. */
static double metric_value(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, name, n) && p[n] == ' ')
            return atof(p + n + 1);
    return -1;
}

/* The 4xx line of /metrics (moed_http_responses_total{code="4xx"}), or -1. */
static long metrics_4xx(const char *sock)
{
    struct hc_resp r;
    if (hc_request_unix(sock, "GET", "/metrics", NULL, &r, 5000) != 0)
        return -1;
    long v = r.body ? (long)metric_value(r.body, "moed_http_responses_total{code=\"4xx\"}") : -1;
    hc_resp_free(&r);
    return v;
}

/* A worker that stops answering (SIGSTOP) is noticed by its missing heartbeat, killed and
 * replaced; the request it held is run again instead of hanging. */
TEST_TIMEOUT(daemon_wedged_worker_is_replaced, 180)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--threads", "1", NULL};
    setenv("MOED_WORKER_SILENT_MS", "2000", 1);
    moed_spawn(&d, dir, args);
    unsetenv("MOED_WORKER_SILENT_MS");
    moed_wait_socket(&d, 30);
    moed_require_ready(&d, 60);
    int pid = worker_pid(d.sock, 0);
    CHECK(pid > 0);
    CHECK_EQ(kill(pid, SIGSTOP), 0);
    double t0 = moe_test_now();
    int status;
    char *body = completion_body("In the beginning", 4, false);
    json_t *j = post_json(d.sock, "/v1/completions", body, &status);
    free(body);
    double dt = moe_test_now() - t0;
    CHECK_MSG(status == 200, "status %d: %s", status, err_msg(j));
    json_decref(j);
    CHECK_MSG(dt < 30, "answered after %.1f s", dt);
    CHECK(worker_restarts(d.sock) >= 1);
    CHECK(log_contains(&d, "sent nothing for"));
    CHECK(worker_pid(d.sock, 0) != pid);
    kill(pid, SIGKILL); /* already gone; harmless */
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* A prompt longer than the context could hold even in the longest tokens is refused before it is
 * tokenized: 8 MB of spaces used to hold the event loop (every client) for seconds. */
TEST_TIMEOUT(daemon_huge_prompt_refused_without_tokenizing, 120)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--ctx", "256", "--max-body", "16M",
                          NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    const size_t n = 8u << 20;
    char *body = malloc(n + 64);
    CHECK(body);
    size_t k = (size_t)sprintf(body, "{\"prompt\": \"");
    memset(body + k, ' ', n);
    k += n;
    k += (size_t)sprintf(body + k, "\"}");
    double t0 = moe_test_now();
    int status;
    json_t *j = post_json(d.sock, "/v1/completions", body, &status);
    double dt = moe_test_now() - t0;
    free(body);
    CHECK_EQ(status, 400);
    CHECK_MSG(strstr(err_msg(j), "longer than the context"), "%s", err_msg(j));
    json_decref(j);
    CHECK_MSG(dt < 1.5, "answered after %.2f s", dt);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* A daemon with one CPU worker in a fresh directory, ready to serve (the socket opens before the
 * model is loaded: requests before that get 503). */
static void moed_start_one_cpu(struct moed *d)
{
    const char *args[] = {"--devices", "cpu", "--workers", "1", NULL};
    moed_start(d, moe_test_tmpdir(), args);
}

struct big_post {
    const char *sock, *body;
    int status;
    double seconds;
};

static void *big_post_thread(void *arg)
{
    struct big_post *bp = arg;
    struct hc_resp r;
    double t0 = moe_test_now();
    int st = hc_request_unix(bp->sock, "POST", "/v1/completions", bp->body, &r, 60000) == 0
                 ? r.status
                 : -1;
    bp->seconds = moe_test_now() - t0;
    if (st >= 0)
        hc_resp_free(&r);
    __atomic_store_n(&bp->status, st, __ATOMIC_SEQ_CST);
    return NULL;
}

/* The longest prompt the size check lets through is tokenized off the event loop: while it is,
 * /health answers at once. (Alternating spaces and tabs make one whitespace piece of megabytes
 * that the merge loop takes seconds over; runs of one byte have a shortcut.) */
TEST_TIMEOUT(daemon_tokenizes_off_the_event_loop, 180)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--parallel", "1", "--ctx",
                          "131072", "--max-body", "64M", NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 60);
    moed_require_ready(&d, 60);
    /* Just under what the check refuses: len / max_piece + 0 < n_ctx. */
    struct gguf_file *f = NULL;
    struct moe_tokenizer *tok = NULL;
    char err[256];
    CHECK_MSG(gguf_open(&f, "models/kjv-demo-F16.gguf", err, sizeof err) == 0, "%s", err);
    CHECK_MSG(moe_tok_load(&tok, f, err, sizeof err) == 0, "%s", err);
    const size_t n = (131072 - 8) * moe_tok_max_piece(tok);
    moe_tok_free(tok);
    gguf_close(f);
    char *body = malloc(2 * n + 64);
    CHECK(body);
    size_t k = (size_t)sprintf(body, "{\"prompt\": \"");
    for (size_t i = 0; i < n; i++) {
        if (i % 2) {
            body[k++] = '\\';
            body[k++] = 't';
        } else {
            body[k++] = ' ';
        }
    }
    sprintf(body + k, "\", \"max_tokens\": 1}");
    struct big_post bp = {.sock = d.sock, .body = body, .status = 0};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, big_post_thread, &bp) == 0);
    double worst = 0;
    int polls = 0;
    double t0 = moe_test_now();
    usleep(20000);
    while (moe_test_now() - t0 < 60) {
        struct hc_resp r;
        double a = moe_test_now();
        CHECK(hc_request_unix(d.sock, "GET", "/health", NULL, &r, 30000) == 0);
        double dt = moe_test_now() - a;
        hc_resp_free(&r);
        polls++;
        worst = dt > worst ? dt : worst;
        if (__atomic_load_n(&bp.status, __ATOMIC_SEQ_CST) != 0)
            break;
        usleep(10000);
    }
    pthread_join(th, NULL);
    free(body);
    printf("  %zu bytes of spaces and tabs: answered %d after %.2f s; %d /health polls meanwhile, the "
           "slowest %.3f s\n", n, bp.status, bp.seconds, polls, worst);
    CHECK(bp.status == 200 || bp.status == 400);
    /* Held on the loop, /health would have waited about as long as the tokenizing. */
    CHECK_MSG(worst < 0.5 || worst < 0.5 * bp.seconds, "/health waited %.3f s", worst);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* The connection limits are options: with --max-conns 2 --admin-reserve 0 the third
 * connection to the socket gets 503 while two idle ones are held. */
TEST_TIMEOUT(daemon_connection_limit_options, 120)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--max-conns", "2",
                          "--admin-reserve", "0", "--max-write-queue", "1M", NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    struct hc_conn u[3];
    for (int i = 0; i < 3; i++)
        CHECK(hc_connect_unix(&u[i], d.sock) == 0);
    struct hc_resp r;
    CHECK_EQ(hc_read(&u[2], &r, 5000), 0);
    CHECK_EQ(r.status, 503);
    hc_resp_free(&r);
    const char *req = "GET /health HTTP/1.1\r\n\r\n";
    CHECK(hc_send(&u[0], req, strlen(req)) == 0);
    CHECK_EQ(hc_read(&u[0], &r, 5000), 0);
    CHECK(r.status == 200 || r.status == 503);
    hc_resp_free(&r);
    for (int i = 0; i < 3; i++)
        hc_close(&u[i]);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* llama-server's /tokenize, /detokenize, /apply-template and /props: ids, pieces that spell the
 * text back, the round trip, the rendered chat prompt, the server's properties, and clear 400s
 * and 405s. */
TEST_TIMEOUT(daemon_tokenize_and_detokenize, 120)
{
    struct moed d;
    moed_start_one_cpu(&d);
    int status;
    const char *text = "In the beginning God created the heaven and the earth.";
    char body[512];
    snprintf(body, sizeof body, "{\"content\": \"%s\"}", text);
    json_t *j = post_json(d.sock, "/tokenize", body, &status);
    CHECK_EQ(status, 200);
    json_t *toks = json_object_get(j, "tokens");
    CHECK(json_is_array(toks) && json_array_size(toks) > 3);
    /* Back to the text. */
    char *ids = json_dumps(toks, JSON_COMPACT);
    char *b2 = malloc(strlen(ids) + 32);
    sprintf(b2, "{\"tokens\": %s}", ids);
    json_t *k = post_json(d.sock, "/detokenize", b2, &status);
    CHECK_EQ(status, 200);
    CHECK_STREQ(json_string_value(json_object_get(k, "content")), text);
    json_decref(k);
    free(b2);
    free(ids);
    /* Pieces spell the text. */
    snprintf(body, sizeof body, "{\"content\": \"%s\", \"with_pieces\": true}", text);
    k = post_json(d.sock, "/tokenize", body, &status);
    CHECK_EQ(status, 200);
    char joined[512] = "";
    size_t i;
    json_t *t;
    json_array_foreach(json_object_get(k, "tokens"), i, t) {
        CHECK(json_is_integer(json_object_get(t, "id")));
        CHECK_EQ(json_integer_value(json_object_get(t, "id")),
                 json_integer_value(json_array_get(toks, i)));
        strncat(joined, json_string_value(json_object_get(t, "piece")),
                sizeof joined - strlen(joined) - 1);
    }
    CHECK_STREQ(joined, text);
    json_decref(k);
    json_decref(j);
    /* Special tokens are parsed unless parse_special is false. */
    j = post_json(d.sock, "/tokenize", "{\"content\": \"<|im_start|>\"}", &status);
    CHECK_EQ(status, 200);
    const size_t n_special = json_array_size(json_object_get(j, "tokens"));
    json_decref(j);
    j = post_json(d.sock, "/tokenize",
                  "{\"content\": \"<|im_start|>\", \"parse_special\": false}", &status);
    CHECK_EQ(status, 200);
    CHECK(json_array_size(json_object_get(j, "tokens")) > n_special);
    json_decref(j);
    static const struct {
        const char *path, *body, *needle;
    } bad[] = {
        {"/tokenize", "{}", "content"},
        {"/tokenize", "{\"content\": 5}", "content"},
        {"/tokenize", "{\"content\": \"x\", \"add_special\": 1}", "add_special"},
        {"/tokenize", "[1]", "JSON object"},
        {"/tokenize", "{\"content\"", "not valid JSON"},
        {"/detokenize", "{\"tokens\": [1, -1]}", "tokens[1]"},
        {"/detokenize", "{\"tokens\": [99999999]}", "tokens[0]"},
        {"/detokenize", "{\"tokens\": \"12\"}", "array"},
    };
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        j = post_json(d.sock, bad[b].path, bad[b].body, &status);
        CHECK_MSG(status == 400, "%s %s: %d", bad[b].path, bad[b].body, status);
        CHECK_MSG(strstr(err_msg(j), bad[b].needle), "%s", err_msg(j));
        json_decref(j);
    }
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/tokenize", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 405);
    hc_resp_free(&r);
    /* /apply-template: the text a chat request is tokenized from. */
    j = post_json(d.sock, "/apply-template",
                  "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
                  "{\"role\": \"user\", \"content\": \"Who made the earth?\"}]}",
                  &status);
    CHECK_MSG(status == 200, "%d %s", status, err_msg(j));
    CHECK_STREQ(json_string_value(json_object_get(j, "prompt")),
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho made the "
                "earth?<|im_end|>\n<|im_start|>assistant\n");
    json_decref(j);
    j = post_json(d.sock, "/apply-template", "{\"messages\": []}", &status);
    CHECK_EQ(status, 400);
    CHECK(strstr(err_msg(j), "messages"));
    json_decref(j);
    /* /props: the context, the slots (one worker, 4 sequences), the template, the version. */
    CHECK(hc_request_unix(d.sock, "GET", "/props", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    j = json_loads(r.body, 0, NULL);
    hc_resp_free(&r);
    CHECK_EQ(json_integer_value(json_object_get(j, "total_slots")), 4);
    CHECK(json_integer_value(json_object_get(json_object_get(j, "default_generation_settings"),
                                             "n_ctx")) > 0);
    CHECK(strstr(json_string_value(json_object_get(j, "chat_template")), "im_start"));
    CHECK(!strncmp(json_string_value(json_object_get(j, "build_info")), "moed ", 5));
    json_decref(j);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* A generation whose first token ends it (logit_bias pushes the end-of-generation tokens): the
 * completion with echo is the prompt alone, the chat answer is empty, streamed or not; with
 * ignore_eos, the same requests run to max_tokens. */
TEST_TIMEOUT(daemon_generation_that_ends_at_once, 120)
{
    struct moed d;
    moed_start_one_cpu(&d);
    int status;
    char bias[256] = "";
    const char *eog[] = {"<|endoftext|>", "<|im_end|>"};
    for (size_t i = 0; i < 2; i++) {
        char body[128];
        snprintf(body, sizeof body, "{\"content\": \"%s\"}", eog[i]);
        json_t *j = post_json(d.sock, "/tokenize", body, &status);
        CHECK_EQ(status, 200);
        json_t *toks = json_object_get(j, "tokens");
        CHECK_MSG(json_array_size(toks) == 1, "%s is not one token", eog[i]);
        size_t l = strlen(bias);
        snprintf(bias + l, sizeof bias - l, "%s\"%lld\": 100", i ? ", " : "",
                 (long long)json_integer_value(json_array_get(toks, 0)));
        json_decref(j);
    }
    char body[512];
    snprintf(body, sizeof body, "{\"prompt\": \"In the beginning\", \"echo\": true, \"max_tokens\": 4, "
             "\"temperature\": 0, \"logit_bias\": {%s}}", bias);
    json_t *j = post_json(d.sock, "/v1/completions", body, &status);
    CHECK_MSG(status == 200, "%d %s", status, err_msg(j));
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    CHECK_STREQ(json_string_value(json_object_get(ch, "text")), "In the beginning");
    CHECK_STREQ(json_string_value(json_object_get(ch, "finish_reason")), "stop");
    json_decref(j);
    for (int stream = 0; stream < 2; stream++) {
        snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
                 "\"max_tokens\": 4, \"temperature\": 0, \"stream\": %s, \"logit_bias\": {%s}}",
                 stream ? "true" : "false", bias);
        struct hc_resp r;
        CHECK(hc_request_unix(d.sock, "POST", "/v1/chat/completions", body, &r, 60000) == 0);
        CHECK_MSG(r.status == 200, "%d %s", r.status, r.body);
        if (stream) {
            CHECK_MSG(strstr(r.body, "\"finish_reason\":\"stop\"") && strstr(r.body, "data: [DONE]"),
                      "%s", r.body);
        } else {
            j = json_loads(r.body, 0, NULL);
            ch = json_array_get(json_object_get(j, "choices"), 0);
            CHECK_STREQ(json_string_value(json_object_get(json_object_get(ch, "message"), "content")), "");
            CHECK_STREQ(json_string_value(json_object_get(ch, "finish_reason")), "stop");
            json_decref(j);
        }
        hc_resp_free(&r);
    }
    /* ignore_eos: the same biases are overridden (the end-of-generation tokens banned), and the
     * generation runs to max_tokens: the completion is the plain greedy one (which does not end
     * in 5 tokens). */
    j = post_json(d.sock, "/v1/completions", "{\"prompt\": \"In the beginning\", \"max_tokens\": 5, "
                  "\"temperature\": 0}", &status);
    CHECK_MSG(status == 200, "%d %s", status, err_msg(j));
    ch = json_array_get(json_object_get(j, "choices"), 0);
    CHECK_STREQ(json_string_value(json_object_get(ch, "finish_reason")), "length");
    char *plain = strdup(json_string_value(json_object_get(ch, "text")));
    CHECK(plain && *plain);
    json_decref(j);
    for (int chat = 0; chat < 2; chat++) {
        if (chat)
            snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": "
                     "\"Hi\"}], \"max_tokens\": 5, \"temperature\": 0, \"ignore_eos\": true, "
                     "\"logit_bias\": {%s}}", bias);
        else
            snprintf(body, sizeof body, "{\"prompt\": \"In the beginning\", \"max_tokens\": 5, "
                     "\"temperature\": 0, \"ignore_eos\": true, \"logit_bias\": {%s}}", bias);
        j = post_json(d.sock, chat ? "/v1/chat/completions" : "/v1/completions", body, &status);
        CHECK_MSG(status == 200, "%d %s", status, err_msg(j));
        ch = json_array_get(json_object_get(j, "choices"), 0);
        CHECK_STREQ(json_string_value(json_object_get(ch, "finish_reason")), "length");
        CHECK_EQ(json_integer_value(json_object_get(json_object_get(j, "usage"),
                                                    "completion_tokens")), 5);
        if (!chat)
            CHECK_STREQ(json_string_value(json_object_get(ch, "text")), plain);
        json_decref(j);
    }
    free(plain);
    j = post_json(d.sock, "/v1/completions", "{\"prompt\": \"hi\", \"ignore_eos\": 1}", &status);
    CHECK_EQ(status, 400);
    CHECK(strstr(err_msg(j), "'ignore_eos' must be a boolean"));
    json_decref(j);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* A completion of token ids at temperature 0; returns its text (malloc'd) and cached tokens. */
static char *complete_ids(const char *sock, const int32_t *ids, size_t n, int64_t *cached)
{
    char *body = malloc(n * 12 + 128), *p = body;
    CHECK(body);
    p += sprintf(p, "{\"prompt\": [");
    for (size_t i = 0; i < n; i++)
        p += sprintf(p, "%s%d", i ? "," : "", ids[i]);
    sprintf(p, "], \"max_tokens\": 16, \"temperature\": 0}");
    int status;
    json_t *j = post_json(sock, "/v1/completions", body, &status);
    free(body);
    CHECK_MSG(status == 200, "%d %s", status, err_msg(j));
    json_t *u = json_object_get(j, "usage");
    CHECK_EQ(json_integer_value(json_object_get(u, "prompt_tokens")), (json_int_t)n);
    *cached = json_integer_value(
        json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens"));
    char *text = strdup(json_string_value(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text")));
    json_decref(j);
    return text;
}

/* Prefix reuse: a prompt that starts with what a slot already holds continues from there
 * (usage.prompt_tokens_details.cached_tokens says how many), and the completion is the one a
 * fresh slot gives. */
TEST_TIMEOUT(daemon_reuses_a_cached_prefix, 120)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--parallel", "1", NULL};
    moed_start(&d, dir, args);
    enum { NA = 40, NB = 60 };
    int32_t ids[NB];
    for (int i = 0; i < NB; i++)
        ids[i] = 100 + (i * 37) % 3000;
    int64_t cached;
    /* Fresh: the reference for the long prompt. */
    char *ref = complete_ids(d.sock, ids, NB, &cached);
    CHECK_EQ(cached, 0);
    /* The same prompt again: all but its last token come from the slot. */
    char *again = complete_ids(d.sock, ids, NB, &cached);
    CHECK_EQ(cached, NB - 1);
    CHECK_STREQ(again, ref);
    /* A prefix of it, then the long one: the prefix is shared. */
    char *shorter = complete_ids(d.sock, ids, NA, &cached);
    CHECK_EQ(cached, NA - 1);
    char *third = complete_ids(d.sock, ids, NB, &cached);
    CHECK_MSG(cached >= NA && cached < NB, "cached %lld", (long long)cached);
    CHECK_STREQ(third, ref);
    /* An unrelated prompt starts over. */
    int32_t other[8] = {7, 8, 9, 10, 11, 12, 13, 14};
    char *o = complete_ids(d.sock, other, 8, &cached);
    CHECK_EQ(cached, 0);
    free(ref), free(again), free(shorter), free(third), free(o);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* With two workers, a request goes to the worker that holds its prefix: two conversations in
 * any order each keep finding their own cache. */
TEST_TIMEOUT(daemon_routes_to_the_worker_with_the_prefix, 120)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "2", "--parallel", "1", "--threads",
                          "1", NULL};
    moed_start(&d, dir, args);
    enum { N = 70 };
    int32_t a[N], b[N];
    for (int i = 0; i < N; i++) {
        a[i] = 100 + (i * 37) % 3000;
        b[i] = 200 + (i * 53) % 3000;
    }
    int64_t cached;
    char *ra = complete_ids(d.sock, a, N, &cached);
    CHECK_EQ(cached, 0);
    char *rb = complete_ids(d.sock, b, N, &cached);
    CHECK_EQ(cached, 0); /* the other worker: nothing of b anywhere */
    /* Not alternating: a worker picked by turns alone would evict the other conversation. */
    static const char order[] = "bbaabab";
    for (int i = 0; order[i]; i++) {
        const bool is_a = order[i] == 'a';
        char *x = complete_ids(d.sock, is_a ? a : b, N, &cached);
        CHECK_MSG(cached == N - 1, "request %d (%c): cached %lld", i, order[i], (long long)cached);
        CHECK_STREQ(x, is_a ? ra : rb);
        free(x);
    }
    free(ra);
    free(rb);
    CHECK_EQ(moed_stop(&d, 60), 0);
}


/* GET path on the daemon's socket as JSON (status 200). */
static json_t *get_json(const char *sock, const char *path)
{
    struct hc_resp r;
    CHECK(hc_request_unix(sock, "GET", path, NULL, &r, 5000) == 0);
    CHECK_MSG(r.status == 200, "%s: %d", path, r.status);
    json_t *j = json_loads(r.body, 0, NULL);
    CHECK(j);
    hc_resp_free(&r);
    return j;
}

static double metric_value(const char *text, const char *name);

/* Routing signatures (--route-signatures on, CPU workers): each Done carries its request's, the
 * daemon's workload table learns the keys (the prompt's first 32 tokens) of finished requests,
 * and /admin/placement and /metrics show them; CPU workers pin nothing, so the hot sets stay
 * identical, and a prompt shorter than a key teaches nothing. Without the option (auto, no GPU
 * worker) nothing is learned. */
TEST_TIMEOUT(daemon_learns_workloads_from_route_signatures, 120)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "2", "--parallel", "2", "--threads",
                          "1", "--route-signatures", "on", NULL};
    moed_start(&d, dir, args);
    enum { N = 44 };
    int32_t a[N], b[N], tiny[6] = {5, 6, 7, 8, 9, 10};
    for (int i = 0; i < N; i++) {
        a[i] = 100 + (i * 37) % 3000;
        b[i] = 200 + (i * 53) % 3000;
    }
    int64_t cached;
    for (int r = 0; r < 3; r++) {
        a[N - 1] = b[N - 1] = 400 + r; /* same heads, other endings */
        free(complete_ids(d.sock, a, N, &cached));
        free(complete_ids(d.sock, b, N, &cached));
    }
    free(complete_ids(d.sock, tiny, 6, &cached));
    json_t *j = get_json(d.sock, "/admin/placement");
    json_t *wl = json_object_get(j, "workloads");
    CHECK_EQ(json_integer_value(json_object_get(wl, "keys")), 2);
    CHECK_EQ(json_integer_value(json_object_get(wl, "requests")), 6);
    CHECK_EQ(json_integer_value(json_object_get(wl, "key_tokens")), 32);
    size_t i;
    json_t *e;
    double shares = 0;
    json_array_foreach(json_object_get(wl, "entries"), i, e) {
        CHECK_EQ(strlen(json_string_value(json_object_get(e, "key"))), 16);
        CHECK_EQ(json_integer_value(json_object_get(e, "requests")), 3);
        /* The first of each evaluated its whole prompt; the others continued from it. */
        CHECK(json_integer_value(json_object_get(e, "prompt_tokens")) >= N + 2);
        CHECK_EQ(json_array_size(json_object_get(e, "served")), 2);
        CHECK(json_is_null(json_array_get(json_object_get(e, "coverage"), 0)));
        shares += json_number_value(json_object_get(e, "traffic_share"));
    }
    CHECK_NEAR(shares, 1.0, 1e-9);
    json_t *c = json_object_get(j, "complementary");
    CHECK(json_is_false(json_object_get(c, "active")));
    CHECK(strstr(json_string_value(json_object_get(c, "why")), "GPU worker"));
    CHECK(json_is_null(json_object_get(json_array_get(json_object_get(j, "workers"), 0),
                                       "hot_experts")));
    json_decref(j);
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/metrics", NULL, &r, 5000) == 0);
    CHECK_EQ(metric_value(r.body, "moed_workload_keys"), 2);
    CHECK_EQ(metric_value(r.body, "moed_workload_requests_total"), 6);
    CHECK_EQ(metric_value(r.body, "moed_placement_complementary"), 0);
    hc_resp_free(&r);
    CHECK_EQ(moed_stop(&d, 60), 0);

    const char *plain[] = {"--devices", "cpu", "--workers", "1", NULL};
    moed_start(&d, moe_test_tmpdir(), plain);
    free(complete_ids(d.sock, a, N, &cached));
    j = get_json(d.sock, "/admin/placement");
    CHECK_EQ(json_integer_value(json_object_get(json_object_get(j, "workloads"), "requests")), 0);
    json_decref(j);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* Time to first token and inter-token latency are Prometheus histograms: one TTFT observation
 * per generation, one ITL per token after the first, cumulative buckets ending at the count. */
TEST_TIMEOUT(daemon_latency_histograms, 120)
{
    struct moed d;
    moed_start_one_cpu(&d);
    int32_t ids[20];
    for (int i = 0; i < 20; i++)
        ids[i] = 300 + i * 11;
    int64_t cached;
    for (int k = 0; k < 3; k++) {
        ids[0] = 300 + k; /* three different prompts */
        free(complete_ids(d.sock, ids, 20, &cached));
    }
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/metrics", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    const double gen = metric_value(r.body, "moed_generated_tokens_total");
    CHECK_EQ(metric_value(r.body, "moed_time_to_first_token_seconds_count"), 3);
    CHECK_EQ(metric_value(r.body, "moed_inter_token_latency_seconds_count"), gen - 3);
    CHECK(metric_value(r.body, "moed_time_to_first_token_seconds_sum") > 0);
    CHECK(strstr(r.body, "# TYPE moed_time_to_first_token_seconds histogram"));
    CHECK_EQ(metric_value(r.body, "moed_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 3);
    /* Cumulative: never decreasing. */
    double prev = 0;
    for (const char *p = strstr(r.body, "moed_inter_token_latency_seconds_bucket"); p;
         p = strstr(p + 1, "moed_inter_token_latency_seconds_bucket")) {
        double v = atof(strchr(p, ' ') + 1);
        CHECK(v >= prev);
        prev = v;
    }
    CHECK_EQ(prev, gen - 3);
    /* Every family has its HELP right before its TYPE. */
    int families = 0;
    for (const char *p = strstr(r.body, "# TYPE "); p; p = strstr(p + 1, "# TYPE ")) {
        char name[128];
        CHECK(sscanf(p, "# TYPE %127s", name) == 1);
        char help[160];
        snprintf(help, sizeof help, "# HELP %s ", name);
        /* The line before this one. */
        const char *h = p > r.body + 1 ? p - 2 : r.body;
        while (h > r.body && h[-1] != '\n')
            h--;
        CHECK_MSG(!strncmp(h, help, strlen(help)), "no HELP right before the TYPE of %s", name);
        families++;
    }
    CHECK(families > 10);
    hc_resp_free(&r);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* llama-server's fields: n_predict sets the length when no OpenAI name does; sampling controls
 * moed does not have are refused unless neutral, never silently ignored. */
TEST_TIMEOUT(daemon_llama_server_fields, 120)
{
    struct moed d;
    moed_start_one_cpu(&d);
    int status;
    json_t *j = post_json(d.sock, "/v1/completions",
                          "{\"prompt\": \"In the beginning\", \"n_predict\": 3, \"temperature\": 0, "
                          "\"typical_p\": 1, \"mirostat\": 0, \"grammar\": \"\"}", &status);
    CHECK_MSG(status == 200, "%d %s", status, err_msg(j));
    CHECK_EQ(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 3);
    json_decref(j);
    static const char *const bad[][2] = {
        {"\"mirostat\": 2", "mirostat"},     {"\"typical_p\": 0.5", "typical_p"},
        {"\"tfs_z\": 0.9", "tfs_z"},         {"\"dry_multiplier\": 0.8", "dry_multiplier"},
        {"\"xtc_probability\": 0.5", "xtc_probability"},
        {"\"grammar\": \"root ::= [a-z\"", "grammar"}, /* malformed: an open class */
        {"\"json_schema\": {\"type\": \"object\", \"patternProperties\": {}}", "json_schema"},
        {"\"n_probs\": 5", "n_probs"},        {"\"n_predict\": 0", "n_predict"},
        {"\"n_predict\": -2", "n_predict"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char body[256];
        snprintf(body, sizeof body, "{\"prompt\": \"x\", %s}", bad[i][0]);
        j = post_json(d.sock, "/v1/completions", body, &status);
        CHECK_MSG(status == 400, "%s: %d", bad[i][0], status);
        CHECK_STREQ(json_string_value(json_object_get(json_object_get(j, "error"), "param")),
                    bad[i][1]);
        json_decref(j);
    }
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* A chat longer than the context: 400 with the counts, or with "truncation": "auto" the oldest
 * messages are dropped until it fits (the system message stays). */
TEST_TIMEOUT(daemon_chat_truncation, 120)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--ctx", "160", NULL};
    moed_start(&d, dir, args);
    char body[8192], *p = body;
    p += sprintf(p, "{\"max_tokens\": 8, \"temperature\": 0, %%s\"messages\": [{\"role\": "
                    "\"system\", \"content\": \"Answer briefly.\"}");
    for (int i = 0; i < 12; i++)
        p += sprintf(p, ", {\"role\": \"%s\", \"content\": \"%d and the lord spake unto moses "
                        "saying speak unto the children of israel\"}",
                     i % 2 ? "assistant" : "user", i);
    sprintf(p, "]}");
    char req[8400];
    int status;
    snprintf(req, sizeof req, body, "");
    json_t *j = post_json(d.sock, "/v1/chat/completions", req, &status);
    CHECK_EQ(status, 400);
    CHECK_MSG(!strcmp(json_string_value(json_object_get(json_object_get(j, "error"), "code")),
                      "context_length_exceeded"), "%s", err_msg(j));
    json_decref(j);
    snprintf(req, sizeof req, body, "\"truncation\": \"auto\", ");
    j = post_json(d.sock, "/v1/chat/completions", req, &status);
    CHECK_MSG(status == 200, "%d %s", status, err_msg(j));
    const json_int_t np = json_integer_value(json_object_get(json_object_get(j, "usage"),
                                                             "prompt_tokens"));
    CHECK_MSG(np > 20 && np + 8 <= 160, "prompt %lld", (long long)np);
    json_decref(j);
    snprintf(req, sizeof req, body, "\"truncation\": \"sometimes\", ");
    j = post_json(d.sock, "/v1/chat/completions", req, &status);
    CHECK_EQ(status, 400);
    CHECK(strstr(err_msg(j), "truncation"));
    json_decref(j);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* TCP port with the socket's permissions bypassed: --listen needs an API key file, and every TCP
 * request but /health must carry it; the Unix socket needs none. */
TEST_TIMEOUT(daemon_tcp_needs_the_api_key, 120)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    int st;
    const char *bad[] = {"--listen", "127.0.0.1:0", NULL};
    moed_spawn(&d, dir, bad);
    waitpid(d.pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 2);
    CHECK(log_contains(&d, "--listen needs --api-key-file"));
    char shortkey[512];
    snprintf(shortkey, sizeof shortkey, "%s/short.key", dir);
    moe_test_write_file(shortkey, "abc\n", 4);
    const char *bad2[] = {"--listen", "127.0.0.1:0", "--api-key-file", shortkey, NULL};
    moed_spawn(&d, dir, bad2);
    waitpid(d.pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 2);
    CHECK(log_contains(&d, "16..1024 characters"));

    const char *args[] = {"--devices", "cpu", "--workers", "1", "--listen", "127.0.0.1:0",
                          "--api-key-file", api_key_file(dir), NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    int port = moed_tcp_port(&d);
    CHECK(port > 0);
    struct {
        const char *req;
        int status;
    } cases[] = {
        {"GET /v1/models HTTP/1.1\r\n\r\n", 401},
        {"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer wrong-key-0123456789abcdef\r\n\r\n", 401},
        {"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer " TEST_API_KEY "x\r\n\r\n", 401},
        {"GET /metrics HTTP/1.1\r\n\r\n", 401},
        {"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer " TEST_API_KEY "\r\n\r\n", 200},
        {"GET /v1/models HTTP/1.1\r\nauthorization: bearer  " TEST_API_KEY "\r\n\r\n", 200},
        {"GET /health HTTP/1.1\r\n\r\n", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct hc_conn c;
        CHECK(hc_connect_tcp(&c, port) == 0);
        CHECK(hc_send(&c, cases[i].req, strlen(cases[i].req)) == 0);
        struct hc_resp r;
        CHECK(hc_read(&c, &r, 5000) == 0);
        if (cases[i].status)
            CHECK_MSG(r.status == cases[i].status, "case %zu: %d %s", i, r.status, r.body);
        else
            CHECK_MSG(r.status != 401, "case %zu: %d", i, r.status);
        if (cases[i].status == 401)
            CHECK(strstr(r.body, "invalid_api_key"));
        hc_resp_free(&r);
        hc_close(&c);
    }
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/v1/models", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    hc_resp_free(&r);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* Responses the HTTP layer sends itself (a malformed request) are in /metrics too. */
TEST(daemon_metrics_count_malformed_requests)
{
    struct moed d;
    moed_start_one_cpu(&d);
    long before = metrics_4xx(d.sock);
    CHECK(before >= 0);
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, d.sock) == 0);
    CHECK(hc_send(&c, "GARBAGE\r\n\r\n", 11) == 0);
    struct hc_resp r;
    CHECK_EQ(hc_read(&c, &r, 5000), 0);
    CHECK_EQ(r.status, 400);
    hc_resp_free(&r);
    hc_close(&c);
    CHECK_EQ(metrics_4xx(d.sock), before + 1);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* Ctrl-C in a terminal sends SIGINT to the whole foreground process group, workers included:
 * the workers ignore it (the daemon owns their lifetime), the daemon drains, and a running
 * stream ends normally instead of with a dead worker's error. */
TEST_TIMEOUT(daemon_sigint_to_the_process_group_drains, 180)
{
    const char *dir = moe_test_tmpdir();
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--threads", "1", NULL};
    spawn_new_pgrp = true;
    moed_spawn(&d, dir, args);
    spawn_new_pgrp = false;
    moed_wait_socket(&d, 30);
    moed_require_ready(&d, 60);
    struct hc_conn c;
    start_stream(&c, d.sock, "Let there be light", 64);
    struct pollfd pfd = {.fd = c.fd, .events = POLLIN};
    CHECK(poll(&pfd, 1, 30000) == 1);
    CHECK_EQ(kill(-d.pid, SIGINT), 0);
    struct hc_resp r;
    int rc = hc_read(&c, &r, 60000);
    CHECK_MSG(rc == 0, "read: %d", rc);
    CHECK_EQ(r.status, 200);
    CHECK_MSG(strstr(r.body, "data: [DONE]") && !strstr(r.body, "\"error\""), "%s", r.body);
    hc_resp_free(&r);
    hc_close(&c);
    int st;
    double t0 = moe_test_now();
    while (waitpid(d.pid, &st, WNOHANG) != d.pid) {
        CHECK_MSG(moe_test_now() - t0 < 60, "moed did not exit after SIGINT");
        usleep(20000);
    }
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    CHECK(log_contains(&d, "SIGINT: draining"));
    CHECK(!log_contains(&d, "signal 2"));
}

/* --log-file: lines go to the file; SIGHUP reopens it after it was moved away (logrotate). */
TEST(daemon_log_file_sighup)
{
    const char *dir = moe_test_tmpdir();
    char logf[300], moved[310];
    snprintf(logf, sizeof logf, "%s/moed-file.log", dir);
    snprintf(moved, sizeof moved, "%s.1", logf);
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--workers", "1", "--log-file", logf, "--log-level", "debug", NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    /* The worker must be up: its shutdown line is checked below. */
    moed_require_ready(&d, 60);
    CHECK(access(logf, F_OK) == 0);
    CHECK(rename(logf, moved) == 0);
    kill(d.pid, SIGHUP);
    bool reopened = false;
    for (int i = 0; i < 100 && !reopened; i++) {
        usleep(20000);
        reopened = access(logf, F_OK) == 0;
    }
    CHECK(reopened);
    CHECK_EQ(moed_stop(&d, 30), 0);
    struct moed tmp = d;
    snprintf(tmp.log, sizeof tmp.log, "%s", moved);
    CHECK(log_contains(&tmp, "opening tests/golden/models"));
    snprintf(tmp.log, sizeof tmp.log, "%s", logf);
    CHECK(log_contains(&tmp, "SIGHUP: log file reopened"));
    CHECK(log_contains(&tmp, "stopped"));
    /* The worker's own lines go through the daemon's log too, with its timestamps: its
     * shutdown message is in the reopened file. */
    CHECK(log_contains(&tmp, "INFO  worker 0: shutdown requested"));
    /* ... and nothing reached the daemon's stderr from the worker. */
    CHECK(!log_contains(&d, "moed-worker["));
}

/* ---- devices: --devices auto asks the worker program; workers that never start ---- */

/* "device:state" of every worker from /admin/status, comma-separated ("cpu:ready,cpu:ready"). */
static void worker_summary(const char *sock, char *out, size_t cap)
{
    out[0] = 0;
    struct hc_resp r;
    if (hc_request_unix(sock, "GET", "/admin/status", NULL, &r, 5000) != 0)
        return;
    json_t *o = json_loads(r.body ? r.body : "", 0, NULL);
    hc_resp_free(&r);
    json_t *ws = json_object_get(o, "workers");
    size_t n = 0;
    for (size_t i = 0; i < json_array_size(ws) && n < cap; i++) {
        json_t *w = json_array_get(ws, i);
        n += (size_t)snprintf(out + n, cap - n, "%s%s:%s", i ? "," : "",
                              json_string_value(json_object_get(w, "device")),
                              json_string_value(json_object_get(w, "state")));
    }
    json_decref(o);
}

/* Polls worker_summary until it equals want; returns the last summary seen in out. */
static bool wait_summary(const char *sock, const char *want, double timeout, char *out, size_t cap)
{
    double t0 = moe_test_now();
    do {
        worker_summary(sock, out, cap);
        if (!strcmp(out, want))
            return true;
        usleep(50000);
    } while (moe_test_now() - t0 < timeout);
    return false;
}

/* A stand-in worker program: `list` answers --list-devices; every other start runs `rest`. */
static const char *fake_worker(const char *name, const char *list, const char *rest)
{
    char body[2048];
    snprintf(body, sizeof body, "if [ \"$1\" = --list-devices ]; then\n%s\nfi\n%s\n", list, rest);
    return moe_test_script(name, body);
}

/* The real worker, for fake_worker's `rest`: exec it with the daemon's arguments. */
static const char *exec_real_worker(void)
{
    static char cmd[PATH_MAX + 32];
    char *real = realpath(moe_test_bin("moed-worker"), NULL);
    CHECK(real != NULL);
    snprintf(cmd, sizeof cmd, "exec '%s' \"$@\"", real);
    free(real);
    return cmd;
}

/* Runs moed --devices auto with the stand-in worker program w and `workers` (a --workers value),
 * waits until the workers' summary is `want` and checks that the log says `log_line`, then
 * stops it. ready: the workers are real ones that must get ready. */
static void check_auto_plan(const char *w, const char *workers, bool ready, const char *want,
                            const char *log_line)
{
    char sum[256];
    struct moed d;
    const char *args[] = {"--devices", "auto", "--workers", workers, "--threads", "1",
                          "--worker-bin", w, NULL};
    moed_spawn(&d, moe_test_tmpdir(), args);
    moed_wait_socket(&d, 30);
    if (ready)
        moed_require_ready(&d, 60);
    CHECK_MSG(wait_summary(d.sock, want, 10, sum, sizeof sum), "%s (want %s)", sum, want);
    CHECK_MSG(log_contains(&d, log_line), "no \"%s\" in the log", log_line);
    CHECK_EQ(moed_stop(&d, 30), 0);
}

TEST_TIMEOUT(daemon_auto_devices_follow_the_worker, 120)
{
    /* The worker lists only the CPU: --workers CPU workers. */
    const char *w = fake_worker("cpu-worker.sh", "echo 'cpu Test CPU, 2 cores'; exit 0",
                                exec_real_worker());
    check_auto_plan(w, "2", true, "cpu:ready,cpu:ready", "lists no usable GPU; serving on the CPU");

    /* It lists a GPU: one worker on cuda:0 (--workers is for CPU workers). This stand-in never
     * gets ready; what matters is what was planned. */
    w = fake_worker("gpu-worker.sh",
                    "echo 'cpu Test CPU'; echo 'cuda:0 Fake GPU, 1024 MiB, compute capability 9.0'; "
                    "exit 0",
                    "exec sleep 60");
    check_auto_plan(w, "2", false, "cuda:0:starting",
                    "--devices auto: cuda:0 (Fake GPU, 1024 MiB, compute capability 9.0)");

    /* The probe fails: CPU workers, and the log says why. */
    w = fake_worker("broken-probe.sh", "echo 'cuda:0 GPU'; exit 3", exec_real_worker());
    check_auto_plan(w, "1", true, "cpu:ready",
                    "--list-devices exited with status 3; serving on the CPU");
}

/* A worker that exits at every start (a device it cannot use, say) is restarted a bounded number
 * of times, then marked failed; the daemon stays up and says so. */
TEST_TIMEOUT(daemon_gives_up_on_a_worker_that_never_starts, 120)
{
    const char *dir = moe_test_tmpdir();
    char sum[256];
    struct moed d;
    /* It reads the start of the Hello first, as a worker rejecting its device does. */
    const char *w = moe_test_script("dead-worker.sh",
                                    "head -c 1 <&3 >/dev/null\necho 'no such device' >&2\nexit 1\n");
    const char *args[] = {"--devices", "cpu", "--worker-bin", w, NULL};
    moed_spawn(&d, dir, args);
    moed_wait_socket(&d, 30);
    char want[64];
    snprintf(want, sizeof want, "%s:failed", test_device());
    CHECK_MSG(wait_summary(d.sock, want, 30, sum, sizeof sum), "%s", sum);
    CHECK(log_contains(&d, "giving up after 5 starts in a row"));
    CHECK_EQ(worker_restarts(d.sock), 4);
    /* It stays failed and the daemon keeps answering. */
    usleep(1500000);
    CHECK_EQ(worker_restarts(d.sock), 4);
    CHECK(waitpid(d.pid, NULL, WNOHANG) == 0);
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/health", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 503);
    hc_resp_free(&r);
    CHECK(hc_request_unix(d.sock, "GET", "/metrics", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    snprintf(want, sizeof want, "moed_worker_failed{worker=\"0\",device=\"%s\"} 1", test_device());
    CHECK_MSG(r.body && strstr(r.body, want), "%s", r.body ? r.body : "");
    hc_resp_free(&r);
    char out[4096];
    const char *st[] = {"status", NULL};
    CHECK_EQ(run_moectl(d.sock, 0, 0, false, st, out, sizeof out), 0);
    CHECK_MSG(strstr(out, "failed") && strstr(out, "exited with status 1"), "%s", out);
    CHECK_EQ(moed_stop(&d, 30), 0);
}

/* --devices as a list: one worker per item, in order (CPU items here; cpu,cuda:K mixes run on
 * the GPU machine, tools/device/offload-daemon.py), each answering the same greedy text. */
/* n concurrent greedy completions of ntok tokens of ptext, each of which must be `want`. */
static void clients_get(const char *sock, int n, const char *ptext, int ntok, const char *want)
{
    struct client_job jobs[8];
    pthread_t th[8];
    CHECK(n <= 8);
    for (int i = 0; i < n; i++) {
        jobs[i] = (struct client_job){.sock = sock, .body = completion_body(ptext, ntok, false)};
        CHECK(pthread_create(&th[i], NULL, client_thread, &jobs[i]) == 0);
    }
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        CHECK_MSG(jobs[i].status == 200, "client %d: status %d", i, jobs[i].status);
        CHECK_MSG(jobs[i].text && !strcmp(jobs[i].text, want), "client %d: '%s' != '%s'", i,
                  jobs[i].text ? jobs[i].text : "(null)", want);
        free(jobs[i].text);
        free(jobs[i].body);
    }
}

TEST_TIMEOUT(daemon_devices_list_starts_one_worker_each, 180)
{
    const char *dir = moe_test_tmpdir();
    const char *prompt = "tests/golden/prompts/p1.txt";
    char *want = worker_text(prompt, 8), *ptext = moe_test_read_file_or_fail(prompt, NULL);
    struct moed d;
    const char *args[] = {"--devices", "cpu,cpu,cpu", "--parallel", "1", "--threads", "1", NULL};
    moed_start(&d, dir, args);
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/admin/status", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    json_t *ws = json_object_get(j, "workers");
    CHECK_MSG(json_is_array(ws) && json_array_size(ws) == 3, "%s", r.body);
    json_decref(j);
    hc_resp_free(&r);
    /* Three clients at once: with one sequence per worker, each worker serves one. */
    clients_get(d.sock, 3, ptext, 8, want);
    CHECK_EQ(moed_stop(&d, 30), 0);
    free(want);
    free(ptext);
}

/* tokens_generated of worker i from /admin/status (-1 when absent). */
static long long worker_tokens(const char *sock, size_t i)
{
    struct hc_resp r;
    if (hc_request_unix(sock, "GET", "/admin/status", NULL, &r, 5000) != 0)
        return -1;
    json_t *o = json_loads(r.body ? r.body : "", 0, NULL);
    hc_resp_free(&r);
    json_t *w = json_array_get(json_object_get(o, "workers"), i);
    const long long v = w ? (long long)json_integer_value(json_object_get(w, "tokens_generated")) : -1;
    json_decref(o);
    return v;
}

/* Workers of two kinds in one daemon (with MOE_TEST_DEVICE=cuda:K a GPU worker and a CPU
 * worker; without, two CPU workers): concurrent clients, more than one worker's slots, all get
 * the greedy text of the worker run alone, and both workers serve. */
TEST_TIMEOUT(daemon_mixed_devices_serve_equal_greedy_text, 180)
{
    const char *dir = moe_test_tmpdir();
    const char *prompt = "tests/golden/prompts/p1.txt";
    char *want = worker_text(prompt, 8), *ptext = moe_test_read_file_or_fail(prompt, NULL);
    char devs[32];
    const bool gpu = strcmp(test_device(), "cpu") != 0;
    snprintf(devs, sizeof devs, "%s,cpu", gpu ? test_device() : "cpu");
    struct moed d;
    /* Not "--devices cpu": moed_spawn leaves a list as it is. */
    const char *args[] = {"--devices", devs, "--parallel", "2", "--threads", "1", NULL};
    moed_start(&d, dir, args);
    char sum[128], want_sum[64];
    snprintf(want_sum, sizeof want_sum, "%s:ready,cpu:ready", gpu ? test_device() : "cpu");
    CHECK_MSG(wait_summary(d.sock, want_sum, 60, sum, sizeof sum), "workers: %s", sum);
    for (int round = 0; round < 2; round++)
        clients_get(d.sock, 6, ptext, 8, want);
    /* Six at once over four slots: both workers took some (their counts come with Metrics). */
    double t0 = moe_test_now();
    long long t_a = 0, t_b = 0;
    do {
        t_a = worker_tokens(d.sock, 0);
        t_b = worker_tokens(d.sock, 1);
        if (t_a > 0 && t_b > 0)
            break;
        usleep(100000);
    } while (moe_test_now() - t0 < 10);
    CHECK_MSG(t_a > 0 && t_b > 0, "tokens generated: %lld and %lld", t_a, t_b);
    CHECK_EQ(moed_stop(&d, 30), 0);
    free(want);
    free(ptext);
}

/* ---- tiered store (--ram-budget) ---- */

#define KJV "models/kjv-demo-F16.gguf"   /* 4 layers x 32 experts (top-4), 36 KiB slots */

static const char *const tier_prompts[3] = {"In the beginning God created", "And the LORD spake unto Moses, saying",
                                            "Blessed are the"};

/* nclients concurrent greedy completions of n tokens over the prompts; texts into out[nclients]. */
static void tier_run_clients(const char *sock, int nclients, int n, char **out)
{
    struct client_job jobs[8];
    pthread_t th[8];
    CHECK(nclients <= 8);
    for (int i = 0; i < nclients; i++) {
        jobs[i] = (struct client_job){.sock = sock, .body = completion_body(tier_prompts[i % 3], n, false)};
        CHECK(pthread_create(&th[i], NULL, client_thread, &jobs[i]) == 0);
    }
    for (int i = 0; i < nclients; i++) {
        pthread_join(th[i], NULL);
        CHECK_MSG(jobs[i].status == 200 && jobs[i].text, "client %d: status %d", i, jobs[i].status);
        out[i] = jobs[i].text;
        free(jobs[i].body);
    }
}

/* A number from /admin/status's store.pool (-1 when there is no pool). */
static long long pool_stat(const char *sock, const char *key)
{
    struct hc_resp r;
    CHECK(hc_request_unix(sock, "GET", "/admin/status", NULL, &r, 5000) == 0);
    json_t *o = json_loads(r.body, 0, NULL);
    hc_resp_free(&r);
    json_t *p = json_object_get(json_object_get(o, "store"), "pool");
    long long v = p ? (long long)json_number_value(json_object_get(p, key)) : -1;
    json_decref(o);
    return v;
}

/* The greedy texts of the full store, one worker: what every budget must reproduce. */
static void tier_reference(const char *dir, int n, char **want)
{
    struct moed d;
    const char *args[] = {"--model", KJV, "--devices", "cpu", "--workers", "1", "--threads", "1", NULL};
    moed_start(&d, dir, args);
    tier_run_clients(d.sock, 3, n, want);
    CHECK_EQ(pool_stat(d.sock, "slots"), -1);
    CHECK_EQ(moed_stop(&d, 30), 0);
}

TEST_TIMEOUT(daemon_ram_budget_output_equals_full_store, 300)
{
    /* With MOE_TEST_DEVICE=cuda:K the workers are GPU workers, a quarter of each layer's
     * experts in VRAM, the rest borrowed from the pool inside the step; a GPU worker's share of
     * the slots must hold a layer's 32 experts, so 30% (38 slots) is for one worker only. */
    const bool gpu = strcmp(test_device(), "cpu") != 0;
    const char *dir = moe_test_tmpdir();
    const int n = 24;
    char *want[3];
    tier_reference(dir, n, want);
    /* The last: without read-ahead, and with buffered reads (the others read with O_DIRECT
     * where the test's file system takes it). */
    static const char *const budgets_cpu[4] = {"100%", "50%", "20%", "20%"};
    static const char *const budgets_gpu[4] = {"100%", "60%", "30%", "30%"};
    const char *const *budgets = gpu ? budgets_gpu : budgets_cpu;
    static const char *const nworkers[2] = {"1", "2"};
    for (int b = 0; b < 4; b++)
        for (int w = 0; w < 2; w++) {
            if (gpu && b >= 2 && w == 1)
                continue;
            char sub[512];
            snprintf(sub, sizeof sub, "%s/%d%d", dir, b, w);
            mkdir(sub, 0700);
            struct moed d;
            const char *args[20] = {"--model", KJV, "--devices", "cpu", "--workers", nworkers[w], "--parallel", "4",
                                    "--threads", "1", "--ram-budget", budgets[b]};
            int na = 12;
            if (gpu) {
                args[na++] = "--expert-residency";
                args[na++] = "25%";
            }
            if (b == 3) {
                args[na++] = "--pool-prefetch";
                args[na++] = "0";
                args[na++] = "--pool-io";
                args[na++] = "buffered";
            }
            args[na] = NULL;
            moed_start(&d, sub, args);
            if (b == 3)
                CHECK(log_contains(&d, "misses read buffered"));
            else if (b > 0)
                CHECK(log_contains(&d, "misses read with O_DIRECT") ||
                      log_contains(&d, "misses read buffered (O_DIRECT: "));
            char *got[6];
            tier_run_clients(d.sock, 6, n, got);
            for (int i = 0; i < 6; i++) {
                CHECK_MSG(!strcmp(got[i], want[i % 3]), "--ram-budget %s, %s workers, client %d: '%s' != '%s'",
                          budgets[b], nworkers[w], i, got[i], want[i % 3]);
                free(got[i]);
            }
            long long slots = pool_stat(d.sock, "slots");
            if (b == 0) {
                CHECK_EQ(slots, -1); /* every expert fits: the full store */
            } else {
                CHECK_EQ(slots, gpu ? (b == 1 ? 76 : 38) : (b == 1 ? 64 : 25));
                /* Read-ahead of the next layer's predicted experts, unless turned off. */
                if (b == 3) {
                    CHECK_EQ(pool_stat(d.sock, "prefetch_reads"), 0);
                } else {
                    CHECK(pool_stat(d.sock, "prefetch_requests") > 0);
                    CHECK(pool_stat(d.sock, "prefetch_reads") > 0);
                }
                CHECK(pool_stat(d.sock, "reads") > 0);
                CHECK(pool_stat(d.sock, "read_bytes") >= pool_stat(d.sock, "reads") * 30000);
                CHECK_EQ(pool_stat(d.sock, "read_errors"), 0);
                CHECK_EQ(pool_stat(d.sock, "pinned"), 0); /* idle: nothing pinned */
                /* The workers' hit counts arrive with their Metrics (about once a second). */
                for (int tries = 0; tries < 50 && pool_stat(d.sock, "misses") <= 0; tries++)
                    usleep(100 * 1000);
                CHECK(pool_stat(d.sock, "misses") > 0);
                CHECK(pool_stat(d.sock, "hits") > 0);
                struct hc_resp r;
                CHECK(hc_request_unix(d.sock, "GET", "/metrics", NULL, &r, 5000) == 0);
                CHECK_EQ(metric_value(r.body, "moed_pool_slots"), (double)slots);
                CHECK(metric_value(r.body, "moed_pool_disk_read_bytes_total") > 0);
                double hr = metric_value(r.body, "moed_pool_hit_rate");
                CHECK(hr > 0 && hr < 1);
                CHECK(metric_value(r.body, "moed_pool_read_latency_seconds{quantile=\"0.99\"}") > 0);
                hc_resp_free(&r);
                char out[8192];
                const char *st_args[] = {"status", NULL};
                CHECK_EQ(run_moectl(d.sock, 0, 0, false, st_args, out, sizeof out), 0);
                CHECK_MSG(strstr(out, "pool ") && strstr(out, "slots of 36 KiB") && strstr(out, "hit rate"),
                          "%s", out);
            }
            CHECK_EQ(moed_stop(&d, 30), 0);
        }
    for (int i = 0; i < 3; i++)
        free(want[i]);
}

TEST_TIMEOUT(daemon_ram_budget_refusals_and_auto, 120)
{
    const char *dir = moe_test_tmpdir();
    struct {
        const char *budget, *devices, *want;
    } cases[] = {
        /* 15 slots of 36 KiB; 4 layers x top-4 need 16 */
        {"540K", "cpu", "one step needs at least 16"},
        {"10%", "cpu", "give at least 576.0 KiB"},
        {"lots", "cpu", "is not a size"},
        {"0%", "cpu", "a share must be in"},
        /* 20 slots: a GPU worker needs a layer's 32 */
        {"720K", "0", "a GPU worker needs a share of at least one layer's experts (32)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char sub[512];
        snprintf(sub, sizeof sub, "%s/%zu", dir, i);
        mkdir(sub, 0700);
        struct moed d;
        const char *args[] = {"--model", KJV, "--devices", cases[i].devices, "--ram-budget", cases[i].budget, NULL};
        moed_spawn(&d, sub, args);
        int rc = moed_wait_exit(&d, 30);
        CHECK_MSG(rc == 2, "--ram-budget %s --devices %s: exit %d", cases[i].budget, cases[i].devices, rc);
        if (!log_contains(&d, cases[i].want)) {
            dump_log(&d);
            CHECK_MSG(false, "--ram-budget %s: no '%s' in the log", cases[i].budget, cases[i].want);
        }
    }
    /* auto: 3/4 of MemAvailable, far more than this model's experts: the full store. */
    {
        char sub[512];
        snprintf(sub, sizeof sub, "%s/auto", dir);
        mkdir(sub, 0700);
        struct moed d;
        const char *args[] = {"--model", KJV, "--devices", "cpu", "--threads", "1", "--ram-budget", "auto", NULL};
        moed_start(&d, sub, args);
        CHECK_EQ(pool_stat(d.sock, "slots"), -1);
        CHECK_EQ(moed_stop(&d, 30), 0);
    }
    /* moed --help names the option. */
    int status;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s --help", moe_test_bin("moed"));
    char *out = moe_test_run_shell(cmd, &status);
    CHECK_EQ(status, 0);
    CHECK(strstr(out, "--ram-budget") != NULL);
    free(out);
}

TEST_TIMEOUT(daemon_ram_budget_tiny_pool_eviction_and_kill9, 300)
{
    const bool gpu = strcmp(test_device(), "cpu") != 0;
    const char *dir = moe_test_tmpdir();
    const int n = 24;
    char *want[3];
    tier_reference(dir, n, want);
    char sub[512];
    snprintf(sub, sizeof sub, "%s/tiny", dir);
    mkdir(sub, 0700);
    struct moed d;
    /* The smallest pool: 16 slots (4 layers x top-4), 8 per worker, shared by 2 workers with 4
     * sequences each: nearly every expert of every step is a read, and slots turn over all the time.
     * GPU workers (MOE_TEST_DEVICE): the smallest pool they take, a layer's 32 experts each (64
     * slots), and a quarter of the experts in VRAM. */
    const char *args[] = {"--model", KJV, "--devices", "cpu", "--workers", "2", "--parallel", "4", "--threads", "1",
                          "--ram-budget", gpu ? "2304K" : "576K", gpu ? "--expert-residency" : NULL, "25%", NULL};
    /* The workers check every blob they use against the daemon's hash of it, when pinned and
     * when let go: a torn or stale slot fails the request. */
    setenv("MOED_POOL_VERIFY", "1", 1);
    moed_start(&d, sub, args);
    unsetenv("MOED_POOL_VERIFY");
    CHECK_EQ(pool_stat(d.sock, "slots"), gpu ? 64 : 16);
    for (int round = 0; round < 2; round++) {
        char *got[8];
        tier_run_clients(d.sock, 8, n, got);
        for (int i = 0; i < 8; i++) {
            CHECK_MSG(!strcmp(got[i], want[i % 3]), "round %d client %d: '%s' != '%s'", round, i, got[i],
                      want[i % 3]);
            free(got[i]);
        }
    }
    CHECK(pool_stat(d.sock, "evictions") > 100);
    CHECK_EQ(pool_stat(d.sock, "read_errors"), 0);
    CHECK_EQ(pool_stat(d.sock, "pinned"), 0);

    /* kill -9 of a worker in the middle of its requests, three times: the survivors keep
     * answering right, and whatever the dead one had pinned is given back when it is reaped. */
    for (int k = 0; k < 3; k++) {
        int pid = worker_pid(d.sock, k % 2);
        CHECK(pid > 0);
        struct client_job jobs[4];
        pthread_t th[4];
        for (int i = 0; i < 4; i++) {
            jobs[i] = (struct client_job){.sock = d.sock, .body = completion_body(tier_prompts[i % 3], 200, false)};
            CHECK(pthread_create(&th[i], NULL, client_thread, &jobs[i]) == 0);
        }
        usleep(50 * 1000 + (useconds_t)k * 30 * 1000);
        CHECK(kill(pid, SIGKILL) == 0);
        for (int i = 0; i < 4; i++) {
            pthread_join(th[i], NULL);
            /* A request either finished (on the survivor or retried) or failed with 500. */
            CHECK_MSG(jobs[i].status == 200 || jobs[i].status == 500, "status %d", jobs[i].status);
            free(jobs[i].text);
            free(jobs[i].body);
        }
        CHECK(moed_wait_ready(&d, 60));
    }
    CHECK(log_contains(&d, "was killed by signal 9"));
    char *got[8];
    tier_run_clients(d.sock, 6, n, got);
    for (int i = 0; i < 6; i++) {
        CHECK_MSG(!strcmp(got[i], want[i % 3]), "after kill -9, client %d: '%s' != '%s'", i, got[i], want[i % 3]);
        free(got[i]);
    }
    CHECK_EQ(pool_stat(d.sock, "pinned"), 0);
    fprintf(stderr, "tiny pool: %lld reads, %lld evictions, %lld merged, %lld pins reclaimed\n",
            pool_stat(d.sock, "reads"), pool_stat(d.sock, "evictions"), pool_stat(d.sock, "merged"),
            pool_stat(d.sock, "reclaimed"));
    /* SIGTERM while requests wait for reads: they drain, the daemon exits 0. */
    struct client_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (struct client_job){.sock = d.sock, .body = completion_body(tier_prompts[i % 3], 100, false)};
        CHECK(pthread_create(&th[i], NULL, client_thread, &jobs[i]) == 0);
    }
    usleep(30 * 1000);
    CHECK_EQ(moed_stop(&d, 30), 0);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK_MSG(jobs[i].status == 200 || jobs[i].status == 503, "status %d", jobs[i].status);
        free(jobs[i].text);
        free(jobs[i].body);
    }
    for (int i = 0; i < 3; i++)
        free(want[i]);
}

/* The GGUF shrinks or changes under a tiered daemon: the requests that need a read fail with
 * a message that says so; the daemon and its workers live on. */
TEST_TIMEOUT(daemon_ram_budget_file_changed_or_truncated, 180)
{
    const bool gpu = strcmp(test_device(), "cpu") != 0;
    const char *dir = moe_test_tmpdir();
    for (int variant = 0; variant < 2; variant++) {
        char sub[512], model[600];
        snprintf(sub, sizeof sub, "%s/%d", dir, variant);
        mkdir(sub, 0700);
        snprintf(model, sizeof model, "%s/model.gguf", sub);
        size_t len;
        char *bytes = moe_test_read_file_or_fail(KJV, &len);
        moe_test_write_file(model, bytes, len);
        struct moed d;
        const char *args[] = {"--model", model, "--devices", "cpu", "--workers", "1", "--threads", "1",
                              "--ram-budget", gpu ? "30%" : "20%", gpu ? "--expert-residency" : NULL,
                              "25%", NULL};
        moed_start(&d, sub, args);
        char *got[3];
        tier_run_clients(d.sock, 3, 8, got);
        for (int i = 0; i < 3; i++)
            free(got[i]);
        if (variant == 0) {
            CHECK(truncate(model, (off_t)(len / 2)) == 0);
        } else {
            /* Same size, another header: a KV's bytes (in the first 4 KiB) changed in place. */
            int fd = open(model, O_WRONLY);
            CHECK(fd >= 0);
            CHECK(pwrite(fd, "XX", 2, 40) == 2);
            close(fd);
            struct timespec ts[2] = {{0, UTIME_NOW}, {0, UTIME_NOW}};
            utimensat(AT_FDCWD, model, ts, 0);
        }
        int status = 0;
        json_t *res = NULL;
        /* Prompts long enough that some expert is not in the 25 slots. */
        for (int tries = 0; tries < 5 && status != 500; tries++) {
            json_decref(res);
            char body[256];
            snprintf(body, sizeof body, "{\"prompt\": \"%s %d\", \"max_tokens\": 16, \"temperature\": 0}",
                     tier_prompts[tries % 3], tries);
            res = post_json(d.sock, "/v1/completions", body, &status);
        }
        CHECK_MSG(status == 500, "status %d: %s", status, err_msg(res));
        CHECK_MSG(strstr(err_msg(res), "changed under the daemon") != NULL, "%s", err_msg(res));
        json_decref(res);
        CHECK(pool_stat(d.sock, "read_errors") > 0);
        CHECK_EQ(pool_stat(d.sock, "pinned"), 0);
        /* Still alive and answering. */
        struct hc_resp r;
        CHECK(hc_request_unix(d.sock, "GET", "/health", NULL, &r, 5000) == 0);
        hc_resp_free(&r);
        CHECK_EQ(worker_restarts(d.sock), 0);
        CHECK_EQ(moed_stop(&d, 30), 0);
        free(bytes);
    }
}

/* --temp 0: a request that gives no temperature is greedy (the standalone worker's text); one
 * that gives its own is not bound by it; /props shows the defaults and where they come from. */
TEST_TIMEOUT(daemon_sampling_defaults_from_config, 120)
{
    const char *dir = moe_test_tmpdir();
    const char *prompt = "tests/golden/prompts/p2.txt";
    char *want = worker_text(prompt, 12), *ptext = moe_test_read_file_or_fail(prompt, NULL);
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--temp", "0", "--top-k", "7", NULL};
    moed_start(&d, dir, args);
    json_t *o = json_pack("{s:s, s:i}", "prompt", ptext, "max_tokens", 12);
    char *body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    int status;
    for (int i = 0; i < 2; i++) {
        json_t *j = post_json(d.sock, "/v1/completions", body, &status);
        CHECK_EQ(status, 200);
        const char *text = json_string_value(
            json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text"));
        CHECK_MSG(text && !strcmp(text, want), "'%s' != '%s'", text ? text : "(null)", want);
        json_decref(j);
    }
    free(body);
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/props", NULL, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    json_t *p = json_loads(r.body, 0, NULL);
    json_t *params = json_object_get(json_object_get(p, "default_generation_settings"), "params");
    CHECK(json_number_value(json_object_get(params, "temperature")) == 0.0);
    CHECK_EQ(json_integer_value(json_object_get(params, "top_k")), 7);
    CHECK_STREQ(json_string_value(json_object_get(params, "defaults_from")), "configuration");
    json_decref(p);
    hc_resp_free(&r);
    CHECK_EQ(moed_stop(&d, 30), 0);
    free(want);
    free(ptext);
}

/* --chat-template FILE replaces the model's template: /apply-template renders with it and
 * /props shows it; one that does not parse stops moed at start. */
TEST_TIMEOUT(daemon_chat_template_file, 120)
{
    const char *dir = moe_test_tmpdir();
    char path[512], bad[512];
    snprintf(path, sizeof path, "%s/t.jinja", dir);
    snprintf(bad, sizeof bad, "%s/bad.jinja", dir);
    static const char tmpl[] = "{# [TOOL_CALLS] #}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n"
                               "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}";
    moe_test_write_file(path, tmpl, strlen(tmpl));
    moe_test_write_file(bad, "{% for m in %}", 14);
    struct moed d;
    const char *args[] = {"--devices", "cpu", "--chat-template", path, NULL};
    moed_start(&d, dir, args);
    int status;
    json_t *j = post_json(d.sock, "/apply-template",
                          "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}", &status);
    CHECK_EQ(status, 200);
    CHECK_STREQ(json_string_value(json_object_get(j, "prompt")), "[USER] Hi\n[ASSISTANT]");
    json_decref(j);
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "GET", "/props", NULL, &r, 5000) == 0);
    json_t *p = json_loads(r.body, 0, NULL);
    CHECK_STREQ(json_string_value(json_object_get(p, "chat_template")), tmpl);
    json_decref(p);
    hc_resp_free(&r);
    /* the template's markers tell how the model writes its tool calls */
    CHECK(hc_request_unix(d.sock, "GET", "/v1/models", NULL, &r, 5000) == 0);
    p = json_loads(r.body, 0, NULL);
    json_t *meta = json_object_get(json_array_get(json_object_get(p, "data"), 0), "meta");
    CHECK_STREQ(json_string_value(json_object_get(meta, "tool_call_format")), "mistral");
    json_decref(p);
    hc_resp_free(&r);
    CHECK_EQ(moed_stop(&d, 30), 0);

    char dir2[600];
    snprintf(dir2, sizeof dir2, "%s/two", dir);
    CHECK(mkdir(dir2, 0700) == 0);
    const char *args2[] = {"--devices", "cpu", "--chat-template", bad, NULL};
    moed_spawn(&d, dir2, args2);
    CHECK_EQ(moed_wait_exit(&d, 30), 1);
    CHECK(log_contains(&d, "--chat-template"));
}

/* ---- several prompts in one completion request, on the bundled demo model ---- */

#define DEMO_MODEL "models/kjv-demo-F16.gguf"

/* POSTs body (taken) to /v1/completions; the answer, whose status must be want. */
static json_t *post_cmpl(const char *sock, json_t *body, int want)
{
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    CHECK(s);
    int status;
    json_t *j = post_json(sock, "/v1/completions", s, &status);
    CHECK_MSG(status == want, "status %d, not %d, for %.300s: %s", status, want, s, err_msg(j));
    free(s);
    return j;
}

static json_t *choice_at(json_t *j, size_t k)
{
    return json_array_get(json_object_get(j, "choices"), k);
}

static const char *text_at(json_t *j, size_t k)
{
    const char *t = json_string_value(json_object_get(choice_at(j, k), "text"));
    return t ? t : "(none)";
}

static json_int_t usage_of(json_t *j, const char *key)
{
    return json_integer_value(json_object_get(json_object_get(j, "usage"), key));
}

/* The token ids of text (/tokenize). */
static json_t *token_ids(const char *sock, const char *text)
{
    json_t *b = json_pack("{s:s}", "content", text);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    int status;
    json_t *j = post_json(sock, "/tokenize", s, &status);
    free(s);
    CHECK_EQ(status, 200);
    json_t *ids = json_incref(json_object_get(j, "tokens"));
    json_decref(j);
    CHECK(json_array_size(ids) > 0);
    return ids;
}

/* The demo model's daemon: one CPU worker of four slots. */
static void moed_start_demo(struct moed *d)
{
    const char *args[] = {"--model", DEMO_MODEL, "--devices", "cpu", "--workers", "1",
                          "--parallel", "4", NULL};
    moed_start(d, moe_test_tmpdir(), args);
}

static const char *const several[3] = {"In the beginning", "And God said unto Moses",
                                       "The LORD is my shepherd"};

/* The greedy 8-token answer to each of several[] alone, its prompt and completion tokens and its
 * token ids. */
struct single_answer {
    char *text;
    json_int_t n_prompt, n_gen;
    json_t *ids;
};

static void single_answers(const char *sock, struct single_answer *out)
{
    for (int i = 0; i < 3; i++) {
        json_t *j = post_cmpl(sock, json_pack("{s:s,s:i,s:f}", "prompt", several[i], "max_tokens", 8,
                                              "temperature", 0.0), 200);
        out[i].text = strdup(text_at(j, 0));
        out[i].n_prompt = usage_of(j, "prompt_tokens");
        out[i].n_gen = usage_of(j, "completion_tokens");
        out[i].ids = token_ids(sock, several[i]);
        CHECK_EQ((json_int_t)json_array_size(out[i].ids), out[i].n_prompt);
        CHECK_STREQ(json_string_value(json_object_get(choice_at(j, 0), "finish_reason")), "length");
        json_decref(j);
    }
}

static void single_answers_free(struct single_answer *s)
{
    for (int i = 0; i < 3; i++) {
        free(s[i].text);
        json_decref(s[i].ids);
    }
}

/* 'prompt' as an array of strings, of token id arrays, or both: each prompt gets n choices,
 * indexed prompt * n + j, each the answer the prompt gets alone; usage counts each prompt once and
 * every choice's tokens; echo and logprobs are each choice's own prompt's; seeded choice k uses
 * seed + k. */
TEST_TIMEOUT(daemon_several_prompts_answer_as_single_ones, 240)
{
    struct moed d;
    moed_start_demo(&d);
    struct single_answer s[3];
    single_answers(d.sock, s);
    CHECK(strcmp(s[0].text, s[1].text) && strcmp(s[1].text, s[2].text));

    /* Three strings, n = 2. */
    json_t *j = post_cmpl(d.sock, json_pack("{s:[s,s,s],s:i,s:i,s:f}", "prompt", several[0],
                                            several[1], several[2], "n", 2, "max_tokens", 8,
                                            "temperature", 0.0), 200);
    CHECK_EQ(json_array_size(json_object_get(j, "choices")), 6);
    for (size_t k = 0; k < 6; k++) {
        CHECK_EQ(json_integer_value(json_object_get(choice_at(j, k), "index")), (json_int_t)k);
        CHECK_MSG(!strcmp(text_at(j, k), s[k / 2].text), "choice %zu: '%s', alone '%s'", k,
                  text_at(j, k), s[k / 2].text);
    }
    const json_int_t n_prompt = s[0].n_prompt + s[1].n_prompt + s[2].n_prompt;
    const json_int_t n_gen = 2 * (s[0].n_gen + s[1].n_gen + s[2].n_gen);
    CHECK_EQ(usage_of(j, "prompt_tokens"), n_prompt);
    CHECK_EQ(usage_of(j, "completion_tokens"), n_gen);
    CHECK_EQ(usage_of(j, "total_tokens"), n_prompt + n_gen);
    json_t *details = json_object_get(json_object_get(j, "usage"), "prompt_tokens_details");
    json_int_t cached = json_integer_value(json_object_get(details, "cached_tokens"));
    CHECK(cached >= 0 && cached < n_prompt);
    json_t *tm = json_object_get(j, "timings");
    CHECK_EQ(json_integer_value(json_object_get(tm, "predicted_n")), n_gen);
    CHECK_EQ(json_integer_value(json_object_get(tm, "cache_n")), cached);
    CHECK_EQ(json_integer_value(json_object_get(tm, "prompt_n")) + cached, n_prompt);
    CHECK(json_real_value(json_object_get(tm, "prompt_ms")) > 0);
    json_decref(j);

    /* Token id arrays. */
    j = post_cmpl(d.sock, json_pack("{s:[O,O],s:i,s:f}", "prompt", s[0].ids, s[2].ids, "max_tokens",
                                    8, "temperature", 0.0), 200);
    CHECK_EQ(json_array_size(json_object_get(j, "choices")), 2);
    CHECK_STREQ(text_at(j, 0), s[0].text);
    CHECK_STREQ(text_at(j, 1), s[2].text);
    CHECK_EQ(usage_of(j, "prompt_tokens"), s[0].n_prompt + s[2].n_prompt);
    json_decref(j);

    /* Mixed, with echo: each choice starts with its own prompt (the ids' text for ids). */
    j = post_cmpl(d.sock, json_pack("{s:[s,O,s],s:i,s:f,s:b}", "prompt", several[0], s[1].ids,
                                    several[2], "max_tokens", 8, "temperature", 0.0, "echo", 1), 200);
    for (size_t k = 0; k < 3; k++) {
        char want[256];
        snprintf(want, sizeof want, "%s%s", several[k], s[k].text);
        CHECK_STREQ(text_at(j, k), want);
    }
    json_decref(j);

    /* echo with logprobs, n = 2: each choice lists its own prompt's tokens first (the first
     * without a logprob), then its generated ones; text_offset counts from its own start. */
    j = post_cmpl(d.sock, json_pack("{s:[O,s],s:i,s:i,s:f,s:b,s:i}", "prompt", s[0].ids, several[1],
                                    "n", 2, "max_tokens", 8, "temperature", 0.0, "echo", 1,
                                    "logprobs", 0), 200);
    CHECK_EQ(json_array_size(json_object_get(j, "choices")), 4);
    for (size_t k = 0; k < 4; k++) {
        const struct single_answer *a = &s[k / 2];
        json_t *lp = json_object_get(choice_at(j, k), "logprobs");
        json_t *toks = json_object_get(lp, "tokens");
        CHECK_EQ((json_int_t)json_array_size(toks), a->n_prompt + a->n_gen);
        char joined[256] = "";
        for (json_int_t t = 0; t < a->n_prompt; t++)
            strncat(joined, json_string_value(json_array_get(toks, (size_t)t)),
                    sizeof joined - strlen(joined) - 1);
        CHECK_STREQ(joined, several[k / 2]);
        CHECK(json_is_null(json_array_get(json_object_get(lp, "token_logprobs"), 0)));
        CHECK(json_is_number(json_array_get(json_object_get(lp, "token_logprobs"), 1)));
        CHECK_EQ(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 0)), 0);
    }
    CHECK_EQ(usage_of(j, "prompt_tokens"), s[0].n_prompt + s[1].n_prompt);
    json_decref(j);

    /* Seeded sampling: choice k uses seed + k, whichever prompt it answers. */
    j = post_cmpl(d.sock, json_pack("{s:[s,s],s:i,s:i,s:f,s:i}", "prompt", several[0], several[1],
                                    "n", 2, "max_tokens", 8, "temperature", 1.0, "seed", 11), 200);
    for (size_t k = 0; k < 4; k++) {
        json_t *one = post_cmpl(d.sock, json_pack("{s:s,s:i,s:f,s:i}", "prompt", several[k / 2],
                                                  "max_tokens", 8, "temperature", 1.0, "seed",
                                                  (int)(11 + k)), 200);
        CHECK_MSG(!strcmp(text_at(j, k), text_at(one, 0)), "choice %zu: '%s', alone with seed %zu: '%s'",
                  k, text_at(j, k), 11 + k, text_at(one, 0));
        json_decref(one);
    }
    json_decref(j);
    single_answers_free(s);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* Streamed: every chunk carries one choice and its index; the texts by index are the single
 * answers; each choice finishes once; timings come once; the usage chunk sums the prompts. */
TEST_TIMEOUT(daemon_several_prompts_stream, 240)
{
    struct moed d;
    moed_start_demo(&d);
    struct single_answer s[3];
    single_answers(d.sock, s);
    json_t *body = json_pack("{s:[s,O,s],s:i,s:i,s:f,s:b,s:{s:b}}", "prompt", several[0], s[1].ids,
                             several[2], "n", 2, "max_tokens", 8, "temperature", 0.0, "stream", 1,
                             "stream_options", "include_usage", 1);
    char *bs = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct hc_resp r;
    CHECK(hc_request_unix(d.sock, "POST", "/v1/completions", bs, &r, 60000) == 0);
    free(bs);
    CHECK_MSG(r.status == 200, "%d %s", r.status, r.body);
    char text[6][256] = {{0}};
    int finished[6] = {0}, n_timings = 0, n_usage = 0;
    bool done = false;
    json_t *usage = NULL;
    for (char *p = r.body; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (strncmp(p, "data: ", 6))
            continue;
        CHECK_MSG(!done, "an event after [DONE]");
        if (!strncmp(p + 6, "[DONE]", 6)) {
            done = true;
            continue;
        }
        json_t *o = json_loadb(p + 6, strcspn(p + 6, "\n"), 0, NULL);
        CHECK_MSG(o, "not JSON: %.200s", p);
        json_t *chs = json_object_get(o, "choices");
        n_timings += json_object_get(o, "timings") != NULL;
        if (json_array_size(chs) == 0) {
            n_usage++;
            json_decref(usage);
            usage = json_incref(json_object_get(o, "usage"));
        } else {
            CHECK_EQ(json_array_size(chs), 1);
            CHECK_MSG(!usage, "a choice after the usage chunk");
            json_t *c = json_array_get(chs, 0);
            json_int_t k = json_integer_value(json_object_get(c, "index"));
            CHECK_MSG(k >= 0 && k < 6 && !finished[k], "index %lld", (long long)k);
            strncat(text[k], json_string_value(json_object_get(c, "text")),
                    sizeof text[k] - strlen(text[k]) - 1);
            finished[k] += json_is_string(json_object_get(c, "finish_reason"));
        }
        json_decref(o);
    }
    CHECK(done);
    CHECK_EQ(n_timings, 1);
    CHECK_EQ(n_usage, 1);
    json_int_t n_prompt = 0, n_gen = 0;
    for (int k = 0; k < 6; k++) {
        CHECK_EQ(finished[k], 1);
        CHECK_MSG(!strcmp(text[k], s[k / 2].text), "choice %d: '%s', alone '%s'", k, text[k],
                  s[k / 2].text);
        n_gen += s[k / 2].n_gen;
        n_prompt += k % 2 ? 0 : s[k / 2].n_prompt;
    }
    CHECK_EQ(json_integer_value(json_object_get(usage, "prompt_tokens")), n_prompt);
    CHECK_EQ(json_integer_value(json_object_get(usage, "completion_tokens")), n_gen);
    CHECK_EQ(json_integer_value(json_object_get(usage, "total_tokens")), n_prompt + n_gen);
    json_decref(usage);
    hc_resp_free(&r);
    single_answers_free(s);
    CHECK_EQ(moed_stop(&d, 60), 0);
}

/* The caps: 64 prompts, 128 choices (prompts x n) are served; one more of either is a 400 that
 * says the limit. A prompt longer than the context is named. A client that leaves a stream of
 * several prompts cancels every choice. */
TEST_TIMEOUT(daemon_several_prompts_limits, 240)
{
    struct moed d;
    moed_start_demo(&d);
    json_t *p = json_array();
    for (int i = 0; i < 8; i++)
        json_array_append_new(p, i % 2 ? json_pack("[i,i]", 10 + i, 20 + i) : json_string(several[i % 3]));
    json_t *j = post_cmpl(d.sock, json_pack("{s:O,s:i,s:i}", "prompt", p, "n", 16, "max_tokens", 2), 200);
    CHECK_EQ(json_array_size(json_object_get(j, "choices")), 128);
    for (size_t k = 0; k < 128; k++)
        CHECK_EQ(json_integer_value(json_object_get(choice_at(j, k), "index")), (json_int_t)k);
    json_decref(j);
    json_array_append_new(p, json_string("And"));
    j = post_cmpl(d.sock, json_pack("{s:O,s:i,s:i}", "prompt", p, "n", 15, "max_tokens", 2), 400);
    CHECK_MSG(strstr(err_msg(j), "9 prompts with 'n' 15 ask for 135 choices") &&
              strstr(err_msg(j), "at most 128"), "%s", err_msg(j));
    CHECK_STREQ(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "n");
    json_decref(j);
    json_decref(p);

    p = json_array();
    for (int i = 0; i < 64; i++)
        json_array_append_new(p, json_string(several[i % 3]));
    j = post_cmpl(d.sock, json_pack("{s:O,s:i,s:f}", "prompt", p, "max_tokens", 1, "temperature", 0.0), 200);
    CHECK_EQ(json_array_size(json_object_get(j, "choices")), 64);
    json_decref(j);
    json_array_append_new(p, json_string("x"));
    j = post_cmpl(d.sock, json_pack("{s:O}", "prompt", p), 400);
    CHECK_MSG(strstr(err_msg(j), "'prompt' holds 65 prompts; a request may hold at most 64"), "%s", err_msg(j));
    json_decref(j);
    json_decref(p);

    /* A prompt too long for the context (refused by its size, before tokenizing). */
    char *huge = malloc(200001);
    memset(huge, 'x', 200000);
    huge[200000] = 0;
    j = post_cmpl(d.sock, json_pack("{s:[s,s]}", "prompt", "In the beginning", huge), 400);
    CHECK_MSG(strstr(err_msg(j), "'prompt[1]' (200000 bytes) is longer than the context"), "%s", err_msg(j));
    json_decref(j);
    free(huge);

    /* 4 prompts x 4 choices of 500 tokens each, streamed; the client leaves after a moment:
     * every choice stops, far from the 8000 tokens they would make. */
    p = json_pack("[s,s,s,s]", several[0], several[1], several[2], "And");
    json_t *body = json_pack("{s:O,s:i,s:i,s:b,s:b}", "prompt", p, "n", 4, "max_tokens", 500,
                             "stream", 1, "ignore_eos", 1);
    json_decref(p);
    char *bs = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct hc_conn c;
    start_post(&c, d.sock, "/v1/completions", bs);
    free(bs);
    usleep(300000);
    hc_close(&c);
    double t0 = moe_test_now(), in_flight = -1, running = -1, queued = -1, gen = -1;
    while (moe_test_now() - t0 < 30) {
        struct hc_resp r;
        CHECK(hc_request_unix(d.sock, "GET", "/metrics", NULL, &r, 5000) == 0);
        in_flight = metric_value(r.body, "moed_generations_in_flight");
        running = metric_value(r.body, "moed_requests_running");
        queued = metric_value(r.body, "moed_queue_depth");
        gen = metric_value(r.body, "moed_generated_tokens_total");
        hc_resp_free(&r);
        if (in_flight == 0 && running == 0 && queued == 0)
            break;
        usleep(20000);
    }
    CHECK_MSG(in_flight == 0 && running == 0 && queued == 0, "in flight %g, running %g, queued %g",
              in_flight, running, queued);
    /* Before: 128 x 2 + 64 tokens at most. */
    CHECK_MSG(gen < 320 + 4000, "%g tokens generated: the choices went on", gen);
    j = post_cmpl(d.sock, json_pack("{s:[s,s],s:i,s:i}", "prompt", "a", "b", "n", 2, "max_tokens", 2), 200);
    CHECK_EQ(usage_of(j, "completion_tokens"), 8);
    json_decref(j);
    CHECK_EQ(moed_stop(&d, 60), 0);
}
