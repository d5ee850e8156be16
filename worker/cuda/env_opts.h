/* The CUDA backend's options from the environment (docs/cuda.md lists them): switches and whole
 * numbers, read the same way everywhere. Plain C, shared with the host test that checks it
 * (tests/test_basics.c).
 *
 * A switch that is on by default is off only for "0"; an opt-in switch is on only for "1". A
 * number is taken only when the whole value is a decimal integer in the option's range; any
 * other value is reported on stderr and the default stands, so a typo never turns into 0. */
#ifndef MOE_CUDA_ENV_OPTS_H
#define MOE_CUDA_ENV_OPTS_H

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* On unless the variable is "0". */
static inline bool moe_env_on(const char *name)
{
    const char *v = getenv(name);
    return !v || strcmp(v, "0") != 0;
}

/* Off unless the variable is "1". */
static inline bool moe_env_is1(const char *name)
{
    const char *v = getenv(name);
    return v && !strcmp(v, "1");
}

/* The variable's value as a whole number in lo..hi; def when unset or empty, or (with a message
 * naming the variable) when it is anything else. */
static inline long long moe_env_int(const char *name, long long lo, long long hi, long long def)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return def;
    char *end;
    errno = 0;
    const long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "moed-worker: %s=%s is not a whole number in %lld..%lld; ignored\n", name,
                v, lo, hi);
        return def;
    }
    return x;
}

#endif
