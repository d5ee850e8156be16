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
    enum chat_fmt fmt;
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
    ct->fmt = chat_fmt_detect(src, len);
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

static bool has(const char *src, size_t len, const char *m) { return memmem(src, len, m, strlen(m)); }

enum chat_fmt chat_fmt_detect(const char *src, size_t len)
{
    if (has(src, len, "<|channel|>"))
        return CHAT_FMT_HARMONY;
    if (has(src, len, "tool▁call▁begin"))
        return CHAT_FMT_DEEPSEEK;
    if (has(src, len, "[TOOL_CALLS]"))
        return CHAT_FMT_MISTRAL;
    if (has(src, len, "<seed:tool_call>"))
        return CHAT_FMT_SEED;
    if (has(src, len, "<tool_call>"))
        return CHAT_FMT_HERMES;
    if (has(src, len, "<function="))
        return CHAT_FMT_FUNCTIONARY;
    if (has(src, len, ">>>all"))
        return CHAT_FMT_FUNCTIONARY2;
    if (has(src, len, "functools["))
        return CHAT_FMT_FIREFUNCTION;
    if (has(src, len, "<|START_ACTION|>") || (has(src, len, "Action:") && has(src, len, "tool_name")))
        return CHAT_FMT_COMMAND_R;
    if (has(src, len, "<|python_tag|>") || has(src, len, "\"parameters\": dictionary"))
        return CHAT_FMT_LLAMA;
    return CHAT_FMT_HERMES;
}

enum chat_fmt chat_template_format(const struct chat_template *t) { return t->fmt; }

const char *chat_fmt_name(enum chat_fmt f)
{
    static const char *const names[] = {"hermes", "llama", "mistral", "deepseek", "harmony",
                                        "command-r", "functionary", "firefunction",
                                        "functionary-v3.2", "seed"};
    return (unsigned)f < sizeof names / sizeof names[0] ? names[f] : "hermes";
}

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

enum { S_START, S_REASON_START, S_REASON, S_CONTENT_START, S_CONTENT, S_TOOLS, S_XCONTENT, S_XTOOLS,
       S_HTEXT, S_HHEAD, S_HBODY };

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

void chat_out_init(struct chat_out *p, bool think_open, bool tools, const char *id_prefix,
                   enum chat_fmt fmt)
{
    memset(p, 0, sizeof *p);
    p->state = fmt == CHAT_FMT_HARMONY ? S_HTEXT : fmt == CHAT_FMT_FUNCTIONARY2 ? S_XTOOLS
               : think_open ? S_REASON_START : S_START;
    p->fmt = fmt;
    /* Command R7B writes its plan between its own markers */
    p->think = fmt == CHAT_FMT_COMMAND_R ? "<|START_THINKING|>" : fmt == CHAT_FMT_SEED ? "<seed:think>" : THINK;
    p->think_end = fmt == CHAT_FMT_COMMAND_R ? "<|END_THINKING|>"
                   : fmt == CHAT_FMT_SEED    ? "</seed:think>"
                                             : THINK_END;
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

/* ---- The other formats: calls found by markers, each region parsed once it is complete ---- */

static const char PYTAG[] = "<|python_tag|>";
static const char DS_CALLS[] = "<｜tool▁calls▁begin｜>", DS_CALLS_END[] = "<｜tool▁calls▁end｜>";
static const char DS_CALL[] = "<｜tool▁call▁begin｜>", DS_CALL_END[] = "<｜tool▁call▁end｜>";
static const char DS_SEP[] = "<｜tool▁sep｜>";

/* The markers that begin calls within content, and those also taken between calls. */
static const char *const *fmt_starts(enum chat_fmt f, bool between)
{
    static const char *const llama[] = {PYTAG, NULL}, *const llama2[] = {PYTAG, "{", ";", NULL};
    static const char *const mistral[] = {"[TOOL_CALLS]", NULL};
    static const char *const ds[] = {DS_CALLS, DS_CALL, NULL}, *const ds2[] = {DS_CALLS, DS_CALL, DS_CALLS_END, NULL};
    static const char *const cr[] = {"Action:", "<|START_ACTION|>", NULL};
    static const char *const fn[] = {"<function=", PYTAG, NULL};
    static const char *const ff[] = {"functools", NULL}, *const f2[] = {">>>", NULL};
    static const char *const seed[] = {"<seed:tool_call>", NULL};
    switch (f) {
    case CHAT_FMT_LLAMA: return between ? llama2 : llama;
    case CHAT_FMT_MISTRAL: return mistral;
    case CHAT_FMT_DEEPSEEK: return between ? ds2 : ds;
    case CHAT_FMT_COMMAND_R: return cr;
    case CHAT_FMT_FUNCTIONARY: return fn;
    case CHAT_FMT_FUNCTIONARY2: return f2;
    case CHAT_FMT_SEED: return seed;
    default: return ff;
    }
}

static bool starts(const char *r, size_t n, const char *m)
{
    size_t l = strlen(m);
    return n >= l && !memcmp(r, m, l);
}

/* The first of the markers in r[0, n): its offset (n: none) and length. */
static size_t find_any(const char *r, size_t n, const char *const *ms, size_t *mlen)
{
    size_t at = n;
    for (; *ms; ms++) {
        const char *h = memmem(r, n, *ms, strlen(*ms));
        if (h && (size_t)(h - r) < at) {
            at = (size_t)(h - r);
            *mlen = strlen(*ms);
        }
    }
    return at;
}

static size_t partial_any(const char *r, size_t n, const char *const *ms)
{
    size_t k = 0;
    for (; *ms; ms++) {
        size_t t = strlen(*ms) > 1 ? partial_tag(r, n, *ms) : 0;
        k = t > k ? t : k;
    }
    return k;
}

static size_t skip_ws(const char *r, size_t n, size_t i)
{
    while (i < n && ws(r[i]))
        i++;
    return i;
}

/* The end (past its closing bracket) of the JSON object or array that opens at r[i]; 0 while it
 * is still open. Brackets inside strings do not count. */
static size_t json_close(const char *r, size_t n, size_t i)
{
    int depth = 0;
    bool str = false, esc = false;
    for (; i < n; i++) {
        char c = r[i];
        if (str) {
            if (esc)
                esc = false;
            else if (c == '\\')
                esc = true;
            else if (c == '"')
                str = false;
        } else if (c == '"') {
            str = true;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if ((c == '}' || c == ']') && --depth <= 0) {
            return i + 1;
        }
    }
    return 0;
}

/* The JSON value (opening with one of opens) after whitespace from r[i]: 1, its bounds [*b, *e);
 * 0: more text is needed; -1: there is none (*used: how far the region goes). */
static int json_after(const char *r, size_t n, size_t i, const char *opens, bool final, size_t *b,
                      size_t *e, size_t *used)
{
    size_t j = skip_ws(r, n, i);
    if (j < n && (!r[j] || !strchr(opens, r[j]))) {
        *used = j;
        return -1;
    }
    if (j < n && (*e = json_close(r, n, j))) {
        *b = j;
        return 1;
    }
    if (!final)
        return 0;
    *used = n;
    return -1;
}

/* After r[0, e): optional whitespace and marker m, consumed; SIZE_MAX while they may still come. */
static size_t tail(const char *r, size_t n, size_t e, const char *m, bool final)
{
    size_t j = skip_ws(r, n, e);
    if (starts(r + j, n - j, m))
        return j + strlen(m);
    if (!final && (j == n || prefix_of(r + j, n - j, m)))
        return SIZE_MAX;
    return e;
}

/* Appends {name, arguments: JSON text} to calls: args an object (written compact), a string (as
 * it is) or NULL ("{}"). -1: not a call. */
static int add_call(json_t *calls, const char *name, size_t nlen, json_t *args)
{
    while (nlen && ws(*name))
        name++, nlen--;
    while (nlen && ws(name[nlen - 1]))
        nlen--;
    if (!nlen || memchr(name, '\n', nlen) || (args && !json_is_object(args) && !json_is_string(args)))
        return -1;
    char *at = !args ? strdup("{}") : json_is_string(args) ? strdup(json_string_value(args))
                                                           : json_dumps(args, JSON_COMPACT);
    json_t *c = at ? json_pack("{s:s%,s:s}", "name", name, nlen, "arguments", at) : NULL;
    free(at);
    if (!c || json_array_append_new(calls, c))
        return -1;
    return 0;
}

/* An object {"name" (or "tool_name"), "arguments" (or "parameters")}. */
static int obj_call(json_t *calls, json_t *o)
{
    json_t *name = json_object_get(o, "name");
    if (!name)
        name = json_object_get(o, "tool_name");
    json_t *args = json_object_get(o, "arguments");
    if (!args)
        args = json_object_get(o, "parameters");
    if (!json_is_string(name))
        return -1;
    return add_call(calls, json_string_value(name), strlen(json_string_value(name)), args);
}

/* One such object, or an array of them. */
static int json_calls(json_t *calls, const char *s, size_t n)
{
    json_t *j = json_loadb(s, n, 0, NULL);
    int rc = json_is_object(j) ? obj_call(calls, j) : json_array_size(j) ? 0 : -1;
    for (size_t i = 0; json_is_array(j) && i < json_array_size(j) && !rc; i++)
        rc = obj_call(calls, json_array_get(j, i));
    json_decref(j);
    return rc;
}

/* A call whose arguments are the JSON object s[0, n). */
static int args_call(json_t *calls, const char *name, size_t nlen, const char *s, size_t n)
{
    json_t *j = json_loadb(s, n, 0, NULL);
    int rc = json_is_object(j) ? add_call(calls, name, nlen, j) : -1;
    json_decref(j);
    return rc;
}

/* Python keyword arguments, key="text", key=1, key=True, ..., as a JSON object; NULL if they
 * are not that. */
static json_t *py_kwargs(const char *s, size_t n)
{
    json_t *o = json_object();
    char *buf = malloc(n + 1);
    size_t i = skip_ws(s, n, 0);
    bool bad = !o || !buf;
    while (!bad && i < n) {
        char key[64];
        size_t k = 0;
        while (i < n && k < sizeof key - 1 && (s[i] == '_' || (s[i] >= 'a' && s[i] <= 'z') ||
                                               (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9')))
            key[k++] = s[i++];
        key[k] = 0;
        i = skip_ws(s, n, i);
        if ((bad = !k || i >= n || s[i] != '='))
            break;
        i = skip_ws(s, n, i + 1);
        json_t *v = NULL;
        if (i < n && (s[i] == '"' || s[i] == '\'')) {
            char q = s[i++];
            size_t b = 0;
            while (i < n && s[i] != q) {
                char c = s[i];
                if (c == '\\' && i + 1 < n) {
                    c = s[++i];
                    c = c == 'n' ? '\n' : c == 't' ? '\t' : c;
                }
                buf[b++] = c;
                i++;
            }
            if (i++ < n)
                v = json_stringn(buf, b);
        } else {
            size_t b = i;
            while (i < n && s[i] != ',')
                i++;
            size_t e = i;
            while (e > b && ws(s[e - 1]))
                e--;
            if (e - b == 4 && !memcmp(s + b, "True", 4))
                v = json_true();
            else if (e - b == 5 && !memcmp(s + b, "False", 5))
                v = json_false();
            else if (e - b == 4 && !memcmp(s + b, "None", 4))
                v = json_null();
            else if ((v = json_loadb(s + b, e - b, JSON_DECODE_ANY, NULL)) && !json_is_number(v))
                json_decref(v), v = NULL;
        }
        if ((bad = !v || json_object_set_new(o, key, v)))
            break;
        i = skip_ws(s, n, i);
        if (i < n && s[i] == ',')
            i = skip_ws(s, n, i + 1);
        else if ((bad = i < n))
            break;
    }
    free(buf);
    if (bad) {
        json_decref(o);
        o = NULL;
    }
    return o;
}

/* <function=name><parameter=key>value</parameter>...</function> as a call. */
static int xml_call(json_t *calls, const char *s, size_t n)
{
    const char *f = memmem(s, n, "<function=", 10), *end = s + n;
    const char *gt = f ? memchr(f, '>', (size_t)(end - f)) : NULL;
    if (!gt)
        return -1;
    json_t *args = json_object();
    const char *q = gt + 1, *fe = memmem(q, (size_t)(end - q), "</function>", 11);
    if (fe)
        end = fe;
    int rc = args ? 0 : -1;
    const char *pa;
    while (!rc && (pa = memmem(q, (size_t)(end - q), "<parameter=", 11))) {
        const char *k = pa + 11, *kg = memchr(k, '>', (size_t)(end - k));
        const char *v = kg ? kg + 1 : NULL;
        const char *ve = v ? memmem(v, (size_t)(end - v), "</parameter>", 12) : NULL;
        char key[128];
        if (!ve || (size_t)(kg - k) >= sizeof key) {
            rc = -1;
            break;
        }
        memcpy(key, k, (size_t)(kg - k));
        key[kg - k] = 0;
        while (v < ve && ws(*v))
            v++;
        size_t vl = (size_t)(ve - v);
        while (vl && ws(v[vl - 1]))
            vl--;
        json_t *val = json_loadb(v, vl, JSON_DECODE_ANY, NULL);
        if (!val || json_is_string(val)) {
            json_decref(val);
            val = json_stringn(v, vl);
        }
        rc = !val || json_object_set_new(args, key, val) ? -1 : 0;
        q = ve + 12;
    }
    if (!rc)
        rc = add_call(calls, f + 10, (size_t)(gt - f - 10), args);
    json_decref(args);
    return rc;
}

/* <|python_tag|> then, up to the end: a call object, name.call(kwargs) or code. */
static int python_tag(const char *r, size_t n, bool final, size_t *used, json_t *calls)
{
    size_t i = skip_ws(r, n, sizeof PYTAG - 1);
    if (i < n && r[i] == '{') {
        size_t e = json_close(r, n, i);
        if (!e && !final)
            return 0;
        *used = e ? e : n;
        return e && !json_calls(calls, r + i, e - i) ? 1 : -1;
    }
    if (!final)
        return 0;
    *used = n;
    size_t e = n;
    while (e > i && ws(r[e - 1]))
        e--;
    if (e == i)
        return -1;
    const char *dot = memmem(r + i, e - i, ".call(", 6);
    if (dot && r[e - 1] == ')') {
        size_t nl = (size_t)(dot - (r + i)), a = (size_t)(dot - r) + 6;
        json_t *kw = py_kwargs(r + a, e - 1 - a);
        int rc = kw ? add_call(calls, r + i, nl, kw) : -1;
        json_decref(kw);
        if (!rc)
            return 1;
    }
    json_t *code = json_pack("{s:s%}", "code", r + i, e - i);
    int rc = code ? add_call(calls, "python", 6, code) : -1;
    json_decref(code);
    return rc ? -1 : 1;
}

/* One region of calls at r (which opens with one of the format's markers). 1: parsed (*used
 * bytes, its calls appended, maybe none); -1: not calls (*used bytes stay content); 0: more text
 * is needed (never when final). */
static int parse_region(enum chat_fmt f, const char *r, size_t n, bool final, size_t *used,
                        json_t *calls)
{
#define NEED_OR_BAD(k) do { if (!final) return 0; *used = (k); return -1; } while (0)
    size_t i, b = 0, e = 0, t;
    int k;
    *used = n;
    switch (f) {
    case CHAT_FMT_LLAMA:
        if (r[0] == ';') {
            *used = 1;
            return 1;
        }
        if (starts(r, n, PYTAG))
            return python_tag(r, n, final, used, calls);
        if (!(e = json_close(r, n, 0)))
            NEED_OR_BAD(n);
        *used = e;
        return json_calls(calls, r, e) ? -1 : 1;
    case CHAT_FMT_MISTRAL: {
        i = skip_ws(r, n, sizeof "[TOOL_CALLS]" - 1);
        if (i == n)
            NEED_OR_BAD(n);
        if (r[i] == '[') { /* Nemo: a list */
            if ((k = json_after(r, n, i, "[", final, &b, &e, used)) <= 0)
                return k;
            *used = e;
            return json_calls(calls, r + b, e - b) ? -1 : 1;
        }
        const char *a = memmem(r + i, n - i, "[ARGS]", 6);
        if (!a)
            NEED_OR_BAD(n);
        size_t ne = (size_t)(a - r);
        const char *cid = memmem(r + i, ne - i, "[CALL_ID]", 9);
        if (cid)
            ne = (size_t)(cid - r);
        if ((k = json_after(r, n, (size_t)(a - r) + 6, "{", final, &b, &e, used)) <= 0)
            return k;
        *used = e;
        return args_call(calls, r + i, ne - i, r + b, e - b) ? -1 : 1;
    }
    case CHAT_FMT_DEEPSEEK: {
        if (starts(r, n, DS_CALLS) || starts(r, n, DS_CALLS_END)) {
            *used = starts(r, n, DS_CALLS) ? sizeof DS_CALLS - 1 : sizeof DS_CALLS_END - 1;
            return 1;
        }
        const char *body = r + sizeof DS_CALL - 1;
        size_t bn = n - (sizeof DS_CALL - 1);
        const char *end = memmem(body, bn, DS_CALL_END, sizeof DS_CALL_END - 1);
        if (!end && !final)
            return 0;
        size_t bl = end ? (size_t)(end - body) : bn;
        *used = (size_t)(body - r) + bl + (end ? sizeof DS_CALL_END - 1 : 0);
        const char *sep = memmem(body, bl, DS_SEP, sizeof DS_SEP - 1);
        if (!sep)
            return -1;
        const char *b = sep + sizeof DS_SEP - 1;
        size_t blen = (size_t)(body + bl - b);
        const char *fence = memmem(b, blen, "```json", 7);
        if (!fence) /* V3.1: name<sep>arguments */
            return args_call(calls, body, (size_t)(sep - body), b, blen) ? -1 : 1;
        /* R1: type<sep>name\n```json\narguments\n``` */
        const char *a = fence + 7, *close = memmem(a, (size_t)(b + blen - a), "```", 3);
        size_t al = close ? (size_t)(close - a) : (size_t)(b + blen - a);
        return args_call(calls, b, (size_t)(fence - b), a, al) ? -1 : 1;
    }
    case CHAT_FMT_COMMAND_R: {
        bool act = starts(r, n, "<|START_ACTION|>"), fenced = false;
        i = skip_ws(r, n, act ? sizeof "<|START_ACTION|>" - 1 : sizeof "Action:" - 1);
        if (!act && !final && prefix_of(r + i, n - i, "```json"))
            return 0;
        if (!act && (starts(r + i, n - i, "```json") || starts(r + i, n - i, "```"))) {
            i = skip_ws(r, n, i + (starts(r + i, n - i, "```json") ? 7 : 3));
            fenced = true;
        }
        if ((k = json_after(r, n, i, "[{", final, &b, &e, used)) <= 0)
            return k;
        t = act ? tail(r, n, e, "<|END_ACTION|>", final) : fenced ? tail(r, n, e, "```", final) : e;
        if (t == SIZE_MAX)
            return 0;
        *used = t;
        return json_calls(calls, r + b, e - b) ? -1 : 1;
    }
    case CHAT_FMT_FUNCTIONARY: {
        if (starts(r, n, PYTAG))
            return python_tag(r, n, final, used, calls);
        i = sizeof "<function=" - 1;
        const char *gt = memchr(r + i, '>', n - i);
        if (!gt)
            NEED_OR_BAD(n);
        if ((k = json_after(r, n, (size_t)(gt - r) + 1, "{", final, &b, &e, used)) <= 0)
            return k;
        if ((t = tail(r, n, e, "</function>", final)) == SIZE_MAX)
            return 0;
        *used = t;
        return args_call(calls, r + i, (size_t)(gt - r) - i, r + b, e - b) ? -1 : 1;
    }
    case CHAT_FMT_FUNCTIONARY2: {
        /* the first recipient follows the prompt's >>> */
        i = starts(r, n, ">>>") ? 3 : 0;
        const char *nl = memchr(r + i, '\n', n - i);
        if (!nl)
            NEED_OR_BAD(n);
        size_t nb = i, ne = (size_t)(nl - r);
        while (nb < ne && ws(r[nb]))
            nb++;
        while (ne > nb && ws(r[ne - 1]))
            ne--;
        if (ne - nb == 3 && !memcmp(r + nb, "all", 3)) {
            *used = (size_t)(nl - r) + 1; /* the text that follows is content */
            return 1;
        }
        size_t j = skip_ws(r, n, (size_t)(nl - r) + 1);
        if (ne - nb == 6 && !memcmp(r + nb, "python", 6) && (j == n || r[j] != '{')) {
            const char *next = memmem(r + j, n - j, ">>>", 3);
            if (!next && !final)
                return 0;
            size_t ce = next ? (size_t)(next - r) : n;
            *used = ce;
            while (ce > j && ws(r[ce - 1]))
                ce--;
            json_t *code = json_pack("{s:s%}", "code", r + j, ce - j);
            int rc = code ? add_call(calls, "python", 6, code) : -1;
            json_decref(code);
            return rc ? -1 : 1;
        }
        if ((k = json_after(r, n, j, "{", final, &b, &e, used)) <= 0)
            return k;
        *used = e;
        return args_call(calls, r + nb, ne - nb, r + b, e - b) ? -1 : 1;
    }
    case CHAT_FMT_SEED: {
        const char *end = memmem(r, n, "</seed:tool_call>", 17);
        if (!end && !final)
            return 0;
        size_t bl = end ? (size_t)(end - r) : n;
        *used = end ? bl + 17 : n;
        return xml_call(calls, r + 16, bl - 16) ? -1 : 1;
    }
    default: /* firefunction */
        if ((k = json_after(r, n, sizeof "functools" - 1, "[", final, &b, &e, used)) <= 0)
            return k;
        *used = e;
        return json_calls(calls, r + b, e - b) ? -1 : 1;
    }
#undef NEED_OR_BAD
}

static int emit_calls(struct chat_out *p, json_t *calls, chat_emit_fn emit, void *user)
{
    int rc = 0;
    for (size_t i = 0; i < json_array_size(calls) && !rc; i++) {
        json_t *c = json_array_get(calls, i);
        char id[64];
        snprintf(id, sizeof id, "%s_%d", p->id_prefix, p->n_calls);
        struct chat_tool_call tc = {p->n_calls, id, json_string_value(json_object_get(c, "name")),
                                    json_string_value(json_object_get(c, "arguments"))};
        p->n_calls++;
        rc = emit(user, CHAT_EV_TOOL_CALL, NULL, 0, &tc);
    }
    return rc;
}

static int say(struct chat_out *p, const char *s, size_t n, chat_emit_fn emit, void *user)
{
    if (!n)
        return 0;
    p->said = true;
    return emit(user, CHAT_EV_CONTENT, s, n, NULL);
}

/* S_XCONTENT and S_XTOOLS; *more: the state moved on (feed again). */
static int feed_calls(struct chat_out *p, const char *r, size_t n, bool final, chat_emit_fn emit,
                      void *user, bool *more)
{
    int rc;
    *more = false;
    bool on = p->tools || p->fmt == CHAT_FMT_FUNCTIONARY2; /* its recipients are there anyway */
    if (p->state == S_XCONTENT) {
        size_t ml = 0, at = on ? find_any(r, n, fmt_starts(p->fmt, false), &ml) : n;
        if (p->tools && p->fmt == CHAT_FMT_LLAMA && !p->said) { /* the message is the call */
            size_t w = skip_ws(r, n, 0);
            at = w < n && r[w] == '{' && w < at ? w : at;
        }
        size_t upto = at < n ? at : final || !on ? n : n - partial_any(r, n, fmt_starts(p->fmt, false));
        size_t keep = upto;
        if (on && !(final && at == n)) /* whitespace before a tool call is dropped */
            while (keep > 0 && ws(r[keep - 1]))
                keep--;
        if ((rc = say(p, r, keep, emit, user)))
            return rc;
        if (at < n) {
            p->pos += upto;
            p->state = S_XTOOLS;
            *more = true;
        } else {
            p->pos += keep;
        }
        return 0;
    }
    size_t w = skip_ws(r, n, 0);
    if (w == n) {
        if (final)
            p->pos += n;
        return 0;
    }
    r += w;
    n -= w;
    const char *const *ms = fmt_starts(p->fmt, true);
    bool hit = p->fmt == CHAT_FMT_FUNCTIONARY2 && !p->kind, part = false;
    for (const char *const *m = ms; *m; m++) {
        hit = hit || starts(r, n, *m);
        part = part || prefix_of(r, n, *m);
    }
    if (!hit && !final && part)
        return 0;
    *more = true;
    if (!hit) {
        p->pos += w;
        p->state = S_XCONTENT; /* text after the calls */
        return 0;
    }
    json_t *calls = json_array();
    if (!calls)
        return -ENOMEM;
    size_t used = n;
    int k = parse_region(p->fmt, r, n, final, &used, calls);
    p->kind = p->kind || k != 0;
    if (k > 0 && !p->tools && json_array_size(calls)) /* calls without tools are text */
        k = -1;
    if (k == 0) {
        *more = false;
        rc = 0;
    } else {
        rc = k > 0 ? emit_calls(p, calls, emit, user) : say(p, r, used, emit, user);
        p->pos += w + used;
        if (k < 0) /* what follows text continues it */
            p->state = S_XCONTENT;
    }
    json_decref(calls);
    return rc;
}

/* ---- gpt-oss (harmony): messages <|start|>assistant<|channel|>NAME[ to=...]<|message|>...<|end|> ---- */

enum { H_CONTENT, H_REASON, H_CALL };

static int feed_harmony(struct chat_out *p, const char *r, size_t n, bool final, chat_emit_fn emit,
                        void *user, bool *more)
{
    static const char *const head[] = {"<|channel|>", "<|start|>", NULL};
    static const char *const end[] = {"<|end|>", "<|call|>", "<|return|>", NULL};
    static const char MSG[] = "<|message|>";
    int rc = 0;
    size_t ml = 0, at;
    *more = false;
    switch (p->state) {
    case S_HTEXT: {
        at = find_any(r, n, head, &ml);
        size_t upto = at < n ? at : final ? n : n - partial_any(r, n, head);
        if ((rc = say(p, r, upto, emit, user)))
            return rc;
        p->pos += upto;
        if (at < n) {
            p->state = S_HHEAD;
            *more = true;
        }
        return 0;
    }
    case S_HHEAD: {
        const char *m = memmem(r, n, MSG, sizeof MSG - 1);
        if (!m) {
            if (final)
                p->pos += n; /* a header without a message says nothing */
            return 0;
        }
        size_t hl = (size_t)(m - r);
        const char *ch = memmem(r, hl, "<|channel|>", 11);
        const char *to = memmem(r, hl, "to=functions.", 13);
        p->kind = ch && starts(ch + 11, (size_t)(r + hl - ch - 11), "analysis") ? H_REASON : H_CONTENT;
        if (to && p->tools) {
            const char *nm = to + 13;
            size_t k = 0;
            while (nm + k < r + hl && !ws(nm[k]) && nm[k] != '<' && k < sizeof p->name - 1)
                k++;
            memcpy(p->name, nm, k);
            p->name[k] = 0;
            p->kind = H_CALL;
        }
        p->pos += hl + sizeof MSG - 1;
        p->state = S_HBODY;
        *more = true;
        return 0;
    }
    default:
        at = find_any(r, n, end, &ml);
        if (p->kind == H_CALL) {
            if (at == n && !final)
                return 0;
            json_t *calls = json_array();
            if (!calls)
                return -ENOMEM;
            rc = args_call(calls, p->name, strlen(p->name), r, at) ? say(p, r, at, emit, user)
                                                                   : emit_calls(p, calls, emit, user);
            json_decref(calls);
            if (rc)
                return rc;
        } else {
            size_t upto = at < n ? at : final ? n : n - partial_any(r, n, end);
            if (upto && (rc = p->kind == H_REASON ? emit(user, CHAT_EV_REASONING, r, upto, NULL)
                                                  : say(p, r, upto, emit, user)))
                return rc;
            if (at == n) {
                p->pos += upto;
                return 0;
            }
        }
        p->pos += at < n ? at + ml : n;
        p->state = S_HTEXT;
        *more = at < n;
        return 0;
    }
}

int chat_out_feed(struct chat_out *p, const char *text, size_t len, bool final, chat_emit_fn emit,
                  void *user)
{
    int rc = 0;
    if (!text) /* nothing generated yet: no buffer (len is 0) */
        text = "";
    while (p->pos < len || (final && p->state == S_START)) {
        const char *r = text + p->pos;
        size_t n = len - p->pos;
        switch (p->state) {
        case S_START:
            if (n >= strlen(p->think) && !memcmp(r, p->think, strlen(p->think))) {
                p->pos += strlen(p->think);
                p->state = S_REASON_START;
            } else if (!final && prefix_of(r, n, p->think)) {
                return 0;
            } else {
                p->state = p->fmt == CHAT_FMT_HERMES ? S_CONTENT : S_XCONTENT;
            }
            if (final && n == 0)
                return 0;
            break;
        case S_REASON_START: case S_CONTENT_START:
            while (p->pos < len && ws(text[p->pos]))
                p->pos++;
            if (p->pos == len)
                return 0;
            p->state = p->state == S_REASON_START ? S_REASON
                       : p->fmt == CHAT_FMT_HERMES ? S_CONTENT : S_XCONTENT;
            break;
        case S_REASON: {
            const char *hit = memmem(r, n, p->think_end, strlen(p->think_end));
            size_t upto = hit ? (size_t)(hit - r) : final ? n : n - partial_tag(r, n, p->think_end);
            size_t keep = upto;
            while (keep > 0 && ws(r[keep - 1])) /* trailing whitespace waits for more text */
                keep--;
            if (keep && (rc = emit(user, CHAT_EV_REASONING, r, keep, NULL)))
                return rc;
            if (hit) {
                p->pos += upto + strlen(p->think_end);
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
        case S_XCONTENT: case S_XTOOLS: case S_HTEXT: case S_HHEAD: case S_HBODY: {
            bool more;
            rc = p->state >= S_HTEXT ? feed_harmony(p, r, n, final, emit, user, &more)
                                     : feed_calls(p, r, n, final, emit, user, &more);
            if (rc || !more)
                return rc;
            break;
        }
        }
    }
    return 0;
}
