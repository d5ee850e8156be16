/* A small blocking HTTP/1.1 client for the daemon's tests (Unix socket or TCP), with responses
 * parsed by http-parser. Header-only: included by tests/test_http.c, test_api.c, test_daemon.c. */
#ifndef MOE_TEST_HTTPC_H
#define MOE_TEST_HTTPC_H

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <http_parser.h>

#include "store/io.h"

#define HC_UNUSED __attribute__((unused))

struct hc_conn {
    int fd;
    char buf[65536];
    size_t len;          /* unparsed bytes in buf */
};

struct hc_resp {
    int status;
    char *body;
    size_t body_len;
    char headers[8192];  /* "name: value\n" lines, names lower-cased */
    size_t hlen;
    bool keep_alive;
    bool done;
    bool last_was_value;
};

HC_UNUSED static int hc_connect_unix(struct hc_conn *c, const char *path)
{
    memset(c, 0, sizeof *c);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0)
        return -errno;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    if (connect(c->fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        close(c->fd);
        c->fd = -1;
        return -e;
    }
    return 0;
}

HC_UNUSED static int hc_connect_tcp(struct hc_conn *c, int port)
{
    memset(c, 0, sizeof *c);
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0)
        return -errno;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(0x7f000001);
    if (connect(c->fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        close(c->fd);
        c->fd = -1;
        return -e;
    }
    return 0;
}

HC_UNUSED static void hc_close(struct hc_conn *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
}

HC_UNUSED static int hc_send(struct hc_conn *c, const void *data, size_t n)
{
    const char *p = data;
    while (n) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int hc_on_status(http_parser *p, const char *at, size_t n)
{
    (void)p, (void)at, (void)n;
    return 0;
}

static int hc_on_hfield(http_parser *p, const char *at, size_t n)
{
    struct hc_resp *r = p->data;
    if (r->last_was_value && r->hlen + 1 < sizeof r->headers)
        r->headers[r->hlen++] = '\n';
    r->last_was_value = false;
    for (size_t i = 0; i < n && r->hlen + 1 < sizeof r->headers; i++) {
        char ch = at[i];
        r->headers[r->hlen++] = (ch >= 'A' && ch <= 'Z') ? (char)(ch + 32) : ch;
    }
    r->headers[r->hlen] = 0;
    return 0;
}

static int hc_on_hvalue(http_parser *p, const char *at, size_t n)
{
    struct hc_resp *r = p->data;
    if (!r->last_was_value && r->hlen + 2 < sizeof r->headers) {
        r->headers[r->hlen++] = ':';
        r->headers[r->hlen++] = ' ';
    }
    r->last_was_value = true;
    for (size_t i = 0; i < n && r->hlen + 1 < sizeof r->headers; i++)
        r->headers[r->hlen++] = at[i];
    r->headers[r->hlen] = 0;
    return 0;
}

static int hc_on_body(http_parser *p, const char *at, size_t n)
{
    struct hc_resp *r = p->data;
    char *nb = realloc(r->body, r->body_len + n + 1);
    if (!nb)
        return -1;
    r->body = nb;
    memcpy(r->body + r->body_len, at, n);
    r->body_len += n;
    r->body[r->body_len] = 0;
    return 0;
}

static int hc_on_complete(http_parser *p)
{
    struct hc_resp *r = p->data;
    r->done = true;
    r->status = (int)p->status_code;
    r->keep_alive = http_should_keep_alive(p) != 0;
    http_parser_pause(p, 1);
    return 0;
}

static int hc_on_headers(http_parser *p)
{
    struct hc_resp *r = p->data;
    r->status = (int)p->status_code;
    return 0;
}

/* Reads one response. Returns 0, -ETIMEDOUT, -ECONNRESET (closed before a complete response;
 * r->status may still be set when the headers arrived) or -EPROTO. */
HC_UNUSED static int hc_read(struct hc_conn *c, struct hc_resp *r, int timeout_ms)
{
    static const http_parser_settings st = {
        .on_status = hc_on_status,
        .on_header_field = hc_on_hfield,
        .on_header_value = hc_on_hvalue,
        .on_headers_complete = hc_on_headers,
        .on_body = hc_on_body,
        .on_message_complete = hc_on_complete,
    };
    memset(r, 0, sizeof *r);
    http_parser p;
    http_parser_init(&p, HTTP_RESPONSE);
    p.data = r;
    double t0 = moe_now_s();
    bool eof = false;
    for (;;) {
        if (c->len) {
            size_t n = http_parser_execute(&p, &st, c->buf, c->len);
            if (n > c->len)
                n = c->len;
            memmove(c->buf, c->buf + n, c->len - n);
            c->len -= n;
            if (HTTP_PARSER_ERRNO(&p) == HPE_PAUSED)
                return 0;
            if (HTTP_PARSER_ERRNO(&p) != HPE_OK)
                return -EPROTO;
        }
        if (eof) {
            /* A body delimited by the end of the connection. */
            http_parser_execute(&p, &st, NULL, 0);
            return r->done ? 0 : -ECONNRESET;
        }
        long el = (long)((moe_now_s() - t0) * 1000.0);
        if (el >= timeout_ms)
            return -ETIMEDOUT;
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        int pr = poll(&pfd, 1, (int)(timeout_ms - el));
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr <= 0)
            return -ETIMEDOUT;
        ssize_t n = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            eof = true;
        else
            c->len += (size_t)n;
    }
}

HC_UNUSED static void hc_resp_free(struct hc_resp *r)
{
    free(r->body);
    r->body = NULL;
}

/* Value of a response header (name lower-case) copied into out, or NULL. */
HC_UNUSED static const char *hc_header(const struct hc_resp *r, const char *name, char *out,
                                       size_t cap)
{
    size_t nl = strlen(name);
    const char *p = r->headers;
    while (p && *p) {
        if (!strncmp(p, name, nl) && p[nl] == ':') {
            const char *v = p + nl + 2;
            const char *e = strchr(v, '\n');
            size_t n = e ? (size_t)(e - v) : strlen(v);
            if (n >= cap)
                n = cap - 1;
            memcpy(out, v, n);
            out[n] = 0;
            return out;
        }
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    return NULL;
}

/* True when the peer closed the connection within timeout_ms (reads and drops anything else). */
HC_UNUSED static bool hc_wait_closed(struct hc_conn *c, int timeout_ms)
{
    for (int waited = 0; waited < timeout_ms; waited += 50) {
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        if (poll(&pfd, 1, 50) > 0) {
            char tmp[4096];
            ssize_t n = recv(c->fd, tmp, sizeof tmp, 0);
            if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN))
                return true;
        }
    }
    return false;
}

/* One request on a new Unix-socket connection. Returns 0 or a negative errno. */
HC_UNUSED static int hc_request_unix(const char *sock, const char *method, const char *path,
                                     const char *body, struct hc_resp *r, int timeout_ms)
{
    struct hc_conn c;
    int rc = hc_connect_unix(&c, sock);
    if (rc)
        return rc;
    char head[1024];
    size_t bl = body ? strlen(body) : 0;
    int hn = snprintf(head, sizeof head,
                      "%s %s HTTP/1.1\r\nHost: moed\r\nContent-Type: application/json\r\n"
                      "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                      method, path, bl);
    rc = hc_send(&c, head, (size_t)hn);
    if (!rc && bl)
        rc = hc_send(&c, body, bl);
    if (!rc)
        rc = hc_read(&c, r, timeout_ms);
    hc_close(&c);
    return rc;
}

#endif
