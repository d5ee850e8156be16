/* Chat template rendering; see chat.h. */
#include "daemon/chat.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "store/buf.h"
#include "store/err.h"

enum chat_family chat_detect(const char *tmpl)
{
    if (!tmpl || !*tmpl)
        return CHAT_NONE;
    if (strstr(tmpl, "<|im_start|>"))
        return CHAT_CHATML;
    return CHAT_UNSUPPORTED;
}

const char *chat_family_name(enum chat_family f)
{
    switch (f) {
    case CHAT_NONE: return "none";
    case CHAT_CHATML: return "chatml";
    default: return "unsupported";
    }
}

struct builder {
    struct chat_rendered *r;
    size_t cap, span_cap;
};

static int put(struct builder *b, const char *s, size_t n, bool special)
{
    struct chat_rendered *r = b->r;
    if (n == 0)
        return 0;
    if (moe_buf_reserve(&r->text, &b->cap, r->len + n + 1))
        return -ENOMEM;
    struct chat_span *last = r->n_spans ? &r->spans[r->n_spans - 1] : NULL;
    if (last && !special && !last->special) {
        last->len += n;
    } else {
        if (r->n_spans == b->span_cap) {
            size_t nc = b->span_cap ? b->span_cap * 2 : 16;
            struct chat_span *sp = realloc(r->spans, nc * sizeof *sp);
            if (!sp)
                return -ENOMEM;
            r->spans = sp;
            b->span_cap = nc;
        }
        r->spans[r->n_spans++] = (struct chat_span){r->len, n, special};
    }
    memcpy(r->text + r->len, s, n);
    r->len += n;
    r->text[r->len] = 0;
    return 0;
}

static const char *chatml_role(const char *role)
{
    static const char *ok[] = {"system", "user", "assistant"};
    if (!strcmp(role, "developer"))
        return "system";
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (!strcmp(role, ok[i]))
            return ok[i];
    return NULL;
}

int chat_render(enum chat_family f, const struct chat_msg *msgs, size_t n,
                bool add_generation_prompt, struct chat_rendered *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (f != CHAT_CHATML)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "this model's chat template (%s) is not supported; moed renders ChatML "
                        "(qwen) templates; use /v1/completions with a formatted prompt",
                        chat_family_name(f));
    if (n == 0)
        return moe_fail(err, errlen, MOE_EFORMAT, "messages must not be empty");
    struct builder b = {.r = out};
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        const char *role = chatml_role(msgs[i].role);
        if (!role) {
            rc = moe_fail(err, errlen, MOE_EUNSUPPORTED,
                          "messages[%zu].role '%s' is not supported (use system, developer, user "
                          "or assistant)", i, msgs[i].role);
            goto fail;
        }
        if ((rc = put(&b, "<|im_start|>", 12, true)) || (rc = put(&b, role, strlen(role), false)) ||
            (rc = put(&b, "\n", 1, false)) ||
            (rc = put(&b, msgs[i].content, msgs[i].content_len, false)) ||
            (rc = put(&b, "<|im_end|>", 10, true)) || (rc = put(&b, "\n", 1, false)))
            goto fail;
    }
    if (add_generation_prompt &&
        ((rc = put(&b, "<|im_start|>", 12, true)) || (rc = put(&b, "assistant\n", 10, false))))
        goto fail;
    return 0;
fail:
    if (rc == -ENOMEM)
        moe_fail(err, errlen, rc, "out of memory");
    chat_rendered_free(out);
    return rc;
}

void chat_rendered_free(struct chat_rendered *r)
{
    free(r->text);
    free(r->spans);
    memset(r, 0, sizeof *r);
}
