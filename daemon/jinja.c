/* Jinja evaluator; see jinja.h. Semantics follow Python's jinja2 as Hugging Face configures it
 * (default Undefined: prints as '', iterates as empty, fails on attribute access; immutable
 * sandbox: no list.append or dict.update). */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/jinja.h"
#include "daemon/jinja_int.h"
#include "store/err.h"

#define MAX_EVAL_DEPTH 1000
#define MAX_VALUE_DEPTH 512

struct scope {
    struct jdict vars;
    struct scope *parent;
};

struct obuf {
    char *s;
    uint8_t *m;
    size_t len, cap;
};

struct jloop {
    const jval *items;
    size_t i, n;
    const struct jnode *node; /* the for (a recursive one runs again through loop(items)) */
    struct scope *scope;      /* where it runs */
    unsigned depth;           /* 0 at the top, 1 in loop(...), ... */
    jval changed;             /* loop.changed's last arguments (V_UNDEF: none yet) */
};

struct jmacro {
    const struct jnode *n;
    struct scope *env;
};

struct jmethod {
    jval self;
    const char *name;
};

/* joiner(sep): '' when first called, then sep; cycler(items...): next() gives the current item
 * and moves on, current is it, reset() goes back to the first. */
struct jobj {
    bool cycler, used;
    jval sep;
    jval *items;
    size_t n, pos;
};

enum { F_RANGE, F_NAMESPACE, F_RAISE, F_STRFTIME, F_DICT, F_JOINER, F_CYCLER };
static const char *const func_names[] = {"range", "namespace", "raise_exception", "strftime_now",
                                         "dict", "joiner", "cycler", NULL};

struct rctx {
    struct jbase b;
    size_t max_output, max_iter, iters;
    unsigned max_depth, depth, edepth;
    struct scope *root;
    bool brk, cont;
    time_t now;
    bool now_utc;
};

#define DIE(R, line, ...) j_die(&(R)->b, MOE_EFORMAT, line, __VA_ARGS__)

static const jval UNDEF = {.t = V_UNDEF};
static const jval NONE = {.t = V_NONE};

static jval mkbool(bool b) { return (jval){.t = V_BOOL, .u.b = b}; }
static jval mkint(int64_t i) { return (jval){.t = V_INT, .u.i = i}; }
static jval mkfloat(double f) { return (jval){.t = V_FLOAT, .u.f = f}; }
static jval undef_named(const char *n) { return (jval){.t = V_UNDEF, .u.uname = n}; }

static bool is(const char *a, const char *b) { return !strcmp(a, b); }

/* ---- Strings ---- */

static struct jstr *mkjstr(struct rctx *R, const char *s, size_t n, uint8_t prov, const uint8_t *m)
{
    struct jstr *js = j_alloc(&R->b, sizeof *js);
    js->s = s;
    js->len = n;
    js->prov = prov;
    js->m = prov == PROV_MIX ? m : NULL;
    js->markup = false;
    return js;
}

static jval vstr(struct jstr *s) { return (jval){.t = V_STR, .u.s = s}; }

static jval cstr(struct rctx *R, const char *s)
{
    size_t n = strlen(s);
    return vstr(mkjstr(R, j_strndup(&R->b, s, n), n, PROV_LIT, NULL));
}

static uint8_t sbit(const struct jstr *s, size_t i)
{
    return s->prov == PROV_MIX ? s->m[i] : s->prov;
}

static struct jstr *jsub(struct rctx *R, const struct jstr *s, size_t off, size_t n)
{
    if (off > s->len)
        off = s->len;
    if (n > s->len - off)
        n = s->len - off;
    return mkjstr(R, s->s + off, n, s->prov, s->prov == PROV_MIX ? s->m + off : NULL);
}

/* ---- Output buffers (text plus one provenance byte per byte) ---- */

static void ob_reserve(struct rctx *R, struct obuf *o, size_t add)
{
    if (add > R->max_output || o->len + add > R->max_output)
        j_die(&R->b, MOE_ETOOBIG, 0, "the output is longer than %zu bytes", R->max_output);
    if (o->len + add <= o->cap)
        return;
    size_t nc = o->cap ? o->cap * 2 : 256;
    while (nc < o->len + add)
        nc *= 2;
    char *ns = j_alloc(&R->b, nc + 1);
    uint8_t *nm = j_alloc(&R->b, nc);
    if (o->len) {
        memcpy(ns, o->s, o->len);
        memcpy(nm, o->m, o->len);
    }
    o->s = ns;
    o->m = nm;
    o->cap = nc;
}

static void ob_put(struct rctx *R, struct obuf *o, const char *s, size_t n, uint8_t bit)
{
    if (!n)
        return;
    ob_reserve(R, o, n);
    memcpy(o->s + o->len, s, n);
    memset(o->m + o->len, bit, n);
    o->len += n;
}

static void ob_lit(struct rctx *R, struct obuf *o, const char *s) { ob_put(R, o, s, strlen(s), 0); }

static void ob_str(struct rctx *R, struct obuf *o, const struct jstr *s)
{
    if (!s->len)
        return;
    ob_reserve(R, o, s->len);
    memcpy(o->s + o->len, s->s, s->len);
    if (s->prov == PROV_MIX)
        memcpy(o->m + o->len, s->m, s->len);
    else
        memset(o->m + o->len, s->prov, s->len);
    o->len += s->len;
}

static struct jstr *ob_done(struct rctx *R, struct obuf *o)
{
    bool any0 = false, any1 = false;
    for (size_t i = 0; i < o->len; i++) {
        if (o->m[i])
            any1 = true;
        else
            any0 = true;
    }
    uint8_t prov = any1 ? (any0 ? PROV_MIX : PROV_DATA) : PROV_LIT;
    if (!o->s)
        return mkjstr(R, "", 0, PROV_LIT, NULL);
    o->s[o->len] = 0;
    return mkjstr(R, o->s, o->len, prov, o->m);
}

static struct jstr *jcat(struct rctx *R, const struct jstr *a, const struct jstr *b)
{
    if (!a->len)
        return (struct jstr *)b;
    if (!b->len)
        return (struct jstr *)a;
    struct obuf o = {0};
    ob_str(R, &o, a);
    ob_str(R, &o, b);
    return ob_done(R, &o);
}

/* ---- UTF-8 ---- */

static size_t u8_next(const char *s, size_t n, size_t i)
{
    i++;
    while (i < n && ((unsigned char)s[i] & 0xc0) == 0x80)
        i++;
    return i;
}

static size_t u8_count(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xc0) != 0x80)
            c++;
    return c;
}

static uint32_t u8_cp(const char *s, size_t n, size_t i, size_t *next)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t e = u8_next(s, n, i);
    *next = e;
    uint32_t c = p[i];
    if (c < 0x80 || e - i == 1)
        return c;
    int k = (int)(e - i);
    c &= k == 2 ? 0x1f : k == 3 ? 0x0f : 0x07;
    for (size_t j = i + 1; j < e; j++)
        c = (c << 6) | (p[j] & 0x3f);
    return c;
}

/* Byte offsets of every code point start, plus the end. */
static size_t *u8_offsets(struct rctx *R, const struct jstr *s, size_t *n)
{
    size_t c = u8_count(s->s, s->len);
    size_t *o = j_alloc(&R->b, (c + 1) * sizeof *o);
    size_t k = 0;
    for (size_t i = 0; i < s->len; i = u8_next(s->s, s->len, i))
        o[k++] = i;
    o[k] = s->len;
    *n = k;
    return o;
}

static bool py_space(uint32_t c)
{
    return c == ' ' || (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

/* ---- Dicts and scopes ---- */

static bool vequal(const jval *a, const jval *b, int depth);

static jval *d_find(const struct jdict *d, const jval *k)
{
    for (size_t i = 0; i < d->n; i++)
        if (vequal(&d->k[i], k, 0))
            return &d->v[i];
    return NULL;
}

static jval *d_find_s(const struct jdict *d, const char *k)
{
    size_t n = strlen(k);
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == V_STR && d->k[i].u.s->len == n && !memcmp(d->k[i].u.s->s, k, n))
            return &d->v[i];
    return NULL;
}

static void d_set(struct rctx *R, struct jdict *d, jval k, jval v)
{
    jval *e = d_find(d, &k);
    if (e) {
        *e = v;
        return;
    }
    if (d->n == d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 4;
        jval *nk = j_alloc(&R->b, nc * sizeof *nk), *nv = j_alloc(&R->b, nc * sizeof *nv);
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof *nk);
            memcpy(nv, d->v, d->n * sizeof *nv);
        }
        d->k = nk;
        d->v = nv;
        d->cap = nc;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}

static void d_set_s(struct rctx *R, struct jdict *d, const char *k, jval v)
{
    jval *e = d_find_s(d, k);
    if (e) {
        *e = v;
        return;
    }
    d_set(R, d, vstr(mkjstr(R, k, strlen(k), PROV_LIT, NULL)), v);
}

static struct scope *new_scope(struct rctx *R, struct scope *parent)
{
    struct scope *s = j_zalloc(&R->b, sizeof *s);
    s->parent = parent;
    return s;
}

static jval lookup(struct rctx *R, struct scope *s, const char *name)
{
    (void)R;
    for (; s; s = s->parent) {
        jval *v = d_find_s(&s->vars, name);
        if (v)
            return *v;
    }
    for (int i = 0; func_names[i]; i++)
        if (is(func_names[i], name))
            return (jval){.t = V_FUNC, .u.fn = i};
    return undef_named(name);
}

static jval mklist(struct rctx *R, size_t n, bool tuple)
{
    struct jlist *l = j_zalloc(&R->b, sizeof *l);
    l->v = n ? j_alloc(&R->b, n * sizeof *l->v) : NULL;
    l->n = n;
    l->tuple = tuple;
    return (jval){.t = V_LIST, .u.l = l};
}

static jval mkdict(struct rctx *R)
{
    return (jval){.t = V_DICT, .u.d = j_zalloc(&R->b, sizeof(struct jdict))};
}

/* ---- Type names, truth, numbers ---- */

static const char *tname(const jval *v)
{
    switch (v->t) {
    case V_UNDEF: return "Undefined";
    case V_NONE: return "NoneType";
    case V_BOOL: return "bool";
    case V_INT: return "int";
    case V_FLOAT: return "float";
    case V_STR: return "str";
    case V_LIST: return v->u.l->range ? "range" : v->u.l->tuple ? "tuple" : "list";
    case V_DICT: return "dict";
    case V_NS: return "Namespace";
    case V_LOOP: return "LoopContext";
    case V_MACRO: return "Macro";
    case V_OBJ: return v->u.ob->cycler ? "Cycler" : "Joiner";
    default: return "function";
    }
}

static bool truthy(const jval *v)
{
    switch (v->t) {
    case V_UNDEF: case V_NONE: return false;
    case V_BOOL: return v->u.b;
    case V_INT: return v->u.i != 0;
    case V_FLOAT: return v->u.f != 0;
    case V_STR: return v->u.s->len != 0;
    case V_LIST: return v->u.l->n != 0;
    case V_DICT: return v->u.d->n != 0;
    default: return true;
    }
}

static bool is_num(const jval *v) { return v->t == V_INT || v->t == V_FLOAT || v->t == V_BOOL; }
static bool is_intlike(const jval *v) { return v->t == V_INT || v->t == V_BOOL; }
static int64_t ival(const jval *v) { return v->t == V_BOOL ? v->u.b : v->u.i; }
static double fval(const jval *v) { return v->t == V_FLOAT ? v->u.f : (double)ival(v); }

/* An undefined value's name is a variable's, or (starting with \1) the whole message jinja2 gives
 * for a missing attribute or item. */
static _Noreturn void undefined_error(struct rctx *R, int line, const jval *v)
{
    if (v->u.uname && v->u.uname[0] == '\1')
        DIE(R, line, "%s", v->u.uname + 1);
    if (v->u.uname)
        DIE(R, line, "'%s' is undefined", v->u.uname);
    DIE(R, line, "a value is undefined");
}

/* jinja2's object_type_repr: how its messages name the type of a value ("dict object", "None"). */
static const char *type_repr(struct rctx *R, const jval *v)
{
    const char *t;
    switch (v->t) {
    case V_NONE: return "None";
    case V_NS: t = "jinja2.utils.Namespace"; break;
    case V_LOOP: t = "jinja2.runtime.LoopContext"; break;
    case V_MACRO: t = "jinja2.runtime.Macro"; break;
    case V_FUNC: case V_METHOD: t = "builtin_function_or_method"; break;
    case V_OBJ: t = v->u.ob->cycler ? "jinja2.utils.Cycler" : "jinja2.utils.Joiner"; break;
    default: t = tname(v);
    }
    size_t n = strlen(t) + 8;
    char *m = j_alloc(&R->b, n);
    snprintf(m, n, "%s object", t);
    return m;
}

/* The undefined value of obj.name, for jinja2's message: 'dict object' has no attribute 'x'. */
static jval undef_attr(struct rctx *R, const jval *obj, const char *name)
{
    const char *t = type_repr(R, obj);
    size_t n = strlen(t) + strlen(name) + 32;
    char *m = j_alloc(&R->b, n);
    snprintf(m, n, "\1'%s' has no attribute '%s'", t, name);
    return undef_named(m);
}

static struct jstr *repr_of(struct rctx *R, const jval *v);
static void line_end(const struct jstr *s, size_t i, size_t *end, size_t *next);

/* The undefined value of obj[key] for a key that is not a name: list object has no element 5. */
static jval undef_elem(struct rctx *R, const jval *obj, const jval *key)
{
    const char *t = type_repr(R, obj);
    const struct jstr *k = repr_of(R, key);
    int kl = k->len > 200 ? 200 : (int)k->len;
    size_t n = strlen(t) + (size_t)kl + 32;
    char *m = j_alloc(&R->b, n);
    snprintf(m, n, "\1%s has no element %.*s", t, kl, k->s);
    return undef_named(m);
}

/* Python's repr of a float: the shortest digits that read back the same. */
static void fmt_float(double x, char *out, size_t cap)
{
    if (isnan(x)) { snprintf(out, cap, "nan"); return; }
    if (isinf(x)) { snprintf(out, cap, x < 0 ? "-inf" : "inf"); return; }
    char buf[40];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, x);
        if (strtod(buf, NULL) == x)
            break;
    }
    char digits[24];
    size_t nd = 0;
    const char *c = buf;
    bool neg = *c == '-';
    if (neg)
        c++;
    for (; *c && *c != 'e'; c++)
        if (*c >= '0' && *c <= '9')
            digits[nd++] = *c;
    int e = atoi(c + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    size_t k = 0;
    char *o = out;
    if (neg)
        o[k++] = '-';
    if (e >= -4 && e < 16) { /* as repr: 0.0001, 1e-05, 1e+16 */
        if (e >= 0) {
            for (int i = 0; i <= e; i++)
                o[k++] = (size_t)i < nd ? digits[i] : '0';
            o[k++] = '.';
            if ((size_t)e + 1 < nd)
                for (size_t i = (size_t)e + 1; i < nd; i++)
                    o[k++] = digits[i];
            else
                o[k++] = '0';
        } else {
            o[k++] = '0';
            o[k++] = '.';
            for (int i = 0; i < -e - 1; i++)
                o[k++] = '0';
            for (size_t i = 0; i < nd; i++)
                o[k++] = digits[i];
        }
        o[k] = 0;
    } else {
        o[k++] = digits[0];
        if (nd > 1) {
            o[k++] = '.';
            for (size_t i = 1; i < nd; i++)
                o[k++] = digits[i];
        }
        snprintf(o + k, cap - k, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    }
}

/* ---- repr, str, tojson ---- */

/* The escape that Python's repr and json.dumps share for c (q: the quote), or NULL. */
static const char *short_escape(unsigned char c, char q, char *e)
{
    if (c == '\\' || c == (unsigned char)q) {
        e[0] = '\\';
        e[1] = (char)c;
        e[2] = 0;
        return e;
    }
    return c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : NULL;
}

#include "daemon/jinja_printable.h"

/* Whether Python's repr writes cp as an escape (cp is not printable). */
static bool repr_escapes(uint32_t cp)
{
    size_t lo = 0, hi = sizeof jprint_escaped / sizeof jprint_escaped[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < jprint_escaped[mid][0])
            hi = mid;
        else if (cp > jprint_escaped[mid][1])
            lo = mid + 1;
        else
            return true;
    }
    return false;
}

static void repr_str(struct rctx *R, struct obuf *o, const struct jstr *s)
{
    bool sq = memchr(s->s, '\'', s->len) != NULL, dq = memchr(s->s, '"', s->len) != NULL;
    char q = sq && !dq ? '"' : '\'';
    ob_put(R, o, &q, 1, 0);
    for (size_t i = 0; i < s->len; i++) {
        unsigned char c = (unsigned char)s->s[i];
        uint8_t bit = sbit(s, i);
        char e[8];
        const char *se = short_escape(c, q, e);
        if (se) {
            ob_put(R, o, se, strlen(se), bit);
        } else if (c < 0x20 || c == 0x7f) {
            snprintf(e, sizeof e, "\\x%02x", c);
            ob_put(R, o, e, 4, bit);
        } else if (c >= 0x80) { /* \xa0, \u200b, \U000e0001 where not printable */
            size_t next;
            uint32_t cp = u8_cp(s->s, s->len, i, &next);
            if (next - i >= 2 && next - i <= 4 && cp <= 0x10ffff && repr_escapes(cp)) {
                char u[12];
                int k = snprintf(u, sizeof u, cp <= 0xff ? "\\x%02x" : cp <= 0xffff ? "\\u%04x" : "\\U%08x", cp);
                ob_put(R, o, u, (size_t)k, bit);
            } else {
                for (size_t j = i; j < next; j++)
                    ob_put(R, o, &s->s[j], 1, sbit(s, j));
            }
            i = next - 1;
        } else {
            ob_put(R, o, (const char *)&s->s[i], 1, bit);
        }
    }
    ob_put(R, o, &q, 1, 0);
}

static void write_str(struct rctx *R, struct obuf *o, const jval *v, bool repr, int depth);

static void write_repr(struct rctx *R, struct obuf *o, const jval *v, int depth)
{
    write_str(R, o, v, true, depth);
}

/* Python str() (repr when repr is set) of v appended to o. */
static void write_str(struct rctx *R, struct obuf *o, const jval *v, bool repr, int depth)
{
    if (depth > MAX_VALUE_DEPTH)
        DIE(R, 0, "a value is nested more than %d deep", MAX_VALUE_DEPTH);
    char buf[48];
    switch (v->t) {
    case V_UNDEF: if (repr) ob_lit(R, o, "Undefined"); return;
    case V_NONE: ob_lit(R, o, "None"); return;
    case V_BOOL: ob_lit(R, o, v->u.b ? "True" : "False"); return;
    case V_INT: snprintf(buf, sizeof buf, "%lld", (long long)v->u.i); ob_lit(R, o, buf); return;
    case V_FLOAT: fmt_float(v->u.f, buf, sizeof buf); ob_lit(R, o, buf); return;
    case V_STR:
        if (repr)
            repr_str(R, o, v->u.s);
        else
            ob_str(R, o, v->u.s);
        return;
    case V_LIST: {
        const struct jlist *l = v->u.l;
        if (l->range) { /* range(start, stop) or range(start, stop, step) */
            for (int k = 0; k < 3; k++) {
                if (k == 2 && l->range[2] == 1)
                    break;
                snprintf(buf, sizeof buf, "%s%lld", k ? ", " : "range(", (long long)l->range[k]);
                ob_lit(R, o, buf);
            }
            ob_lit(R, o, ")");
            return;
        }
        ob_lit(R, o, l->tuple ? "(" : "[");
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                ob_lit(R, o, ", ");
            write_repr(R, o, &l->v[i], depth + 1);
        }
        ob_lit(R, o, l->tuple ? (l->n == 1 ? ",)" : ")") : "]");
        return;
    }
    case V_DICT: case V_NS: {
        const struct jdict *d = v->u.d;
        ob_lit(R, o, v->t == V_NS ? "<Namespace {" : "{");
        for (size_t i = 0; i < d->n; i++) {
            if (i)
                ob_lit(R, o, ", ");
            write_repr(R, o, &d->k[i], depth + 1);
            ob_lit(R, o, ": ");
            write_repr(R, o, &d->v[i], depth + 1);
        }
        ob_lit(R, o, v->t == V_NS ? "}>" : "}");
        return;
    }
    case V_LOOP:
        snprintf(buf, sizeof buf, "<LoopContext %zu/%zu>", v->u.lp->i + 1, v->u.lp->n);
        ob_lit(R, o, buf);
        return;
    case V_MACRO:
        ob_lit(R, o, "<Macro '");
        ob_lit(R, o, v->u.mac->n->name);
        ob_lit(R, o, "'>");
        return;
    case V_OBJ:
        ob_lit(R, o, v->u.ob->cycler ? "<jinja2.utils.Cycler object>" : "<jinja2.utils.Joiner object>");
        return;
    default:
        ob_lit(R, o, "<built-in function>");
    }
}

static struct jstr *to_str(struct rctx *R, const jval *v)
{
    if (v->t == V_STR)
        return v->u.s;
    struct obuf o = {0};
    write_str(R, &o, v, false, 0);
    return ob_done(R, &o);
}

struct json_fmt {
    const char *indent; /* NULL: none */
    const char *item_sep, *key_sep;
    bool sort_keys, ascii;
};

static void json_str(struct rctx *R, struct obuf *o, const struct jstr *s, bool ascii)
{
    ob_put(R, o, "\"", 1, 0);
    for (size_t i = 0; i < s->len;) {
        unsigned char c = (unsigned char)s->s[i];
        uint8_t bit = sbit(s, i);
        char e[16];
        const char *se = short_escape(c, '"', e);
        if (se) {
            ob_put(R, o, se, strlen(se), bit);
        } else if (c == '\b') {
            ob_put(R, o, "\\b", 2, bit);
        } else if (c == '\f') {
            ob_put(R, o, "\\f", 2, bit);
        } else if (c < 0x20) {
            snprintf(e, sizeof e, "\\u%04x", c);
            ob_put(R, o, e, 6, bit);
        } else if (c >= 0x80 && ascii) {
            size_t nx;
            uint32_t cp = u8_cp(s->s, s->len, i, &nx);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(e, sizeof e, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
            } else {
                snprintf(e, sizeof e, "\\u%04x", cp);
            }
            ob_put(R, o, e, strlen(e), bit);
            i = nx;
            continue;
        } else {
            ob_put(R, o, (const char *)&s->s[i], 1, bit);
        }
        i++;
    }
    ob_put(R, o, "\"", 1, 0);
}

static void json_nl(struct rctx *R, struct obuf *o, const struct json_fmt *f, int level)
{
    ob_lit(R, o, "\n");
    for (int i = 0; i < level; i++)
        ob_lit(R, o, f->indent);
}

static int cmp_str(const struct jstr *a, const struct jstr *b)
{
    size_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->s, b->s, n);
    return c ? c : (a->len > b->len) - (a->len < b->len);
}

static void json_write(struct rctx *R, struct obuf *o, const jval *v, const struct json_fmt *f,
                       int level, int line)
{
    if (level > MAX_VALUE_DEPTH)
        DIE(R, line, "a value is nested more than %d deep", MAX_VALUE_DEPTH);
    char buf[48];
    switch (v->t) {
    case V_NONE: ob_lit(R, o, "null"); return;
    case V_BOOL: ob_lit(R, o, v->u.b ? "true" : "false"); return;
    case V_INT: snprintf(buf, sizeof buf, "%lld", (long long)v->u.i); ob_lit(R, o, buf); return;
    case V_FLOAT:
        if (isnan(v->u.f))
            ob_lit(R, o, "NaN");
        else if (isinf(v->u.f))
            ob_lit(R, o, v->u.f < 0 ? "-Infinity" : "Infinity");
        else {
            fmt_float(v->u.f, buf, sizeof buf);
            ob_lit(R, o, buf);
        }
        return;
    case V_STR: json_str(R, o, v->u.s, f->ascii); return;
    case V_LIST: {
        const struct jlist *l = v->u.l;
        if (l->range)
            DIE(R, line, "tojson: object of type range is not JSON serializable");
        if (!l->n) {
            ob_lit(R, o, "[]");
            return;
        }
        ob_lit(R, o, "[");
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                ob_lit(R, o, f->item_sep);
            if (f->indent)
                json_nl(R, o, f, level + 1);
            json_write(R, o, &l->v[i], f, level + 1, line);
        }
        if (f->indent)
            json_nl(R, o, f, level);
        ob_lit(R, o, "]");
        return;
    }
    case V_DICT: {
        const struct jdict *d = v->u.d;
        if (!d->n) {
            ob_lit(R, o, "{}");
            return;
        }
        size_t *ord = j_alloc(&R->b, d->n * sizeof *ord);
        for (size_t i = 0; i < d->n; i++)
            ord[i] = i;
        if (f->sort_keys) /* insertion sort: stable, and dicts are small */
            for (size_t i = 1; i < d->n; i++)
                for (size_t j = i; j > 0; j--) {
                    const jval *a = &d->k[ord[j - 1]], *b = &d->k[ord[j]];
                    if (a->t != V_STR || b->t != V_STR)
                        DIE(R, line, "tojson(sort_keys=true) needs string keys");
                    if (cmp_str(a->u.s, b->u.s) <= 0)
                        break;
                    size_t t = ord[j];
                    ord[j] = ord[j - 1];
                    ord[j - 1] = t;
                }
        ob_lit(R, o, "{");
        for (size_t i = 0; i < d->n; i++) {
            const jval *k = &d->k[ord[i]];
            if (i)
                ob_lit(R, o, f->item_sep);
            if (f->indent)
                json_nl(R, o, f, level + 1);
            if (k->t == V_STR) {
                json_str(R, o, k->u.s, f->ascii);
            } else if (k->t == V_INT || k->t == V_FLOAT || k->t == V_BOOL || k->t == V_NONE) {
                ob_lit(R, o, "\"");
                json_write(R, o, k, f, level + 1, line);
                ob_lit(R, o, "\"");
            } else {
                DIE(R, line, "tojson: keys must be str, int, float, bool or None, not %s", tname(k));
            }
            ob_lit(R, o, f->key_sep);
            json_write(R, o, &d->v[ord[i]], f, level + 1, line);
        }
        if (f->indent)
            json_nl(R, o, f, level);
        ob_lit(R, o, "}");
        return;
    }
    default:
        DIE(R, line, "tojson: object of type %s is not JSON serializable", tname(v));
    }
}

/* ---- Equality and ordering ---- */

static bool vequal(const jval *a, const jval *b, int depth)
{
    if (depth > MAX_VALUE_DEPTH)
        return false;
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b))
            return ival(a) == ival(b);
        return fval(a) == fval(b);
    }
    if (a->t != b->t)
        return false;
    switch (a->t) {
    case V_UNDEF: case V_NONE: return true;
    case V_STR: return a->u.s->len == b->u.s->len && !memcmp(a->u.s->s, b->u.s->s, a->u.s->len);
    case V_LIST: {
        const struct jlist *x = a->u.l, *y = b->u.l;
        if (x->n != y->n || x->tuple != y->tuple || !x->range != !y->range) /* ranges: as sequences */
            return false;
        for (size_t i = 0; i < x->n; i++)
            if (!vequal(&x->v[i], &y->v[i], depth + 1))
                return false;
        return true;
    }
    case V_DICT: {
        const struct jdict *x = a->u.d, *y = b->u.d;
        if (x->n != y->n)
            return false;
        for (size_t i = 0; i < x->n; i++) {
            jval *o = d_find(y, &x->k[i]);
            if (!o || !vequal(&x->v[i], o, depth + 1))
                return false;
        }
        return true;
    }
    case V_NS: return a->u.d == b->u.d;
    case V_MACRO: return a->u.mac->n == b->u.mac->n;
    case V_FUNC: return a->u.fn == b->u.fn;
    case V_OBJ: return a->u.ob == b->u.ob;
    default: return false;
    }
}

static int vcompare(struct rctx *R, const jval *a, const jval *b, int line, int depth)
{
    if (depth > MAX_VALUE_DEPTH)
        DIE(R, line, "a value is nested more than %d deep", MAX_VALUE_DEPTH);
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b))
            return (ival(a) > ival(b)) - (ival(a) < ival(b));
        double x = fval(a), y = fval(b);
        return (x > y) - (x < y);
    }
    if (a->t == V_STR && b->t == V_STR)
        return cmp_str(a->u.s, b->u.s);
    if (a->t == V_LIST && b->t == V_LIST) {
        const struct jlist *x = a->u.l, *y = b->u.l;
        for (size_t i = 0; i < x->n && i < y->n; i++) {
            if (vequal(&x->v[i], &y->v[i], depth + 1))
                continue;
            return vcompare(R, &x->v[i], &y->v[i], line, depth + 1);
        }
        return (x->n > y->n) - (x->n < y->n);
    }
    if (a->t == V_UNDEF)
        undefined_error(R, line, a);
    if (b->t == V_UNDEF)
        undefined_error(R, line, b);
    DIE(R, line, "'<' is not supported between '%s' and '%s'", tname(a), tname(b));
}

/* ---- Iteration ---- */

static jval as_list(struct rctx *R, const jval *v, int line)
{
    switch (v->t) {
    case V_UNDEF: return mklist(R, 0, false);
    case V_LIST: return *v;
    case V_DICT: {
        jval l = mklist(R, v->u.d->n, false);
        for (size_t i = 0; i < v->u.d->n; i++)
            l.u.l->v[i] = v->u.d->k[i];
        return l;
    }
    case V_STR: {
        size_t n, *off = u8_offsets(R, v->u.s, &n);
        jval l = mklist(R, n, false);
        for (size_t i = 0; i < n; i++)
            l.u.l->v[i] = vstr(jsub(R, v->u.s, off[i], off[i + 1] - off[i]));
        return l;
    }
    default:
        DIE(R, line, "'%s' object is not iterable", tname(v));
    }
}

static void count_iter(struct rctx *R, int line)
{
    if (++R->iters > R->max_iter)
        j_die(&R->b, MOE_ETOOBIG, line, "more than %zu loop iterations and calls", R->max_iter);
}

/* ---- Attributes and items ---- */

static const char *const str_methods[] = {
    "startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip", "replace", "upper",
    "lower", "title", "capitalize", "join", "find", "rfind", "count", "splitlines", "format",
    "isdigit", "isalpha", "isalnum", "isspace", "isupper", "islower", "removeprefix",
    "removesuffix", "index", "center", "ljust", "rjust", "zfill", "rindex", "partition", "rpartition",
    "isascii",
    /* Python's, not implemented: calling one fails with "str.x() is not supported" */
    "casefold", "swapcase", "expandtabs", "encode", "format_map", "isnumeric", "isdecimal", "istitle",
    "isidentifier", "isprintable", "translate", "maketrans", NULL};
static const char *const dict_methods[] = {"get", "items", "keys", "values", "copy", NULL};
static const char *const list_methods[] = {"index", "count", "copy", NULL};
/* The methods that modify: as in jinja2's immutable sandbox, the attribute is undefined (even
 * where a dict has such a key), and calling it fails. */
static const char *const dict_modifying[] = {"pop", "update", "clear", "setdefault", "popitem", NULL};
static const char *const list_modifying[] = {"append", "extend", "insert", "pop", "remove", "reverse",
                                             "sort", "clear", NULL};

static bool in_names(const char *const *names, const char *n)
{
    for (int i = 0; names[i]; i++)
        if (is(names[i], n))
            return true;
    return false;
}

static jval method(struct rctx *R, jval self, const char *name)
{
    struct jmethod *m = j_alloc(&R->b, sizeof *m);
    m->self = self;
    m->name = name;
    return (jval){.t = V_METHOD, .u.me = m};
}

static jval modifying_method(struct rctx *R, const char *type, const char *name)
{
    size_t n = 2 * strlen(type) + strlen(name) + 64;
    char *m = j_alloc(&R->b, n);
    snprintf(m, n, "\1%s.%s() modifies the %s, which templates may not do", type, name, type);
    return undef_named(m);
}

static jval get_attr(struct rctx *R, jval obj, const char *name, int line)
{
    switch (obj.t) {
    case V_UNDEF:
        undefined_error(R, line, &obj);
    case V_DICT: {
        if (in_names(dict_methods, name))
            return method(R, obj, name);
        if (in_names(dict_modifying, name))
            return modifying_method(R, "dict", name);
        jval *v = d_find_s(obj.u.d, name);
        return v ? *v : undef_attr(R, &obj, name);
    }
    case V_NS: {
        jval *v = d_find_s(obj.u.d, name);
        return v ? *v : undef_attr(R, &obj, name);
    }
    case V_STR:
        return in_names(str_methods, name) ? method(R, obj, name) : undef_attr(R, &obj, name);
    case V_LIST:
        if (obj.u.l->group && (is(name, "grouper") || is(name, "list")))
            return obj.u.l->v[name[0] == 'g' ? 0 : 1];
        if (obj.u.l->range) /* a range has no list methods but these */
            return is(name, "index") || is(name, "count") ? method(R, obj, name) : undef_attr(R, &obj, name);
        if (in_names(list_modifying, name) && !obj.u.l->tuple)
            return modifying_method(R, "list", name);
        return in_names(list_methods, name) ? method(R, obj, name) : undef_attr(R, &obj, name);
    case V_OBJ:
        if (obj.u.ob->cycler && is(name, "current"))
            return obj.u.ob->items[obj.u.ob->pos];
        if (obj.u.ob->cycler && (is(name, "next") || is(name, "reset")))
            return method(R, obj, name);
        return undef_attr(R, &obj, name);
    case V_LOOP: {
        const struct jloop *lp = obj.u.lp;
        if (is(name, "index")) return mkint((int64_t)lp->i + 1);
        if (is(name, "index0")) return mkint((int64_t)lp->i);
        if (is(name, "revindex")) return mkint((int64_t)(lp->n - lp->i));
        if (is(name, "revindex0")) return mkint((int64_t)(lp->n - lp->i - 1));
        if (is(name, "first")) return mkbool(lp->i == 0);
        if (is(name, "last")) return mkbool(lp->i + 1 == lp->n);
        if (is(name, "length")) return mkint((int64_t)lp->n);
        if (is(name, "depth")) return mkint((int64_t)lp->depth + 1);
        if (is(name, "depth0")) return mkint((int64_t)lp->depth);
        if (is(name, "previtem"))
            return lp->i ? lp->items[lp->i - 1] : undef_named("\1there is no previous item");
        if (is(name, "nextitem"))
            return lp->i + 1 < lp->n ? lp->items[lp->i + 1] : undef_named("\1there is no next item");
        if (is(name, "cycle") || is(name, "changed")) return method(R, obj, name);
        return undef_attr(R, &obj, name);
    }
    default:
        return undef_attr(R, &obj, name);
    }
}

static bool idx_of(const jval *k, size_t n, size_t *out)
{
    if (!is_intlike(k))
        return false;
    int64_t i = ival(k);
    if (i < 0)
        i += (int64_t)n;
    if (i < 0 || (uint64_t)i >= n)
        return false;
    *out = (size_t)i;
    return true;
}

static jval get_item(struct rctx *R, jval obj, jval key, int line)
{
    size_t i;
    switch (obj.t) {
    case V_UNDEF:
        undefined_error(R, line, &obj);
    case V_DICT: case V_NS: {
        jval *v = d_find(obj.u.d, &key);
        if (v)
            return *v;
        break;
    }
    case V_LIST:
        if (idx_of(&key, obj.u.l->n, &i))
            return obj.u.l->v[i];
        if (is_intlike(&key))
            return undef_elem(R, &obj, &key);
        break;
    case V_STR: {
        size_t n, *off = u8_offsets(R, obj.u.s, &n);
        if (idx_of(&key, n, &i))
            return vstr(jsub(R, obj.u.s, off[i], off[i + 1] - off[i]));
        if (is_intlike(&key))
            return undef_elem(R, &obj, &key);
        break;
    }
    default:
        break;
    }
    if (key.t == V_STR) {
        char *name = j_strndup(&R->b, key.u.s->s, key.u.s->len);
        if (obj.t != V_DICT && obj.t != V_NS)
            return get_attr(R, obj, name, line);
        return undef_attr(R, &obj, name);
    }
    return undef_elem(R, &obj, &key);
}

static jval slice(struct rctx *R, jval obj, const jval *lo, const jval *hi, const jval *st, int line)
{
    int64_t step = 1;
    if (st && st->t != V_NONE) {
        if (!is_intlike(st))
            DIE(R, line, "slice indices must be integers");
        step = ival(st);
        if (step == 0)
            DIE(R, line, "slice step cannot be zero");
    }
    size_t n, *off = NULL;
    if (obj.t == V_LIST)
        n = obj.u.l->n;
    else if (obj.t == V_STR)
        off = u8_offsets(R, obj.u.s, &n);
    else if (obj.t == V_UNDEF)
        undefined_error(R, line, &obj);
    else
        DIE(R, line, "'%s' object is not subscriptable", tname(&obj));
    int64_t len = (int64_t)n, a, b;
    const jval *bounds[2] = {lo, hi};
    int64_t *outs[2] = {&a, &b};
    for (int k = 0; k < 2; k++) {
        const jval *x = bounds[k];
        if (!x || x->t == V_NONE) {
            *outs[k] = step > 0 ? (k ? len : 0) : (k ? -1 : len - 1);
            continue;
        }
        if (!is_intlike(x))
            DIE(R, line, "slice indices must be integers");
        int64_t v = ival(x);
        if (v < 0) {
            v = v < -len ? (step > 0 ? 0 : -1) : v + len;
        } else if (v >= len) {
            v = step > 0 ? len : len - 1;
        }
        *outs[k] = v;
    }
    size_t cnt = 0;
    for (int64_t i = a; step > 0 ? i < b : i > b; i += step)
        cnt++;
    if (obj.t == V_LIST) {
        jval l = mklist(R, cnt, obj.u.l->tuple);
        size_t k = 0;
        for (int64_t i = a; step > 0 ? i < b : i > b; i += step)
            l.u.l->v[k++] = obj.u.l->v[i];
        const int64_t *r = obj.u.l->range;
        int64_t sub[3], x, y;
        if (r && !__builtin_mul_overflow(a, r[2], &x) && !__builtin_add_overflow(r[0], x, &sub[0]) &&
            !__builtin_mul_overflow(b, r[2], &y) && !__builtin_add_overflow(r[0], y, &sub[1]) &&
            !__builtin_mul_overflow(step, r[2], &sub[2])) { /* a range's slice is a range, as in Python */
            int64_t *rng = j_alloc(&R->b, sizeof sub);
            memcpy(rng, sub, sizeof sub);
            l.u.l->range = rng;
        }
        return l;
    }
    if (step == 1)
        return vstr(jsub(R, obj.u.s, off[a], off[b > a ? b : a] - off[a]));
    struct obuf o = {0};
    for (int64_t i = a; step > 0 ? i < b : i > b; i += step)
        ob_str(R, &o, jsub(R, obj.u.s, off[i], off[i + 1] - off[i]));
    return vstr(ob_done(R, &o));
}

static struct jstr *html_escape(struct rctx *R, const struct jstr *s);
static struct jstr *py_percent(struct rctx *R, const struct jstr *f, jval args, int line);
static bool is_digit_c(char c) { return c >= '0' && c <= '9'; }

/* ---- Arithmetic ---- */

static jval arith(struct rctx *R, int op, jval a, jval b, int line)
{
    if (a.t == V_UNDEF)
        undefined_error(R, line, &a);
    if (b.t == V_UNDEF && !(op == OP_MOD && a.t == V_STR)) /* '%s' % undefined formats it as '' */
        undefined_error(R, line, &b);
    if (is_num(&a) && is_num(&b)) {
        bool ints = is_intlike(&a) && is_intlike(&b);
        int64_t x = ints ? ival(&a) : 0, y = ints ? ival(&b) : 0, r;
        double fx = fval(&a), fy = fval(&b);
        switch (op) {
        case OP_ADD:
            if (!ints) return mkfloat(fx + fy);
            if (__builtin_add_overflow(x, y, &r)) break;
            return mkint(r);
        case OP_SUB:
            if (!ints) return mkfloat(fx - fy);
            if (__builtin_sub_overflow(x, y, &r)) break;
            return mkint(r);
        case OP_MUL:
            if (!ints) return mkfloat(fx * fy);
            if (__builtin_mul_overflow(x, y, &r)) break;
            return mkint(r);
        case OP_DIV:
            if (fy == 0) DIE(R, line, "division by zero");
            return mkfloat(fx / fy);
        case OP_FDIV: case OP_MOD:
            if (ints) {
                if (y == 0) DIE(R, line, "integer division or modulo by zero");
                if (x == INT64_MIN && y == -1) break;
                int64_t q = x / y, m = x % y;
                if (m && ((m < 0) != (y < 0))) {
                    q--;
                    m += y;
                }
                return mkint(op == OP_FDIV ? q : m);
            }
            if (fy == 0) DIE(R, line, "float division or modulo by zero");
            if (op == OP_FDIV) return mkfloat(floor(fx / fy));
            {
                double m = fmod(fx, fy);
                if (m && ((m < 0) != (fy < 0)))
                    m += fy;
                return mkfloat(m);
            }
        case OP_POW:
            if (ints && y >= 0) {
                if (x == 0 || x == 1)
                    return mkint(y == 0 ? 1 : x);
                if (x == -1)
                    return mkint(y % 2 ? -1 : 1);
                int64_t acc = 1; /* |x| >= 2: overflows within 64 steps */
                for (int64_t k = 0; k < y; k++)
                    if (__builtin_mul_overflow(acc, x, &acc))
                        DIE(R, line, "integer overflow");
                return mkint(acc);
            }
            if (fx == 0 && fy < 0)
                DIE(R, line, "0.0 cannot be raised to a negative power");
            if (fx < 0 && isfinite(fy) && fy != floor(fy))
                j_die(&R->b, MOE_EUNSUPPORTED, line, "a negative number to a fractional power is complex");
            {
                double r = pow(fx, fy);
                if (isinf(r) && isfinite(fx) && isfinite(fy))
                    DIE(R, line, "(34, 'Numerical result out of range')");
                return mkfloat(r);
            }
        }
        DIE(R, line, "integer overflow");
    }
    if (op == OP_ADD && a.t == V_STR && b.t == V_STR) {
        if (a.u.s->markup == b.u.s->markup) {
            struct jstr *r = jcat(R, a.u.s, b.u.s);
            if (r->markup != a.u.s->markup) {
                r = mkjstr(R, r->s, r->len, r->prov, r->m);
                r->markup = a.u.s->markup;
            }
            return vstr(r);
        }
        /* Markup + str escapes the str (and the other way round) */
        struct jstr *x = a.u.s->markup ? a.u.s : html_escape(R, a.u.s);
        struct jstr *y = b.u.s->markup ? b.u.s : html_escape(R, b.u.s);
        struct jstr *r = jcat(R, x, y);
        r = mkjstr(R, r->s, r->len, r->prov, r->m);
        r->markup = true;
        return vstr(r);
    }
    if (op == OP_ADD && a.t == V_LIST && b.t == V_LIST && a.u.l->tuple == b.u.l->tuple && !a.u.l->range &&
        !b.u.l->range) {
        jval l = mklist(R, a.u.l->n + b.u.l->n, a.u.l->tuple);
        if (a.u.l->n)
            memcpy(l.u.l->v, a.u.l->v, a.u.l->n * sizeof(jval));
        if (b.u.l->n)
            memcpy(l.u.l->v + a.u.l->n, b.u.l->v, b.u.l->n * sizeof(jval));
        return l;
    }
    if (op == OP_MUL && ((a.t == V_STR || (a.t == V_LIST && !a.u.l->range)) && is_intlike(&b))) {
        int64_t k = ival(&b);
        if (k < 0)
            k = 0;
        if (a.t == V_STR) {
            if (a.u.s->len && (uint64_t)k > R->max_output / a.u.s->len)
                j_die(&R->b, MOE_ETOOBIG, line, "the output is longer than %zu bytes", R->max_output);
            struct obuf o = {0};
            for (int64_t i = 0; i < k; i++)
                ob_str(R, &o, a.u.s);
            return vstr(ob_done(R, &o));
        }
        size_t n = a.u.l->n;
        if (n && (uint64_t)k > R->max_iter / n)
            j_die(&R->b, MOE_ETOOBIG, line, "a list of more than %zu items", R->max_iter);
        jval l = mklist(R, n * (size_t)k, false);
        for (int64_t i = 0; i < k; i++)
            if (n)
                memcpy(l.u.l->v + (size_t)i * n, a.u.l->v, n * sizeof(jval));
        return l;
    }
    if (op == OP_MUL && is_intlike(&a) && (b.t == V_STR || b.t == V_LIST))
        return arith(R, op, b, a, line);
    if (op == OP_MOD && a.t == V_STR)
        return vstr(py_percent(R, a.u.s, b, line));
    static const char *const sym[] = {"+", "-", "*", "/", "//", "%", "**"};
    DIE(R, line, "unsupported operand types for %s: '%s' and '%s'", sym[op], tname(&a), tname(&b));
}

static bool contains(struct rctx *R, jval hay, jval needle, int line)
{
    switch (hay.t) {
    case V_STR:
        if (needle.t != V_STR)
            DIE(R, line, "'in <string>' requires string as left operand, not %s", tname(&needle));
        if (!needle.u.s->len)
            return true;
        return hay.u.s->len >= needle.u.s->len &&
               memmem(hay.u.s->s, hay.u.s->len, needle.u.s->s, needle.u.s->len) != NULL;
    case V_LIST:
        for (size_t i = 0; i < hay.u.l->n; i++)
            if (vequal(&hay.u.l->v[i], &needle, 0))
                return true;
        return false;
    case V_DICT:
        if ((needle.t == V_LIST && !needle.u.l->tuple) || needle.t == V_DICT) /* not a key Python can hash */
            DIE(R, line, "unhashable type: '%s'", tname(&needle));
        return d_find(hay.u.d, &needle) != NULL;
    case V_UNDEF: return false;
    default: DIE(R, line, "argument of type '%s' is not iterable", tname(&hay));
    }
}

/* ---- Calls ---- */

struct args {
    const jval *pos;
    size_t n;
    const char **kwn;
    const jval *kwv;
    size_t nkw;
    int line;
    const char *what; /* for messages */
};

/* Argument i by position, or by keyword name; NULL when absent. */
static const jval *arg(const struct args *a, size_t i, const char *name)
{
    if (i < a->n)
        return &a->pos[i];
    for (size_t k = 0; name && k < a->nkw; k++)
        if (is(a->kwn[k], name))
            return &a->kwv[k];
    return NULL;
}

static void check_args(struct rctx *R, const struct args *a, size_t max_pos, const char *const *kw)
{
    if (a->n > max_pos)
        DIE(R, a->line, "%s takes at most %zu positional arguments (%zu given)", a->what, max_pos, a->n);
    for (size_t k = 0; k < a->nkw; k++) {
        bool ok = false;
        for (int i = 0; kw && kw[i]; i++)
            if (is(kw[i], a->kwn[k]))
                ok = true;
        if (!ok)
            DIE(R, a->line, "%s got an unexpected keyword argument '%s'", a->what, a->kwn[k]);
    }
}

static struct jstr *need_str(struct rctx *R, const jval *v, int line, const char *what)
{
    if (v->t == V_UNDEF)
        undefined_error(R, line, v);
    if (v->t != V_STR)
        DIE(R, line, "%s must be a string, not %s", what, tname(v));
    return v->u.s;
}

static void exec_body(struct rctx *R, const struct jnlist *body, struct scope *s, struct obuf *o);
static jval eval(struct rctx *R, const struct jnode *n, struct scope *s);

/* Calls macro mc; caller: the {% call %} block's body as a macro, or NULL. */
static jval call_macro(struct rctx *R, const struct jmacro *mc, const struct args *a, const jval *caller)
{
    const struct jnode *m = mc->n;
    if (R->depth >= R->max_depth)
        j_die(&R->b, MOE_ETOOBIG, a->line, "macro calls nested more than %u deep", R->max_depth);
    count_iter(R, a->line);
    if (a->n > m->n_targets && !(m->op & MAC_VARARGS))
        DIE(R, a->line, "macro '%s' takes %zu arguments (%zu given)", m->name, m->n_targets, a->n);
    if (caller && !(m->op & MAC_CALLER))
        DIE(R, a->line, "macro '%s' was invoked with two values for the special caller argument", m->name);
    struct scope *s = new_scope(R, mc->env);
    jval kwargs = mkdict(R);
    for (size_t k = 0; k < a->nkw; k++) {
        bool ok = false;
        for (size_t i = 0; i < m->n_targets; i++)
            if (is(m->targets[i], a->kwn[k]))
                ok = true;
        if (!ok && !(m->op & MAC_KWARGS))
            DIE(R, a->line, "macro '%s' has no parameter '%s'", m->name, a->kwn[k]);
        if (!ok)
            d_set_s(R, kwargs.u.d, a->kwn[k], a->kwv[k]);
    }
    R->depth++;
    for (size_t i = 0; i < m->n_targets; i++) {
        const jval *v = arg(a, i, m->targets[i]);
        jval val;
        if (v)
            val = *v;
        else if (m->defaults.v[i])
            val = eval(R, m->defaults.v[i], s);
        else { /* jinja2's undefined for a parameter left out */
            size_t n = strlen(m->targets[i]) + 32;
            char *msg = j_alloc(&R->b, n);
            snprintf(msg, n, "\1parameter '%s' was not provided", m->targets[i]);
            val = undef_named(msg);
        }
        d_set_s(R, &s->vars, m->targets[i], val);
    }
    if (m->op & MAC_CALLER)
        d_set_s(R, &s->vars, "caller", caller ? *caller : undef_named("\1No caller defined"));
    if (m->op & MAC_VARARGS) {
        size_t extra = a->n > m->n_targets ? a->n - m->n_targets : 0;
        jval va = mklist(R, extra, true);
        for (size_t i = 0; i < extra; i++)
            va.u.l->v[i] = a->pos[m->n_targets + i];
        d_set_s(R, &s->vars, "varargs", va);
    }
    if (m->op & MAC_KWARGS)
        d_set_s(R, &s->vars, "kwargs", kwargs);
    struct obuf o = {0};
    bool brk = R->brk, cont = R->cont;
    exec_body(R, &m->body, s, &o);
    R->brk = brk;
    R->cont = cont;
    R->depth--;
    return vstr(ob_done(R, &o));
}

static jval call_func(struct rctx *R, int fn, const struct args *a)
{
    switch (fn) {
    case F_RANGE: {
        check_args(R, a, 3, NULL);
        int64_t v[3] = {0, 0, 1};
        if (a->n == 0)
            DIE(R, a->line, "range expected at least 1 argument");
        for (size_t i = 0; i < a->n; i++) {
            if (!is_intlike(&a->pos[i]))
                DIE(R, a->line, "range() arguments must be integers, not %s", tname(&a->pos[i]));
            v[a->n == 1 ? 1 : i] = ival(&a->pos[i]);
        }
        if (v[2] == 0)
            DIE(R, a->line, "range() step must not be zero");
        size_t cnt = 0;
        for (int64_t i = v[0]; v[2] > 0 ? i < v[1] : i > v[1]; i += v[2]) {
            if (++cnt > R->max_iter)
                j_die(&R->b, MOE_ETOOBIG, a->line, "range() of more than %zu items", R->max_iter);
            if ((v[2] > 0 && i > INT64_MAX - v[2]) || (v[2] < 0 && i < INT64_MIN - v[2]))
                break;
        }
        jval l = mklist(R, cnt, false);
        int64_t x = v[0];
        for (size_t i = 0; i < cnt; i++, x += (i < cnt ? v[2] : 0))
            l.u.l->v[i] = mkint(x);
        int64_t *rng = j_alloc(&R->b, sizeof v);
        memcpy(rng, v, sizeof v);
        l.u.l->range = rng;
        return l;
    }
    case F_JOINER: case F_CYCLER: {
        struct jobj *ob = j_alloc(&R->b, sizeof *ob);
        memset(ob, 0, sizeof *ob);
        ob->cycler = fn == F_CYCLER;
        if (ob->cycler) {
            check_args(R, a, SIZE_MAX, NULL);
            if (!a->n)
                DIE(R, a->line, "cycler: at least one item has to be provided");
            ob->items = j_alloc(&R->b, a->n * sizeof *ob->items);
            memcpy(ob->items, a->pos, a->n * sizeof *ob->items);
            ob->n = a->n;
        } else {
            static const char *const kw[] = {"sep", NULL};
            check_args(R, a, 1, kw);
            const jval *sep = arg(a, 0, "sep");
            ob->sep = sep ? *sep : vstr(mkjstr(R, ", ", 2, PROV_LIT, NULL));
        }
        return (jval){.t = V_OBJ, .u.ob = ob};
    }
    case F_NAMESPACE: case F_DICT: {
        jval d = mkdict(R);
        if (fn == F_NAMESPACE)
            d.t = V_NS;
        if (a->n > 1)
            DIE(R, a->line, "%s() takes at most one positional argument", func_names[fn]);
        if (a->n == 1) {
            if (a->pos[0].t != V_DICT && a->pos[0].t != V_NS)
                DIE(R, a->line, "%s() argument must be a mapping", func_names[fn]);
            const struct jdict *src = a->pos[0].u.d;
            for (size_t i = 0; i < src->n; i++)
                d_set(R, d.u.d, src->k[i], src->v[i]);
        }
        for (size_t k = 0; k < a->nkw; k++)
            d_set_s(R, d.u.d, a->kwn[k], a->kwv[k]);
        return d;
    }
    case F_RAISE: {
        struct jstr *m = a->n ? to_str(R, &a->pos[0]) : mkjstr(R, "", 0, PROV_LIT, NULL);
        DIE(R, a->line, "raise_exception: %.*s", (int)(m->len > 400 ? 400 : m->len), m->s);
    }
    case F_STRFTIME: {
        check_args(R, a, 1, NULL);
        struct jstr *f = a->n ? need_str(R, &a->pos[0], a->line, "strftime_now's format")
                              : mkjstr(R, "", 0, PROV_LIT, NULL);
        struct tm tm;
        time_t t = R->now ? R->now : time(NULL);
        if (R->now_utc)
            gmtime_r(&t, &tm);
        else
            localtime_r(&t, &tm);
        char *fmt = j_strndup(&R->b, f->s, f->len > 256 ? 256 : f->len);
        /* Python formats a naive datetime: %Z and %z give nothing */
        size_t w = 0;
        for (size_t r = 0; fmt[r]; r++) {
            if (fmt[r] == '%' && (fmt[r + 1] == 'Z' || fmt[r + 1] == 'z')) {
                r++;
                continue;
            }
            fmt[w++] = fmt[r];
            if (fmt[r] == '%' && fmt[r + 1])
                fmt[w++] = fmt[++r];
        }
        fmt[w] = 0;
        char buf[1024];
        size_t n = fmt[0] ? strftime(buf, sizeof buf, fmt, &tm) : 0;
        return vstr(mkjstr(R, j_strndup(&R->b, buf, n), n, PROV_LIT, NULL));
    }
    }
    DIE(R, a->line, "unknown function");
}

static jval call_filter_named(struct rctx *R, const char *name, jval v, const struct args *a);
static bool run_test(struct rctx *R, const char *name, jval v, const struct args *a);

/* Python's str.split / rsplit. */
static jval str_split(struct rctx *R, const struct jstr *s, const jval *sep, int64_t maxsplit,
                      bool right, int line)
{
    jval out = mklist(R, 0, false);
    size_t cap = 0;
    struct jlist *l = out.u.l;
#define PUSH(x)                                                                             \
    do {                                                                                    \
        if (l->n == cap) {                                                                  \
            size_t nc = cap ? cap * 2 : 8;                                                  \
            jval *nv = j_alloc(&R->b, nc * sizeof *nv);                                     \
            if (l->n)                                                                       \
                memcpy(nv, l->v, l->n * sizeof *nv);                                        \
            l->v = nv;                                                                      \
            cap = nc;                                                                       \
        }                                                                                   \
        l->v[l->n++] = (x);                                                                 \
    } while (0)
    if (!sep || sep->t == V_NONE) {
        /* runs of whitespace; leading and trailing whitespace gives no empty pieces */
        size_t n, *off = u8_offsets(R, s, &n);
        bool *sp = j_alloc(&R->b, (n + 1) * sizeof *sp);
        for (size_t i = 0; i < n; i++) {
            size_t nx;
            sp[i] = py_space(u8_cp(s->s, s->len, off[i], &nx));
        }
        int64_t splits = 0;
        if (!right) {
            size_t i = 0;
            while (i < n) {
                while (i < n && sp[i])
                    i++;
                if (i >= n)
                    break;
                size_t j = i;
                if (maxsplit >= 0 && splits >= maxsplit) { /* the rest, trailing whitespace too */
                    PUSH(vstr(jsub(R, s, off[i], off[n] - off[i])));
                    break;
                }
                while (j < n && !sp[j])
                    j++;
                PUSH(vstr(jsub(R, s, off[i], off[j] - off[i])));
                splits++;
                i = j;
            }
        } else {
            size_t i = n;
            while (i > 0) {
                while (i > 0 && sp[i - 1])
                    i--;
                if (i == 0)
                    break;
                size_t j = i;
                if (maxsplit >= 0 && splits >= maxsplit) { /* the rest, leading whitespace too */
                    PUSH(vstr(jsub(R, s, 0, off[i])));
                    break;
                }
                while (j > 0 && !sp[j - 1])
                    j--;
                PUSH(vstr(jsub(R, s, off[j], off[i] - off[j])));
                splits++;
                i = j;
            }
            for (size_t a = 0, b = l->n ? l->n - 1 : 0; a < b; a++, b--) {
                jval t = l->v[a];
                l->v[a] = l->v[b];
                l->v[b] = t;
            }
        }
        return out;
    }
    const struct jstr *p = need_str(R, sep, line, "the separator");
    if (!p->len)
        DIE(R, line, "empty separator");
    int64_t splits = 0;
    if (!right) {
        size_t i = 0;
        for (;;) {
            const char *hit = (maxsplit < 0 || splits < maxsplit) && s->len - i >= p->len
                                  ? memmem(s->s + i, s->len - i, p->s, p->len) : NULL;
            if (!hit) {
                PUSH(vstr(jsub(R, s, i, s->len - i)));
                break;
            }
            size_t h = (size_t)(hit - s->s);
            PUSH(vstr(jsub(R, s, i, h - i)));
            i = h + p->len;
            splits++;
        }
    } else {
        size_t e = s->len;
        for (;;) {
            size_t h = SIZE_MAX;
            if ((maxsplit < 0 || splits < maxsplit) && e >= p->len)
                for (size_t k = e - p->len + 1; k-- > 0;)
                    if (!memcmp(s->s + k, p->s, p->len)) {
                        h = k;
                        break;
                    }
            if (h == SIZE_MAX) {
                PUSH(vstr(jsub(R, s, 0, e)));
                break;
            }
            PUSH(vstr(jsub(R, s, h + p->len, e - h - p->len)));
            e = h;
            splits++;
        }
        for (size_t a = 0, b = l->n ? l->n - 1 : 0; a < b; a++, b--) {
            jval t = l->v[a];
            l->v[a] = l->v[b];
            l->v[b] = t;
        }
    }
#undef PUSH
    return out;
}

static bool strippable(const struct jstr *s, size_t off, bool ws, const uint32_t *set, size_t ns)
{
    size_t nx;
    uint32_t cp = u8_cp(s->s, s->len, off, &nx);
    if (ws)
        return py_space(cp);
    for (size_t q = 0; q < ns; q++)
        if (set[q] == cp)
            return true;
    return false;
}

/* str.strip family: which 1 left, 2 right, 3 both; chars NULL: whitespace. */
static struct jstr *str_strip(struct rctx *R, const struct jstr *s, const jval *chars, int which, int line)
{
    size_t n, *off = u8_offsets(R, s, &n);
    uint32_t set[64];
    size_t ns = 0;
    bool ws = !chars || chars->t == V_NONE;
    if (!ws) {
        const struct jstr *c = need_str(R, chars, line, "strip's argument");
        for (size_t i = 0; i < c->len && ns < 64;) {
            size_t nx;
            set[ns++] = u8_cp(c->s, c->len, i, &nx);
            i = nx;
        }
    }
    size_t a = 0, b = n;
    if (which & 1)
        while (a < b && strippable(s, off[a], ws, set, ns))
            a++;
    if (which & 2)
        while (b > a && strippable(s, off[b - 1], ws, set, ns))
            b--;
    return jsub(R, s, off[a], off[b] - off[a]);
}

static struct jstr *str_replace(struct rctx *R, const struct jstr *s, const struct jstr *old,
                                const struct jstr *new, int64_t count)
{
    struct obuf o = {0};
    int64_t done = 0;
    if (!old->len) { /* Python inserts new between every code point */
        for (size_t i = 0; i <= s->len; i = u8_next(s->s, s->len, i)) {
            if (count < 0 || done < count) {
                ob_str(R, &o, new);
                done++;
            }
            if (i < s->len) {
                size_t nx = u8_next(s->s, s->len, i);
                ob_str(R, &o, jsub(R, s, i, nx - i));
            }
            if (i >= s->len)
                break;
        }
        return ob_done(R, &o);
    }
    size_t i = 0;
    while (i < s->len) {
        const char *hit = (count < 0 || done < count) && s->len - i >= old->len
                              ? memmem(s->s + i, s->len - i, old->s, old->len) : NULL;
        if (!hit)
            break;
        size_t h = (size_t)(hit - s->s);
        ob_str(R, &o, jsub(R, s, i, h - i));
        ob_str(R, &o, new);
        i = h + old->len;
        done++;
    }
    ob_str(R, &o, jsub(R, s, i, s->len - i));
    return ob_done(R, &o);
}

/* ---- Case mapping (Python's str methods: full mappings, from jinja_case.h) ---- */

#include "daemon/jinja_case.h"

static const struct jcase *case_of(uint32_t cp)
{
    size_t lo = 0, hi = sizeof jcase_table / sizeof jcase_table[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (jcase_table[mid].cp == cp)
            return &jcase_table[mid];
        if (jcase_table[mid].cp < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* 2 upper, 4 lower, 8 title (Python's isupper / islower / istitle of one code point) */
static unsigned case_flags(uint32_t cp)
{
    if (cp < 0x80)
        return (cp >= 'A' && cp <= 'Z') ? 2 : (cp >= 'a' && cp <= 'z') ? 4 : 0;
    const struct jcase *c = case_of(cp);
    return c ? c->flags : 0;
}

static bool is_cased(uint32_t cp) { return case_flags(cp) != 0; }

/* Appends cp mapped (0 lower, 1 upper, 2 title) to o with provenance bit. */
static void put_case(struct rctx *R, struct obuf *o, const char *src, size_t n, uint32_t cp, int to,
                     uint8_t bit)
{
    if (cp < 0x80) {
        char c = (char)cp;
        if (to && c >= 'a' && c <= 'z')
            c = (char)(c - 32);
        else if (!to && c >= 'A' && c <= 'Z')
            c = (char)(c + 32);
        ob_put(R, o, &c, 1, bit);
        return;
    }
    const struct jcase *c = cp < 0x10000 ? case_of(cp) : NULL;
    const char *m = !c ? "" : to == 0 ? c->lower : to == 1 ? c->upper : c->title;
    if (*m)
        ob_put(R, o, m, strlen(m), bit);
    else
        ob_put(R, o, src, n, bit);
}

static bool title_sep(uint32_t cp)
{
    return py_space(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
}

/* Case mapping, provenance kept: mode 0 str.lower, 1 str.upper, 2 str.title, 3 str.capitalize,
 * 4 Jinja's title filter (each piece after a run of whitespace or -({[< gets its first code point
 * upper-cased, the rest lower-cased). Lowering a capital sigma gives a final sigma at a word's end
 * (after a cased letter and before none), as Python does. */
static struct jstr *str_case(struct rctx *R, const struct jstr *s, int mode)
{
    struct obuf o = {0};
    bool prev_cased = false, start = true;
    for (size_t i = 0; i < s->len;) {
        size_t nx;
        uint32_t cp = u8_cp(s->s, s->len, i, &nx);
        int to;
        if (mode == 0 || mode == 1) to = mode;
        else if (mode == 2) to = prev_cased ? 0 : 2;
        else if (mode == 3) to = i == 0 ? 2 : 0;
        else to = start ? 1 : 0;
        if (cp == 0x3a3 && to == 0 && prev_cased) {
            size_t nn;
            bool next_cased = nx < s->len && is_cased(u8_cp(s->s, s->len, nx, &nn));
            if (!next_cased) {
                ob_put(R, &o, "\xcf\x82", 2, sbit(s, i));
                i = nx;
                continue;
            }
        }
        put_case(R, &o, s->s + i, nx - i, cp, to, sbit(s, i));
        start = title_sep(cp);
        prev_cased = is_cased(cp);
        i = nx;
    }
    return ob_done(R, &o);
}

/* A code point that Python's \\w matches: letters, digits, '_' (outside ASCII: a cased letter,
 * or anything but whitespace and common punctuation, an approximation). */
static bool word_char(uint32_t cp)
{
    if (cp < 0x80)
        return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
    if (is_cased(cp))
        return true;
    if (py_space(cp) || (cp >= 0x2000 && cp <= 0x206f) || (cp >= 0x3000 && cp <= 0x303f) ||
        (cp >= 0xff01 && cp <= 0xff0f) || cp == 0xd7 || cp == 0xf7)
        return false;
    if (cp >= 0xa1 && cp <= 0xbf)
        return cp == 0xaa || cp == 0xb2 || cp == 0xb3 || cp == 0xb5 || cp == 0xb9 || cp == 0xba ||
               (cp >= 0xbc && cp <= 0xbe);
    return true;
}

/* Python's str.islower (lower) / isupper: a cased code point and none of the other case. */
static bool str_is_case(const struct jstr *s, bool lower)
{
    bool any = false;
    for (size_t i = 0; i < s->len;) {
        size_t nx;
        unsigned f = case_flags(u8_cp(s->s, s->len, i, &nx));
        if (f & (lower ? 2 | 8 : 4 | 8))
            return false;
        if (f & (lower ? 4 : 2))
            any = true;
        i = nx;
    }
    return any;
}

/* markupsafe.escape: a Markup string with & < > " ' replaced. */
static struct jstr *html_escape(struct rctx *R, const struct jstr *s)
{
    struct obuf o = {0};
    for (size_t i = 0; i < s->len; i++) {
        char c = s->s[i];
        const char *rep = c == '&' ? "&amp;" : c == '<' ? "&lt;" : c == '>' ? "&gt;"
                        : c == '"' ? "&#34;" : c == '\'' ? "&#39;" : NULL;
        if (rep)
            ob_put(R, &o, rep, strlen(rep), sbit(s, i));
        else
            ob_put(R, &o, s->s + i, 1, sbit(s, i));
    }
    struct jstr *r = ob_done(R, &o);
    r->markup = true;
    return r;
}

static jval join(struct rctx *R, jval seq, const struct jstr *sep, int line)
{
    jval l = as_list(R, &seq, line);
    struct obuf o = {0};
    for (size_t i = 0; i < l.u.l->n; i++) {
        if (i)
            ob_str(R, &o, sep);
        ob_str(R, &o, to_str(R, &l.u.l->v[i]));
    }
    return vstr(ob_done(R, &o));
}

/* ---- String formatting: the % operator and str.format ---- */

#define FMT_MAX_WIDTH 256
#define FMT_MAX_PREC 100

/* body padded with fill to width code points: align '<', '>', '^' (extra on the right) or '='
 * (padding after a sign and a 0x / 0o / 0b prefix). */
static void pad_put(struct rctx *R, struct obuf *o, const struct jstr *body, int64_t width, char align,
                    const char *fill, size_t fill_len)
{
    size_t n = u8_count(body->s, body->len);
    size_t padn = width > 0 && (uint64_t)width > n ? (size_t)width - n : 0;
    size_t left = align == '<' ? 0 : align == '^' ? padn / 2 : padn, skip = 0;
    if (align == '=') {
        if (body->len && (body->s[0] == '-' || body->s[0] == '+' || body->s[0] == ' '))
            skip = 1;
        if (body->len >= skip + 2 && body->s[skip] == '0' && strchr("xXoObB", body->s[skip + 1]))
            skip += 2;
        ob_str(R, o, jsub(R, body, 0, skip));
    }
    for (size_t k = 0; k < left; k++)
        ob_put(R, o, fill, fill_len, 0);
    ob_str(R, o, jsub(R, body, skip, body->len - skip));
    for (size_t k = left; k < padn; k++)
        ob_put(R, o, fill, fill_len, 0);
}

/* A number by one C conversion (d x X o: an integer; e E f F g G: a float) with flags from
 * "-+ #0", width and precision (-1: none). */
static struct jstr *fmt_num(struct rctx *R, const jval *v, const char *flags, int64_t width,
                            int64_t prec, char conv, int line)
{
    if (width > FMT_MAX_WIDTH || prec > FMT_MAX_PREC)
        j_die(&R->b, MOE_EUNSUPPORTED, line, "a format width above %d or precision above %d",
              FMT_MAX_WIDTH, FMT_MAX_PREC);
    char spec[48], buf[1024];
    size_t k = (size_t)snprintf(spec, sizeof spec, "%%%s", flags);
    if (width >= 0)
        k += (size_t)snprintf(spec + k, sizeof spec - k, "%lld", (long long)width);
    if (prec >= 0)
        k += (size_t)snprintf(spec + k, sizeof spec - k, ".%lld", (long long)prec);
    if (strchr("dxXo", conv)) {
        int64_t x;
        if (is_intlike(v)) {
            x = ival(v);
        } else if (v->t == V_FLOAT && conv == 'd' && v->u.f > -9.2e18 && v->u.f < 9.2e18) {
            x = (int64_t)v->u.f;
        } else {
            DIE(R, line, "%%%c format: %s is required, not %s", conv,
                conv == 'd' ? "a real number" : "an integer", tname(v));
        }
        if (conv != 'd' && (x < 0 || strpbrk(flags, "#+ "))) { /* Python: -ff, +ff, 0o17 (C: ffffff01, ff, 017) */
            unsigned long long mag = x < 0 ? 0ULL - (unsigned long long)x : (unsigned long long)x;
            char digits[32];
            int nd = snprintf(digits, sizeof digits, conv == 'x' ? "%llx" : conv == 'X' ? "%llX" : "%llo", mag);
            const char *sign = x < 0 ? "-" : strchr(flags, '+') ? "+" : strchr(flags, ' ') ? " " : "";
            const char *pre = !strchr(flags, '#') ? "" : conv == 'o' ? "0o" : conv == 'x' ? "0x" : "0X";
            char zeros[FMT_MAX_PREC + 1];
            int nz = prec > nd ? (int)prec - nd : 0;
            memset(zeros, '0', (size_t)nz);
            zeros[nz] = 0;
            int w = snprintf(buf, sizeof buf, "%s%s%s%s", sign, pre, zeros, digits);
            struct jstr *body = mkjstr(R, j_strndup(&R->b, buf, (size_t)w), (size_t)w, PROV_LIT, NULL);
            struct obuf o = {0};
            bool zero = strchr(flags, '0') && !strchr(flags, '-');
            pad_put(R, &o, body, width, strchr(flags, '-') ? '<' : zero ? '=' : '>', zero ? "0" : " ", 1);
            return ob_done(R, &o);
        }
        snprintf(spec + k, sizeof spec - k, "ll%c", conv);
        snprintf(buf, sizeof buf, spec, (long long)x);
    } else {
        if (!is_num(v))
            DIE(R, line, "must be real number, not %s", tname(v));
        snprintf(spec + k, sizeof spec - k, "%c", conv);
        snprintf(buf, sizeof buf, spec, fval(v));
    }
    size_t n = strlen(buf);
    return mkjstr(R, j_strndup(&R->b, buf, n), n, PROV_LIT, NULL);
}

static struct jstr *char_of(struct rctx *R, const jval *v, int line)
{
    if (v->t == V_STR && u8_count(v->u.s->s, v->u.s->len) == 1)
        return v->u.s;
    if (!is_intlike(v) || ival(v) < 0 || ival(v) > 0x10ffff || (ival(v) >= 0xd800 && ival(v) < 0xe000))
        DIE(R, line, "%%c requires an int in range(0x110000) or a single character");
    char *b = j_alloc(&R->b, 5);
    size_t n = j_put_utf8(b, (unsigned long)ival(v));
    return mkjstr(R, b, n, PROV_LIT, NULL);
}

static struct jstr *repr_of(struct rctx *R, const jval *v)
{
    struct obuf o = {0};
    write_repr(R, &o, v, 0);
    return ob_done(R, &o);
}

/* Python's ascii(): the repr with each code point beyond ASCII as \x, \u or \U escape (of the
 * provenance of the code point it stands for). */
static struct jstr *ascii_of(struct rctx *R, const jval *v)
{
    struct jstr *r = repr_of(R, v);
    struct obuf o = {0};
    size_t i = 0, run = 0;
    while (i < r->len) {
        if (!((unsigned char)r->s[i] & 0x80)) {
            i++;
            continue;
        }
        ob_str(R, &o, jsub(R, r, run, i - run));
        size_t nx;
        uint32_t c = u8_cp(r->s, r->len, i, &nx);
        char buf[16];
        const char *f = c < 0x100 ? "\\x%02x" : c < 0x10000 ? "\\u%04x" : "\\U%08x";
        int n = snprintf(buf, sizeof buf, f, (unsigned)c);
        uint8_t prov = r->prov == PROV_MIX ? (r->m[i] ? PROV_DATA : PROV_LIT) : r->prov;
        ob_str(R, &o, mkjstr(R, j_strndup(&R->b, buf, (size_t)n), (size_t)n, prov, NULL));
        i = run = nx;
    }
    ob_str(R, &o, jsub(R, r, run, r->len - run));
    return ob_done(R, &o);
}

/* Python's str % args: args a tuple (its items), a dict (for %(key)s) or one value. */
static struct jstr *py_percent(struct rctx *R, const struct jstr *f, jval args, int line)
{
    bool tuple = args.t == V_LIST && args.u.l->tuple;
    const jval *items = tuple ? args.u.l->v : &args;
    size_t nitems = tuple ? args.u.l->n : 1, next = 0;
    struct obuf o = {0};
    const char *s = f->s;
    for (size_t i = 0; i < f->len;) {
        if (s[i] != '%') {
            size_t j = i;
            while (j < f->len && s[j] != '%')
                j++;
            ob_str(R, &o, jsub(R, f, i, j - i));
            i = j;
            continue;
        }
        if (++i >= f->len)
            DIE(R, line, "incomplete format");
        const jval *v = NULL;
        if (s[i] == '(') {
            size_t j = i + 1;
            while (j < f->len && s[j] != ')')
                j++;
            if (j >= f->len)
                DIE(R, line, "incomplete format key");
            if (args.t == V_UNDEF)
                undefined_error(R, line, &args);
            if (args.t != V_DICT)
                DIE(R, line, "format requires a mapping");
            v = d_find(args.u.d, &(jval){.t = V_STR, .u.s = jsub(R, f, i + 1, j - i - 1)});
            if (!v)
                DIE(R, line, "KeyError: '%.*s'", (int)(j - i - 1 > 100 ? 100 : j - i - 1), s + i + 1);
            i = j + 1;
        }
        char flags[8];
        size_t nf = 0;
        while (i < f->len && strchr("-+ #0", s[i]) && s[i]) {
            if (nf < sizeof flags - 1)
                flags[nf++] = s[i];
            i++;
        }
        flags[nf] = 0;
        int64_t width = -1, prec = -1;
        if (i < f->len && s[i] == '*')
            j_die(&R->b, MOE_EUNSUPPORTED, line, "'*' widths in %% formatting are not supported");
        for (; i < f->len && is_digit_c(s[i]); i++)
            width = (width < 0 ? 0 : width) * 10 + (s[i] - '0') > 100000 ? 100000
                  : (width < 0 ? 0 : width) * 10 + (s[i] - '0');
        if (i < f->len && s[i] == '.') {
            prec = 0;
            for (i++; i < f->len && is_digit_c(s[i]); i++)
                prec = prec * 10 + (s[i] - '0') > 100000 ? 100000 : prec * 10 + (s[i] - '0');
        }
        while (i < f->len && (s[i] == 'h' || s[i] == 'l' || s[i] == 'L'))
            i++;
        if (i >= f->len)
            DIE(R, line, "incomplete format");
        char conv = s[i++];
        if (conv == '%') {
            ob_lit(R, &o, "%");
            continue;
        }
        if (!v) {
            if (next >= nitems)
                DIE(R, line, "not enough arguments for format string");
            v = &items[next++];
        }
        if (width > FMT_MAX_WIDTH)
            j_die(&R->b, MOE_EUNSUPPORTED, line, "a format width above %d", FMT_MAX_WIDTH);
        switch (conv) {
        case 's': case 'r': case 'a': case 'c': {
            struct jstr *b = conv == 's' ? to_str(R, v) : conv == 'c' ? char_of(R, v, line)
                           : conv == 'a' ? ascii_of(R, v) : repr_of(R, v);
            if (prec >= 0 && conv != 'c') {
                size_t n, *off = u8_offsets(R, b, &n);
                if ((size_t)prec < n)
                    b = jsub(R, b, 0, off[prec]);
            }
            pad_put(R, &o, b, width, strchr(flags, '-') ? '<' : '>', " ", 1);
            break;
        }
        case 'i': case 'u': conv = 'd'; /* fall through */
        case 'd': case 'x': case 'X': case 'o': case 'e': case 'E': case 'f': case 'F': case 'g': case 'G':
            if (v->t == V_UNDEF) /* undefined has no number */
                undefined_error(R, line, v);
            ob_str(R, &o, fmt_num(R, v, flags, width, prec, conv, line));
            break;
        default:
            DIE(R, line, "unsupported format character '%c'", conv > 32 && conv < 127 ? conv : '?');
        }
    }
    /* Python does not check what is left of a mapping (for it, lists are mappings too) */
    if (args.t != V_DICT && !(args.t == V_LIST && !tuple) && next < nitems)
        DIE(R, line, "not all arguments converted during string formatting");
    return ob_done(R, &o);
}

/* One value by a format spec: [[fill]align][sign][#][0][width][.precision][type]. */
static void format_spec(struct rctx *R, struct obuf *o, const jval *v, const struct jstr *sp, int line)
{
    const char *s = sp->s;
    size_t n = sp->len, i = 0;
    char align = 0, fill[4] = " ";
    size_t fill_len = 1;
    size_t c1 = n ? u8_next(s, n, 0) : 0;
    if (c1 > 4) /* not UTF-8: one byte */
        c1 = 1;
    if (c1 < n && strchr("<>=^", s[c1]) && s[c1]) {
        memcpy(fill, s, c1);
        fill_len = c1;
        align = s[c1];
        i = c1 + 1;
    } else if (n && strchr("<>=^", s[0]) && s[0]) {
        align = s[0];
        i = 1;
    }
    char flags[8];
    size_t nf = 0;
    if (i < n && (s[i] == '+' || s[i] == '-' || s[i] == ' '))
        flags[nf++] = s[i++];
    if (i < n && s[i] == '#')
        flags[nf++] = s[i++];
    if (i < n && s[i] == '0') {
        if (!align) {
            align = '=';
            fill[0] = '0';
            fill_len = 1;
        }
        i++;
    }
    flags[nf] = 0;
    int64_t width = -1, prec = -1;
    for (; i < n && is_digit_c(s[i]); i++)
        width = (width < 0 ? 0 : width) * 10 + (s[i] - '0') > 100000 ? 100000 : (width < 0 ? 0 : width) * 10 + (s[i] - '0');
    if (i < n && (s[i] == ',' || s[i] == '_'))
        j_die(&R->b, MOE_EUNSUPPORTED, line, "thousands separators in format specs are not supported");
    if (i < n && s[i] == '.') {
        prec = 0;
        for (i++; i < n && is_digit_c(s[i]); i++)
            prec = prec * 10 + (s[i] - '0') > 100000 ? 100000 : prec * 10 + (s[i] - '0');
    }
    char type = i < n ? s[i++] : 0;
    if (i < n)
        DIE(R, line, "invalid format specifier");
    if (width > FMT_MAX_WIDTH)
        j_die(&R->b, MOE_EUNSUPPORTED, line, "a format width above %d", FMT_MAX_WIDTH);
    struct jstr *body;
    bool num = is_num(v) && !(v->t == V_BOOL && !n);
    if (v->t == V_STR || !num) {
        if (v->t != V_STR && n)
            DIE(R, line, "unsupported format string passed to %s.__format__", tname(v));
        if (type && type != 's')
            DIE(R, line, "Unknown format code '%c' for object of type 'str'", type > 32 && type < 127 ? type : '?');
        body = to_str(R, v);
        if (prec >= 0) {
            size_t cnt, *off = u8_offsets(R, body, &cnt);
            if ((size_t)prec < cnt)
                body = jsub(R, body, 0, off[prec]);
        }
        pad_put(R, o, body, width, align ? align : '<', fill, fill_len);
        return;
    }
    bool intv = is_intlike(v);
    if (type == 'c') {
        body = char_of(R, v, line);
    } else if ((!type || type == 'd') && intv) {
        body = fmt_num(R, v, flags, -1, -1, 'd', line);
    } else if (type == 'x' || type == 'X' || type == 'o') {
        if (!intv)
            DIE(R, line, "Unknown format code '%c' for object of type 'float'", type);
        body = fmt_num(R, v, flags, -1, -1, type, line);
    } else if (type == 'd') {
        DIE(R, line, "Unknown format code 'd' for object of type 'float'");
    } else if (!type && prec < 0) {
        struct obuf b = {0};
        if (strchr(flags, '+') && !signbit(fval(v)))
            ob_lit(R, &b, "+");
        else if (strchr(flags, ' ') && !signbit(fval(v)))
            ob_lit(R, &b, " ");
        jval fv = mkfloat(fval(v));
        write_str(R, &b, &fv, false, 0);
        body = ob_done(R, &b);
    } else if (type == '%') {
        jval pv = mkfloat(fval(v) * 100);
        body = jcat(R, fmt_num(R, &pv, flags, -1, prec < 0 ? 6 : prec, 'f', line),
                    mkjstr(R, "%", 1, PROV_LIT, NULL));
    } else if (!type || strchr("eEfFgG", type)) {
        body = fmt_num(R, v, flags, -1, prec < 0 ? 6 : prec, type ? type : 'g', line);
        if (!type && isfinite(fval(v)) && !memchr(body->s, '.', body->len) && !memchr(body->s, 'e', body->len))
            body = jcat(R, body, mkjstr(R, ".0", 2, PROV_LIT, NULL));
    } else {
        DIE(R, line, "Unknown format code '%c' for a number", type > 32 && type < 127 ? type : '?');
    }
    pad_put(R, o, body, width, align ? align : '>', fill, fill_len);
}

/* Python's str.format: {}, {0}, {name}, then .attr / [key], !r / !s / !a, :spec; {{ and }}. */
static struct jstr *py_format(struct rctx *R, const struct jstr *f, const struct args *a)
{
    struct obuf o = {0};
    const char *s = f->s;
    size_t auto_i = 0, n = f->len;
    int line = a->line, numbering = 0; /* 1 automatic, 2 manual */
    for (size_t i = 0; i < n;) {
        if ((s[i] == '{' || s[i] == '}') && i + 1 < n && s[i + 1] == s[i]) {
            ob_str(R, &o, jsub(R, f, i, 1));
            i += 2;
            continue;
        }
        if (s[i] == '}')
            DIE(R, line, "Single '}' encountered in format string");
        if (s[i] != '{') {
            size_t j = i;
            while (j < n && s[j] != '{' && s[j] != '}')
                j++;
            ob_str(R, &o, jsub(R, f, i, j - i));
            i = j;
            continue;
        }
        size_t j = ++i;
        while (j < n && !strchr(".[!:}", s[j]) && s[j])
            j++;
        if (j >= n)
            DIE(R, line, "expected '}' before end of string");
        const jval *v;
        bool digits = j > i;
        for (size_t k = i; k < j; k++)
            digits &= is_digit_c(s[k]);
        if (j == i || digits) {
            if (numbering && numbering != (j == i ? 1 : 2))
                DIE(R, line, "cannot switch between manual and automatic field numbering");
            numbering = j == i ? 1 : 2;
            size_t idx = j == i ? auto_i++ : (size_t)strtoull(j_strndup(&R->b, s + i, j - i > 9 ? 9 : j - i), NULL, 10);
            if (idx >= a->n)
                DIE(R, line, "IndexError: Replacement index %zu out of range for positional args tuple", idx);
            v = &a->pos[idx];
        } else {
            const char *key = j_strndup(&R->b, s + i, j - i);
            v = NULL;
            for (size_t k = 0; k < a->nkw; k++)
                if (is(a->kwn[k], key))
                    v = &a->kwv[k];
            if (!v)
                DIE(R, line, "KeyError: '%.100s'", key);
        }
        jval cur = *v;
        i = j;
        while (i < n && (s[i] == '.' || s[i] == '[')) {
            bool dot = s[i] == '.';
            size_t k = ++i;
            while (k < n && (dot ? !strchr(".[!:}", s[k]) : s[k] != ']') && s[k])
                k++;
            if (k >= n || k == i)
                DIE(R, line, "bad field name in a format string");
            char *part = j_strndup(&R->b, s + i, k - i);
            bool num = !dot;
            for (size_t q = i; q < k && num; q++)
                num = is_digit_c(s[q]);
            if (dot)
                cur = get_attr(R, cur, part, line);
            else if (num && k - i < 18)
                cur = get_item(R, cur, mkint(strtoll(part, NULL, 10)), line);
            else
                cur = get_item(R, cur, vstr(mkjstr(R, part, k - i, PROV_LIT, NULL)), line);
            if (cur.t == V_UNDEF)
                DIE(R, line, "'%.100s' is not in the formatted value", part);
            i = dot ? k : k + 1;
        }
        if (i < n && s[i] == '!') {
            char c = i + 1 < n ? s[i + 1] : 0;
            if (c != 'r' && c != 's' && c != 'a')
                DIE(R, line, "Unknown conversion specifier in a format string");
            cur = vstr(c == 's' ? to_str(R, &cur) : c == 'a' ? ascii_of(R, &cur) : repr_of(R, &cur));
            i += 2;
        }
        size_t ss = i, se = i;
        if (i < n && s[i] == ':') {
            ss = ++i;
            while (i < n && s[i] != '}') {
                if (s[i] == '{')
                    j_die(&R->b, MOE_EUNSUPPORTED, line, "nested fields in a format spec are not supported");
                i++;
            }
            se = i;
        }
        if (i >= n || s[i] != '}')
            DIE(R, line, "expected '}' before end of string");
        i++;
        format_spec(R, &o, &cur, jsub(R, f, ss, se - ss), line);
    }
    return ob_done(R, &o);
}

/* Python's str.center / ljust / rjust (how '^', '<', '>'); fill: one code point (NULL: a space). */
static struct jstr *str_justify(struct rctx *R, struct jstr *t, int64_t width, char how,
                                const struct jstr *fill, int line)
{
    if (width > 100000)
        j_die(&R->b, MOE_ETOOBIG, line, "a width of %lld", (long long)width);
    if (fill && u8_count(fill->s, fill->len) != 1)
        DIE(R, line, "the fill character must be exactly one character long");
    int64_t len = (int64_t)u8_count(t->s, t->len), marg = width - len;
    if (marg <= 0)
        return t;
    int64_t left = how == '<' ? 0 : how == '>' ? marg : marg / 2 + (marg & width & 1);
    struct obuf o = {0};
    for (int64_t k = 0; k < marg; k++) {
        if (k == left)
            ob_str(R, &o, t);
        if (fill)
            ob_str(R, &o, fill);
        else
            ob_lit(R, &o, " ");
    }
    if (left == marg)
        ob_str(R, &o, t);
    return ob_done(R, &o);
}

/* The part of s that str methods' optional start and end arguments (positions i and i + 1, code
 * points, negative from the end, none for the default) select, as Python clamps them; *cp_off is
 * where it begins. NULL when end falls before start, where even an empty string is not found. */
static const struct jstr *str_range(struct rctx *R, const struct jstr *s, const struct args *a, size_t i,
                                    int64_t *cp_off, const char *what)
{
    const jval *st = arg(a, i, NULL), *en = arg(a, i + 1, NULL);
    int64_t n = (int64_t)u8_count(s->s, s->len), b = 0, e = n;
    for (int k = 0; k < 2; k++) {
        const jval *v = k ? en : st;
        if (!v || v->t == V_NONE)
            continue;
        if (!is_intlike(v))
            DIE(R, a->line, "slice indices of %s() must be integers or None", what);
        int64_t x = ival(v);
        if (x < 0 && (x += n) < 0)
            x = 0;
        if (k)
            e = x > n ? n : x;
        else
            b = x;
    }
    *cp_off = b;
    if (e < b)
        return NULL;
    if (!st && !en)
        return s;
    size_t *off = u8_offsets(R, s, &(size_t){0});
    return jsub(R, s, off[b], off[e] - off[b]);
}

static jval call_method(struct rctx *R, const struct jmethod *m, const struct args *a)
{
    jval self = m->self;
    const char *name = m->name;
    int line = a->line;
    if (self.t == V_STR) {
        const struct jstr *s = self.u.s;
        if (is(name, "startswith") || is(name, "endswith")) {
            check_args(R, a, 3, NULL);
            const jval *p = arg(a, 0, NULL);
            if (!p)
                DIE(R, line, "%s() takes at least 1 argument", name);
            jval opts = p->t == V_LIST ? *p : (jval){0};
            size_t nopt = p->t == V_LIST ? p->u.l->n : 1;
            for (size_t k = 0; k < nopt; k++) /* the type first, as Python checks it */
                need_str(R, p->t == V_LIST ? &opts.u.l->v[k] : p, line, name);
            int64_t from;
            s = str_range(R, s, a, 1, &from, name);
            if (!s)
                return mkbool(false);
            for (size_t k = 0; k < nopt; k++) {
                const struct jstr *x = need_str(R, p->t == V_LIST ? &opts.u.l->v[k] : p, line, name);
                if (x->len <= s->len &&
                    !memcmp(name[0] == 's' ? s->s : s->s + s->len - x->len, x->s, x->len))
                    return mkbool(true);
            }
            return mkbool(false);
        }
        if (is(name, "split") || is(name, "rsplit")) {
            static const char *const kw[] = {"sep", "maxsplit", NULL};
            check_args(R, a, 2, kw);
            const jval *ms = arg(a, 1, "maxsplit");
            if (ms && !is_intlike(ms))
                DIE(R, line, "maxsplit must be an integer");
            return str_split(R, s, arg(a, 0, "sep"), ms ? ival(ms) : -1, name[0] == 'r', line);
        }
        if (is(name, "strip") || is(name, "lstrip") || is(name, "rstrip")) {
            check_args(R, a, 1, NULL);
            return vstr(str_strip(R, s, arg(a, 0, NULL), name[0] == 'l' ? 1 : name[0] == 'r' ? 2 : 3, line));
        }
        if (is(name, "replace")) {
            static const char *const kw[] = {"count", NULL};
            check_args(R, a, 3, kw);
            const jval *o = arg(a, 0, NULL), *n = arg(a, 1, NULL), *c = arg(a, 2, "count");
            if (!o || !n)
                DIE(R, line, "replace() takes at least 2 arguments");
            if (c && !is_intlike(c))
                DIE(R, line, "replace()'s count must be an integer");
            return vstr(str_replace(R, s, need_str(R, o, line, "replace's old"),
                                    need_str(R, n, line, "replace's new"), c ? ival(c) : -1));
        }
        if (is(name, "upper") || is(name, "lower") || is(name, "title") || is(name, "capitalize")) {
            check_args(R, a, 0, NULL);
            return vstr(str_case(R, s, name[0] == 'l' ? 0 : name[0] == 'u' ? 1 : name[0] == 't' ? 2 : 3));
        }
        if (is(name, "format"))
            return vstr(py_format(R, s, a));
        if (is(name, "center") || is(name, "ljust") || is(name, "rjust") || is(name, "zfill")) {
            bool z = name[0] == 'z';
            check_args(R, a, z ? 1 : 2, NULL);
            if (!a->n || !is_intlike(&a->pos[0]))
                DIE(R, line, "%s() needs an integer width", name);
            if (!z)
                return vstr(str_justify(R, (struct jstr *)s, ival(&a->pos[0]), name[0] == 'c' ? '^' : name[0] == 'l' ? '<' : '>',
                                        a->n > 1 ? need_str(R, &a->pos[1], line, "the fill character") : NULL, line));
            size_t sg = s->len && (s->s[0] == '-' || s->s[0] == '+'); /* zeros after the sign */
            struct jstr *digits = str_justify(R, jsub(R, s, sg, s->len - sg), ival(&a->pos[0]) - (int64_t)sg, '>',
                                              mkjstr(R, "0", 1, PROV_LIT, NULL), line);
            return vstr(jcat(R, jsub(R, s, 0, sg), digits));
        }
        if (is(name, "join")) {
            check_args(R, a, 1, NULL);
            if (!a->n)
                DIE(R, line, "join() takes one argument");
            jval l = as_list(R, &a->pos[0], line); /* str.join, unlike the filter: strings only */
            for (size_t i = 0; i < l.u.l->n; i++)
                if (l.u.l->v[i].t != V_STR)
                    DIE(R, line, "sequence item %zu: expected str instance, %s found", i, tname(&l.u.l->v[i]));
            return join(R, l, s, line);
        }
        if (is(name, "find") || is(name, "rfind") || is(name, "count") || is(name, "index") || is(name, "rindex")) {
            check_args(R, a, 3, NULL);
            if (!a->n)
                DIE(R, line, "%s() takes at least 1 argument", name);
            const struct jstr *x = need_str(R, &a->pos[0], line, name);
            int64_t from;
            s = str_range(R, s, a, 1, &from, name);
            if (!s) {
                if (is(name, "index") || is(name, "rindex"))
                    DIE(R, line, "substring not found");
                return mkint(is(name, "count") ? 0 : -1);
            }
            int64_t cnt = 0, first = -1, last = -1;
            for (size_t i = 0; i + x->len <= s->len;) {
                if (!memcmp(s->s + i, x->s, x->len)) {
                    int64_t cpi = (int64_t)u8_count(s->s, i);
                    if (first < 0)
                        first = cpi;
                    last = cpi;
                    cnt++;
                    i += x->len ? x->len : 1;
                } else {
                    i++;
                }
                if (!x->len && i > s->len)
                    break;
            }
            if (is(name, "count"))
                return mkint(x->len ? cnt : (int64_t)u8_count(s->s, s->len) + 1);
            for (size_t i = s->len - x->len + 1; x->len && last >= 0 && i-- > 0;) /* the last, overlaps too */
                if (!memcmp(s->s + i, x->s, x->len)) {
                    last = (int64_t)u8_count(s->s, i);
                    break;
                }
            if ((is(name, "index") || is(name, "rindex")) && first < 0)
                DIE(R, line, "substring not found");
            int64_t at = name[0] == 'r' ? last : first;
            return mkint(at < 0 ? at : at + from);
        }
        if (is(name, "partition") || is(name, "rpartition")) { /* (before, sep, after) */
            check_args(R, a, 1, NULL);
            if (!a->n)
                DIE(R, line, "%s() takes one argument", name);
            const struct jstr *x = need_str(R, &a->pos[0], line, name);
            if (!x->len)
                DIE(R, line, "empty separator");
            bool r = name[0] == 'r';
            size_t at = s->len;
            for (size_t k = 0; k + x->len <= s->len; k++) {
                size_t i = r ? s->len - x->len - k : k;
                if (!memcmp(s->s + i, x->s, x->len)) {
                    at = i;
                    break;
                }
            }
            jval t = mklist(R, 3, true);
            jval empty = vstr(jsub(R, s, 0, 0));
            if (at == s->len) { /* not found: the string first (partition) or last */
                t.u.l->v[0] = t.u.l->v[1] = t.u.l->v[2] = empty;
                t.u.l->v[r ? 2 : 0] = self;
                return t;
            }
            t.u.l->v[0] = vstr(jsub(R, s, 0, at));
            t.u.l->v[1] = vstr(jsub(R, s, at, x->len));
            t.u.l->v[2] = vstr(jsub(R, s, at + x->len, s->len - at - x->len));
            return t;
        }
        if (is(name, "isascii")) {
            check_args(R, a, 0, NULL);
            for (size_t i = 0; i < s->len; i++)
                if ((unsigned char)s->s[i] >= 0x80)
                    return mkbool(false);
            return mkbool(true);
        }
        if (is(name, "splitlines")) { /* at \n, \r\n, \r, \v, \f, \x1c-\x1e, \x85, U+2028, U+2029 */
            static const char *const kw[] = {"keepends", NULL};
            check_args(R, a, 1, kw);
            const jval *ke = arg(a, 0, "keepends");
            if (ke && !is_intlike(ke))
                DIE(R, line, "'%s' object cannot be interpreted as an integer", tname(ke));
            bool keep = ke && truthy(ke);
            size_t cnt = 0, end, next;
            for (size_t i = 0; i < s->len; i = next, cnt++)
                line_end(s, i, &end, &next);
            jval out = mklist(R, cnt, false);
            cnt = 0;
            for (size_t i = 0; i < s->len; i = next) {
                line_end(s, i, &end, &next);
                out.u.l->v[cnt++] = vstr(jsub(R, s, i, (keep ? next : end) - i));
            }
            return out;
        }
        if (is(name, "removeprefix") || is(name, "removesuffix")) {
            check_args(R, a, 1, NULL);
            if (!a->n)
                DIE(R, line, "%s() takes one argument", name);
            const struct jstr *x = need_str(R, &a->pos[0], line, name);
            bool pre = name[6] == 'p';
            if (x->len <= s->len && !memcmp(pre ? s->s : s->s + s->len - x->len, x->s, x->len))
                return vstr(jsub(R, s, pre ? x->len : 0, s->len - x->len));
            return self;
        }
        if (is(name, "isupper") || is(name, "islower")) {
            check_args(R, a, 0, NULL);
            return mkbool(str_is_case(s, name[2] == 'l'));
        }
        if (is(name, "isdigit") || is(name, "isalpha") || is(name, "isalnum") || is(name, "isspace")) {
            check_args(R, a, 0, NULL);
            if (!s->len)
                return mkbool(false);
            bool ok = true;
            if (is(name, "isspace")) { /* the whitespace of str.split() */
                for (size_t i = 0, next; i < s->len; i = next)
                    ok &= py_space(u8_cp(s->s, s->len, i, &next));
                return mkbool(ok);
            }
            for (size_t i = 0; i < s->len; i++) {
                unsigned char c = (unsigned char)s->s[i];
                bool dig = c >= '0' && c <= '9', up = c >= 'A' && c <= 'Z', lo = c >= 'a' && c <= 'z';
                if (is(name, "isdigit")) ok &= dig;
                else if (is(name, "isalpha")) ok &= up || lo || c >= 0x80;
                else ok &= up || lo || dig || c >= 0x80; /* isalnum */
            }
            return mkbool(ok);
        }
        j_die(&R->b, MOE_EUNSUPPORTED, line, "str.%s() is not supported", name);
    }
    if (self.t == V_DICT) {
        const struct jdict *d = self.u.d;
        if (is(name, "get")) {
            check_args(R, a, 2, NULL);
            if (!a->n)
                DIE(R, line, "get() takes at least one argument");
            jval *v = d_find(d, &a->pos[0]);
            return v ? *v : a->n > 1 ? a->pos[1] : NONE;
        }
        if (is(name, "items") || is(name, "keys") || is(name, "values")) {
            check_args(R, a, 0, NULL);
            jval l = mklist(R, d->n, false);
            for (size_t i = 0; i < d->n; i++) {
                if (name[0] == 'i') {
                    jval t = mklist(R, 2, true);
                    t.u.l->v[0] = d->k[i];
                    t.u.l->v[1] = d->v[i];
                    l.u.l->v[i] = t;
                } else {
                    l.u.l->v[i] = name[0] == 'k' ? d->k[i] : d->v[i];
                }
            }
            return l;
        }
        if (is(name, "copy")) {
            jval c = mkdict(R);
            for (size_t i = 0; i < d->n; i++)
                d_set(R, c.u.d, d->k[i], d->v[i]);
            return c;
        }
        DIE(R, line, "dict.%s() is not supported", name);
    }
    if (self.t == V_LIST) {
        const struct jlist *l = self.u.l;
        if (is(name, "index") || is(name, "count")) {
            check_args(R, a, 1, NULL);
            if (!a->n)
                DIE(R, line, "%s() takes one argument", name);
            int64_t cnt = 0;
            for (size_t i = 0; i < l->n; i++)
                if (vequal(&l->v[i], &a->pos[0], 0)) {
                    if (name[0] == 'i')
                        return mkint((int64_t)i);
                    cnt++;
                }
            if (name[0] == 'i')
                DIE(R, line, "list.index(x): x not in list");
            return mkint(cnt);
        }
        if (is(name, "copy"))
            return self; /* lists are never modified */
        DIE(R, line, "list.%s() is not supported", name);
    }
    if (self.t == V_LOOP && is(name, "changed")) {
        jval now = mklist(R, a->n, true);
        if (a->n)
            memcpy(now.u.l->v, a->pos, a->n * sizeof(jval));
        bool changed = self.u.lp->changed.t == V_UNDEF || !vequal(&self.u.lp->changed, &now, 0);
        self.u.lp->changed = now;
        return mkbool(changed);
    }
    if (self.t == V_OBJ && (is(name, "next") || is(name, "reset"))) {
        check_args(R, a, 0, NULL);
        struct jobj *ob = self.u.ob;
        if (name[0] == 'r') {
            ob->pos = 0;
            return NONE;
        }
        jval rv = ob->items[ob->pos];
        ob->pos = (ob->pos + 1) % ob->n;
        return rv;
    }
    if (self.t == V_LOOP && is(name, "cycle")) {
        if (!a->n)
            DIE(R, line, "loop.cycle() needs at least one argument");
        return a->pos[self.u.lp->i % a->n];
    }
    DIE(R, line, "'%s' is not callable", name);
}

static void exec_for_list(struct rctx *R, const struct jnode *n, struct scope *s, jval it,
                          unsigned depth, struct obuf *o);

/* loop(items) in a recursive loop: the loop's body over items, one level deeper. */
static jval call_loop(struct rctx *R, struct jloop *lp, const struct args *a)
{
    if (!lp->node->op) /* N_FOR: recursive */
        DIE(R, a->line, "the loop is not marked 'recursive'; loop() calls only such loops");
    if (a->n != 1 || a->nkw)
        DIE(R, a->line, "loop() takes one argument, the items");
    if (R->depth >= R->max_depth)
        j_die(&R->b, MOE_ETOOBIG, a->line, "recursive loops or macro calls nested more than %u deep", R->max_depth);
    count_iter(R, a->line);
    R->depth++;
    struct obuf o = {0};
    exec_for_list(R, lp->node, lp->scope, a->pos[0], lp->depth + 1, &o);
    R->depth--;
    return vstr(ob_done(R, &o));
}

static jval call_value(struct rctx *R, jval f, const struct args *a)
{
    switch (f.t) {
    case V_MACRO: return call_macro(R, f.u.mac, a, NULL);
    case V_LOOP: return call_loop(R, f.u.lp, a);
    case V_FUNC: return call_func(R, f.u.fn, a);
    case V_METHOD: return call_method(R, f.u.me, a);
    case V_OBJ: /* a joiner */
        if (f.u.ob->cycler)
            DIE(R, a->line, "'Cycler' object is not callable");
        check_args(R, a, 0, NULL);
        if (!f.u.ob->used) {
            f.u.ob->used = true;
            return vstr(mkjstr(R, "", 0, PROV_LIT, NULL));
        }
        return f.u.ob->sep;
    case V_UNDEF: undefined_error(R, a->line, &f);
    default: DIE(R, a->line, "'%s' object is not callable", tname(&f));
    }
}

static struct args eval_args(struct rctx *R, const struct jnode *n, struct scope *s, const char *what)
{
    struct args a = {.n = n->args.n, .nkw = n->kwargs.n, .kwn = n->kwnames, .line = n->line, .what = what};
    if (a.n) {
        jval *p = j_alloc(&R->b, a.n * sizeof *p);
        for (size_t i = 0; i < a.n; i++)
            p[i] = eval(R, n->args.v[i], s);
        a.pos = p;
    }
    if (a.nkw) {
        jval *p = j_alloc(&R->b, a.nkw * sizeof *p);
        for (size_t i = 0; i < a.nkw; i++)
            p[i] = eval(R, n->kwargs.v[i], s);
        a.kwv = p;
    }
    if (n->b) { /* *seq: more positional arguments */
        jval x = eval(R, n->b, s);
        jval l = as_list(R, &x, n->line);
        jval *p = j_alloc(&R->b, (a.n + l.u.l->n + 1) * sizeof *p);
        if (a.n)
            memcpy(p, a.pos, a.n * sizeof *p);
        if (l.u.l->n)
            memcpy(p + a.n, l.u.l->v, l.u.l->n * sizeof *p);
        a.pos = p;
        a.n += l.u.l->n;
    }
    if (n->c) { /* **mapping: more keyword arguments */
        jval x = eval(R, n->c, s);
        if (x.t != V_DICT && x.t != V_NS)
            DIE(R, n->line, "argument after ** must be a mapping, not %s", tname(&x));
        const struct jdict *d = x.u.d;
        const char **kn = j_alloc(&R->b, (a.nkw + d->n + 1) * sizeof *kn);
        jval *kv = j_alloc(&R->b, (a.nkw + d->n + 1) * sizeof *kv);
        if (a.nkw) {
            memcpy(kn, a.kwn, a.nkw * sizeof *kn);
            memcpy(kv, a.kwv, a.nkw * sizeof *kv);
        }
        for (size_t i = 0; i < d->n; i++) {
            if (d->k[i].t != V_STR)
                DIE(R, n->line, "keywords must be strings");
            for (size_t k = 0; k < a.nkw + i; k++)
                if (strlen(kn[k]) == d->k[i].u.s->len && !memcmp(kn[k], d->k[i].u.s->s, d->k[i].u.s->len))
                    DIE(R, n->line, "got multiple values for keyword argument '%s'", kn[k]);
            kn[a.nkw + i] = j_strndup(&R->b, d->k[i].u.s->s, d->k[i].u.s->len);
            kv[a.nkw + i] = d->v[i];
        }
        a.kwn = kn;
        a.kwv = kv;
        a.nkw += d->n;
    }
    return a;
}

/* ---- Filters ---- */

/* item.attr where attr may be dotted ("function.name") or a number. */
static jval attr_path(struct rctx *R, jval v, const struct jstr *path, int line)
{
    size_t i = 0;
    while (i <= path->len) {
        size_t j = i;
        while (j < path->len && path->s[j] != '.')
            j++;
        char *part = j_strndup(&R->b, path->s + i, j - i);
        bool num = j > i;
        for (size_t k = i; k < j; k++)
            if (path->s[k] < '0' || path->s[k] > '9')
                num = false;
        if (v.t == V_UNDEF)
            return v;
        if (num && j - i < 18)
            v = get_item(R, v, mkint(strtoll(part, NULL, 10)), line);
        else
            v = get_item(R, v, vstr(mkjstr(R, part, j - i, PROV_LIT, NULL)), line);
        i = j + 1;
    }
    return v;
}

static jval lower_key(struct rctx *R, jval v, bool case_sensitive)
{
    return !case_sensitive && v.t == V_STR ? vstr(str_case(R, v.u.s, 0)) : v;
}

/* sort's key: attribute "a" or "a,b" (a tuple of the values), strings lowered unless case_sensitive. */
static jval multi_key(struct rctx *R, jval v, const struct jstr *path, bool case_sensitive, int line)
{
    if (!memchr(path->s, ',', path->len))
        return lower_key(R, attr_path(R, v, path, line), case_sensitive);
    jval parts = str_split(R, path, &(jval){.t = V_STR, .u.s = mkjstr(R, ",", 1, PROV_LIT, NULL)}, -1, false, line);
    jval k = mklist(R, parts.u.l->n, true);
    for (size_t i = 0; i < parts.u.l->n; i++)
        k.u.l->v[i] = lower_key(R, attr_path(R, v, parts.u.l->v[i].u.s, line), case_sensitive);
    return k;
}

/* Stable merge sort of vals by keys. */
static void sort_vals(struct rctx *R, jval *vals, jval *keys, size_t n, bool reverse, int line)
{
    if (n < 2)
        return;
    jval *tv = j_alloc(&R->b, n * sizeof *tv), *tk = j_alloc(&R->b, n * sizeof *tk);
    for (size_t w = 1; w < n; w *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * w) {
            size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                int c = vcompare(R, &keys[j], &keys[i], line, 0);
                bool take_right = reverse ? c > 0 : c < 0;
                if (take_right) {
                    tv[k] = vals[j];
                    tk[k++] = keys[j++];
                } else {
                    tv[k] = vals[i];
                    tk[k++] = keys[i++];
                }
            }
            while (i < mid) {
                tv[k] = vals[i];
                tk[k++] = keys[i++];
            }
            while (j < hi) {
                tv[k] = vals[j];
                tk[k++] = keys[j++];
            }
        }
        memcpy(vals, tv, n * sizeof *vals);
        memcpy(keys, tk, n * sizeof *keys);
    }
}

/* str.splitlines(): the line starting at i ends at *end, the next starts at *next. */
static void line_end(const struct jstr *s, size_t i, size_t *end, size_t *next)
{
    const unsigned char *p = (const unsigned char *)s->s;
    size_t n = s->len;
    for (; i < n; i++) {
        unsigned c = p[i];
        size_t w = 0;
        if (c == '\r')
            w = i + 1 < n && p[i + 1] == '\n' ? 2 : 1;
        else if (c == '\n' || c == 0x0b || c == 0x0c || (c >= 0x1c && c <= 0x1e))
            w = 1;
        else if (c == 0xc2 && i + 1 < n && p[i + 1] == 0x85)
            w = 2;
        else if (c == 0xe2 && i + 2 < n && p[i + 1] == 0x80 && (p[i + 2] == 0xa8 || p[i + 2] == 0xa9))
            w = 3;
        if (w) {
            *end = i;
            *next = i + w;
            return;
        }
    }
    *end = *next = n;
}

static jval f_indent(struct rctx *R, jval v, const struct args *a)
{
    static const char *const kw[] = {"width", "first", "blank", NULL};
    check_args(R, a, 3, kw);
    const jval *w = arg(a, 0, "width"), *first = arg(a, 1, "first"), *blank = arg(a, 2, "blank");
    if (v.t == V_UNDEF) /* undefined + "\n" */
        undefined_error(R, a->line, &v);
    if (v.t == V_LIST) /* jinja2: s += "\n"; s.splitlines() */
        DIE(R, a->line, "indent: 'list' object has no attribute 'splitlines'");
    if (v.t != V_STR)
        DIE(R, a->line, "indent: unsupported operand type(s) for +=: '%s' and 'str'", tname(&v));
    struct jstr *ind;
    if (w && w->t == V_STR) {
        ind = w->u.s;
    } else {
        int64_t n = w ? (is_intlike(w) ? ival(w) : -1) : 4;
        if (n < 0 || n > 256)
            DIE(R, a->line, "indent width must be an integer from 0 to 256");
        char *sp = j_alloc(&R->b, (size_t)n + 1);
        memset(sp, ' ', (size_t)n);
        ind = mkjstr(R, sp, (size_t)n, PROV_LIT, NULL);
    }
    /* Jinja2: s += "\n"; lines = s.splitlines(); the first line as is, the others indented
     * (empty ones only with blank) */
    struct jstr *s = jcat(R, to_str(R, &v), mkjstr(R, "\n", 1, PROV_LIT, NULL));
    struct obuf o = {0};
    if (first && truthy(first))
        ob_str(R, &o, ind);
    size_t i = 0;
    for (bool first_line = true; i < s->len; first_line = false) {
        size_t end, next;
        line_end(s, i, &end, &next);
        struct jstr *ln = jsub(R, s, i, end - i);
        if (!first_line) {
            ob_lit(R, &o, "\n");
            if (ln->len || (blank && truthy(blank)))
                ob_str(R, &o, ind);
        }
        ob_str(R, &o, ln);
        i = next;
    }
    return vstr(ob_done(R, &o));
}

static jval f_tojson(struct rctx *R, jval v, const struct args *a)
{
    static const char *const kw[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
    check_args(R, a, 4, kw);
    const jval *asc = arg(a, 0, "ensure_ascii"), *ind = arg(a, 1, "indent"),
               *sep = arg(a, 2, "separators"), *sk = arg(a, 3, "sort_keys");
    struct json_fmt f = {.item_sep = ", ", .key_sep = ": ", .ascii = asc && truthy(asc),
                         .sort_keys = sk && truthy(sk)};
    if (ind && ind->t != V_NONE) {
        if (ind->t == V_STR) {
            f.indent = j_strndup(&R->b, ind->u.s->s, ind->u.s->len);
        } else if (is_intlike(ind)) {
            int64_t n = ival(ind);
            if (n > 256)
                DIE(R, a->line, "tojson indent must be at most 256");
            n = n < 0 ? 0 : n;
            char *sp = j_alloc(&R->b, (size_t)n + 1);
            memset(sp, ' ', (size_t)n);
            sp[n] = 0;
            f.indent = sp;
        } else {
            DIE(R, a->line, "tojson indent must be an integer or a string");
        }
        f.item_sep = ",";
    }
    if (sep && sep->t != V_NONE) {
        if (sep->t != V_LIST || sep->u.l->n != 2 || sep->u.l->v[0].t != V_STR || sep->u.l->v[1].t != V_STR)
            DIE(R, a->line, "tojson separators must be a pair of strings");
        f.item_sep = j_strndup(&R->b, sep->u.l->v[0].u.s->s, sep->u.l->v[0].u.s->len);
        f.key_sep = j_strndup(&R->b, sep->u.l->v[1].u.s->s, sep->u.l->v[1].u.s->len);
    }
    struct obuf o = {0};
    json_write(R, &o, &v, &f, 0, a->line);
    return vstr(ob_done(R, &o));
}

static jval f_select(struct rctx *R, const char *fname, jval v, const struct args *a)
{
    bool attr = strstr(fname, "attr") != NULL, reject = fname[0] == 'r';
    if (!truthy(&v)) /* Jinja2 iterates only a true value */
        return mklist(R, 0, false);
    jval l = as_list(R, &v, a->line);
    size_t skip = attr ? 1 : 0;
    const struct jstr *path = NULL;
    if (attr) {
        if (!a->n)
            DIE(R, a->line, "%s needs an attribute name", fname);
        path = need_str(R, &a->pos[0], a->line, "the attribute name");
    }
    const char *test = NULL;
    if (a->n > skip) {
        test = j_strndup(&R->b, need_str(R, &a->pos[skip], a->line, "the test name")->s,
                         a->pos[skip].u.s->len);
        if (j_test_id(test) < 0)
            j_die(&R->b, MOE_EUNSUPPORTED, a->line, "no test named '%s'", test);
    }
    struct args ta = {.pos = a->n > skip + 1 ? a->pos + skip + 1 : NULL,
                      .n = a->n > skip + 1 ? a->n - skip - 1 : 0, .line = a->line, .what = test};
    jval out = mklist(R, l.u.l->n, false);
    size_t k = 0;
    for (size_t i = 0; i < l.u.l->n; i++) {
        jval x = l.u.l->v[i];
        jval y = attr ? attr_path(R, x, path, a->line) : x;
        bool ok = test ? run_test(R, test, y, &ta) : truthy(&y);
        if (ok != reject)
            out.u.l->v[k++] = x;
    }
    out.u.l->n = k;
    return out;
}

static jval call_filter(struct rctx *R, const struct jnode *f, jval v, struct scope *s)
{
    struct args a = eval_args(R, f, s, f->name);
    return call_filter_named(R, f->name, v, &a);
}

static jval call_filter_named(struct rctx *R, const char *name, jval v, const struct args *a)
{
    int line = a->line;
    if (j_filter_refused(name))
        j_die(&R->b, MOE_EUNSUPPORTED, line, "the filter '%s' is not supported", name);
    if (is(name, "tojson"))
        return f_tojson(R, v, a);
    if (is(name, "indent"))
        return f_indent(R, v, a);
    if (is(name, "trim")) {
        check_args(R, a, 1, NULL);
        return vstr(str_strip(R, to_str(R, &v), arg(a, 0, "chars"), 3, line));
    }
    if (is(name, "length") || is(name, "count")) {
        check_args(R, a, 0, NULL);
        switch (v.t) {
        case V_UNDEF: return mkint(0);
        case V_STR: return mkint((int64_t)u8_count(v.u.s->s, v.u.s->len));
        case V_LIST: return mkint((int64_t)v.u.l->n);
        case V_DICT: return mkint((int64_t)v.u.d->n);
        default: DIE(R, line, "object of type '%s' has no len()", tname(&v));
        }
    }
    if (is(name, "items")) {
        check_args(R, a, 0, NULL);
        if (v.t == V_UNDEF)
            return mklist(R, 0, false);
        if (v.t != V_DICT)
            DIE(R, line, "can only get item pairs from a mapping, not %s", tname(&v));
        struct jmethod m = {v, "items"};
        struct args none = {.line = line, .what = "items"};
        return call_method(R, &m, &none);
    }
    if (is(name, "dictsort")) {
        static const char *const kw[] = {"case_sensitive", "by", "reverse", NULL};
        check_args(R, a, 3, kw);
        if (v.t == V_UNDEF) /* undefined.items() */
            undefined_error(R, line, &v);
        if (v.t != V_DICT)
            DIE(R, line, "dictsort needs a mapping, not %s", tname(&v));
        const jval *cs = arg(a, 0, "case_sensitive"), *by = arg(a, 1, "by"), *rev = arg(a, 2, "reverse");
        bool by_value = false;
        if (by) {
            const struct jstr *b = need_str(R, by, line, "dictsort's by");
            if (b->len == 5 && !memcmp(b->s, "value", 5))
                by_value = true;
            else if (!(b->len == 3 && !memcmp(b->s, "key", 3)))
                DIE(R, line, "dictsort: by must be 'key' or 'value'");
        }
        struct jmethod m = {v, "items"};
        struct args none = {.line = line, .what = "items"};
        jval l = call_method(R, &m, &none);
        size_t n = l.u.l->n;
        jval *keys = j_alloc(&R->b, (n ? n : 1) * sizeof *keys);
        for (size_t i = 0; i < n; i++)
            keys[i] = lower_key(R, l.u.l->v[i].u.l->v[by_value ? 1 : 0], cs && truthy(cs));
        sort_vals(R, l.u.l->v, keys, n, rev && truthy(rev), line);
        return l;
    }
    if (is(name, "selectattr") || is(name, "rejectattr") || is(name, "select") || is(name, "reject"))
        return f_select(R, name, v, a);
    if (is(name, "map")) {
        static const char *const kw[] = {"attribute", "default", NULL};
        jval l = truthy(&v) ? as_list(R, &v, line) : mklist(R, 0, false);
        jval out = mklist(R, l.u.l->n, false);
        const jval *at = NULL;
        for (size_t k = 0; k < a->nkw; k++)
            if (is(a->kwn[k], "attribute"))
                at = &a->kwv[k];
        if (at) {
            check_args(R, a, 0, kw);
            const struct jstr *path = need_str(R, at, line, "map's attribute");
            const jval *def = arg(a, 99, "default");
            for (size_t i = 0; i < l.u.l->n; i++) {
                jval x = attr_path(R, l.u.l->v[i], path, line);
                out.u.l->v[i] = x.t == V_UNDEF && def ? *def : x;
            }
            return out;
        }
        if (!a->n)
            DIE(R, line, "map needs a filter name or attribute=");
        const struct jstr *fn = need_str(R, &a->pos[0], line, "map's filter name");
        char *fname = j_strndup(&R->b, fn->s, fn->len);
        if (j_filter_refused(fname))
            j_die(&R->b, MOE_EUNSUPPORTED, line, "the filter '%s' is not supported", fname);
        if (j_filter_id(fname) < 0)
            j_die(&R->b, MOE_EUNSUPPORTED, line, "no filter named '%s'", fname);
        struct args fa = *a;
        fa.pos++;
        fa.n--;
        fa.what = fname;
        for (size_t i = 0; i < l.u.l->n; i++)
            out.u.l->v[i] = call_filter_named(R, fname, l.u.l->v[i], &fa);
        return out;
    }
    if (is(name, "join")) {
        static const char *const kw[] = {"d", "attribute", NULL};
        check_args(R, a, 2, kw);
        const jval *d = arg(a, 0, "d"), *at = arg(a, 1, "attribute");
        jval seq = v;
        if (at) {
            jval l = as_list(R, &v, line);
            seq = mklist(R, l.u.l->n, false);
            const struct jstr *path = need_str(R, at, line, "join's attribute");
            for (size_t i = 0; i < l.u.l->n; i++)
                seq.u.l->v[i] = attr_path(R, l.u.l->v[i], path, line);
        }
        return join(R, seq, d ? to_str(R, d) : mkjstr(R, "", 0, PROV_LIT, NULL), line);
    }
    if (is(name, "first") || is(name, "last")) {
        check_args(R, a, 0, NULL);
        jval l = as_list(R, &v, line);
        if (!l.u.l->n) /* jinja2's undefined, with its hint */
            return undef_named(name[0] == 'f' ? "\1No first item, sequence was empty."
                                              : "\1No last item, sequence was empty.");
        return l.u.l->v[name[0] == 'f' ? 0 : l.u.l->n - 1];
    }
    if (is(name, "default") || is(name, "d")) {
        static const char *const kw[] = {"default_value", "boolean", NULL};
        check_args(R, a, 2, kw);
        const jval *dv = arg(a, 0, "default_value"), *b = arg(a, 1, "boolean");
        bool use = v.t == V_UNDEF || (b && truthy(b) && !truthy(&v));
        return use ? (dv ? *dv : cstr(R, "")) : v;
    }
    if (is(name, "upper") || is(name, "lower") || is(name, "capitalize") || is(name, "title")) {
        check_args(R, a, 0, NULL);
        struct jstr *s = to_str(R, &v);
        return vstr(str_case(R, s, name[0] == 'l' ? 0 : name[0] == 'u' ? 1 : name[0] == 'c' ? 3 : 4));
    }
    if (is(name, "replace")) {
        static const char *const kw[] = {"old", "new", "count", NULL};
        check_args(R, a, 3, kw);
        const jval *o = arg(a, 0, "old"), *n = arg(a, 1, "new"), *c = arg(a, 2, "count");
        if (!o || !n)
            DIE(R, line, "replace needs old and new");
        if (c && c->t != V_NONE && !is_intlike(c))
            DIE(R, line, "replace's count must be an integer");
        return vstr(str_replace(R, to_str(R, &v), to_str(R, o), to_str(R, n),
                                c && c->t != V_NONE ? ival(c) : -1));
    }
    if (is(name, "string")) {
        check_args(R, a, 0, NULL);
        return vstr(to_str(R, &v));
    }
    if (is(name, "safe") || is(name, "e") || is(name, "escape") || is(name, "forceescape")) {
        check_args(R, a, 0, NULL);
        struct jstr *s = to_str(R, &v);
        if (name[0] == 's' || (s->markup && name[0] != 'f')) {
            struct jstr *m = mkjstr(R, s->s, s->len, s->prov, s->m);
            m->markup = true;
            return vstr(m);
        }
        return vstr(html_escape(R, s));
    }
    if (is(name, "int") || is(name, "float")) {
        static const char *const kw[] = {"default", "base", NULL};
        check_args(R, a, 2, kw);
        const jval *dv = arg(a, 0, "default");
        bool fl = name[0] == 'f';
        if (v.t == V_UNDEF) /* int(undefined) fails in jinja2 */
            undefined_error(R, line, &v);
        jval def = dv ? *dv : fl ? mkfloat(0) : mkint(0);
        if (is_num(&v)) {
            if (fl)
                return mkfloat(fval(&v));
            if (v.t == V_FLOAT) {
                if (!(v.u.f > -9.2e18 && v.u.f < 9.2e18))
                    return def;
                return mkint((int64_t)v.u.f);
            }
            return mkint(ival(&v));
        }
        if (v.t != V_STR)
            return def;
        char *t = j_strndup(&R->b, v.u.s->s, v.u.s->len > 64 ? 64 : v.u.s->len), *end;
        errno = 0;
        if (!fl) {
            long long x = strtoll(t, &end, 10);
            while (*end == ' ' || *end == '\t' || *end == '\n')
                end++;
            if (!errno && end != t && !*end)
                return mkint(x);
        }
        double d = strtod(t, &end);
        while (*end == ' ' || *end == '\t' || *end == '\n')
            end++;
        if (end == t || *end)
            return def;
        if (fl)
            return mkfloat(d);
        if (!(d > -9.2e18 && d < 9.2e18))
            return def;
        return mkint((int64_t)d);
    }
    if (is(name, "list")) {
        check_args(R, a, 0, NULL);
        jval l = as_list(R, &v, line);
        jval c = mklist(R, l.u.l->n, false);
        if (l.u.l->n)
            memcpy(c.u.l->v, l.u.l->v, l.u.l->n * sizeof(jval));
        return c;
    }
    if (is(name, "unique")) {
        static const char *const kw[] = {"case_sensitive", "attribute", NULL};
        check_args(R, a, 2, kw);
        const jval *cs = arg(a, 0, "case_sensitive"), *at = arg(a, 1, "attribute");
        jval l = as_list(R, &v, line);
        jval out = mklist(R, l.u.l->n, false);
        jval *seen = j_alloc(&R->b, (l.u.l->n ? l.u.l->n : 1) * sizeof *seen);
        size_t k = 0;
        for (size_t i = 0; i < l.u.l->n; i++) {
            jval key = l.u.l->v[i];
            if (at)
                key = attr_path(R, key, need_str(R, at, line, "unique's attribute"), line);
            key = lower_key(R, key, cs && truthy(cs));
            bool dup = false;
            for (size_t j = 0; j < k && !dup; j++)
                dup = vequal(&seen[j], &key, 0);
            if (!dup) {
                seen[k] = key;
                out.u.l->v[k++] = l.u.l->v[i];
            }
        }
        out.u.l->n = k;
        return out;
    }
    if (is(name, "reverse")) {
        check_args(R, a, 0, NULL);
        if (v.t == V_STR) {
            jval m1 = mkint(-1);
            return slice(R, v, NULL, NULL, &m1, line);
        }
        jval l = as_list(R, &v, line);
        jval out = mklist(R, l.u.l->n, false);
        for (size_t i = 0; i < l.u.l->n; i++)
            out.u.l->v[i] = l.u.l->v[l.u.l->n - 1 - i];
        return out;
    }
    if (is(name, "sort")) {
        static const char *const kw[] = {"reverse", "case_sensitive", "attribute", NULL};
        check_args(R, a, 3, kw);
        const jval *rev = arg(a, 0, "reverse"), *cs = arg(a, 1, "case_sensitive"), *at = arg(a, 2, "attribute");
        jval l = as_list(R, &v, line);
        size_t n = l.u.l->n;
        jval out = mklist(R, n, false);
        jval *keys = j_alloc(&R->b, (n ? n : 1) * sizeof *keys);
        for (size_t i = 0; i < n; i++) {
            out.u.l->v[i] = l.u.l->v[i];
            keys[i] = at ? multi_key(R, l.u.l->v[i], need_str(R, at, line, "sort's attribute"), cs && truthy(cs), line)
                         : lower_key(R, l.u.l->v[i], cs && truthy(cs));
        }
        sort_vals(R, out.u.l->v, keys, n, rev && truthy(rev), line);
        return out;
    }
    if (is(name, "abs")) {
        check_args(R, a, 0, NULL);
        if (v.t == V_FLOAT)
            return mkfloat(fabs(v.u.f));
        if (is_intlike(&v)) {
            if (ival(&v) == INT64_MIN)
                DIE(R, line, "integer overflow");
            return mkint(ival(&v) < 0 ? -ival(&v) : ival(&v));
        }
        DIE(R, line, "bad operand type for abs(): '%s'", tname(&v));
    }
    if (is(name, "round")) {
        static const char *const kw[] = {"precision", "method", NULL};
        check_args(R, a, 2, kw);
        const jval *p = arg(a, 0, "precision"), *me = arg(a, 1, "method");
        if (!is_num(&v))
            DIE(R, line, "round needs a number");
        if (p && !is_intlike(p))
            DIE(R, line, "round's precision must be an integer");
        int64_t prec = p ? ival(p) : 0;
        if (prec > 300 || prec < -300)
            return v.t == V_FLOAT || me ? mkfloat(fval(&v)) : v;
        int mth = 0; /* Python's round (half to even, exact), or math.ceil / math.floor */
        if (me) {
            const struct jstr *m = need_str(R, me, line, "round's method");
            if (m->len == 4 && !memcmp(m->s, "ceil", 4)) mth = 1;
            else if (m->len == 5 && !memcmp(m->s, "floor", 5)) mth = 2;
            else if (!(m->len == 6 && !memcmp(m->s, "common", 6)))
                DIE(R, line, "method must be common, ceil or floor");
        }
        double x = fval(&v), sc = pow(10, (double)(prec < 0 ? -prec : prec));
        if (mth) { /* math.ceil / floor give an int: a zero has no sign (+ 0.0 drops it) */
            double r = (mth == 1 ? ceil(x * pow(10, (double)prec)) : floor(x * pow(10, (double)prec))) + 0.0;
            return mkfloat(r / pow(10, (double)prec));
        }
        if (is_intlike(&v)) {
            if (prec >= 0)
                return mkint(ival(&v));
            if (sc > 9e18)
                return mkint(0);
            int64_t d = (int64_t)sc, q = ival(&v) / d, r = ival(&v) % d;
            if (r < 0) { q--; r += d; }
            if (2 * (double)r > (double)d || (2 * (double)r == (double)d && (q & 1)))
                q++;
            return mkint(q * d);
        }
        if (!isfinite(x))
            return v;
        if (prec == 0)
            return mkfloat(nearbyint(x));
        if (prec < 0)
            return mkfloat(nearbyint(x / sc) * sc);
        char buf[400];
        snprintf(buf, sizeof buf, "%.*f", (int)prec, x);
        return mkfloat(strtod(buf, NULL));
    }
    if (is(name, "min") || is(name, "max") || is(name, "sum")) {
        static const char *const kw[] = {"attribute", "start", "case_sensitive", NULL};
        check_args(R, a, 0, kw);
        jval l = as_list(R, &v, line);
        const jval *at = arg(a, 99, "attribute");
        if (is(name, "sum")) {
            const jval *st = arg(a, 99, "start");
            jval acc = st ? *st : mkint(0);
            for (size_t i = 0; i < l.u.l->n; i++) {
                jval x = at ? attr_path(R, l.u.l->v[i], need_str(R, at, line, "attribute"), line) : l.u.l->v[i];
                acc = arith(R, OP_ADD, acc, x, line);
            }
            return acc;
        }
        if (!l.u.l->n)
            return undef_named("\1No aggregated item, sequence was empty.");
        const jval *cs = arg(a, 99, "case_sensitive");
        jval best = l.u.l->v[0], bk = {0};
        for (size_t i = 0; i < l.u.l->n; i++) {
            jval x = l.u.l->v[i];
            jval k = at ? attr_path(R, x, need_str(R, at, line, "attribute"), line) : x;
            k = lower_key(R, k, cs && truthy(cs));
            int c = i ? vcompare(R, &k, &bk, line, 0) : 0;
            if (!i || (name[1] == 'i' ? c < 0 : c > 0)) {
                best = x;
                bk = k;
            }
        }
        return best;
    }
    if (is(name, "attr")) {
        check_args(R, a, 1, NULL);
        if (!a->n)
            DIE(R, line, "attr needs a name");
        const struct jstr *n = need_str(R, &a->pos[0], line, "attr's name");
        char *an = j_strndup(&R->b, n->s, n->len);
        if (v.t == V_DICT && !in_names(dict_methods, an) && !in_names(dict_modifying, an)) /* not the keys */
            return undef_attr(R, &v, an);
        return get_attr(R, v, an, line);
    }
    if (is(name, "format")) {
        if (a->n && a->nkw)
            DIE(R, line, "the format filter takes positional or keyword arguments, not both");
        jval args;
        if (a->nkw) {
            args = mkdict(R);
            for (size_t k = 0; k < a->nkw; k++)
                d_set_s(R, args.u.d, a->kwn[k], a->kwv[k]);
        } else {
            args = mklist(R, a->n, true);
            for (size_t k = 0; k < a->n; k++)
                args.u.l->v[k] = a->pos[k];
        }
        return vstr(py_percent(R, to_str(R, &v), args, line));
    }
    if (is(name, "wordcount")) {
        check_args(R, a, 0, NULL);
        struct jstr *t = to_str(R, &v);
        int64_t cnt = 0;
        bool in = false;
        for (size_t i = 0; i < t->len;) {
            size_t nx;
            bool w = word_char(u8_cp(t->s, t->len, i, &nx));
            cnt += w && !in;
            in = w;
            i = nx;
        }
        return mkint(cnt);
    }
    if (is(name, "center")) {
        static const char *const kw[] = {"width", NULL};
        check_args(R, a, 1, kw);
        const jval *w = arg(a, 0, "width");
        if (w && !is_intlike(w))
            DIE(R, line, "center's width must be an integer");
        return vstr(str_justify(R, to_str(R, &v), w ? ival(w) : 80, '^', NULL, line));
    }
    if (is(name, "truncate")) {
        static const char *const kw[] = {"length", "killwords", "end", "leeway", NULL};
        check_args(R, a, 4, kw);
        const jval *ln = arg(a, 0, "length"), *kill = arg(a, 1, "killwords"), *end = arg(a, 2, "end"),
                   *lw = arg(a, 3, "leeway");
        if ((ln && !is_intlike(ln)) || (lw && lw->t != V_NONE && !is_intlike(lw)))
            DIE(R, line, "truncate's length and leeway must be integers");
        int64_t length = ln ? ival(ln) : 255, leeway = lw && lw->t != V_NONE ? ival(lw) : 5;
        if (v.t == V_LIST || v.t == V_DICT) { /* jinja2 takes len(), then slices and adds a str */
            size_t vn = v.t == V_LIST ? v.u.l->n : v.u.d->n;
            if ((int64_t)vn <= length + leeway)
                return v;
            DIE(R, line, "truncate: can only truncate a string, not a long %s", tname(&v));
        }
        if (v.t != V_STR && v.t != V_UNDEF)
            DIE(R, line, "object of type '%s' has no len()", tname(&v));
        struct jstr *e = end ? to_str(R, end) : mkjstr(R, "...", 3, PROV_LIT, NULL);
        int64_t elen = (int64_t)u8_count(e->s, e->len);
        if (length < elen || leeway < 0)
            DIE(R, line, "truncate: expected length >= %lld and leeway >= 0", (long long)elen);
        if (v.t == V_UNDEF) /* of length 0: as it is */
            return v;
        struct jstr *t = v.u.s;
        size_t n, *off = u8_offsets(R, t, &n);
        if ((int64_t)n <= length + leeway)
            return vstr(t);
        struct jstr *head = jsub(R, t, 0, off[length - elen]);
        if (!(kill && truthy(kill))) {
            jval sp = cstr(R, " ");
            head = str_split(R, head, &sp, 1, true, line).u.l->v[0].u.s;
        }
        return vstr(jcat(R, head, e));
    }
    if (is(name, "batch") || is(name, "slice")) {
        static const char *const kw[] = {"linecount", "slices", "fill_with", NULL};
        check_args(R, a, 2, kw);
        const jval *cnt = arg(a, 0, name[0] == 'b' ? "linecount" : "slices"), *fill = arg(a, 1, "fill_with");
        if (!cnt || !is_intlike(cnt) || ival(cnt) <= 0)
            DIE(R, line, "%s needs a positive integer", name);
        if (fill && fill->t == V_NONE)
            fill = NULL;
        jval l = as_list(R, &v, line);
        size_t n = l.u.l->n, k = (size_t)(ival(cnt) > 1000000 ? 1000000 : ival(cnt));
        size_t groups = name[0] == 'b' ? (n + k - 1) / k : k;
        jval out = mklist(R, groups, false);
        size_t per = name[0] == 'b' ? k : n / k, extra = name[0] == 'b' ? 0 : n % k, at = 0;
        for (size_t g = 0; g < groups; g++) {
            size_t take = name[0] == 'b' ? (n - at < k ? n - at : k) : per + (g < extra);
            bool pad = fill && (name[0] == 'b' ? take < k : g >= extra);
            size_t width = name[0] == 'b' && pad ? k : take + pad;
            jval row = mklist(R, width, false);
            for (size_t q = 0; q < take; q++)
                row.u.l->v[q] = l.u.l->v[at + q];
            for (size_t q = take; q < width; q++)
                row.u.l->v[q] = *fill;
            at += take;
            out.u.l->v[g] = row;
            count_iter(R, line);
        }
        return out;
    }
    if (is(name, "groupby")) {
        static const char *const kw[] = {"attribute", "default", "case_sensitive", NULL};
        check_args(R, a, 3, kw);
        const jval *at = arg(a, 0, "attribute"), *def = arg(a, 1, "default"), *cs = arg(a, 2, "case_sensitive");
        if (!at)
            DIE(R, line, "groupby needs an attribute");
        bool sens = cs && truthy(cs);
        jval l = as_list(R, &v, line);
        size_t n = l.u.l->n;
        jval *vals = j_alloc(&R->b, (n ? n : 1) * sizeof *vals), *keys = j_alloc(&R->b, (n ? n : 1) * sizeof *keys);
        jval *orig = j_alloc(&R->b, (n ? n : 1) * sizeof *orig);
        for (size_t i = 0; i < n; i++) {
            jval x = is_intlike(at) ? get_item(R, l.u.l->v[i], *at, line)
                                    : attr_path(R, l.u.l->v[i], need_str(R, at, line, "groupby's attribute"), line);
            if (x.t == V_UNDEF && def)
                x = *def;
            vals[i] = l.u.l->v[i];
            keys[i] = lower_key(R, x, sens);
        }
        sort_vals(R, vals, keys, n, false, line);
        for (size_t i = 0; i < n; i++) { /* the grouper as the group's first item has it */
            jval x = is_intlike(at) ? get_item(R, vals[i], *at, line)
                                    : attr_path(R, vals[i], at->u.s, line);
            orig[i] = x.t == V_UNDEF && def ? *def : x;
        }
        jval out = mklist(R, 0, false);
        out.u.l->v = j_alloc(&R->b, (n ? n : 1) * sizeof(jval));
        for (size_t i = 0; i < n;) {
            size_t j = i + 1;
            while (j < n && vequal(&keys[j], &keys[i], 0))
                j++;
            jval g = mklist(R, 2, true), items = mklist(R, j - i, false);
            g.u.l->group = true;
            memcpy(items.u.l->v, vals + i, (j - i) * sizeof(jval));
            g.u.l->v[0] = sens ? keys[i] : orig[i];
            g.u.l->v[1] = items;
            out.u.l->v[out.u.l->n++] = g;
            i = j;
        }
        return out;
    }
    j_die(&R->b, MOE_EUNSUPPORTED, line, "the filter '%s' is not supported", name);
}

/* ---- Tests ---- */

static bool run_test(struct rctx *R, const char *name, jval v, const struct args *a)
{
    int line = a->line;
    const jval *x = arg(a, 0, NULL);
    if (is(name, "defined")) return v.t != V_UNDEF;
    if (is(name, "undefined")) return v.t == V_UNDEF;
    if (is(name, "none")) return v.t == V_NONE;
    if (is(name, "boolean")) return v.t == V_BOOL;
    if (is(name, "true")) return v.t == V_BOOL && v.u.b;
    if (is(name, "false")) return v.t == V_BOOL && !v.u.b;
    if (is(name, "integer")) return v.t == V_INT;
    if (is(name, "float")) return v.t == V_FLOAT;
    if (is(name, "number")) return is_num(&v);
    if (is(name, "string")) return v.t == V_STR;
    if (is(name, "mapping")) return v.t == V_DICT;
    if (is(name, "iterable")) return v.t == V_STR || v.t == V_LIST || v.t == V_DICT || v.t == V_UNDEF;
    if (is(name, "sequence")) return v.t == V_STR || v.t == V_LIST || v.t == V_DICT || v.t == V_UNDEF;
    if (is(name, "callable"))
        return v.t == V_MACRO || v.t == V_FUNC || v.t == V_METHOD || (v.t == V_OBJ && !v.u.ob->cycler);
    if (is(name, "escaped")) return false;
    if (is(name, "lower") || is(name, "upper")) /* str(value).islower() */
        return str_is_case(to_str(R, &v), name[0] == 'l');
    if (is(name, "odd") || is(name, "even") || is(name, "divisibleby")) {
        if ((v.t == V_FLOAT && (name[0] != 'd' || (x && is_num(x)))) ||
            (is_intlike(&v) && name[0] == 'd' && x && x->t == V_FLOAT)) { /* Python's float %: value % 2 == 1 */
            double b = name[0] == 'd' ? fval(x) : 2, m;
            if (b == 0)
                DIE(R, line, "float modulo");
            m = fmod(fval(&v), b);
            if (m != 0 && (m < 0) != (b < 0))
                m += b;
            return name[0] == 'o' ? m == 1 : m == 0;
        }
        if (!is_intlike(&v))
            DIE(R, line, "the test '%s' needs an integer", name);
        int64_t d = 2;
        if (name[0] == 'd') {
            if (!x || !is_intlike(x) || ival(x) == 0)
                DIE(R, line, "divisibleby needs a non-zero integer");
            d = ival(x);
        }
        int64_t m = d == -1 ? 0 : ival(&v) % d;
        return name[0] == 'o' ? m != 0 : m == 0;
    }
    if (is(name, "filter") || is(name, "test")) { /* whether the value names one */
        if (v.t != V_STR)
            return false;
        char *n = j_strndup(&R->b, v.u.s->s, v.u.s->len);
        return name[0] == 'f' ? j_filter_id(n) >= 0 || j_filter_refused(n) : j_test_id(n) >= 0;
    }
    if (!x)
        DIE(R, line, "the test '%s' needs an argument", name);
    if (is(name, "eq") || is(name, "equalto") || is(name, "==")) return vequal(&v, x, 0);
    if (is(name, "ne") || is(name, "!=")) return !vequal(&v, x, 0);
    if (is(name, "sameas")) { /* Python's 'is': lists and dicts by identity */
        if (v.t != x->t)
            return false;
        if (v.t == V_LIST || v.t == V_DICT || v.t == V_NS)
            return v.t == V_LIST ? v.u.l == x->u.l : v.u.d == x->u.d;
        return vequal(&v, x, 0);
    }
    if (is(name, "lt") || is(name, "<") || is(name, "lessthan")) return vcompare(R, &v, x, line, 0) < 0;
    if (is(name, "le") || is(name, "<=")) return vcompare(R, &v, x, line, 0) <= 0;
    if (is(name, "gt") || is(name, ">") || is(name, "greaterthan")) return vcompare(R, &v, x, line, 0) > 0;
    if (is(name, "ge") || is(name, ">=")) return vcompare(R, &v, x, line, 0) >= 0;
    if (is(name, "in")) return contains(R, *x, v, line);
    j_die(&R->b, MOE_EUNSUPPORTED, line, "the test '%s' is not supported", name);
}

/* ---- Expressions ---- */

static jval eval(struct rctx *R, const struct jnode *n, struct scope *s)
{
    if (++R->edepth > MAX_EVAL_DEPTH)
        j_die(&R->b, MOE_ETOOBIG, n->line, "expressions nested more than %d deep", MAX_EVAL_DEPTH);
    jval r;
    switch (n->kind) {
    case E_LIT:
        r = n->lit;
        break;
    case E_NAME:
        r = lookup(R, s, n->name);
        break;
    case E_LIST: case E_TUPLE:
        r = mklist(R, n->args.n, n->kind == E_TUPLE);
        for (size_t i = 0; i < n->args.n; i++)
            r.u.l->v[i] = eval(R, n->args.v[i], s);
        break;
    case E_DICT:
        r = mkdict(R);
        for (size_t i = 0; i + 1 < n->args.n; i += 2) {
            jval k = eval(R, n->args.v[i], s);
            if (k.t == V_LIST || k.t == V_DICT || k.t == V_NS)
                DIE(R, n->line, "unhashable type: '%s'", tname(&k));
            d_set(R, r.u.d, k, eval(R, n->args.v[i + 1], s));
        }
        break;
    case E_ATTR:
        r = get_attr(R, eval(R, n->a, s), n->name, n->line);
        break;
    case E_ITEM:
        r = get_item(R, eval(R, n->a, s), eval(R, n->b, s), n->line);
        break;
    case E_SLICE: {
        jval obj = eval(R, n->a, s);
        jval lo, hi, st;
        if (n->b) lo = eval(R, n->b, s);
        if (n->c) hi = eval(R, n->c, s);
        if (n->args.v[0]) st = eval(R, n->args.v[0], s);
        r = slice(R, obj, n->b ? &lo : NULL, n->c ? &hi : NULL, n->args.v[0] ? &st : NULL, n->line);
        break;
    }
    case E_CALL: {
        jval f = eval(R, n->a, s);
        const char *what = n->a->kind == E_NAME || n->a->kind == E_ATTR ? n->a->name : "the call";
        struct args a = eval_args(R, n, s, what);
        r = call_value(R, f, &a);
        break;
    }
    case E_FILTER:
        if (n->id < 0 && !j_filter_refused(n->name)) /* a name jinja2 does not know either, in an if */
            DIE(R, n->line, "no filter named '%s'", n->name);
        r = call_filter(R, n, eval(R, n->a, s), s);
        break;
    case E_TEST: {
        if (n->id < 0)
            DIE(R, n->line, "no test named '%s'", n->name);
        jval v = eval(R, n->a, s);
        struct args a = eval_args(R, n, s, n->name);
        r = mkbool(run_test(R, n->name, v, &a) != (bool)n->op);
        break;
    }
    case E_NOT:
        r = eval(R, n->a, s);
        r = mkbool(!truthy(&r));
        break;
    case E_NEG: case E_POS: {
        jval v = eval(R, n->a, s);
        if (v.t == V_UNDEF)
            undefined_error(R, n->line, &v);
        if (!is_num(&v))
            DIE(R, n->line, "bad operand type for unary %c: '%s'", n->kind == E_NEG ? '-' : '+', tname(&v));
        if (n->kind == E_POS)
            r = v.t == V_BOOL ? mkint(v.u.b) : v;
        else if (v.t == V_FLOAT)
            r = mkfloat(-v.u.f);
        else if (ival(&v) == INT64_MIN)
            DIE(R, n->line, "integer overflow");
        else
            r = mkint(-ival(&v));
        break;
    }
    case E_BIN: {
        jval a = eval(R, n->a, s), b = eval(R, n->b, s);
        switch (n->op) {
        case OP_EQ: r = mkbool(vequal(&a, &b, 0)); break;
        case OP_NE: r = mkbool(!vequal(&a, &b, 0)); break;
        case OP_LT: r = mkbool(vcompare(R, &a, &b, n->line, 0) < 0); break;
        case OP_LE: r = mkbool(vcompare(R, &a, &b, n->line, 0) <= 0); break;
        case OP_GT: r = mkbool(vcompare(R, &a, &b, n->line, 0) > 0); break;
        case OP_GE: r = mkbool(vcompare(R, &a, &b, n->line, 0) >= 0); break;
        case OP_IN: r = mkbool(contains(R, b, a, n->line)); break;
        case OP_NOTIN: r = mkbool(!contains(R, b, a, n->line)); break;
        default: r = arith(R, n->op, a, b, n->line);
        }
        break;
    }
    case E_AND: {
        jval a = eval(R, n->a, s);
        r = truthy(&a) ? eval(R, n->b, s) : a;
        break;
    }
    case E_OR: {
        jval a = eval(R, n->a, s);
        r = truthy(&a) ? a : eval(R, n->b, s);
        break;
    }
    case E_COND: {
        jval c = eval(R, n->a, s);
        r = truthy(&c) ? eval(R, n->b, s) : n->c ? eval(R, n->c, s) : UNDEF;
        break;
    }
    case E_CONCAT: {
        jval a = eval(R, n->a, s), b = eval(R, n->b, s);
        r = vstr(jcat(R, to_str(R, &a), to_str(R, &b)));
        break;
    }
    default:
        DIE(R, n->line, "unexpected node");
    }
    R->edepth--;
    return r;
}

/* ---- Statements ---- */

static jval apply_filter_chain(struct rctx *R, const struct jnode *f, jval v, struct scope *s)
{
    if (!f)
        return v;
    v = apply_filter_chain(R, f->a, v, s);
    return call_filter(R, f, v, s);
}

/* {% set ns.attr = v %} (and the block form, and ns.attr in a tuple target): only a namespace
 * takes an attribute. */
static void set_ns_attr(struct rctx *R, struct scope *s, const struct jnode *t, jval v)
{
    jval ns = lookup(R, s, t->name);
    if (ns.t != V_NS)
        DIE(R, t->line, "cannot assign attribute '%s' on '%s' (not a namespace)", t->attr, t->name);
    d_set_s(R, ns.u.d, t->attr, v);
}

/* Binds v to an assignment target (see struct jnode's tgt), unpacking as Python does: a string
 * gives its characters, a dict its keys, an undefined value nothing; the rest is not iterable. The
 * target nests at most as deep as the parser allows. */
static void assign(struct rctx *R, struct scope *s, const struct jnode *t, jval v, int line)
{
    if (t->kind == E_NAME) {
        if (t->attr)
            set_ns_attr(R, s, t, v);
        else
            d_set_s(R, &s->vars, t->name, v);
        return;
    }
    if (v.t != V_LIST && v.t != V_STR && v.t != V_DICT && v.t != V_UNDEF)
        DIE(R, line, "cannot unpack non-iterable %s object", tname(&v));
    jval l = as_list(R, &v, line);
    size_t n = t->args.n;
    if (l.u.l->n > n)
        DIE(R, line, "too many values to unpack (expected %zu)", n);
    if (l.u.l->n < n)
        DIE(R, line, "not enough values to unpack (expected %zu, got %zu)", n, l.u.l->n);
    for (size_t i = 0; i < n; i++)
        assign(R, s, t->args.v[i], l.u.l->v[i], line);
}

static void exec_for_list(struct rctx *R, const struct jnode *n, struct scope *s, jval it,
                          unsigned depth, struct obuf *o)
{
    jval l = as_list(R, &it, n->line);
    const jval *items = l.u.l->v;
    size_t cnt = l.u.l->n;
    if (n->b) {
        jval *kept = j_alloc(&R->b, (cnt ? cnt : 1) * sizeof *kept);
        size_t k = 0;
        for (size_t i = 0; i < cnt; i++) {
            count_iter(R, n->line);
            struct scope *fs = new_scope(R, s);
            assign(R, fs, n->tgt, items[i], n->line);
            jval c = eval(R, n->b, fs);
            if (truthy(&c))
                kept[k++] = items[i];
        }
        items = kept;
        cnt = k;
    }
    if (!cnt) { /* in a scope of its own, as jinja2's loop frame: what it sets stays inside */
        exec_body(R, &n->orelse, new_scope(R, s), o);
        return;
    }
    struct jloop *lp = j_alloc(&R->b, sizeof *lp);
    lp->items = items;
    lp->n = cnt;
    lp->node = n;
    lp->scope = s;
    lp->depth = depth;
    lp->changed = UNDEF;
    /* One scope serves every iteration: what an iteration sets is dropped before the next (as
     * in Jinja2, where each iteration starts afresh), the loop variables are overwritten. */
    struct scope *is = new_scope(R, s);
    d_set_s(R, &is->vars, "loop", (jval){.t = V_LOOP, .u.lp = lp});
    bool completed = false; /* an iteration reached the end of the body */
    for (size_t i = 0; i < cnt; i++) {
        count_iter(R, n->line);
        lp->i = i;
        is->vars.n = 1;
        assign(R, is, n->tgt, items[i], n->line);
        exec_body(R, &n->body, is, o);
        completed |= !R->brk && !R->cont;
        R->cont = false;
        if (R->brk) {
            R->brk = false;
            break;
        }
    }
    /* jinja2 clears its "no iteration" flag at the end of the body, so the else block runs too
     * when every iteration left by break or continue */
    if (!completed && n->orelse.n)
        exec_body(R, &n->orelse, new_scope(R, s), o);
}

static void exec_for(struct rctx *R, const struct jnode *n, struct scope *s, struct obuf *o)
{
    exec_for_list(R, n, s, eval(R, n->a, s), 0, o);
}

static jval mkmacro(struct rctx *R, const struct jnode *n, struct scope *env)
{
    struct jmacro *m = j_alloc(&R->b, sizeof *m);
    m->n = n;
    m->env = env;
    return (jval){.t = V_MACRO, .u.mac = m};
}

static void exec_node(struct rctx *R, const struct jnode *n, struct scope *s, struct obuf *o)
{
    switch (n->kind) {
    case N_TEXT:
        ob_str(R, o, n->lit.u.s);
        return;
    case N_OUT: {
        jval v = eval(R, n->a, s);
        write_str(R, o, &v, false, 0);
        return;
    }
    case N_IF: {
        jval c = eval(R, n->a, s);
        exec_body(R, truthy(&c) ? &n->body : &n->orelse, s, o);
        return;
    }
    case N_FOR:
        exec_for(R, n, s, o);
        return;
    case N_SET: {
        assign(R, s, n->tgt, eval(R, n->a, s), n->line);
        return;
    }
    case N_SETBLOCK: case N_FILTERBLOCK: {
        struct obuf b = {0};
        exec_body(R, &n->body, new_scope(R, s), &b); /* its own scope, as in jinja2 */
        if (R->brk || R->cont) /* left for the loop around: nothing is filtered, written or set */
            return;
        jval v = apply_filter_chain(R, n->a, vstr(ob_done(R, &b)), s);
        if (n->kind == N_FILTERBLOCK)
            write_str(R, o, &v, false, 0);
        else /* {% set x %}, {% set ns.x %}, {% set a, b %}...{% endset %} */
            assign(R, s, n->tgt, v, n->line);
        return;
    }
    case N_MACRO:
        d_set_s(R, &s->vars, n->name, mkmacro(R, n, s));
        return;
    case N_WITH: {
        struct scope *ws = new_scope(R, s);
        jval *vals = j_alloc(&R->b, (n->args.n ? n->args.n : 1) * sizeof *vals);
        for (size_t i = 0; i < n->args.n; i++) /* all evaluated outside, then bound */
            vals[i] = eval(R, n->args.v[i], s);
        for (size_t i = 0; i < n->args.n; i++)
            d_set_s(R, &ws->vars, n->targets[i], vals[i]);
        exec_body(R, &n->body, ws, o);
        return;
    }
    case N_CALLBLOCK: {
        const struct jnode *c = n->a;
        jval f = eval(R, c->a, s);
        if (f.t == V_UNDEF)
            undefined_error(R, n->line, &f);
        if (f.t != V_MACRO)
            DIE(R, n->line, "{%% call %%} needs a macro, not %s", tname(&f));
        struct args a = eval_args(R, c, s, f.u.mac->n->name);
        jval caller = mkmacro(R, n->c, s);
        jval r = call_macro(R, f.u.mac, &a, &caller);
        write_str(R, o, &r, false, 0);
        return;
    }
    case N_BREAK:
        R->brk = true;
        return;
    case N_CONTINUE:
        R->cont = true;
        return;
    case N_BLOCK:
        if (n->op & BLK_REQUIRED)
            DIE(R, n->line, "required block '%s' not found", n->name);
        /* a {% block %} has its own scope; unless scoped it sees the template's variables only.
         * {% generation %} (a call block in transformers) sees the variables around it, but what
         * it sets stays inside. */
        exec_body(R, &n->body, new_scope(R, !n->op || (n->op & BLK_SCOPED) ? s : R->root), o);
        return;
    default:
        DIE(R, n->line, "unexpected statement");
    }
}

static void exec_body(struct rctx *R, const struct jnlist *body, struct scope *s, struct obuf *o)
{
    if (++R->edepth > MAX_EVAL_DEPTH)
        j_die(&R->b, MOE_ETOOBIG, 0, "blocks nested more than %d deep", MAX_EVAL_DEPTH);
    for (size_t i = 0; i < body->n && !R->brk && !R->cont; i++)
        exec_node(R, body->v[i], s, o);
    R->edepth--;
}

/* ---- Inputs ---- */

static jval from_json(struct rctx *R, json_t *j, uint8_t prov, int depth)
{
    if (depth > MAX_VALUE_DEPTH)
        DIE(R, 0, "an input value is nested more than %d deep", MAX_VALUE_DEPTH);
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jval d = mkdict(R);
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) {
            size_t kl = strlen(k);
            d_set(R, d.u.d, vstr(mkjstr(R, j_strndup(&R->b, k, kl), kl, prov, NULL)),
                  from_json(R, v, prov, depth + 1));
        }
        return d;
    }
    case JSON_ARRAY: {
        jval l = mklist(R, json_array_size(j), false);
        for (size_t i = 0; i < l.u.l->n; i++)
            l.u.l->v[i] = from_json(R, json_array_get(j, i), prov, depth + 1);
        return l;
    }
    case JSON_STRING: {
        size_t n = json_string_length(j);
        return vstr(mkjstr(R, j_strndup(&R->b, json_string_value(j), n), n, prov, NULL));
    }
    case JSON_INTEGER: return mkint((int64_t)json_integer_value(j));
    case JSON_REAL: return mkfloat(json_real_value(j));
    case JSON_TRUE: return mkbool(true);
    case JSON_FALSE: return mkbool(false);
    default: return NONE;
    }
}

static void add_vars(struct rctx *R, json_t *obj, uint8_t prov)
{
    if (!obj)
        return;
    if (!json_is_object(obj))
        DIE(R, 0, "template variables must be a JSON object");
    const char *k;
    json_t *v;
    json_object_foreach(obj, k, v)
        d_set_s(R, &R->root->vars, j_strndup(&R->b, k, strlen(k)), from_json(R, v, prov, 0));
}

int jinja_render(const struct jinja_tmpl *t, json_t *data, json_t *literal,
                 const struct jinja_opts *opts, struct jinja_out *out, char *err, size_t errlen)
{
    static const struct jinja_opts defaults = {0};
    if (!opts)
        opts = &defaults;
    memset(out, 0, sizeof *out);
    struct rctx *volatile R = calloc(1, sizeof *R);
    if (!R)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    R->b.limit = opts->max_memory ? opts->max_memory : 64u << 20;
    R->max_output = opts->max_output ? opts->max_output : 4u << 20;
    R->max_iter = opts->max_iterations ? opts->max_iterations : 1000000;
    R->max_depth = opts->max_depth ? opts->max_depth : 64;
    R->now = opts->now;
    R->now_utc = opts->now != 0;
    if (setjmp(R->b.jb)) {
        int code = R->b.code;
        moe_fail(err, errlen, code, "chat template: %s", R->b.msg);
        j_arena_free(&R->b);
        free(R);
        jinja_out_free(out);
        return code;
    }
    R->root = new_scope(R, NULL);
    add_vars(R, data, PROV_DATA);
    add_vars(R, literal, PROV_LIT);
    struct obuf o = {0};
    exec_body(R, &t->body, R->root, &o);
    size_t ns = 0;
    for (size_t i = 0; i < o.len; i++)
        if (i == 0 || o.m[i] != o.m[i - 1])
            ns++;
    out->text = malloc(o.len + 1);
    out->spans = malloc((ns ? ns : 1) * sizeof *out->spans);
    if (!out->text || !out->spans)
        j_die(&R->b, -ENOMEM, 0, "out of memory");
    if (o.len)
        memcpy(out->text, o.s, o.len);
    out->text[o.len] = 0;
    out->len = o.len;
    for (size_t i = 0; i < o.len; i++) {
        if (i == 0 || o.m[i] != o.m[i - 1])
            out->spans[out->n_spans++] = (struct jinja_span){i, 0, o.m[i] != 0};
        out->spans[out->n_spans - 1].len++;
    }
    j_arena_free(&R->b);
    free(R);
    return 0;
}

void jinja_out_free(struct jinja_out *o)
{
    free(o->text);
    free(o->spans);
    memset(o, 0, sizeof *o);
}
