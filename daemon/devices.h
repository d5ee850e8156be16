/* What a worker program can compute on: `moed-worker --list-devices`, run and read.
 *
 * The daemon is built without CUDA and never touches a GPU itself; for --devices auto it asks
 * the worker binary it is going to start, which knows what it was built with and probes the
 * hardware (a GPU is listed only when a kernel of that binary ran on it). */
#ifndef MOED_DEVICES_H
#define MOED_DEVICES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DEVICES_MAX 64

struct devices_found {
    bool cpu;                       /* a "cpu" line was there */
    uint32_t n_gpu;
    int gpu[DEVICES_MAX];           /* CUDA device indexes, in the order listed */
    char desc[DEVICES_MAX][128];    /* their descriptions */
};

/* Runs `worker_bin --list-devices` (stdin /dev/null, stderr inherited) for at most timeout_ms;
 * after that it is killed, with whatever it started (its own process group). Each output line
 * is a device name and a description: "cpu ...", "cuda:K ..."; other names are skipped, and
 * so are repeats. Returns 0, or an error with the reason in err: the program cannot be run,
 * hangs, exits with a non-zero status or a signal, prints more than 64 KiB, or lists no
 * device at all. */
int devices_list(const char *worker_bin, uint32_t timeout_ms, struct devices_found *out,
                 char *err, size_t errlen);

/* A --devices list other than "auto": comma-separated items "cpu" (a CPU worker), "K" or
 * "cuda:K" (GPU K < DEVICES_MAX), at most DEVICES_MAX of them, mixed freely ("cpu,0,1"). Writes
 * the workers' device names ("cpu", "cuda:K") to names[0..*n) when names is not NULL. Returns 0,
 * MOE_EFORMAT or MOE_ERANGE. */
int devices_parse_list(const char *s, char (*names)[16], uint32_t *n);

/* The GPU index of a worker device name "cuda:K", or -1. */
int devices_gpu_index(const char *name);

#endif
