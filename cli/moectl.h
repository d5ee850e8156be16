/* moectl subcommands register themselves at load time:
 *
 *   static int cmd_inspect(int argc, char **argv);   // argv[0] is "inspect"
 *   MOECTL_COMMAND(inspect, "MODEL  describe a GGUF model", cmd_inspect)
 *
 * A command returns the process exit code: 0 ok, 1 failure, 2 usage error, 3 daemon not
 * reachable, 4 access denied. Global options (--socket PATH, --json) are parsed by main and
 * available through moectl_opts. */
#ifndef MOECTL_H
#define MOECTL_H

#include <stdbool.h>
#include <string.h>

typedef int (*moectl_fn)(int argc, char **argv);
void moectl_register(const char *name, const char *help, moectl_fn fn);

struct moectl_opts {
    const char *socket;   /* --socket, or $MOED_SOCKET, or /run/moed/moed.sock */
    bool json;            /* --json */
};
extern struct moectl_opts moectl_opts;

/* `moectl VERB --help` (or -h): the verb prints its usage to stdout and exits 0. */
static inline bool moectl_wants_help(int argc, char **argv)
{
    return argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
}

#define MOECTL_COMMAND(name, help, fn)                                           \
    __attribute__((constructor)) static void moectl_register_##name(void)        \
    {                                                                            \
        moectl_register(#name, help, fn);                                        \
    }

#endif
