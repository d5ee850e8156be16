/* moectl chat: an interactive chat with the served model. Each line read from stdin is a user
 * message; the reply streams to stdout; the conversation is kept for the next turn. On a terminal
 * the line is read with libedit (editing, history of the session's messages). Also
 * moectl_complete(), the streaming request shared with generate. */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <histedit.h>
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

/* Where user lines come from: libedit (el, with the session's history) on a terminal, else
 * getline into buf. */
struct line_in {
    EditLine *el;
    History *hist;
    char *buf;
    size_t cap;
};

static const char *chat_prompt(EditLine *el)
{
    (void)el;
    return "> ";
}

/* The next user line, without its end, valid until the next call; NULL at the end of input.
 * *cleared is set when Ctrl-C came instead of a line (the caller asks again). */
static char *read_line(struct line_in *in, bool *cleared)
{
    *cleared = false;
    errno = 0;
    ssize_t n;
    if (in->el) {
        int count = 0;
        client_interrupted = 0; /* a Ctrl-C before the prompt showed is spent */
        const char *s = el_gets(in->el, &count);
        if (client_interrupted) { /* Ctrl-C while typing: drop the line */
            client_interrupted = 0;
            *cleared = true;
            putchar('\n');
            return NULL;
        }
        if (!s || count <= 0)
            return NULL;
        n = (ssize_t)strlen(s);
        if ((size_t)n + 1 > in->cap) {
            char *nb = realloc(in->buf, (size_t)n + 1);
            if (!nb)
                return NULL;
            in->buf = nb;
            in->cap = (size_t)n + 1;
        }
        memcpy(in->buf, s, (size_t)n + 1);
    } else {
        if (isatty(0)) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        n = getline(&in->buf, &in->cap, stdin);
        if (n < 0 && client_interrupted) { /* Ctrl-C at the prompt: a fresh line */
            client_interrupted = 0;
            clearerr(stdin);
            putchar('\n');
            *cleared = true;
            return NULL;
        }
        if (n < 0)
            return NULL;
    }
    while (n > 0 && (in->buf[n - 1] == '\n' || in->buf[n - 1] == '\r'))
        in->buf[--n] = 0;
    if (in->el && n > 0) {
        HistEvent ev;
        history(in->hist, &ev, H_ENTER, in->buf);
    }
    return in->buf;
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
    /* Ctrl-C stops the reply being streamed, not the session (no SA_RESTART: a blocked read
     * returns, see client_interrupted); while a line is typed it drops the line. */
    struct sigaction sa = {.sa_handler = on_sigint}, old_sa;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_sa);
    struct line_in in = {0};
    if (isatty(0) && isatty(1) && (in.el = el_init("moectl", stdin, stdout, stderr))) {
        HistEvent ev;
        in.hist = history_init();
        if (in.hist) {
            history(in.hist, &ev, H_SETSIZE, 1000);
            el_set(in.el, EL_HIST, history, in.hist);
        }
        el_set(in.el, EL_PROMPT, chat_prompt);
        el_set(in.el, EL_EDITOR, "emacs");
    }
    int rc = 0;
    for (;;) {
        bool cleared;
        char *line = read_line(&in, &cleared);
        if (cleared)
            continue;
        if (!line)
            break;
        if (!*line)
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
    if (in.el)
        el_end(in.el);
    if (in.hist)
        history_end(in.hist);
    sigaction(SIGINT, &old_sa, NULL);
    free(in.buf);
    json_decref(req);
    return rc;
}

MOECTL_COMMAND(chat, "[--system TEXT]  chat with the model (one message per line on stdin)", cmd_chat)
