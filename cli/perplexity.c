/* moectl perplexity: how well a model predicts a text, offline, on the CPU engine.
 *
 *   moectl perplexity -m MODEL -f FILE|- [--ctx N] [--threads N] [--no-special] [--json]
 *
 * The text is tokenized (no BOS) and cut into non-overlapping windows of N tokens (default 512);
 * each window is evaluated from an empty cache and every position t predicts token t+1, so a
 * window of n tokens scores n-1 of them. The result is exp(mean negative log-likelihood). The
 * same definition is used by tools/train-demo/train.py, so the two can be compared directly. */
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "cli/moectl.h"
#include "cli/util.h"
#include "store/err.h"
#include "worker/engine.h"
#include "worker/engine_load.h"

static void perplexity_usage(FILE *f)
{
    fprintf(f, "usage: moectl perplexity -m MODEL -f FILE|- [--ctx N] [--threads N] [--no-special] [--json]\n"
               "  --ctx 2..1048576 (default 512), --threads 0..1024 (default 0: all cores)\n");
}

/* Negative log-likelihood of `next` under logits[n_vocab], in double precision. */
static double token_nll(const float *logits, uint32_t n_vocab, int32_t next)
{
    float mx = logits[0];
    for (uint32_t i = 1; i < n_vocab; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (uint32_t i = 0; i < n_vocab; i++)
        sum += exp((double)logits[i] - mx);
    return log(sum) - ((double)logits[next] - mx);
}

static int cmd_perplexity(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"file", required_argument, 0, 'f'},
        {"ctx", required_argument, 0, 'c'},   {"threads", required_argument, 0, 't'},
        {"no-special", no_argument, 0, 'S'},  {"json", no_argument, 0, 'j'},
        {"help", no_argument, 0, 'h'},        {0, 0, 0, 0},
    };
    const char *model = NULL, *file = NULL;
    long long n_ctx = 512, threads = 0;
    bool special = true, json = moectl_opts.json;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:f:c:t:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'f': file = optarg; break;
        case 'c':
            if (moectl_parse_int("--ctx", optarg, 2, 1 << 20, &n_ctx))
                return 2;
            break;
        case 't':
            if (moectl_parse_int("--threads", optarg, 0, 1024, &threads))
                return 2;
            break;
        case 'S': special = false; break;
        case 'j': json = true; break;
        case 'h': perplexity_usage(stdout); return 0;
        default: perplexity_usage(stderr); return 2;
        }
    }
    if (!model || !file || optind != argc || n_ctx < 2 || n_ctx > 1 << 20 || threads < 0) {
        perplexity_usage(stderr);
        return 2;
    }

    char err[512];
    struct moe_loaded lm = {0};
    struct moe_engine *eng = NULL;
    char *text = NULL;
    int32_t *ids = NULL, *pos = NULL, *seq = NULL;
    float *logits = NULL;
    size_t len = 0, n = 0;
    int rc = 1;

    int e = moectl_read_path(file, &text, &len, err, sizeof err);
    if (e) {
        fprintf(stderr, "moectl perplexity: %s: %s\n", file, err);
        goto out;
    }
    if ((e = moe_loaded_open(&lm, model, true, err, sizeof err))) {
        fprintf(stderr, "moectl perplexity: %s\n", err);
        goto out;
    }
    if ((e = moe_tok_encode(lm.tok, text, len, special, &ids, &n))) {
        fprintf(stderr, "moectl perplexity: tokenizing %s: %s\n", file, moe_strerror(e));
        goto out;
    }
    if (n < 2) {
        fprintf(stderr, "moectl perplexity: %s has fewer than 2 tokens\n", file);
        goto out;
    }
    uint32_t win = (uint32_t)n_ctx;
    struct moe_engine_opts eo = {.n_ctx = win, .n_seq = 1, .n_batch = win, .n_threads = (int)threads};
    if ((e = moe_engine_init(&eng, &lm.model, &eo, err, sizeof err))) {
        fprintf(stderr, "moectl perplexity: %s\n", err);
        goto out;
    }
    uint32_t n_vocab = lm.model.hp.n_vocab;
    pos = malloc(win * sizeof *pos);
    seq = calloc(win, sizeof *seq);
    logits = malloc((size_t)win * n_vocab * sizeof *logits);
    if (!pos || !seq || !logits) {
        fprintf(stderr, "moectl perplexity: out of memory\n");
        goto out;
    }
    for (uint32_t i = 0; i < win; i++)
        pos[i] = (int32_t)i;

    bool tty = isatty(2);
    double nll = 0;
    size_t scored = 0, windows = 0;
    for (size_t s = 0; s + 1 < n; s += win) {
        uint32_t w = (uint32_t)(n - s < win ? n - s : win);
        if (w < 2)
            break;
        moe_engine_seq_clear(eng, 0);
        struct moe_batch b = {.n = w, .token = ids + s, .pos = pos, .seq = seq, .logits = NULL};
        if ((e = moe_engine_forward(eng, &b, logits))) {
            fprintf(stderr, "moectl perplexity: forward: %s\n", moe_strerror(e));
            goto out;
        }
        for (uint32_t t = 0; t + 1 < w; t++)
            nll += token_nll(logits + (size_t)t * n_vocab, n_vocab, ids[s + t + 1]);
        scored += w - 1;
        windows++;
        if (!json && tty)
            fprintf(stderr, "\r[%zu/%zu] ppl %.4f", windows, (n + win - 1) / win, exp(nll / scored));
    }
    if (!json && tty)
        fprintf(stderr, "\n");
    double mean = nll / (double)scored;
    if (json) {
        json_t *o = json_pack("{s:I, s:I, s:I, s:f, s:f}", "tokens", (json_int_t)n, "scored",
                              (json_int_t)scored, "windows", (json_int_t)windows, "nll", mean,
                              "ppl", exp(mean));
        char *s = json_dumps(o, JSON_REAL_PRECISION(10));
        printf("%s\n", s);
        free(s);
        json_decref(o);
    } else {
        printf("perplexity %.4f (mean nll %.6f over %zu tokens, %zu windows of %u)\n", exp(mean), mean,
               scored, windows, win);
    }
    rc = 0;
out:
    free(logits);
    free(pos);
    free(seq);
    free(ids);
    free(text);
    moe_engine_free(eng);
    moe_loaded_close(&lm);
    return rc;
}

MOECTL_COMMAND(perplexity, "-m MODEL -f FILE   perplexity of a text (CPU engine)", cmd_perplexity)
