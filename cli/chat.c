/* moectl chat: an interactive chat with the served model. Each line read from stdin is a user
 * message; the reply streams to stdout; the conversation is kept for the next turn. Also
 * moectl_complete(), the streaming request shared with generate. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "cli/client.h"
#include "cli/moectl.h"
#include "cli/stream.h"
#include "store/buf.h"

struct stream_state {
    int chat;
    char *text;
    size_t len, cap;
    int error;
    int done;
};

/* Out of memory only shortens the kept copy (the chat history): the reply was printed already. */
static void keep(struct stream_state *s, const char *t, size_t n)
{
    (void)moe_buf_append(&s->text, &s->len, &s->cap, t, n);
}

static int on_event(const char *data, size_t len, void *user)
{
    struct stream_state *s = user;
    (void)len;
    if (!strcmp(data, "[DONE]")) {
        s->done = 1;
        return 1;
    }
    json_t *o = json_loads(data, 0, NULL);
    if (!o)
        return 0;
    json_t *err = json_object_get(o, "error");
    if (err) {
        fflush(stdout);
        fprintf(stderr, "\nmoectl: generation failed: %s\n",
                json_string_value(json_object_get(err, "message")));
        s->error = 1;
        json_decref(o);
        return 1;
    }
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    json_t *t = s->chat ? json_object_get(json_object_get(ch, "delta"), "content")
                        : json_object_get(ch, "text");
    if (json_is_string(t) && json_string_length(t)) {
        fwrite(json_string_value(t), 1, json_string_length(t), stdout);
        fflush(stdout);
        keep(s, json_string_value(t), json_string_length(t));
    }
    json_decref(o);
    return 0;
}

int moectl_complete(const char *path, json_t *req, int chat, char **text)
{
    bool stream = !moectl_opts.json;
    json_object_set_new(req, "stream", json_boolean(stream));
    char *body = json_dumps(req, JSON_COMPACT);
    if (!body)
        return 1;
    struct stream_state s = {.chat = chat};
    struct client_resp r;
    int rc = client_request(moectl_opts.socket, "POST", path, "application/json", body, strlen(body),
                            stream ? on_event : NULL, &s, &r);
    free(body);
    if (rc == CLIENT_INTERRUPTED) {
        putchar('\n');
        if (text)
            *text = s.text ? s.text : strdup(""); /* what came before the interrupt */
        else
            free(s.text);
        return rc;
    }
    if (rc) {
        free(s.text);
        return rc;
    }
    if (r.status != 200) {
        rc = client_report_error(path, &r);
        client_resp_free(&r);
        free(s.text);
        return rc;
    }
    if (!stream) {
        fputs(r.body, stdout);
        json_t *o = json_loads(r.body, 0, NULL);
        json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        json_t *t = chat ? json_object_get(json_object_get(ch, "message"), "content")
                         : json_object_get(ch, "text");
        if (json_is_string(t))
            keep(&s, json_string_value(t), json_string_length(t));
        json_decref(o);
    } else {
        putchar('\n');
        if (!s.done && !s.error) {
            fprintf(stderr, "moectl: the stream ended early\n");
            rc = 1;
        }
    }
    if (s.error)
        rc = 1;
    client_resp_free(&r);
    if (text)
        *text = s.text ? s.text : strdup("");
    else
        free(s.text);
    return rc;
}

static void on_sigint(int sig)
{
    (void)sig;
    client_interrupted = 1;
}

static int chat_usage(FILE *f)
{
    fprintf(f, "usage: moectl [--socket PATH] [--json] chat [-n N] [--temp T] [--system TEXT]\n"
               "  (and the other sampling options of generate, with the same ranges)\n"
               "  reads one user message per line from stdin; the reply streams to stdout;\n"
               "  Ctrl-C stops a reply (what came is kept) or clears the line; Ctrl-D or /quit ends\n");
    return f == stdout ? 0 : 2;
}

static int cmd_chat(int argc, char **argv)
{
    if (moectl_wants_help(argc, argv))
        return chat_usage(stdout);
    json_t *req = json_object();
    json_t *msgs = json_array();
    json_object_set_new(req, "messages", msgs);
    int i = moectl_sampling_args(argc, argv, req);
    if (i < 0 || i < argc) {
        json_decref(req);
        return chat_usage(stderr);
    }
    bool tty = isatty(0);
    /* Ctrl-C stops the reply being streamed, not the session (no SA_RESTART: a blocked read
     * returns, see client_interrupted). */
    struct sigaction sa = {.sa_handler = on_sigint}, old_sa;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_sa);
    char *line = NULL;
    size_t cap = 0;
    int rc = 0;
    for (;;) {
        if (tty) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        errno = 0;
        ssize_t n = getline(&line, &cap, stdin);
        if (n < 0 && client_interrupted) { /* Ctrl-C at the prompt: a fresh line */
            client_interrupted = 0;
            clearerr(stdin);
            putchar('\n');
            continue;
        }
        if (n < 0)
            break;
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = 0;
        if (n == 0)
            continue;
        if (!strcmp(line, "/quit") || !strcmp(line, "/exit"))
            break;
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", line));
        char *reply = NULL;
        rc = moectl_complete("/v1/chat/completions", req, 1, &reply);
        if (rc == CLIENT_INTERRUPTED) {
            client_interrupted = 0;
            rc = 0;
            fprintf(stderr, "moectl: reply stopped\n");
        } else if (rc) {
            free(reply);
            break;
        }
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "assistant", "content", reply));
        free(reply);
    }
    sigaction(SIGINT, &old_sa, NULL);
    free(line);
    json_decref(req);
    return rc;
}

MOECTL_COMMAND(chat, "[--system TEXT]  chat with the model (one message per line on stdin)", cmd_chat)
