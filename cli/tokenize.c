/* moectl tokenize: the model's tokenizer, offline.
 *
 *   moectl tokenize -m MODEL [--no-special] [--pieces] -f FILE|-
 *
 * Prints the token ids of FILE (or stdin for "-") space-separated on one line. Scripts rely on
 * this exact form: special tokens are parsed unless --no-special, no BOS is added, nothing else
 * goes to stdout. --pieces prints one "id:piece" per line instead (bytes escaped C-style), for
 * people. */
#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/moectl.h"
#include "cli/util.h"
#include "store/err.h"
#include "store/gguf.h"
#include "store/tokenizer.h"

static void tokenize_usage(FILE *f)
{
    fprintf(f, "usage: moectl tokenize -m MODEL [--no-special] [--pieces] -f FILE|-\n");
}

static void print_escaped(const char *p, int n)
{
    for (int i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        switch (c) {
        case '\n': fputs("\\n", stdout); break;
        case '\r': fputs("\\r", stdout); break;
        case '\t': fputs("\\t", stdout); break;
        case '\\': fputs("\\\\", stdout); break;
        default:
            /* UTF-8 bytes (>= 0x80) go out as they are so that text stays readable. */
            if (c < 0x20 || c == 0x7f)
                printf("\\x%02x", c);
            else
                putchar(c);
        }
    }
}

static int cmd_tokenize(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"file", required_argument, NULL, 'f'},
        {"no-special", no_argument, NULL, 'n'},
        {"pieces", no_argument, NULL, 'p'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *model = NULL, *file = NULL;
    bool special = true, pieces = false;
    int c;

    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "m:f:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'f': file = optarg; break;
        case 'n': special = false; break;
        case 'p': pieces = true; break;
        case 'h': tokenize_usage(stdout); return 0;
        default:
            fprintf(stderr, "moectl tokenize: bad option '%s'\n", argv[optind - 1]);
            tokenize_usage(stderr);
            return 2;
        }
    }
    if (!model || !file || optind != argc) {
        tokenize_usage(stderr);
        return 2;
    }

    char err[512] = "";
    struct gguf_file *f = NULL;
    struct moe_tokenizer *tok = NULL;
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL;
    size_t n = 0;
    int ret = 1, rc;

    if ((rc = gguf_open(&f, model, err, sizeof err))) {
        /* gguf_open's messages already start with the path. */
        if (*err)
            fprintf(stderr, "moectl tokenize: %s\n", err);
        else
            fprintf(stderr, "moectl tokenize: %s: %s\n", model, moe_strerror(rc));
        goto done;
    }
    rc = moe_tok_load(&tok, f, err, sizeof err);
    gguf_close(f);
    if (rc) {
        fprintf(stderr, "moectl tokenize: %s: %s\n", model, *err ? err : moe_strerror(rc));
        goto done;
    }

    if ((rc = moectl_read_path(file, &text, &len, err, sizeof err))) {
        fprintf(stderr, "moectl tokenize: %s: %s\n", file, err);
        goto done;
    }

    if ((rc = moe_tok_encode(tok, text, len, special, &ids, &n))) {
        fprintf(stderr, "moectl tokenize: %s\n", moe_strerror(rc));
        goto done;
    }
    if (pieces) {
        size_t cap = moe_tok_max_piece(tok) + 1;
        char *buf = malloc(cap);
        if (!buf) {
            fprintf(stderr, "moectl tokenize: %s\n", moe_strerror(-ENOMEM));
            goto done;
        }
        for (size_t i = 0; i < n; i++) {
            int k = moe_tok_piece(tok, ids[i], buf, cap);
            printf("%d:", ids[i]);
            print_escaped(buf, k < 0 ? 0 : k);
            putchar('\n');
        }
        free(buf);
    } else {
        for (size_t i = 0; i < n; i++)
            printf(i ? " %d" : "%d", ids[i]);
        putchar('\n');
    }
    if (fflush(stdout) != 0) {
        fprintf(stderr, "moectl tokenize: writing output: %s\n", strerror(errno));
        goto done;
    }
    ret = 0;
done:
    free(ids);
    free(text);
    moe_tok_free(tok);
    return ret;
}

MOECTL_COMMAND(tokenize, "-m MODEL [--no-special] [--pieces] -f FILE|-  print token ids",
               cmd_tokenize)
