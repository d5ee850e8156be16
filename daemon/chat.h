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

/* How a model writes its tool calls, told by the markers its chat template holds (see "The
 * assistant's output" below for each). */
enum chat_fmt {
    CHAT_FMT_HERMES = 0,    /* <tool_call>{...}</tool_call>: Qwen, Hermes, and the default */
    CHAT_FMT_LLAMA,         /* {"name", "parameters"} as the message; <|python_tag|>: Llama 3.x */
    CHAT_FMT_MISTRAL,       /* [TOOL_CALLS][{...}, ...] or [TOOL_CALLS]name[ARGS]{...} */
    CHAT_FMT_DEEPSEEK,      /* <｜tool▁call▁begin｜>...<｜tool▁call▁end｜>: V3.1, R1 */
    CHAT_FMT_HARMONY,       /* gpt-oss channels: <|channel|>commentary to=functions.NAME ... */
    CHAT_FMT_COMMAND_R,     /* Action: ```json [...]```, <|START_ACTION|>[...]<|END_ACTION|> */
    CHAT_FMT_FUNCTIONARY,   /* <function=NAME>{...}</function>: functionary v3.1 */
    CHAT_FMT_FIREFUNCTION,  /* functools[{...}, ...] */
    CHAT_FMT_FUNCTIONARY2,  /* >>>recipient\n...: functionary v3.2 */
    CHAT_FMT_SEED,          /* <seed:tool_call><function=NAME><parameter=K>V</parameter>... */
};
/* The format a template's text teaches (CHAT_FMT_HERMES when none is recognised). */
enum chat_fmt chat_fmt_detect(const char *src, size_t len);
enum chat_fmt chat_template_format(const struct chat_template *t);
/* "hermes", "llama", ... */
const char *chat_fmt_name(enum chat_fmt f);

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
 *              and </think> (command-r: <|START_THINKING|> and <|END_THINKING|>; seed: <seed:think>), without the
 *              whitespace around it;
 *   content    the rest (whitespace after </think> dropped);
 *   tool call  when tools are on, each call in the format's shape; a call that does not parse
 *              stays content:
 *     hermes      <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen, Hermes);
 *     llama       {"name": ..., "parameters": {...}} opening the message (several: separated
 *                 by ';' or whitespace), <|python_tag|> then such an object, a built-in tool's
 *                 name.call(key="value", ...) or code (the "python" tool, {"code": ...});
 *     mistral     [TOOL_CALLS][{"name", "arguments"}, ...] (Nemo) or
 *                 [TOOL_CALLS]name[ARGS]{...} (Small 3.2, Devstral; [CALL_ID]id before [ARGS]);
 *     deepseek    <｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜> (V3.1) or
 *                 <｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>
 *                 (R1), inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>;
 *     harmony     gpt-oss messages, <|channel|>NAME ... <|message|>text<|end|>: the analysis
 *                 channel is reasoning, a message to=functions.NAME a call (its text the
 *                 arguments, up to <|call|>), the others content (whatever the tools);
 *     command-r   Action: ```json [{"tool_name", "parameters"}, ...] ``` (Command R+) or
 *                 <|START_ACTION|>[...]<|END_ACTION|> (R7B);
 *     functionary <function=name>{...}</function> (v3.1);
 *     firefunction functools[{"name", "arguments"}, ...];
 *     functionary-v3.2  >>>recipient\ntext, one after the other (the prompt wrote the first
 *                 >>>): "all" is content, another name a call with its JSON object, "python" a
 *                 call with its code (whatever the tools);
 *     seed        <seed:tool_call><function=name><parameter=key>value</parameter>...</function>
 *                 </seed:tool_call> (Seed-OSS; a value that is JSON other than a string is
 *                 that value, else the text), its reasoning between <seed:think> and
 *                 </seed:think>. */
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
    bool said;           /* some content was given */
    enum chat_fmt fmt;
    const char *think, *think_end; /* the reasoning's markers */
    int n_calls;
    int kind;            /* harmony: what the open message is; functionary v3.2: a recipient was read */
    char name[96];       /* harmony: the open call's function */
    char id_prefix[40];
};

/* think_open: the prompt ended inside <think> (the model starts with its reasoning). */
void chat_out_init(struct chat_out *p, bool think_open, bool tools, const char *id_prefix,
                   enum chat_fmt fmt);
/* Consumes text[p->pos, len) as far as it is decided; final: all of it. Returns 0 or what emit
 * returned. */
int chat_out_feed(struct chat_out *p, const char *text, size_t len, bool final, chat_emit_fn emit,
                  void *user);

#endif
