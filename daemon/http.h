/* HTTP/1.1 server on libuv + http-parser: a Unix socket listener and optional loopback TCP
 * listeners, keep-alive, pipelining (one request at a time per connection), hard limits on
 * header and body sizes, idle timeouts, and chunked streaming responses (for SSE).
 *
 * Everything runs on one libuv loop. The server parses a request completely (body included),
 * then calls the handler once; the handler answers right away or later (after a generation)
 * with http_respond() or http_stream_*(). A connection whose client goes away while a request
 * is outstanding calls the abort callback set with http_conn_on_abort(), so that the owner can
 * cancel work; the connection (and the request) must not be used after that. */
#ifndef MOED_HTTP_H
#define MOED_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <uv.h>

struct http_server;
struct http_conn;

enum http_transport { HTTP_TRANSPORT_UNIX = 1, HTTP_TRANSPORT_TCP = 2 };

/* Who is on the other end. Credentials come from SO_PEERCRED on Unix sockets only. */
struct http_peer {
    enum http_transport transport;
    bool has_cred;
    pid_t pid;
    uid_t uid;
    gid_t gid;
};

struct http_request {
    struct http_conn *conn;
    unsigned method;            /* enum http_method from http_parser.h (HTTP_GET, HTTP_POST...) */
    const char *method_name;    /* "GET" */
    const char *path;           /* path as sent (not percent-decoded), without the query */
    const char *query;          /* after '?', or "" */
    const char *body;           /* NUL-terminated for convenience; body_len bytes */
    size_t body_len;
    const char *content_type;   /* header value or "" */
    const char *authorization;  /* the Authorization header's value, or NULL */
    const struct http_peer *peer;
    uint64_t id;                /* unique per server, for logs */
};

struct http_limits {
    size_t max_header_bytes;    /* request line + all headers; over it: 431 and close */
    size_t max_body_bytes;      /* over it: 413 and close */
    size_t max_total_body_bytes; /* bodies held by all connections at once; over it: 503 and close */
    size_t max_write_queue;     /* response bytes queued for a client that does not read; over it:
                                   the request is aborted and the connection closed */
    uint64_t idle_timeout_ms;   /* keep-alive idle, and the time allowed to send one request */
    uint32_t max_conns;         /* per listener; beyond it a connection gets 503 and is closed */
    uint32_t admin_reserve;     /* Unix socket: this many more for root and the daemon's own uid */
};

/* Called once per complete request. The handler owns the request until it answers. */
typedef void (*http_handler_fn)(void *user, struct http_request *req);
/* Called when the client goes away (or the server closes) while a request is outstanding. */
typedef void (*http_abort_fn)(void *user);

/* Defaults: 16 KiB of headers, 8 MiB of body, 60 s idle, 1024 connections. */
void http_limits_default(struct http_limits *l);

/* Creates a server on loop. Returns 0 or -ENOMEM. */
int http_server_new(struct http_server **out, uv_loop_t *loop, const struct http_limits *lim,
                    http_handler_fn handler, void *user);

/* Listens on a Unix socket at path, created mode 0660 with no window where it has wider
 * permissions (bound under umask 0117). An existing socket at path is removed only when nothing
 * answers on it; anything else there is an error. Returns 0, or a negative errno / MOE_E* with a
 * message in err. */
int http_server_listen_unix(struct http_server *s, const char *path, char *err, size_t errlen);

/* The check http_server_listen_unix makes before it binds, without removing anything: 0 when
 * path is free or holds a stale socket, -EADDRINUSE ("another process is listening on this
 * socket") when something accepts connections on it, another error when path is not a socket.
 * The daemon calls it before its slow startup steps. */
int http_unix_socket_check(const char *path, char *err, size_t errlen);

/* Listens on TCP at "HOST:PORT", "[V6]:PORT" or "PORT" (127.0.0.1). Only loopback addresses are
 * accepted (127.0.0.0/8, ::1, "localhost"); others give MOE_ERANGE. PORT 0 picks a free port
 * (see http_server_tcp_port). */
int http_server_listen_tcp(struct http_server *s, const char *hostport, char *err, size_t errlen);

/* The port of the first TCP listener, or 0. */
int http_server_tcp_port(const struct http_server *s);

/* fn(user, status) is called for each response the server sends on its own (malformed requests:
 * 400/413/431/505; 408 for a request cut short by the idle timeout), so they can be counted with
 * the handler's. */
void http_server_on_status(struct http_server *s, void (*fn)(void *user, int status), void *user);

/* Parses "HOST:PORT" and checks that the host is loopback. Returns 0 or MOE_ERANGE/MOE_EFORMAT
 * with a message. */
int http_parse_listen(const char *hostport, struct sockaddr_storage *out, char *err, size_t errlen);

/* Stops accepting: closes the listeners and removes the Unix socket file, if the path still names
 * the file this server bound (not one another process bound there since). Open connections
 * stay; in-flight requests can still be answered. */
void http_server_stop_listening(struct http_server *s);

/* Closes every connection (calling abort callbacks of outstanding requests) and, once libuv
 * has released all handles, frees the server. Call from the loop thread; the loop must run
 * afterwards for the frees to happen. */
void http_server_close(struct http_server *s);

/* Open connection and outstanding request counts. */
uint32_t http_server_conns(const struct http_server *s);
uint32_t http_server_busy(const struct http_server *s);

/* Sets the abort callback of the connection's outstanding request (NULL to clear). */
void http_conn_on_abort(struct http_conn *c, http_abort_fn fn, void *user);

/* Answers the outstanding request with a complete response. extra_headers, if not NULL, is a
 * block of "Name: value\r\n" lines. Returns 0 or a negative errno (the connection is then being
 * closed). The request must not be used afterwards. */
int http_respond(struct http_conn *c, int status, const char *content_type,
                 const char *extra_headers, const void *body, size_t len);

/* Streaming response: a header block with Transfer-Encoding: chunked, then chunks, then the end.
 * http_stream_end() finishes the request. Writes are queued (never block); returns 0 or a
 * negative errno when the connection is gone. */
int http_stream_start(struct http_conn *c, int status, const char *content_type,
                      const char *extra_headers);
int http_stream_write(struct http_conn *c, const void *data, size_t len);
int http_stream_end(struct http_conn *c);

/* Bytes queued on the connection but not yet written to the socket. */
size_t http_conn_write_queue(const struct http_conn *c);

/* "Not Found" for 404, and so on; "Unknown" for unknown codes. */
const char *http_status_text(int status);

#endif
