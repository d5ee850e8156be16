/* Asking the worker program what it can compute on. See daemon/devices.h. */
#include "daemon/devices.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "store/err.h"
#include "store/io.h"

#define OUTPUT_MAX (64 * 1024)

/* Reads one "NAME DESCRIPTION" line into *out. */
static void parse_line(char *line, struct devices_found *out)
{
    char *name = line + strspn(line, " \t");
    size_t nl = strcspn(name, " \t");
    char *desc = name + nl;
    if (*desc)
        *desc++ = 0;
    desc += strspn(desc, " \t");
    if (!strcmp(name, "cpu")) {
        out->cpu = true;
        return;
    }
    if (strncmp(name, "cuda:", 5) != 0)
        return;
    char *end;
    errno = 0;
    long k = strtol(name + 5, &end, 10);
    if (end == name + 5 || *end || errno || k < 0 || k >= DEVICES_MAX)
        return;
    for (uint32_t i = 0; i < out->n_gpu; i++)
        if (out->gpu[i] == (int)k)
            return;
    if (out->n_gpu == DEVICES_MAX)
        return;
    out->gpu[out->n_gpu] = (int)k;
    snprintf(out->desc[out->n_gpu], sizeof out->desc[0], "%s", desc);
    out->n_gpu++;
}

static void parse_output(char *text, struct devices_found *out)
{
    for (char *line = text; line && *line;) {
        char *next = strchr(line, '\n');
        if (next)
            *next++ = 0;
        line[strcspn(line, "\r")] = 0;
        parse_line(line, out);
        line = next;
    }
}

static void child_exec(const char *bin, int out_fd)
{
    setpgid(0, 0);
    int null = open("/dev/null", O_RDONLY);
    if (null >= 0) {
        dup2(null, 0);
        close(null);
    }
    dup2(out_fd, 1);
    char *const argv[] = {(char *)bin, "--list-devices", NULL};
    execv(bin, argv);
    _exit(127);
}

/* Reads the child's stdout until EOF, the deadline or the size limit. Returns 0 at EOF,
 * -ETIMEDOUT, -EFBIG, or another negative errno. */
static int read_until_eof(int fd, double deadline, char *buf, size_t cap, size_t *len)
{
    for (;;) {
        double left = deadline - moe_now_s();
        if (left <= 0)
            return -ETIMEDOUT;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        if (r == 0)
            continue;
        ssize_t k = read(fd, buf + *len, cap - *len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -errno;
        if (k == 0)
            return 0;
        *len += (size_t)k;
        if (*len == cap)
            return -EFBIG;
    }
}

/* Waits for the child until the deadline. Returns 0 with *status, or -ETIMEDOUT. */
static int wait_until(pid_t pid, double deadline, int *status)
{
    for (;;) {
        pid_t r = waitpid(pid, status, WNOHANG);
        if (r == pid)
            return 0;
        if (r < 0 && errno != EINTR)
            return -errno;
        if (moe_now_s() >= deadline)
            return -ETIMEDOUT;
        usleep(2000);
    }
}

int devices_list(const char *worker_bin, uint32_t timeout_ms, struct devices_found *out,
                 char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (access(worker_bin, X_OK) != 0)
        return moe_fail(err, errlen, -errno, "cannot run %s: %s", worker_bin, strerror(errno));
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0)
        return moe_fail(err, errlen, -errno, "pipe: %s", strerror(errno));
    char *buf = malloc(OUTPUT_MAX + 1);
    if (!buf) {
        close(fds[0]);
        close(fds[1]);
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        close(fds[0]);
        close(fds[1]);
        free(buf);
        return moe_fail(err, errlen, -e, "fork: %s", strerror(e));
    }
    if (pid == 0)
        child_exec(worker_bin, fds[1]);
    setpgid(pid, pid); /* also here, so that the kill below cannot miss a child not there yet */
    close(fds[1]);

    double deadline = moe_now_s() + timeout_ms / 1000.0;
    size_t len = 0;
    int status = 0;
    int rc = read_until_eof(fds[0], deadline, buf, OUTPUT_MAX, &len);
    close(fds[0]);
    if (rc == 0)
        rc = wait_until(pid, deadline, &status);
    if (rc) {
        kill(-pid, SIGKILL);
        kill(pid, SIGKILL);
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
            ;
        free(buf);
        if (rc == -ETIMEDOUT)
            return moe_fail(err, errlen, rc, "%s --list-devices gave no answer within %u ms",
                            worker_bin, timeout_ms);
        if (rc == -EFBIG)
            return moe_fail(err, errlen, rc, "%s --list-devices printed more than %d bytes",
                            worker_bin, OUTPUT_MAX);
        return moe_fail(err, errlen, rc, "%s --list-devices: %s", worker_bin, strerror(-rc));
    }
    if (WIFSIGNALED(status) || WEXITSTATUS(status) != 0) {
        free(buf);
        if (WIFSIGNALED(status))
            return moe_fail(err, errlen, MOE_EBACKEND, "%s --list-devices was killed by signal %d",
                            worker_bin, WTERMSIG(status));
        return moe_fail(err, errlen, MOE_EBACKEND, "%s --list-devices exited with status %d",
                        worker_bin, WEXITSTATUS(status));
    }
    buf[len] = 0;
    parse_output(buf, out);
    free(buf);
    if (!out->cpu && out->n_gpu == 0)
        return moe_fail(err, errlen, MOE_EFORMAT, "%s --list-devices listed no device", worker_bin);
    return 0;
}

/* "K" or "cuda:K" with K < DEVICES_MAX at s[0..len): K, or -1. */
static int gpu_item(const char *s, size_t len)
{
    if (len > 5 && !strncmp(s, "cuda:", 5)) {
        s += 5;
        len -= 5;
    }
    if (len == 0 || len > 2)
        return -1;
    int k = 0;
    for (size_t i = 0; i < len; i++) {
        if (!isdigit((unsigned char)s[i]))
            return -1;
        k = k * 10 + (s[i] - '0');
    }
    return k < DEVICES_MAX ? k : -1;
}

int devices_parse_list(const char *s, char (*names)[16], uint32_t *n)
{
    *n = 0;
    if (!s || !*s)
        return MOE_EFORMAT;
    for (;;) {
        const size_t len = strcspn(s, ",");
        if (*n == DEVICES_MAX)
            return MOE_ERANGE;
        int k;
        if (len == 3 && !strncmp(s, "cpu", 3)) {
            if (names)
                snprintf(names[*n], 16, "cpu");
        } else if ((k = gpu_item(s, len)) >= 0) {
            if (names)
                snprintf(names[*n], 16, "cuda:%d", k);
        } else {
            return MOE_EFORMAT;
        }
        (*n)++;
        if (!s[len])
            return 0;
        s += len + 1;
    }
}

int devices_gpu_index(const char *name)
{
    return name && !strncmp(name, "cuda:", 5) ? gpu_item(name, strlen(name)) : -1;
}
