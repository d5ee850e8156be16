/* The HTTP layer (daemon/http.c) on real sockets, with an in-process server on its own libuv loop
 * thread: keep-alive, pipelining, malformed requests, header and body limits, streaming,
 * client disconnects, idle timeouts, socket permissions, stale sockets, loopback-only TCP and
 * SO_PEERCRED. */
#include <errno.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <uv.h>

#include "daemon/http.h"
#include "store/err.h"
#include "tests/harness.h"
#include "tests/httpc.h"

struct srv {
    uv_loop_t loop;
    uv_async_t stop;
    struct http_server *http;
    pthread_t thread;
    char path[256];
    int port;
    atomic_int aborts;
    atomic_int requests;
    struct http_conn *slow;      /* a request answered later by a timer */
    uv_timer_t timer;
};

static void on_slow_abort(void *user)
{
    struct srv *s = user;
    s->slow = NULL;
    atomic_fetch_add(&s->aborts, 1);
}

static void on_slow_timer(uv_timer_t *t)
{
    struct srv *s = t->data;
    if (s->slow) {
        http_conn_on_abort(s->slow, NULL, NULL);
        http_respond(s->slow, 200, "text/plain", NULL, "slow\n", 5);
        s->slow = NULL;
    }
}

/* /echo answers with method, path, query, body and peer; /stream sends three chunks; /slow
 * answers after 1 s (or records an abort). */
static void handler(void *user, struct http_request *req)
{
    struct srv *s = user;
    atomic_fetch_add(&s->requests, 1);
    char buf[512];
    if (!strcmp(req->path, "/stream")) {
        http_stream_start(req->conn, 200, "text/event-stream", NULL);
        http_stream_write(req->conn, "data: 1\n\n", 9);
        http_stream_write(req->conn, "data: 2\n\n", 9);
        http_stream_write(req->conn, "data: [DONE]\n\n", 14);
        http_stream_end(req->conn);
        return;
    }
    if (!strcmp(req->path, "/flood")) {
        /* Far more than the write-queue limit, at once: the client does not read. */
        http_conn_on_abort(req->conn, on_slow_abort, s);
        http_stream_start(req->conn, 200, "text/event-stream", NULL);
        static char chunk[8192];
        memset(chunk, 'y', sizeof chunk);
        for (int i = 0; i < 4096; i++)
            if (http_stream_write(req->conn, chunk, sizeof chunk) != 0)
                return;
        http_stream_end(req->conn);
        return;
    }
    if (!strcmp(req->path, "/slow")) {
        s->slow = req->conn;
        http_conn_on_abort(req->conn, on_slow_abort, s);
        uv_timer_start(&s->timer, on_slow_timer, 1000, 0);
        return;
    }
    int n = snprintf(buf, sizeof buf, "%s %s ?%s uid=%d t=%d body=%zu:%.*s", req->method_name,
                     req->path, req->query, req->peer->has_cred ? (int)req->peer->uid : -1,
                     (int)req->peer->transport, req->body_len, (int)(req->body_len < 100 ? req->body_len : 100),
                     req->body);
    http_respond(req->conn, 200, "text/plain", "X-Test: yes\r\n", buf, (size_t)n);
}

static void on_stop(uv_async_t *a)
{
    struct srv *s = a->data;
    http_server_close(s->http);
    uv_close((uv_handle_t *)&s->stop, NULL);
    uv_close((uv_handle_t *)&s->timer, NULL);
}

static void *loop_thread(void *arg)
{
    struct srv *s = arg;
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return NULL;
}

static void srv_start(struct srv *s, const char *dir, const struct http_limits *lim, bool tcp)
{
    memset(s, 0, sizeof *s);
    CHECK(uv_loop_init(&s->loop) == 0);
    CHECK(uv_async_init(&s->loop, &s->stop, on_stop) == 0);
    s->stop.data = s;
    uv_timer_init(&s->loop, &s->timer);
    s->timer.data = s;
    CHECK(http_server_new(&s->http, &s->loop, lim, handler, s) == 0);
    snprintf(s->path, sizeof s->path, "%s/test.sock", dir);
    char err[256];
    int rc = http_server_listen_unix(s->http, s->path, err, sizeof err);
    CHECK_MSG(rc == 0, "listen_unix: %s", err);
    if (tcp) {
        rc = http_server_listen_tcp(s->http, "127.0.0.1:0", err, sizeof err);
        CHECK_MSG(rc == 0, "listen_tcp: %s", err);
        s->port = http_server_tcp_port(s->http);
        CHECK(s->port > 0);
    }
    CHECK(pthread_create(&s->thread, NULL, loop_thread, s) == 0);
}

static void srv_stop(struct srv *s)
{
    uv_async_send(&s->stop);
    pthread_join(s->thread, NULL);
    CHECK(uv_loop_close(&s->loop) == 0);
}

static void srv_default(struct srv *s)
{
    struct http_limits lim;
    http_limits_default(&lim);
    srv_start(s, moe_test_tmpdir(), &lim, true);
}

TEST(http_get_keepalive_and_pipelining)
{
    struct srv s;
    srv_default(&s);
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, s.path) == 0);
    const char *req = "GET /echo?x=1 HTTP/1.1\r\nHost: a\r\n\r\n";
    struct hc_resp r;
    /* The echo handler reports the peer's uid: this process's own, root or not. */
    char want_get[96], want_post[96];
    snprintf(want_get, sizeof want_get, "GET /echo ?x=1 uid=%d t=1 body=0:", (int)getuid());
    snprintf(want_post, sizeof want_post, "POST /echo ? uid=%d t=1 body=3:abc", (int)getuid());
    for (int i = 0; i < 3; i++) {
        CHECK(hc_send(&c, req, strlen(req)) == 0);
        CHECK(hc_read(&c, &r, 5000) == 0);
        CHECK_EQ(r.status, 200);
        CHECK(r.keep_alive);
        CHECK_MSG(strstr(r.body, want_get) != NULL, "body: %s", r.body);
        char v[64];
        CHECK(hc_header(&r, "x-test", v, sizeof v) && !strcmp(v, "yes"));
        hc_resp_free(&r);
    }
    /* Two requests in one write: answered in order. */
    const char *two = "POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /second HTTP/1.1\r\n\r\n";
    CHECK(hc_send(&c, two, strlen(two)) == 0);
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK_MSG(strstr(r.body, want_post) != NULL, "body: %s", r.body);
    hc_resp_free(&r);
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK(strstr(r.body, "GET /second") != NULL);
    hc_resp_free(&r);
    /* Connection: close is honoured. */
    const char *cl = "GET /echo HTTP/1.1\r\nConnection: close\r\n\r\n";
    CHECK(hc_send(&c, cl, strlen(cl)) == 0);
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK(!r.keep_alive);
    hc_resp_free(&r);
    CHECK(hc_wait_closed(&c, 2000));
    hc_close(&c);
    srv_stop(&s);
}

TEST(http_tcp_and_chunked_request_body)
{
    struct srv s;
    srv_default(&s);
    struct hc_conn c;
    CHECK(hc_connect_tcp(&c, s.port) == 0);
    const char *req = "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                      "4\r\nWiki\r\n5\r\npedia\r\n0\r\n\r\n";
    CHECK(hc_send(&c, req, strlen(req)) == 0);
    struct hc_resp r;
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    /* TCP peers have no credentials. */
    CHECK_MSG(strstr(r.body, "uid=-1 t=2 body=9:Wikipedia") != NULL, "body: %s", r.body);
    hc_resp_free(&r);
    hc_close(&c);
    srv_stop(&s);
}

static void expect_error(const char *sock, const char *raw, size_t n, int status)
{
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, sock) == 0);
    CHECK(hc_send(&c, raw, n) == 0);
    struct hc_resp r;
    int rc = hc_read(&c, &r, 5000);
    CHECK_MSG(rc == 0, "read: %d", rc);
    CHECK_MSG(r.status == status, "expected %d, got %d (%s)", status, r.status, r.body ? r.body : "");
    CHECK(r.body && strstr(r.body, "\"error\"") && strstr(r.body, "\"message\""));
    char v[64];
    CHECK(hc_header(&r, "content-type", v, sizeof v) && !strcmp(v, "application/json"));
    hc_resp_free(&r);
    /* The connection is closed after a protocol error. */
    CHECK(hc_wait_closed(&c, 3000));
    hc_close(&c);
}

TEST(http_malformed_requests)
{
    struct srv s;
    srv_default(&s);
    const char *bad[] = {
        "GARBAGE\r\n\r\n",
        "GET\r\n\r\n",
        "GET / HTTP/9.9\r\n\r\n",
        "GET /x HTTP/1.1\r\nBad Header Without Colon\r\n\r\n",
        "POST /x HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        "POST /x HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", /* a TLS ClientHello */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int want = strstr(bad[i], "HTTP/9.9") ? 505 : 400;
        expect_error(s.path, bad[i], strlen(bad[i]), want);
    }
    CHECK_EQ(atomic_load(&s.requests), 0);
    srv_stop(&s);
}

TEST(http_header_and_body_limits)
{
    struct http_limits lim;
    http_limits_default(&lim);
    lim.max_header_bytes = 4096;
    lim.max_body_bytes = 1000;
    struct srv s;
    srv_start(&s, moe_test_tmpdir(), &lim, false);
    /* Huge header. */
    size_t hn = 10000;
    char *big = malloc(hn + 200);
    int n = snprintf(big, 200, "GET /echo HTTP/1.1\r\nX-Big: ");
    memset(big + n, 'a', hn);
    memcpy(big + n + hn, "\r\n\r\n", 4);
    expect_error(s.path, big, (size_t)n + hn + 4, 431);
    /* Huge URL. */
    n = snprintf(big, 200, "GET /");
    memset(big + n, 'b', hn);
    memcpy(big + n + hn, " HTTP/1.1\r\n\r\n", 13);
    expect_error(s.path, big, (size_t)n + hn + 13, 431);
    free(big);
    /* Declared body over the limit: refused before the body is sent. */
    const char *decl = "POST /echo HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n";
    expect_error(s.path, decl, strlen(decl), 413);
    /* Chunked body that grows past the limit. */
    char chunked[4096];
    n = snprintf(chunked, sizeof chunked, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 3; i++) {
        n += snprintf(chunked + n, sizeof chunked - (size_t)n, "1f4\r\n");
        memset(chunked + n, 'x', 500);
        n += 500;
        n += snprintf(chunked + n, sizeof chunked - (size_t)n, "\r\n");
    }
    expect_error(s.path, chunked, (size_t)n, 413);
    /* Exactly at the limit is fine. */
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, s.path) == 0);
    char ok[1200];
    n = snprintf(ok, sizeof ok, "POST /echo HTTP/1.1\r\nContent-Length: 1000\r\n\r\n");
    memset(ok + n, 'y', 1000);
    CHECK(hc_send(&c, ok, (size_t)n + 1000) == 0);
    struct hc_resp r;
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK_EQ(r.status, 200);
    CHECK(strstr(r.body, "body=1000:yyy") != NULL);
    hc_resp_free(&r);
    hc_close(&c);
    CHECK_EQ(atomic_load(&s.requests), 1);
    srv_stop(&s);
}

TEST(http_streaming_response)
{
    struct srv s;
    srv_default(&s);
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, s.path) == 0);
    const char *req = "GET /stream HTTP/1.1\r\n\r\n";
    struct hc_resp r;
    for (int i = 0; i < 2; i++) {
        CHECK(hc_send(&c, req, strlen(req)) == 0);
        CHECK(hc_read(&c, &r, 5000) == 0);
        CHECK_EQ(r.status, 200);
        char v[64];
        CHECK(hc_header(&r, "transfer-encoding", v, sizeof v) && !strcmp(v, "chunked"));
        CHECK_STREQ(r.body, "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n");
        hc_resp_free(&r);
    }
    hc_close(&c);
    /* HTTP/1.0 has no chunked encoding: the body ends with the connection. */
    CHECK(hc_connect_unix(&c, s.path) == 0);
    const char *req10 = "GET /stream HTTP/1.0\r\n\r\n";
    CHECK(hc_send(&c, req10, strlen(req10)) == 0);
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK_STREQ(r.body, "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n");
    hc_resp_free(&r);
    hc_close(&c);
    srv_stop(&s);
}

TEST(http_client_disconnect_aborts_request)
{
    struct srv s;
    srv_default(&s);
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, s.path) == 0);
    const char *req = "GET /slow HTTP/1.1\r\n\r\n";
    CHECK(hc_send(&c, req, strlen(req)) == 0);
    usleep(200000);
    hc_close(&c);
    for (int i = 0; i < 100 && atomic_load(&s.aborts) == 0; i++)
        usleep(10000);
    CHECK_EQ(atomic_load(&s.aborts), 1);
    /* A request that is waited for completes normally. */
    CHECK(hc_connect_unix(&c, s.path) == 0);
    CHECK(hc_send(&c, req, strlen(req)) == 0);
    struct hc_resp r;
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK_STREQ(r.body, "slow\n");
    hc_resp_free(&r);
    hc_close(&c);
    CHECK_EQ(atomic_load(&s.aborts), 1);
    srv_stop(&s);
}

TEST(http_idle_timeout_and_max_conns)
{
    struct http_limits lim;
    http_limits_default(&lim);
    lim.idle_timeout_ms = 300;
    lim.max_conns = 2;
    lim.admin_reserve = 0;
    struct srv s;
    srv_start(&s, moe_test_tmpdir(), &lim, false);
    struct hc_conn a, b, c;
    CHECK(hc_connect_unix(&a, s.path) == 0);
    CHECK(hc_connect_unix(&b, s.path) == 0);
    usleep(50000);
    /* The third connection is over the limit: a 503, then the close. */
    CHECK(hc_connect_unix(&c, s.path) == 0);
    struct hc_resp r3;
    CHECK_EQ(hc_read(&c, &r3, 1000), 0);
    CHECK_EQ(r3.status, 503);
    hc_resp_free(&r3);
    hc_close(&c);
    /* A half-sent request also counts as idle: both are closed after the timeout. */
    CHECK(hc_send(&b, "GET /echo HTTP/1.1\r\n", 20) == 0);
    CHECK(hc_wait_closed(&a, 2000));
    CHECK(hc_wait_closed(&b, 2000));
    hc_close(&a);
    hc_close(&b);
    srv_stop(&s);
}

TEST(http_unix_socket_mode_and_stale_socket)
{
    const char *dir = moe_test_tmpdir();
    struct srv s;
    srv_default(&s);
    struct stat st;
    CHECK(stat(s.path, &st) == 0);
    CHECK(S_ISSOCK(st.st_mode));
    CHECK_EQ(st.st_mode & 0777, 0660);
    /* A second server on the same path must refuse: the first one answers there. */
    uv_loop_t loop;
    uv_loop_init(&loop);
    struct http_server *h2;
    CHECK(http_server_new(&h2, &loop, NULL, handler, NULL) == 0);
    char err[256];
    int rc = http_server_listen_unix(h2, s.path, err, sizeof err);
    CHECK_EQ(rc, -EADDRINUSE);
    CHECK(strstr(err, "already running") != NULL);
    srv_stop(&s);
    /* A socket file nobody listens on is stale and gets replaced. */
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s/stale.sock", dir);
    CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
    close(fd);
    rc = http_server_listen_unix(h2, a.sun_path, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    /* A regular file is never removed. */
    char file[300];
    snprintf(file, sizeof file, "%s/file", dir);
    FILE *f = fopen(file, "w");
    fclose(f);
    rc = http_server_listen_unix(h2, file, err, sizeof err);
    CHECK(rc != 0);
    CHECK(strstr(err, "not a socket") != NULL);
    CHECK(stat(file, &st) == 0);
    http_server_close(h2);
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK(uv_loop_close(&loop) == 0);
    /* Closing removed the socket file. */
    CHECK(stat(a.sun_path, &st) != 0);
}

TEST(http_listen_loopback_only)
{
    struct sockaddr_storage ss;
    char err[256];
    CHECK_EQ(http_parse_listen("127.0.0.1:8080", &ss, err, sizeof err), 0);
    CHECK_EQ(http_parse_listen("127.1.2.3:1", &ss, err, sizeof err), 0);
    CHECK_EQ(http_parse_listen("[::1]:8080", &ss, err, sizeof err), 0);
    CHECK_EQ(http_parse_listen("localhost:80", &ss, err, sizeof err), 0);
    CHECK_EQ(http_parse_listen("8080", &ss, err, sizeof err), 0);
    CHECK_EQ(http_parse_listen("0.0.0.0:8080", &ss, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "loopback") != NULL);
    CHECK_EQ(http_parse_listen("10.0.0.1:80", &ss, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(http_parse_listen("[::]:80", &ss, err, sizeof err), MOE_ERANGE);
    CHECK_EQ(http_parse_listen("[::ffff:127.0.0.1]:80", &ss, err, sizeof err), 0);
    CHECK_EQ(http_parse_listen("example.com:80", &ss, err, sizeof err), MOE_EFORMAT);
    CHECK_EQ(http_parse_listen("127.0.0.1:99999", &ss, err, sizeof err), MOE_EFORMAT);
    CHECK_EQ(http_parse_listen("127.0.0.1:", &ss, err, sizeof err), MOE_EFORMAT);
    CHECK_EQ(http_parse_listen("", &ss, err, sizeof err), MOE_EFORMAT);
}

/* SO_PEERCRED reports the connecting process's uid (as root: a child that became nobody). */
TEST(http_peer_credentials_other_uid)
{
    if (geteuid() != 0)
        moe_test_skip("needs root to switch to another uid");
    struct passwd *pw = getpwnam("nobody");
    if (!pw)
        moe_test_skip("no user 'nobody'");
    /* nobody must be able to reach the socket: a world-traversable directory, a 0666 socket. */
    char dir[] = "/tmp/moe-http-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    chmod(dir, 0755);
    struct http_limits lim;
    http_limits_default(&lim);
    struct srv s;
    srv_start(&s, dir, &lim, false);
    chmod(s.path, 0666);
    uid_t uid = pw->pw_uid;
    gid_t gid = pw->pw_gid;
    int pfd[2];
    CHECK(pipe(pfd) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        if (setgid(gid) != 0 || setuid(uid) != 0)
            _exit(2);
        struct hc_resp r;
        if (hc_request_unix(s.path, "GET", "/echo", NULL, &r, 5000) != 0)
            _exit(3);
        ssize_t w = write(pfd[1], r.body, r.body_len);
        (void)w;
        _exit(0);
    }
    close(pfd[1]);
    char buf[512] = {0};
    ssize_t n = 0, k;
    while ((k = read(pfd[0], buf + n, sizeof buf - 1 - (size_t)n)) > 0)
        n += k;
    close(pfd[0]);
    int st;
    waitpid(pid, &st, 0);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
    char want[64];
    snprintf(want, sizeof want, "uid=%d ", (int)uid);
    CHECK_MSG(strstr(buf, want) != NULL, "got: %s", buf);
    srv_stop(&s);
    rmdir(dir);
}

/* A refused body over TCP: the client is still sending when the 413 goes out; it must still be
 * able to read the response (no reset before it arrives). */
TEST(http_tcp_413_while_client_sends)
{
    struct http_limits lim;
    http_limits_default(&lim);
    lim.max_body_bytes = 1000;
    struct srv s;
    srv_start(&s, moe_test_tmpdir(), &lim, true);
    struct hc_conn c;
    CHECK(hc_connect_tcp(&c, s.port) == 0);
    const char *head = "POST /echo HTTP/1.1\r\nContent-Length: 200000\r\n\r\n";
    CHECK(hc_send(&c, head, strlen(head)) == 0);
    char *body = malloc(200000);
    memset(body, 'z', 200000);
    /* Part of the body may be refused by a closed peer; that is fine. */
    for (int i = 0; i < 4; i++)
        if (hc_send(&c, body + i * 50000, 50000) != 0)
            break;
    free(body);
    struct hc_resp r;
    CHECK(hc_read(&c, &r, 5000) == 0);
    CHECK_EQ(r.status, 413);
    hc_resp_free(&r);
    hc_close(&c);
    CHECK_EQ(atomic_load(&s.requests), 0);
    srv_stop(&s);
}

/* "Expect: 100-continue" gets an interim 100 before the client sends its body (curl waits a
 * second for it otherwise). */
TEST(http_expect_continue)
{
    struct srv s;
    srv_default(&s);
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, s.path) == 0);
    const char *head = "POST /echo HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n";
    CHECK(hc_send(&c, head, strlen(head)) == 0);
    struct hc_resp r;
    CHECK(hc_read(&c, &r, 2000) == 0);
    CHECK_EQ(r.status, 100);
    hc_resp_free(&r);
    CHECK(hc_send(&c, "hello", 5) == 0);
    CHECK(hc_read(&c, &r, 2000) == 0);
    CHECK_EQ(r.status, 200);
    CHECK(strstr(r.body, "body=5:hello") != NULL);
    hc_resp_free(&r);
    hc_close(&c);
    srv_stop(&s);
}

/* The responses the server sends on its own are reported (for /metrics): parser errors, and a
 * 408 for a request cut short by the idle timeout (a connection idle between requests is just
 * closed, without one). */
static atomic_int status_seen[6];

static void count_status(void *user, int status)
{
    (void)user;
    if (status >= 100 && status < 600)
        atomic_fetch_add(&status_seen[status / 100], 1);
}

TEST(http_own_responses_counted_and_408_on_timeout)
{
    struct http_limits lim;
    http_limits_default(&lim);
    lim.idle_timeout_ms = 300;
    struct srv s;
    srv_start(&s, moe_test_tmpdir(), &lim, false);
    for (int i = 0; i < 6; i++)
        atomic_store(&status_seen[i], 0);
    http_server_on_status(s.http, count_status, NULL);
    expect_error(s.path, "GARBAGE\r\n\r\n", 11, 400);
    expect_error(s.path, "GET / HTTP/9.9\r\n\r\n", 18, 505);
    CHECK_EQ(atomic_load(&status_seen[4]), 1);
    CHECK_EQ(atomic_load(&status_seen[5]), 1);
    /* Half a request: 408, then the close. */
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, s.path) == 0);
    const char *half = "POST /echo HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"a\":";
    CHECK(hc_send(&c, half, strlen(half)) == 0);
    struct hc_resp r;
    CHECK_EQ(hc_read(&c, &r, 3000), 0);
    CHECK_EQ(r.status, 408);
    hc_resp_free(&r);
    CHECK(hc_wait_closed(&c, 2000));
    hc_close(&c);
    CHECK_EQ(atomic_load(&status_seen[4]), 2);
    /* Idle between requests: closed, nothing sent, nothing counted. */
    CHECK(hc_connect_unix(&c, s.path) == 0);
    CHECK(hc_wait_closed(&c, 2000));
    hc_close(&c);
    CHECK_EQ(atomic_load(&status_seen[4]), 2);
    srv_stop(&s);
}

/* Request bodies of all connections share one memory budget: a body that would take the total
 * past it gets 503 and its connection is closed; the others finish, and the budget comes back. */
TEST(http_global_body_budget)
{
    struct http_limits lim;
    http_limits_default(&lim);
    lim.max_body_bytes = 512 << 10;
    lim.max_total_body_bytes = 1 << 20;
    struct srv s;
    srv_start(&s, moe_test_tmpdir(), &lim, false);
    enum { BODY = 400 << 10, PART = 380 << 10 };
    char *data = malloc(BODY);
    CHECK(data);
    memset(data, 'x', BODY);
    char head[128];
    int hn = snprintf(head, sizeof head, "POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n", BODY);
    struct hc_conn c[3];
    for (int i = 0; i < 3; i++) {
        CHECK(hc_connect_unix(&c[i], s.path) == 0);
        CHECK(hc_send(&c[i], head, (size_t)hn) == 0);
        CHECK(hc_send(&c[i], data, PART) == 0);
        usleep(100000);
    }
    /* The third pushed the total (3 x 380 KiB) past 1 MiB. */
    struct hc_resp r;
    CHECK_EQ(hc_read(&c[2], &r, 3000), 0);
    CHECK_EQ(r.status, 503);
    CHECK(strstr(r.body, "server_busy"));
    hc_resp_free(&r);
    hc_close(&c[2]);
    for (int i = 0; i < 2; i++) {
        CHECK(hc_send(&c[i], data + PART, BODY - PART) == 0);
        CHECK_EQ(hc_read(&c[i], &r, 5000), 0);
        CHECK_EQ(r.status, 200);
        hc_resp_free(&r);
        hc_close(&c[i]);
    }
    /* With the bodies answered the budget is free again. */
    CHECK(hc_connect_unix(&c[0], s.path) == 0);
    CHECK(hc_send(&c[0], head, (size_t)hn) == 0);
    CHECK(hc_send(&c[0], data, BODY) == 0);
    CHECK_EQ(hc_read(&c[0], &r, 5000), 0);
    CHECK_EQ(r.status, 200);
    hc_resp_free(&r);
    hc_close(&c[0]);
    free(data);
    srv_stop(&s);
}

/* A client that does not read a stream is dropped once its queue passes the limit, and the
 * handler hears of it (the generation would be cancelled), instead of the daemon buffering it. */
TEST(http_client_that_never_reads_is_dropped)
{
    struct http_limits lim;
    http_limits_default(&lim);
    lim.max_write_queue = 1 << 20;
    struct srv s;
    srv_start(&s, moe_test_tmpdir(), &lim, false);
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, s.path) == 0);
    const char *req = "GET /flood HTTP/1.1\r\n\r\n";
    CHECK(hc_send(&c, req, strlen(req)) == 0);
    for (int i = 0; i < 100 && atomic_load(&s.aborts) == 0; i++)
        usleep(20000);
    CHECK_EQ(atomic_load(&s.aborts), 1);
    CHECK(hc_wait_closed(&c, 5000));
    hc_close(&c);
    srv_stop(&s);
}

/* A request trickled in a byte at a time gets its 408 at the idle timeout counted from its first
 * byte: the bytes that keep arriving do not extend it (slowloris). */
TEST(http_trickled_request_times_out)
{
    struct http_limits lim;
    http_limits_default(&lim);
    lim.idle_timeout_ms = 300;
    struct srv s;
    srv_start(&s, moe_test_tmpdir(), &lim, false);
    struct hc_conn c;
    CHECK(hc_connect_unix(&c, s.path) == 0);
    const char *req = "GET /echo HTTP/1.1\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    double t0 = moe_test_now();
    bool answered = false;
    char buf[512];
    size_t got = 0;
    for (size_t i = 0; i < strlen(req) && !answered; i++) {
        if (hc_send(&c, req + i, 1) != 0)
            break;
        usleep(50000);
        struct pollfd pfd = {.fd = c.fd, .events = POLLIN};
        if (poll(&pfd, 1, 0) > 0) {
            ssize_t n = recv(c.fd, buf + got, sizeof buf - 1 - got, 0);
            if (n > 0)
                got += (size_t)n;
            answered = n != 0;
        }
    }
    double dt = moe_test_now() - t0;
    buf[got] = 0;
    CHECK_MSG(answered, "no answer after %.2f s of trickled bytes", dt);
    CHECK_MSG(strstr(buf, "HTTP/1.1 408"), "%s", buf);
    CHECK_MSG(dt < 1.5, "answered after %.2f s", dt);
    CHECK(hc_wait_closed(&c, 2000));
    hc_close(&c);
    CHECK_EQ(atomic_load(&s.requests), 0);
    srv_stop(&s);
}

/* Connection limits are per listener (TCP clients cannot lock out the Unix socket), and on the
 * Unix socket root and the daemon's uid get a reserve beyond the limit. */
TEST(http_conn_limits_per_listener_and_admin_reserve)
{
    struct http_limits lim;
    http_limits_default(&lim);
    lim.max_conns = 2;
    lim.admin_reserve = 1;
    struct srv s;
    srv_start(&s, moe_test_tmpdir(), &lim, true);
    struct hc_conn t[3], u[4];
    for (int i = 0; i < 3; i++)
        CHECK(hc_connect_tcp(&t[i], s.port) == 0);
    struct hc_resp r;
    CHECK_EQ(hc_read(&t[2], &r, 2000), 0); /* TCP over its limit */
    CHECK_EQ(r.status, 503);
    hc_resp_free(&r);
    /* The Unix socket still takes its own two, plus one from the reserve (we are root or the
     * server's own uid), then refuses. */
    for (int i = 0; i < 4; i++)
        CHECK(hc_connect_unix(&u[i], s.path) == 0);
    CHECK_EQ(hc_read(&u[3], &r, 2000), 0);
    CHECK_EQ(r.status, 503);
    hc_resp_free(&r);
    for (int i = 0; i < 3; i++) {
        const char *req = "GET /echo HTTP/1.1\r\n\r\n";
        CHECK(hc_send(&u[i], req, strlen(req)) == 0);
        CHECK_EQ(hc_read(&u[i], &r, 2000), 0);
        CHECK_EQ(r.status, 200);
        hc_resp_free(&r);
    }
    for (int i = 0; i < 3; i++)
        hc_close(&t[i]);
    for (int i = 0; i < 4; i++)
        hc_close(&u[i]);
    srv_stop(&s);
}
