/* Shared by moectl generate and chat: send a completion request, print the text as it streams. */
#ifndef MOECTL_STREAM_H
#define MOECTL_STREAM_H

#include <jansson.h>

/* Parses -n/--temp/--seed/--top-k/--top-p/--min-p/--stop (and --system for chat requests, which
 * carry "messages") into req. Returns the index of the first non-option argument, -1 on error. */
int moectl_sampling_args(int argc, char **argv, json_t *req);

/* POSTs req to path. Without --json the request streams and the text goes to stdout as it
 * arrives; with --json a non-streaming request is made and the response printed. When text is not
 * NULL it receives the complete generated text (malloc'd). Returns a moectl exit code. */
int moectl_complete(const char *path, json_t *req, int chat, char **text);

#endif
