/* moectl generate [-n N] [--temp T] [--seed S] [--stop S] PROMPT: one completion, streamed to
 * stdout as it is generated (with --json: the whole response object at the end). */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli/client.h"
#include "cli/moectl.h"
#include "cli/stream.h"
#include "cli/util.h"

static int usage(FILE *f)
{
    fprintf(f, "usage: moectl [--socket PATH] [--json] generate [-n N] [--temp T] [--seed S] "
                    "[--top-k K] [--top-p P] [--min-p P]\n"
                    "       [--repeat-penalty R] [--presence-penalty P] [--frequency-penalty F] "
                    "[--stop STRING] PROMPT\n"
                    "  -n 1..16777216, --temp 0..100, --top-k 0..2147483647, --top-p and --min-p 0..1,\n"
                    "  --repeat-penalty 0.01..100, --presence-penalty and --frequency-penalty -2..2\n");
    return f == stdout ? 0 : 2;
}

/* Parses the sampling options shared by generate and chat into req; returns the index of the
 * first non-option argument, or -1 after printing a usage error. */
int moectl_sampling_args(int argc, char **argv, json_t *req)
{
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-' || !strcmp(a, "-") || !strcmp(a, "--"))
            break;
        if (i + 1 >= argc) {
            fprintf(stderr, "moectl: %s needs a value\n", a);
            return -1;
        }
        const char *v = argv[++i];
        /* The ranges are the API's (docs/api.md), so that a value the daemon would refuse or
         * that JSON cannot carry (nan, inf) is an error here instead of a silent default. */
        static const struct {
            const char *opt, *key;
            double min, max;
        } nums[] = {
            {"--temp", "temperature", 0, 100},
            {"--top-p", "top_p", 0, 1},
            {"--min-p", "min_p", 0, 1},
            {"--repeat-penalty", "repetition_penalty", 0.01, 100},
            {"--presence-penalty", "presence_penalty", -2, 2},
            {"--frequency-penalty", "frequency_penalty", -2, 2},
        };
        size_t k = 0;
        while (k < sizeof nums / sizeof nums[0] && strcmp(a, nums[k].opt))
            k++;
        long long n;
        double d;
        if (!strcmp(a, "-n") || !strcmp(a, "--max-tokens")) {
            if (moectl_parse_int(a, v, 1, MOECTL_MAX_TOKENS, &n))
                return -1;
            json_object_set_new(req, "max_tokens", json_integer(n));
        } else if (k < sizeof nums / sizeof nums[0]) {
            if (moectl_parse_num(a, v, nums[k].min, nums[k].max, &d))
                return -1;
            json_object_set_new(req, nums[k].key, json_real(d));
        } else if (!strcmp(a, "--top-k")) {
            if (moectl_parse_int(a, v, 0, INT32_MAX, &n))
                return -1;
            json_object_set_new(req, "top_k", json_integer(n));
        } else if (!strcmp(a, "--seed")) {
            if (moectl_parse_int(a, v, LLONG_MIN, LLONG_MAX, &n))
                return -1;
            json_object_set_new(req, "seed", json_integer(n));
        } else if (!strcmp(a, "--stop")) {
            json_t *s = json_object_get(req, "stop");
            if (!s) {
                s = json_array();
                json_object_set_new(req, "stop", s);
            }
            json_array_append_new(s, json_string(v));
        } else if (!strcmp(a, "--system") && json_object_get(req, "messages")) {
            json_array_append_new(json_object_get(req, "messages"),
                                  json_pack("{s:s, s:s}", "role", "system", "content", v));
        } else {
            fprintf(stderr, "moectl: unknown option %s\n", a);
            return -1;
        }
    }
    if (i < argc && !strcmp(argv[i], "--"))
        i++;
    return i;
}

static int cmd_generate(int argc, char **argv)
{
    if (moectl_wants_help(argc, argv))
        return usage(stdout);
    json_t *req = json_object();
    int i = moectl_sampling_args(argc, argv, req);
    if (i < 0 || i >= argc) {
        json_decref(req);
        return usage(stderr);
    }
    /* The rest of the arguments, joined by spaces, is the prompt. */
    size_t len = 0;
    for (int k = i; k < argc; k++)
        len += strlen(argv[k]) + 1;
    char *prompt = malloc(len + 1);
    if (!prompt) {
        json_decref(req);
        return 1;
    }
    prompt[0] = 0;
    for (int k = i; k < argc; k++) {
        if (k > i)
            strcat(prompt, " ");
        strcat(prompt, argv[k]);
    }
    json_object_set_new(req, "prompt", json_string(prompt));
    free(prompt);
    if (!json_object_get(req, "max_tokens"))
        json_object_set_new(req, "max_tokens", json_integer(128));
    int rc = moectl_complete("/v1/completions", req, false, NULL);
    json_decref(req);
    return rc;
}

MOECTL_COMMAND(generate, "[-n N] [--temp T] PROMPT  complete a prompt (streams the text)", cmd_generate)
