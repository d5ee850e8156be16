/* The client API: OpenAI-compatible endpoints, health, metrics and the admin endpoints, on top of
 * the HTTP server (daemon/http.h) and the scheduler (daemon/sched.h).
 *
 *   POST /v1/completions, POST /v1/chat/completions (stream: true gives SSE), GET /v1/models,
 *   GET /health, GET /metrics, GET /admin/status, GET|PUT|DELETE /admin/profile,
 *   GET /admin/placement.
 *
 * The API tokenizes prompts, renders chat templates, validates every field, cuts the text at stop
 * strings (holding back text that could start one while streaming) and detokenizes without ever
 * splitting a UTF-8 sequence; the scheduler deals only in token ids. Bad input gets
 * {"error": {"message", "type", "code", "param"}} with a 4xx status and nothing else happens.
 * /admin/... is served only on the Unix socket to peers that are root, the daemon's own user or
 * members of its admin group (SO_PEERCRED); everyone else gets 403. */
#ifndef MOED_API_H
#define MOED_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/chat.h"
#include "daemon/http.h"
#include "daemon/sched.h"
#include "store/tokenizer.h"

struct api;

struct api_model_info {
    const char *id;             /* model name shown in /v1/models and responses (copied) */
    const char *arch;           /* "qwen3moe" (copied) */
    uint32_t n_ctx;             /* context per sequence: prompt + generated tokens */
    uint32_t n_vocab, n_layer, n_expert, n_expert_used;
    uint64_t fingerprint;
    uint64_t bytes_dense, bytes_experts;
    uint32_t n_slots;           /* sequences served at once: workers x parallel (/props) */
};

/* Hooks into the rest of the daemon for the admin endpoints and extra metrics. Any may be NULL
 * (the endpoint then answers 501). Text results are malloc'd JSON that the API frees. Errors
 * return a MOE_E* code and fill err: MOE_EFORMAT/MOE_ETYPE/MOE_ERANGE become 400, MOE_ENOTFOUND
 * 404, anything else 500. */
struct api_hooks {
    /* Extra members for /admin/status (workers, store, profile), as a JSON object text. */
    int (*status)(void *user, char **json, char *err, size_t errlen);
    int (*profile_export)(void *user, char **json, char *err, size_t errlen);
    int (*profile_import)(void *user, const char *json, size_t len, char *err, size_t errlen);
    int (*profile_reset)(void *user, char *err, size_t errlen);
    int (*placement)(void *user, char **json, char *err, size_t errlen);
    /* Extra Prometheus lines appended to /metrics (malloc'd text). */
    int (*metrics)(void *user, char **text);
    void *user;
};

/* A request's sampling defaults. */
struct api_sampling_defaults {
    float temperature, top_p, min_p, repetition_penalty;
    int32_t top_k;
    bool set;
    const char *source;              /* where they come from, for /props and the log (static) */
};

struct api_opts {
    const struct moe_tokenizer *tok; /* NULL: generation endpoints answer 503 */
    struct sched *sched;             /* NULL: generation endpoints answer 503 (set later) */
    struct api_model_info model;
    uid_t admin_uid;                 /* the daemon's own uid (besides root) */
    gid_t admin_gid;                 /* members of this group may use /admin/... */
    bool have_admin_gid;
    uint32_t max_tokens_default;     /* when a request gives none; 0: up to the context */
    const char *api_key;             /* TCP requests must send "Authorization: Bearer KEY";
                                        NULL: none (the Unix socket never needs one) */
    struct api_hooks hooks;
    uv_loop_t *loop;                 /* prompts are tokenized on its thread pool (the event loop
                                        never waits for a long prompt); NULL: inline */
    const char *chat_template;       /* Jinja text that replaces the model's chat template
                                        (--chat-template); NULL: the model's, else ChatML */
    /* What a request that gives no temperature, top_p, top_k, min_p or repetition penalty
     * gets; not set: OpenAI's defaults (temperature 1, top_p 1, no top_k, min_p or penalty). */
    struct api_sampling_defaults sampling;
};

/* Returns 0, -ENOMEM, or MOE_EFORMAT for a chat_template that does not parse (message in err).
 * A model whose own chat template does not parse still gets an API: its chat requests answer
 * 501 with the template's error; a model without one gets built-in ChatML. */
int api_new(struct api **out, const struct api_opts *o, char *err, size_t errlen);
/* Cancels every generation still running (their connections get an error) and frees. */
void api_free(struct api *a);

/* The http_handler_fn to pass to http_server_new (user = the api). */
void api_handle(void *api, struct http_request *req);

/* Counts a response the HTTP server sent on its own (http_server_on_status's callback). */
void api_count_status(void *api, int status);

void api_set_sched(struct api *a, struct sched *s);
/* Ready: workers are up (GET /health answers 200 {"status":"ok"}; before: 503 "loading"). */
void api_set_ready(struct api *a, bool ready);
/* Progress of the expert store's build, shown by GET /health while loading (any thread). */
void api_set_loading(struct api *a, uint64_t done, uint64_t total);
/* Draining: new generation requests answer 503; /health answers 503 "stopping". */
void api_set_draining(struct api *a, bool draining);

/* Adds routing count deltas ([n_layer][n_expert]) for /metrics. Ignored if the shape differs. */
void api_add_routing(struct api *a, const uint64_t *counts, uint32_t n_layer, uint32_t n_expert,
                     uint64_t n_tokens);

/* Generations in flight (submitted, not finished). */
uint32_t api_inflight(const struct api *a);

/* Whether this peer may use /admin/... (exposed for tests). */
bool api_peer_is_admin(const struct api *a, const struct http_peer *p);

/* Stop-string helpers (exposed for tests). Finds the earliest occurrence of any stop string in
 * text[from_hint-?, len): returns its offset or -1. */
long api_find_stop(const char *text, size_t len, size_t from, char *const *stops, size_t n_stops);
/* Length of the longest suffix of text[0..len) that is a proper prefix of some stop string:
 * those bytes must be held back while streaming. */
size_t api_stop_holdback(const char *text, size_t len, char *const *stops, size_t n_stops);

#endif
