/* moectl chat against a stand-in for moed that streams a reply slowly and without end: Ctrl-C
 * (SIGINT) stops the reply, closing the connection, and the session goes on with the partial
 * reply kept in the history; a second Ctrl-C at the prompt only clears the line; /quit ends
 * with status 0. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/harness.h"

struct fake {
    int lfd;
    char body2[8192];      /* the second request's body */
    char body3[8192];      /* the third's, when `third` */
    bool third;            /* serve a third request like the second */
    bool first_cut;        /* the first reply's connection was closed by the client */
    _Atomic bool got3;     /* body3 is written (the test waits for it while the thread serves) */
};

/* Reads one request (headers and Content-Length body) into buf. */
static ssize_t read_request(int fd, char *buf, size_t cap)
{
    size_t n = 0;
    for (;;) {
        ssize_t k = recv(fd, buf + n, cap - 1 - n, 0);
        if (k <= 0)
            return -1;
        n += (size_t)k;
        buf[n] = 0;
        char *he = strstr(buf, "\r\n\r\n");
        const char *cl = strcasestr(buf, "content-length:");
        if (he && cl && n >= (size_t)(he + 4 - buf) + (size_t)atol(cl + 15))
            return (ssize_t)n;
        if (n + 1 >= cap)
            return -1;
    }
}

static void *serve(void *arg)
{
    struct fake *f = arg;
    static const char head[] = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                               "Connection: close\r\n\r\n";
    static const char tok[] = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok \"}}]}\n\n";
    char buf[16384];
    /* 1: a reply that never ends, one token every 20 ms until the client hangs up. */
    int c = accept(f->lfd, NULL, NULL);
    if (c < 0 || read_request(c, buf, sizeof buf) < 0)
        return NULL;
    send(c, head, sizeof head - 1, MSG_NOSIGNAL);
    for (int i = 0; i < 1500; i++) { /* 30 s at most */
        if (send(c, tok, sizeof tok - 1, MSG_NOSIGNAL) < 0) {
            f->first_cut = true;
            break;
        }
        usleep(20000);
    }
    close(c);
    /* 2: the next turn; a short complete reply. */
    c = accept(f->lfd, NULL, NULL);
    ssize_t n = c < 0 ? -1 : read_request(c, buf, sizeof buf);
    if (n < 0)
        return NULL;
    const char *b = strstr(buf, "\r\n\r\n");
    snprintf(f->body2, sizeof f->body2, "%s", b ? b + 4 : "");
    static const char done[] = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}]}\n\n"
                               "data: [DONE]\n\n";
    send(c, head, sizeof head - 1, MSG_NOSIGNAL);
    send(c, done, sizeof done - 1, MSG_NOSIGNAL);
    close(c);
    if (!f->third)
        return NULL;
    c = accept(f->lfd, NULL, NULL);
    n = c < 0 ? -1 : read_request(c, buf, sizeof buf);
    if (n < 0)
        return NULL;
    b = strstr(buf, "\r\n\r\n");
    snprintf(f->body3, sizeof f->body3, "%s", b ? b + 4 : "");
    f->got3 = true;
    send(c, head, sizeof head - 1, MSG_NOSIGNAL);
    send(c, done, sizeof done - 1, MSG_NOSIGNAL);
    close(c);
    return NULL;
}

/* Reads the child's stdout until it holds `want` (or 10 s pass). */
static bool wait_output(int fd, char *acc, size_t cap, size_t *len, const char *want)
{
    double t0 = moe_test_now();
    while (!strstr(acc, want) && moe_test_now() - t0 < 10) {
        ssize_t k = read(fd, acc + *len, cap - 1 - *len);
        if (k <= 0)
            return false;
        *len += (size_t)k;
        acc[*len] = 0;
    }
    return strstr(acc, want) != NULL;
}

/* The stand-in listening at sock (in the test's directory) on a thread; errlog: where the
 * child's stderr goes. sock and errlog hold 512 bytes. */
static void start_fake(struct fake *f, char *sock, char *errlog, pthread_t *th)
{
    snprintf(sock, 512, "%s/fake.sock", moe_test_tmpdir());
    snprintf(errlog, 512, "%s/err.log", moe_test_tmpdir());
    f->lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    CHECK(strlen(sock) < sizeof a.sun_path);
    memcpy(a.sun_path, sock, strlen(sock) + 1);
    CHECK(f->lfd >= 0 && bind(f->lfd, (struct sockaddr *)&a, sizeof a) == 0 && listen(f->lfd, 4) == 0);
    CHECK(pthread_create(th, NULL, serve, f) == 0);
}

TEST_TIMEOUT(moectl_chat_ctrl_c_stops_the_reply, 60)
{
    struct fake f = {0};
    char sock[512], errlog[512];
    pthread_t th;
    start_fake(&f, sock, errlog, &th);

    int in[2], out[2];
    CHECK(pipe(in) == 0 && pipe(out) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        FILE *e = freopen(errlog, "w", stderr);
        (void)e;
        close(in[1]);
        close(out[0]);
        execl(moe_test_bin("moectl"), "moectl", "--socket", sock, "chat", (char *)NULL);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    char acc[65536] = "";
    size_t len = 0;
    CHECK(write(in[1], "hello\n", 6) == 6);
    CHECK_MSG(wait_output(out[0], acc, sizeof acc, &len, "tok tok tok "), "%s", acc);
    kill(pid, SIGINT);
    /* The next turn goes out with the partial reply in the history. */
    CHECK(write(in[1], "again\n", 6) == 6);
    CHECK_MSG(wait_output(out[0], acc, sizeof acc, &len, "ok"), "%s", acc);
    /* Ctrl-C at the prompt clears the line, no more. */
    usleep(100000);
    kill(pid, SIGINT);
    usleep(100000);
    CHECK(write(in[1], "/quit\n", 6) == 6);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    close(in[1]);
    close(out[0]);
    pthread_join(th, NULL);
    char *err = moe_test_read_file_or_fail(errlog, NULL);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d, stderr: %s", st, err);
    CHECK(f.first_cut);
    CHECK_MSG(strstr(err, "reply stopped"), "%s", err);
    CHECK_MSG(strstr(f.body2, "\"assistant\"") && strstr(f.body2, "tok tok") &&
                  strstr(f.body2, "again"), "%s", f.body2);
    free(err);
    close(f.lfd);
}

/* Reads and drops what the terminal shows, waiting at most us microseconds (the child must not
 * block on a full pty). */
static void drain(int m, long us)
{
    char tmp[4096];
    struct timeval tv = {0, us};
    fd_set rs;
    FD_ZERO(&rs);
    FD_SET(m, &rs);
    if (select(m + 1, &rs, NULL, NULL, &tv) > 0 && read(m, tmp, sizeof tmp) <= 0)
        usleep((useconds_t)us);
}

/* On a terminal (a pty) moectl chat reads lines with libedit: Ctrl-C (the terminal's interrupt
 * character) stops a reply; arrow keys edit the line ("agin", two steps left, "a" makes
 * "again"); Ctrl-C while typing drops the line; up-arrow brings back the last message. */
TEST_TIMEOUT(moectl_chat_line_editing_on_a_terminal, 60)
{
    struct fake f = {.third = true};
    char sock[512], errlog[512];
    pthread_t th;
    start_fake(&f, sock, errlog, &th);

    int m = posix_openpt(O_RDWR | O_NOCTTY);
    CHECK(m >= 0 && grantpt(m) == 0 && unlockpt(m) == 0);
    const char *sname = ptsname(m);
    CHECK(sname != NULL);
    char slave[128];
    snprintf(slave, sizeof slave, "%s", sname);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        /* A session of its own with the pty as its controlling terminal. */
        setsid();
        int sfd = open(slave, O_RDWR);
        if (sfd < 0)
            _exit(126);
        ioctl(sfd, TIOCSCTTY, 0);
        dup2(sfd, 0);
        dup2(sfd, 1);
        FILE *e = freopen(errlog, "w", stderr);
        (void)e;
        close(m);
        setenv("TERM", "vt100", 1);
        execl(moe_test_bin("moectl"), "moectl", "--socket", sock, "chat", (char *)NULL);
        _exit(127);
    }
    char acc[65536] = "";
    size_t len = 0;
    CHECK_MSG(wait_output(m, acc, sizeof acc, &len, "> "), "%s", acc);
    CHECK(write(m, "hello\r", 6) == 6);
    CHECK_MSG(wait_output(m, acc, sizeof acc, &len, "tok tok tok "), "%s", acc);
    CHECK(write(m, "\x03", 1) == 1); /* Ctrl-C: the reply stops */
    usleep(200000);
    CHECK(write(m, "agin\x1b[D\x1b[Da\r", 13) == 13);
    CHECK_MSG(wait_output(m, acc, sizeof acc, &len, "ok"), "%s", acc);
    usleep(200000);
    CHECK(write(m, "junk", 4) == 4);
    usleep(200000);
    CHECK(write(m, "\x03", 1) == 1); /* drops "junk" */
    usleep(200000);
    CHECK(write(m, "\x1b[A\r", 4) == 4); /* the last message again */
    double t0 = moe_test_now();
    while (!f.got3 && moe_test_now() - t0 < 10)
        drain(m, 100000);
    usleep(300000);
    CHECK(write(m, "/quit\r", 6) == 6);
    int st = 0;
    t0 = moe_test_now();
    pid_t w = 0;
    while ((w = waitpid(pid, &st, WNOHANG)) == 0 && moe_test_now() - t0 < 10)
        drain(m, 50000);
    if (w != pid) {
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
    }
    pthread_join(th, NULL);
    close(m);
    char *err = moe_test_read_file_or_fail(errlog, NULL);
    CHECK_MSG(w == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d, stderr: %s", st, err);
    CHECK(f.first_cut);
    CHECK_MSG(strstr(f.body2, "\"again\"") && strstr(f.body2, "tok tok"), "%s", f.body2);
    CHECK_MSG(!strstr(f.body3, "junk"), "%s", f.body3);
    /* The recalled line: "again" as the last user message, after the first "again" turn. */
    const char *first = strstr(f.body3, "\"again\"");
    CHECK_MSG(first && strstr(first + 1, "\"again\""), "%s", f.body3);
    free(err);
    close(f.lfd);
}
