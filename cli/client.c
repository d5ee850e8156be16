/* moectl's HTTP client over the daemon's Unix socket; see client.h. */
#include "cli/client.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <http_parser.h>
#include <jansson.h>

#include "cli/moectl.h"
#include "store/buf.h"

struct rstate {
    struct client_resp *r;
    client_sse_fn sse;
    void *user;
    bool is_sse, stop, done;
    char field[32];
    size_t field_len;
    bool in_value;
    char *line;              /* SSE: the current partial line */
    size_t line_len, line_cap;
    size_t body_cap;
    char *data;              /* SSE: data of the current event */
    size_t data_len, data_cap;
};

static int on_hfield(http_parser *p, const char *at, size_t n)
{
    struct rstate *s = p->data;
    if (s->in_value) {
        s->field_len = 0;
        s->in_value = false;
    }
    for (size_t i = 0; i < n && s->field_len < sizeof s->field - 1; i++) {
        char c = at[i];
        s->field[s->field_len++] = (c >= 'A' && c <= 'Z') ? (char)(c + 32) : c;
    }
    s->field[s->field_len] = 0;
    return 0;
}

static int on_hvalue(http_parser *p, const char *at, size_t n)
{
    struct rstate *s = p->data;
    s->in_value = true;
    if (!strcmp(s->field, "content-type")) {
        size_t have = strlen(s->r->content_type);
        size_t room = sizeof s->r->content_type - 1 - have;
        memcpy(s->r->content_type + have, at, n < room ? n : room);
        s->r->content_type[have + (n < room ? n : room)] = 0;
    }
    return 0;
}

static int on_headers(http_parser *p)
{
    struct rstate *s = p->data;
    s->r->status = (int)p->status_code;
    s->is_sse = s->sse && s->r->status == 200 && !strncmp(s->r->content_type, "text/event-stream", 17);
    return 0;
}

/* One complete SSE line: "data: x" accumulates, an empty line dispatches the event. */
static int sse_line(struct rstate *s, const char *l, size_t n)
{
    if (n && l[n - 1] == '\r')
        n--;
    if (n == 0) {
        if (s->data_len) {
            s->data[s->data_len] = 0;
            if (s->sse(s->data, s->data_len, s->user))
                s->stop = true;
            s->data_len = 0;
        }
        return 0;
    }
    if (n >= 5 && !memcmp(l, "data:", 5)) {
        const char *v = l + 5;
        size_t vn = n - 5;
        if (vn && *v == ' ')
            v++, vn--;
        if (moe_buf_reserve(&s->data, &s->data_cap, s->data_len + vn + 2))
            return -1;
        if (s->data_len)
            s->data[s->data_len++] = '\n';
        memcpy(s->data + s->data_len, v, vn);
        s->data_len += vn;
    }
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t n)
{
    struct rstate *s = p->data;
    if (!s->is_sse) {
        return moe_buf_append(&s->r->body, &s->r->len, &s->body_cap, at, n) ? -1 : 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (at[i] == '\n') {
            if (sse_line(s, s->line, s->line_len))
                return -1;
            s->line_len = 0;
            if (s->stop)
                return 0;
        } else {
            if (moe_buf_reserve(&s->line, &s->line_cap, s->line_len + 2))
                return -1;
            s->line[s->line_len++] = at[i];
        }
    }
    return 0;
}

static int on_complete(http_parser *p)
{
    struct rstate *s = p->data;
    s->done = true;
    return 0;
}

static int send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

volatile sig_atomic_t client_interrupted;

int client_request(const char *socket_path, const char *method, const char *path,
                   const char *content_type, const char *body, size_t len, client_sse_fn sse,
                   void *user, struct client_resp *out)
{
    memset(out, 0, sizeof *out);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(socket_path) >= sizeof a.sun_path) {
        fprintf(stderr, "moectl: socket path too long: %s\n", socket_path);
        return CLIENT_EXIT_FAIL;
    }
    memcpy(a.sun_path, socket_path, strlen(socket_path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        fprintf(stderr, "moectl: socket: %s\n", strerror(errno));
        return CLIENT_EXIT_FAIL;
    }
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        close(fd);
        if (e == ENOENT || e == ECONNREFUSED || e == ENOTDIR) {
            fprintf(stderr, "moed is not running (no socket at %s)\n", socket_path);
            return CLIENT_EXIT_NOT_RUNNING;
        }
        if (e == EACCES || e == EPERM) {
            fprintf(stderr, "access denied: cannot connect to %s (%s); moed's socket is for root, "
                            "the moed user and the moed group\n", socket_path, strerror(e));
            return CLIENT_EXIT_DENIED;
        }
        fprintf(stderr, "moectl: connect %s: %s\n", socket_path, strerror(e));
        return CLIENT_EXIT_FAIL;
    }
    char head[1024];
    int hn = snprintf(head, sizeof head,
                      "%s %s HTTP/1.1\r\nHost: moed\r\nUser-Agent: moectl\r\nAccept: */*\r\n"
                      "%s%s%sContent-Length: %zu\r\nConnection: close\r\n\r\n",
                      method, path, content_type ? "Content-Type: " : "",
                      content_type ? content_type : "", content_type ? "\r\n" : "", len);
    if (send_all(fd, head, (size_t)hn) || (len && send_all(fd, body, len))) {
        fprintf(stderr, "moectl: sending the request: %s\n", strerror(errno));
        close(fd);
        return CLIENT_EXIT_FAIL;
    }
    static const http_parser_settings st = {
        .on_header_field = on_hfield,
        .on_header_value = on_hvalue,
        .on_headers_complete = on_headers,
        .on_body = on_body,
        .on_message_complete = on_complete,
    };
    struct rstate s = {.r = out, .sse = sse, .user = user};
    http_parser p;
    http_parser_init(&p, HTTP_RESPONSE);
    p.data = &s;
    char buf[16384];
    int rc = 0;
    for (;;) {
        if (client_interrupted) {
            rc = CLIENT_INTERRUPTED;
            break;
        }
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            fprintf(stderr, "moectl: reading the response: %s\n", strerror(errno));
            rc = CLIENT_EXIT_FAIL;
            break;
        }
        size_t k = http_parser_execute(&p, &st, buf, (size_t)n);
        if (HTTP_PARSER_ERRNO(&p) != HPE_OK || (n > 0 && k != (size_t)n)) {
            fprintf(stderr, "moectl: malformed response from moed: %s\n",
                    http_errno_description(HTTP_PARSER_ERRNO(&p)));
            rc = CLIENT_EXIT_FAIL;
            break;
        }
        if (s.done || s.stop)
            break;
        if (n == 0) {
            if (!s.done) {
                fprintf(stderr, "moectl: moed closed the connection before the response ended\n");
                rc = CLIENT_EXIT_FAIL;
            }
            break;
        }
    }
    close(fd);
    free(s.line);
    free(s.data);
    if (!out->body && rc == 0) {
        out->body = calloc(1, 1);
    }
    return rc;
}

void client_resp_free(struct client_resp *r)
{
    free(r->body);
    r->body = NULL;
}

int client_report_error(const char *what, const struct client_resp *r)
{
    const char *msg = r->body ? r->body : "";
    json_t *j = r->body ? json_loads(r->body, 0, NULL) : NULL;
    json_t *m = json_object_get(json_object_get(j, "error"), "message");
    if (json_is_string(m))
        msg = json_string_value(m);
    if (r->status == 403) {
        if (!strncmp(msg, "access denied", 13))
            fprintf(stderr, "%s\n", msg);
        else
            fprintf(stderr, "access denied: %s\n", msg);
    } else {
        fprintf(stderr, "moectl: %s: HTTP %d: %s\n", what, r->status, msg);
    }
    json_decref(j);
    return r->status == 403 ? CLIENT_EXIT_DENIED : CLIENT_EXIT_FAIL;
}

int client_call(const char *method, const char *path, const char *body, size_t len,
                struct client_resp *out)
{
    int rc = client_request(moectl_opts.socket, method, path, body ? "application/json" : NULL, body,
                            len, NULL, NULL, out);
    if (rc)
        return rc;
    if (out->status / 100 != 2) {
        char what[160];
        snprintf(what, sizeof what, "%s %s", method, path);
        rc = client_report_error(what, out);
        client_resp_free(out);
        return rc;
    }
    return 0;
}

int client_get_json(const char *path, const char *what, json_t **out)
{
    struct client_resp r;
    json_error_t je;
    *out = NULL;
    int rc = client_call("GET", path, NULL, 0, &r);
    if (rc)
        return rc;
    if (moectl_opts.json) {
        fputs(r.body, stdout);
        if (r.len && r.body[r.len - 1] != '\n')
            putchar('\n');
        client_resp_free(&r);
        return 0;
    }
    json_t *o = json_loads(r.body, 0, &je);
    client_resp_free(&r);
    if (!json_is_object(o)) {
        fprintf(stderr, "moectl: %s: unexpected reply from moed: %s\n", what,
                o ? "not a JSON object" : je.text);
        json_decref(o);
        return CLIENT_EXIT_FAIL;
    }
    *out = o;
    return 0;
}
