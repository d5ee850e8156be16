/* libFuzzer target for the client API's request handling (daemon/api.c with daemon/chat.c, the
 * Jinja renderer and the real scheduler, daemon/sched.c).
 *
 * The API runs against the bundled model's tokenizer and chat template (models/kjv-demo-F16.gguf,
 * so run from the repository root) and a scheduler with one ready worker. The HTTP connection and
 * the worker are played here: the connection through daemon/http.h's response functions (no
 * sockets; daemon/http.c is not linked), the worker through the scheduler's calls into the
 * supervisor (daemon/sched_int.h; daemon/supervisor.c is not linked), so that a request that
 * passes validation is generated for as far as the input says, then finishes, fails, or its
 * client goes away.
 *
 * Input: byte 0 picks the endpoint (a path and method, or a path taken from the body), byte 1
 * holds flags (tokenize on the loop's thread pool or inline, TCP with or without the API key, HEAD,
 * how the generation ends, a client that stops reading its stream, the daemon stopping with the
 * request in flight), then the request body up to
 * the first NUL byte, then the tokens the worker generates (two bytes each, modulo the
 * vocabulary).
 *
 * Every request must be answered exactly once, with a JSON body (an error object with a message
 * for 4xx/5xx), a 500 only when the worker failed, and nothing left in flight afterwards in the
 * API or the scheduler. Anything else aborts. */
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <http_parser.h>
#include <uv.h>

#include "daemon/api.h"
#include "daemon/http.h"
#include "daemon/log.h"
#include "daemon/sched.h"
#include "daemon/sched_int.h"
#include "store/err.h"
#include "store/gguf.h"
#include "store/model.h"
#include "store/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define MODEL_PATH "models/kjv-demo-F16.gguf"
#define N_CTX 512
#define MAX_SCRIPT 64        /* tokens the worker generates at most */
#define MAX_SUBMITS 128      /* a request's choices at most (prompts x n) */
#define API_KEY "fuzz-key"

/* ---- the connection: daemon/http.h's response side ---- */

struct http_conn {
    bool responded;          /* the request was answered (respond or stream end) */
    bool streaming;
    bool aborted;            /* the abort callback ran: nothing may touch the connection */
    bool overflow;           /* the client stopped reading: writes fail, the abort comes later */
    int status;
    int writes_left;         /* stream writes before the overflow; -1: never */
    http_abort_fn abort_fn;
    void *abort_user;
    char *body;
    size_t len, cap;
    char ctype[128];
};

static void conn_append(struct http_conn *c, const void *p, size_t n)
{
    if (c->len + n + 1 > c->cap) {
        size_t cap = (c->len + n + 1) * 2;
        char *b = realloc(c->body, cap);
        if (!b)
            abort();
        c->body = b;
        c->cap = cap;
    }
    memcpy(c->body + c->len, p, n);
    c->len += n;
    c->body[c->len] = 0;
}

static void conn_check_alive(const struct http_conn *c)
{
    if (!c || c->aborted) {
        fprintf(stderr, "fuzz_api: connection used after its abort callback\n");
        abort();
    }
}

void http_conn_on_abort(struct http_conn *c, http_abort_fn fn, void *user)
{
    conn_check_alive(c);
    c->abort_fn = fn;
    c->abort_user = user;
}

size_t http_conn_write_queue(const struct http_conn *c)
{
    return c->len;
}

const char *http_status_text(int status)
{
    (void)status;
    return "Status";
}

static void conn_head(struct http_conn *c, int status, const char *content_type)
{
    conn_check_alive(c);
    if (c->responded || c->streaming) {
        fprintf(stderr, "fuzz_api: a second response to one request (status %d after %d)\n", status,
                c->status);
        abort();
    }
    if (status < 100 || status > 599) {
        fprintf(stderr, "fuzz_api: status %d\n", status);
        abort();
    }
    c->status = status;
    snprintf(c->ctype, sizeof c->ctype, "%s", content_type ? content_type : "");
}

int http_respond(struct http_conn *c, int status, const char *content_type,
                 const char *extra_headers, const void *body, size_t len)
{
    (void)extra_headers;
    conn_head(c, status, content_type);
    if (c->overflow)
        return -EPIPE;
    conn_append(c, body, len);
    c->responded = true;
    c->abort_fn = NULL;
    return 0;
}

int http_stream_start(struct http_conn *c, int status, const char *content_type,
                      const char *extra_headers)
{
    (void)extra_headers;
    conn_head(c, status, content_type);
    c->streaming = true;
    return 0;
}

static void conn_check_stream(const struct http_conn *c, const char *what)
{
    conn_check_alive(c);
    if (!c->streaming || c->responded) {
        fprintf(stderr, "fuzz_api: stream %s outside a stream\n", what);
        abort();
    }
}

int http_stream_write(struct http_conn *c, const void *data, size_t len)
{
    conn_check_stream(c, "write");
    if (c->overflow)
        return -EPIPE;
    if (c->writes_left == 0) {
        c->overflow = true; /* the real server aborts the request on its next loop iteration */
        return -EPIPE;
    }
    if (c->writes_left > 0)
        c->writes_left--;
    conn_append(c, data, len);
    return 0;
}

int http_stream_end(struct http_conn *c)
{
    conn_check_stream(c, "end");
    if (c->overflow)
        return -EPIPE;
    c->responded = true;
    c->abort_fn = NULL;
    return 0;
}

/* The client goes away (or the server drops a client that does not read). */
static void conn_abort(struct http_conn *c)
{
    if (c->aborted || c->responded)
        return;
    http_abort_fn fn = c->abort_fn;
    void *user = c->abort_user;
    c->abort_fn = NULL;
    c->aborted = true;
    if (fn)
        fn(user);
}

/* ---- the worker: the scheduler's calls into the supervisor ---- */

struct submit {
    uint64_t id;
    uint32_t n_prompt, max_tokens;
    int32_t prompt[N_CTX + 1];
    bool logprobs, prompt_logprobs;
    uint32_t n_top;
    bool cancelled;
};

static struct submit submits[MAX_SUBMITS];
static uint32_t n_submits;

int moed_workers_send_submit(struct moed_workers *ws, uint32_t w, uint64_t id, const int32_t *prompt,
                             uint32_t n_prompt, uint32_t max_tokens,
                             const struct sched_sampling *sp, const int32_t *eog, uint32_t n_eog)
{
    (void)ws;
    (void)w;
    (void)eog;
    (void)n_eog;
    if (n_submits >= MAX_SUBMITS || n_prompt > N_CTX)
        abort();
    struct submit *s = &submits[n_submits++];
    memset(s, 0, sizeof *s);
    s->id = id;
    s->n_prompt = n_prompt;
    s->max_tokens = max_tokens;
    memcpy(s->prompt, prompt, n_prompt * sizeof *prompt);
    s->logprobs = sp->logprobs;
    s->prompt_logprobs = sp->prompt_logprobs;
    s->n_top = sp->top_logprobs;
    if (s->n_top > SCHED_MAX_TOP_LOGPROBS)
        abort();
    return 0;
}

int moed_workers_send_cancel(struct moed_workers *ws, uint32_t w, uint64_t id)
{
    (void)ws;
    (void)w;
    for (uint32_t i = 0; i < n_submits; i++)
        if (submits[i].id == id)
            submits[i].cancelled = true;
    return 0;
}

/* ---- the environment, built once ---- */

static uv_loop_t loop;
static struct gguf_file *gguf;
static struct moe_model model;
static struct moe_tokenizer *tok;
static struct sched *sched;
static struct api *api_pool, *api_inline; /* tokenizing on the loop's thread pool, or inline */
static uint32_t n_vocab;
static struct api_opts opts_pool, opts_inline;

static void fatal(const char *what, const char *err);

static struct api *api_make(const struct api_opts *o)
{
    char err[512];
    struct api *a;
    if (api_new(&a, o, err, sizeof err))
        fatal("api_new", err);
    api_set_ready(a, true);
    return a;
}

static void fatal(const char *what, const char *err)
{
    fprintf(stderr, "fuzz_api: %s: %s (run from the repository root)\n", what, err);
    exit(1);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    char err[512];
    log_set_level(LOG_LEVEL_DEBUG); /* every log line is formatted, and goes nowhere */
    if (log_open_file("/dev/null", err, sizeof err))
        fatal("log", err);
    if (gguf_open(&gguf, MODEL_PATH, err, sizeof err))
        fatal(MODEL_PATH, err);
    if (moe_model_from_gguf(&model, gguf, err, sizeof err))
        fatal(MODEL_PATH, err);
    if (moe_tok_load(&tok, gguf, err, sizeof err))
        fatal("tokenizer", err);
    n_vocab = moe_tok_n_vocab(tok);
    if (uv_loop_init(&loop))
        fatal("uv_loop_init", "failed");
    int32_t eog[64];
    uint32_t n_eog = 0;
    for (uint32_t id = 0; id < n_vocab && n_eog < 64; id++)
        if (moe_tok_is_eog(tok, (int32_t)id))
            eog[n_eog++] = (int32_t)id;
    struct sched_config sc = {.n_workers = 1, .n_ctx = N_CTX, .queue_max = 64,
                              .queue_wait_ms = 60000, .eog = eog, .n_eog = n_eog};
    if (sched_create(&sched, &loop, NULL, &sc))
        fatal("sched_create", "out of memory");
    sched_worker_ready(sched, 0, MAX_SUBMITS, N_CTX);
    const struct moe_hparams *hp = &model.hp;
    struct api_opts ao = {
        .tok = tok,
        .sched = sched,
        .model = {.id = "kjv-demo", .arch = model.arch_name, .n_ctx = N_CTX,
                  .n_vocab = hp->n_vocab, .n_layer = hp->n_layer, .n_expert = hp->n_expert,
                  .n_expert_used = hp->n_expert_used, .fingerprint = model.fingerprint,
                  .bytes_dense = model.bytes_dense, .bytes_experts = model.bytes_experts,
                  .n_slots = MAX_SUBMITS},
        .admin_uid = geteuid(),
        .api_key = API_KEY,
        .loop = &loop,
    };
    opts_pool = ao;
    api_pool = api_make(&opts_pool);
    ao.loop = NULL;
    ao.api_key = NULL;
    ao.max_tokens_default = 8;
    opts_inline = ao;
    api_inline = api_make(&opts_inline);
    return 0;
}

/* ---- one request ---- */

struct route {
    unsigned method;
    const char *path;        /* NULL: the path is the body's first line */
};

static const struct route routes[] = {
    {HTTP_POST, "/v1/chat/completions"}, {HTTP_POST, "/v1/completions"},
    {HTTP_POST, "/tokenize"},            {HTTP_POST, "/detokenize"},
    {HTTP_POST, "/apply-template"},      {HTTP_POST, "/v1/chat/completions/"},
    {HTTP_GET, "/v1/models"},            {HTTP_GET, "/v1/models/kjv-demo"},
    {HTTP_GET, "/health"},               {HTTP_GET, "/props"},
    {HTTP_GET, "/slots"},                {HTTP_GET, "/metrics"},
    {HTTP_GET, "/admin/status"},         {HTTP_PUT, "/admin/profile"},
    {HTTP_GET, "/v1/completions"},       {HTTP_POST, NULL},
    {HTTP_GET, NULL},                    {HTTP_DELETE, NULL},
    {HTTP_POST, "/v1/responses"},
};
#define N_ROUTES (sizeof routes / sizeof routes[0])

static const char *method_name(unsigned m)
{
    return http_method_str((enum http_method)m);
}

/* What every response must look like. */
static void check_response(const struct http_conn *c, bool worker_failed)
{
    if (c->status == 500 && !worker_failed) {
        fprintf(stderr, "fuzz_api: 500 without a worker failure: %.*s\n", (int)c->len, c->body);
        abort();
    }
    if (strncmp(c->ctype, "application/json", 16) == 0) {
        json_error_t je;
        json_t *v = json_loadb(c->body, c->len, JSON_ALLOW_NUL, &je);
        if (!v) {
            fprintf(stderr, "fuzz_api: response is not JSON (%s): %.*s\n", je.text, (int)c->len, c->body);
            abort();
        }
        if (c->status >= 400) {
            json_t *m = json_object_get(json_object_get(v, "error"), "message");
            if (!json_is_string(m) || !json_string_length(m)) {
                fprintf(stderr, "fuzz_api: error without a message: %.*s\n", (int)c->len, c->body);
                abort();
            }
        }
        json_decref(v);
    } else if (strncmp(c->ctype, "text/event-stream", 17) == 0) {
        /* Each event is "data: JSON" or "data: [DONE]". */
        const char *p = c->body, *end = c->body + c->len;
        while (p && p < end) {
            const char *nl = memchr(p, '\n', (size_t)(end - p));
            size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
            if (n > 6 && !strncmp(p, "data: ", 6) && strncmp(p + 6, "[DONE]", 6) != 0) {
                json_error_t je;
                json_t *v = json_loadb(p + 6, n - 6, JSON_ALLOW_NUL, &je);
                if (!v) {
                    fprintf(stderr, "fuzz_api: event is not JSON (%s): %.*s\n", je.text, (int)n, p);
                    abort();
                }
                json_decref(v);
            }
            p = nl ? nl + 1 : NULL;
        }
    }
}

static void fake_lp(struct sched_logprob *lp, uint32_t n_top, uint32_t seed)
{
    memset(lp, 0, sizeof *lp);
    lp->logprob = -(float)(seed % 7) * 0.5f;
    lp->n_top = n_top;
    for (uint32_t k = 0; k < n_top; k++) {
        lp->top_id[k] = (int32_t)((seed * 31u + k * 7u) % n_vocab);
        lp->top_lp[k] = -(float)k;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    const struct route *rt = &routes[data[0] % N_ROUTES];
    const uint8_t fl = data[1];
    const bool use_pool = fl & 1;
    const bool tcp = fl & 2, with_key = fl & 4;
    const int end_how = (fl >> 3) & 3;   /* 0: done (stop), 1: done (length), 2: worker error, 3: client goes away */
    const bool overflow = fl & 0x20;     /* the client stops reading after a few stream writes */
    const bool head = (fl & 0x40) && rt->method == HTTP_GET;
    const bool shutdown = fl & 0x80;     /* the daemon stops (api_free) with the request in flight */
    data += 2;
    size -= 2;
    const uint8_t *nul = memchr(data, 0, size);
    size_t blen = nul ? (size_t)(nul - data) : size;
    const uint8_t *script = nul ? nul + 1 : NULL;
    size_t n_script = nul ? (size - blen - 1) / 2 : 0;
    if (n_script > MAX_SCRIPT)
        n_script = MAX_SCRIPT;

    /* The body is NUL-terminated, as the HTTP server hands it over; exact size for ASan. */
    char *body = malloc(blen + 1);
    if (!body)
        return 0;
    memcpy(body, data, blen);
    body[blen] = 0;
    char path[512];
    if (rt->path) {
        snprintf(path, sizeof path, "%s", rt->path);
    } else {
        size_t pl = strcspn(body, "\r\n");
        snprintf(path, sizeof path, "/%.*s", (int)(pl < 400 ? pl : 400), body);
    }
    char *q = strchr(path, '?');
    const char *query = "";
    if (q) {
        *q = 0;
        query = q + 1;
    }

    struct http_conn *c = calloc(1, sizeof *c);
    if (!c)
        abort();
    c->writes_left = overflow ? 2 : -1;
    struct http_peer peer = {.transport = tcp ? HTTP_TRANSPORT_TCP : HTTP_TRANSPORT_UNIX,
                             .has_cred = !tcp, .pid = getpid(), .uid = geteuid(), .gid = getegid()};
    struct http_request req = {
        .conn = c,
        .method = head ? HTTP_HEAD : rt->method,
        .method_name = method_name(head ? HTTP_HEAD : rt->method),
        .path = path,
        .query = query,
        .body = body,
        .body_len = blen,
        .content_type = "application/json",
        .authorization = with_key ? "Bearer " API_KEY : NULL,
        .peer = &peer,
        .id = 1,
    };
    struct api *a = use_pool ? api_pool : api_inline;
    n_submits = 0;
    api_handle(a, &req);
    bool freed = false;
    if (shutdown && use_pool) { /* while the prompt is being tokenized */
        api_free(a);
        freed = true;
    }
    uv_run(&loop, UV_RUN_DEFAULT); /* prompts being tokenized on the thread pool */

    /* The worker: each submitted choice gets the script's tokens (up to max_tokens or an
     * end-of-generation token), then its end. */
    bool worker_failed = false;
    for (uint32_t i = 0; i < n_submits && !c->aborted && !freed; i++) {
        struct submit *s = &submits[i];
        struct sched_logprob lp;
        if (s->prompt_logprobs)
            for (uint32_t pos = 1; pos < s->n_prompt && !s->cancelled && !c->aborted; pos++) {
                fake_lp(&lp, s->n_top, pos);
                sched_worker_prompt_logprob(sched, 0, s->id, pos, s->prompt[pos], &lp);
            }
        uint32_t n_gen = 0;
        bool eog = false;
        for (size_t k = 0; k < n_script && n_gen < s->max_tokens && !s->cancelled && !eog; k++) {
            int32_t t = (int32_t)((script[2 * k] | (uint32_t)script[2 * k + 1] << 8) % n_vocab);
            fake_lp(&lp, s->n_top, (uint32_t)k + i);
            sched_worker_token(sched, 0, s->id, t, s->logprobs ? &lp : NULL);
            n_gen++;
            eog = moe_tok_is_eog(tok, t);
            if (c->overflow)
                conn_abort(c);
        }
        if (s->cancelled || c->aborted)
            continue;
        if (shutdown) {
            api_free(a);
            freed = true;
            break;
        }
        if (end_how == 3)
            break;
        if (end_how == 2) {
            worker_failed = true;
            sched_worker_error(sched, 0, s->id, MOE_EINTERNAL, "fuzzed failure");
        } else {
            sched_worker_done(sched, 0, s->id, eog ? 0 : end_how == 1 || n_gen >= s->max_tokens,
                              s->n_prompt, n_gen, 0, NULL, 0);
        }
        if (c->overflow)
            conn_abort(c);
    }
    if (c->overflow || end_how == 3)
        conn_abort(c);
    if (shutdown && !freed) {
        api_free(a);
        freed = true;
    }
    uv_run(&loop, UV_RUN_DEFAULT);

    if (!c->aborted && !c->responded) {
        fprintf(stderr, "fuzz_api: %s %s got no complete response (status %d, %zu bytes so far)\n",
                req.method_name, path, c->status, c->len);
        abort();
    }
    if (getenv("FUZZ_API_PRINT")) /* shows what each input got */
        fprintf(stderr, "%s %s -> %d%s %.*s\n", req.method_name, path, c->status,
                c->aborted ? " (client gone)" : "", (int)(c->len < 600 ? c->len : 600), c->body);
    if (c->responded)
        check_response(c, worker_failed);
    struct sched_stats st;
    sched_get_stats(sched, &st);
    const uint32_t inflight = freed ? 0 : api_inflight(a);
    if (inflight != 0 || st.queued != 0 || st.running != 0) {
        fprintf(stderr, "fuzz_api: left in flight: api %u, scheduler %u queued, %u running\n",
                inflight, st.queued, st.running);
        abort();
    }
    if (freed) { /* the next daemon */
        if (use_pool)
            api_pool = api_make(&opts_pool);
        else
            api_inline = api_make(&opts_inline);
    }
    free(c->body);
    free(c);
    free(body);
    return 0;
}
