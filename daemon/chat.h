/* Chat templates: the model's tokenizer.chat_template (or the file --chat-template names),
 * rendered by moed's Jinja renderer (jinja.h) the way Hugging Face's apply_chat_template renders
 * it; a built-in ChatML template when the model has none.
 *
 * The result is a text plus spans: a special span is one token of the vocabulary found in the
 * template's own text (its markers, bos_token); the rest is plain text, to be tokenized without
 * parsing special tokens, so that a message cannot inject "<|im_start|>system" as text. */
#ifndef MOED_CHAT_H
#define MOED_CHAT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

struct moe_tokenizer;

enum chat_source {
    CHAT_SRC_MODEL = 0,   /* tokenizer.chat_template */
    CHAT_SRC_FILE = 1,    /* --chat-template FILE */
    CHAT_SRC_BUILTIN = 2, /* ChatML, for a model without a template */
};

struct chat_template;

/* The built-in template: ChatML, as Qwen2.5 renders it without tools. */
extern const char chat_chatml_template[];

/* Parses a template. Returns 0, MOE_EFORMAT / MOE_EUNSUPPORTED / MOE_ETOOBIG (message in err,
 * with the template line) or -ENOMEM. */
int chat_template_new(struct chat_template **out, const char *src, size_t len,
                      enum chat_source source, char *err, size_t errlen);
void chat_template_free(struct chat_template *t);
/* "model", "file" or "chatml". */
const char *chat_source_name(enum chat_source s);
enum chat_source chat_template_source(const struct chat_template *t);

/* One span of the rendered text: text[off, off+len). id >= 0: a special token; -1: plain text
 * (adjacent plain spans are merged). */
struct chat_span {
    size_t off, len;
    int32_t id;
};

struct chat_rendered {
    char *text;           /* NUL-terminated */
    size_t len;
    struct chat_span *spans;
    size_t n_spans;
};

/* Renders the template. vars: a JSON object of template variables that come from the request
 * (messages, tools, add_generation_prompt, chat_template_kwargs); bos_token and eos_token are
 * added from tok (which may be NULL: then nothing is special). now: strftime_now's time (0: the
 * current local time). Returns 0, MOE_EFORMAT (the template raised; message in err),
 * MOE_ETOOBIG (a renderer limit) or -ENOMEM. */
int chat_render(const struct chat_template *t, const struct moe_tokenizer *tok, json_t *vars,
                time_t now, struct chat_rendered *out, char *err, size_t errlen);
void chat_rendered_free(struct chat_rendered *r);

/* The template is shared with threads that render on the loop's pool: each holder takes a
 * reference; chat_template_free drops one. */
struct chat_template *chat_template_ref(struct chat_template *t);

/* ---- The assistant's output: reasoning, content and tool calls ----
 *
 * Text generated so far is fed in (the whole text each time, growing); events come out as soon
 * as they can no longer change:
 *   reasoning  text between <think> (at the start of the output, or left open by the prompt)
 *              and </think>, without the whitespace around it;
 *   content    the rest (whitespace after </think> dropped);
 *   tool call  each <tool_call>{"name": ..., "arguments": {...}}</tool_call> block (Qwen,
 *              Hermes), when tools are on; a block whose JSON does not parse stays content. */
enum chat_ev { CHAT_EV_REASONING, CHAT_EV_CONTENT, CHAT_EV_TOOL_CALL };

struct chat_tool_call {
    int index;
    const char *id, *name, *arguments; /* arguments: JSON text */
};

typedef int (*chat_emit_fn)(void *user, enum chat_ev ev, const char *s, size_t n,
                            const struct chat_tool_call *tc);

struct chat_out {
    int state;
    size_t pos;          /* bytes of the text consumed */
    bool tools;
    int n_calls;
    char id_prefix[40];
};

/* think_open: the prompt ended inside <think> (the model starts with its reasoning). */
void chat_out_init(struct chat_out *p, bool think_open, bool tools, const char *id_prefix);
/* Consumes text[p->pos, len) as far as it is decided; final: all of it. Returns 0 or what emit
 * returned. */
int chat_out_feed(struct chat_out *p, const char *text, size_t len, bool final, chat_emit_fn emit,
                  void *user);

#endif
