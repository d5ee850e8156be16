/* moectl's HTTP client: HTTP/1.1 over the daemon's Unix socket, responses parsed with http-parser,
 * Server-Sent Events split into their data payloads for streaming commands. */
#ifndef MOECTL_CLIENT_H
#define MOECTL_CLIENT_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

/* moectl exit codes (cli/moectl.h). */
enum { CLIENT_EXIT_FAIL = 1, CLIENT_EXIT_NOT_RUNNING = 3, CLIENT_EXIT_DENIED = 4,
       CLIENT_INTERRUPTED = 130 };

/* Set by a signal handler (moectl chat's SIGINT, installed without SA_RESTART): the response
 * being read is abandoned (the connection closes, so moed stops generating) and
 * client_request returns CLIENT_INTERRUPTED. The handler's owner clears it. */
extern volatile sig_atomic_t client_interrupted;

struct client_resp {
    int status;
    char *body;              /* NUL-terminated, malloc'd */
    size_t len;
    char content_type[128];
};

/* Called for each SSE "data:" payload (NUL-terminated) of a streaming response; return non-zero
 * to stop reading. */
typedef int (*client_sse_fn)(const char *data, size_t len, void *user);

/* Sends one request to the socket and reads the response. When sse is set and the response is
 * text/event-stream, each event goes to sse as it arrives (and the body stays empty). Returns 0
 * (any HTTP status) or an exit code (CLIENT_EXIT_NOT_RUNNING, CLIENT_EXIT_DENIED when the socket
 * refuses us, CLIENT_EXIT_FAIL) after printing a message to stderr. */
int client_request(const char *socket_path, const char *method, const char *path,
                   const char *content_type, const char *body, size_t len, client_sse_fn sse,
                   void *user, struct client_resp *out);
void client_resp_free(struct client_resp *r);

/* Prints a JSON error response ({"error": {"message"}}) or the raw body to stderr and returns
 * the exit code for it: 4 for 403, 1 otherwise. */
int client_report_error(const char *what, const struct client_resp *r);

/* request + error handling for simple JSON admin calls: returns 0 with *out filled for 2xx,
 * otherwise an exit code (the message is printed). */
int client_call(const char *method, const char *path, const char *body, size_t len,
                struct client_resp *out);

/* GET path for a read-only command (status, placement, profile show). With --json the body is
 * printed as it came (newline-terminated) and *out is NULL; otherwise *out is the reply's JSON
 * object, for the caller to json_decref(). Returns 0 or an exit code after printing a message:
 * client_call()'s, or "moectl: WHAT: unexpected reply from moed" for a body that is not a JSON
 * object. */
int client_get_json(const char *path, const char *what, json_t **out);

#endif
