/* HTTP/1.1 server: see http.h. One libuv loop, one parser per connection, one outstanding
 * request per connection (pipelined requests wait in the input buffer). */
#include "daemon/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <http_parser.h>

#include "store/buf.h"
#include "store/err.h"

#define MAX_LISTENERS 4

/* A listening or connected socket of either transport, usable as the generic libuv types. */
union stream_handle {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
};

struct listener {
    union stream_handle h;
    struct http_server *srv;
    enum http_transport transport;
    bool open;
    uint32_t n_conns;           /* live connections accepted here */
};

struct http_conn {
    union stream_handle h;
    uv_timer_t timer;
    struct listener *lst;       /* where it was accepted (its count includes it) */
    int handles_open;           /* h and timer; freed when both closed */
    struct http_server *srv;
    struct http_conn *prev, *next;
    http_parser parser;
    struct http_peer peer;

    /* Bytes read but not parsed yet (only while a request is outstanding). */
    char *in;
    size_t in_len, in_cap;

    /* The request being parsed. */
    char *url;
    size_t url_len, url_cap;
    char *body;
    size_t body_len, body_cap;
    char *ctype;
    size_t ctype_len;
    char *auth;                 /* the Authorization header, or NULL */
    size_t auth_len;
    char field[32];             /* current header name, lower-cased, truncated */
    size_t field_len;
    bool in_value;
    size_t header_bytes;
    bool expect_continue;       /* "Expect: 100-continue" */
    int fail_status;            /* set by a parser callback that rejected the request */
    const char *fail_msg;
    bool complete;

    char *path, *query;
    struct http_request req;
    bool busy;                  /* request handed to the handler, not answered yet */
    bool streaming;
    bool keep_alive;
    bool http10;
    bool close_after;           /* close once queued writes are done */
    bool closing;
    bool in_process;
    bool lingering;             /* error sent, write side shut: draining input until EOF */
    bool started;               /* a request's first bytes arrived; not answered yet */
    bool overflow;              /* the client stopped reading: closing on the next iteration */
    uv_shutdown_t shutdown_req;
    http_abort_fn abort_fn;
    void *abort_user;
    size_t write_queue;
    uint32_t n_writes;
};

struct http_server {
    uv_loop_t *loop;
    struct http_limits lim;
    http_handler_fn handler;
    void *user;
    struct listener listeners[MAX_LISTENERS];
    int n_listeners;
    char unix_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    dev_t unix_dev;             /* the socket file bound at unix_path: removed at stop only */
    ino_t unix_ino;             /* while the path still names it */
    int tcp_port;
    struct http_conn *conns;
    uint32_t n_conns, n_busy;
    uint64_t next_id;
    size_t body_total;          /* request body bytes held by all connections */
    void (*on_status)(void *user, int status); /* responses the server sends itself */
    void *on_status_user;
    int refs;                   /* open listener handles + live connections */
    bool closing;
};

struct wreq {
    uv_write_t w;
    struct http_conn *c;
    size_t len;
    char data[];
};

static void conn_close(struct http_conn *c);
static const http_parser_settings parser_settings;
static void conn_process(struct http_conn *c);

void http_server_on_status(struct http_server *s, void (*fn)(void *user, int status), void *user)
{
    s->on_status = fn;
    s->on_status_user = user;
}

void http_limits_default(struct http_limits *l)
{
    l->max_header_bytes = 16 * 1024;
    l->max_body_bytes = 8u << 20;
    l->max_total_body_bytes = (size_t)256 << 20;
    l->max_write_queue = (size_t)4 << 20;
    l->idle_timeout_ms = 60000;
    l->max_conns = 1024;
    l->admin_reserve = 16;
}

const char *http_status_text(int status)
{
    switch (status) {
    case 200: return "OK";
    case 201: return "Created";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
    }
}

static void server_unref(struct http_server *s)
{
    if (--s->refs == 0 && s->closing)
        free(s);
}

/* ---- writing ---- */

static void on_linger_timeout(uv_timer_t *t)
{
    conn_close(t->data);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    (void)req, (void)status;
}

/* Closing right after an error response while the client is still sending (a body we refused)
 * makes TCP reset the connection, and the client may lose the response. So the write side is
 * shut down first and the rest of the input is read and dropped until EOF (at most 2 s). */
static void conn_linger(struct http_conn *c)
{
    if (c->closing || c->lingering)
        return;
    c->lingering = true;
    if (uv_shutdown(&c->shutdown_req, &c->h.stream, on_shutdown) != 0) {
        conn_close(c);
        return;
    }
    uv_timer_start(&c->timer, on_linger_timeout, 2000, 0);
}

static void on_write(uv_write_t *w, int status)
{
    struct wreq *r = (struct wreq *)w;
    struct http_conn *c = r->c;
    c->write_queue -= r->len;
    c->n_writes--;
    free(r);
    if (status < 0)
        conn_close(c);
    else if (c->close_after && c->n_writes == 0)
        conn_linger(c);
}

static void on_deferred_close(uv_timer_t *t)
{
    conn_close(t->data);
}

/* A write that fails synchronously happens inside the owner's call (http_respond from a token
 * callback...): closing there would run the abort callback under the caller's feet, so the close
 * happens on the next loop iteration instead. */
static void conn_fail_write(struct http_conn *c)
{
    if (c->closing)
        return;
    c->close_after = true;
    uv_read_stop(&c->h.stream);
    uv_timer_start(&c->timer, on_deferred_close, 0, 0);
}

/* Queues n bytes (copied) made of up to three pieces. */
static int conn_write3(struct http_conn *c, const void *a, size_t na, const void *b, size_t nb,
                       const void *d, size_t nd)
{
    if (c->closing)
        return -EPIPE;
    size_t n = na + nb + nd;
    struct wreq *r = malloc(sizeof *r + (n ? n : 1));
    if (!r) {
        conn_fail_write(c);
        return -ENOMEM;
    }
    r->c = c;
    r->len = n;
    if (na)
        memcpy(r->data, a, na);
    if (nb)
        memcpy(r->data + na, b, nb);
    if (nd)
        memcpy(r->data + na + nb, d, nd);
    uv_buf_t buf = uv_buf_init(r->data, (unsigned)n);
    int rc = uv_write(&r->w, &c->h.stream, &buf, 1, on_write);
    if (rc < 0) {
        free(r);
        conn_fail_write(c);
        return rc;
    }
    c->write_queue += n;
    c->n_writes++;
    return 0;
}

/* ---- request lifecycle ---- */

/* A request's body leaves the global budget; a large buffer is given back, so that connections
 * that once carried a big body do not keep it. */
static void release_body(struct http_conn *c)
{
    c->srv->body_total -= c->body_len;
    c->body_len = 0;
    if (c->body_cap > (256u << 10)) {
        free(c->body);
        c->body = NULL;
        c->body_cap = 0;
    }
}

static void reset_request(struct http_conn *c)
{
    c->url_len = 0;
    release_body(c);
    c->ctype_len = 0;
    c->auth_len = 0;
    c->field_len = 0;
    c->in_value = false;
    c->header_bytes = 0;
    c->fail_status = 0;
    c->fail_msg = NULL;
    c->complete = false;
    c->expect_continue = false;
    c->started = false;
    free(c->path);
    c->path = NULL;
    c->query = NULL;
}

static void send_error(struct http_conn *c, int status, const char *msg);

/* Idle: a connection between requests is closed; one whose request was cut short (headers or
 * body still coming) gets a 408 first. */
static void on_timer(uv_timer_t *t)
{
    struct http_conn *c = t->data;
    if (c->busy)
        return;
    if (c->started && !c->closing && !c->close_after && !c->lingering) {
        send_error(c, 408, "the request was not received in time");
        return;
    }
    conn_close(c);
}

static void on_overflow(uv_timer_t *t)
{
    conn_close(t->data);
}

static void timer_arm(struct http_conn *c)
{
    if (!c->closing && !c->close_after && !c->overflow)
        uv_timer_start(&c->timer, on_timer, c->srv->lim.idle_timeout_ms, 0);
}

/* The outstanding request has been answered completely. */
static void finish_request(struct http_conn *c)
{
    if (!c->busy)
        return;
    c->busy = false;
    c->streaming = false;
    c->abort_fn = NULL;
    c->abort_user = NULL;
    c->srv->n_busy--;
    reset_request(c);
    if (!c->keep_alive) {
        c->close_after = true;
        if (c->n_writes == 0)
            conn_close(c);
        return;
    }
    timer_arm(c);
    if (!c->in_process)
        conn_process(c);
}

static void send_error(struct http_conn *c, int status, const char *msg)
{
    if (c->srv->on_status)
        c->srv->on_status(c->srv->on_status_user, status);
    char body[512];
    const char *code = status == 413 ? "request_too_large"
                     : status == 431 ? "headers_too_large"
                     : status == 408 ? "timeout"
                     : status == 503 ? "server_busy" : "bad_request";
    int n = snprintf(body, sizeof body,
                     "{\"error\":{\"message\":\"%s\",\"type\":\"invalid_request_error\","
                     "\"code\":\"%s\"}}",
                     msg, code);
    char head[256];
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                      "Content-Length: %d\r\nConnection: close\r\n\r\n",
                      status, http_status_text(status), n);
    c->close_after = true;
    conn_write3(c, head, (size_t)hn, body, (size_t)n, NULL, 0);
}

static void dispatch(struct http_conn *c)
{
    struct http_server *s = c->srv;
    struct http_parser_url u;
    http_parser_url_init(&u);
    if (c->url_len == 0 || http_parser_parse_url(c->url, c->url_len, 0, &u) != 0 ||
        !(u.field_set & (1 << UF_PATH))) {
        send_error(c, 400, "malformed request target");
        return;
    }
    size_t plen = u.field_data[UF_PATH].len;
    size_t qlen = (u.field_set & (1 << UF_QUERY)) ? u.field_data[UF_QUERY].len : 0;
    c->path = malloc(plen + qlen + 2);
    if (!c->path) {
        conn_close(c);
        return;
    }
    memcpy(c->path, c->url + u.field_data[UF_PATH].off, plen);
    c->path[plen] = 0;
    c->query = c->path + plen + 1;
    if (qlen)
        memcpy(c->query, c->url + u.field_data[UF_QUERY].off, qlen);
    c->query[qlen] = 0;

    if (!c->body) {
        c->body = malloc(1);
        if (!c->body) {
            conn_close(c);
            return;
        }
    }
    c->body[c->body_len] = 0;
    if (c->ctype)
        c->ctype[c->ctype_len] = 0;
    if (c->auth)
        c->auth[c->auth_len] = 0;

    c->req = (struct http_request){
        .conn = c,
        .method = c->parser.method,
        .method_name = http_method_str(c->parser.method),
        .path = c->path,
        .query = c->query,
        .body = c->body,
        .body_len = c->body_len,
        .content_type = c->ctype ? c->ctype : "",
        .authorization = c->auth && c->auth_len ? c->auth : NULL,
        .peer = &c->peer,
        .id = ++s->next_id,
    };
    c->busy = true;
    s->n_busy++;
    uv_timer_stop(&c->timer);
    s->handler(s->user, &c->req);
}

/* Runs the parser over buffered input until it needs more bytes or a request is outstanding. */
static void conn_process(struct http_conn *c)
{
    c->in_process = true;
    while (!c->busy && !c->closing && !c->close_after && c->in_len > 0) {
        size_t n = http_parser_execute(&c->parser, &parser_settings, c->in, c->in_len);
        enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
        if (n > c->in_len)
            n = c->in_len;
        memmove(c->in, c->in + n, c->in_len - n);
        c->in_len -= n;
        if (e == HPE_PAUSED) {
            http_parser_pause(&c->parser, 0);
            if (c->complete)
                dispatch(c);
            continue;
        }
        if (e != HPE_OK) {
            if (c->fail_status)
                send_error(c, c->fail_status, c->fail_msg);
            else
                send_error(c, 400, "malformed HTTP request");
            break;
        }
        break; /* all consumed, waiting for more */
    }
    c->in_process = false;
}

/* ---- parser callbacks ---- */

static int header_budget(struct http_conn *c, size_t n)
{
    c->header_bytes += n;
    if (c->header_bytes > c->srv->lim.max_header_bytes) {
        c->fail_status = 431;
        c->fail_msg = "request line and headers exceed the size limit";
        return -1;
    }
    return 0;
}

static int cb_message_begin(http_parser *p)
{
    struct http_conn *c = p->data;
    reset_request(c);
    c->started = true;
    return 0;
}

static int cb_url(http_parser *p, const char *at, size_t n)
{
    struct http_conn *c = p->data;
    if (header_budget(c, n))
        return -1;
    return moe_buf_append(&c->url, &c->url_len, &c->url_cap, at, n) ? -1 : 0;
}

static int cb_header_field(http_parser *p, const char *at, size_t n)
{
    struct http_conn *c = p->data;
    if (header_budget(c, n))
        return -1;
    if (c->in_value) {
        c->field_len = 0;
        c->in_value = false;
    }
    for (size_t i = 0; i < n && c->field_len < sizeof c->field - 1; i++) {
        char ch = at[i];
        c->field[c->field_len++] = (ch >= 'A' && ch <= 'Z') ? (char)(ch + 32) : ch;
    }
    c->field[c->field_len] = 0;
    return 0;
}

static int cb_header_value(http_parser *p, const char *at, size_t n)
{
    struct http_conn *c = p->data;
    if (header_budget(c, n))
        return -1;
    c->in_value = true;
    if (!strcmp(c->field, "expect") && n >= 12 && !strncasecmp(at, "100-continue", 12))
        c->expect_continue = true;
    if (!strcmp(c->field, "content-type") || !strcmp(c->field, "authorization")) {
        bool ct = c->field[0] == 'c';
        char **buf = ct ? &c->ctype : &c->auth;
        size_t *len = ct ? &c->ctype_len : &c->auth_len;
        size_t cap = c->srv->lim.max_header_bytes + 1;
        if (!*buf) {
            *buf = malloc(cap);
            if (!*buf)
                return -1;
        }
        if (*len + n < cap) {
            memcpy(*buf + *len, at, n);
            *len += n;
        }
    }
    return 0;
}

static int cb_headers_complete(http_parser *p)
{
    struct http_conn *c = p->data;
    if ((p->flags & F_CONTENTLENGTH) && p->content_length != ULLONG_MAX &&
        p->content_length > c->srv->lim.max_body_bytes) {
        c->fail_status = 413;
        c->fail_msg = "request body exceeds the size limit";
        return -1;
    }
    c->http10 = p->http_major == 1 && p->http_minor == 0;
    if (p->http_major != 1) {
        c->fail_status = 505;
        c->fail_msg = "only HTTP/1.x is supported";
        return -1;
    }
    /* curl waits a second for this before sending a body over 1 KiB. */
    if (c->expect_continue && !c->http10)
        conn_write3(c, "HTTP/1.1 100 Continue\r\n\r\n", 25, NULL, 0, NULL, 0);
    return 0;
}

static int cb_body(http_parser *p, const char *at, size_t n)
{
    struct http_conn *c = p->data;
    struct http_server *s = c->srv;
    if (c->body_len + n > s->lim.max_body_bytes) {
        c->fail_status = 413;
        c->fail_msg = "request body exceeds the size limit";
        return -1;
    }
    if (s->lim.max_total_body_bytes && s->body_total + n > s->lim.max_total_body_bytes) {
        c->fail_status = 503;
        c->fail_msg = "too many request bodies in flight; retry later";
        return -1;
    }
    if (moe_buf_append(&c->body, &c->body_len, &c->body_cap, at, n))
        return -1;
    s->body_total += n;
    return 0;
}

static int cb_message_complete(http_parser *p)
{
    struct http_conn *c = p->data;
    c->complete = true;
    c->keep_alive = http_should_keep_alive(p) != 0;
    http_parser_pause(p, 1);
    return 0;
}

static const http_parser_settings parser_settings = {
    .on_message_begin = cb_message_begin,
    .on_url = cb_url,
    .on_header_field = cb_header_field,
    .on_header_value = cb_header_value,
    .on_headers_complete = cb_headers_complete,
    .on_body = cb_body,
    .on_message_complete = cb_message_complete,
};

/* ---- connections ---- */

static void on_conn_handle_closed(uv_handle_t *h)
{
    struct http_conn *c = h->data;
    if (--c->handles_open > 0)
        return;
    struct http_server *s = c->srv;
    free(c->in);
    free(c->url);
    free(c->body);
    free(c->ctype);
    free(c->auth);
    free(c->path);
    free(c);
    server_unref(s);
}

static void conn_close(struct http_conn *c)
{
    if (c->closing)
        return;
    c->closing = true;
    struct http_server *s = c->srv;
    s->body_total -= c->body_len;
    c->body_len = 0;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    s->n_conns--;
    if (c->lst)
        c->lst->n_conns--;
    if (c->busy) {
        http_abort_fn fn = c->abort_fn;
        void *u = c->abort_user;
        c->busy = false;
        c->abort_fn = NULL;
        s->n_busy--;
        if (fn)
            fn(u);
    }
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, on_conn_handle_closed);
    uv_close(&c->h.handle, on_conn_handle_closed);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    struct http_conn *c = h->data;
    (void)suggested;
    size_t want = 64 * 1024;
    if (c->in_cap - c->in_len < want) {
        size_t nc = c->in_len + want;
        char *nb = realloc(c->in, nc);
        if (!nb) {
            *buf = uv_buf_init(NULL, 0);
            return;
        }
        c->in = nb;
        c->in_cap = nc;
    }
    *buf = uv_buf_init(c->in + c->in_len, (unsigned)(c->in_cap - c->in_len));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    struct http_conn *c = st->data;
    (void)buf;
    if (nread < 0) {
        /* EOF or error: a client that goes away while its request is outstanding aborts it. */
        conn_close(c);
        return;
    }
    if (nread == 0)
        return;
    if (c->lingering) {
        c->in_len = 0;
        return;
    }
    c->in_len += (size_t)nread;
    /* A client that keeps sending while its request is outstanding must not make us buffer
     * without bound. */
    if (c->in_len > c->srv->lim.max_header_bytes + c->srv->lim.max_body_bytes + 65536) {
        conn_close(c);
        return;
    }
    if (c->close_after)
        return;
    /* Between requests any byte restarts the idle timer; once a request has begun, its deadline
     * stays where its first byte put it, so a client trickling bytes (slowloris) cannot hold the
     * connection open longer than the timeout per request. */
    if (!c->busy && !c->started)
        timer_arm(c);
    conn_process(c);
}

static void on_connection(uv_stream_t *ls, int status)
{
    struct listener *l = ls->data;
    struct http_server *s = l->srv;
    if (status < 0)
        return;
    struct http_conn *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->srv = s;
    int rc = l->transport == HTTP_TRANSPORT_UNIX ? uv_pipe_init(s->loop, &c->h.pipe, 0)
                                                 : uv_tcp_init(s->loop, &c->h.tcp);
    if (rc < 0) {
        free(c);
        return;
    }
    uv_timer_init(s->loop, &c->timer);
    c->h.handle.data = c;
    c->timer.data = c;
    c->handles_open = 2;
    s->refs++;
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    c->lst = l;
    l->n_conns++;
    if (uv_accept(ls, &c->h.stream) < 0 || s->closing) {
        conn_close(c);
        return;
    }
    c->peer.transport = l->transport;
    if (l->transport == HTTP_TRANSPORT_UNIX) {
        uv_os_fd_t fd;
        struct ucred cred;
        socklen_t len = sizeof cred;
        if (uv_fileno(&c->h.handle, &fd) == 0 &&
            getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
            c->peer.has_cred = true;
            c->peer.pid = cred.pid;
            c->peer.uid = cred.uid;
            c->peer.gid = cred.gid;
        }
    } else {
        uv_tcp_nodelay(&c->h.tcp, 1);
    }
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    /* Over the listener's limit: a 503 rather than a silent close; on the Unix socket root and
     * the daemon's own uid have a reserve beyond it, so an operator can still look in. */
    uint32_t limit = s->lim.max_conns;
    if (l->transport == HTTP_TRANSPORT_UNIX && c->peer.has_cred &&
        (c->peer.uid == 0 || c->peer.uid == geteuid()))
        limit += s->lim.admin_reserve;
    if (l->n_conns > limit) {
        send_error(c, 503, "too many connections"); /* then closed, once written */
        return;
    }
    timer_arm(c);
    if (uv_read_start(&c->h.stream, on_alloc, on_read) < 0)
        conn_close(c);
}

/* ---- public API ---- */

int http_server_new(struct http_server **out, uv_loop_t *loop, const struct http_limits *lim,
                    http_handler_fn handler, void *user)
{
    struct http_server *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    s->loop = loop;
    if (lim)
        s->lim = *lim;
    else
        http_limits_default(&s->lim);
    s->handler = handler;
    s->user = user;
    s->refs = 1; /* dropped by http_server_close */
    *out = s;
    return 0;
}

static struct listener *new_listener(struct http_server *s, char *err, size_t errlen)
{
    if (s->n_listeners == MAX_LISTENERS) {
        moe_fail(err, errlen, MOE_ETOOBIG, "too many listeners (at most %d)", MAX_LISTENERS);
        return NULL;
    }
    struct listener *l = &s->listeners[s->n_listeners];
    memset(l, 0, sizeof *l);
    l->srv = s;
    return l;
}

/* Counts a listener whose handle was initialised: from here on http_server_stop_listening()
 * closes it, even when a later step of the listen fails, and its close callback drops the server
 * ref taken here. */
static void listener_add(struct listener *l, enum http_transport transport)
{
    struct http_server *s = l->srv;
    l->h.handle.data = l;
    l->transport = transport;
    l->open = true;
    s->n_listeners++;
    s->refs++;
}

/* Whether something answers on the socket file at path: 0 when nothing is there or connecting
 * is refused (*stale tells which), -EADDRINUSE when a process accepts connections on it, another
 * error when path is not a socket or cannot be checked. */
static int check_socket(const char *path, bool *stale, char *err, size_t errlen)
{
    struct stat st;
    *stale = false;
    if (lstat(path, &st) != 0)
        return errno == ENOENT ? 0 : moe_fail(err, errlen, -errno, "%s: %s", path, strerror(errno));
    if (!S_ISSOCK(st.st_mode))
        return moe_fail(err, errlen, -EEXIST, "%s exists and is not a socket; not removing it",
                        path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return moe_fail(err, errlen, -errno, "socket: %s", strerror(errno));
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    int rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    int e = errno;
    close(fd);
    if (rc == 0)
        return moe_fail(err, errlen, -EADDRINUSE,
                        "%s: another process is listening on this socket (is moed already "
                        "running?)", path);
    if (e != ECONNREFUSED && e != ENOENT)
        return moe_fail(err, errlen, -e, "%s: cannot check the existing socket: %s", path,
                        strerror(e));
    *stale = e == ECONNREFUSED;
    return 0;
}

int http_unix_socket_check(const char *path, char *err, size_t errlen)
{
    struct sockaddr_un a;
    bool stale;
    if (!path || !*path || strlen(path) >= sizeof a.sun_path)
        return moe_fail(err, errlen, MOE_ERANGE, "socket path '%s' is empty or longer than %zu bytes",
                        path ? path : "", sizeof a.sun_path - 1);
    return check_socket(path, &stale, err, errlen);
}

/* A socket file is stale when connecting to it is refused: its owner is gone. */
static int remove_stale_socket(const char *path, char *err, size_t errlen)
{
    bool stale;
    int rc = check_socket(path, &stale, err, errlen);
    if (rc || !stale)
        return rc;
    if (unlink(path) != 0 && errno != ENOENT)
        return moe_fail(err, errlen, -errno, "%s: cannot remove stale socket: %s", path,
                        strerror(errno));
    return 0;
}

int http_server_listen_unix(struct http_server *s, const char *path, char *err, size_t errlen)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (!path || !*path || strlen(path) >= sizeof a.sun_path)
        return moe_fail(err, errlen, MOE_ERANGE, "socket path '%s' is empty or longer than %zu bytes",
                        path ? path : "", sizeof a.sun_path - 1);
    struct listener *l = new_listener(s, err, errlen);
    if (!l)
        return MOE_ETOOBIG;
    int rc = remove_stale_socket(path, err, errlen);
    if (rc)
        return rc;
    memcpy(a.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return moe_fail(err, errlen, -errno, "socket: %s", strerror(errno));
    /* The socket file gets 0777 & ~umask at bind time: binding under 0117 creates it 0660
     * directly, so there is no moment where others could connect. */
    mode_t old = umask(0117);
    rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    int e = errno;
    umask(old);
    if (rc != 0) {
        close(fd);
        return moe_fail(err, errlen, -e, "bind %s: %s%s", path, strerror(e),
                        e == ENOENT || e == EACCES
                            ? " (its directory must exist and be writable by moed; or use --socket PATH)"
                            : "");
    }
    /* Remember which file this bind made: at shutdown the path may name another daemon's
     * socket (one started after this one's file was removed), which must stay. */
    struct stat bst;
    if (lstat(path, &bst) != 0) {
        e = errno;
        close(fd);
        unlink(path);
        return moe_fail(err, errlen, -e, "stat %s after bind: %s", path, strerror(e));
    }
    if (listen(fd, 128) != 0) {
        e = errno;
        close(fd);
        unlink(path);
        return moe_fail(err, errlen, -e, "listen %s: %s", path, strerror(e));
    }
    if ((rc = uv_pipe_init(s->loop, &l->h.pipe, 0)) < 0) {
        close(fd);
        unlink(path);
        return moe_fail(err, errlen, rc, "uv_pipe_init: %s", uv_strerror(rc));
    }
    listener_add(l, HTTP_TRANSPORT_UNIX);
    if ((rc = uv_pipe_open(&l->h.pipe, fd)) < 0 ||
        (rc = uv_listen(&l->h.stream, 128, on_connection)) < 0) {
        unlink(path);
        return moe_fail(err, errlen, rc, "listen %s: %s", path, uv_strerror(rc));
    }
    snprintf(s->unix_path, sizeof s->unix_path, "%s", path);
    s->unix_dev = bst.st_dev;
    s->unix_ino = bst.st_ino;
    return 0;
}

static bool is_loopback(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)ss;
        return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)ss;
        if (IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr))
            return true;
        return IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) && in6->sin6_addr.s6_addr[12] == 127;
    }
    return false;
}

int http_parse_listen(const char *hostport, struct sockaddr_storage *out, char *err, size_t errlen)
{
    char host[128];
    const char *port;
    memset(out, 0, sizeof *out);
    if (!hostport || !*hostport)
        return moe_fail(err, errlen, MOE_EFORMAT, "empty listen address");
    if (hostport[0] == '[') {
        const char *end = strchr(hostport, ']');
        if (!end || end[1] != ':' || (size_t)(end - hostport - 1) >= sizeof host)
            return moe_fail(err, errlen, MOE_EFORMAT, "listen address '%s': expected [V6ADDR]:PORT",
                            hostport);
        memcpy(host, hostport + 1, (size_t)(end - hostport - 1));
        host[end - hostport - 1] = 0;
        port = end + 2;
    } else {
        const char *colon = strrchr(hostport, ':');
        if (!colon) {
            snprintf(host, sizeof host, "127.0.0.1");
            port = hostport;
        } else {
            if ((size_t)(colon - hostport) >= sizeof host)
                return moe_fail(err, errlen, MOE_EFORMAT, "listen address '%s' is too long",
                                hostport);
            memcpy(host, hostport, (size_t)(colon - hostport));
            host[colon - hostport] = 0;
            port = colon + 1;
        }
    }
    char *end;
    errno = 0;
    long pn = strtol(port, &end, 10);
    if (!*port || *end || errno || pn < 0 || pn > 65535)
        return moe_fail(err, errlen, MOE_EFORMAT, "listen address '%s': bad port '%s'", hostport,
                        port);
    if (!strcmp(host, "localhost") || !*host)
        snprintf(host, sizeof host, "127.0.0.1");
    struct sockaddr_in *in = (struct sockaddr_in *)out;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)out;
    if (inet_pton(AF_INET, host, &in->sin_addr) == 1) {
        in->sin_family = AF_INET;
        in->sin_port = htons((uint16_t)pn);
    } else if (inet_pton(AF_INET6, host, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons((uint16_t)pn);
    } else {
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "listen address '%s': '%s' is not an IP address (use 127.0.0.1 or ::1)",
                        hostport, host);
    }
    /* The API has no authentication of its own: only the local machine may reach it. */
    if (!is_loopback(out))
        return moe_fail(err, errlen, MOE_ERANGE,
                        "listen address '%s' is not a loopback address; moed only listens on "
                        "127.0.0.0/8 or ::1 (put a reverse proxy in front for remote access)",
                        hostport);
    return 0;
}

int http_server_listen_tcp(struct http_server *s, const char *hostport, char *err, size_t errlen)
{
    struct sockaddr_storage ss;
    int rc = http_parse_listen(hostport, &ss, err, errlen);
    if (rc)
        return rc;
    struct listener *l = new_listener(s, err, errlen);
    if (!l)
        return MOE_ETOOBIG;
    if ((rc = uv_tcp_init(s->loop, &l->h.tcp)) < 0)
        return moe_fail(err, errlen, rc, "uv_tcp_init: %s", uv_strerror(rc));
    listener_add(l, HTTP_TRANSPORT_TCP);
    if ((rc = uv_tcp_bind(&l->h.tcp, (const struct sockaddr *)&ss, 0)) < 0 ||
        (rc = uv_listen(&l->h.stream, 128, on_connection)) < 0)
        return moe_fail(err, errlen, rc, "listen on %s: %s", hostport, uv_strerror(rc));
    if (!s->tcp_port) {
        struct sockaddr_storage bound;
        int len = sizeof bound;
        if (uv_tcp_getsockname(&l->h.tcp, (struct sockaddr *)&bound, &len) == 0)
            s->tcp_port = ntohs(bound.ss_family == AF_INET
                                    ? ((struct sockaddr_in *)&bound)->sin_port
                                    : ((struct sockaddr_in6 *)&bound)->sin6_port);
    }
    return 0;
}

int http_server_tcp_port(const struct http_server *s)
{
    return s->tcp_port;
}

static void on_listener_closed(uv_handle_t *h)
{
    struct listener *l = h->data;
    server_unref(l->srv);
}

void http_server_stop_listening(struct http_server *s)
{
    for (int i = 0; i < s->n_listeners; i++) {
        struct listener *l = &s->listeners[i];
        if (!l->open)
            continue;
        l->open = false;
        uv_close(&l->h.handle, on_listener_closed);
    }
    if (s->unix_path[0]) {
        struct stat st;
        if (lstat(s->unix_path, &st) == 0 && st.st_dev == s->unix_dev && st.st_ino == s->unix_ino)
            unlink(s->unix_path); /* else gone, or another daemon's socket now: not ours */
        s->unix_path[0] = 0;
    }
}

void http_server_close(struct http_server *s)
{
    if (s->closing)
        return;
    http_server_stop_listening(s);
    s->closing = true;
    while (s->conns)
        conn_close(s->conns);
    server_unref(s);
}

uint32_t http_server_conns(const struct http_server *s)
{
    return s->n_conns;
}

uint32_t http_server_busy(const struct http_server *s)
{
    return s->n_busy;
}

void http_conn_on_abort(struct http_conn *c, http_abort_fn fn, void *user)
{
    c->abort_fn = fn;
    c->abort_user = user;
}

size_t http_conn_write_queue(const struct http_conn *c)
{
    return c->write_queue;
}

/* Writes the status line and headers, then len bytes of body (none for a stream's start). The
 * head is sized from its variable parts, so a long content type or extra header block is never
 * cut off. */
static int send_head(struct http_conn *c, int status, const char *content_type, const char *extra,
                     const char *framing, const void *body, size_t len)
{
    size_t cap = 256 + strlen(framing) + (content_type ? strlen(content_type) : 0) +
                 (extra ? strlen(extra) : 0);
    char *head = malloc(cap);
    if (!head) {
        conn_fail_write(c);
        return -ENOMEM;
    }
    const char *conn = c->keep_alive ? "keep-alive" : "close";
    int hn = snprintf(head, cap, "HTTP/1.1 %d %s\r\n%s%s%s%sConnection: %s\r\n%s\r\n", status,
                      http_status_text(status), content_type ? "Content-Type: " : "",
                      content_type ? content_type : "", content_type ? "\r\n" : "", framing, conn,
                      extra ? extra : "");
    int rc = conn_write3(c, head, (size_t)hn, body, len, NULL, 0);
    free(head);
    return rc;
}

int http_respond(struct http_conn *c, int status, const char *content_type,
                 const char *extra_headers, const void *body, size_t len)
{
    if (c->closing)
        return -EPIPE;
    if (!c->busy || c->streaming)
        return MOE_EINTERNAL;
    char framing[64];
    snprintf(framing, sizeof framing, "Content-Length: %zu\r\n", len);
    int rc = send_head(c, status, content_type, extra_headers, framing, body,
                       c->req.method == HTTP_HEAD ? 0 : len);
    if (rc)
        return rc;
    finish_request(c);
    return 0;
}

int http_stream_start(struct http_conn *c, int status, const char *content_type,
                      const char *extra_headers)
{
    if (c->closing)
        return -EPIPE;
    if (!c->busy || c->streaming)
        return MOE_EINTERNAL;
    /* HTTP/1.0 has no chunked encoding: the end of the body is the end of the connection. */
    if (c->http10)
        c->keep_alive = false;
    const char *framing = c->http10 ? "" : "Transfer-Encoding: chunked\r\n";
    int rc = send_head(c, status, content_type, extra_headers, framing, NULL, 0);
    if (rc)
        return rc;
    c->streaming = true;
    return 0;
}

int http_stream_write(struct http_conn *c, const void *data, size_t len)
{
    if (c->closing)
        return -EPIPE;
    if (!c->streaming)
        return MOE_EINTERNAL;
    if (len == 0)
        return 0;
    /* A client that does not read its stream is dropped (its request aborted) rather than
     * buffered without bound. The close happens on the next loop iteration, not inside the
     * caller's write (which may be in the middle of its own bookkeeping). */
    if (c->overflow)
        return -EPIPE;
    if (c->srv->lim.max_write_queue && c->write_queue + len > c->srv->lim.max_write_queue) {
        c->overflow = true;
        uv_timer_start(&c->timer, on_overflow, 0, 0);
        return -EPIPE;
    }
    if (c->http10)
        return conn_write3(c, data, len, NULL, 0, NULL, 0);
    char size[24];
    int n = snprintf(size, sizeof size, "%zx\r\n", len);
    return conn_write3(c, size, (size_t)n, data, len, "\r\n", 2);
}

int http_stream_end(struct http_conn *c)
{
    if (c->closing)
        return -EPIPE;
    if (!c->streaming)
        return MOE_EINTERNAL;
    if (!c->http10) {
        int rc = conn_write3(c, "0\r\n\r\n", 5, NULL, 0, NULL, 0);
        if (rc)
            return rc;
    }
    finish_request(c);
    return 0;
}
