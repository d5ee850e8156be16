/* moed configuration: defaults < config file < command line. See config.h. */
#include "daemon/config.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/socket.h>

#include "daemon/devices.h"
#include "daemon/http.h"
#include "daemon/tier.h"
#include "store/err.h"
#include "store/units.h"

/* K_DEVICES: a string, checked to be cpu, auto or a list of GPU indexes. */
/* K_FLOAT: a decimal number (a double) in [min/1000, max/1000]. */
enum kind { K_STR, K_DEVICES, K_U32, K_SIZE, K_LEVEL, K_SHARE, K_CACHE, K_VRAM, K_FLOAT, K_CHOICE };

struct key {
    const char *name;
    enum kind kind;
    size_t off;
    const char *arg, *help;
    /* K_U32 and K_SIZE: the values that make sense; a value given outside them is refused
     * (the zero that some fields hold by default only means "not set" when nothing was given). */
    uint64_t min, max;
};

/* K_CHOICE: the words the value may be, the list choices[max] (NULL-terminated); the field (an
 * int) gets the index of the one given. */
enum { CHOICE_POOL_IO, CHOICE_AUTO_ON_OFF };
static const char *const *const choices[] = {
    [CHOICE_POOL_IO] = (const char *const[]){"auto", "direct", "buffered", NULL},
    [CHOICE_AUTO_ON_OFF] = (const char *const[]){"auto", "on", "off", NULL},
};

/* moed-worker refuses a thread count outside this (its own --threads), the Hello a context
 * over MOE_IPC_MAX_CTX. */
#define MAX_THREADS 1024u
#define MAX_CTX (1u << 24)
#define MAX_WORKERS 64u
#define MAX_PARALLEL 256u
#define DAY_S 86400u

_Static_assert(CONFIG_GPUS_MAX == DEVICES_MAX, "one GPU index range");
_Static_assert(MOED_TIER_IO_AUTO == 0 && MOED_TIER_IO_DIRECT == 1 && MOED_TIER_IO_BUFFERED == 2,
               "--pool-io's modes in order");
_Static_assert(CONFIG_AUTO == 0 && CONFIG_ON == 1 && CONFIG_OFF == 2, "auto, on, off in order");

#define F(field) offsetof(struct moed_config, field)
static const struct key keys[] = {
    {"model", K_STR, F(model), "PATH", "GGUF model to serve (required)", 0, 0},
    {"socket", K_STR, F(socket), "PATH", "Unix socket (default " MOED_DEFAULT_SOCKET ")", 0, 0},
    {"listen", K_STR, F(listen), "HOST:PORT", "also listen on loopback TCP (127.0.0.1:PORT)", 0, 0},
    {"state-dir", K_STR, F(state_dir), "DIR", "profile database (default " MOED_DEFAULT_STATE_DIR ")", 0, 0},
    {"devices", K_DEVICES, F(devices), "LIST", "cpu | auto (what moed-worker --list-devices lists) | workers' devices like 0,1 or cpu,cuda:0 (GPU indexes 0..63; default auto)", 0, 0},
    {"workers", K_U32, F(workers), "N", "worker processes (default: one per device, 1 for cpu)", 1, MAX_WORKERS},
    {"ctx", K_U32, F(ctx), "N", "context length per sequence (0 or default: model's, at most 4096)", 0, MAX_CTX},
    {"parallel", K_U32, F(parallel), "N", "concurrent sequences per worker (default 4)", 1, MAX_PARALLEL},
    {"threads", K_U32, F(threads), "N", "compute threads per worker (0 or default: cores / workers)", 0, MAX_THREADS},
    {"vram-budget", K_VRAM, F(vram_budget), "SIZE", "VRAM per GPU worker, e.g. 24G or auto (its memory minus a margin), or per GPU like cuda:0=40G,cuda:1=20G (0 or default: no budget)", 0, UINT64_MAX},
    {"expert-residency", K_SHARE, F(expert_residency), "SHARE", "GPU workers: share of each layer's experts in VRAM, e.g. 60% (default: as the budget allows)", 0, 0},
    {"ram-budget", K_STR, F(ram_budget), "SIZE|P%|auto", "host RAM for experts: bytes, a share of the expert bytes (50%) or auto (3/4 of MemAvailable less the dense weights); below all experts the store keeps a pool and CPU workers ask for missing experts (default: every expert)", 0, 0},
    {"pool-prefetch", K_U32, F(pool_prefetch), "N", "with --ram-budget: read-aheads of the experts CPU workers predict for their next layer, at most N reads at a time (0: off; default 8)", 0, 1024},
    {"pool-io", K_CHOICE, F(pool_io), "MODE", "with --ram-budget: how experts are read from the GGUF: auto (O_DIRECT where the file system takes it, else buffered), direct or buffered (default auto)", 0, CHOICE_POOL_IO},
    {"cache-slots", K_CACHE, F(cache_slots), "N", "GPU workers: per-layer expert slots kept as a cache: auto, off or a count (default auto)", 0, 0},
    {"route-signatures", K_CHOICE, F(route_signatures), "WHEN", "workers send each request's routing signature, which places requests and complementary hot sets over several GPU workers: auto (with 2 or more GPU workers), on or off (default auto)", 0, CHOICE_AUTO_ON_OFF},
    {"config", K_STR, F(config_file), "FILE", "config file with the same keys (key = value)", 0, 0},
    {"log-level", K_LEVEL, F(log_level), "LEVEL", "error | warn | info | debug (default info)", 0, 0},
    {"log-file", K_STR, F(log_file), "PATH", "log to a file instead of stderr (SIGHUP reopens)", 0, 0},
    {"admin-group", K_STR, F(admin_group), "NAME", "group allowed on /admin/* (default moed-admin)", 0, 0},
    {"api-key-file", K_STR, F(api_key_file), "FILE", "the API key TCP clients must send (required with --listen)", 0, 0},
    {"model-alias", K_STR, F(model_alias), "NAME", "the model id served in /v1/models and required in requests' 'model' (default: the GGUF's file name without .gguf)", 0, 0},
    {"chat-template", K_STR, F(chat_template), "FILE", "Jinja chat template to use instead of the model's tokenizer.chat_template", 0, 0},
    {"worker-bin", K_STR, F(worker_bin), "PATH", "moed-worker program (default: next to moed)", 0, 0},
    {"max-body", K_SIZE, F(max_body), "SIZE", "request body limit (default 8M)", 1024, 1ull << 30},
    {"idle-timeout", K_U32, F(idle_timeout_s), "SECONDS", "close idle connections (default 60)", 1, DAY_S},
    {"profile-interval", K_U32, F(profile_interval_s), "SECONDS", "save routing counts (default 5)", 1, DAY_S},
    {"profile-half-life", K_SIZE, F(profile_half_life), "TOKENS", "routings this many tokens old weigh half (K/M/G suffixes, binary; 0: never; default 10000000)", 0, UINT64_MAX},
    {"queue-max", K_U32, F(queue_max), "N", "requests waiting for a slot (default 256)", 1, 1000000},
    {"temp", K_FLOAT, F(default_temp), "T", "temperature of requests that give none (default: the model's general.sampling.temp, else 1)", 0, 100000},
    {"top-p", K_FLOAT, F(default_top_p), "P", "top_p of requests that give none (default: the model's general.sampling.top_p, else 1)", 1, 1000},
    {"top-k", K_U32, F(default_top_k), "K", "top_k of requests that give none, 0 off (default: the model's general.sampling.top_k, else off)", 0, 1000000},
    {"min-p", K_FLOAT, F(default_min_p), "P", "min_p of requests that give none (default: the model's general.sampling.min_p, else off)", 0, 1000},
    {"repeat-penalty", K_FLOAT, F(default_repeat_penalty), "R", "repetition penalty of requests that give none (default: the model's general.sampling.penalty_repeat, else 1)", 1, 100000},
    {"max-tokens-default", K_U32, F(max_tokens_default), "N",
     "max_tokens when a request gives none (0 or default: up to the context)", 0, MAX_CTX},
    {"max-total-body", K_SIZE, F(max_total_body), "SIZE", "request bodies all connections may hold at once, then 503 (0 or default: max(256M, 4 x max-body))", 0, 1ull << 36},
    {"max-write-queue", K_SIZE, F(max_write_queue), "SIZE", "response bytes queued for a client that does not read before it is dropped (default 4M)", 64 * 1024, 1ull << 30},
    {"max-conns", K_U32, F(max_conns), "N", "connections per listener, then 503 (default 1024)", 1, 1u << 20},
    {"admin-reserve", K_U32, F(admin_reserve), "N", "extra Unix-socket connections for root and moed's user (default 16)", 0, 4096},
    {"worker-silent-timeout", K_U32, F(worker_silent_s), "SECONDS", "a ready worker that sends nothing this long is killed and replaced (default 10)", 1, DAY_S},
    {"worker-stall-timeout", K_U32, F(worker_stall_s), "SECONDS", "a worker whose steps stop this long with requests in flight is killed and replaced (default 300)", 1, DAY_S},
};
#undef F
#define N_KEYS (sizeof keys / sizeof keys[0])

static int dup_into(char **dst, const char *s)
{
    char *d = strdup(s);
    if (!d)
        return -ENOMEM;
    free(*dst);
    *dst = d;
    return 0;
}

int config_init(struct moed_config *c)
{
    memset(c, 0, sizeof *c);
    c->log_level = LOG_LEVEL_INFO;
    c->default_temp = c->default_top_p = c->default_min_p = c->default_repeat_penalty = NAN;
    c->default_top_k = UINT32_MAX; /* unset */
    c->parallel = 4;
    c->max_body = 8u << 20;
    c->idle_timeout_s = 60;
    c->profile_interval_s = 5;
    c->profile_half_life = 10000000;
    c->queue_max = 256;
    c->max_write_queue = 4u << 20;
    c->max_conns = 1024;
    c->admin_reserve = 16;
    c->worker_silent_s = 10;
    c->worker_stall_s = 300;
    c->pool_prefetch = 8;
    if (dup_into(&c->socket, MOED_DEFAULT_SOCKET) || dup_into(&c->state_dir, MOED_DEFAULT_STATE_DIR) ||
        dup_into(&c->devices, "auto") || dup_into(&c->admin_group, "moed-admin")) {
        config_free(c);
        return -ENOMEM;
    }
    return 0;
}

void config_free(struct moed_config *c)
{
    if (c->api_key) {
        memset(c->api_key, 0, strlen(c->api_key));
        free(c->api_key);
        c->api_key = NULL;
    }
    for (size_t i = 0; i < N_KEYS; i++)
        if (keys[i].kind == K_STR || keys[i].kind == K_DEVICES) {
            char **p = (char **)((char *)c + keys[i].off);
            free(*p);
            *p = NULL;
        }
}

int config_parse_size(const char *s, uint64_t *out)
{
    return moe_parse_size(s, out);
}

/* "auto", or a list devices_parse_list accepts ("cpu", "0,1", "cpu,cuda:0"). */
static bool devices_ok(const char *s)
{
    uint32_t n;
    return !strcmp(s, "auto") || devices_parse_list(s, NULL, &n) == 0;
}

/* --vram-budget: "SIZE" for every GPU worker, or a list of "DEV=SIZE" (DEV "K" or "cuda:K") and at
 * most one bare SIZE (the rest): "cuda:0=40G,cuda:1=20G", "24G,1=12G". */
static int parse_vram(struct moed_config *c, const char *value, char *err, size_t errlen)
{
    uint64_t dflt = 0, dev[CONFIG_GPUS_MAX] = {0};
    bool have_dflt = false, set[CONFIG_GPUS_MAX] = {false};
    for (const char *s = value;;) {
        const size_t len = strcspn(s, ",");
        char item[64];
        if (len == 0 || len >= sizeof item)
            return moe_fail(err, errlen, MOE_EFORMAT, "vram-budget: '%s' is not a size, auto or "
                            "a list like cuda:0=40G,cuda:1=20G", value);
        memcpy(item, s, len);
        item[len] = 0;
        char *eq = strchr(item, '=');
        uint64_t v;
        if (eq)
            *eq = 0;
        const char *size = eq ? eq + 1 : item;
        if (!strcmp(size, "auto")) {
            v = MOE_VRAM_AUTO;
        } else {
            int rc = config_parse_size(size, &v);
            if (rc)
                return moe_fail(err, errlen, rc, "vram-budget: '%s' is not a size (bytes, or a "
                                "number with K, M, G or T) or auto", size);
        }
        if (eq) {
            char dn[80];
            snprintf(dn, sizeof dn, "%s%s", strncmp(item, "cuda:", 5) ? "cuda:" : "", item);
            const int k = devices_gpu_index(dn);
            if (k < 0 || k >= CONFIG_GPUS_MAX)
                return moe_fail(err, errlen, MOE_EFORMAT, "vram-budget: '%s' is not a GPU (K or "
                                "cuda:K, K < %d)", item, CONFIG_GPUS_MAX);
            if (set[k])
                return moe_fail(err, errlen, MOE_EFORMAT, "vram-budget: GPU %d given twice", k);
            set[k] = true;
            dev[k] = v;
        } else {
            if (have_dflt)
                return moe_fail(err, errlen, MOE_EFORMAT, "vram-budget: two sizes for every GPU "
                                "in '%s'", value);
            have_dflt = true;
            dflt = v;
        }
        if (!s[len])
            break;
        s += len + 1;
    }
    c->vram_budget = dflt;
    memcpy(c->vram_budget_dev, dev, sizeof dev);
    memcpy(c->vram_budget_set, set, sizeof set);
    return 0;
}


/* 1024 -> "1K", 1 << 30 -> "1G": a limit as the user would write it. */
static const char *size_text(uint64_t v, char *buf, size_t cap)
{
    static const char suffix[] = "KMGT";
    int i = -1;
    while (i < 3 && v >= 1024 && v % 1024 == 0) {
        v /= 1024;
        i++;
    }
    if (i < 0)
        snprintf(buf, cap, "%" PRIu64, v);
    else
        snprintf(buf, cap, "%" PRIu64 "%c", v, suffix[i]);
    return buf;
}

static const struct key *find_key(const char *name)
{
    char norm[64];
    size_t n = strlen(name);
    if (n >= sizeof norm)
        return NULL;
    for (size_t i = 0; i <= n; i++)
        norm[i] = name[i] == '_' ? '-' : (char)tolower((unsigned char)name[i]);
    for (size_t i = 0; i < N_KEYS; i++)
        if (!strcmp(keys[i].name, norm))
            return &keys[i];
    return NULL;
}

int config_set(struct moed_config *c, const char *key, const char *value, char *err, size_t errlen)
{
    const struct key *k = find_key(key);
    if (!k)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "unknown option '%s'", key);
    void *p = (char *)c + k->off;
    switch (k->kind) {
    case K_DEVICES:
        if (!devices_ok(value))
            return moe_fail(err, errlen, MOE_EFORMAT, "devices must be cpu, auto or a list of "
                            "devices like 0,1 or cpu,cuda:0 (GPU indexes in 0..%u, at most %u "
                            "workers), not '%s'", DEVICES_MAX - 1, DEVICES_MAX, value);
        /* fall through */
    case K_STR:
        if (!*value)
            return moe_fail(err, errlen, MOE_EFORMAT, "%s: empty value", k->name);
        return dup_into((char **)p, value) ? moe_fail(err, errlen, -ENOMEM, "out of memory") : 0;
    case K_U32: {
        char *end;
        errno = 0;
        unsigned long long v = isdigit((unsigned char)value[0]) ? strtoull(value, &end, 10) : 0;
        if (!isdigit((unsigned char)value[0]) || *end)
            return moe_fail(err, errlen, MOE_EFORMAT, "%s must be a whole number in %" PRIu64 "..%" PRIu64
                            ", not '%s'", k->name, k->min, k->max, value);
        if (errno == ERANGE || v < k->min || v > k->max)
            return moe_fail(err, errlen, MOE_ERANGE, "%s must be %" PRIu64 "..%" PRIu64 ", not %s",
                            k->name, k->min, k->max, value);
        *(uint32_t *)p = (uint32_t)v;
        return 0;
    }
    case K_SIZE: {
        uint64_t v;
        int rc = config_parse_size(value, &v);
        if (rc)
            return moe_fail(err, errlen, rc,
                            "%s: '%s' is not a size (bytes, or a number with K, M, G or T)",
                            k->name, value);
        if (v < k->min || v > k->max) {
            char lo[32], hi[32];
            return moe_fail(err, errlen, MOE_ERANGE, "%s must be %s..%s, not %s", k->name,
                            size_text(k->min, lo, sizeof lo), size_text(k->max, hi, sizeof hi), value);
        }
        *(uint64_t *)p = v;
        return 0;
    }
    case K_VRAM:
        return parse_vram(c, value, err, errlen);
    case K_FLOAT: {
        char *end;
        errno = 0;
        double v = strtod(value, &end);
        if (end == value || *end || errno || !isfinite(v))
            return moe_fail(err, errlen, MOE_EFORMAT, "%s must be a number, not '%s'", k->name,
                            value);
        if (v < (double)k->min / 1000 || v > (double)k->max / 1000)
            return moe_fail(err, errlen, MOE_ERANGE, "%s must be %g..%g, not %s", k->name,
                            (double)k->min / 1000, (double)k->max / 1000, value);
        *(double *)p = v;
        return 0;
    }
    case K_SHARE: {
        int rc = moe_parse_share(value, (double *)p);
        if (rc)
            return moe_fail(err, errlen, rc, "%s: '%s' is not a share in (0, 1] such as 60%% or 0.6",
                            k->name, value);
        return 0;
    }
    case K_CACHE: {
        char *end;
        errno = 0;
        if (!strcmp(value, "auto")) {
            *(int32_t *)p = 0;
            return 0;
        }
        if (!strcmp(value, "off")) {
            *(int32_t *)p = -1;
            return 0;
        }
        unsigned long long v = isdigit((unsigned char)value[0]) ? strtoull(value, &end, 10) : 0;
        if (!isdigit((unsigned char)value[0]) || *end || errno || v < 1 || v > 65536)
            return moe_fail(err, errlen, MOE_EFORMAT, "%s must be auto, off or 1..65536, not '%s'",
                            k->name, value);
        *(int32_t *)p = (int32_t)v;
        return 0;
    }
    case K_CHOICE: {
        const char *const *ch = choices[k->max];
        char words[128] = "";
        for (int i = 0; ch[i]; i++) {
            if (!strcmp(value, ch[i])) {
                *(int *)p = i;
                return 0;
            }
            snprintf(words + strlen(words), sizeof words - strlen(words), "%s%s",
                     i == 0 ? "" : ch[i + 1] ? ", " : " or ", ch[i]);
        }
        return moe_fail(err, errlen, MOE_EFORMAT, "%s must be %s, not '%s'", k->name, words, value);
    }
    case K_LEVEL:
        if (log_level_parse(value, (enum log_level *)p))
            return moe_fail(err, errlen, MOE_EFORMAT,
                            "%s: '%s' is not one of error, warn, info, debug", k->name, value);
        return 0;
    }
    return MOE_EINTERNAL;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = 0;
    return s;
}

int config_load_file(struct moed_config *c, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return moe_fail(err, errlen, -errno, "config file %s: %s", path, strerror(errno));
    char line[4096];
    int lineno = 0, rc = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            rc = moe_fail(err, errlen, MOE_ETOOBIG, "%s:%d: line too long", path, lineno);
            goto out;
        }
        char *s = trim(line);
        if (!*s || *s == '#' || *s == ';' || *s == '[')
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            rc = moe_fail(err, errlen, MOE_EFORMAT, "%s:%d: expected 'key = value'", path, lineno);
            goto out;
        }
        *eq = 0;
        char *key = trim(s), *val = trim(eq + 1);
        /* A '#' or ';' after whitespace starts a comment, unless the value is quoted. */
        if (*val != '"' && *val != '\'') {
            for (char *p = val + 1; *p; p++)
                if ((*p == '#' || *p == ';') && (p[-1] == ' ' || p[-1] == '\t')) {
                    *p = 0;
                    val = trim(val);
                    break;
                }
        }
        size_t vl = strlen(val);
        if (vl >= 2 && (val[0] == '"' || val[0] == '\'') && val[vl - 1] == val[0]) {
            val[vl - 1] = 0;
            val++;
        }
        if (!strcmp(key, "config"))
            continue;
        char msg[512];
        if ((rc = config_set(c, key, val, msg, sizeof msg)) != 0) {
            moe_fail(err, errlen, rc, "%s:%d: %s", path, lineno, msg);
            goto out;
        }
    }
    if (ferror(f))
        rc = moe_fail(err, errlen, -EIO, "config file %s: read error", path);
out:
    fclose(f);
    return rc;
}

void config_usage(FILE *f)
{
    fprintf(f, "usage: moed --model PATH [options]\n\n"
               "Serves a Mixture-of-Experts GGUF model over HTTP (OpenAI-compatible API) on a Unix\n"
               "socket. Runs in the foreground and logs to stderr.\n\noptions:\n");
    for (size_t i = 0; i < N_KEYS; i++) {
        char left[48];
        snprintf(left, sizeof left, "--%s %s", keys[i].name, keys[i].arg);
        char range[64] = "";
        if (keys[i].kind == K_U32)
            snprintf(range, sizeof range, "; %" PRIu64 "..%" PRIu64, keys[i].min, keys[i].max);
        else if (keys[i].kind == K_FLOAT)
            snprintf(range, sizeof range, "; %g..%g", (double)keys[i].min / 1000,
                     (double)keys[i].max / 1000);
        else if (keys[i].kind == K_SIZE && keys[i].max != UINT64_MAX) {
            char lo[32], hi[32];
            snprintf(range, sizeof range, "; %s..%s", size_text(keys[i].min, lo, sizeof lo),
                     size_text(keys[i].max, hi, sizeof hi));
        }
        fprintf(f, "  %-30s %s%s\n", left, keys[i].help, range);
    }
    fprintf(f, "  %-30s %s\n", "-h, --help", "this text");
    fprintf(f, "\nA config file uses the same names without dashes in front: 'workers = 2'.\n"
               "Options on the command line win over the file. A number outside the range shown\n"
               "is refused at start (exit status 2).\n");
}

/* The key: the file's first line without surrounding blanks, 16..1024 printable characters. */
static int read_api_key(struct moed_config *c, char *msg, size_t len)
{
    FILE *f = fopen(c->api_key_file, "r");
    if (!f)
        return moe_fail(msg, len, -errno, "%s", strerror(errno));
    char buf[1100];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = buf;
    while (*p == ' ' || *p == '\t')
        p++;
    size_t k = strcspn(p, "\r\n");
    while (k && (p[k - 1] == ' ' || p[k - 1] == '\t'))
        k--;
    p[k] = 0;
    for (size_t i = 0; i < k; i++)
        if ((unsigned char)p[i] < 0x21 || (unsigned char)p[i] > 0x7e)
            return moe_fail(msg, len, MOE_ERANGE, "the key must be printable ASCII without blanks");
    if (k < 16 || k > 1024)
        return moe_fail(msg, len, MOE_ERANGE, "the key must be 16..1024 characters, not %zu", k);
    free(c->api_key);
    if (!(c->api_key = strdup(p)))
        return -ENOMEM;
    memset(buf, 0, sizeof buf);
    return 0;
}

int config_parse_args(struct moed_config *c, int argc, char **argv, bool *help, char *err,
                      size_t errlen)
{
    *help = false;
    char msg[512];
    /* First pass: --help and --config, so that the file loads before the options override it. */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            *help = true;
            return 0;
        }
        const char *v = NULL;
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            v = argv[++i];
        else if (!strncmp(argv[i], "--config=", 9))
            v = argv[i] + 9;
        if (v) {
            int rc = config_load_file(c, v, err, errlen);
            if (rc)
                return rc;
            if (dup_into(&c->config_file, v))
                return moe_fail(err, errlen, -ENOMEM, "out of memory");
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0)
            return moe_fail(err, errlen, MOE_EFORMAT, "unexpected argument '%s' (see --help)", a);
        char name[64];
        const char *val;
        const char *eq = strchr(a + 2, '=');
        if (eq) {
            size_t n = (size_t)(eq - a - 2);
            if (n >= sizeof name)
                return moe_fail(err, errlen, MOE_EFORMAT, "unknown option '%s'", a);
            memcpy(name, a + 2, n);
            name[n] = 0;
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%s", a + 2);
            if (i + 1 >= argc)
                return moe_fail(err, errlen, MOE_EFORMAT, "option '%s' needs a value", a);
            val = argv[++i];
        }
        if (!strcmp(name, "config"))
            continue;
        int rc = config_set(c, name, val, msg, sizeof msg);
        if (rc == MOE_ENOTFOUND)
            return moe_fail(err, errlen, rc, "unknown option '--%s' (see --help)", name);
        if (rc)
            return moe_fail(err, errlen, rc, "--%s", msg);
    }
    if (!c->model)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "--model PATH is required (see --help)");
    if (c->listen) {
        struct sockaddr_storage ss;
        int rc = http_parse_listen(c->listen, &ss, msg, sizeof msg);
        if (rc)
            return moe_fail(err, errlen, rc, "--listen: %s", msg);
        /* A TCP port is open to every local user: it is only served with a key. */
        if (!c->api_key_file)
            return moe_fail(err, errlen, MOE_ERANGE,
                            "--listen needs --api-key-file FILE: over TCP every local user could "
                            "use the API; clients send the file's key as 'Authorization: Bearer KEY'");
    }
    if (c->api_key_file) {
        int rc = read_api_key(c, msg, sizeof msg);
        if (rc)
            return moe_fail(err, errlen, rc, "--api-key-file %s: %s", c->api_key_file, msg);
    }
    return 0;
}
