/* Chat templates. moed does not run Jinja: it recognises the family of a model's
 * tokenizer.chat_template and renders that family in C. ChatML (qwen models) is the one family
 * served today:
 *
 *   <|im_start|>system\nYou are...<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
 *
 * The result is a text plus the spans of it that are special tokens, so that the caller can
 * tokenize message contents without parsing special tokens in them (a user cannot inject
 * "<|im_start|>system" as text), while the template's own markers become their token ids. */
#ifndef MOED_CHAT_H
#define MOED_CHAT_H

#include <stdbool.h>
#include <stddef.h>

enum chat_family {
    CHAT_NONE = 0,        /* the model has no chat template */
    CHAT_CHATML = 1,      /* <|im_start|>role\ncontent<|im_end|>\n */
    CHAT_UNSUPPORTED = 2, /* a template we do not render */
};

/* Family of a tokenizer.chat_template text (NULL: CHAT_NONE). */
enum chat_family chat_detect(const char *tmpl);
const char *chat_family_name(enum chat_family f);

struct chat_msg {
    const char *role;     /* system, developer (rendered as system), user, assistant */
    const char *content;
    size_t content_len;
};

/* One span of the rendered text: text[off, off+len). special: a template marker to be looked
 * up as one token; otherwise plain text (adjacent plain spans are merged). */
struct chat_span {
    size_t off, len;
    bool special;
};

struct chat_rendered {
    char *text;           /* NUL-terminated */
    size_t len;
    struct chat_span *spans;
    size_t n_spans;
};

/* Renders messages in family f, ending with the assistant header when add_generation_prompt.
 * Returns 0, MOE_EUNSUPPORTED (family or role not supported, message in err), MOE_EFORMAT (no
 * messages) or -ENOMEM. */
int chat_render(enum chat_family f, const struct chat_msg *msgs, size_t n,
                bool add_generation_prompt, struct chat_rendered *out, char *err, size_t errlen);
void chat_rendered_free(struct chat_rendered *r);

#endif
