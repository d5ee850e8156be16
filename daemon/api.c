/* The client API; see api.h. */
#include "daemon/api.h"

#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <math.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <http_parser.h>
#include <jansson.h>

#include "daemon/log.h"
#include "store/buf.h"
#include "store/err.h"
#include "store/grammar.h"
#include "store/json_schema.h"
#include "store/io.h"
#include "store/version.h"

#define MAX_STOPS 16
#define MAX_CHOICES 16                  /* n */
#define MAX_PROMPTS 64                  /* prompts of one completion request */
#define MAX_REQUEST_CHOICES 128         /* choices of one request: prompts x n */
#define MAX_STOP_LEN 256
#define TPS_BUCKETS 16

struct gen;

/* A Prometheus histogram of seconds. */
#define LAT_BUCKETS 12
struct latency_hist {
    uint64_t count[LAT_BUCKETS + 1]; /* [i]: observations <= bound[i]; the last one +Inf */
    uint64_t n;
    double sum;
};
static const double TTFT_BOUNDS[LAT_BUCKETS] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                1, 2.5, 5, 10, 30, 60};
static const double ITL_BOUNDS[LAT_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                               0.1, 0.25, 0.5, 1, 2.5, 10};

static void lat_observe(struct latency_hist *h, const double *bounds, double v)
{
    int i = 0;
    while (i < LAT_BUCKETS && v > bounds[i])
        i++;
    h->count[i]++;
    h->n++;
    h->sum += v;
}

struct api {
    const struct moe_tokenizer *tok;
    struct sched *sched;
    struct api_model_info model;
    char *model_id, *model_arch;
    struct chat_template *chat;     /* NULL: chat requests are refused with chat_err */
    char *chat_text;                /* the template text in use (owned; /props) */
    char chat_err[640];
    int32_t im_start, im_end;
    uid_t admin_uid;
    gid_t admin_gid;
    bool have_admin_gid;
    uint32_t max_tokens_default;
    struct api_sampling_defaults sampling; /* always set (OpenAI's when the options are not) */
    char *api_key;                  /* owned copy, or NULL */
    _Atomic uint64_t load_done, load_total; /* expert store build progress (any thread) */
    struct api_hooks hooks;
    bool ready, draining;
    time_t started;
    uint64_t id_seed, id_next;

    struct gen *gens;
    uint32_t n_gens;
    uv_loop_t *loop;                /* prompts are tokenized on its thread pool; NULL: inline */
    struct tok_job *jobs;           /* requests whose prompt is being tokenized */
    uint32_t n_jobs;

    /* Counters for /metrics. */
    uint64_t http_by_class[6];      /* 1xx..5xx responses */
    uint64_t gen_tokens, gen_requests, gen_errors, prompt_tokens;
    uint64_t tps_count[TPS_BUCKETS];
    int64_t tps_sec[TPS_BUCKETS];
    uint64_t *routing;              /* [n_layer][n_expert], NULL when unknown */
    uint64_t routing_tokens;
    struct latency_hist ttft, itl;  /* seconds: request to first token, between tokens */
};

/* One response: its choices (a gen each, submitted as a request each: n for each of its
 * prompts, choice k answering prompt k / n_per) and what they share. */
struct gen_group {
    struct api *api;
    struct http_conn *conn;
    bool headers_sent;
    bool submitting;                /* callbacks are parked while the choices are submitted */
    uint32_t n, n_open;             /* choices; those not finished */
    uint32_t n_per;                 /* choices per prompt (the request's n) */
    struct gen **g;                 /* [n] */
    json_t *choices;                /* not streamed: [n] the finished choices, null until then */
    json_t *resp;                   /* Responses API: the Response's echoed fields, else NULL */
};

struct gen {
    struct api *api;
    struct gen_group *grp;
    uint32_t index;                 /* the choice's index */
    struct gen *prev, *next;
    struct http_conn *conn;
    struct sched_req *req;
    bool chat, stream, include_usage;
    bool responses;                 /* POST /v1/responses (chat, answered as a Response) */
    bool finished;
    bool linked;                    /* in api.gens */
    char id[48];
    time_t created;
    char *stops[MAX_STOPS];
    size_t n_stops;
    struct moe_detok detok;
    struct chat_out co;             /* chat: the output split into reasoning, content, tool calls */
    char *reasoning, *content;      /* chat, not streamed: what co gave */
    size_t reasoning_len, reasoning_cap, content_len, content_cap;
    json_t *tool_calls;
    char *piece;                    /* scratch for one token's text */
    size_t piece_cap;
    char *text;                     /* generated text so far (cut at a stop string) */
    size_t text_len, text_cap;
    size_t sent;                    /* bytes of text already streamed */
    uint32_t n_prompt, n_gen;
    uint32_t n_cached;              /* prompt tokens the worker continued from its KV cache */
    double t_start, t_last;         /* moe_now_s(): request complete, last token */
    double t_first;                 /* the first token (timings) */
    /* logprobs: one chat-shaped entry ({token, logprob, bytes, top_logprobs}) per generated
     * token, the offset of its text in text, and how many entries were streamed; lp_bound: the
     * text a chunk being streamed covers (its entries are those before it). */
    bool logprobs;
    uint32_t n_top;
    json_t *lp;
    size_t *lp_off, lp_cap, lp_sent, lp_bound;
    size_t lp_chars;                /* completions: characters before the next entry's text */
    uint32_t n_plp;                 /* echo with logprobs: the first entries are the prompt's */
    char *echo;                     /* completions with echo: the prompt's text */
    size_t echo_len;
    bool echo_sent;
    /* A callback that arrives while the group is submitted is parked here. */
    int early;                      /* 0, 1: done, 2: error */
    enum sched_finish early_why;
    int early_status;
    char early_msg[256];
    /* Responses: the output items done (r_output), the one being written (a message or
     * reasoning, its id and text), the next event's sequence_number, whether an item answers. */
    json_t *r_output;
    int r_open;                     /* 0, RESP_MESSAGE or RESP_REASONING */
    char r_item[48];
    char *r_text;
    size_t r_len, r_cap;
    json_int_t r_seq;
    bool r_answered;
    /* Responses with logprobs: the open message's entries (taken from lp), and the first lp
     * entry no output item has had yet. */
    json_t *r_lp;
    size_t r_lp_next;
};

enum { RESP_MESSAGE = 1, RESP_REASONING = 2 };

/* ---- small helpers ---- */

/* What /v1/models and /admin/status say of the chat template. */
static const char *api_chat_kind(const struct api *a)
{
    return a->chat ? chat_source_name(chat_template_source(a->chat)) : a->chat_err[0] ? "unusable" : "none";
}


static void count_response(struct api *a, int status)
{
    int c = status / 100;
    if (c >= 1 && c <= 5)
        a->http_by_class[c]++;
}

void api_count_status(void *api, int status)
{
    count_response((struct api *)api, status);
}

static const char *error_type(int status)
{
    if (status == 401 || status == 403)
        return "permission_error";
    if (status == 404)
        return "not_found_error";
    if (status >= 500)
        return "server_error";
    return "invalid_request_error";
}

static const char *error_code(int status)
{
    switch (status) {
    case 401: return "invalid_api_key";
    case 403: return "forbidden";
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 413: return "request_too_large";
    case 501: return "not_implemented";
    case 503: return "unavailable";
    default: return status >= 500 ? "internal_error" : "invalid_request";
    }
}

static json_t *json_text(const char *s, size_t n);

/* Builds the error object; extra members (n_prompt_tokens...) may be added by the caller. The
 * message quotes what the client sent (a path, a field's value), which need not be UTF-8, and
 * may be cut inside a sequence: it is always made valid text. */
static json_t *error_obj(int status, const char *param, const char *msg)
{
    json_t *e = json_object();
    /* OpenAI's answer for a model it does not have. */
    const bool no_model = status == 404 && param && !strcmp(param, "model");
    json_object_set_new(e, "message", json_text(msg, strlen(msg)));
    json_object_set_new(e, "type", json_string(no_model ? "invalid_request_error" : error_type(status)));
    json_object_set_new(e, "code", json_string(no_model ? "model_not_found" : error_code(status)));
    json_object_set_new(e, "param", param ? json_text(param, strlen(param)) : json_null());
    return e;
}

static void respond_json(struct api *a, struct http_conn *c, int status, json_t *body,
                         const char *extra_headers)
{
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    count_response(a, status);
    if (!text) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"code\":\"internal_error\"}}";
        http_respond(c, 500, "application/json", NULL, oom, sizeof oom - 1);
        return;
    }
    size_t n = strlen(text);
    text[n] = 0;
    char *with_nl = realloc(text, n + 2);
    if (with_nl) {
        text = with_nl;
        text[n++] = '\n';
        text[n] = 0;
    }
    http_respond(c, status, "application/json", extra_headers, text, n);
    free(text);
}

static void respond_error_ex(struct api *a, struct http_conn *c, int status, const char *param,
                             json_t *extra, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static void respond_error_ex(struct api *a, struct http_conn *c, int status, const char *param,
                             json_t *extra, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    json_t *e = error_obj(status, param, msg);
    if (extra) {
        json_object_update(e, extra);
        json_decref(extra);
    }
    json_t *body = json_object();
    json_object_set_new(body, "error", e);
    log_debug("http %d: %s", status, msg);
    respond_json(a, c, status, body, NULL);
}

#define respond_error(a, c, status, param, ...) \
    respond_error_ex(a, c, status, param, NULL, __VA_ARGS__)

/* Replaces invalid UTF-8 with U+FFFD so that the text is always valid JSON. */
static json_t *json_text(const char *s, size_t n)
{
    json_t *j = json_stringn(s, n);
    if (j)
        return j;
    char *buf = malloc(n * 3 + 1);
    if (!buf)
        return json_string("");
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char ch = (unsigned char)s[i];
        size_t len = ch < 0x80 ? 1 : (ch >> 5) == 6 ? 2 : (ch >> 4) == 14 ? 3 : (ch >> 3) == 30 ? 4 : 0;
        bool ok = len > 0 && i + len <= n && ch != 0;
        for (size_t k = 1; ok && k < len; k++)
            ok = ((unsigned char)s[i + k] >> 6) == 2;
        if (ok) {
            json_t *probe = json_stringn(s + i, len);
            ok = probe != NULL;
            json_decref(probe);
        }
        if (ok) {
            memcpy(buf + o, s + i, len);
            o += len;
            i += len;
        } else {
            memcpy(buf + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        }
    }
    j = json_stringn(buf, o);
    free(buf);
    return j ? j : json_string("");
}

static bool is_member(uid_t uid, gid_t gid, gid_t group)
{
    if (gid == group)
        return true;
    struct passwd pw, *pwp = NULL;
    char buf[4096];
    if (getpwuid_r(uid, &pw, buf, sizeof buf, &pwp) != 0 || !pwp)
        return false;
    if (pw.pw_gid == group)
        return true;
    gid_t groups[256];
    int ng = 256;
    if (getgrouplist(pw.pw_name, pw.pw_gid, groups, &ng) < 0)
        return false;
    for (int i = 0; i < ng; i++)
        if (groups[i] == group)
            return true;
    return false;
}

bool api_peer_is_admin(const struct api *a, const struct http_peer *p)
{
    if (p->transport != HTTP_TRANSPORT_UNIX || !p->has_cred)
        return false;
    if (p->uid == 0 || p->uid == a->admin_uid)
        return true;
    return a->have_admin_gid && is_member(p->uid, p->gid, a->admin_gid);
}

/* ---- stop strings ---- */

long api_find_stop(const char *text, size_t len, size_t from, char *const *stops, size_t n_stops)
{
    long best = -1;
    for (size_t i = 0; i < n_stops; i++) {
        size_t sl = strlen(stops[i]);
        if (sl == 0 || sl > len)
            continue;
        for (size_t p = from; p + sl <= len; p++) {
            if (best >= 0 && (long)p >= best)
                break;
            if (memcmp(text + p, stops[i], sl) == 0) {
                best = (long)p;
                break;
            }
        }
    }
    return best;
}

size_t api_stop_holdback(const char *text, size_t len, char *const *stops, size_t n_stops)
{
    size_t hold = 0;
    for (size_t i = 0; i < n_stops; i++) {
        size_t sl = strlen(stops[i]);
        for (size_t k = sl > 0 ? sl - 1 : 0; k > hold; k--) {
            if (k <= len && memcmp(text + len - k, stops[i], k) == 0) {
                hold = k;
                break;
            }
        }
    }
    return hold;
}

/* ---- generation ---- */

static void gen_free(struct gen *g)
{
    struct api *a = g->api;
    if (g->linked) {
        if (g->prev)
            g->prev->next = g->next;
        else if (a->gens == g)
            a->gens = g->next;
        if (g->next)
            g->next->prev = g->prev;
        a->n_gens--;
    }
    for (size_t i = 0; i < g->n_stops; i++)
        free(g->stops[i]);
    free(g->piece);
    free(g->text);
    free(g->reasoning);
    free(g->content);
    json_decref(g->tool_calls);
    json_decref(g->lp);
    free(g->lp_off);
    free(g->echo);
    free(g->r_text);
    json_decref(g->r_output);
    json_decref(g->r_lp);
    free(g);
}

static void group_free(struct gen_group *grp)
{
    for (uint32_t i = 0; grp->g && i < grp->n; i++)
        if (grp->g[i])
            gen_free(grp->g[i]);
    free(grp->g);
    json_decref(grp->choices);
    json_decref(grp->resp);
    free(grp);
}

static void tps_add(struct api *a, uint64_t n)
{
    int64_t s = (int64_t)moe_now_s();
    int b = (int)(s % TPS_BUCKETS);
    if (a->tps_sec[b] != s) {
        a->tps_sec[b] = s;
        a->tps_count[b] = 0;
    }
    a->tps_count[b] += n;
}

/* Tokens per second over the last ten complete seconds. */
static double tps_rate(const struct api *a)
{
    int64_t s = (int64_t)moe_now_s();
    uint64_t sum = 0;
    for (int i = 0; i < TPS_BUCKETS; i++)
        if (a->tps_sec[i] < s && a->tps_sec[i] >= s - 10)
            sum += a->tps_count[i];
    return (double)sum / 10.0;
}

/* Each prompt once (the figures of its first choice), the completion tokens of every choice
 * (as OpenAI counts n > 1 and several prompts). */
static json_t *usage_obj(const struct gen_group *grp)
{
    json_int_t prompt = 0, cached = 0, gen = 0;
    for (uint32_t i = 0; i < grp->n; i++) {
        const struct gen *g = grp->g[i];
        gen += g->n_gen;
        if (i % grp->n_per == 0) {
            prompt += g->n_prompt;
            cached += g->n_cached;
        }
    }
    json_t *u = json_object();
    json_object_set_new(u, "prompt_tokens", json_integer(prompt));
    json_object_set_new(u, "completion_tokens", json_integer(gen));
    json_object_set_new(u, "total_tokens", json_integer(prompt + gen));
    /* As OpenAI reports prompt caching: the prompt tokens taken from a kept KV cache. */
    json_object_set_new(u, "prompt_tokens_details", json_pack("{s:I}", "cached_tokens", cached));
    return u;
}

static json_t *chunk_obj(const struct gen *g)
{
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(g->id));
    json_object_set_new(o, "object", json_string(g->chat ? "chat.completion.chunk" : "text_completion"));
    json_object_set_new(o, "created", json_integer(g->created));
    json_object_set_new(o, "model", json_string(g->api->model_id));
    return o;
}

/* One server-sent event: obj (taken) as its data, with an event line when event is not NULL. */
static int sse_send_event(struct gen *g, const char *event, json_t *obj)
{
    char *s = json_dumps(obj, JSON_COMPACT);
    json_decref(obj);
    if (!s)
        return -ENOMEM;
    size_t n = strlen(s), el = event ? strlen(event) + 8 : 0;
    char *buf = malloc(el + n + 9);
    if (!buf) {
        free(s);
        return -ENOMEM;
    }
    if (event)
        snprintf(buf, el + 1, "event: %s\n", event);
    memcpy(buf + el, "data: ", 6);
    memcpy(buf + el + 6, s, n);
    memcpy(buf + el + 6 + n, "\n\n", 2);
    free(s);
    int rc = http_stream_write(g->conn, buf, el + n + 8);
    free(buf);
    return rc;
}

static int sse_send(struct gen *g, json_t *obj)
{
    return sse_send_event(g, NULL, obj);
}

/* ---- Responses API output: items and events ---- */

static void new_id(struct api *a, char *out, size_t cap, const char *prefix);

/* A Responses event (taken): its type and sequence_number set, sent when streaming. */
static int resp_event(struct gen *g, const char *type, json_t *ev)
{
    if (!g->stream) {
        json_decref(ev);
        return 0;
    }
    json_t *o = json_pack("{s:s}", "type", type); /* type first, as OpenAI sends it */
    json_object_update(o, ev);
    json_decref(ev);
    json_object_set_new(o, "sequence_number", json_integer(g->r_seq++));
    return sse_send_event(g, type, o);
}

/* The Response as it stands: the echoed request fields, the output items done, usage once
 * finished. */
static json_t *resp_snapshot(struct gen *g, const char *status)
{
    const struct gen_group *grp = g->grp;
    json_t *o = json_pack("{s:s}", "id", g->id), *echo = json_deep_copy(grp->resp);
    json_object_update(o, echo);
    json_decref(echo);
    json_object_set_new(o, "created_at", json_integer(g->created));
    json_object_set_new(o, "status", json_string(status));
    json_object_set_new(o, "model", json_string(g->api->model_id));
    json_object_set_new(o, "output", json_deep_copy(g->r_output));
    if (!strcmp(status, "completed") || !strcmp(status, "incomplete")) {
        json_object_set_new(o, "usage", json_pack("{s:I,s:{s:I},s:I,s:{s:i},s:I}", "input_tokens",
                                                  (json_int_t)g->n_prompt, "input_tokens_details",
                                                  "cached_tokens", (json_int_t)g->n_cached,
                                                  "output_tokens", (json_int_t)g->n_gen,
                                                  "output_tokens_details", "reasoning_tokens", 0,
                                                  "total_tokens",
                                                  (json_int_t)g->n_prompt + g->n_gen));
    }
    return o;
}

/* {item_id, output_index[, content_index]} of the item being written. */
static json_t *resp_at(const struct gen *g, bool content)
{
    json_t *o = json_pack("{s:s,s:I}", "item_id", g->r_item, "output_index",
                          (json_int_t)json_array_size(g->r_output));
    if (content)
        json_object_set_new(o, "content_index", json_integer(0));
    return o;
}

/* The open item's content part with text so far. */
static json_t *resp_part(const struct gen *g)
{
    json_t *text = json_text(g->r_text ? g->r_text : "", g->r_len);
    if (g->r_open == RESP_REASONING)
        return json_pack("{s:s,s:o}", "type", "reasoning_text", "text", text);
    return json_pack("{s:s,s:o,s:[],s:o}", "type", "output_text", "text", text, "annotations",
                     "logprobs", g->r_lp ? json_deep_copy(g->r_lp) : json_array());
}

/* Logprob entries as the text events give them: {token, logprob, top_logprobs: [{token,
 * logprob}]} (without the bytes the output_text part has). */
static json_t *resp_lp_event(const json_t *entries)
{
    json_t *out = json_array(), *e, *t;
    size_t i, k;
    json_array_foreach(entries, i, e) {
        json_t *top = json_array();
        json_array_foreach(json_object_get(e, "top_logprobs"), k, t)
            json_array_append_new(top, json_pack("{s:O,s:O}", "token", json_object_get(t, "token"),
                                                 "logprob", json_object_get(t, "logprob")));
        json_array_append_new(out, json_pack("{s:O,s:O,s:o}", "token", json_object_get(e, "token"),
                                             "logprob", json_object_get(e, "logprob"),
                                             "top_logprobs", top));
    }
    return out;
}

/* With logprobs: the entries of the text [start, end) of g->text that chat_out gave as an
 * item's text. Entries whose text ends before start (markup, reasoning) are passed over; those
 * starting before end are the text's: added to the open message's (content) and returned, or
 * passed over (reasoning). NULL without logprobs. */
static json_t *resp_lp_take(struct gen *g, size_t start, size_t end, bool content)
{
    if (!g->logprobs)
        return NULL;
    json_t *got = json_array();
    size_t n = json_array_size(g->lp);
    for (; g->r_lp_next < n && g->lp_off[g->r_lp_next] < end; g->r_lp_next++) {
        const size_t i = g->r_lp_next, off = g->lp_off[i];
        const size_t next = i + 1 < n ? g->lp_off[i + 1] : g->text_len;
        if (!content || (off < start && next <= start))
            continue;
        json_t *e = json_array_get(g->lp, i);
        json_array_append(g->r_lp, e);
        json_array_append(got, e);
    }
    return got;
}

static json_t *resp_item(const struct gen *g, const char *status, json_t *content)
{
    if (g->r_open == RESP_REASONING)
        return json_pack("{s:s,s:s,s:[],s:o,s:s}", "id", g->r_item, "type", "reasoning", "summary",
                         "content", content, "status", status);
    return json_pack("{s:s,s:s,s:s,s:s,s:o}", "id", g->r_item, "type", "message", "status", status,
                     "role", "assistant", "content", content);
}

/* An item is done: its event, and it joins the output. */
static void resp_item_done(struct gen *g, json_t *item)
{
    json_t *ev = json_pack("{s:I,s:O}", "output_index", (json_int_t)json_array_size(g->r_output),
                           "item", item);
    resp_event(g, "response.output_item.done", ev);
    json_array_append_new(g->r_output, item);
}

/* Opens a message or reasoning item (output_item.added, content_part.added). */
static void resp_open(struct gen *g, int kind)
{
    struct api *a = g->api;
    g->r_open = kind;
    g->r_len = 0;
    if (g->r_lp)
        json_array_clear(g->r_lp);
    new_id(a, g->r_item, sizeof g->r_item, kind == RESP_MESSAGE ? "msg_" : "rs_");
    if (kind == RESP_MESSAGE)
        g->r_answered = true;
    resp_event(g, "response.output_item.added",
               json_pack("{s:I,s:o}", "output_index", (json_int_t)json_array_size(g->r_output),
                         "item", resp_item(g, "in_progress", json_array())));
    json_t *ev = resp_at(g, true);
    json_object_set_new(ev, "part", resp_part(g));
    resp_event(g, "response.content_part.added", ev);
}

/* Closes the open item, if any (the text's done, content_part.done, output_item.done). */
static void resp_close(struct gen *g, const char *status)
{
    if (!g->r_open)
        return;
    json_t *ev = resp_at(g, true);
    json_object_set_new(ev, "text", json_text(g->r_text ? g->r_text : "", g->r_len));
    if (g->r_open == RESP_MESSAGE)
        json_object_set_new(ev, "logprobs", g->r_lp ? resp_lp_event(g->r_lp) : json_array());
    resp_event(g, g->r_open == RESP_MESSAGE ? "response.output_text.done"
                                            : "response.reasoning_text.done", ev);
    ev = resp_at(g, true);
    json_object_set_new(ev, "part", resp_part(g));
    resp_event(g, "response.content_part.done", ev);
    resp_item_done(g, resp_item(g, status, json_pack("[o]", resp_part(g))));
    g->r_open = 0;
    g->r_len = 0;
    if (g->r_lp)
        json_array_clear(g->r_lp);
}

/* chat_out's events as Response output items (and their events when streaming). */
static int emit_resp(void *user, enum chat_ev ev, const char *s, size_t n, const struct chat_tool_call *tc)
{
    struct gen *g = user;
    if (ev == CHAT_EV_TOOL_CALL) {
        resp_close(g, "completed");
        g->r_answered = true;
        char id[48];
        new_id(g->api, id, sizeof id, "fc_");
        const json_int_t at = (json_int_t)json_array_size(g->r_output);
        json_t *item = json_pack("{s:s,s:s,s:s,s:s,s:s,s:s}", "id", id, "type", "function_call",
                                 "status", "in_progress", "arguments", "", "call_id", tc->id,
                                 "name", tc->name);
        resp_event(g, "response.output_item.added",
                   json_pack("{s:I,s:O}", "output_index", at, "item", item));
        resp_event(g, "response.function_call_arguments.delta",
                   json_pack("{s:s,s:I,s:s}", "item_id", id, "output_index", at, "delta",
                             tc->arguments));
        resp_event(g, "response.function_call_arguments.done",
                   json_pack("{s:s,s:I,s:s,s:s}", "item_id", id, "output_index", at, "name",
                             tc->name, "arguments", tc->arguments));
        json_object_set_new(item, "status", json_string("completed"));
        json_object_set_new(item, "arguments", json_string(tc->arguments));
        resp_item_done(g, item);
        return 0;
    }
    const int kind = ev == CHAT_EV_REASONING ? RESP_REASONING : RESP_MESSAGE;
    if (!n)
        return 0;
    if (g->r_open != kind) {
        resp_close(g, "completed");
        resp_open(g, kind);
    }
    if (moe_buf_append(&g->r_text, &g->r_len, &g->r_cap, s, n))
        return -ENOMEM;
    /* s is the text chat_out was fed (g->text): where it lies there gives its tokens. */
    size_t start = 0, end = g->stream ? g->lp_bound : g->text_len;
    if (g->text && s >= g->text && s + n <= g->text + g->text_len) {
        start = (size_t)(s - g->text);
        end = start + n;
    }
    json_t *lp = resp_lp_take(g, start, end, kind == RESP_MESSAGE);
    json_t *d = resp_at(g, true);
    json_object_set_new(d, "delta", json_text(s, n));
    if (kind == RESP_MESSAGE)
        json_object_set_new(d, "logprobs", lp ? resp_lp_event(lp) : json_array());
    json_decref(lp);
    return resp_event(g, kind == RESP_MESSAGE ? "response.output_text.delta"
                                              : "response.reasoning_text.delta", d);
}

/* The stream's first events: response.created and response.in_progress. */
static int resp_started(struct gen *g)
{
    int rc = resp_event(g, "response.created", json_pack("{s:o}", "response", resp_snapshot(g, "in_progress")));
    return rc ? rc : resp_event(g, "response.in_progress",
                                json_pack("{s:o}", "response", resp_snapshot(g, "in_progress")));
}

/* Starts the event stream; a chat stream opens every choice with an assistant role delta. */
static int stream_headers(struct gen *g)
{
    if (g->grp->headers_sent)
        return 0;
    g->grp->headers_sent = true;
    count_response(g->api, 200);
    int rc = http_stream_start(g->conn, 200, "text/event-stream",
                               "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n");
    if (rc == 0 && g->responses)
        return resp_started(g);
    for (uint32_t i = 0; rc == 0 && g->chat && i < g->grp->n; i++) {
        json_t *o = chunk_obj(g);
        json_t *ch = json_object();
        json_t *delta = json_object();
        json_object_set_new(delta, "role", json_string("assistant"));
        json_object_set_new(delta, "content", json_string(""));
        json_object_set_new(ch, "index", json_integer(i));
        json_object_set_new(ch, "delta", delta);
        json_object_set_new(ch, "logprobs", json_null());
        json_object_set_new(ch, "finish_reason", json_null());
        json_object_set_new(o, "choices", json_pack("[o]", ch));
        if (g->include_usage)
            json_object_set_new(o, "usage", json_null());
        rc = sse_send(g, o);
    }
    return rc;
}

/* A logprob as JSON can hold it (-inf: a token that cannot be sampled). */
static double lp_num(float x)
{
    return isfinite(x) ? (double)x : -9999.0;
}

/* {token, logprob, bytes} of one token: its own text (U+FFFD where it is not UTF-8 by itself)
 * and its bytes. */
static json_t *lp_token(const struct api *a, int32_t id, float logprob)
{
    char buf[512];
    int n = moe_tok_piece(a->tok, id, buf, sizeof buf);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof buf ? (size_t)n : sizeof buf;
    json_t *bytes = json_array();
    for (size_t i = 0; i < len; i++)
        json_array_append_new(bytes, json_integer((unsigned char)buf[i]));
    return json_pack("{s:o,s:f,s:o}", "token", json_text(buf, len), "logprob", lp_num(logprob),
                     "bytes", bytes);
}

/* Records a token's logprobs (NULL: the prompt's first token, which has none); off: where its
 * text starts in g->text. Returns 0 or -ENOMEM. */
static int lp_add(struct gen *g, int32_t token, const struct sched_logprob *lp, size_t off)
{
    size_t n = json_array_size(g->lp);
    if (n == g->lp_cap) {
        size_t cap = g->lp_cap ? 2 * g->lp_cap : 64;
        size_t *p = realloc(g->lp_off, cap * sizeof *p);
        if (!p)
            return -ENOMEM;
        g->lp_off = p;
        g->lp_cap = cap;
    }
    json_t *e = lp_token(g->api, token, lp ? lp->logprob : 0);
    json_t *top = lp ? json_array() : json_null();
    for (uint32_t i = 0; lp && i < lp->n_top && i < g->n_top; i++)
        json_array_append_new(top, lp_token(g->api, lp->top_id[i], lp->top_lp[i]));
    json_object_set_new(e, "top_logprobs", top);
    if (!lp)
        json_object_set_new(e, "logprob", json_null());
    if (json_array_append_new(g->lp, e))
        return -ENOMEM;
    g->lp_off[n] = off;
    return 0;
}

static size_t utf8_chars(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += ((unsigned char)s[i] & 0xc0) != 0x80;
    return c;
}

/* Entries [from, to) in the endpoint's shape: chat {content: [...], refusal}; completions
 * {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset} (text_offset: where
 * each token starts, in characters, counting the echoed prompt and the tokens before it). */
static json_t *lp_obj(struct gen *g, size_t from, size_t to)
{
    if (g->chat) {
        json_t *c = json_array();
        for (size_t i = from; i < to; i++)
            json_array_append(c, json_array_get(g->lp, i));
        return json_pack("{s:o,s:n}", "content", c, "refusal");
    }
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (size_t i = from; i < to; i++) {
        json_t *e = json_array_get(g->lp, i);
        json_array_append(toks, json_object_get(e, "token"));
        json_array_append(lps, json_object_get(e, "logprob"));
        json_t *top = json_object_get(e, "top_logprobs"), *t;
        json_t *d = json_is_null(top) ? json_null() : json_object();
        size_t k;
        json_array_foreach(top, k, t)
            json_object_set(d, json_string_value(json_object_get(t, "token")), json_object_get(t, "logprob"));
        json_array_append_new(tops, d);
        json_t *tok = json_object_get(e, "token");
        json_array_append_new(offs, json_integer((json_int_t)g->lp_chars));
        g->lp_chars += utf8_chars(json_string_value(tok), json_string_length(tok));
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops,
                     "text_offset", offs);
}

/* For a streamed chunk: the entries not streamed yet whose text starts before upto (and the
 * prompt's, with the echoed prompt); null without logprobs. */
static json_t *lp_take(struct gen *g, size_t upto)
{
    if (!g->logprobs)
        return json_null();
    size_t n = json_array_size(g->lp), to = g->lp_sent;
    while (to < n && (to < g->n_plp || g->lp_off[to] < upto))
        to++;
    json_t *o = lp_obj(g, g->lp_sent, to);
    g->lp_sent = to;
    return o;
}

/* llama-server's per-response timings: prompt (each prompt's first choice: its tokens summed,
 * the time from the request to the last of their first tokens, so queueing too) and generation
 * (first token to last, of all choices together). */
static json_t *timings_obj(const struct gen_group *grp)
{
    double pms = 0, first = 0, last = 0;
    json_int_t n_gen = 0, pn = 0, cn = 0;
    for (uint32_t i = 0; i < grp->n; i += grp->n_per) {
        const struct gen *g = grp->g[i];
        const double ms = ((g->n_gen ? g->t_first : g->t_last) - g->t_start) * 1e3;
        const uint32_t cached = g->n_cached < g->n_prompt ? g->n_cached : g->n_prompt;
        pms = ms > pms ? ms : pms;
        cn += g->n_cached;
        pn += g->n_prompt - cached;
    }
    for (uint32_t i = 0; i < grp->n; i++) {
        const struct gen *x = grp->g[i];
        if (!x->n_gen)
            continue;
        if (!n_gen || x->t_first < first)
            first = x->t_first;
        if (!n_gen || x->t_last > last)
            last = x->t_last;
        n_gen += x->n_gen;
    }
    const double gms = n_gen ? (last - first) * 1e3 : 0;
    return json_pack("{s:I,s:I,s:f,s:f,s:f,s:I,s:f,s:f,s:f}", "cache_n", cn,
                     "prompt_n", pn, "prompt_ms", pms,
                     "prompt_per_token_ms", pn ? pms / (double)pn : 0.0,
                     "prompt_per_second", pms > 0 ? (double)pn * 1e3 / pms : 0.0,
                     "predicted_n", n_gen, "predicted_ms", gms,
                     "predicted_per_token_ms", n_gen ? gms / (double)n_gen : 0.0,
                     "predicted_per_second", gms > 0 ? (double)n_gen * 1e3 / gms : 0.0);
}

/* One streamed chunk: a chat delta (taken) or a completion's text, with a finish reason or not. */
static int stream_send(struct gen *g, json_t *delta, const char *text, size_t n, const char *finish)
{
    int rc = stream_headers(g);
    if (rc) {
        json_decref(delta);
        return rc;
    }
    json_t *o = chunk_obj(g);
    json_t *ch = json_object();
    json_object_set_new(ch, "index", json_integer(g->index));
    if (g->chat)
        json_object_set_new(ch, "delta", delta ? delta : json_object());
    else
        json_object_set_new(ch, "text", finish ? json_string("") : json_text(text, n));
    json_object_set_new(ch, "logprobs", lp_take(g, finish ? SIZE_MAX : g->lp_bound));
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    if (finish && g->grp->n_open == 1) /* the last choice to finish */
        json_object_set_new(o, "timings", timings_obj(g->grp));
    json_object_set_new(o, "choices", json_pack("[o]", ch));
    if (g->include_usage)
        json_object_set_new(o, "usage", json_null());
    return sse_send(g, o);
}

static json_t *tool_call_obj(const struct chat_tool_call *tc, bool with_index)
{
    json_t *o = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", tc->id, "type", "function", "function",
                          "name", tc->name, "arguments", tc->arguments);
    if (o && with_index)
        json_object_set_new(o, "index", json_integer(tc->index));
    return o;
}

/* chat_out's events as stream deltas. */
static int emit_stream(void *user, enum chat_ev ev, const char *s, size_t n, const struct chat_tool_call *tc)
{
    struct gen *g = user;
    json_t *d = json_object();
    if (ev == CHAT_EV_TOOL_CALL)
        json_object_set_new(d, "tool_calls", json_pack("[o]", tool_call_obj(tc, true)));
    else
        json_object_set_new(d, ev == CHAT_EV_REASONING ? "reasoning_content" : "content", json_text(s, n));
    return stream_send(g, d, NULL, 0, NULL);
}

/* chat_out's events gathered for the whole message. */
static int emit_collect(void *user, enum chat_ev ev, const char *s, size_t n, const struct chat_tool_call *tc)
{
    struct gen *g = user;
    if (ev == CHAT_EV_TOOL_CALL) {
        if (!g->tool_calls)
            g->tool_calls = json_array();
        return json_array_append_new(g->tool_calls, tool_call_obj(tc, false)) ? -ENOMEM : 0;
    }
    if (ev == CHAT_EV_REASONING)
        return moe_buf_append(&g->reasoning, &g->reasoning_len, &g->reasoning_cap, s, n);
    return moe_buf_append(&g->content, &g->content_len, &g->content_cap, s, n);
}

/* Streams the text that can no longer become part of a stop string. */
static void stream_pending(struct gen *g, bool final)
{
    size_t upto = g->text_len;
    if (!final)
        upto -= api_stop_holdback(g->text, g->text_len, g->stops, g->n_stops);
    if (g->echo && !g->echo_sent) {
        g->echo_sent = true;
        g->lp_bound = 0;
        stream_send(g, NULL, g->echo, g->echo_len, NULL);
    }
    g->lp_bound = upto;
    if (g->chat) {
        stream_headers(g);
        chat_out_feed(&g->co, g->text, upto, final, g->responses ? emit_resp : emit_stream, g);
    } else if (upto > g->sent) {
        stream_send(g, NULL, g->text + g->sent, upto - g->sent, NULL);
        g->sent = upto;
    } else if (!g->grp->headers_sent) {
        stream_headers(g);
    }
}

/* A Response is over (it has one choice): its last items, then the Response (the last event
 * when streaming); the group is freed. A length cut makes it incomplete. */
static void resp_finish(struct gen *g, const char *reason)
{
    const bool cut = !strcmp(reason, "length");
    const char *status = cut ? "incomplete" : "completed";
    if (g->stream)
        stream_pending(g, true);
    else
        chat_out_feed(&g->co, g->text, g->text_len, true, emit_resp, g);
    resp_close(g, status);
    if (!g->r_answered) { /* nothing but reasoning, or nothing at all: an empty message */
        resp_open(g, RESP_MESSAGE);
        resp_close(g, status);
    }
    json_t *o = resp_snapshot(g, status);
    if (cut)
        json_object_set_new(o, "incomplete_details", json_pack("{s:s}", "reason", "max_output_tokens"));
    http_conn_on_abort(g->conn, NULL, NULL);
    if (g->stream) {
        resp_event(g, cut ? "response.incomplete" : "response.completed", json_pack("{s:o}", "response", o));
        http_stream_end(g->conn);
    } else {
        respond_json(g->api, g->conn, 200, o, NULL);
    }
    group_free(g->grp);
}

/* A choice is over (stop string, end of generation or length): its last chunk, or its part of
 * the answer; once every choice is, the end of the stream or the answer, and the group is
 * freed. */
static void gen_finish(struct gen *g, const char *reason)
{
    struct api *a = g->api;
    struct gen_group *grp = g->grp;
    struct http_conn *c = g->conn;
    if (g->finished)
        return;
    g->finished = true;
    if (g->responses) {
        resp_finish(g, reason);
        return;
    }
    if (g->chat && !g->stream)
        chat_out_feed(&g->co, g->text, g->text_len, true, emit_collect, g);
    if (g->chat && g->co.n_calls && !strcmp(reason, "stop"))
        reason = "tool_calls";
    if (g->stream) {
        stream_pending(g, true);
        if (g->chat && g->co.n_calls && !strcmp(reason, "stop"))
            reason = "tool_calls";
        stream_send(g, NULL, NULL, 0, reason);
    } else {
        json_t *ch = json_object();
        json_object_set_new(ch, "index", json_integer(g->index));
        if (g->chat) {
            json_t *m = json_object();
            json_object_set_new(m, "role", json_string("assistant"));
            json_object_set_new(m, "content", g->tool_calls && !g->content_len
                                                  ? json_null() : json_text(g->content ? g->content : "", g->content_len));
            if (g->reasoning_len)
                json_object_set_new(m, "reasoning_content", json_text(g->reasoning, g->reasoning_len));
            if (g->tool_calls) {
                json_object_set_new(m, "tool_calls", g->tool_calls);
                g->tool_calls = NULL;
            }
            json_object_set_new(ch, "message", m);
        } else if (g->echo) {
            char *t = malloc(g->echo_len + g->text_len + 1);
            if (t) {
                memcpy(t, g->echo, g->echo_len);
                if (g->text_len) /* nothing generated: text is NULL */
                    memcpy(t + g->echo_len, g->text, g->text_len);
            }
            json_object_set_new(ch, "text", t ? json_text(t, g->echo_len + g->text_len) : json_string(""));
            free(t);
        } else {
            json_object_set_new(ch, "text", json_text(g->text, g->text_len));
        }
        json_object_set_new(ch, "logprobs", g->logprobs ? lp_obj(g, 0, json_array_size(g->lp)) : json_null());
        json_object_set_new(ch, "finish_reason", json_string(reason));
        json_array_set_new(grp->choices, g->index, ch);
    }
    if (--grp->n_open)
        return;
    http_conn_on_abort(c, NULL, NULL);
    if (g->stream) {
        if (g->include_usage) {
            json_t *o = chunk_obj(g);
            json_object_set_new(o, "choices", json_array());
            json_object_set_new(o, "usage", usage_obj(grp));
            sse_send(g, o);
        }
        http_stream_write(c, "data: [DONE]\n\n", 14);
        http_stream_end(c);
    } else {
        json_t *o = json_object();
        json_object_set_new(o, "id", json_string(g->id));
        json_object_set_new(o, "object", json_string(g->chat ? "chat.completion" : "text_completion"));
        json_object_set_new(o, "created", json_integer(g->created));
        json_object_set_new(o, "model", json_string(a->model_id));
        json_object_set_new(o, "choices", grp->choices);
        grp->choices = NULL;
        json_object_set_new(o, "usage", usage_obj(grp));
        json_object_set_new(o, "timings", timings_obj(grp));
        respond_json(a, c, 200, o, NULL);
    }
    group_free(grp);
}

/* Appends new text, checks the stop strings; true when a stop string ended the generation. */
static bool take_text(struct gen *g, const char *s, size_t n)
{
    if (!n)
        return false;
    size_t before = g->text_len;
    if (moe_buf_append(&g->text, &g->text_len, &g->text_cap, s, n))
        return false;
    if (g->n_stops) {
        /* Earlier text was checked already: a match must end in the new bytes. */
        size_t from = before >= MAX_STOP_LEN ? before - MAX_STOP_LEN : 0;
        long at = api_find_stop(g->text, g->text_len, from, g->stops, g->n_stops);
        if (at >= 0) {
            g->text_len = (size_t)at;
            g->text[at] = 0;
            return true;
        }
    }
    return false;
}

static void on_token(struct sched_req *r, void *user, int32_t token)
{
    struct gen *g = user;
    struct api *a = g->api;
    const double now = moe_now_s();
    if (g->n_gen == 0) {
        lat_observe(&a->ttft, TTFT_BOUNDS, now - g->t_start);
        g->t_first = now;
    } else {
        lat_observe(&a->itl, ITL_BOUNDS, now - g->t_last);
    }
    g->t_last = now;
    g->n_gen++;
    a->gen_tokens++;
    tps_add(a, 1);
    const struct sched_logprob *lp = g->logprobs ? sched_req_logprob(r) : NULL;
    if (lp)
        lp_add(g, token, lp, g->text_len);
    /* The end-of-generation token ends the answer; its text ("<|endoftext|>") is not part of
     * it (the worker ends the request after it). */
    size_t n = moe_tok_is_eog(a->tok, token)
                   ? 0
                   : moe_detok_push(&g->detok, a->tok, token, g->piece, g->piece_cap);
    if (take_text(g, g->piece, n)) {
        /* The tokens of the stop string are not part of the answer. */
        while (g->logprobs && json_array_size(g->lp) > g->lp_sent &&
               json_array_size(g->lp) > g->n_plp &&
               g->lp_off[json_array_size(g->lp) - 1] >= g->text_len)
            json_array_remove(g->lp, json_array_size(g->lp) - 1);
        /* A stop string matched: nothing after it may be generated or sent. */
        sched_cancel(a->sched, g->req);
        g->req = NULL;
        gen_finish(g, "stop");
        return;
    }
    if (g->stream)
        stream_pending(g, false);
}

/* echo with logprobs: the prompt's tokens, in order, before any generated one. */
static void on_prompt_logprob(struct sched_req *r, void *user, uint32_t pos, int32_t token,
                              const struct sched_logprob *lp)
{
    struct gen *g = user;
    (void)r;
    if (!g->logprobs || g->n_gen || !g->n_plp)
        return;
    if (pos == 1 && g->n_plp > 1) { /* sent again by the worker a retry went to */
        while (json_array_size(g->lp) > 1)
            json_array_remove(g->lp, json_array_size(g->lp) - 1);
        g->n_plp = 1;
    }
    if (pos == g->n_plp && lp_add(g, token, lp, 0) == 0)
        g->n_plp++;
}

static void gen_done(struct gen *g, enum sched_finish why)
{
    size_t n = moe_detok_flush(&g->detok, g->piece, g->piece_cap);
    take_text(g, g->piece, n);
    gen_finish(g, why == SCHED_FINISH_LENGTH ? "length" : "stop");
}

static void gen_fail(struct gen *g, int http_status, const char *message);

static void on_done(struct sched_req *r, void *user, enum sched_finish why, uint32_t n_prompt,
                    uint32_t n_gen)
{
    struct gen *g = user;
    (void)n_prompt, (void)n_gen;
    g->n_cached = sched_req_cached(r);
    g->req = NULL;
    if (g->grp->submitting) {
        g->early = 1;
        g->early_why = why;
        return;
    }
    gen_done(g, why);
}

static void on_error(struct sched_req *r, void *user, int http_status, const char *message)
{
    struct gen *g = user;
    (void)r;
    g->req = NULL;
    if (g->grp->submitting) {
        g->early = 2;
        g->early_status = http_status;
        snprintf(g->early_msg, sizeof g->early_msg, "%s", message ? message : "");
        return;
    }
    gen_fail(g, http_status, message);
}

/* Stops every choice of the group (the others' requests are cancelled). */
static void group_cancel(struct gen_group *grp)
{
    for (uint32_t i = 0; i < grp->n; i++) {
        struct gen *x = grp->g[i];
        if (x && x->req)
            sched_cancel(grp->api->sched, x->req);
        if (x)
            x->req = NULL;
    }
}

/* A choice failed: the whole response does (an error event once streaming) and is freed. */
static void gen_fail(struct gen *g, int http_status, const char *message)
{
    struct api *a = g->api;
    struct gen_group *grp = g->grp;
    a->gen_errors++;
    log_warn("generation %s failed (%d): %s", g->id, http_status, message);
    http_conn_on_abort(g->conn, NULL, NULL);
    group_cancel(grp);
    if (grp->headers_sent) {
        /* Too late for a status code: an error event tells SSE clients (the openai SDK raises
         * it) that the stream is broken, and there is no [DONE]. */
        int status = http_status >= 400 ? http_status : 500;
        if (g->responses) {
            /* As OpenAI's stream: an error event, then response.failed with the Response. */
            resp_event(g, "error", json_pack("{s:s,s:o,s:n}", "code", error_code(status), "message",
                                             json_text(message, strlen(message)), "param"));
            json_t *r = resp_snapshot(g, "failed");
            json_object_set_new(r, "error", json_pack("{s:s,s:o}", "code", "server_error", "message",
                                                      json_text(message, strlen(message))));
            resp_event(g, "response.failed", json_pack("{s:o}", "response", r));
        } else {
            json_t *o = json_object();
            json_object_set_new(o, "error", error_obj(status, NULL, message));
            sse_send(g, o);
        }
        http_stream_end(g->conn);
    } else {
        respond_error(a, g->conn, http_status >= 400 ? http_status : 500, NULL, "%s", message);
    }
    group_free(grp);
}

/* The client went away: stop generating for it. */
static void on_abort(void *user)
{
    struct gen_group *grp = user;
    group_cancel(grp);
    log_debug("generation %s: client disconnected after %u tokens", grp->g[0]->id, grp->g[0]->n_gen);
    group_free(grp);
}

/* ---- request parsing ---- */

/* One prompt of a request, tokenized: a completion's 'prompt' holds one or several, a chat one. */
struct gen_prompt {
    int32_t *ids;
    size_t n;
    bool is_bound;                /* tokenizing stopped early: the prompt has more than n */
    char *echo;                   /* echo: the prompt's text (the string given, or the ids' text) */
    size_t echo_len;
    char what[24];                /* how messages name it: "the prompt", "'prompt[3]'" */
};

struct gen_req {
    /* The prompt being tokenized (a chat's parts are appended to it); once complete it moves to
     * prompts[]. what: how messages name it. */
    int32_t *prompt;
    size_t n_prompt;
    bool n_prompt_is_bound;       /* tokenizing stopped early: the prompt has more than n_prompt */
    char what[24];
    struct gen_prompt *prompts;   /* [n_prompts]; choice k answers prompts[k / n] */
    uint32_t n_prompts;
    bool prompt_list;             /* completions: 'prompt' is an array of prompts */
    struct sched_sampling s;
    int64_t max_tokens;           /* -1: default */
    bool stream, include_usage;
    bool truncate;                /* truncation "auto": drop the oldest messages to fit */
    uint32_t dropped;             /* messages truncation dropped */
    char *stops[MAX_STOPS];
    size_t n_stops;
    bool tools;                   /* chat: the request has tools (parse tool calls) */
    json_t *resp;                 /* POST /v1/responses: the Response's echoed fields */
    bool think_open;              /* chat: the prompt ends inside <think> */
    bool call_forced;             /* chat: the grammar forces a <tool_call> (force_tool_call) */
    uint32_t n;                   /* choices */
    bool echo;                    /* completions: the answer starts with the prompt */
    int32_t *bias_tok;            /* logit_bias; r->s points at these */
    float *bias_val;
    char *grammar;                /* GBNF from grammar / json_schema / response_format; r->s too */
};

static void gen_req_free(struct gen_req *r)
{
    free(r->prompt);
    for (uint32_t i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].ids);
        free(r->prompts[i].echo);
    }
    free(r->prompts);
    free(r->bias_tok);
    free(r->bias_val);
    free(r->grammar);
    json_decref(r->resp);
    for (size_t i = 0; i < r->n_stops; i++)
        free(r->stops[i]);
}

/* A validation failure: status, param and message for the response. */
struct verr {
    int status;
    const char *param;
    char msg[512];
};

static int fail(struct verr *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(struct verr *e, int status, const char *param, const char *fmt, ...)
{
    va_list ap;
    e->status = status;
    e->param = param;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return -1;
}

static const char *jtype(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* Optional number field in [lo, hi]. */
static int get_num(json_t *body, const char *key, double lo, double hi, float *out, struct verr *e)
{
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_number(v))
        return fail(e, 400, key, "'%s' must be a number, not %s", key, jtype(v));
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi)
        return fail(e, 400, key, "'%s' must be between %g and %g, not %g", key, lo, hi, d);
    *out = (float)d;
    return 0;
}

static int get_int(json_t *body, const char *key, int64_t lo, int64_t hi, int64_t *out, bool *set,
                   struct verr *e)
{
    json_t *v = json_object_get(body, key);
    if (set)
        *set = false;
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_integer(v))
        return fail(e, 400, key, "'%s' must be an integer, not %s", key, jtype(v));
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return fail(e, 400, key, "'%s' must be between %" PRId64 " and %" PRId64 ", not %" PRId64,
                    key, lo, hi, (int64_t)x);
    *out = x;
    if (set)
        *set = true;
    return 0;
}

static int get_bool(json_t *body, const char *key, bool *out, struct verr *e)
{
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_boolean(v))
        return fail(e, 400, key, "'%s' must be a boolean, not %s", key, jtype(v));
    *out = json_is_true(v);
    return 0;
}

/* Chat: logprobs (boolean) and top_logprobs (0..20, only with logprobs); completions: logprobs
 * (0..20 most likely tokens per position; null or false: none). */
static int parse_logprobs(json_t *body, bool chat, struct gen_req *r, struct verr *e)
{
    json_t *v = json_object_get(body, "logprobs");
    const int64_t max = SCHED_MAX_TOP_LOGPROBS;
    int64_t top = 0;
    bool set = false;
    if (chat) {
        if (get_bool(body, "logprobs", &r->s.logprobs, e) ||
            get_int(body, "top_logprobs", 0, max, &top, &set, e))
            return -1;
        if (set && !r->s.logprobs)
            return fail(e, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    } else {
        if ((v = json_object_get(body, "top_logprobs")) && !json_is_null(v))
            return fail(e, 400, "top_logprobs", "'top_logprobs' is a chat field; /v1/completions "
                        "takes 'logprobs': N");
        v = json_object_get(body, "logprobs");
        if (v && !json_is_null(v) && !json_is_false(v)) {
            if (!json_is_integer(v))
                return fail(e, 400, "logprobs", "'logprobs' must be an integer 0..%d (the most likely "
                            "tokens to list per position), not %s", (int)max, jtype(v));
            if (get_int(body, "logprobs", 0, max, &top, &set, e))
                return -1;
            r->s.logprobs = true;
        }
    }
    r->s.top_logprobs = (uint32_t)top;
    return 0;
}

/* logit_bias: {"token id": bias in -100..100}, added to those logits before sampling. */
/* Whether a grammar parses and can start (the worker's first steps are what a state at the
 * start needs: an ambiguity past its limits shows here). 0 or -1 with the message in err. */
static int grammar_check(const char *text, char *err, size_t errlen)
{
    struct moe_grammar *gr = moe_grammar_parse(text, strlen(text), err, errlen);
    if (!gr)
        return -1;
    struct moe_grammar_state *st = moe_grammar_state_new(gr, err, errlen);
    const int rc = st ? 0 : -1;
    moe_grammar_state_free(st);
    moe_grammar_free(gr);
    return rc;
}

/* Structured output: `grammar` (GBNF, as llama-server takes it), `json_schema` (a schema, as
 * llama-server takes it) or `response_format` {"type": "json_object"} / {"type": "json_schema",
 * "json_schema": {"schema": ...}} (OpenAI), at most one of them. The grammar is parsed here so
 * that a bad one is a 400; the worker masks the tokens it does not allow (store/grammar.h). */
static int parse_constraint(json_t *body, struct gen_req *r, struct verr *e)
{
    json_t *g = json_object_get(body, "grammar"), *js = json_object_get(body, "json_schema"),
           *rf = json_object_get(body, "response_format");
    if (g && (json_is_null(g) || (json_is_string(g) && json_string_length(g) == 0)))
        g = NULL;
    if (js && json_is_null(js))
        js = NULL;
    const char *rft = NULL;
    json_t *rf_schema = NULL;
    if (rf && !json_is_null(rf)) {
        json_t *t = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
        if (!json_is_string(t))
            return fail(e, 400, "response_format", "'response_format' must be an object with a "
                        "'type' of text, json_object or json_schema");
        rft = json_string_value(t);
        if (!strcmp(rft, "text")) {
            rft = NULL;
        } else if (!strcmp(rft, "json_schema")) {
            json_t *o = json_object_get(rf, "json_schema");
            rf_schema = json_is_object(o) ? json_object_get(o, "schema") : NULL;
            if (!json_is_object(rf_schema) && !json_is_boolean(rf_schema))
                return fail(e, 400, "response_format", "'response_format.json_schema.schema' "
                            "must be a JSON Schema object");
        } else if (strcmp(rft, "json_object")) {
            return fail(e, 400, "response_format", "'response_format.type' must be text, "
                        "json_object or json_schema, not '%s'", rft);
        }
    }
    if ((g != NULL) + (js != NULL) + (rft != NULL) > 1)
        return fail(e, 400, g ? "grammar" : "json_schema", "give one of 'grammar', 'json_schema' "
                    "and 'response_format' (json_object or json_schema)");
    char err[512];
    if (g) {
        if (!json_is_string(g))
            return fail(e, 400, "grammar", "'grammar' must be a string (GBNF)");
        if (!(r->grammar = strdup(json_string_value(g))))
            return fail(e, 500, NULL, "out of memory");
    } else if (js || rf_schema) {
        if (moe_json_schema_to_gbnf(js ? js : rf_schema, &r->grammar, err, sizeof err))
            return fail(e, 400, js ? "json_schema" : "response_format", "the JSON schema: %s",
                        err);
    } else if (rft) {
        if (!(r->grammar = strdup(moe_json_object_gbnf())))
            return fail(e, 500, NULL, "out of memory");
    } else {
        return 0;
    }
    if (grammar_check(r->grammar, err, sizeof err))
        return fail(e, 400, g ? "grammar" : js ? "json_schema" : "response_format",
                    "the grammar: %s", err);
    r->s.grammar = r->grammar;
    return 0;
}

/* ignore_eos (as llama-server): every end-of-generation token the workers would stop at (the
 * scheduler's list) gets the bias -100 (over any logit_bias of its own), so that the generation
 * runs to max_tokens, and the worker is given none to stop at. */
static int add_eog_ban(struct api *a, struct gen_req *r, struct verr *e)
{
    uint32_t n_eog;
    const int32_t *eog = sched_eog(a->sched, &n_eog);
    if (n_eog == 0)
        return 0;
    const uint32_t n = r->s.n_bias;
    int32_t *bt = realloc(r->bias_tok, (n + n_eog) * sizeof *bt);
    if (bt)
        r->bias_tok = bt;
    float *bv = bt ? realloc(r->bias_val, (n + n_eog) * sizeof *bv) : NULL;
    if (bv)
        r->bias_val = bv;
    if (!bt || !bv)
        return fail(e, 500, NULL, "out of memory");
    uint32_t k = n;
    for (uint32_t j = 0; j < n_eog; j++) {
        uint32_t i = 0;
        while (i < n && r->bias_tok[i] != eog[j])
            i++;
        if (i == n)
            i = k++;
        r->bias_tok[i] = eog[j];
        r->bias_val[i] = -100.0f;
    }
    if (k > SCHED_MAX_BIAS)
        return fail(e, 400, "logit_bias", "'logit_bias' with 'ignore_eos' has %u entries, the "
                    "end-of-generation tokens counted (at most %d)", k, SCHED_MAX_BIAS);
    r->s.bias_tok = r->bias_tok;
    r->s.bias_val = r->bias_val;
    r->s.n_bias = k;
    return 0;
}

static int parse_logit_bias(struct api *a, json_t *body, struct gen_req *r, struct verr *e)
{
    json_t *v = json_object_get(body, "logit_bias");
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_object(v))
        return fail(e, 400, "logit_bias", "'logit_bias' must be an object of token ids (as strings) "
                    "to biases, not %s", jtype(v));
    size_t n = json_object_size(v);
    if (n == 0)
        return 0;
    if (n > SCHED_MAX_BIAS)
        return fail(e, 400, "logit_bias", "'logit_bias' has %zu entries (at most %d)", n, SCHED_MAX_BIAS);
    r->bias_tok = malloc(n * sizeof *r->bias_tok);
    r->bias_val = malloc(n * sizeof *r->bias_val);
    if (!r->bias_tok || !r->bias_val)
        return fail(e, 500, NULL, "out of memory");
    const char *key;
    json_t *x;
    size_t k = 0;
    json_object_foreach(v, key, x) {
        char *end = NULL;
        errno = 0;
        long long id = key[0] >= '0' && key[0] <= '9' ? strtoll(key, &end, 10) : -1;
        if (!end || *end || errno)
            return fail(e, 400, "logit_bias", "'logit_bias' key \"%.64s\" is not a token id (a "
                        "non-negative integer)", key);
        if (id > INT32_MAX || (a->model.n_vocab && id >= (long long)a->model.n_vocab))
            return fail(e, 400, "logit_bias", "'logit_bias' key %.64s is not a token id (n_vocab %u)",
                        key, a->model.n_vocab);
        if (!json_is_number(x))
            return fail(e, 400, "logit_bias", "'logit_bias[\"%s\"]' must be a number, not %s", key,
                        jtype(x));
        double b = json_number_value(x);
        if (!isfinite(b) || b < -100 || b > 100)
            return fail(e, 400, "logit_bias", "'logit_bias[\"%s\"]' must be between -100 and 100, "
                        "not %g", key, b);
        r->bias_tok[k] = (int32_t)id;
        r->bias_val[k] = (float)b;
        k++;
    }
    r->s.bias_tok = r->bias_tok;
    r->s.bias_val = r->bias_val;
    r->s.n_bias = (uint32_t)k;
    return 0;
}

/* Fields shared by both generation endpoints. */
static int force_tool_call(json_t *body, struct gen_req *r, struct verr *e);

static int parse_common(struct api *a, json_t *body, bool chat, struct gen_req *r, struct verr *e)
{
    json_t *v;
    r->s = (struct sched_sampling){.temperature = a->sampling.temperature,
                                   .top_p = a->sampling.top_p,
                                   .top_k = a->sampling.top_k,
                                   .min_p = a->sampling.min_p,
                                   .repetition_penalty = a->sampling.repetition_penalty};
    r->max_tokens = -1;
    if ((v = json_object_get(body, "model")) && !json_is_string(v) && !json_is_null(v))
        return fail(e, 400, "model", "'model' must be a string, not %s", jtype(v));
    /* As OpenAI: a model that is not served is 404 model_not_found (absent or null: the one). */
    if (v && json_is_string(v) && strcmp(json_string_value(v), a->model_id) != 0)
        return fail(e, 404, "model", "The model '%.200s' does not exist (this daemon serves '%s'; "
                    "see /v1/models)", json_string_value(v), a->model_id);
    if (get_num(body, "temperature", 0, 100, &r->s.temperature, e) ||
        get_num(body, "top_p", 0, 1, &r->s.top_p, e) ||
        get_num(body, "min_p", 0, 1, &r->s.min_p, e) ||
        get_num(body, "repetition_penalty", 0.01, 100, &r->s.repetition_penalty, e) ||
        get_num(body, "presence_penalty", -2, 2, &r->s.presence_penalty, e) ||
        get_num(body, "frequency_penalty", -2, 2, &r->s.frequency_penalty, e))
        return -1;
    int64_t k = 0, seed = 0, n = 1, mt = -1;
    bool seed_set = false, mt_set = false;
    if (get_int(body, "top_k", 0, a->model.n_vocab ? a->model.n_vocab : INT32_MAX, &k, NULL, e) ||
        get_int(body, "seed", INT64_MIN, INT64_MAX, &seed, &seed_set, e) ||
        get_int(body, "n", 1, MAX_CHOICES, &n, NULL, e))
        return -1;
    r->n = (uint32_t)n;
    r->s.top_k = (int32_t)k;
    r->s.seed = (uint64_t)seed;
    r->s.has_seed = seed_set;
    uint32_t n_ctx = a->model.n_ctx ? a->model.n_ctx : UINT32_MAX;
    const char *mt_key = json_object_get(body, "max_completion_tokens") ? "max_completion_tokens"
                                                                        : "max_tokens";
    if (get_int(body, mt_key, INT64_MIN, INT64_MAX, &mt, &mt_set, e))
        return -1;
    if (mt_set && (mt < 1 || mt > n_ctx))
        return fail(e, 400, mt_key, "'%s' must be between 1 and %u (the context length), not %" PRId64,
                    mt_key, n_ctx, mt);
    r->max_tokens = mt_set ? mt : -1;
    /* llama-server's n_predict, when neither OpenAI name is given: -1 up to the context. */
    int64_t np = 0;
    bool np_set = false;
    if (!mt_set && json_object_get(body, "n_predict")) {
        if (get_int(body, "n_predict", INT64_MIN, INT64_MAX, &np, &np_set, e))
            return -1;
        if (np_set && np != -1 && (np < 1 || np > n_ctx))
            return fail(e, 400, "n_predict", "'n_predict' must be -1 or between 1 and %u, not %" PRId64,
                        n_ctx, np);
        if (np_set)
            r->max_tokens = np == -1 ? (int64_t)n_ctx : np;
    }
    if (get_bool(body, "stream", &r->stream, e))
        return -1;
    /* As OpenAI's Responses API: "auto" drops the oldest conversation messages (never the
     * system ones, never the last) until the prompt fits; "disabled" (default) answers 400. */
    if ((v = json_object_get(body, "truncation")) && !json_is_null(v)) {
        if (!json_is_string(v) || (strcmp(json_string_value(v), "auto") &&
                                   strcmp(json_string_value(v), "disabled")))
            return fail(e, 400, "truncation", "'truncation' must be \"auto\" or \"disabled\"");
        r->truncate = !strcmp(json_string_value(v), "auto");
    }
    if ((v = json_object_get(body, "stream_options")) && !json_is_null(v)) {
        if (!json_is_object(v))
            return fail(e, 400, "stream_options", "'stream_options' must be an object, not %s", jtype(v));
        if (get_bool(v, "include_usage", &r->include_usage, e))
            return -1;
    }
    if ((v = json_object_get(body, "stop")) && !json_is_null(v)) {
        json_t *one[1] = {v};
        json_t **items = one;
        size_t ni = 1;
        if (json_is_array(v)) {
            ni = json_array_size(v);
            if (ni > MAX_STOPS)
                return fail(e, 400, "stop", "'stop' may hold at most %d strings", MAX_STOPS);
            items = NULL;
        } else if (!json_is_string(v)) {
            return fail(e, 400, "stop", "'stop' must be a string or an array of strings, not %s",
                        jtype(v));
        }
        for (size_t i = 0; i < ni; i++) {
            json_t *s = items ? items[i] : json_array_get(v, i);
            if (!json_is_string(s))
                return fail(e, 400, "stop", "'stop[%zu]' must be a string, not %s", i, jtype(s));
            size_t len = json_string_length(s);
            if (len == 0 || len > MAX_STOP_LEN)
                return fail(e, 400, "stop", "stop strings must be 1 to %d bytes long", MAX_STOP_LEN);
            if (memchr(json_string_value(s), 0, len))
                return fail(e, 400, "stop", "stop strings must not contain NUL");
            r->stops[r->n_stops] = strdup(json_string_value(s));
            if (!r->stops[r->n_stops])
                return fail(e, 500, NULL, "out of memory");
            r->n_stops++;
        }
    }
    /* Features we do not have must be refused, not silently ignored. */
    static const char *unsupported[] = {"tools", "functions", "tool_choice", "function_call",
                                        "suffix", "audio", "modalities", "prediction"};
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        if (chat && i < 3 && i != 1) /* chat: tools and tool_choice (see chat_tools) */
            continue;
        v = json_object_get(body, unsupported[i]);
        if (v && !json_is_null(v) && !(json_is_object(v) && json_object_size(v) == 0) &&
            !(json_is_array(v) && json_array_size(v) == 0) &&
            !(json_is_string(v) && !strcmp(unsupported[i], "tool_choice") &&
              !strcmp(json_string_value(v), "none")))
            return fail(e, 400, unsupported[i], "'%s' is not supported by moed", unsupported[i]);
    }
    /* llama-server sampling controls moed does not have: refused unless they ask for what moed
     * does anyway (their neutral value), so that an answer never silently ignores them. */
    static const struct {
        const char *name;
        double neutral;
    } samplers[] = {{"mirostat", 0},      {"typical_p", 1},       {"tfs_z", 1},
                    {"dynatemp_range", 0}, {"xtc_probability", 0}, {"dry_multiplier", 0},
                    {"n_probs", 0},        {"top_n_sigma", -1}};
    for (size_t i = 0; i < sizeof samplers / sizeof samplers[0]; i++) {
        v = json_object_get(body, samplers[i].name);
        if (v && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == samplers[i].neutral))
            return fail(e, 400, samplers[i].name, "'%s' is not supported by moed (only %g, its "
                        "neutral value)", samplers[i].name, samplers[i].neutral);
    }
    static const char *const constrained[] = {"samplers"};
    for (size_t i = 0; i < sizeof constrained / sizeof constrained[0]; i++) {
        v = json_object_get(body, constrained[i]);
        if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
            return fail(e, 400, constrained[i], "'%s' is not supported by moed", constrained[i]);
    }
    if (parse_logprobs(body, chat, r, e) || parse_logit_bias(a, body, r, e) ||
        get_bool(body, "ignore_eos", &r->s.ignore_eos, e) ||
        (r->s.ignore_eos && add_eog_ban(a, r, e)) || parse_constraint(body, r, e) ||
        (chat && force_tool_call(body, r, e)))
        return -1;
    if (chat) {
        if ((v = json_object_get(body, "echo")) && !json_is_null(v) && !json_is_false(v))
            return fail(e, 400, "echo", "'echo' is a /v1/completions field");
    } else if (get_bool(body, "echo", &r->echo, e)) {
        return -1;
    }
    /* echo with logprobs lists the prompt's tokens first, as OpenAI's legacy completions do. */
    r->s.prompt_logprobs = r->echo && r->s.logprobs;
    if ((v = json_object_get(body, "best_of")) && !json_is_null(v) &&
        !(json_is_integer(v) && (json_integer_value(v) == 1 || json_integer_value(v) == (json_int_t)r->n)))
        return fail(e, 400, "best_of", "'best_of' must be 1 or equal 'n' (moed returns every sequence)");
    return 0;
}

static int tokenize(struct api *a, const char *text, size_t len, bool special, struct gen_req *r,
                    struct verr *e)
{
    int32_t *ids = NULL;
    size_t n = 0;
    /* A token covers at most max_piece bytes: text longer than the context could hold even in
     * the longest tokens is refused before tokenizing it (which would hold the event loop). */
    uint32_t n_ctx = a->model.n_ctx;
    size_t maxp = moe_tok_max_piece(a->tok);
    if (n_ctx && maxp && len / maxp + r->n_prompt >= n_ctx) {
        if (r->n_prompt == 0)
            return fail(e, 400, r->what[0] ? "prompt" : NULL,
                        "%s (%zu bytes) is longer than the context of %u tokens can hold",
                        r->what[0] ? r->what : "the prompt", len, n_ctx);
        /* A later part (a chat message) takes the prompt past the context: at least n_ctx
         * tokens, counted as such (context_length_exceeded, or truncation). */
        r->n_prompt = n_ctx;
        r->n_prompt_is_bound = true;
        return 0;
    }
    /* A prompt is counted up to four contexts' worth, then refused as "more than that" (the
     * rest would cost work and tell nothing). */
    if (r->n_prompt_is_bound)
        return 0;
    size_t bound = n_ctx ? 4 * (size_t)n_ctx : SIZE_MAX;
    size_t max = r->n_prompt < bound ? bound - r->n_prompt : 0;
    int trc = moe_tok_encode_max(a->tok, text, len, special, max, &ids, &n);
    if (trc == MOE_ERANGE) {
        r->n_prompt = bound + 1;
        r->n_prompt_is_bound = true;
        return 0;
    }
    if (trc)
        return fail(e, 500, NULL, "out of memory while tokenizing");
    int32_t *np = realloc(r->prompt, (r->n_prompt + n + 1) * sizeof *np);
    if (!np) {
        free(ids);
        return fail(e, 500, NULL, "out of memory while tokenizing");
    }
    r->prompt = np;
    memcpy(r->prompt + r->n_prompt, ids, n * sizeof *ids);
    r->n_prompt += n;
    free(ids);
    return 0;
}

static int push_token(struct gen_req *r, int32_t id, struct verr *e)
{
    if (r->n_prompt_is_bound)
        return 0; /* already refused as too long; the ids past the bound are not kept */
    int32_t *np = realloc(r->prompt, (r->n_prompt + 1) * sizeof *np);
    if (!np)
        return fail(e, 500, NULL, "out of memory");
    r->prompt = np;
    r->prompt[r->n_prompt++] = id;
    return 0;
}

static int parse_token_array(struct api *a, json_t *arr, const char *what, struct gen_req *r,
                             struct verr *e)
{
    size_t i;
    json_t *t;
    json_array_foreach(arr, i, t) {
        if (!json_is_integer(t))
            return fail(e, 400, "prompt", "'%s[%zu]' must be a token id (integer), not %s", what, i,
                        jtype(t));
        json_int_t id = json_integer_value(t);
        if (id < 0 || id >= (json_int_t)a->model.n_vocab)
            return fail(e, 400, "prompt", "'%s[%zu]': token id %" PRId64 " is out of range (n_vocab %u)",
                        what, i, (int64_t)id, a->model.n_vocab);
        if (push_token(r, (int32_t)id, e))
            return -1;
    }
    return 0;
}

/* The prompt tokenized so far (r->prompt) is complete: it moves to r->prompts[], named as
 * r->what says. */
static int prompt_push(struct gen_req *r, struct verr *e)
{
    struct gen_prompt *np = realloc(r->prompts, (r->n_prompts + 1) * sizeof *np);
    if (!np)
        return fail(e, 500, NULL, "out of memory");
    r->prompts = np;
    struct gen_prompt *p = &np[r->n_prompts++];
    *p = (struct gen_prompt){.ids = r->prompt, .n = r->n_prompt, .is_bound = r->n_prompt_is_bound};
    snprintf(p->what, sizeof p->what, "%s", r->what[0] ? r->what : "the prompt");
    r->prompt = NULL;
    r->n_prompt = 0;
    r->n_prompt_is_bound = false;
    return 0;
}

/* echo: the prompt's text as given (v a string), or for token ids their text. */
static int prompt_echo(struct api *a, json_t *v, struct gen_prompt *p, struct verr *e)
{
    if (json_is_string(v)) {
        p->echo_len = json_string_length(v);
        p->echo = malloc(p->echo_len + 1);
        if (!p->echo)
            return fail(e, 500, NULL, "out of memory");
        memcpy(p->echo, json_string_value(v), p->echo_len + 1);
        return 0;
    }
    struct moe_detok d;
    moe_detok_init(&d);
    size_t cap = 3 * (moe_tok_max_piece(a->tok) + 4) + 1, len = 0, bcap = 0;
    char *piece = malloc(cap), *out = NULL;
    int rc = piece ? 0 : -ENOMEM;
    for (size_t i = 0; rc == 0 && i <= p->n; i++) {
        size_t n = i < p->n ? moe_detok_push(&d, a->tok, p->ids[i], piece, cap)
                            : moe_detok_flush(&d, piece, cap);
        rc = moe_buf_append(&out, &len, &bcap, piece, n);
    }
    free(piece);
    if (rc || !out) {
        free(out);
        return fail(e, 500, NULL, "out of memory");
    }
    p->echo = out;
    p->echo_len = len;
    return 0;
}

/* One prompt, v: a string or an array of token ids; index: its place in a list of prompts, or
 * -1 for the request's only 'prompt'. */
static int parse_one_prompt(struct api *a, json_t *v, int index, struct gen_req *r,
                            struct verr *e)
{
    char label[24] = "prompt";
    r->what[0] = 0;
    if (index >= 0) {
        snprintf(label, sizeof label, "prompt[%d]", index);
        snprintf(r->what, sizeof r->what, "'prompt[%d]'", index);
    }
    int rc = json_is_string(v) ? tokenize(a, json_string_value(v), json_string_length(v), true, r, e)
                               : parse_token_array(a, v, label, r, e);
    if (rc || prompt_push(r, e))
        return -1;
    struct gen_prompt *p = &r->prompts[r->n_prompts - 1];
    return r->echo && !p->is_bound ? prompt_echo(a, v, p, e) : 0;
}

/* A completion's prompts, tokenized (prompt_shape has checked the outer shape and the caps).
 * A prompt longer than the context ends the work: the request is refused for it. */
static int parse_prompts(struct api *a, json_t *body, struct gen_req *r, struct verr *e)
{
    json_t *p = json_object_get(body, "prompt");
    if (!r->prompt_list)
        return parse_one_prompt(a, p, -1, r, e);
    for (size_t i = 0; i < json_array_size(p); i++) {
        if (parse_one_prompt(a, json_array_get(p, i), (int)i, r, e))
            return -1;
        if (a->model.n_ctx && r->prompts[r->n_prompts - 1].n >= a->model.n_ctx)
            break;
    }
    return 0;
}

/* The shape of a completion's 'prompt', checked before anything is tokenized: a string or an
 * array of token ids is one prompt; an array of strings and arrays of token ids holds one prompt
 * each, at most MAX_PROMPTS of them and MAX_REQUEST_CHOICES choices (prompts x n). Looks at the
 * outer array and the types of its elements only. */
static int prompt_shape(json_t *body, struct gen_req *r, struct verr *e)
{
    json_t *p = json_object_get(body, "prompt");
    if (!p || json_is_null(p))
        return fail(e, 400, "prompt", "'prompt' is required");
    if (json_is_string(p))
        return 0;
    if (!json_is_array(p))
        return fail(e, 400, "prompt", "'prompt' must be a string, an array of token ids, or an array "
                    "of strings and arrays of token ids, not %s", jtype(p));
    const size_t n = json_array_size(p);
    if (n == 0)
        return fail(e, 400, "prompt", "'prompt' is empty");
    if (json_is_integer(json_array_get(p, 0)))
        return 0; /* one prompt of token ids (parse_token_array checks the rest) */
    if (n > MAX_PROMPTS)
        return fail(e, 400, "prompt", "'prompt' holds %zu prompts; a request may hold at most %d",
                    n, MAX_PROMPTS);
    if (n * r->n > MAX_REQUEST_CHOICES)
        return fail(e, 400, "n", "%zu prompts with 'n' %u ask for %zu choices; a request may ask "
                    "for at most %d (prompts x n)", n, r->n, n * r->n, MAX_REQUEST_CHOICES);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(p, i);
        if (!json_is_string(v) && !json_is_array(v))
            return fail(e, 400, "prompt", "'prompt[%zu]' must be a string or an array of token ids, "
                        "not %s", i, jtype(v));
        if (json_is_string(v) ? json_string_length(v) == 0 : json_array_size(v) == 0)
            return fail(e, 400, "prompt", "'prompt[%zu]' is empty", i);
    }
    r->prompt_list = true;
    return 0;
}

/* Message content: a string, or an array of {"type": "text", "text": ...} parts (joined). */
static int message_content(json_t *m, size_t i, char **out, size_t *len, struct verr *e)
{
    json_t *c = json_object_get(m, "content");
    *out = NULL;
    *len = 0;
    if (!c || json_is_null(c)) {
        *out = strdup("");
        return *out ? 0 : fail(e, 500, NULL, "out of memory");
    }
    if (json_is_string(c)) {
        *len = json_string_length(c);
        *out = malloc(*len + 1);
        if (!*out)
            return fail(e, 500, NULL, "out of memory");
        memcpy(*out, json_string_value(c), *len + 1);
        return 0;
    }
    if (!json_is_array(c))
        return fail(e, 400, "messages", "'messages[%zu].content' must be a string or an array of parts, not %s",
                    i, jtype(c));
    size_t total = 0, k;
    json_t *part;
    json_array_foreach(c, k, part) {
        json_t *type = json_is_object(part) ? json_object_get(part, "type") : NULL;
        json_t *text = json_is_object(part) ? json_object_get(part, "text") : NULL;
        if (!type || !json_is_string(type) || strcmp(json_string_value(type), "text") != 0)
            return fail(e, 400, "messages",
                        "'messages[%zu].content[%zu]': only parts of type \"text\" are supported", i, k);
        if (!json_is_string(text))
            return fail(e, 400, "messages", "'messages[%zu].content[%zu].text' must be a string", i, k);
        total += json_string_length(text);
    }
    *out = malloc(total + 1);
    if (!*out)
        return fail(e, 500, NULL, "out of memory");
    json_array_foreach(c, k, part) {
        json_t *text = json_object_get(part, "text");
        memcpy(*out + *len, json_string_value(text), json_string_length(text));
        *len += json_string_length(text);
    }
    (*out)[*len] = 0;
    return 0;
}

static const char *const chat_roles[] = {"system", "developer", "user", "assistant", "tool", NULL};

/* messages[i].tool_calls checked (OpenAI shape); arguments that are a JSON object's text become
 * that object when as_objects (what most templates expect; *had_text notes that some were). */
static int chat_tool_calls(json_t *m, size_t i, bool as_objects, bool *had_text, struct verr *e)
{
    json_t *tc = json_object_get(m, "tool_calls");
    if (!tc || json_is_null(tc))
        return 0;
    if (!json_is_array(tc))
        return fail(e, 400, "messages", "'messages[%zu].tool_calls' must be an array", i);
    json_t *calls = json_array();
    size_t k;
    json_t *c;
    json_array_foreach(tc, k, c) {
        json_t *fn = json_object_get(c, "function");
        if (!json_is_object(c) || !json_is_object(fn) || !json_is_string(json_object_get(fn, "name"))) {
            json_decref(calls);
            return fail(e, 400, "messages",
                        "'messages[%zu].tool_calls[%zu]' must be {\"type\": \"function\", \"function\": "
                        "{\"name\": ..., \"arguments\": ...}}", i, k);
        }
        json_t *cc = json_deep_copy(c), *args = json_object_get(fn, "arguments");
        if (json_is_string(args)) {
            json_t *obj = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
            if (json_is_object(obj)) {
                *had_text = true;
                if (as_objects)
                    json_object_set(json_object_get(cc, "function"), "arguments", obj);
            }
            json_decref(obj);
        }
        json_array_append_new(calls, cc);
    }
    json_object_set_new(m, "tool_calls", calls);
    return 0;
}

enum { TOOL_CHOICE_AUTO, TOOL_CHOICE_NONE, TOOL_CHOICE_REQUIRED, TOOL_CHOICE_NAMED };

/* tool_choice (absent or null: auto); for a named function *want is its name. Returns one of
 * TOOL_CHOICE_* or -1 (a 400 in e). */
static int parse_tool_choice(json_t *choice, const char **want, struct verr *e)
{
    *want = NULL;
    if (!choice || json_is_null(choice))
        return TOOL_CHOICE_AUTO;
    const char *cs = json_string_value(choice);
    if (cs && !strcmp(cs, "auto"))
        return TOOL_CHOICE_AUTO;
    if (cs && !strcmp(cs, "none"))
        return TOOL_CHOICE_NONE;
    if (cs && !strcmp(cs, "required"))
        return TOOL_CHOICE_REQUIRED;
    json_t *type = json_object_get(choice, "type"), *fn = json_object_get(choice, "function");
    if (!cs && json_is_string(type) && !strcmp(json_string_value(type), "function") &&
        json_is_string(json_object_get(fn, "name"))) {
        *want = json_string_value(json_object_get(fn, "name"));
        return TOOL_CHOICE_NAMED;
    }
    return fail(e, 400, "tool_choice", "tool_choice must be \"auto\", \"none\", \"required\" or "
                "{\"type\": \"function\", \"function\": {\"name\": ...}}");
}

/* tool_choice "required" or a named function: the answer must be one tool call in the
 * Qwen/Hermes format, <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, with
 * arguments that follow the function's parameters schema; a grammar made from the tools (a JSON
 * Schema of the call, converted, then wrapped in the markers) forces it. */
static int force_tool_call(json_t *body, struct gen_req *r, struct verr *e)
{
    json_t *tools = json_object_get(body, "tools");
    const char *want = NULL;
    const int tc = parse_tool_choice(json_object_get(body, "tool_choice"), &want, e);
    if (tc < 0)
        return -1;
    if (tc == TOOL_CHOICE_AUTO || tc == TOOL_CHOICE_NONE)
        return 0;
    const char *cs = tc == TOOL_CHOICE_REQUIRED ? "required" : NULL;
    if (!json_is_array(tools) || json_array_size(tools) == 0)
        return fail(e, 400, "tool_choice", "tool_choice %s needs 'tools'", cs ? cs : "naming a function");
    if (r->grammar)
        return fail(e, 400, "tool_choice", "tool_choice %s cannot be combined with "
                    "response_format, grammar or json_schema", cs ? cs : "naming a function");
    json_t *any = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || (want && strcmp(want, name)))
            continue;
        json_t *params = json_object_get(fn, "parameters");
        json_t *args = json_is_object(params) ? json_incref(params)
                                              : json_pack("{s:s}", "type", "object");
        json_array_append_new(any, json_pack("{s:s, s:{s:{s:s}, s:o}, s:[s,s], s:b}", "type",
                                             "object", "properties", "name", "const", name,
                                             "arguments", args, "required", "name", "arguments",
                                             "additionalProperties", 0));
    }
    if (json_array_size(any) == 0) {
        json_decref(any);
        return fail(e, 400, "tool_choice", "tool_choice names '%s', which is not among 'tools'", want);
    }
    json_t *schema = json_array_size(any) == 1 ? json_incref(json_array_get(any, 0))
                                               : json_pack("{s:O}", "anyOf", any);
    json_decref(any);
    char err[512], *gbnf = NULL;
    int rc = moe_json_schema_to_gbnf(schema, &gbnf, err, sizeof err);
    json_decref(schema);
    if (rc)
        return fail(e, 400, "tools", "a tool's parameters cannot be enforced: %s", err);
    /* The converter's start rule becomes the call; the new root wraps it in the markers. */
    const char *at = strncmp(gbnf, "root ::=", 8) ? strstr(gbnf, "\nroot ::=") : gbnf;
    if (!at) {
        free(gbnf);
        return fail(e, 500, "tools", "the tool call grammar has no root rule");
    }
    if (at != gbnf)
        at++;
    static const char wrap[] = "root ::= \"<tool_call>\\n\" moed-tool-call \"\\n</tool_call>\"\n";
    const size_t pre = (size_t)(at - gbnf), len = strlen(gbnf);
    char *g = malloc(sizeof wrap + len + 32);
    if (!g) {
        free(gbnf);
        return fail(e, 500, NULL, "out of memory");
    }
    snprintf(g, sizeof wrap + len + 32, "%s%.*smoed-tool-call ::=%s", wrap, (int)pre, gbnf,
             at + 8);
    free(gbnf);
    if (grammar_check(g, err, sizeof err)) {
        free(g);
        return fail(e, 400, "tools", "the tool call grammar: %s", err);
    }
    r->grammar = g;
    r->s.grammar = g;
    r->call_forced = true;
    return 0;
}

/* The request's tools (NULL when none, or tool_choice "none"), checked. */
static int chat_tools(json_t *body, json_t **out, struct verr *e)
{
    *out = NULL;
    json_t *tools = json_object_get(body, "tools");
    const char *want;
    const int tc = parse_tool_choice(json_object_get(body, "tool_choice"), &want, e);
    if (tc < 0)
        return -1;
    if (tc == TOOL_CHOICE_NONE)
        return 0; /* required and a named function are forced by a grammar (force_tool_call) */
    if (!tools || json_is_null(tools))
        return 0;
    if (!json_is_array(tools))
        return fail(e, 400, "tools", "'tools' must be an array, not %s", jtype(tools));
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *type = json_object_get(t, "type"), *fn = json_object_get(t, "function");
        if (!json_is_object(t) || !json_is_string(type) || strcmp(json_string_value(type), "function") ||
            !json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
            return fail(e, 400, "tools",
                        "'tools[%zu]' must be {\"type\": \"function\", \"function\": {\"name\": ...}}", i);
    }
    if (json_array_size(tools))
        *out = tools;
    return 0;
}

/* The template variables of a chat request: messages (content as a string, checked roles,
 * tool calls), tools, add_generation_prompt and the chat_template_kwargs. */
static json_t *chat_vars(json_t *body, bool args_as_objects, bool *had_text_args, struct verr *e)
{
    json_t *msgs = json_object_get(body, "messages");
    if (!msgs || json_is_null(msgs))
        return fail(e, 400, "messages", "'messages' is required"), NULL;
    if (!json_is_array(msgs))
        return fail(e, 400, "messages", "'messages' must be an array, not %s", jtype(msgs)), NULL;
    size_t n = json_array_size(msgs);
    if (n == 0)
        return fail(e, 400, "messages", "'messages' must not be empty"), NULL;
    if (n > 4096)
        return fail(e, 400, "messages", "too many messages (%zu)", n), NULL;
    json_t *tools, *kw = json_object_get(body, "chat_template_kwargs");
    if (chat_tools(body, &tools, e))
        return NULL;
    if (kw && !json_is_null(kw) && !json_is_object(kw))
        return fail(e, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object"), NULL;
    json_t *vars = json_object(), *list = json_array();
    json_object_set_new(vars, "messages", list);
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(msgs, i);
        if (!json_is_object(m)) {
            fail(e, 400, "messages", "'messages[%zu]' must be an object, not %s", i, jtype(m));
            goto bad;
        }
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!role) {
            fail(e, 400, "messages", "'messages[%zu].role' must be a string", i);
            goto bad;
        }
        size_t r = 0;
        while (role && chat_roles[r] && strcmp(chat_roles[r], role))
            r++;
        if (!chat_roles[r]) {
            fail(e, 400, "messages", "'messages[%zu].role' must be system, developer, user, assistant or tool", i);
            goto bad;
        }
        char *content;
        size_t len;
        if (message_content(m, i, &content, &len, e))
            goto bad;
        json_t *mc = json_copy(m);
        json_object_set_new(mc, "content", json_stringn(content, len));
        free(content);
        json_array_append_new(list, mc);
        if (chat_tool_calls(mc, i, args_as_objects, had_text_args, e))
            goto bad;
    }
    json_object_set(vars, "tools", tools ? tools : json_null());
    json_object_set_new(vars, "add_generation_prompt", json_true());
    const char *k;
    json_t *v;
    json_object_foreach(kw, k, v)
        if (!json_object_get(vars, k))
            json_object_set(vars, k, v);
    json_t *effort = json_object_get(body, "reasoning_effort");
    if (json_is_string(effort) && !json_object_get(vars, "reasoning_effort"))
        json_object_set(vars, "reasoning_effort", effort);
    return vars;
bad:
    json_decref(vars);
    return NULL;
}

/* Renders body's messages with the chat template (ending with the assistant header) into *ren;
 * *tools tells whether the request has tools for the model to call. Returns 0 or -1 with e set. */
static int render_messages(struct api *a, json_t *body, struct chat_rendered *ren, bool *tools,
                           struct verr *e)
{
    if (!a->chat)
        return fail(e, a->chat_err[0] ? 501 : 400, "messages", "%s",
                    a->chat_err[0] ? a->chat_err : "this model has no chat template; use /v1/completions");
    bool had_text = false;
    json_t *vars = chat_vars(body, true, &had_text, e);
    if (!vars)
        return -1;
    *tools = json_is_array(json_object_get(vars, "tools"));
    char msg[512];
    int rc = chat_render(a->chat, a->tok, vars, 0, ren, msg, sizeof msg);
    json_decref(vars);
    if (rc == MOE_EFORMAT && had_text) {
        /* Some templates (DeepSeek V3.1, functionary) take the arguments as the client sent them. */
        json_t *v2 = chat_vars(body, false, &had_text, e);
        if (!v2)
            return -1;
        char msg2[512];
        if (chat_render(a->chat, a->tok, v2, 0, ren, msg2, sizeof msg2) == 0)
            rc = 0;
        json_decref(v2);
    }
    if (rc)
        return fail(e, rc == -ENOMEM ? 500 : 400, "messages", "%s", msg);
    return 0;
}

static int parse_messages_once(struct api *a, json_t *body, struct gen_req *r, struct verr *e);

/* Whether the tokenized prompt leaves room for the generation (max_tokens when given). */
static bool prompt_fits(const struct api *a, const struct gen_req *r)
{
    const uint64_t n_ctx = a->model.n_ctx;
    const uint64_t want = r->max_tokens > 0 ? (uint64_t)r->max_tokens : 1;
    return !n_ctx || (!r->n_prompt_is_bound && r->n_prompt + want <= n_ctx);
}

/* The messages rendered and tokenized; with truncation, the oldest non-system messages are
 * dropped one at a time (each attempt rendered and tokenized again) until the prompt fits or
 * one conversation message is left. */
static int parse_messages(struct api *a, json_t *body, struct gen_req *r, struct verr *e)
{
    if (parse_messages_once(a, body, r, e))
        return -1;
    json_t *msgs = json_object_get(body, "messages");
    if (!r->truncate || prompt_fits(a, r) || !json_is_array(msgs))
        return 0;
    const size_t n = json_array_size(msgs);
    size_t sys = 0;
    while (sys < n) {
        const char *role = json_string_value(json_object_get(json_array_get(msgs, sys), "role"));
        if (!role || (strcmp(role, "system") && strcmp(role, "developer")))
            break;
        sys++;
    }
    for (size_t drop = 1; sys + drop < n; drop++) {
        json_t *kept = json_array(), *b2 = json_copy(body);
        if (!kept || !b2) {
            json_decref(kept);
            json_decref(b2);
            return fail(e, 500, NULL, "out of memory");
        }
        for (size_t i = 0; i < n; i++)
            if (i < sys || i >= sys + drop)
                json_array_append(kept, json_array_get(msgs, i));
        json_object_set_new(b2, "messages", kept);
        free(r->prompt);
        r->prompt = NULL;
        r->n_prompt = 0;
        r->n_prompt_is_bound = false;
        int rc = parse_messages_once(a, b2, r, e);
        json_decref(b2);
        if (rc)
            return -1;
        r->dropped = (uint32_t)drop;
        if (prompt_fits(a, r))
            break;
    }
    return 0;
}

static int parse_messages_once(struct api *a, json_t *body, struct gen_req *r, struct verr *e)
{
    struct chat_rendered ren = {0};
    int rc = -1;
    if (render_messages(a, body, &ren, &r->tools, e))
        goto out;
    for (size_t i = 0; i < ren.n_spans; i++) {
        const struct chat_span *sp = &ren.spans[i];
        if (sp->id >= 0 ? push_token(r, sp->id, e) : tokenize(a, ren.text + sp->off, sp->len, false, r, e))
            goto out;
    }
    /* A prompt that ends inside <think> (QwQ, DeepSeek R1): the output starts with reasoning. */
    size_t end = ren.len;
    while (end > 0 && (ren.text[end - 1] == '\n' || ren.text[end - 1] == ' '))
        end--;
    r->think_open = end >= 7 && !memcmp(ren.text + end - 7, "<think>", 7);
    rc = 0;
out:
    chat_rendered_free(&ren);
    return rc;
}

/* The request's prompts tokenized into r->prompts: a chat's one, a completion's one or more. */
static int parse_input(struct api *a, json_t *body, bool chat, struct gen_req *r, struct verr *e)
{
    if (!chat)
        return parse_prompts(a, body, r, e);
    return parse_messages(a, body, r, e) || prompt_push(r, e) ? -1 : 0;
}

static void new_id(struct api *a, char *out, size_t cap, const char *prefix)
{
    uint64_t x = a->id_seed ^ (++a->id_next * 0x9e3779b97f4a7c15ull);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    snprintf(out, cap, "%s%016" PRIx64 "%08" PRIx64, prefix, x, a->id_next);
}

/* Answers or submits a request whose prompt is tokenized (rc 0) or refused (e). */
static void finish_generate(struct api *a, struct http_conn *c, bool chat, struct gen_req *r,
                            struct verr *ep, int rc, double t0);

/* A request whose prompt is tokenized on the loop's thread pool, so that a long prompt (or a
 * chat of many long messages) never holds the event loop. The pool thread reads only the job:
 * the request body, already parsed, and a copy of the api's read-only parts (the tokenizer, the
 * chat family, the model's shape), never the api itself. */
struct tok_job {
    uv_work_t work;
    struct api *a;                  /* NULL once the api is gone (shutdown) */
    struct api snap;                /* what the pool thread reads */
    struct http_conn *c;
    json_t *body;
    bool chat, aborted;
    bool tokenize;                  /* POST /tokenize rather than a generation */
    double t0;                      /* when the request was complete (moe_now_s) */
    bool add_special, parse_special, with_pieces;
    int32_t *ids;                   /* /tokenize: the result */
    size_t n_ids;
    struct gen_req r;
    struct verr e;
    int rc;
    struct tok_job *prev, *next;
};

static void finish_tokenize(struct api *a, struct tok_job *j);

static void tok_job_unlink(struct tok_job *j)
{
    struct api *a = j->a;
    if (!a)
        return;
    if (j->prev)
        j->prev->next = j->next;
    else
        a->jobs = j->next;
    if (j->next)
        j->next->prev = j->prev;
    a->n_jobs--;
    j->prev = j->next = NULL;
}

static void tok_job_abort(void *user)
{
    struct tok_job *j = user;
    j->aborted = true; /* the connection is gone; the pool thread finishes, nobody answers */
    j->c = NULL;
}

/* /tokenize: content's ids (BOS first with add_special when the model adds one). */
static int tokenize_content(struct api *a, struct tok_job *j)
{
    json_t *ct = json_object_get(j->body, "content");
    j->ids = NULL;
    j->n_ids = 0;
    int rc = moe_tok_encode(a->tok, json_string_value(ct), json_string_length(ct),
                            j->parse_special, &j->ids, &j->n_ids);
    if (rc)
        return fail(&j->e, 500, NULL, "out of memory while tokenizing");
    int32_t bos = moe_tok_bos(a->tok);
    if (j->add_special && moe_tok_add_bos(a->tok) && bos >= 0) {
        int32_t *n = realloc(j->ids, sizeof *n * (j->n_ids + 1));
        if (!n)
            return fail(&j->e, 500, NULL, "out of memory while tokenizing");
        memmove(n + 1, n, sizeof *n * j->n_ids);
        n[0] = bos;
        j->ids = n;
        j->n_ids++;
    }
    return 0;
}

static void tok_job_work(uv_work_t *w)
{
    struct tok_job *j = w->data;
    struct api *sa = &j->snap;
    if (j->tokenize)
        j->rc = tokenize_content(sa, j);
    else
        j->rc = parse_input(sa, j->body, j->chat, &j->r, &j->e);
}

static void tok_job_done(uv_work_t *w, int status)
{
    struct tok_job *j = w->data;
    struct api *a = j->a;
    tok_job_unlink(j);
    if (a && !j->aborted && status == 0) {
        http_conn_on_abort(j->c, NULL, NULL);
        if (j->tokenize)
            finish_tokenize(a, j);
        else
            finish_generate(a, j->c, j->chat, &j->r, &j->e, j->rc, j->t0);
    } else if (a && !j->aborted) {
        http_conn_on_abort(j->c, NULL, NULL);
        respond_error(a, j->c, 503, NULL, "moed is shutting down");
    }
    gen_req_free(&j->r);
    json_decref(j->body);
    free(j->ids);
    chat_template_free(j->snap.chat);
    free(j);
}

/* Queues j on the pool (tok_job_done answers); returns 0, or a uv error. */
static int tok_job_queue(struct api *a, struct tok_job *j)
{
    j->a = a;
    j->snap = *a;
    j->work.data = j;
    int qrc = uv_queue_work(a->loop, &j->work, tok_job_work, tok_job_done);
    if (qrc)
        return qrc;
    chat_template_ref(a->chat); /* the pool thread may render after the api is gone */
    j->next = a->jobs;
    if (a->jobs)
        a->jobs->prev = j;
    a->jobs = j;
    a->n_jobs++;
    http_conn_on_abort(j->c, tok_job_abort, j);
    return 0;
}

/* The request body as a JSON object, or NULL with the error sent (503 before the model is
 * served, 400 for a body that is not a JSON object). */
static json_t *load_object(struct api *a, struct http_request *req)
{
    if (!a->tok) {
        respond_error(a, req->conn, 503, NULL, "no model is being served yet");
        return NULL;
    }
    json_error_t jerr;
    json_t *body = json_loadb(req->body, req->body_len, JSON_REJECT_DUPLICATES, &jerr);
    if (!body) {
        respond_error(a, req->conn, 400, NULL,
                      "request body is not valid JSON: %s (line %d, column %d)", jerr.text,
                      jerr.line, jerr.column);
        return NULL;
    }
    if (!json_is_object(body)) {
        respond_error(a, req->conn, 400, NULL, "request body must be a JSON object, not %s",
                      jtype(body));
        json_decref(body);
        return NULL;
    }
    return body;
}

/* ---- Responses API requests: translated into a chat request ---- */

/* A Responses content (a string, or input_text / output_text parts) as chat content. */
static int resp_content(json_t *c, const char *where, size_t i, json_t **out, struct verr *e)
{
    if (json_is_string(c)) {
        *out = json_incref(c);
        return 0;
    }
    if (!json_is_array(c))
        return fail(e, 400, "input", "'input[%zu].%s' must be a string or an array of content "
                    "parts, not %s", i, where, c ? jtype(c) : "missing");
    json_t *parts = json_array();
    size_t k;
    json_t *p;
    json_array_foreach(c, k, p) {
        const char *type = json_string_value(json_object_get(p, "type"));
        json_t *text = json_object_get(p, "text");
        if (!type || (strcmp(type, "input_text") && strcmp(type, "output_text"))) {
            json_decref(parts);
            return fail(e, 400, "input", "'input[%zu].%s[%zu]': only input_text and output_text "
                        "parts are supported, not %s", i, where, k,
                        type ? type : "a part without a type");
        }
        if (!json_is_string(text)) {
            json_decref(parts);
            return fail(e, 400, "input", "'input[%zu].%s[%zu].text' must be a string", i, where, k);
        }
        json_array_append_new(parts, json_pack("{s:s,s:O}", "type", "text", "text", text));
    }
    *out = parts;
    return 0;
}

/* input (a string or a list of items) and instructions as chat messages. */
static json_t *resp_messages(json_t *body, struct verr *e)
{
    json_t *input = json_object_get(body, "input"), *ins = json_object_get(body, "instructions");
    if (ins && !json_is_null(ins) && !json_is_string(ins))
        return fail(e, 400, "instructions", "'instructions' must be a string, not %s", jtype(ins)), NULL;
    if (!input || json_is_null(input))
        return fail(e, 400, "input", "'input' is required"), NULL;
    if (!json_is_string(input) && !json_is_array(input))
        return fail(e, 400, "input", "'input' must be a string or an array of input items, not %s",
                    jtype(input)), NULL;
    json_t *msgs = json_array();
    if (json_is_string(ins))
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "system", "content", ins));
    if (json_is_string(input)) {
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user", "content", input));
        return msgs;
    }
    size_t i;
    json_t *it;
    json_array_foreach(input, i, it) {
        if (!json_is_object(it)) {
            fail(e, 400, "input", "'input[%zu]' must be an object, not %s", i, jtype(it));
            goto bad;
        }
        json_t *tv = json_object_get(it, "type"), *content;
        const char *type = tv ? json_string_value(tv) : "message";
        json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
        if (!type) {
            fail(e, 400, "input", "'input[%zu].type' must be a string", i);
            goto bad;
        }
        if (!strcmp(type, "message")) {
            const char *role = json_string_value(json_object_get(it, "role"));
            if (!role || (strcmp(role, "user") && strcmp(role, "system") && strcmp(role, "developer") &&
                          strcmp(role, "assistant"))) {
                fail(e, 400, "input", "'input[%zu].role' must be user, system, developer or assistant", i);
                goto bad;
            }
            if (resp_content(json_object_get(it, "content"), "content", i, &content, e))
                goto bad;
            json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", role, "content", content));
        } else if (!strcmp(type, "function_call")) {
            json_t *id = json_object_get(it, "call_id"), *name = json_object_get(it, "name"),
                   *args = json_object_get(it, "arguments");
            if (!json_is_string(id) || !json_is_string(name) || !json_is_string(args)) {
                fail(e, 400, "input", "'input[%zu]' (function_call) needs string 'call_id', 'name' and "
                     "'arguments'", i);
                goto bad;
            }
            /* Calls in a row (and after the assistant's text) are one assistant message. */
            const char *lr = json_string_value(json_object_get(last, "role"));
            if (!lr || strcmp(lr, "assistant")) {
                last = json_pack("{s:s,s:s}", "role", "assistant", "content", "");
                json_array_append_new(msgs, last);
            }
            json_t *calls = json_object_get(last, "tool_calls");
            if (!calls)
                json_object_set_new(last, "tool_calls", calls = json_array());
            json_array_append_new(calls, json_pack("{s:O,s:s,s:{s:O,s:O}}", "id", id, "type",
                                                   "function", "function", "name", name,
                                                   "arguments", args));
        } else if (!strcmp(type, "function_call_output")) {
            json_t *id = json_object_get(it, "call_id");
            if (!json_is_string(id)) {
                fail(e, 400, "input", "'input[%zu].call_id' must be a string", i);
                goto bad;
            }
            if (resp_content(json_object_get(it, "output"), "output", i, &content, e))
                goto bad;
            json_array_append_new(msgs, json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", id,
                                                  "content", content));
        } else if (strcmp(type, "reasoning")) { /* earlier reasoning: templates drop it anyway */
            fail(e, 400, "input", "'input[%zu]': items of type '%.64s' are not supported (message, "
                 "function_call, function_call_output%s)", i, type,
                 !strcmp(type, "item_reference") ? "; moed does not store responses" : "");
            goto bad;
        }
    }
    return msgs;
bad:
    json_decref(msgs);
    return NULL;
}

/* tools (the flat {"type": "function", "name", ...} form) and tool_choice in the chat shape. */
static int resp_tools(json_t *body, json_t *chat, struct verr *e)
{
    json_t *tools = json_object_get(body, "tools"), *tc = json_object_get(body, "tool_choice");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools))
            return fail(e, 400, "tools", "'tools' must be an array, not %s", jtype(tools));
        json_t *out = json_array();
        json_object_set_new(chat, "tools", out);
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            const char *type = json_string_value(json_object_get(t, "type"));
            if (!type || strcmp(type, "function"))
                return fail(e, 400, "tools", "'tools[%zu]': only function tools are supported, not "
                            "'%.64s'", i, type ? type : "a tool without a type");
            if (!json_is_string(json_object_get(t, "name")))
                return fail(e, 400, "tools", "'tools[%zu].name' must be a string", i);
            json_t *fn = json_object();
            static const char *const keys[] = {"name", "description", "parameters", "strict"};
            for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
                if (json_object_get(t, keys[k]) && !json_is_null(json_object_get(t, keys[k])))
                    json_object_set(fn, keys[k], json_object_get(t, keys[k]));
            json_array_append_new(out, json_pack("{s:s,s:o}", "type", "function", "function", fn));
        }
    }
    if (!tc || json_is_null(tc) || json_is_string(tc)) {
        if (tc)
            json_object_set(chat, "tool_choice", tc); /* the chat parser checks the string */
        return 0;
    }
    const char *type = json_string_value(json_object_get(tc, "type"));
    json_t *name = json_object_get(tc, "name");
    if (!type || strcmp(type, "function") || !json_is_string(name))
        return fail(e, 400, "tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" "
                    "or {\"type\": \"function\", \"name\": ...}");
    json_object_set_new(chat, "tool_choice", json_pack("{s:s,s:{s:O}}", "type", "function",
                                                       "function", "name", name));
    return 0;
}

/* text.format as the chat response_format. */
static int resp_format(json_t *body, json_t *chat, struct verr *e)
{
    json_t *text = json_object_get(body, "text");
    if (!text || json_is_null(text))
        return 0;
    if (!json_is_object(text))
        return fail(e, 400, "text", "'text' must be an object, not %s", jtype(text));
    json_t *f = json_object_get(text, "format");
    if (!f || json_is_null(f))
        return 0;
    const char *type = json_string_value(json_object_get(f, "type"));
    if (!type)
        return fail(e, 400, "text.format", "'text.format' must be an object with a 'type' of text, "
                    "json_object or json_schema");
    if (strcmp(type, "json_schema")) {
        if (strcmp(type, "text") && strcmp(type, "json_object"))
            return fail(e, 400, "text.format", "'text.format.type' must be text, json_object or "
                        "json_schema, not '%.64s'", type);
        json_object_set_new(chat, "response_format", json_pack("{s:s}", "type", type));
        return 0;
    }
    json_t *schema = json_object_get(f, "schema");
    if (!json_is_object(schema) && !json_is_boolean(schema))
        return fail(e, 400, "text.format", "'text.format.schema' must be a JSON Schema object");
    json_object_set_new(chat, "response_format", json_pack("{s:s,s:{s:O}}", "type", "json_schema",
                                                           "json_schema", "schema", schema));
    return 0;
}

/* A Responses request as the chat request that computes it; r->resp gets the fields the
 * Response echoes. NULL with e set when it asks for what moed cannot do. */
static json_t *resp_chat_body(struct api *a, json_t *body, struct gen_req *r, struct verr *e)
{
    json_t *v;
    static const struct {
        const char *key, *why;
    } refused[] = {
        {"previous_response_id", "moed does not store responses; send the whole conversation as 'input'"},
        {"conversation", "moed does not store conversations; send the whole conversation as 'input'"},
        {"prompt", "prompt templates are not supported"},
        {"max_tool_calls", "'max_tool_calls' is not supported"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        v = json_object_get(body, refused[i].key);
        if (v && !json_is_null(v) && !(json_is_array(v) && json_array_size(v) == 0))
            return fail(e, 400, refused[i].key, "%s", refused[i].why), NULL;
    }
    bool background = false, store = false;
    if (get_bool(body, "background", &background, e) || get_bool(body, "store", &store, e))
        return NULL;
    if (background)
        return fail(e, 400, "background", "background responses are not supported"), NULL;
    /* include: only message.output_text.logprobs (the output text's logprobs). */
    bool logprobs = false;
    if ((v = json_object_get(body, "include")) && !json_is_null(v)) {
        if (!json_is_array(v))
            return fail(e, 400, "include", "'include' must be an array of strings, not %s", jtype(v)), NULL;
        json_t *x;
        size_t i;
        json_array_foreach(v, i, x) {
            if (!json_is_string(x))
                return fail(e, 400, "include", "'include[%zu]' must be a string, not %s", i, jtype(x)), NULL;
            if (strcmp(json_string_value(x), "message.output_text.logprobs"))
                return fail(e, 400, "include", "'include' value '%.64s' is not supported (only "
                            "message.output_text.logprobs)", json_string_value(x)), NULL;
            logprobs = true;
        }
    }
    int64_t top = 0;
    bool top_set = false;
    if (get_int(body, "top_logprobs", 0, 20, &top, &top_set, e))
        return NULL;
    if (top > 0 && !logprobs)
        return fail(e, 400, "top_logprobs", "'top_logprobs' needs 'include': "
                    "[\"message.output_text.logprobs\"]"), NULL;
    json_t *reasoning = json_object_get(body, "reasoning"), *effort = NULL;
    if (reasoning && !json_is_null(reasoning)) {
        if (!json_is_object(reasoning))
            return fail(e, 400, "reasoning", "'reasoning' must be an object, not %s", jtype(reasoning)), NULL;
        v = json_object_get(reasoning, "summary");
        if ((v && !json_is_null(v)) || ((v = json_object_get(reasoning, "generate_summary")) && !json_is_null(v)))
            return fail(e, 400, "reasoning", "reasoning summaries are not supported"), NULL;
        effort = json_object_get(reasoning, "effort");
        if (effort && !json_is_null(effort) && !json_is_string(effort))
            return fail(e, 400, "reasoning", "'reasoning.effort' must be a string"), NULL;
    }
    int64_t mt = 0;
    bool mt_set = false;
    if (get_int(body, "max_output_tokens", 1, a->model.n_ctx ? a->model.n_ctx : INT32_MAX, &mt,
                &mt_set, e))
        return NULL;
    json_t *msgs = resp_messages(body, e);
    if (!msgs)
        return NULL;
    json_t *chat = json_pack("{s:o}", "messages", msgs);
    static const char *const copied[] = {"model", "temperature", "top_p", "stream", "truncation"};
    for (size_t i = 0; i < sizeof copied / sizeof copied[0]; i++)
        if ((v = json_object_get(body, copied[i])))
            json_object_set(chat, copied[i], v);
    if (mt_set)
        json_object_set_new(chat, "max_completion_tokens", json_integer(mt));
    if (logprobs) {
        json_object_set_new(chat, "logprobs", json_true());
        json_object_set_new(chat, "top_logprobs", json_integer(top));
    }
    if (json_is_string(effort))
        json_object_set(chat, "reasoning_effort", effort);
    if (resp_tools(body, chat, e) || resp_format(body, chat, e)) {
        json_decref(chat);
        return NULL;
    }
    /* What the Response echoes: the request's values, or what was used in their place. */
    json_t *get;
#define RESP_ECHO(key, dflt) ((get = json_object_get(body, key)) && !json_is_null(get) ? json_incref(get) : (dflt))
    r->resp = json_object();
    json_object_set_new(r->resp, "object", json_string("response"));
    json_object_set_new(r->resp, "error", json_null());
    json_object_set_new(r->resp, "incomplete_details", json_null());
    json_object_set_new(r->resp, "instructions", RESP_ECHO("instructions", json_null()));
    json_object_set_new(r->resp, "max_output_tokens", RESP_ECHO("max_output_tokens", json_null()));
    json_object_set_new(r->resp, "metadata", RESP_ECHO("metadata", json_object()));
    json_object_set_new(r->resp, "parallel_tool_calls", RESP_ECHO("parallel_tool_calls", json_true()));
    json_object_set_new(r->resp, "previous_response_id", json_null());
    json_object_set_new(r->resp, "reasoning", json_pack("{s:O,s:n}", "effort",
                                                        effort ? effort : json_null(), "summary"));
    json_object_set_new(r->resp, "store", json_false());
    json_object_set_new(r->resp, "temperature",
                        RESP_ECHO("temperature", json_real(a->sampling.temperature)));
    json_object_set_new(r->resp, "text", RESP_ECHO("text", json_pack("{s:{s:s}}", "format", "type", "text")));
    json_object_set_new(r->resp, "tool_choice", RESP_ECHO("tool_choice", json_string("auto")));
    json_object_set_new(r->resp, "tools", RESP_ECHO("tools", json_array()));
    json_object_set_new(r->resp, "top_logprobs", json_integer(top));
    json_object_set_new(r->resp, "top_p", RESP_ECHO("top_p", json_real(a->sampling.top_p)));
    json_object_set_new(r->resp, "truncation", RESP_ECHO("truncation", json_string("disabled")));
    json_object_set_new(r->resp, "user", RESP_ECHO("user", json_null()));
    json_object_set_new(r->resp, "background", json_false());
    json_object_set_new(r->resp, "service_tier", json_string("default"));
    json_object_set_new(r->resp, "usage", json_null());
#undef RESP_ECHO
    return chat;
}

/* POST /v1/completions, /v1/chat/completions and /v1/responses (chat, answered as a Response). */
static void handle_generate(struct api *a, struct http_request *req, bool chat, bool responses)
{
    const double t0 = moe_now_s();
    struct http_conn *c = req->conn;
    struct verr e = {0};
    struct gen_req r = {0};
    json_t *body = NULL;
    if (a->draining) {
        respond_error(a, c, 503, NULL, "moed is shutting down");
        return;
    }
    if (!a->tok || !a->sched) {
        respond_error(a, c, 503, NULL, "no model is being served yet (workers are starting)");
        return;
    }
    if (!(body = load_object(a, req)))
        return;
    if (responses) {
        json_t *cb = resp_chat_body(a, body, &r, &e);
        json_decref(body);
        if (!(body = cb))
            goto fail;
    }
    if (parse_common(a, body, chat, &r, &e) || (!chat && prompt_shape(body, &r, &e)))
        goto fail;
    if (a->loop) {
        struct tok_job *j = calloc(1, sizeof *j);
        if (!j) {
            fail(&e, 500, NULL, "out of memory");
            goto fail;
        }
        j->c = c;
        j->body = body;
        j->chat = chat;
        j->r = r;
        j->t0 = t0;
        int qrc = tok_job_queue(a, j);
        if (qrc) {
            free(j);
            fail(&e, 500, NULL, "cannot queue the prompt for tokenizing: %s", uv_strerror(qrc));
            goto fail;
        }
        return; /* tok_job_done continues */
    }
    int rc = parse_input(a, body, chat, &r, &e);
    finish_generate(a, c, chat, &r, &e, rc, t0);
    gen_req_free(&r);
    json_decref(body);
    return;
fail:
    respond_error(a, c, e.status ? e.status : 400, e.param, "%s", e.msg);
    gen_req_free(&r);
    json_decref(body);
}

/* One choice of a response, answering prompt p: everything but its request. NULL when out of
 * memory. */
static struct gen *gen_new(struct api *a, struct gen_group *grp, uint32_t index, bool chat,
                           const struct gen_req *r, const struct gen_prompt *p, const char *id,
                           time_t created, double t0)
{
    struct gen *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->api = a;
    g->grp = grp;
    g->index = index;
    g->conn = grp->conn;
    g->chat = chat;
    g->stream = r->stream;
    g->include_usage = r->include_usage;
    g->responses = r->resp != NULL;
    g->created = created;
    g->t_start = g->t_last = t0;
    g->n_prompt = (uint32_t)p->n;
    g->logprobs = r->s.logprobs;
    g->n_top = r->s.top_logprobs;
    snprintf(g->id, sizeof g->id, "%s", id);
    bool ok = (!g->logprobs || (g->lp = json_array())) &&
              (!g->responses || (g->r_output = json_array())) &&
              (!g->responses || !g->logprobs || (g->r_lp = json_array()));
    /* The prompt's first token leads its entries, without a logprob (nothing comes before). */
    if (ok && r->s.prompt_logprobs)
        g->n_plp = (ok = lp_add(g, p->ids[0], NULL, 0) == 0);
    if (ok && r->echo) {
        g->echo = malloc(p->echo_len + 1);
        ok = g->echo != NULL;
        if (ok) {
            if (p->echo_len)
                memcpy(g->echo, p->echo, p->echo_len);
            g->echo[p->echo_len] = 0;
            g->echo_len = p->echo_len;
            /* text_offset counts the prompt's token texts when they are listed */
            g->lp_chars = r->s.prompt_logprobs ? 0 : utf8_chars(g->echo, g->echo_len);
        }
    }
    for (size_t i = 0; ok && i < r->n_stops; i++) {
        ok = (g->stops[i] = strdup(r->stops[i])) != NULL;
        g->n_stops += ok;
    }
    moe_detok_init(&g->detok);
    if (chat) {
        char prefix[40];
        snprintf(prefix, sizeof prefix, "call_%.24s", g->id + strcspn(g->id, "-_") + 1);
        /* the calls come in the template's format, or in the one the grammar forces */
        enum chat_fmt fmt = r->call_forced || !a->chat ? CHAT_FMT_HERMES : chat_template_format(a->chat);
        chat_out_init(&g->co, r->think_open, r->tools, prefix, fmt);
    }
    g->piece_cap = 3 * (moe_tok_max_piece(a->tok) + 4) + 1;
    ok = ok && (g->piece = malloc(g->piece_cap));
    g->next = a->gens;
    if (a->gens)
        a->gens->prev = g;
    a->gens = g;
    a->n_gens++;
    g->linked = true;
    if (!ok) {
        gen_free(g);
        return NULL;
    }
    return g;
}

/* Refuses a prompt that is empty or leaves no room in the context: -1 with e set, or 1 once the
 * answer (context_length_exceeded, with the counts) is sent; 0 when every prompt fits. */
static int check_prompts(struct api *a, struct http_conn *c, const char *param,
                         const struct gen_req *r, struct verr *e)
{
    const uint32_t n_ctx = a->model.n_ctx;
    if (r->n_prompts == 0)
        return fail(e, 400, param, "the prompt is empty (0 tokens)");
    for (uint32_t i = 0; i < r->n_prompts; i++) {
        const struct gen_prompt *p = &r->prompts[i];
        if (p->n == 0)
            return fail(e, 400, param, "%s is empty (0 tokens)", p->what);
        if (!n_ctx || p->n < n_ctx)
            continue;
        json_t *extra = json_object();
        json_object_set_new(extra, "n_prompt_tokens", json_integer((json_int_t)p->n));
        json_object_set_new(extra, "n_ctx", json_integer(n_ctx));
        json_object_set_new(extra, "code", json_string("context_length_exceeded"));
        respond_error_ex(a, c, 400, param, extra,
                         "%s has %s%zu tokens; the context holds %u (prompt and completion "
                         "together)", p->what, p->is_bound ? "more than " : "",
                         p->n - (p->is_bound ? 1 : 0), n_ctx);
        return 1;
    }
    return 0;
}

/* What a choice of an n_prompt-token prompt may generate: max_tokens (or the default) clipped to
 * the room the context leaves. */
static uint32_t choice_max_tokens(const struct api *a, const struct gen_req *r, bool chat,
                                  size_t n_prompt)
{
    const uint32_t n_ctx = a->model.n_ctx;
    const uint32_t room = n_ctx ? n_ctx - (uint32_t)n_prompt : UINT32_MAX;
    if (r->max_tokens > 0)
        return (uint64_t)r->max_tokens < room ? (uint32_t)r->max_tokens : room;
    if (a->max_tokens_default)
        return a->max_tokens_default < room ? a->max_tokens_default : room;
    return chat ? room : (16 < room ? 16 : room);
}

/* The response's choices, n for each prompt (prompt-major, as OpenAI indexes them); NULL when
 * out of memory. */
static struct gen_group *group_new(struct api *a, struct http_conn *c, bool chat,
                                   const struct gen_req *r, double t0)
{
    struct gen_group *grp = calloc(1, sizeof *grp);
    if (!grp)
        return NULL;
    grp->api = a;
    grp->conn = c;
    grp->n_per = r->n;
    grp->n = grp->n_open = r->n_prompts * r->n;
    grp->g = calloc(grp->n, sizeof *grp->g);
    grp->choices = json_array();
    grp->resp = json_incref(r->resp);
    if (!grp->g || !grp->choices) {
        group_free(grp);
        return NULL;
    }
    char id[48];
    new_id(a, id, sizeof id, r->resp ? "resp_" : chat ? "chatcmpl-" : "cmpl-");
    const time_t created = time(NULL);
    for (uint32_t k = 0; k < grp->n; k++) {
        json_array_append_new(grp->choices, json_null());
        if (!(grp->g[k] = gen_new(a, grp, k, chat, r, &r->prompts[k / r->n], id, created, t0))) {
            group_free(grp);
            return NULL;
        }
    }
    return grp;
}

/* Submits every choice as a request of its own (seeded ones: choice k gets seed + k). Callbacks
 * that come meanwhile are parked. Returns 0, or -1 with e set and the group freed when one
 * choice could not be queued or failed at once (the response fails as a whole). */
static int group_submit(struct api *a, struct gen_group *grp, bool chat, const struct gen_req *r,
                        struct verr *e)
{
    int status = 503;
    char msg[512] = "";
    a->gen_requests++;
    for (uint32_t i = 0; i < r->n_prompts; i++)
        a->prompt_tokens += r->prompts[i].n;
    http_conn_on_abort(grp->conn, on_abort, grp);
    grp->submitting = true;
    for (uint32_t k = 0; k < grp->n; k++) {
        const struct gen_prompt *p = &r->prompts[k / r->n];
        struct sched_params sp = {
            .prompt = p->ids,
            .n_prompt = (uint32_t)p->n,
            .max_tokens = choice_max_tokens(a, r, chat, p->n),
            .sampling = r->s,
            .cb = {on_token, on_done, on_error, on_prompt_logprob},
            .user = grp->g[k],
        };
        sp.sampling.seed += k;
        struct sched_req *sr = sched_submit(a->sched, &sp, &status, msg, sizeof msg);
        if (!grp->g[k]->early)
            grp->g[k]->req = sr; /* else it finished inside: the handle is gone */
        if (!sr && !grp->g[k]->early)
            break;
    }
    grp->submitting = false;
    for (uint32_t k = 0; k < grp->n; k++) {
        struct gen *x = grp->g[k];
        if (x->early != 2 && (x->req || x->early))
            continue;
        if (x->early == 2) {
            status = x->early_status;
            snprintf(msg, sizeof msg, "%s", x->early_msg);
        }
        http_conn_on_abort(grp->conn, NULL, NULL);
        group_cancel(grp);
        a->gen_errors++;
        group_free(grp);
        return fail(e, status >= 400 ? status : 503, NULL, "%s",
                    msg[0] ? msg : "the request could not be queued");
    }
    return 0;
}

/* Choices the scheduler finished inside sched_submit() (their handles are gone); the last one
 * to finish frees the group. */
static void group_finish_early(struct gen_group *grp)
{
    for (uint32_t k = 0; k < grp->n; k++) {
        struct gen *x = grp->g[k];
        if (x->early != 1)
            continue;
        const bool last = grp->n_open == 1;
        gen_done(x, x->early_why);
        if (last)
            break;
    }
}

static void finish_generate(struct api *a, struct http_conn *c, bool chat, struct gen_req *r,
                            struct verr *ep, int rc, double t0)
{
    struct verr e = *ep;
    const char *what = r->resp ? "input" : chat ? "messages" : "prompt";
    /* r's allocations stay owned by the caller (freed there): the scheduler copies the prompts,
     * each choice its stop strings and echo. */
    if (rc)
        goto fail;
    if (a->draining) {
        fail(&e, 503, NULL, "moed is shutting down");
        goto fail;
    }
    int ck = check_prompts(a, c, what, r, &e);
    if (ck > 0)
        return;
    if (ck < 0)
        goto fail;
    struct gen_group *grp = group_new(a, c, chat, r, t0);
    if (!grp) {
        fail(&e, 500, NULL, "out of memory");
        goto fail;
    }
    if (group_submit(a, grp, chat, r, &e))
        goto fail;
    size_t n_tok = 0;
    for (uint32_t i = 0; i < r->n_prompts; i++)
        n_tok += r->prompts[i].n;
    log_debug("%s: %u prompt(s) of %zu tokens, max_tokens %u, temperature %g, n %u%s",
              grp->g[0]->id, r->n_prompts, n_tok, choice_max_tokens(a, r, chat, r->prompts[0].n),
              (double)r->s.temperature, r->n, r->stream ? ", streaming" : "");
    group_finish_early(grp);
    return;
fail:
    respond_error(a, c, e.status ? e.status : 400, e.param, "%s", e.msg);
}


/* ---- llama-server's tokenizer endpoints ---- */


/* An optional boolean field; -1 (and a 400 sent) when it is not one. */
static int opt_bool(struct api *a, struct http_request *req, json_t *body, const char *name,
                    bool dflt)
{
    json_t *v = json_object_get(body, name);
    if (!v || json_is_null(v))
        return dflt;
    if (!json_is_boolean(v)) {
        respond_error(a, req->conn, 400, name, "'%s' must be a boolean, not %s", name, jtype(v));
        return -1;
    }
    return json_is_true(v);
}

/* A token's text for with_pieces: a string when its bytes are valid UTF-8, else their values. */
static json_t *piece_json(struct api *a, int32_t id)
{
    char buf[512];
    int n = moe_tok_piece(a->tok, id, buf, sizeof buf);
    if (n < 0)
        n = 0;
    size_t len = (size_t)n < sizeof buf ? (size_t)n : sizeof buf;
    json_t *s = json_stringn(buf, len);
    if (s)
        return s;
    json_t *arr = json_array();
    for (size_t i = 0; i < len; i++)
        json_array_append_new(arr, json_integer((unsigned char)buf[i]));
    return arr;
}

static void finish_tokenize(struct api *a, struct tok_job *j)
{
    if (j->rc) {
        respond_error(a, j->c, j->e.status ? j->e.status : 500, j->e.param, "%s", j->e.msg);
        return;
    }
    json_t *toks = json_array();
    for (size_t i = 0; i < j->n_ids; i++) {
        if (!j->with_pieces) {
            json_array_append_new(toks, json_integer(j->ids[i]));
            continue;
        }
        json_t *o = json_object();
        json_object_set_new(o, "id", json_integer(j->ids[i]));
        json_object_set_new(o, "piece", piece_json(a, j->ids[i]));
        json_array_append_new(toks, o);
    }
    json_t *o = json_object();
    json_object_set_new(o, "tokens", toks);
    respond_json(a, j->c, 200, o, NULL);
}

/* POST /tokenize {"content", "add_special" (false), "parse_special" (true), "with_pieces"
 * (false)} -> {"tokens": [...]}, as llama-server answers; tokenized on the thread pool. */
static void handle_tokenize(struct api *a, struct http_request *req)
{
    json_t *body = load_object(a, req);
    if (!body)
        return;
    json_t *ct = json_object_get(body, "content");
    int add = opt_bool(a, req, body, "add_special", false), ps = 0, wp = 0;
    if (add < 0 || (ps = opt_bool(a, req, body, "parse_special", true)) < 0 ||
        (wp = opt_bool(a, req, body, "with_pieces", false)) < 0) {
        json_decref(body);
        return;
    }
    if (!json_is_string(ct)) {
        respond_error(a, req->conn, 400, "content", "'content' must be a string, not %s",
                      ct ? jtype(ct) : "missing");
        json_decref(body);
        return;
    }
    struct tok_job *j = calloc(1, sizeof *j);
    if (!j) {
        respond_error(a, req->conn, 500, NULL, "out of memory");
        json_decref(body);
        return;
    }
    j->tokenize = true;
    j->add_special = add;
    j->parse_special = ps;
    j->with_pieces = wp;
    j->c = req->conn;
    j->body = body;
    if (a->loop && tok_job_queue(a, j) == 0)
        return;
    /* No loop (tests) or the queue refused: tokenize here. */
    j->rc = tokenize_content(a, j);
    finish_tokenize(a, j);
    json_decref(j->body);
    free(j->ids);
    free(j);
}

/* POST /apply-template {"messages": [...]} -> {"prompt": text}: the prompt a chat request would
 * be tokenized from (special tokens as their text), as llama-server answers. */
static void handle_apply_template(struct api *a, struct http_request *req)
{
    json_t *body = load_object(a, req);
    if (!body)
        return;
    struct verr e = {0};
    struct chat_rendered ren = {0};
    bool tools;
    if (render_messages(a, body, &ren, &tools, &e)) {
        respond_error(a, req->conn, e.status ? e.status : 400, e.param, "%s", e.msg);
    } else {
        json_t *o = json_object();
        json_object_set_new(o, "prompt", json_stringn(ren.text, ren.len));
        respond_json(a, req->conn, 200, o, NULL);
    }
    chat_rendered_free(&ren);
    json_decref(body);
}

/* GET /props: what llama-server's clients read from it (the context, the slots, the model, the
 * chat template, the defaults a request gets). */
static void handle_props(struct api *a, struct http_request *req)
{
    const char *tmpl = a->chat_text; /* --chat-template's, the model's or the built-in one */
    json_t *params = json_pack("{s:f,s:f,s:i,s:f,s:f,s:f,s:f,s:i,s:s}", "temperature",
                               (double)a->sampling.temperature, "top_p",
                               (double)a->sampling.top_p, "top_k", (int)a->sampling.top_k,
                               "min_p", (double)a->sampling.min_p, "repeat_penalty",
                               (double)a->sampling.repetition_penalty, "presence_penalty", 0.0,
                               "frequency_penalty", 0.0, "n_predict", -1, "defaults_from",
                               a->sampling.source);
    json_t *o = json_object();
    json_object_set_new(o, "default_generation_settings",
                        json_pack("{s:i,s:o}", "n_ctx", (json_int_t)a->model.n_ctx, "params",
                                  params));
    json_object_set_new(o, "total_slots", json_integer(a->model.n_slots));
    json_object_set_new(o, "model_path", json_string(a->model_id));
    json_object_set_new(o, "chat_template", json_string(tmpl ? tmpl : ""));
    json_object_set_new(o, "build_info", json_string("moed " MOE_VERSION));
    json_object_set_new(o, "modalities", json_pack("{s:b,s:b}", "vision", 0, "audio", 0));
    respond_json(a, req->conn, 200, o, NULL);
}

/* POST /detokenize {"tokens": [ids]} -> {"content": text}. */
/* GET /slots, read-only, in llama-server's shape: per sequence slot its id, the request on it
 * (id_task, -1: none), n_ctx, is_processing (and the older numeric state), and next_token's
 * n_decoded / n_remain; moed adds the worker and the prompt's token count. */
static void handle_slots(struct api *a, struct http_request *req)
{
    size_t n = a->sched ? sched_slots(a->sched, NULL, 0) : 0;
    struct sched_slot *sl = n ? calloc(n, sizeof *sl) : NULL;
    if (n && !sl) {
        respond_error(a, req->conn, 500, NULL, "out of memory");
        return;
    }
    if (n)
        n = sched_slots(a->sched, sl, n);
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++) {
        const bool busy = sl[i].id != 0;
        json_t *nt = json_pack("{s:b,s:I,s:I}", "has_next_token", busy, "n_remain",
                               busy ? (json_int_t)sl[i].max_tokens - sl[i].n_gen : (json_int_t)-1,
                               "n_decoded", (json_int_t)sl[i].n_gen);
        json_array_append_new(arr, json_pack("{s:I,s:I,s:I,s:b,s:i,s:I,s:I,s:I,s:o}",
                                             "id", (json_int_t)i,
                                             "id_task", busy ? (json_int_t)sl[i].id : (json_int_t)-1,
                                             "n_ctx", (json_int_t)sl[i].n_ctx, "is_processing", busy,
                                             "state", busy ? 1 : 0, "worker", (json_int_t)sl[i].worker,
                                             "n_prompt_tokens", (json_int_t)sl[i].n_prompt,
                                             "n_decoded", (json_int_t)sl[i].n_gen, "next_token", nt));
    }
    free(sl);
    respond_json(a, req->conn, 200, arr, NULL);
}

static void handle_detokenize(struct api *a, struct http_request *req)
{
    json_t *body = load_object(a, req);
    if (!body)
        return;
    json_t *arr = json_object_get(body, "tokens");
    if (!json_is_array(arr)) {
        respond_error(a, req->conn, 400, "tokens", "'tokens' must be an array of token ids");
        json_decref(body);
        return;
    }
    struct moe_detok d;
    moe_detok_init(&d);
    const size_t cap = 3 * (moe_tok_max_piece(a->tok) + 4) + 1;
    char *piece = malloc(cap), *text = NULL;
    size_t n = 0, tcap = 0;
    bool ok = piece != NULL;
    size_t i;
    json_t *t;
    json_array_foreach(arr, i, t) {
        if (!ok)
            break;
        json_int_t id = json_is_integer(t) ? json_integer_value(t) : -1;
        if (id < 0 || id >= (json_int_t)a->model.n_vocab) {
            respond_error(a, req->conn, 400, "tokens", "'tokens[%zu]' is not a token id in 0..%u",
                          i, a->model.n_vocab - 1);
            free(piece);
            free(text);
            json_decref(body);
            return;
        }
        size_t k = moe_detok_push(&d, a->tok, (int32_t)id, piece, cap);
        ok = moe_buf_append(&text, &n, &tcap, piece, k) == 0;
    }
    if (ok) {
        size_t k = moe_detok_flush(&d, piece, cap);
        ok = moe_buf_append(&text, &n, &tcap, piece, k) == 0;
    }
    free(piece);
    json_decref(body);
    if (!ok) {
        free(text);
        respond_error(a, req->conn, 500, NULL, "out of memory");
        return;
    }
    json_t *o = json_object();
    json_object_set_new(o, "content", json_stringn(text ? text : "", n));
    free(text);
    respond_json(a, req->conn, 200, o, NULL);
}

/* ---- other endpoints ---- */

static void handle_models(struct api *a, struct http_request *req, const char *one)
{
    json_t *m = json_object();
    json_object_set_new(m, "id", json_string(a->model_id));
    json_object_set_new(m, "object", json_string("model"));
    json_object_set_new(m, "created", json_integer(a->started));
    json_object_set_new(m, "owned_by", json_string("moed"));
    json_t *meta = json_object();
    json_object_set_new(meta, "arch", json_string(a->model_arch));
    json_object_set_new(meta, "n_ctx", json_integer(a->model.n_ctx));
    json_object_set_new(meta, "n_vocab", json_integer(a->model.n_vocab));
    json_object_set_new(meta, "n_layer", json_integer(a->model.n_layer));
    json_object_set_new(meta, "n_expert", json_integer(a->model.n_expert));
    json_object_set_new(meta, "n_expert_used", json_integer(a->model.n_expert_used));
    json_object_set_new(meta, "chat_template", json_string(api_chat_kind(a)));
    if (a->chat)
        json_object_set_new(meta, "tool_call_format", json_string(chat_fmt_name(chat_template_format(a->chat))));
    json_object_set_new(m, "meta", meta);
    if (one) {
        if (strcmp(one, a->model_id) != 0) {
            json_decref(m);
            respond_error(a, req->conn, 404, "model", "model '%s' is not served here (this daemon serves '%s')",
                          one, a->model_id);
            return;
        }
        respond_json(a, req->conn, 200, m, NULL);
        return;
    }
    json_t *o = json_object();
    json_object_set_new(o, "object", json_string("list"));
    json_object_set_new(o, "data", json_pack("[o]", m));
    respond_json(a, req->conn, 200, o, NULL);
}

static void get_stats(struct api *a, struct sched_stats *st)
{
    memset(st, 0, sizeof *st);
    if (a->sched)
        sched_get_stats(a->sched, st);
}

static void handle_health(struct api *a, struct http_request *req)
{
    struct sched_stats st;
    get_stats(a, &st);
    const char *status = a->draining ? "stopping" : a->ready ? "ok" : "loading";
    json_t *o = json_object();
    json_object_set_new(o, "status", json_string(status));
    json_object_set_new(o, "workers_ready", json_integer(st.workers_ready));
    json_object_set_new(o, "workers_total", json_integer(st.workers_total));
    uint64_t total = atomic_load(&a->load_total), done = atomic_load(&a->load_done);
    if (!a->ready && total) {
        json_t *l = json_object();
        json_object_set_new(l, "experts_done_bytes", json_integer((json_int_t)done));
        json_object_set_new(l, "experts_total_bytes", json_integer((json_int_t)total));
        json_object_set_new(o, "loading", l);
    }
    respond_json(a, req->conn, a->ready && !a->draining ? 200 : 503, o, NULL);
}

struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
};

static void sb_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(struct sbuf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    va_list ap;
    va_start(ap, fmt);
    b->oom = moe_buf_vprintf(&b->p, &b->len, &b->cap, fmt, ap) != 0;
    va_end(ap);
}

static void metric(struct sbuf *b, const char *name, const char *type, const char *help, double v)
{
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

static void handle_metrics(struct api *a, struct http_request *req)
{
    struct sched_stats st;
    get_stats(a, &st);
    struct sbuf b = {0};
    metric(&b, "moed_up", "gauge", "1 when every worker is ready.", a->ready ? 1 : 0);
    metric(&b, "moed_uptime_seconds", "gauge", "Seconds since the daemon started.",
           (double)(time(NULL) - a->started));
    metric(&b, "moed_requests_total", "counter", "Generation requests accepted by the scheduler.",
           (double)st.requests_total);
    metric(&b, "moed_requests_failed_total", "counter", "Generation requests that ended in an error.",
           (double)st.requests_failed);
    metric(&b, "moed_prompt_tokens_total", "counter", "Prompt tokens processed.",
           (double)st.prompt_tokens_total);
    metric(&b, "moed_generated_tokens_total", "counter", "Tokens generated.",
           (double)st.gen_tokens_total);
    metric(&b, "moed_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
           tps_rate(a));
    metric(&b, "moed_queue_depth", "gauge", "Requests waiting for a worker slot.", st.queued);
    metric(&b, "moed_requests_running", "gauge", "Requests generating now.", st.running);
    metric(&b, "moed_workers_ready", "gauge", "Workers ready to serve.", st.workers_ready);
    metric(&b, "moed_workers", "gauge", "Workers configured.", st.workers_total);
    metric(&b, "moed_generations_in_flight", "gauge", "Generation requests not finished yet.",
           (double)a->n_gens);
    sb_printf(&b, "# HELP moed_http_responses_total HTTP responses by status class.\n"
                  "# TYPE moed_http_responses_total counter\n");
    for (int i = 1; i <= 5; i++)
        sb_printf(&b, "moed_http_responses_total{code=\"%dxx\"} %" PRIu64 "\n", i, a->http_by_class[i]);
    if (a->routing) {
        sb_printf(&b, "# HELP moed_expert_routings_total Tokens routed to each expert since the daemon started.\n"
                      "# TYPE moed_expert_routings_total counter\n");
        for (uint32_t l = 0; l < a->model.n_layer; l++)
            for (uint32_t x = 0; x < a->model.n_expert; x++)
                sb_printf(&b, "moed_expert_routings_total{layer=\"%u\",expert=\"%u\"} %" PRIu64 "\n", l,
                          x, a->routing[(size_t)l * a->model.n_expert + x]);
        metric(&b, "moed_routed_tokens_total", "counter", "Tokens whose routing was counted.",
               (double)a->routing_tokens);
    }
    static const struct {
        const char *name, *help;
        size_t off;
        const double *bounds;
    } hs[] = {
        {"moed_time_to_first_token_seconds",
         "From a complete generation request to its first token (tokenizing and queueing included).",
         offsetof(struct api, ttft), TTFT_BOUNDS},
        {"moed_inter_token_latency_seconds", "Between consecutive tokens of a generation.",
         offsetof(struct api, itl), ITL_BOUNDS},
    };
    for (size_t k = 0; k < sizeof hs / sizeof hs[0]; k++) {
        const struct latency_hist *h = (const struct latency_hist *)((const char *)a + hs[k].off);
        sb_printf(&b, "# HELP %s %s\n# TYPE %s histogram\n", hs[k].name, hs[k].help, hs[k].name);
        uint64_t cum = 0;
        for (int i = 0; i < LAT_BUCKETS; i++) {
            cum += h->count[i];
            sb_printf(&b, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", hs[k].name, hs[k].bounds[i], cum);
        }
        cum += h->count[LAT_BUCKETS];
        sb_printf(&b, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n%s_sum %.9g\n%s_count %" PRIu64 "\n",
                  hs[k].name, cum, hs[k].name, h->sum, hs[k].name, h->n);
    }
    if (a->hooks.metrics) {
        char *extra = NULL;
        if (a->hooks.metrics(a->hooks.user, &extra) == 0 && extra)
            sb_printf(&b, "%s", extra);
        free(extra);
    }
    count_response(a, b.oom ? 500 : 200);
    if (b.oom)
        http_respond(req->conn, 500, "text/plain", NULL, "out of memory\n", 14);
    else
        http_respond(req->conn, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, b.p, b.len);
    free(b.p);
}

static int hook_status(int rc)
{
    switch (rc) {
    case MOE_EFORMAT:
    case MOE_ETYPE:
    case MOE_ERANGE:
        return 400;
    case MOE_ENOTFOUND:
        return 404;
    case MOE_ETOOBIG:
        return 413;
    default:
        return 500;
    }
}

static void respond_hook_json(struct api *a, struct http_request *req, int rc, char *json,
                              const char *err)
{
    if (rc) {
        respond_error(a, req->conn, hook_status(rc), NULL, "%s", err[0] ? err : moe_strerror(rc));
    } else {
        size_t n = json ? strlen(json) : 0;
        count_response(a, 200);
        http_respond(req->conn, 200, "application/json", NULL, json ? json : "{}", json ? n : 2);
    }
    free(json);
}

static void handle_admin_status(struct api *a, struct http_request *req)
{
    struct sched_stats st;
    get_stats(a, &st);
    json_t *o = json_object();
    json_t *m = json_object();
    char fp[24];
    snprintf(fp, sizeof fp, "%016" PRIx64, a->model.fingerprint);
    json_object_set_new(m, "id", json_string(a->model_id));
    json_object_set_new(m, "arch", json_string(a->model_arch));
    json_object_set_new(m, "fingerprint", json_string(fp));
    json_object_set_new(m, "n_ctx", json_integer(a->model.n_ctx));
    json_object_set_new(m, "n_vocab", json_integer(a->model.n_vocab));
    json_object_set_new(m, "n_layer", json_integer(a->model.n_layer));
    json_object_set_new(m, "n_expert", json_integer(a->model.n_expert));
    json_object_set_new(m, "n_expert_used", json_integer(a->model.n_expert_used));
    json_object_set_new(m, "bytes_dense", json_integer((json_int_t)a->model.bytes_dense));
    json_object_set_new(m, "bytes_experts", json_integer((json_int_t)a->model.bytes_experts));
    json_object_set_new(m, "chat_template", json_string(api_chat_kind(a)));
    json_object_set_new(o, "model", m);
    json_object_set_new(o, "status", json_string(a->draining ? "stopping" : a->ready ? "ready" : "loading"));
    json_object_set_new(o, "pid", json_integer(getpid()));
    json_object_set_new(o, "uptime_s", json_integer(time(NULL) - a->started));
    json_t *s = json_object();
    json_object_set_new(s, "queued", json_integer(st.queued));
    json_object_set_new(s, "running", json_integer(st.running));
    json_object_set_new(s, "workers_ready", json_integer(st.workers_ready));
    json_object_set_new(s, "workers_total", json_integer(st.workers_total));
    json_object_set_new(s, "requests_total", json_integer((json_int_t)st.requests_total));
    json_object_set_new(s, "requests_failed", json_integer((json_int_t)st.requests_failed));
    json_object_set_new(s, "prompt_tokens_total", json_integer((json_int_t)st.prompt_tokens_total));
    json_object_set_new(s, "gen_tokens_total", json_integer((json_int_t)st.gen_tokens_total));
    json_object_set_new(s, "tokens_per_second", json_real(tps_rate(a)));
    json_object_set_new(o, "scheduler", s);
    if (a->hooks.status) {
        char *extra = NULL, err[256] = "";
        if (a->hooks.status(a->hooks.user, &extra, err, sizeof err) == 0 && extra) {
            json_t *x = json_loads(extra, 0, NULL);
            if (json_is_object(x))
                json_object_update(o, x);
            json_decref(x);
        }
        free(extra);
    }
    respond_json(a, req->conn, 200, o, NULL);
}

static void handle_admin(struct api *a, struct http_request *req, const char *what)
{
    char err[512] = "";
    char *json = NULL;
    if (!api_peer_is_admin(a, req->peer)) {
        if (req->peer->transport != HTTP_TRANSPORT_UNIX)
            respond_error(a, req->conn, 403, NULL, "access denied: /admin is only served on the Unix socket");
        else
            respond_error(a, req->conn, 403, NULL,
                          "access denied: uid %u is not root, the daemon's user, or in its admin group",
                          req->peer->has_cred ? (unsigned)req->peer->uid : 0u);
        return;
    }
    bool get = req->method == HTTP_GET || req->method == HTTP_HEAD;
    if (!strcmp(what, "status")) {
        if (!get)
            goto method;
        handle_admin_status(a, req);
        return;
    }
    if (!strcmp(what, "profile")) {
        int rc;
        if (get) {
            if (!a->hooks.profile_export)
                goto not_impl;
            rc = a->hooks.profile_export(a->hooks.user, &json, err, sizeof err);
            respond_hook_json(a, req, rc, json, err);
        } else if (req->method == HTTP_PUT) {
            if (!a->hooks.profile_import)
                goto not_impl;
            rc = a->hooks.profile_import(a->hooks.user, req->body, req->body_len, err, sizeof err);
            if (rc == 0)
                json = strdup("{\"imported\":true}");
            respond_hook_json(a, req, rc, json, err);
        } else if (req->method == HTTP_DELETE) {
            if (!a->hooks.profile_reset)
                goto not_impl;
            rc = a->hooks.profile_reset(a->hooks.user, err, sizeof err);
            if (rc == 0)
                json = strdup("{\"reset\":true}");
            respond_hook_json(a, req, rc, json, err);
        } else {
            respond_error_ex(a, req->conn, 405, NULL, NULL, "%s is not allowed on %s (use GET, PUT or DELETE)",
                             req->method_name, req->path);
        }
        return;
    }
    if (!strcmp(what, "placement")) {
        if (!get)
            goto method;
        if (!a->hooks.placement)
            goto not_impl;
        int rc = a->hooks.placement(a->hooks.user, &json, err, sizeof err);
        respond_hook_json(a, req, rc, json, err);
        return;
    }
    respond_error(a, req->conn, 404, NULL, "no such endpoint: %s", req->path);
    return;
method:
    respond_error(a, req->conn, 405, NULL, "%s is not allowed on %s (use GET)", req->method_name, req->path);
    return;
not_impl:
    respond_error(a, req->conn, 501, NULL, "%s is not available in this daemon", req->path);
}

/* Equal strings, in a time that depends on their lengths only. */
static bool same_secret(const char *x, const char *y)
{
    size_t nx = strlen(x), ny = strlen(y), n = nx > ny ? nx : ny;
    unsigned diff = (unsigned)(nx ^ ny);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)(i < nx ? x[i] : 0) ^ (unsigned char)(i < ny ? y[i] : 0);
    return diff == 0;
}

/* Over TCP every request but /health must carry the API key (a TCP port is open to every local
 * user, whatever the Unix socket's mode says). */
static bool tcp_authorized(const struct api *a, const struct http_request *req)
{
    if (!a->api_key || req->peer->transport != HTTP_TRANSPORT_TCP)
        return true;
    const char *h = req->authorization;
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    h += 7;
    while (*h == ' ')
        h++;
    return same_secret(h, a->api_key);
}

void api_handle(void *user, struct http_request *req)
{
    struct api *a = user;
    const char *p = req->path;
    if (strcmp(p, "/health") != 0 && !tcp_authorized(a, req)) {
        respond_error(a, req->conn, 401, NULL,
                      "missing or wrong API key: send 'Authorization: Bearer KEY' (the key of "
                      "--api-key-file)");
        return;
    }
    bool get = req->method == HTTP_GET || req->method == HTTP_HEAD;
    bool post = req->method == HTTP_POST;
    /* Trailing slashes are tolerated: "/v1/models/" is "/v1/models". */
    char path[256];
    size_t pl = strlen(p);
    if (pl >= sizeof path) {
        respond_error(a, req->conn, 404, NULL, "no such endpoint");
        return;
    }
    memcpy(path, p, pl + 1);
    while (pl > 1 && path[pl - 1] == '/')
        path[--pl] = 0;

    if (!strcmp(path, "/tokenize") || !strcmp(path, "/detokenize") ||
        !strcmp(path, "/apply-template")) {
        if (req->method != HTTP_POST) {
            respond_error(a, req->conn, 405, NULL, "%s is not allowed on %s (use POST)", req->method_name, path);
            return;
        }
        if (path[1] == 't')
            handle_tokenize(a, req);
        else if (path[1] == 'd')
            handle_detokenize(a, req);
        else
            handle_apply_template(a, req);
        return;
    }
    if (!strcmp(path, "/v1/completions") || !strcmp(path, "/v1/chat/completions") ||
        !strcmp(path, "/v1/responses")) {
        if (!post) {
            respond_error(a, req->conn, 405, NULL, "%s is not allowed on %s (use POST)", req->method_name, path);
            return;
        }
        const bool responses = path[4] == 'r';
        handle_generate(a, req, responses || (path[4] == 'c' && path[5] == 'h'), responses);
        return;
    }
    if (!get && (!strcmp(path, "/v1/models") || !strncmp(path, "/v1/models/", 11) ||
                 !strcmp(path, "/health") || !strcmp(path, "/metrics") || !strcmp(path, "/props") ||
                 !strcmp(path, "/slots"))) {
        respond_error(a, req->conn, 405, NULL, "%s is not allowed on %s (use GET)", req->method_name, path);
        return;
    }
    if (!strcmp(path, "/v1/models")) {
        handle_models(a, req, NULL);
    } else if (!strncmp(path, "/v1/models/", 11)) {
        handle_models(a, req, path + 11);
    } else if (!strcmp(path, "/health")) {
        handle_health(a, req);
    } else if (!strcmp(path, "/props")) {
        handle_props(a, req);
    } else if (!strcmp(path, "/slots")) {
        handle_slots(a, req);
    } else if (!strcmp(path, "/metrics")) {
        handle_metrics(a, req);
    } else if (!strncmp(path, "/admin/", 7)) {
        handle_admin(a, req, path + 7);
    } else {
        respond_error(a, req->conn, 404, NULL, "no such endpoint: %s %s", req->method_name, path);
    }
}

/* ---- lifecycle ---- */

/* The chat template: --chat-template's text (an error in it is the daemon's error), else the
 * model's (an error in it makes chat requests answer 501 with it), else built-in ChatML. */
static int api_load_chat(struct api *a, const struct api_opts *o, char *err, size_t errlen)
{
    const char *tmpl = moe_tok_chat_template(a->tok);
    char msg[512];
    const char *text = o->chat_template ? o->chat_template : tmpl && *tmpl ? tmpl
                                                                         : chat_chatml_template;
    if (!(a->chat_text = strdup(text)))
        return -ENOMEM;
    if (o->chat_template) {
        if (chat_template_new(&a->chat, o->chat_template, strlen(o->chat_template), CHAT_SRC_FILE,
                              msg, sizeof msg))
            return moe_fail(err, errlen, MOE_EFORMAT, "--chat-template: %s", msg);
    } else if (tmpl && *tmpl) {
        if (chat_template_new(&a->chat, tmpl, strlen(tmpl), CHAT_SRC_MODEL, msg, sizeof msg)) {
            snprintf(a->chat_err, sizeof a->chat_err,
                     "this model's chat template cannot be used (%s); use --chat-template FILE or "
                     "/v1/completions", msg);
            a->chat = NULL;
        }
    } else if (chat_template_new(&a->chat, chat_chatml_template, strlen(chat_chatml_template),
                                 CHAT_SRC_BUILTIN, msg, sizeof msg)) {
        return moe_fail(err, errlen, MOE_EINTERNAL, "built-in template: %s", msg);
    }
    return 0;
}

int api_new(struct api **out, const struct api_opts *o, char *err, size_t errlen)
{
    struct api *a = calloc(1, sizeof *a);
    if (!a)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    a->tok = o->tok;
    a->sched = o->sched;
    a->loop = o->loop;
    a->model = o->model;
    a->model_id = strdup(o->model.id ? o->model.id : "model");
    a->model_arch = strdup(o->model.arch ? o->model.arch : "");
    a->admin_uid = o->admin_uid;
    a->admin_gid = o->admin_gid;
    a->have_admin_gid = o->have_admin_gid;
    a->max_tokens_default = o->max_tokens_default;
    a->sampling = o->sampling;
    if (!a->sampling.set)
        a->sampling = (struct api_sampling_defaults){.temperature = 1.0f, .top_p = 1.0f,
                                                     .repetition_penalty = 1.0f, .set = true};
    if (!a->sampling.source)
        a->sampling.source = o->sampling.set ? "configuration" : "OpenAI's defaults";
    if (o->api_key && !(a->api_key = strdup(o->api_key))) {
        api_free(a);
        return -ENOMEM;
    }
    a->hooks = o->hooks;
    a->started = time(NULL);
    a->im_start = a->im_end = -1;
    if (getrandom(&a->id_seed, sizeof a->id_seed, GRND_NONBLOCK) != sizeof a->id_seed)
        a->id_seed = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
    if (a->tok && api_load_chat(a, o, err, errlen)) {
        api_free(a);
        return MOE_EFORMAT;
    }
    if (a->model.n_layer && a->model.n_expert && a->model.n_layer <= 4096 && a->model.n_expert <= 4096)
        a->routing = calloc((size_t)a->model.n_layer * a->model.n_expert, sizeof *a->routing);
    if (!a->model_id || !a->model_arch) {
        api_free(a);
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    }
    *out = a;
    return 0;
}

void api_free(struct api *a)
{
    if (!a)
        return;
    /* Prompts still being tokenized: answered now; the pool finishes each job and frees it
     * without the api (the loop keeps running until it has). */
    while (a->jobs) {
        struct tok_job *j = a->jobs;
        tok_job_unlink(j);
        uv_cancel((uv_req_t *)&j->work);
        if (!j->aborted) {
            http_conn_on_abort(j->c, NULL, NULL);
            respond_error(a, j->c, 503, NULL, "moed is shutting down");
        }
        j->aborted = true;
        j->c = NULL;
        j->a = NULL;
    }
    while (a->gens) {
        struct gen *g = a->gens;
        group_cancel(g->grp);
        http_conn_on_abort(g->conn, NULL, NULL);
        if (g->grp->headers_sent) {
            json_t *o = json_object();
            json_object_set_new(o, "error", error_obj(503, NULL, "moed is shutting down"));
            sse_send(g, o);
            http_stream_end(g->conn);
        } else {
            respond_error(a, g->conn, 503, NULL, "moed is shutting down");
        }
        group_free(g->grp);
    }
    free(a->routing);
    free(a->chat_text);
    free(a->model_id);
    free(a->model_arch);
    free(a->api_key);
    chat_template_free(a->chat);
    free(a);
}

void api_set_sched(struct api *a, struct sched *s)
{
    a->sched = s;
}

void api_set_loading(struct api *a, uint64_t done, uint64_t total)
{
    atomic_store(&a->load_done, done);
    atomic_store(&a->load_total, total);
}

void api_set_ready(struct api *a, bool ready)
{
    a->ready = ready;
}

void api_set_draining(struct api *a, bool draining)
{
    a->draining = draining;
}

void api_add_routing(struct api *a, const uint64_t *counts, uint32_t n_layer, uint32_t n_expert,
                     uint64_t n_tokens)
{
    if (!a->routing || n_layer != a->model.n_layer || n_expert != a->model.n_expert)
        return;
    for (size_t i = 0; i < (size_t)n_layer * n_expert; i++)
        a->routing[i] += counts[i];
    a->routing_tokens += n_tokens;
}

uint32_t api_inflight(const struct api *a)
{
    return a->n_gens + a->n_jobs;
}
