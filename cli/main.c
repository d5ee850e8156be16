/* moectl: admin and client CLI. Subcommands live one per file in cli/ and register themselves. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/moectl.h"
#include "store/version.h"

#define MAX_COMMANDS 32

struct command {
    const char *name, *help;
    moectl_fn fn;
};
static struct command commands[MAX_COMMANDS];
static int n_commands;

struct moectl_opts moectl_opts;

void moectl_register(const char *name, const char *help, moectl_fn fn)
{
    if (n_commands < MAX_COMMANDS)
        commands[n_commands++] = (struct command){name, help, fn};
}

static int cmp_command(const void *a, const void *b)
{
    return strcmp(((const struct command *)a)->name, ((const struct command *)b)->name);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: moectl [--socket PATH] [--json] COMMAND [ARGS]\n\ncommands:\n");
    for (int i = 0; i < n_commands; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
}

/* "--name=value" becomes "--name" "value" everywhere (up to a "--"), so that every option of
 * every verb takes either spelling. The strings point into argv's own. */
static char **split_equals(int *argc, char **argv)
{
    char **out = calloc((size_t)(2 * *argc + 1), sizeof *out);
    if (!out)
        return argv;
    int n = 0;
    bool opts = true;
    for (int i = 0; i < *argc; i++) {
        char *a = argv[i], *eq;
        if (opts && !strcmp(a, "--"))
            opts = false;
        if (opts && i > 0 && !strncmp(a, "--", 2) && a[2] && (eq = strchr(a, '=')) && eq > a + 2) {
            *eq = 0;
            out[n++] = a;
            out[n++] = eq + 1;
        } else {
            out[n++] = a;
        }
    }
    out[n] = NULL;
    *argc = n;
    return out;
}

static int run(int argc, char **argv);

int main(int argc, char **argv)
{
    qsort(commands, (size_t)n_commands, sizeof commands[0], cmp_command);
    char **av = split_equals(&argc, argv);
    int rc = run(argc, av);
    if (av != argv)
        free(av);
    return rc;
}

static int run(int argc, char **argv)
{
    moectl_opts.socket = getenv("MOED_SOCKET");
    if (!moectl_opts.socket || !*moectl_opts.socket)
        moectl_opts.socket = "/run/moed/moed.sock";
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "--socket") && i + 1 < argc)
            moectl_opts.socket = argv[++i];
        else if (!strcmp(argv[i], "--json"))
            moectl_opts.json = true;
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--version")) {
            printf("moectl %s\n", MOE_VERSION);
            return 0;
        } else {
            fprintf(stderr, "moectl: unknown option %s\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (i >= argc) {
        usage(stderr);
        return 2;
    }
    for (int c = 0; c < n_commands; c++)
        if (!strcmp(commands[c].name, argv[i]))
            return commands[c].fn(argc - i, argv + i);
    fprintf(stderr, "moectl: unknown command '%s'\n", argv[i]);
    usage(stderr);
    return 2;
}
