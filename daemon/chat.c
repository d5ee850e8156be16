/* Chat template rendering; see chat.h. */
#include "daemon/chat.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/jinja.h"
#include "store/err.h"
#include "store/tokenizer.h"

const char chat_chatml_template[] =
    "{%- for message in messages %}"
    "{%- set role = 'system' if message.role == 'developer' else message.role %}"
    "{{- '<|im_start|>' + role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

struct chat_template {
    struct jinja_tmpl *t;
    enum chat_source source;
    _Atomic int refs;
};

int chat_template_new(struct chat_template **out, const char *src, size_t len,
                      enum chat_source source, char *err, size_t errlen)
{
    struct chat_template *ct = calloc(1, sizeof *ct);
    if (!ct)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    int rc = jinja_parse(src, len, &ct->t, err, errlen);
    if (rc) {
        free(ct);
        return rc;
    }
    ct->source = source;
    ct->refs = 1;
    *out = ct;
    return 0;
}

struct chat_template *chat_template_ref(struct chat_template *t)
{
    if (t)
        t->refs++;
    return t;
}

void chat_template_free(struct chat_template *t)
{
    if (!t || --t->refs > 0)
        return;
    jinja_free(t->t);
    free(t);
}

const char *chat_source_name(enum chat_source s)
{
    switch (s) {
    case CHAT_SRC_MODEL: return "model";
    case CHAT_SRC_FILE: return "file";
    default: return "chatml";
    }
}

enum chat_source chat_template_source(const struct chat_template *t) { return t->source; }

struct builder {
    struct chat_rendered *r;
    size_t cap;
};

static int put_span(struct builder *b, size_t off, size_t len, int32_t id)
{
    struct chat_rendered *r = b->r;
    if (len == 0)
        return 0;
    struct chat_span *last = r->n_spans ? &r->spans[r->n_spans - 1] : NULL;
    if (last && id < 0 && last->id < 0 && last->off + last->len == off) {
        last->len += len;
        return 0;
    }
    if (r->n_spans == b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 16;
        struct chat_span *sp = realloc(r->spans, nc * sizeof *sp);
        if (!sp)
            return -ENOMEM;
        r->spans = sp;
        b->cap = nc;
    }
    r->spans[r->n_spans++] = (struct chat_span){off, len, id};
    return 0;
}

static int add_token_var(json_t *lit, const struct moe_tokenizer *tok, const char *name, int32_t id)
{
    if (id < 0)
        return 0;
    char buf[256];
    int n = moe_tok_piece(tok, id, buf, sizeof buf);
    if (n <= 0 || (size_t)n >= sizeof buf)
        return 0;
    return json_object_set_new(lit, name, json_stringn(buf, (size_t)n)) ? -ENOMEM : 0;
}

int chat_render(const struct chat_template *t, const struct moe_tokenizer *tok, json_t *vars,
                time_t now, struct chat_rendered *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    json_t *lit = json_object();
    if (!lit)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    int rc = 0;
    if (tok && ((rc = add_token_var(lit, tok, "bos_token", moe_tok_bos(tok))) ||
                (rc = add_token_var(lit, tok, "eos_token", moe_tok_eos(tok))))) {
        json_decref(lit);
        return moe_fail(err, errlen, rc, "out of memory");
    }
    struct jinja_opts o = {.now = now};
    struct jinja_out jo;
    rc = jinja_render(t->t, vars, lit, &o, &jo, err, errlen);
    json_decref(lit);
    if (rc)
        return rc;
    struct builder b = {.r = out};
    out->text = jo.text;
    out->len = jo.len;
    jo.text = NULL;
    for (size_t i = 0; i < jo.n_spans && !rc; i++) {
        const struct jinja_span *s = &jo.spans[i];
        if (s->data || !tok) {
            rc = put_span(&b, s->off, s->len, -1);
            continue;
        }
        struct moe_tok_frag *fr;
        size_t nfr;
        if ((rc = moe_tok_split_special(tok, out->text + s->off, s->len, &fr, &nfr)))
            break;
        for (size_t k = 0; k < nfr && !rc; k++)
            rc = put_span(&b, s->off + fr[k].off, fr[k].len, fr[k].id);
        free(fr);
    }
    jinja_out_free(&jo);
    if (rc) {
        chat_rendered_free(out);
        return moe_fail(err, errlen, rc, "out of memory");
    }
    return 0;
}

void chat_rendered_free(struct chat_rendered *r)
{
    free(r->text);
    free(r->spans);
    memset(r, 0, sizeof *r);
}

/* ---- Output parsing ---- */

enum { S_START, S_REASON_START, S_REASON, S_CONTENT_START, S_CONTENT, S_TOOLS };

static const char THINK[] = "<think>", THINK_END[] = "</think>";
static const char CALL[] = "<tool_call>", CALL_END[] = "</tool_call>";

static bool ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

/* Length of the longest suffix of s[0..n) that is a proper prefix of tag. */
static size_t partial_tag(const char *s, size_t n, const char *tag)
{
    size_t tl = strlen(tag);
    for (size_t k = tl - 1; k > 0; k--)
        if (k <= n && !memcmp(s + n - k, tag, k))
            return k;
    return 0;
}

static bool prefix_of(const char *s, size_t n, const char *tag)
{
    size_t tl = strlen(tag);
    return n < tl && !memcmp(s, tag, n);
}

void chat_out_init(struct chat_out *p, bool think_open, bool tools, const char *id_prefix)
{
    memset(p, 0, sizeof *p);
    p->state = think_open ? S_REASON_START : S_START;
    p->tools = tools;
    snprintf(p->id_prefix, sizeof p->id_prefix, "%s", id_prefix ? id_prefix : "call");
}

/* One <tool_call> body: {"name": string, "arguments" (or "parameters"): object or string}. */
static int emit_call(struct chat_out *p, const char *s, size_t n, chat_emit_fn emit, void *user)
{
    json_t *j = json_loadb(s, n, 0, NULL);
    json_t *name = json_object_get(j, "name");
    json_t *args = json_object_get(j, "arguments");
    if (!args)
        args = json_object_get(j, "parameters");
    if (!json_is_string(name) || (args && !json_is_object(args) && !json_is_string(args))) {
        json_decref(j);
        return -1;
    }
    char *at = !args ? strdup("{}") : json_is_string(args) ? strdup(json_string_value(args))
                                                           : json_dumps(args, JSON_COMPACT);
    char id[64];
    snprintf(id, sizeof id, "%s_%d", p->id_prefix, p->n_calls);
    struct chat_tool_call tc = {p->n_calls, id, json_string_value(name), at ? at : "{}"};
    p->n_calls++;
    int rc = emit(user, CHAT_EV_TOOL_CALL, NULL, 0, &tc);
    free(at);
    json_decref(j);
    return rc;
}

int chat_out_feed(struct chat_out *p, const char *text, size_t len, bool final, chat_emit_fn emit,
                  void *user)
{
    int rc = 0;
    while (p->pos < len || (final && p->state == S_START)) {
        const char *r = text + p->pos;
        size_t n = len - p->pos;
        switch (p->state) {
        case S_START:
            if (n >= sizeof THINK - 1 && !memcmp(r, THINK, sizeof THINK - 1)) {
                p->pos += sizeof THINK - 1;
                p->state = S_REASON_START;
            } else if (!final && prefix_of(r, n, THINK)) {
                return 0;
            } else {
                p->state = S_CONTENT;
            }
            if (final && n == 0)
                return 0;
            break;
        case S_REASON_START: case S_CONTENT_START:
            while (p->pos < len && ws(text[p->pos]))
                p->pos++;
            if (p->pos == len)
                return 0;
            p->state = p->state == S_REASON_START ? S_REASON : S_CONTENT;
            break;
        case S_REASON: {
            const char *hit = memmem(r, n, THINK_END, sizeof THINK_END - 1);
            size_t upto = hit ? (size_t)(hit - r) : final ? n : n - partial_tag(r, n, THINK_END);
            size_t keep = upto;
            while (keep > 0 && ws(r[keep - 1])) /* trailing whitespace waits for more text */
                keep--;
            if (keep && (rc = emit(user, CHAT_EV_REASONING, r, keep, NULL)))
                return rc;
            if (hit) {
                p->pos += upto + sizeof THINK_END - 1;
                p->state = S_CONTENT_START;
                break;
            }
            p->pos += final ? n : keep;
            return 0;
        }
        case S_CONTENT: {
            const char *hit = p->tools ? memmem(r, n, CALL, sizeof CALL - 1) : NULL;
            size_t upto = hit ? (size_t)(hit - r) : final || !p->tools ? n : n - partial_tag(r, n, CALL);
            size_t keep = upto;
            if (p->tools && !(final && !hit)) /* whitespace before a tool call is dropped */
                while (keep > 0 && ws(r[keep - 1]))
                    keep--;
            if (keep && (rc = emit(user, CHAT_EV_CONTENT, r, keep, NULL)))
                return rc;
            if (hit) {
                p->pos += upto;
                p->state = S_TOOLS;
                break;
            }
            p->pos += keep;
            return 0;
        }
        case S_TOOLS: {
            size_t w = 0;
            while (w < n && ws(r[w]))
                w++;
            if (w == n) {
                if (final)
                    p->pos = len;
                return 0;
            }
            r += w;
            n -= w;
            if (n < sizeof CALL - 1 || memcmp(r, CALL, sizeof CALL - 1)) {
                if (!final && prefix_of(r, n, CALL))
                    return 0;
                p->pos += w;
                p->state = S_CONTENT; /* text after the calls */
                break;
            }
            const char *body = r + sizeof CALL - 1;
            size_t bn = n - (sizeof CALL - 1);
            const char *end = memmem(body, bn, CALL_END, sizeof CALL_END - 1);
            if (!end && !final)
                return 0;
            size_t blen = end ? (size_t)(end - body) : bn;
            size_t total = w + (sizeof CALL - 1) + blen + (end ? sizeof CALL_END - 1 : 0);
            int erc = emit_call(p, body, blen, emit, user);
            if (erc > 0 || (erc < 0 && erc != -1))
                return erc;
            if (erc == -1 && (rc = emit(user, CHAT_EV_CONTENT, r, total - w, NULL)))
                return rc;
            p->pos += total;
            break;
        }
        }
    }
    return 0;
}
