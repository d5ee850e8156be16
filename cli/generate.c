/* moectl generate [-n N] [--temp T] [--seed S] [--stop S] PROMPT: one completion, streamed to
 * stdout as it is generated (with --json: the whole response object at the end). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli/client.h"
#include "cli/moectl.h"
#include "cli/stream.h"

static int usage(void)
{
    fprintf(stderr, "usage: moectl [--socket PATH] [--json] generate [-n N] [--temp T] [--seed S] "
                    "[--top-k K] [--top-p P] [--stop STRING] PROMPT\n");
    return 2;
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
        char *end;
        if (!strcmp(a, "-n") || !strcmp(a, "--max-tokens")) {
            long n = strtol(v, &end, 10);
            if (*end || n < 1) {
                fprintf(stderr, "moectl: %s: '%s' is not a positive number\n", a, v);
                return -1;
            }
            json_object_set_new(req, "max_tokens", json_integer(n));
        } else if (!strcmp(a, "--temp") || !strcmp(a, "--top-p") || !strcmp(a, "--min-p")) {
            double d = strtod(v, &end);
            if (*end || end == v) {
                fprintf(stderr, "moectl: %s: '%s' is not a number\n", a, v);
                return -1;
            }
            json_object_set_new(req, !strcmp(a, "--temp") ? "temperature" : !strcmp(a, "--top-p") ? "top_p" : "min_p",
                                json_real(d));
        } else if (!strcmp(a, "--seed") || !strcmp(a, "--top-k")) {
            long long n = strtoll(v, &end, 10);
            if (*end || end == v) {
                fprintf(stderr, "moectl: %s: '%s' is not an integer\n", a, v);
                return -1;
            }
            json_object_set_new(req, !strcmp(a, "--seed") ? "seed" : "top_k", json_integer(n));
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
    json_t *req = json_object();
    int i = moectl_sampling_args(argc, argv, req);
    if (i < 0 || i >= argc) {
        json_decref(req);
        return usage();
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
