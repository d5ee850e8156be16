/* moed's configuration: defaults, then the config file (--config FILE, INI-style "key = value"
 * lines with the long option names as keys; '#' and ';' start comments; [sections] are ignored),
 * then the command line, which wins. */
#ifndef MOED_CONFIG_H
#define MOED_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "daemon/log.h"

#define MOED_DEFAULT_SOCKET "/run/moed/moed.sock"
#define CONFIG_GPUS_MAX 64 /* GPU indexes 0..63 (DEVICES_MAX) */
#define MOED_DEFAULT_STATE_DIR "/var/lib/moed"

/* auto | on | off settings. */
enum { CONFIG_AUTO = 0, CONFIG_ON = 1, CONFIG_OFF = 2 };

struct moed_config {
    char *model;            /* --model PATH (required) */
    char *socket;           /* --socket PATH */
    char *listen;           /* --listen HOST:PORT (loopback only), or NULL */
    char *state_dir;        /* --state-dir DIR (the LMDB profile database lives here) */
    char *devices;          /* --devices cpu|auto|0,1 */
    uint32_t workers;       /* --workers N; 0: one per device (1 for cpu) */
    uint32_t ctx;           /* --ctx N; 0: the model's training context, capped at 4096 */
    uint32_t parallel;      /* --parallel N: sequences per worker */
    uint32_t threads;       /* --threads N: compute threads per worker; 0: cores / workers */
    uint64_t vram_budget;   /* --vram-budget SIZE (bytes) for GPUs without their own; 0: the
                             * worker decides */
    uint64_t vram_budget_dev[CONFIG_GPUS_MAX]; /* --vram-budget cuda:K=SIZE: GPU K's own */
    bool vram_budget_set[CONFIG_GPUS_MAX];     /* whether GPU K has its own */
    double expert_residency; /* --expert-residency SHARE in (0, 1]; 0: as the budget allows */
    char *ram_budget;       /* --ram-budget SIZE|P%|auto; NULL: every expert in the store */
    uint32_t pool_prefetch; /* --pool-prefetch N: read-aheads in flight at most (0: off) */
    int pool_io;            /* --pool-io auto|direct|buffered: MOED_TIER_IO_* (daemon/tier.h) */
    int32_t cache_slots;    /* --cache-slots auto|off|N: 0 auto, -1 off */
    int route_signatures;   /* --route-signatures auto|on|off: CONFIG_AUTO, _ON, _OFF */
    char *config_file;      /* --config FILE */
    enum log_level log_level; /* --log-level error|warn|info|debug */
    char *log_file;         /* --log-file PATH; NULL: stderr */
    char *admin_group;      /* --admin-group NAME: may use the admin endpoints besides root and our uid */
    char *api_key_file;     /* --api-key-file FILE (required with --listen) */
    char *api_key;          /* its key, read by config_parse_args */
    char *chat_template;    /* --chat-template FILE: replaces the model's chat template; NULL: none */
    char *model_alias;      /* --model-alias NAME: the served model id; NULL: the file name's stem */
    char *worker_bin;       /* --worker-bin PATH; NULL: moed-worker next to moed */
    uint64_t max_body;      /* --max-body SIZE: request body limit (413 above) */
    uint32_t idle_timeout_s;   /* --idle-timeout S: idle keep-alive connections are closed */
    uint32_t profile_interval_s; /* --profile-interval S: how often routing counts are saved */
    uint64_t profile_half_life; /* --profile-half-life N: tokens after which old routings weigh half; 0: never */
    uint32_t queue_max;     /* --queue-max N: requests waiting for a slot (503 above) */
    uint32_t max_tokens_default; /* --max-tokens-default N: when a request names none; 0: to n_ctx */
    /* Sampling defaults for requests that give none (--temp, --top-p, --top-k, --min-p,
     * --repeat-penalty); NaN / UINT32_MAX: not set (the model's general.sampling.*, else
     * OpenAI's). */
    double default_temp, default_top_p, default_min_p, default_repeat_penalty;
    uint32_t default_top_k;
    uint64_t max_total_body; /* --max-total-body SIZE: bodies of all connections; 0: max(256M, 4 x max-body) */
    uint64_t max_write_queue; /* --max-write-queue SIZE: queued for a client that does not read */
    uint32_t max_conns;     /* --max-conns N: per listener */
    uint32_t admin_reserve; /* --admin-reserve N: more Unix connections for root and our uid */
    uint32_t worker_silent_s; /* --worker-silent-timeout S: a Ready worker silent this long is killed */
    uint32_t worker_stall_s;  /* --worker-stall-timeout S: ... or whose steps stop with requests in flight */
};

/* Fills the defaults (allocated strings). Returns 0 or -ENOMEM. */
int config_init(struct moed_config *c);
void config_free(struct moed_config *c);

/* Sets one key ("state-dir" and "state_dir" both work) from its text value. Returns 0,
 * MOE_ENOTFOUND (unknown key), MOE_EFORMAT / MOE_ERANGE (bad value) with a message. */
int config_set(struct moed_config *c, const char *key, const char *value, char *err,
               size_t errlen);

/* Reads a config file. Messages name the file and line. */
int config_load_file(struct moed_config *c, const char *path, char *err, size_t errlen);

/* Applies argv: first finds --config and loads that file, then applies every option so that the
 * command line wins. *help is set when -h/--help was given (nothing else is checked then).
 * Checks the result (--model present, --listen loopback). */
int config_parse_args(struct moed_config *c, int argc, char **argv, bool *help, char *err,
                      size_t errlen);

/* "24G", "24GiB", "512M", "1.5g", "4096" -> bytes (K/M/G/T are powers of 1024). */
int config_parse_size(const char *s, uint64_t *out);

/* Writes the usage text. */
void config_usage(FILE *f);

#endif
