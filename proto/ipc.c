/* IPC framing: codec, validation, reassembly, libuv connections, fd passing. See proto/ipc.h. */
#include "proto/ipc.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "store/err.h"
#include "store/io.h"

/* ---------------------------------------------------------------------------------------------
 * Logging */

static char log_prog[64] = "moed";
static enum moe_ipc_log_level log_max = MOE_LOG_INFO;

void moe_ipc_log_init(const char *prog, enum moe_ipc_log_level max_level)
{
    if (prog)
        snprintf(log_prog, sizeof log_prog, "%s", prog);
    log_max = max_level;
}

static void (*log_sink)(enum moe_ipc_log_level level, const char *msg);

void moe_ipc_log_set_sink(void (*fn)(enum moe_ipc_log_level level, const char *msg))
{
    log_sink = fn;
}

void moe_ipc_log(enum moe_ipc_log_level level, const char *fmt, ...)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    if (log_sink) {
        char msg[1024];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        log_sink(level, msg);
        return;
    }
    if (level > log_max)
        return;
    /* One buffer and one write, so that lines of concurrent processes sharing stderr do not
     * interleave mid-line. */
    char line[1024];
    int n = snprintf(line, sizeof line, "%s: %s: ", log_prog, names[level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line)
        n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof line - 1)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t w = write(2, line, (size_t)n);
    (void)w;
}

/* ---------------------------------------------------------------------------------------------
 * Codec */

const char *moe_ipc_msg_name(int c)
{
    switch (c) {
    case MOED__ENVELOPE__MSG__NOT_SET: return "none";
    case MOED__ENVELOPE__MSG_HELLO: return "hello";
    case MOED__ENVELOPE__MSG_READY: return "ready";
    case MOED__ENVELOPE__MSG_SUBMIT: return "submit";
    case MOED__ENVELOPE__MSG_CANCEL: return "cancel";
    case MOED__ENVELOPE__MSG_TOKEN: return "token";
    case MOED__ENVELOPE__MSG_DONE: return "done";
    case MOED__ENVELOPE__MSG_ERROR: return "error";
    case MOED__ENVELOPE__MSG_ROUTING_STATS: return "routing_stats";
    case MOED__ENVELOPE__MSG_METRICS: return "metrics";
    case MOED__ENVELOPE__MSG_SET_PLACEMENT: return "set_placement";
    case MOED__ENVELOPE__MSG_EXPERT_REQUEST: return "expert_request";
    case MOED__ENVELOPE__MSG_EXPERT_READY: return "expert_ready";
    case MOED__ENVELOPE__MSG_SHUTDOWN: return "shutdown";
    case MOED__ENVELOPE__MSG_HEARTBEAT: return "heartbeat";
    default: return "unknown";
    }
}

int moe_ipc_encode(const Moed__Envelope *env, uint32_t max_frame, uint8_t **out, size_t *len,
                   char *err, size_t errlen)
{
    if (!max_frame)
        max_frame = MOE_IPC_MAX_FRAME;
    size_t n = moed__envelope__get_packed_size(env);
    if (n > max_frame)
        return moe_fail(err, errlen, MOE_ETOOBIG, "%s frame of %zu bytes exceeds the %u byte limit",
                        moe_ipc_msg_name(env->msg_case), n, max_frame);
    uint8_t *b = malloc(MOE_IPC_HEADER + n);
    if (!b)
        return moe_fail(err, errlen, -ENOMEM, "out of memory encoding a %zu byte frame", n);
    size_t packed = moed__envelope__pack(env, b + MOE_IPC_HEADER);
    MOE_ASSERT(packed == n);
    b[0] = (uint8_t)n;
    b[1] = (uint8_t)(n >> 8);
    b[2] = (uint8_t)(n >> 16);
    b[3] = (uint8_t)(n >> 24);
    *out = b;
    *len = MOE_IPC_HEADER + n;
    return 0;
}

int moe_ipc_decode(const uint8_t *body, size_t len, Moed__Envelope **out, char *err, size_t errlen)
{
    Moed__Envelope *env = moed__envelope__unpack(NULL, len, body);
    if (!env)
        return moe_fail(err, errlen, MOE_EFORMAT, "a %zu byte frame is not a valid protobuf Envelope",
                        len);
    /* Every message of the schema has a name; anything else (no message, a case from a newer
     * schema) is not ours. */
    if (env->msg_case == MOED__ENVELOPE__MSG__NOT_SET ||
        strcmp(moe_ipc_msg_name(env->msg_case), "unknown") == 0) {
        moed__envelope__free_unpacked(env, NULL);
        return moe_fail(err, errlen, MOE_EFORMAT, "a %zu byte frame carries no known message", len);
    }
    *out = env;
    return 0;
}

void moe_ipc_free(Moed__Envelope *env)
{
    if (env)
        moed__envelope__free_unpacked(env, NULL);
}

static bool finite_in(float v, float lo, float hi)
{
    return isfinite(v) && v >= lo && v <= hi;
}

static int check_token(int32_t t, const struct moe_ipc_limits *lim, const char *field, size_t i,
                       char *err, size_t errlen)
{
    if (t < 0 || (lim->n_vocab && (uint32_t)t >= lim->n_vocab))
        return moe_fail(err, errlen, MOE_ERANGE, "%s[%zu] = %d is not a token id (n_vocab %u)", field,
                        i, (int)t, lim->n_vocab);
    return 0;
}

static int check_shape(uint32_t n_layer, uint32_t n_expert, const struct moe_ipc_limits *lim,
                       const char *msg, char *err, size_t errlen)
{
    if (n_layer == 0 || n_expert == 0 || (lim->n_layer && n_layer != lim->n_layer) ||
        (lim->n_expert && n_expert != lim->n_expert))
        return moe_fail(err, errlen, MOE_ERANGE,
                        "%s: shape %u layers x %u experts does not match the model (%u x %u)", msg,
                        n_layer, n_expert, lim->n_layer, lim->n_expert);
    return 0;
}

static int validate_from_daemon(const Moed__Envelope *env, const struct moe_ipc_limits *lim,
                                char *err, size_t errlen)
{
    int rc;
    switch (env->msg_case) {
    case MOED__ENVELOPE__MSG_HELLO: {
        const Moed__Hello *h = env->hello;
        if (h->protocol_version != MOE_IPC_PROTOCOL_VERSION)
            return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                            "hello.protocol_version %u, this build speaks %u", h->protocol_version,
                            MOE_IPC_PROTOCOL_VERSION);
        if (!h->model_path || !h->model_path[0] || strlen(h->model_path) >= MOE_IPC_MAX_TEXT)
            return moe_fail(err, errlen, MOE_ERANGE, "hello.model_path is empty or too long");
        if (!h->device || strlen(h->device) >= 32)
            return moe_fail(err, errlen, MOE_ERANGE, "hello.device is too long");
        if (h->n_ctx < 1 || h->n_ctx > MOE_IPC_MAX_CTX)
            return moe_fail(err, errlen, MOE_ERANGE, "hello.n_ctx %u is outside 1..%u", h->n_ctx,
                            MOE_IPC_MAX_CTX);
        if (h->n_seq < 1 || h->n_seq > MOE_IPC_MAX_SEQ)
            return moe_fail(err, errlen, MOE_ERANGE, "hello.n_seq %u is outside 1..%u", h->n_seq,
                            MOE_IPC_MAX_SEQ);
        if (h->n_batch > 65536)
            return moe_fail(err, errlen, MOE_ERANGE, "hello.n_batch %u is over 65536", h->n_batch);
        if (h->n_threads < 0 || h->n_threads > 4096)
            return moe_fail(err, errlen, MOE_ERANGE, "hello.n_threads %d is outside 0..4096",
                            (int)h->n_threads);
        return 0;
    }
    case MOED__ENVELOPE__MSG_SUBMIT: {
        const Moed__Submit *s = env->submit;
        if (s->id == 0)
            return moe_fail(err, errlen, MOE_ERANGE, "submit.id is 0");
        if (s->n_prompt < 1 || (lim->n_ctx && s->n_prompt > lim->n_ctx))
            return moe_fail(err, errlen, MOE_ERANGE, "submit.prompt has %zu tokens (1..%u allowed)",
                            s->n_prompt, lim->n_ctx);
        for (size_t i = 0; i < s->n_prompt; i++)
            if ((rc = check_token(s->prompt[i], lim, "submit.prompt", i, err, errlen)))
                return rc;
        if (s->max_tokens < 1 || s->max_tokens > MOE_IPC_MAX_CTX)
            return moe_fail(err, errlen, MOE_ERANGE, "submit.max_tokens %u is outside 1..%u",
                            s->max_tokens, MOE_IPC_MAX_CTX);
        if (s->n_eog > MOE_IPC_MAX_EOG)
            return moe_fail(err, errlen, MOE_ERANGE, "submit.eog has %zu ids (at most %u)", s->n_eog,
                            MOE_IPC_MAX_EOG);
        for (size_t i = 0; i < s->n_eog; i++)
            if ((rc = check_token(s->eog[i], lim, "submit.eog", i, err, errlen)))
                return rc;
        const Moed__Sampling *p = s->sampling;
        if (p) {
            if (!finite_in(p->temperature, 0, 100))
                return moe_fail(err, errlen, MOE_ERANGE, "submit.sampling.temperature %g is outside 0..100",
                                (double)p->temperature);
            if (!finite_in(p->top_p, 0, 1) || !finite_in(p->min_p, 0, 1))
                return moe_fail(err, errlen, MOE_ERANGE, "submit.sampling.top_p/min_p outside 0..1");
            if (p->top_k < 0 || (lim->n_vocab && (uint32_t)p->top_k > lim->n_vocab))
                return moe_fail(err, errlen, MOE_ERANGE, "submit.sampling.top_k %d is outside 0..%u",
                                (int)p->top_k, lim->n_vocab);
            if (!finite_in(p->repetition_penalty, 0, 100) ||
                !finite_in(p->presence_penalty, -100, 100) ||
                !finite_in(p->frequency_penalty, -100, 100))
                return moe_fail(err, errlen, MOE_ERANGE, "submit.sampling: a penalty is out of range");
            if (p->grammar && strlen(p->grammar) > MOE_IPC_MAX_GRAMMAR)
                return moe_fail(err, errlen, MOE_ERANGE, "submit.sampling.grammar: %zu bytes, at "
                                "most %u", strlen(p->grammar), MOE_IPC_MAX_GRAMMAR);
            if (p->n_bias_token != p->n_bias_value || p->n_bias_token > MOE_IPC_MAX_BIAS)
                return moe_fail(err, errlen, MOE_ERANGE, "submit.sampling: %zu bias tokens, %zu values "
                                "(equal, at most %u)", p->n_bias_token, p->n_bias_value, MOE_IPC_MAX_BIAS);
            for (size_t i = 0; i < p->n_bias_token; i++) {
                if ((rc = check_token(p->bias_token[i], lim, "submit.sampling.bias_token", i, err, errlen)))
                    return rc;
                if (!finite_in(p->bias_value[i], -100, 100))
                    return moe_fail(err, errlen, MOE_ERANGE, "submit.sampling.bias_value[%zu] = %g is "
                                    "outside -100..100", i, (double)p->bias_value[i]);
            }
        }
        if (s->prompt_logprobs && !s->logprobs)
            return moe_fail(err, errlen, MOE_ERANGE, "submit.prompt_logprobs without logprobs");
        if (s->top_logprobs > MOE_IPC_MAX_TOP_LOGPROBS || (s->top_logprobs && !s->logprobs))
            return moe_fail(err, errlen, MOE_ERANGE, "submit.top_logprobs %u: at most %u, and only "
                            "with logprobs", s->top_logprobs, MOE_IPC_MAX_TOP_LOGPROBS);
        return 0;
    }
    case MOED__ENVELOPE__MSG_CANCEL:
        if (env->cancel->id == 0)
            return moe_fail(err, errlen, MOE_ERANGE, "cancel.id is 0");
        return 0;
    case MOED__ENVELOPE__MSG_SET_PLACEMENT: {
        const Moed__SetPlacement *p = env->set_placement;
        if ((rc = check_shape(p->n_layer, p->n_expert, lim, "set_placement", err, errlen)))
            return rc;
        uint64_t need = ((uint64_t)p->n_layer * p->n_expert + 7) / 8;
        if (p->hot.len != need)
            return moe_fail(err, errlen, MOE_ERANGE, "set_placement.hot has %zu bytes, %llu expected",
                            p->hot.len, (unsigned long long)need);
        if (p->n_counts && p->n_counts != (uint64_t)p->n_layer * p->n_expert)
            return moe_fail(err, errlen, MOE_ERANGE, "set_placement.counts has %zu values, %llu "
                            "expected", p->n_counts,
                            (unsigned long long)((uint64_t)p->n_layer * p->n_expert));
        return 0;
    }
    case MOED__ENVELOPE__MSG_EXPERT_READY: {
        const Moed__ExpertReady *x = env->expert_ready;
        if ((lim->n_layer && x->layer >= lim->n_layer) || (lim->n_expert && x->expert >= lim->n_expert))
            return moe_fail(err, errlen, MOE_ERANGE, "expert_ready: expert (%u, %u) does not exist",
                            x->layer, x->expert);
        if (x->error && strlen(x->error) >= MOE_IPC_MAX_TEXT)
            return moe_fail(err, errlen, MOE_ERANGE, "expert_ready: error message too long");
        return 0;
    }
    case MOED__ENVELOPE__MSG_SHUTDOWN:
        return 0;
    default:
        return moe_fail(err, errlen, MOE_EFORMAT, "a %s message cannot come from the daemon",
                        moe_ipc_msg_name(env->msg_case));
    }
}

/* Done.signature: empty, or one count per layer and expert of the model, none above the prompt
 * tokens the worker evaluated (a token chooses an expert at most once per layer). */
static int check_signature(const Moed__Done *d, const struct moe_ipc_limits *lim, char *err,
                           size_t errlen)
{
    if (!d->n_signature)
        return 0;
    const uint64_t want = (uint64_t)lim->n_layer * lim->n_expert;
    if (!want || d->n_signature != want)
        return moe_fail(err, errlen, MOE_ERANGE, "done.signature has %zu counts, %u x %u expected",
                        d->n_signature, lim->n_layer, lim->n_expert);
    if (d->n_cached > d->n_prompt)
        return moe_fail(err, errlen, MOE_ERANGE, "done.n_cached %u is over n_prompt %u",
                        d->n_cached, d->n_prompt);
    const uint32_t evaluated = d->n_prompt - d->n_cached;
    for (size_t i = 0; i < d->n_signature; i++)
        if (d->signature[i] > evaluated)
            return moe_fail(err, errlen, MOE_ERANGE, "done.signature[%zu] = %u is over the %u prompt "
                            "tokens evaluated", i, d->signature[i], evaluated);
    return 0;
}

/* An [n_layer][n_expert] bitmap (LSB first): empty, or exactly the model's bits with the padding
 * of the last byte clear. */
static int check_bitmap(const uint8_t *bits, size_t len, const struct moe_ipc_limits *lim,
                        const char *field, char *err, size_t errlen)
{
    if (!len)
        return 0;
    const uint64_t n = (uint64_t)lim->n_layer * lim->n_expert;
    if (!n || len != (n + 7) / 8)
        return moe_fail(err, errlen, MOE_ERANGE, "%s has %zu bytes, %llu expected (%u x %u bits)",
                        field, len, (unsigned long long)((n + 7) / 8), lim->n_layer, lim->n_expert);
    if (n % 8 && (bits[len - 1] >> (n % 8)))
        return moe_fail(err, errlen, MOE_ERANGE, "%s sets bits past the last expert", field);
    return 0;
}

static int validate_from_worker(const Moed__Envelope *env, const struct moe_ipc_limits *lim,
                                char *err, size_t errlen)
{
    int rc;
    switch (env->msg_case) {
    case MOED__ENVELOPE__MSG_READY: {
        const Moed__Ready *r = env->ready;
        if (r->protocol_version != MOE_IPC_PROTOCOL_VERSION)
            return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                            "ready.protocol_version %u, this build speaks %u", r->protocol_version,
                            MOE_IPC_PROTOCOL_VERSION);
        if (r->n_seq < 1 || r->n_seq > MOE_IPC_MAX_SEQ || r->n_ctx < 1 || r->n_ctx > MOE_IPC_MAX_CTX)
            return moe_fail(err, errlen, MOE_ERANGE, "ready: n_seq %u / n_ctx %u out of range",
                            r->n_seq, r->n_ctx);
        if (r->n_vocab == 0 || (lim->n_vocab && r->n_vocab != lim->n_vocab))
            return moe_fail(err, errlen, MOE_ERANGE, "ready.n_vocab %u, the model has %u",
                            r->n_vocab, lim->n_vocab);
        return check_shape(r->n_layer, r->n_expert, lim, "ready", err, errlen);
    }
    case MOED__ENVELOPE__MSG_TOKEN:
        if (env->token->id == 0)
            return moe_fail(err, errlen, MOE_ERANGE, "token.id is 0");
        if ((rc = check_token(env->token->token, lim, "token.token", 0, err, errlen)))
            return rc;
        if (env->token->n_top_token != env->token->n_top_logprob ||
            env->token->n_top_token > MOE_IPC_MAX_TOP_LOGPROBS ||
            (env->token->n_top_token && !env->token->has_logprob))
            return moe_fail(err, errlen, MOE_ERANGE, "token: %zu top tokens, %zu top logprobs "
                            "(equal, at most %u, only with has_logprob)", env->token->n_top_token,
                            env->token->n_top_logprob, MOE_IPC_MAX_TOP_LOGPROBS);
        for (size_t i = 0; i < env->token->n_top_token; i++)
            if ((rc = check_token(env->token->top_token[i], lim, "token.top_token", i, err, errlen)))
                return rc;
        if (env->token->prompt && (!env->token->has_logprob || env->token->prompt_pos < 1 ||
                                   (lim->n_ctx && env->token->prompt_pos >= lim->n_ctx)))
            return moe_fail(err, errlen, MOE_ERANGE, "token: prompt position %u (1..n_ctx - 1, with "
                            "has_logprob)", env->token->prompt_pos);
        return 0;
    case MOED__ENVELOPE__MSG_DONE: {
        const Moed__Done *d = env->done;
        if (d->id == 0)
            return moe_fail(err, errlen, MOE_ERANGE, "done.id is 0");
        if (d->reason != MOED__FINISH_REASON__FINISH_STOP &&
            d->reason != MOED__FINISH_REASON__FINISH_LENGTH)
            return moe_fail(err, errlen, MOE_ERANGE, "done.reason %d is unknown", (int)d->reason);
        return check_signature(d, lim, err, errlen);
    }
    case MOED__ENVELOPE__MSG_ERROR:
        if (env->error->message && strlen(env->error->message) >= MOE_IPC_MAX_TEXT)
            return moe_fail(err, errlen, MOE_ERANGE, "error.message is over %u bytes", MOE_IPC_MAX_TEXT);
        return 0;
    case MOED__ENVELOPE__MSG_ROUTING_STATS: {
        const Moed__RoutingStats *s = env->routing_stats;
        if ((rc = check_shape(s->n_layer, s->n_expert, lim, "routing_stats", err, errlen)))
            return rc;
        if (s->n_counts != (size_t)s->n_layer * s->n_expert)
            return moe_fail(err, errlen, MOE_ERANGE, "routing_stats.counts has %zu entries, %u x %u expected",
                            s->n_counts, s->n_layer, s->n_expert);
        return 0;
    }
    case MOED__ENVELOPE__MSG_METRICS:
        if (!isfinite(env->metrics->decode_tokens_per_s) || env->metrics->decode_tokens_per_s < 0 ||
            env->metrics->running > MOE_IPC_MAX_SEQ)
            return moe_fail(err, errlen, MOE_ERANGE, "metrics: a value is out of range");
        return check_bitmap(env->metrics->hot.data, env->metrics->hot.len, lim, "metrics.hot", err,
                            errlen);
    case MOED__ENVELOPE__MSG_HEARTBEAT:
        if (env->heartbeat->running > MOE_IPC_MAX_SEQ)
            return moe_fail(err, errlen, MOE_ERANGE, "heartbeat: running is out of range");
        return 0;
    case MOED__ENVELOPE__MSG_EXPERT_REQUEST: {
        const Moed__ExpertRequest *x = env->expert_request;
        if ((lim->n_layer && x->layer >= lim->n_layer) || (lim->n_expert && x->expert >= lim->n_expert))
            return moe_fail(err, errlen, MOE_ERANGE, "expert_request: expert (%u, %u) does not exist",
                            x->layer, x->expert);
        return 0;
    }
    default:
        return moe_fail(err, errlen, MOE_EFORMAT, "a %s message cannot come from a worker",
                        moe_ipc_msg_name(env->msg_case));
    }
}

int moe_ipc_validate(const Moed__Envelope *env, enum moe_ipc_from from,
                     const struct moe_ipc_limits *lim, char *err, size_t errlen)
{
    static const struct moe_ipc_limits none;
    if (!lim)
        lim = &none;
    /* protobuf-c leaves a sub-message pointer NULL only if we built the Envelope by hand; decoded
     * ones always have it, but the check costs nothing and keeps the switch below safe. */
    if (env->msg_case != MOED__ENVELOPE__MSG__NOT_SET && !env->hello)
        return moe_fail(err, errlen, MOE_EFORMAT, "%s message is missing", moe_ipc_msg_name(env->msg_case));
    return from == MOE_IPC_FROM_DAEMON ? validate_from_daemon(env, lim, err, errlen)
                                       : validate_from_worker(env, lim, err, errlen);
}

/* ---------------------------------------------------------------------------------------------
 * Reassembly */

void moe_ipc_reader_init(struct moe_ipc_reader *r, uint32_t max_frame)
{
    memset(r, 0, sizeof *r);
    r->max_frame = max_frame ? max_frame : MOE_IPC_MAX_FRAME;
}

void moe_ipc_reader_free(struct moe_ipc_reader *r)
{
    free(r->buf);
    memset(r, 0, sizeof *r);
}

size_t moe_ipc_reader_pending(const struct moe_ipc_reader *r)
{
    return r->len;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int reader_append(struct moe_ipc_reader *r, const uint8_t *p, size_t n, char *err, size_t errlen)
{
    if (r->len + n > r->cap) {
        size_t cap = r->cap ? r->cap : 4096;
        while (cap < r->len + n)
            cap *= 2;
        uint8_t *b = realloc(r->buf, cap);
        if (!b)
            return moe_fail(err, errlen, -ENOMEM, "out of memory buffering a frame");
        r->buf = b;
        r->cap = cap;
    }
    memcpy(r->buf + r->len, p, n);
    r->len += n;
    return 0;
}

int moe_ipc_reader_feed(struct moe_ipc_reader *r, const void *data, size_t n, moe_ipc_frame_fn fn,
                        void *user, char *err, size_t errlen)
{
    const uint8_t *p = data;
    int rc;
    /* Frames that arrive whole are handed over straight from the caller's buffer; only a frame
     * split across reads is copied, and only up to the announced length, which is checked
     * against the limit before anything of it is buffered. */
    while (n > 0) {
        if (r->len < MOE_IPC_HEADER) {
            size_t take = MOE_IPC_HEADER - r->len;
            if (r->len == 0 && n >= MOE_IPC_HEADER) {
                uint32_t flen = le32(p);
                if (flen > r->max_frame)
                    return moe_fail(err, errlen, MOE_ETOOBIG,
                                    "frame header announces %u bytes, the limit is %u", flen, r->max_frame);
                if (n - MOE_IPC_HEADER >= flen) {
                    if ((rc = fn(user, p + MOE_IPC_HEADER, flen)))
                        return rc;
                    p += MOE_IPC_HEADER + flen;
                    n -= MOE_IPC_HEADER + flen;
                    continue;
                }
            }
            if (take > n)
                take = n;
            if ((rc = reader_append(r, p, take, err, errlen)))
                return rc;
            p += take;
            n -= take;
            if (r->len < MOE_IPC_HEADER)
                return 0;
            if (le32(r->buf) > r->max_frame)
                return moe_fail(err, errlen, MOE_ETOOBIG,
                                "frame header announces %u bytes, the limit is %u", le32(r->buf), r->max_frame);
        }
        uint32_t flen = le32(r->buf);
        size_t have = r->len - MOE_IPC_HEADER;
        size_t take = flen - have < n ? flen - have : n;
        if (take && (rc = reader_append(r, p, take, err, errlen)))
            return rc;
        p += take;
        n -= take;
        if (r->len - MOE_IPC_HEADER < flen)
            return 0;
        r->len = 0; /* before fn, so that the reader is consistent if fn feeds again */
        if ((rc = fn(user, r->buf + MOE_IPC_HEADER, flen)))
            return rc;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Connections */

struct moe_ipc_conn {
    uv_pipe_t pipe;
    struct moe_ipc_reader rd;
    struct moe_ipc_limits lim;
    enum moe_ipc_from peer;
    uint32_t max_frame;
    struct moe_ipc_conn_cb cb;
    void *user;
    char name[48];
    size_t queued;
    bool closing;     /* no more reads are delivered, no more sends accepted */
    bool handle_closed_requested;
    bool in_read;
    int close_reason;
    char close_msg[256];
    char rbuf[65536];
};

struct conn_write {
    uv_write_t req;
    struct moe_ipc_conn *c;
    size_t len;
    uint8_t *data;
};

static void conn_closed_cb(uv_handle_t *h)
{
    struct moe_ipc_conn *c = h->data;
    if (c->cb.on_close)
        c->cb.on_close(c, c->user, c->close_reason, c->close_msg);
    moe_ipc_reader_free(&c->rd);
    free(c);
}

static void conn_close_handle(struct moe_ipc_conn *c)
{
    if (c->handle_closed_requested)
        return;
    c->handle_closed_requested = true;
    uv_read_stop((uv_stream_t *)&c->pipe);
    uv_close((uv_handle_t *)&c->pipe, conn_closed_cb);
}

/* Records why the connection ends (the first reason wins) and starts closing. */
static void conn_fail(struct moe_ipc_conn *c, int reason, const char *msg)
{
    if (!c->closing) {
        c->closing = true;
        c->close_reason = reason;
        snprintf(c->close_msg, sizeof c->close_msg, "%s", msg ? msg : "");
        if (reason != UV_EOF && reason != 0)
            moe_ipc_log(MOE_LOG_ERROR, "%s: %s; closing the connection", c->name, c->close_msg);
    }
    conn_close_handle(c);
}

static void conn_shutdown_cb(uv_shutdown_t *req, int status)
{
    struct moe_ipc_conn *c = req->data;
    (void)status;
    free(req);
    conn_close_handle(c);
}

void moe_ipc_conn_close(struct moe_ipc_conn *c, bool flush)
{
    if (!c || c->handle_closed_requested)
        return;
    bool was_closing = c->closing;
    if (!c->closing) {
        c->closing = true;
        c->close_reason = 0;
        snprintf(c->close_msg, sizeof c->close_msg, "closed locally");
    }
    uv_read_stop((uv_stream_t *)&c->pipe);
    if (flush && !was_closing && c->queued > 0) {
        uv_shutdown_t *req = malloc(sizeof *req);
        if (req) {
            req->data = c;
            if (uv_shutdown(req, (uv_stream_t *)&c->pipe, conn_shutdown_cb) == 0)
                return;
            free(req);
        }
    }
    conn_close_handle(c);
}

static int conn_on_frame(void *user, const uint8_t *body, size_t len)
{
    struct moe_ipc_conn *c = user;
    char msg[256];
    Moed__Envelope *env = NULL;
    if (c->closing)
        return MOE_ECANCELED;
    int rc = moe_ipc_decode(body, len, &env, msg, sizeof msg);
    if (rc == 0)
        rc = moe_ipc_validate(env, c->peer, &c->lim, msg, sizeof msg);
    if (rc == 0 && c->cb.on_msg)
        rc = c->cb.on_msg(c, c->user, env, msg, sizeof msg);
    if (rc != 0 && rc != MOE_ECANCELED) {
        char why[320];
        snprintf(why, sizeof why, "rejected %s frame: %s", env ? moe_ipc_msg_name(env->msg_case) : "a",
                 msg);
        conn_fail(c, rc, why);
    }
    moe_ipc_free(env);
    /* A callback may have closed the connection; stop delivering the rest of this read. */
    return c->closing ? MOE_ECANCELED : 0;
}

static void conn_alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    struct moe_ipc_conn *c = h->data;
    (void)suggested;
    buf->base = c->rbuf;
    buf->len = sizeof c->rbuf;
}

static void conn_read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    struct moe_ipc_conn *c = s->data;
    char msg[256];
    if (c->closing)
        return;
    if (nread > 0) {
        int rc = moe_ipc_reader_feed(&c->rd, buf->base, (size_t)nread, conn_on_frame, c, msg, sizeof msg);
        if (rc != 0 && !c->closing) {
            char why[320];
            snprintf(why, sizeof why, "rejected frame: %s", msg);
            conn_fail(c, rc, why);
        }
        return;
    }
    if (nread == 0)
        return;
    if (nread == UV_EOF) {
        size_t pend = moe_ipc_reader_pending(&c->rd);
        if (pend) {
            snprintf(msg, sizeof msg, "truncated frame: peer closed after %zu bytes of a frame", pend);
            conn_fail(c, MOE_EFORMAT, msg);
        } else {
            conn_fail(c, UV_EOF, "peer closed the connection");
        }
        return;
    }
    snprintf(msg, sizeof msg, "read error: %s", uv_strerror((int)nread));
    conn_fail(c, (int)nread, msg);
}

int moe_ipc_conn_open(struct moe_ipc_conn **out, uv_loop_t *loop, int fd, enum moe_ipc_from peer,
                      const struct moe_ipc_limits *lim, uint32_t max_frame, const char *name,
                      const struct moe_ipc_conn_cb *cb, void *user, char *err, size_t errlen)
{
    struct moe_ipc_conn *c = calloc(1, sizeof *c);
    if (!c)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    c->peer = peer;
    c->max_frame = max_frame ? max_frame : MOE_IPC_MAX_FRAME;
    if (lim)
        c->lim = *lim;
    c->cb = *cb;
    c->user = user;
    snprintf(c->name, sizeof c->name, "%s", name ? name : "ipc");
    moe_ipc_reader_init(&c->rd, c->max_frame);
    int rc = uv_pipe_init(loop, &c->pipe, 0);
    if (rc) {
        close(fd);
        free(c);
        return moe_fail(err, errlen, rc, "uv_pipe_init: %s", uv_strerror(rc));
    }
    c->pipe.data = c;
    c->cb.on_close = NULL; /* nothing to report until the connection is up */
    c->handle_closed_requested = c->closing = true;
    rc = uv_pipe_open(&c->pipe, fd);
    if (rc) {
        close(fd);
        uv_close((uv_handle_t *)&c->pipe, conn_closed_cb);
        return moe_fail(err, errlen, rc, "%s: cannot use fd %d: %s", c->name, fd, uv_strerror(rc));
    }
    rc = uv_read_start((uv_stream_t *)&c->pipe, conn_alloc_cb, conn_read_cb);
    if (rc) {
        uv_close((uv_handle_t *)&c->pipe, conn_closed_cb); /* closes fd too */
        return moe_fail(err, errlen, rc, "%s: cannot read fd %d: %s", c->name, fd, uv_strerror(rc));
    }
    c->cb.on_close = cb->on_close;
    c->handle_closed_requested = c->closing = false;
    *out = c;
    return 0;
}

void moe_ipc_conn_set_limits(struct moe_ipc_conn *c, const struct moe_ipc_limits *lim)
{
    c->lim = *lim;
}

size_t moe_ipc_conn_queued(const struct moe_ipc_conn *c)
{
    return c->queued;
}

static void conn_write_cb(uv_write_t *req, int status)
{
    struct conn_write *w = (struct conn_write *)req;
    struct moe_ipc_conn *c = w->c;
    c->queued -= w->len;
    free(w->data);
    free(w);
    if (status < 0 && status != UV_ECANCELED) {
        char msg[128];
        snprintf(msg, sizeof msg, "write error: %s", uv_strerror(status));
        conn_fail(c, status, msg);
    }
}

int moe_ipc_conn_send(struct moe_ipc_conn *c, const Moed__Envelope *env)
{
    char msg[256];
    if (c->closing)
        return -EPIPE;
    struct conn_write *w = calloc(1, sizeof *w);
    if (!w)
        return -ENOMEM;
    int rc = moe_ipc_encode(env, c->max_frame, &w->data, &w->len, msg, sizeof msg);
    if (rc) {
        free(w);
        moe_ipc_log(MOE_LOG_ERROR, "%s: not sending: %s", c->name, msg);
        return rc;
    }
    w->c = c;
    uv_buf_t b = uv_buf_init((char *)w->data, (unsigned)w->len);
    rc = uv_write(&w->req, (uv_stream_t *)&c->pipe, &b, 1, conn_write_cb);
    if (rc) {
        free(w->data);
        free(w);
        return rc;
    }
    c->queued += w->len;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Blocking frame I/O with a descriptor attached */

int moe_ipc_send_with_fd(int sock, const Moed__Envelope *env, int fd_pass, uint32_t max_frame,
                         char *err, size_t errlen)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = moe_ipc_encode(env, max_frame, &buf, &len, err, errlen);
    if (rc)
        return rc;
    size_t off = 0;
    while (off < len) {
        struct iovec iov = {buf + off, len - off};
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int))];
        } ctl;
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        /* The descriptor rides on the first byte; a partial write sends the rest without it. */
        if (off == 0 && fd_pass >= 0) {
            memset(&ctl, 0, sizeof ctl);
            mh.msg_control = ctl.b;
            mh.msg_controllen = sizeof ctl.b;
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &fd_pass, sizeof(int));
        }
        ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct pollfd p = {.fd = sock, .events = POLLOUT};
                poll(&p, 1, 1000);
                continue;
            }
            rc = -errno;
            moe_fail(err, errlen, rc, "sendmsg: %s", strerror(errno));
            goto out;
        }
        off += (size_t)n;
    }
out:
    free(buf);
    return rc;
}

static long long now_ms(void)
{
    return (long long)(moe_now_s() * 1000.0);
}

/* Reads exactly n bytes (or fails), collecting a passed descriptor if one comes along. */
static int recv_exact(int sock, uint8_t *p, size_t n, long long deadline, int *fd_out, size_t *got,
                      char *err, size_t errlen)
{
    *got = 0;
    while (*got < n) {
        if (deadline >= 0) {
            long long left = deadline - now_ms();
            if (left <= 0)
                return moe_fail(err, errlen, -ETIMEDOUT, "timed out waiting for a frame");
            struct pollfd pf = {.fd = sock, .events = POLLIN};
            int pr = poll(&pf, 1, (int)(left > 1000000 ? 1000000 : left));
            if (pr < 0 && errno != EINTR)
                return moe_fail(err, errlen, -errno, "poll: %s", strerror(errno));
            if (pr <= 0)
                continue;
        }
        struct iovec iov = {p + *got, n - *got};
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int) * 4)];
        } ctl;
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
                            .msg_controllen = sizeof ctl.b};
        ssize_t r = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return moe_fail(err, errlen, -errno, "recvmsg: %s", strerror(errno));
        }
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
                continue;
            size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < nfd; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
                /* Keep the first descriptor; any extra one is not ours to hold. */
                if (*fd_out < 0)
                    *fd_out = fd;
                else
                    close(fd);
            }
        }
        if (r == 0)
            return UV_EOF;
        *got += (size_t)r;
    }
    return 0;
}

int moe_ipc_recv_with_fd(int sock, uint32_t max_frame, int timeout_ms, Moed__Envelope **out,
                         int *fd_out, char *err, size_t errlen)
{
    if (!max_frame)
        max_frame = MOE_IPC_MAX_FRAME;
    long long deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    uint8_t hdr[MOE_IPC_HEADER];
    uint8_t *body = NULL;
    size_t got;
    int fd = -1;
    int rc = recv_exact(sock, hdr, sizeof hdr, deadline, &fd, &got, err, errlen);
    if (rc == UV_EOF) {
        if (got == 0)
            moe_fail(err, errlen, UV_EOF, "peer closed the connection before sending a frame");
        else
            rc = moe_fail(err, errlen, MOE_EFORMAT, "truncated frame: peer closed after %zu header bytes",
                          got);
    }
    if (rc)
        goto fail;
    uint32_t flen = le32(hdr);
    if (flen > max_frame) {
        rc = moe_fail(err, errlen, MOE_ETOOBIG, "frame header announces %u bytes, the limit is %u",
                      flen, max_frame);
        goto fail;
    }
    body = malloc(flen ? flen : 1);
    if (!body) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory for a %u byte frame", flen);
        goto fail;
    }
    rc = recv_exact(sock, body, flen, deadline, &fd, &got, err, errlen);
    if (rc == UV_EOF)
        rc = moe_fail(err, errlen, MOE_EFORMAT, "truncated frame: peer closed after %zu of %u bytes",
                      got, flen);
    if (rc)
        goto fail;
    rc = moe_ipc_decode(body, flen, out, err, errlen);
    if (rc)
        goto fail;
    free(body);
    *fd_out = fd;
    return 0;
fail:
    free(body);
    if (fd >= 0)
        close(fd);
    return rc;
}
