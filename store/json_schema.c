/* JSON Schema to GBNF. See json_schema.h and docs/grammar.md.
 *
 * Every schema becomes a rule whose text ends with `space` (bounded optional whitespace), so
 * rules compose by concatenation. Identical rule bodies share one rule; $ref targets get a rule
 * each (recursive schemas become recursive rules). */
#include "store/json_schema.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_BOUND 1000 /* larger maxItems / maxLength are treated as unbounded */

struct sb {
    char *p;
    size_t n, cap;
    int oom;
};

static void sb_addn(struct sb *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 128;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_add(struct sb *b, const char *s) { sb_addn(b, s, strlen(s)); }

static void sb_addf(struct sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_addf(struct sb *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (w > 0)
        sb_addn(b, tmp, (size_t)w < sizeof tmp ? (size_t)w : sizeof tmp - 1);
}

/* s as a GBNF string literal (quotes included). */
static void sb_literal(struct sb *b, const char *s, size_t n)
{
    sb_add(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[3] = {'\\', (char)c, 0};
            sb_add(b, e);
        } else if (c == '\n') {
            sb_add(b, "\\n");
        } else if (c < 0x20 || c == 0x7f) {
            sb_addf(b, "\\x%02X", c);
        } else {
            sb_addn(b, (const char *)&c, 1);
        }
    }
    sb_add(b, "\"");
}

struct rule {
    char *name, *body; /* body NULL: reserved, not defined yet */
};

struct ref {
    char *ptr;
    const char *name;
};

struct smap {
    uint32_t *slot; /* rule index + 1; 0 empty */
    uint32_t cap;   /* a power of two */
    uint32_t n;
};

struct conv {
    json_t *root;
    struct smap names, bodies;
    struct rule *rules;
    size_t n_rules, cap_rules;
    struct ref *refs;
    size_t n_refs, cap_refs;
    int depth;
    long pattern_repeat; /* repetition counts and groups of the patterns so far */
    char *err;
    size_t errlen;
    int failed;
};

static void cerr(struct conv *c, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void cerr(struct conv *c, const char *path, const char *fmt, ...)
{
    if (c->failed)
        return;
    c->failed = 1;
    if (!c->err || !c->errlen)
        return;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t pl = strlen(path);
    const char *tail = pl > 120 ? path + pl - 120 : path;
    snprintf(c->err, c->errlen, "%s (at %s%s)", msg, pl > 120 ? "..." : "",
             path[0] ? tail : "/");
}

/* Rule lookup by name and by body: open addressing over rule indexes (the first rule with a
 * body keeps it). */
static uint32_t str_hash(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

static const char *rule_key(const struct conv *c, int by_body, uint32_t i)
{
    return by_body ? c->rules[i].body : c->rules[i].name;
}

static long smap_find(const struct conv *c, int by_body, const char *key)
{
    const struct smap *m = by_body ? &c->bodies : &c->names;
    if (!m->cap)
        return -1;
    for (uint32_t j = str_hash(key) & (m->cap - 1); m->slot[j]; j = (j + 1) & (m->cap - 1))
        if (strcmp(rule_key(c, by_body, m->slot[j] - 1), key) == 0)
            return (long)m->slot[j] - 1;
    return -1;
}

static void slot_put(uint32_t *slot, uint32_t cap, uint32_t h, uint32_t v)
{
    uint32_t j = h & (cap - 1);
    while (slot[j])
        j = (j + 1) & (cap - 1);
    slot[j] = v;
}

static int smap_add(struct conv *c, int by_body, uint32_t idx)
{
    struct smap *m = by_body ? &c->bodies : &c->names;
    if (smap_find(c, by_body, rule_key(c, by_body, idx)) >= 0)
        return 0;
    if (2 * (m->n + 1) > m->cap) {
        uint32_t cap = m->cap ? m->cap * 2 : 64;
        uint32_t *slot = calloc(cap, sizeof *slot);
        if (!slot) {
            cerr(c, "", "out of memory");
            return -1;
        }
        for (uint32_t j = 0; j < m->cap; j++)
            if (m->slot[j])
                slot_put(slot, cap, str_hash(rule_key(c, by_body, m->slot[j] - 1)), m->slot[j]);
        free(m->slot);
        m->slot = slot;
        m->cap = cap;
    }
    slot_put(m->slot, m->cap, str_hash(rule_key(c, by_body, idx)), idx + 1);
    m->n++;
    return 0;
}

/* Gives rule k its body (taken), indexed for sharing. */
static int set_body(struct conv *c, long k, char *body)
{
    if (!body) {
        cerr(c, "", "out of memory");
        return -1;
    }
    c->rules[k].body = body;
    return smap_add(c, 1, (uint32_t)k);
}

/* Reserves a fresh rule name derived from hint; returns its index or -1. */
static long reserve(struct conv *c, const char *hint)
{
    char base[96];
    size_t n = 0;
    for (const char *p = hint; *p && n < 64; p++) {
        char ch = *p;
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
        if (!ok)
            ch = '-';
        if (ch == '-' && (n == 0 || base[n - 1] == '-'))
            continue;
        base[n++] = ch;
    }
    while (n && base[n - 1] == '-')
        n--;
    if (!n)
        base[n++] = 'r';
    base[n] = '\0';
    char name[128];
    snprintf(name, sizeof name, "%s", base);
    for (unsigned k = 1; smap_find(c, 0, name) >= 0; k++)
        snprintf(name, sizeof name, "%s-%u", base, k);
    if (c->n_rules == c->cap_rules) {
        size_t cap = c->cap_rules ? c->cap_rules * 2 : 32;
        struct rule *r = realloc(c->rules, cap * sizeof *r);
        if (!r) {
            cerr(c, "", "out of memory");
            return -1;
        }
        c->rules = r;
        c->cap_rules = cap;
    }
    c->rules[c->n_rules].name = strdup(name);
    c->rules[c->n_rules].body = NULL;
    if (!c->rules[c->n_rules].name) {
        cerr(c, "", "out of memory");
        return -1;
    }
    c->n_rules++;
    if (smap_add(c, 0, (uint32_t)(c->n_rules - 1)) != 0)
        return -1;
    return (long)c->n_rules - 1;
}

/* A rule with this body (an existing one when some rule already has it). Takes body->p. */
static const char *add_rule(struct conv *c, const char *hint, struct sb *body)
{
    if (body->oom) {
        free(body->p);
        cerr(c, "", "out of memory");
        return NULL;
    }
    long i = smap_find(c, 1, body->p ? body->p : "");
    if (i >= 0) {
        free(body->p);
        return c->rules[i].name;
    }
    i = reserve(c, hint);
    if (i < 0) {
        free(body->p);
        return NULL;
    }
    if (set_body(c, i, body->p ? body->p : strdup("")) != 0)
        return NULL;
    return c->rules[i].name;
}

/* ---------------------------------------------------------------- primitives */

static const struct {
    const char *name, *body, *deps;
} prims[] = {
    {"space", "| \" \" | \"\\n\" [ \\t]{0,20}", ""},
    {"boolean", "(\"true\" | \"false\") space", "space"},
    {"null", "\"null\" space", "space"},
    {"char", "[^\"\\\\\\x7F\\x00-\\x1F] | [\\\\] ([\"\\\\bfnrt/] | \"u\" [0-9a-fA-F]{4})", ""},
    {"string", "\"\\\"\" char* \"\\\"\" space", "char space"},
    {"integral-part", "[0] | [1-9] [0-9]{0,15}", ""},
    {"decimal-part", "[0-9]{1,16}", ""},
    {"number",
     "(\"-\"? integral-part) (\".\" decimal-part)? ([eE] [-+]? integral-part)? space",
     "integral-part decimal-part space"},
    {"integer", "(\"-\"? integral-part) space", "integral-part space"},
    {"value", "object | array | string | number | boolean | null",
     "object array string number boolean null"},
    {"object",
     "\"{\" space ( string \":\" space value (\",\" space string \":\" space value)* )? \"}\" "
     "space",
     "space string value"},
    {"array", "\"[\" space ( value (\",\" space value)* )? \"]\" space", "space value"},
    {"date", "[0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [1-2] [0-9] | "
             "\"3\" [0-1] )",
     ""},
    {"time", "( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,6} "
             ")? ( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )",
     ""},
    {"date-string", "\"\\\"\" date \"\\\"\" space", "date space"},
    {"time-string", "\"\\\"\" time \"\\\"\" space", "time space"},
    {"date-time-string", "\"\\\"\" date \"T\" time \"\\\"\" space", "date time space"},
    {"uuid", "\"\\\"\" [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" "
             "[0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{12} \"\\\"\" space",
     "space"},
};

static const char *prim(struct conv *c, const char *name)
{
    long at = smap_find(c, 0, name);
    struct rule *r = at >= 0 ? &c->rules[at] : NULL;
    if (r && r->body)
        return r->name;
    for (size_t i = 0; i < sizeof prims / sizeof *prims; i++) {
        if (strcmp(prims[i].name, name) != 0)
            continue;
        long k = r ? (long)(r - c->rules) : reserve(c, name);
        if (k < 0)
            return NULL;
        if (set_body(c, k, strdup(prims[i].body)) != 0)
            return NULL;
        const char *d = prims[i].deps;
        while (*d) {
            const char *e = strchr(d, ' ');
            size_t n = e ? (size_t)(e - d) : strlen(d);
            char dep[32];
            snprintf(dep, sizeof dep, "%.*s", (int)n, d);
            if (!prim(c, dep))
                return NULL;
            d += n;
            while (*d == ' ')
                d++;
        }
        return c->rules[k].name;
    }
    cerr(c, "", "internal: no primitive '%s'", name);
    return NULL;
}

/* ---------------------------------------------------------------- schemas */

static const char *visit(struct conv *c, json_t *s, const char *hint, const char *path);

static int is_annotation(const char *k)
{
    static const char *ann[] = {"$schema", "$id", "$comment", "title", "description", "default",
                                "examples", "deprecated", "readOnly", "writeOnly", "$defs",
                                "definitions", "$anchor"};
    for (size_t i = 0; i < sizeof ann / sizeof *ann; i++)
        if (strcmp(k, ann[i]) == 0)
            return 1;
    return 0;
}

static int check_keywords(struct conv *c, json_t *s, const char *path)
{
    static const char *known[] = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
                                  "nullable", "properties", "required", "additionalProperties",
                                  "items", "minItems", "maxItems", "minLength", "maxLength",
                                  "format", "minimum", "maximum", "exclusiveMinimum",
                                  "exclusiveMaximum", "pattern", "prefixItems"};
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v) {
        if (is_annotation(k))
            continue;
        size_t i;
        for (i = 0; i < sizeof known / sizeof *known; i++)
            if (strcmp(k, known[i]) == 0)
                break;
        if (i == sizeof known / sizeof *known) {
            cerr(c, path, "keyword '%s' is not supported", k);
            return -1;
        }
    }
    return 0;
}

static void path_join(char *out, size_t cap, const char *path, const char *a, const char *b)
{
    snprintf(out, cap, "%s/%s%s%s", path, a, b ? "/" : "", b ? b : "");
}

/* The schema a "#/..." pointer names, or NULL. */
static json_t *resolve(struct conv *c, const char *ref)
{
    if (ref[0] != '#')
        return NULL;
    json_t *cur = c->root;
    const char *p = ref + 1;
    while (*p == '/' && cur) {
        p++;
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char key[256];
        size_t k = 0;
        for (size_t i = 0; i < n && k + 1 < sizeof key; i++) {
            if (p[i] == '~' && i + 1 < n && (p[i + 1] == '0' || p[i + 1] == '1')) {
                key[k++] = p[i + 1] == '0' ? '~' : '/';
                i++;
            } else {
                key[k++] = p[i];
            }
        }
        key[k] = '\0';
        if (json_is_object(cur)) {
            cur = json_object_get(cur, key);
        } else if (json_is_array(cur)) {
            char *end;
            unsigned long idx = strtoul(key, &end, 10);
            cur = *end ? NULL : json_array_get(cur, idx);
        } else {
            cur = NULL;
        }
        p += n;
    }
    return *p ? NULL : cur;
}

static const char *visit_ref(struct conv *c, const char *ref, const char *path)
{
    for (size_t i = 0; i < c->n_refs; i++)
        if (strcmp(c->refs[i].ptr, ref) == 0)
            return c->refs[i].name;
    json_t *target = resolve(c, ref);
    if (!target) {
        cerr(c, path, "$ref '%s' is not a local reference that resolves (#/$defs/..., "
                      "#/definitions/...)", ref);
        return NULL;
    }
    const char *last = strrchr(ref, '/');
    char hint[96];
    snprintf(hint, sizeof hint, "ref-%s", last ? last + 1 : "root");
    long k = reserve(c, hint);
    if (k < 0)
        return NULL;
    if (c->n_refs == c->cap_refs) {
        size_t cap = c->cap_refs ? c->cap_refs * 2 : 16;
        struct ref *r = realloc(c->refs, cap * sizeof *r);
        if (!r) {
            cerr(c, path, "out of memory");
            return NULL;
        }
        c->refs = r;
        c->cap_refs = cap;
    }
    c->refs[c->n_refs].ptr = strdup(ref);
    c->refs[c->n_refs].name = c->rules[k].name;
    c->n_refs++;
    char tpath[512];
    snprintf(tpath, sizeof tpath, "%s", ref + 1);
    const char *inner = visit(c, target, c->rules[k].name, tpath);
    if (!inner)
        return NULL;
    if (set_body(c, k, strdup(inner)) != 0)
        return NULL;
    return c->rules[k].name;
}

static long get_uint(struct conv *c, json_t *s, const char *key, long dflt, const char *path)
{
    json_t *v = json_object_get(s, key);
    if (!v)
        return dflt;
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        cerr(c, path, "'%s' must be a non-negative integer", key);
        return -2;
    }
    json_int_t x = json_integer_value(v);
    return x > 1000000 ? 1000000 : (long)x;
}

/* ("," space item){lo,hi}, with hi < 0 for unbounded. */
static void sb_repeat(struct sb *b, const char *sep_item, long lo, long hi)
{
    if (hi == 0)
        return;
    sb_addf(b, " (%s)", sep_item);
    if (hi < 0) {
        if (lo == 0)
            sb_add(b, "*");
        else
            sb_addf(b, "{%ld,}", lo);
    } else {
        sb_addf(b, "{%ld,%ld}", lo, hi);
    }
}

/* ---------------------------------------------------------------- numeric bounds */

#define NUM_LIM 9999999999999999LL /* the largest integral part of 16 digits */

static const char *const bound_keys[] = {"minimum", "exclusiveMinimum", "maximum",
                                         "exclusiveMaximum"};

/* The first numeric bound keyword of s, or NULL. */
static const char *bound_keyword(json_t *s)
{
    for (size_t i = 0; i < sizeof bound_keys / sizeof *bound_keys; i++)
        if (json_object_get(s, bound_keys[i]))
            return bound_keys[i];
    return NULL;
}

/* Digit strings from x to y, both n digits (x <= y), as a GBNF sequence: the common prefix, then
 * x's first digit with the rest from x up, the digits between with anything after, and y's first
 * digit with the rest up to y. */
static void sb_digits(struct sb *b, const char *x, const char *y, size_t n)
{
    size_t k = 0;
    while (k < n && x[k] == y[k])
        k++;
    if (k)
        sb_literal(b, x, k);
    if (k == n)
        return;
    if (k)
        sb_add(b, " ");
    x += k, y += k, n -= k;
    int x_low = strspn(x + 1, "0") == n - 1, y_high = strspn(y + 1, "9") == n - 1;
    char d0 = (char)(x_low ? x[0] : x[0] + 1), d1 = (char)(y_high ? y[0] : y[0] - 1);
    char nines[24], zeros[24];
    memset(nines, '9', n - 1);
    memset(zeros, '0', n - 1);
    nines[n - 1] = zeros[n - 1] = '\0';
    int alts = 0;
    sb_add(b, "(");
    if (!x_low) {
        sb_addf(b, "\"%c\" ", x[0]);
        sb_digits(b, x + 1, nines, n - 1);
        alts++;
    }
    if (d0 <= d1) {
        sb_addf(b, "%s[%c-%c]", alts++ ? " | " : "", d0, d1);
        if (n > 1)
            sb_addf(b, " [0-9]{%zu}", n - 1);
    }
    if (!y_high) {
        sb_addf(b, "%s\"%c\" ", alts ? " | " : "", y[0]);
        sb_digits(b, zeros, y + 1, n - 1);
    }
    sb_add(b, ")");
}

/* The integers lo..hi (0 <= lo <= hi <= NUM_LIM) as JSON writes them, one GBNF group. */
static void sb_uint_range(struct sb *b, long long lo, long long hi)
{
    char x[24], y[24], from[24], to[24];
    int dl = snprintf(x, sizeof x, "%lld", lo), dh = snprintf(y, sizeof y, "%lld", hi);
    sb_add(b, "(");
    for (int n = dl; n <= dh; n++) {
        if (n > dl)
            sb_add(b, " | ");
        if (n > dl && n < dh) { /* every number of these lengths */
            sb_addf(b, "[1-9] [0-9]{%d,%d}", n - 1, dh - 2);
            n = dh - 1;
            continue;
        }
        memset(from, '0', (size_t)n);
        memset(to, '9', (size_t)n);
        from[0] = '1';
        from[n] = to[n] = '\0';
        sb_digits(b, n == dl ? x : from, n == dh ? y : to, (size_t)n);
    }
    sb_add(b, ")");
}

/* Fractions of 1 to k digits (k <= 16) that are not all zeros: a rule. */
static const char *nonzero_fraction(struct conv *c, int k)
{
    const char *prev = NULL;
    for (int j = 1; j <= k; j++) {
        struct sb b = {0};
        sb_add(&b, "[1-9]");
        if (j > 1)
            sb_addf(&b, " [0-9]{0,%d} | \"0\" %s", j - 1, prev);
        char h[32];
        snprintf(h, sizeof h, "nonzero-fraction-%d", j);
        if (!(prev = add_rule(c, h, &b)))
            return NULL;
    }
    return prev;
}

/* A bound's value i + f / 10^16, with 0 <= f < 10^16 (so i is the floor). */
struct dec {
    long long i, f;
};

#define FRAC_ONE 10000000000000000LL /* 10^16 */

static int dec_cmp(struct dec a, struct dec b)
{
    if (a.i != b.i)
        return a.i < b.i ? -1 : 1;
    return (a.f > b.f) - (a.f < b.f);
}

static struct dec dec_neg(struct dec a)
{
    return a.f ? (struct dec){-a.i - 1, FRAC_ONE - a.f} : (struct dec){-a.i, 0};
}

/* Fraction digits s (0 to L of them; at least one when ne) whose value, read as 0.s, is >= 0.x
 * (> when xs) and <= 0.y (< when ys); x and y without trailing zeros, y NULL for no upper bound.
 * Decided digit by digit as strings compare: a digit strictly between the bounds' digits leaves
 * the rest free, one equal to a bound's digit keeps that bound for the rest. Writes one group
 * (which may match the empty string when !ne). Returns 1 written, 0 when only the empty string
 * fits (nothing written), -1 when nothing fits, -2 out of memory. */
static int sb_fraction(struct conv *c, struct sb *o, const char *x, int xs, const char *y, int ys,
                       int L, int ne)
{
    int empty = !ne && !*x && !xs && (!y || *y || !ys);
    if (y && !*y && ys)
        return -1;
    if (L == 0)
        return empty ? 0 : -1;
    if (!*x && !xs && (!y || !*y)) { /* anything, or zeros only */
        sb_addf(o, "[%s]{%d,%d}", y ? "0" : "0-9", ne, L);
        return 1;
    }
    if (!*x && xs && !y) { /* not all zeros */
        const char *nz = nonzero_fraction(c, L);
        if (!nz)
            return -2;
        sb_add(o, nz);
        return 1;
    }
    struct sb a = {0};
    int n = 0;
    for (int d = 0; d <= 9; d++) {
        /* the bounds for the digits after d: "" / 0 and NULL when d leaves that side free */
        const char *nx = "", *ny = NULL;
        int nxs = 0, nys = 0, lo_free, up_free;
        if (!*x) {
            lo_free = !xs || d > 0;
            nxs = !lo_free;
        } else {
            if (d < x[0] - '0')
                continue;
            lo_free = d > x[0] - '0';
            if (!lo_free)
                nx = x + 1, nxs = xs;
        }
        if (!y) {
            up_free = 1;
        } else {
            int y0 = *y ? y[0] - '0' : 0;
            if (d > y0)
                continue;
            up_free = *y && d < y0;
            if (!up_free)
                ny = *y ? y + 1 : y, nys = ys;
        }
        if (lo_free && up_free) { /* a run of free digits */
            int e = d;
            while (e < 9 && (!*x || e + 1 > x[0] - '0') && (!y || (*y && e + 1 < y[0] - '0')))
                e++;
            if (e > d)
                sb_addf(&a, "%s[%d-%d]", n++ ? " | " : "", d, e);
            else
                sb_addf(&a, "%s[%d]", n++ ? " | " : "", d);
            if (L > 1)
                sb_addf(&a, " [0-9]{0,%d}", L - 1);
            d = e;
            continue;
        }
        struct sb rest = {0};
        int r = sb_fraction(c, &rest, nx, nxs, ny, nys, L - 1, 0);
        if (r == -2) {
            free(rest.p);
            free(a.p);
            return -2;
        }
        if (r >= 0) {
            sb_addf(&a, "%s\"%d\"%s", n++ ? " | " : "", d, r ? " " : "");
            sb_add(&a, r ? rest.p : "");
        }
        free(rest.p);
    }
    if (a.oom) {
        free(a.p);
        return -2;
    }
    if (n) {
        sb_add(o, "(");
        sb_add(o, a.p);
        sb_add(o, empty ? ")?" : ")");
    }
    free(a.p);
    return n ? 1 : empty ? 0 : -1;
}

/* The 16 fraction digits of f without trailing zeros. */
static void frac_digits(char *out, long long f)
{
    snprintf(out, 17, "%016lld", f);
    size_t n = strlen(out);
    while (n && out[n - 1] == '0')
        n--;
    out[n] = '\0';
}

/* Integral part ip and a fraction from 0.x to 0.y (see sb_fraction; y NULL: below 1), appended as
 * one more alternative of o when some value fits. Returns the count of alternatives, -1 on memory. */
static int sb_int_fraction(struct conv *c, struct sb *o, int n, long long ip, long long x, int xs,
                           const long long *y, int ys)
{
    char xd[17], yd[17];
    frac_digits(xd, x);
    if (y)
        frac_digits(yd, *y);
    struct sb f = {0};
    int r = sb_fraction(c, &f, xd, xs, y ? yd : NULL, ys, 16, 1);
    int zero = !x && !xs && (!y || *y || !ys); /* the integral part alone */
    if (r == -2 || f.oom) {
        free(f.p);
        return -1;
    }
    if (r > 0) {
        sb_addf(o, "%s\"%lld\" %s\".\" ", n ? " | " : "", ip, zero ? "(" : "");
        sb_add(o, f.p);
        sb_add(o, zero ? ")?" : "");
    }
    else if (zero)
        sb_addf(o, "%s\"%lld\"", n ? " | " : "", ip);
    free(f.p);
    return n + (r > 0 || zero);
}

/* Magnitudes y with a <= y <= b (a < y when ax, y < b when bx; 0 <= a, b <= NUM_LIM + 1):
 * integral digits and, when frac, an optional fraction (a and b whole unless frac). Appends
 * alternatives (each after " | " once one is written) and returns how many. */
static int sb_magnitude(struct conv *c, struct sb *o, struct dec a, int ax, struct dec b, int bx,
                        int frac)
{
    /* integral parts that take any fraction (or, for integers, all of them) */
    long long lo = a.i + (ax || a.f), hi = frac || bx ? b.i - 1 : b.i;
    if (hi > NUM_LIM)
        hi = NUM_LIM;
    if (frac && a.i == b.i) /* one integral part, the fraction between both bounds' */
        return sb_int_fraction(c, o, 0, a.i, a.f, ax, &b.f, bx);
    int n = 0;
    if (lo <= hi) {
        sb_uint_range(o, lo, hi);
        if (frac)
            sb_add(o, " (\".\" decimal-part)?");
        n++;
    }
    if (!frac)
        return n;
    if ((ax || a.f) && a.i <= NUM_LIM) /* a and the fractions above a's */
        n = sb_int_fraction(c, o, n, a.i, a.f, ax, NULL, 0);
    if (n >= 0 && b.i <= NUM_LIM) /* b and the fractions below b's */
        n = sb_int_fraction(c, o, n, b.i, 0, 0, &b.f, bx);
    return n;
}

/* A non-integral bound d of a number as a decimal of at most 16 fraction digits: d exactly when
 * it has that few (2.75, 0.0000152587890625), else the decimal with the fewest digits that reads
 * back as d (0.1 for the double nearest 0.1). -1 when that one has more than 16. text: d short. */
static int dec_of_double(double d, struct dec *v, char *text, size_t tn)
{
    char e[48];
    int p = 1;
    for (; p < 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, d);
        if (strtod(e, NULL) == d)
            break;
    }
    snprintf(text, tn, "%.*g", p, d);
    int fd = 16;
    if (ldexp(d, 16) != floor(ldexp(d, 16))) { /* not exactly k / 2^16: the short one */
        snprintf(e, sizeof e, "%.*e", p - 1, d);
        fd = p - 1 - atoi(strchr(e, 'e') + 1);
        if (fd > 16)
            return -1;
    }
    /* |d| < 2^52 (it has a fraction): fd digits after the point fit e */
    snprintf(e, sizeof e, "%.*f", fd, fabs(d));
    char *dot = strchr(e, '.');
    long long ip = strtoll(e, NULL, 10), fp = 0;
    for (int k = 0; k < 16; k++)
        fp = fp * 10 + (dot && k < fd ? dot[1 + k] - '0' : 0);
    *v = d < 0 ? dec_neg((struct dec){ip, fp}) : (struct dec){ip, fp};
    return 0;
}

/* A bound of s as (value, exclusive). For an integer schema, the nearest integer inside; for a
 * number, the decimal of at most 16 fraction digits that it is. Values are clamped to
 * +-(NUM_LIM + 1). Returns 0 when absent, 1 when read, -1 refused. */
static int read_bound(struct conv *c, json_t *s, const char *key, int upper, int integer,
                      struct dec *v, int *excl, const char *path)
{
    json_t *j = json_object_get(s, key);
    if (!j)
        return 0;
    if (!json_is_number(j)) {
        cerr(c, path, "'%s' must be a number", key);
        return -1;
    }
    double d = json_number_value(j);
    int x = strstr(key, "exclusive") != NULL;
    if (!json_is_integer(j) && d != floor(d)) {
        if (!integer) {
            char text[40];
            if (dec_of_double(d, v, text, sizeof text) != 0) {
                cerr(c, path, "'%s' %s has more than 16 fraction digits", key, text);
                return -1;
            }
            *excl = x;
            return 1;
        }
        /* the integers past a fractional bound: the inclusive bound is the next one inside */
        d = upper ? floor(d) : ceil(d);
        x = 0;
    }
    double lim = (double)(NUM_LIM + 1);
    long long iv;
    if (json_is_integer(j)) {
        json_int_t ji = json_integer_value(j);
        iv = ji > NUM_LIM + 1 ? NUM_LIM + 1 : ji < -NUM_LIM - 1 ? -NUM_LIM - 1 : (long long)ji;
    } else {
        iv = d > lim ? NUM_LIM + 1 : d < -lim ? -NUM_LIM - 1 : (long long)d;
    }
    if (integer && x) { /* x < v: x <= v - 1; v < x: v + 1 <= x */
        iv += upper ? -1 : 1;
        x = 0;
    }
    *v = (struct dec){iv, 0};
    *excl = x;
    return 1;
}

/* An integer or a number with minimum / maximum / exclusiveMinimum / exclusiveMaximum: the
 * values in range exactly, without exponents (see docs/grammar.md). */
static const char *visit_numeric(struct conv *c, json_t *s, int integer, const char *hint,
                                 const char *path)
{
    if (!bound_keyword(s))
        return prim(c, integer ? "integer" : "number");
    /* lo <= x (lo < x when lx), x <= hi (x < hi when hx) */
    struct dec lo = {-NUM_LIM - 1, 0}, hi = {NUM_LIM + 1, 0}, zero = {0, 0};
    int lx = 1, hx = 1;
    for (size_t i = 0; i < sizeof bound_keys / sizeof *bound_keys; i++) {
        struct dec v;
        int x, upper = i >= 2;
        int r = read_bound(c, s, bound_keys[i], upper, integer, &v, &x, path);
        if (r < 0)
            return NULL;
        if (r == 0)
            continue;
        int k = dec_cmp(v, upper ? hi : lo);
        if (!upper && (k > 0 || (k == 0 && x)))
            lo = v, lx = x;
        if (upper && (k < 0 || (k == 0 && x)))
            hi = v, hx = x;
    }
    const char *what = integer ? "integer" : "number";
    if (lo.i > NUM_LIM || hi.i < -NUM_LIM) {
        cerr(c, path, "no %s of at most 16 integral digits satisfies the bounds", what);
        return NULL;
    }
    int k = dec_cmp(lo, hi);
    if (k > 0 || (k == 0 && (lx || hx))) {
        cerr(c, path, "no %s satisfies the bounds", what);
        return NULL;
    }
    if (!prim(c, "space") || (!integer && !prim(c, "decimal-part")))
        return NULL;
    struct sb b = {0};
    sb_add(&b, "(");
    /* x >= 0: magnitudes from max(lo, 0) to hi */
    int lo_neg = dec_cmp(lo, zero) < 0, hi_pos = dec_cmp(hi, zero) > 0;
    int np = dec_cmp(hi, zero) < 0
                 ? 0
                 : sb_magnitude(c, &b, lo_neg ? zero : lo, lo_neg ? 0 : lx, hi, hx, !integer);
    /* x <= 0, written "-" and y = -x: from max(-hi, 0) to -lo */
    struct sb neg = {0};
    int nn = dec_cmp(lo, zero) > 0 ? 0
                                   : sb_magnitude(c, &neg, hi_pos ? zero : dec_neg(hi),
                                                  hi_pos ? 0 : hx, dec_neg(lo), lx, !integer);
    if (np < 0 || nn < 0) {
        free(b.p);
        free(neg.p);
        cerr(c, path, "out of memory");
        return NULL;
    }
    if (nn) {
        sb_add(&b, np ? " | \"-\" (" : "\"-\" (");
        sb_add(&b, neg.p);
        sb_add(&b, ")");
    }
    free(neg.p);
    sb_add(&b, ") space");
    if (!np && !nn) { /* two exclusive bounds 10^-16 apart */
        free(b.p);
        cerr(c, path, "no %s of at most 16 fraction digits satisfies the bounds", what);
        return NULL;
    }
    return add_rule(c, hint, &b);
}

static uint32_t next_cp(const char **pp)
{
    const unsigned char *p = (const unsigned char *)*pp;
    uint32_t c = p[0];
    int n = c < 0x80 ? 0 : c < 0xe0 ? 1 : c < 0xf0 ? 2 : 3;
    if (n)
        c &= 0x3fu >> n;
    for (int i = 1; i <= n && p[i]; i++)
        c = (c << 6) | (p[i] & 0x3fu);
    *pp += 1 + n;
    return c;
}

static void sb_class_cp(struct sb *b, uint32_t cp)
{
    if (cp < 0x80)
        sb_addf(b, "\\x%02X", cp);
    else if (cp < 0x10000)
        sb_addf(b, "\\u%04X", cp);
    else
        sb_addf(b, "\\U%08X", cp);
}

/* Code point cp (not NUL) as a GBNF string literal of its UTF-8. */
static void sb_literal_cp(struct sb *b, uint32_t cp)
{
    char u[5] = {0};
    if (cp < 0x80) {
        u[0] = (char)cp;
    } else if (cp < 0x800) {
        u[0] = (char)(0xc0 | (cp >> 6)), u[1] = (char)(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
        u[0] = (char)(0xe0 | (cp >> 12)), u[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        u[2] = (char)(0x80 | (cp & 0x3f));
    } else {
        u[0] = (char)(0xf0 | (cp >> 18)), u[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3f)), u[3] = (char)(0x80 | (cp & 0x3f));
    }
    sb_literal(b, u, strlen(u));
}

/* ---------------------------------------------------------------- pattern */

/* `pattern` (ECMA-262 syntax, matched anywhere in the string unless anchored) becomes the string's
 * content: each set of characters as JSON writes them (a `"`, `\` or control character escaped),
 * each group a rule. Backreferences, lookaround, word boundaries and inner anchors are refused. */
#define MAX_PATTERN 2048        /* bytes of one pattern */
#define MAX_PATTERN_REPEAT 4000 /* repetition counts and groups over all patterns of a schema */
#define MAX_PATTERN_GROUPS 32   /* nesting of groups */

struct cset {
    uint32_t (*r)[2]; /* ranges lo..hi; sorted and merged after cs_norm */
    size_t n, cap;
    int oom;
};

static void cs_add(struct cset *s, uint32_t lo, uint32_t hi)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        uint32_t(*r)[2] = realloc(s->r, cap * sizeof *r);
        if (!r) {
            s->oom = 1;
            return;
        }
        s->r = r;
        s->cap = cap;
    }
    s->r[s->n][0] = lo;
    s->r[s->n][1] = hi;
    s->n++;
}

static int cs_cmp(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

static void cs_norm(struct cset *s)
{
    if (!s->n)
        return;
    qsort(s->r, s->n, sizeof *s->r, cs_cmp);
    size_t k = 0;
    for (size_t i = 1; i < s->n; i++) {
        if (s->r[i][0] <= s->r[k][1] + 1) {
            if (s->r[i][1] > s->r[k][1])
                s->r[k][1] = s->r[i][1];
        } else {
            s->r[++k][0] = s->r[i][0];
            s->r[k][1] = s->r[i][1];
        }
    }
    s->n = k + 1;
}

/* The code points (up to U+10FFFF) not in s; s normalized first. */
static void cs_negate(struct cset *s)
{
    cs_norm(s);
    struct cset t = {0};
    uint32_t next = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (s->r[i][0] > next)
            cs_add(&t, next, s->r[i][0] - 1);
        next = s->r[i][1] + 1;
    }
    if (next <= 0x10ffff)
        cs_add(&t, next, 0x10ffff);
    t.oom |= s->oom;
    free(s->r);
    *s = t;
}

/* \d \w \s and their complements \D \W \S (ECMA-262: ASCII digits and word characters, Unicode
 * white space and line terminators). */
static int cs_class_escape(struct cset *s, char e)
{
    static const uint32_t space[][2] = {{0x09, 0x0d}, {0x20, 0x20}, {0xa0, 0xa0},
                                        {0x1680, 0x1680}, {0x2000, 0x200a}, {0x2028, 0x2029},
                                        {0x202f, 0x202f}, {0x205f, 0x205f}, {0x3000, 0x3000},
                                        {0xfeff, 0xfeff}};
    struct cset t = {0};
    switch (e | 0x20) {
    case 'd':
        cs_add(&t, '0', '9');
        break;
    case 'w':
        cs_add(&t, '0', '9'), cs_add(&t, 'A', 'Z'), cs_add(&t, '_', '_'), cs_add(&t, 'a', 'z');
        break;
    case 's':
        for (size_t i = 0; i < sizeof space / sizeof *space; i++)
            cs_add(&t, space[i][0], space[i][1]);
        break;
    default:
        return 0;
    }
    if (e >= 'A' && e <= 'Z')
        cs_negate(&t);
    for (size_t i = 0; i < t.n; i++)
        cs_add(s, t.r[i][0], t.r[i][1]);
    s->oom |= t.oom;
    free(t.r);
    return 1;
}

/* The characters of s as they appear inside a JSON string: one class of those written as
 * themselves, and the escapes of the others. */
static void sb_cset(struct sb *b, const struct cset *s)
{
    static const uint32_t plain[][2] = {{0x20, 0x21}, {0x23, 0x5b}, {0x5d, 0x7e},
                                        {0x80, 0xd7ff}, {0xe000, 0x10ffff}};
    uint32_t one = s->r[0][0];
    if (s->n == 1 && s->r[0][1] == one && one >= 0x20 && one != '"' && one != '\\' &&
        one != 0x7f) { /* a character written as itself */
        sb_literal_cp(b, one);
        return;
    }
    struct sb cls = {0};
    for (size_t i = 0; i < s->n; i++)
        for (size_t k = 0; k < sizeof plain / sizeof *plain; k++) {
            uint32_t lo = s->r[i][0] > plain[k][0] ? s->r[i][0] : plain[k][0];
            uint32_t hi = s->r[i][1] < plain[k][1] ? s->r[i][1] : plain[k][1];
            if (lo > hi)
                continue;
            sb_class_cp(&cls, lo);
            if (hi > lo) {
                sb_add(&cls, "-");
                sb_class_cp(&cls, hi);
            }
        }
    int alts = 0;
    char has[0x80] = {0};
    for (size_t i = 0; i < s->n; i++)
        for (uint32_t cp = s->r[i][0]; cp <= s->r[i][1] && cp < 0x80; cp++)
            has[cp] = 1;
    struct sb out = {0};
    if (cls.p) {
        sb_add(&out, "[");
        sb_add(&out, cls.p);
        sb_add(&out, "]");
        alts++;
    }
    free(cls.p);
    if (has['"'])
        sb_addf(&out, "%s\"\\\\\\\"\"", alts++ ? " | " : "");
    if (has['\\'])
        sb_addf(&out, "%s\"\\\\\\\\\"", alts++ ? " | " : "");
    /* control characters: a short escape where JSON has one, and \u00XX (hex in either case) */
    struct sb esc = {0};
    char shorts[8] = {0}, *sp = shorts;
    for (const char *e = "\bb\ff\nn\rr\tt"; *e; e += 2)
        if (has[(unsigned char)e[0]])
            *sp++ = e[1];
    if (sp > shorts)
        sb_addf(&esc, "[%s]", shorts);
    for (unsigned hi = 0; hi < 8; hi++) {
        struct sb lo = {0};
        for (unsigned d = 0; d < 16; d++) {
            unsigned cp = hi << 4 | d;
            if (!has[cp] || (cp >= 0x20 && cp != 0x7f))
                continue;
            if (d < 10)
                sb_addf(&lo, "%u", d);
            else
                sb_addf(&lo, "%c%c", 'a' + (d - 10), 'A' + (d - 10));
        }
        if (lo.p)
            sb_addf(&esc, "%s\"u00%u\" [%s]", esc.p ? " | " : "", hi, lo.p);
        esc.oom |= lo.oom;
        free(lo.p);
    }
    if (esc.p) {
        sb_addf(&out, "%s[\\\\] (", alts++ ? " | " : "");
        sb_add(&out, esc.p);
        sb_add(&out, ")");
    }
    out.oom |= esc.oom;
    free(esc.p);
    if (alts > 1)
        sb_add(b, "(");
    sb_add(b, out.p ? out.p : "");
    if (alts > 1)
        sb_add(b, ")");
    b->oom |= out.oom;
    free(out.p);
}

struct rx {
    struct conv *c;
    const char *start, *p, *end, *path, *hint;
    int groups;
};

static void rx_fail(struct rx *r, const char *what)
{
    cerr(r->c, r->path, "pattern: %s (at offset %ld) is not supported", what,
         (long)(r->p - r->start));
}

static int rx_alt(struct rx *r, struct sb *b, int top);

/* A character of the pattern outside escapes, as a code point. */
static uint32_t rx_cp(struct rx *r) { return next_cp(&r->p); }

/* An escape at r->p (after the '\'): a class escape into s (returns 2), a character (1, *cp), or
 * refused (0). in_class: inside [...], where \b is a backspace. */
static int rx_escape(struct rx *r, struct cset *s, uint32_t *cp, int in_class)
{
    if (r->p >= r->end) {
        rx_fail(r, "a '\\' at the end");
        return 0;
    }
    char e = *r->p;
    if (cs_class_escape(s, e)) {
        r->p++;
        return 2;
    }
    static const char ctl[] = "t\tn\nr\rv\vf\f";
    const char *k = strchr(ctl, e);
    if (e && k && (k - ctl) % 2 == 0) {
        r->p++;
        *cp = (unsigned char)k[1];
        return 1;
    }
    if (e == 'b' && in_class) {
        r->p++;
        *cp = 8;
        return 1;
    }
    if (e == '0' && !(r->p + 1 < r->end && r->p[1] >= '0' && r->p[1] <= '9')) {
        r->p++;
        *cp = 0;
        return 1;
    }
    if (e == 'c' && r->p + 1 < r->end && ((r->p[1] | 0x20) >= 'a' && (r->p[1] | 0x20) <= 'z')) {
        *cp = (uint32_t)(r->p[1] & 31);
        r->p += 2;
        return 1;
    }
    if (e == 'x' || e == 'u') {
        int nd = e == 'x' ? 2 : 4;
        uint32_t v = 0;
        for (int i = 1; i <= nd; i++) {
            char h = r->p + i < r->end ? r->p[i] : 0;
            int d = h >= '0' && h <= '9' ? h - '0' : (h | 0x20) >= 'a' && (h | 0x20) <= 'f'
                                                         ? (h | 0x20) - 'a' + 10 : -1;
            if (d < 0) {
                rx_fail(r, e == 'x' ? "'\\x' without 2 hex digits"
                                    : "'\\u' without 4 hex digits ('\\u{...}' included)");
                return 0;
            }
            v = v * 16 + (uint32_t)d;
        }
        if (v >= 0xd800 && v <= 0xdfff) {
            rx_fail(r, "a surrogate '\\u' escape");
            return 0;
        }
        r->p += 1 + nd;
        *cp = v;
        return 1;
    }
    if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9')) {
        char what[64];
        snprintf(what, sizeof what, "the escape '\\%c'%s", e,
                 e >= '1' && e <= '9' ? " (a backreference)"
                 : e == 'b' || e == 'B' ? " (a word boundary)"
                 : e == 'p' || e == 'P' ? " (a Unicode property)"
                 : e == 'k' ? " (a named backreference)" : "");
        rx_fail(r, what);
        return 0;
    }
    *cp = rx_cp(r); /* an escaped punctuation character is itself */
    return 1;
}

/* [...] at r->p (after the '['). */
static int rx_class(struct rx *r, struct cset *s)
{
    int neg = r->p < r->end && *r->p == '^';
    r->p += neg;
    while (r->p < r->end && *r->p != ']') {
        uint32_t lo, hi;
        int k = 1;
        if (*r->p == '\\') {
            r->p++;
            if (!(k = rx_escape(r, s, &lo, 1)))
                return -1;
        } else {
            lo = rx_cp(r);
        }
        if (k == 1 && r->p + 1 < r->end && r->p[0] == '-' && r->p[1] != ']') {
            r->p++;
            int k2 = 1;
            if (*r->p == '\\') {
                r->p++;
                struct cset t = {0};
                k2 = rx_escape(r, &t, &hi, 1);
                free(t.r);
                if (!k2)
                    return -1;
            } else {
                hi = rx_cp(r);
            }
            if (k2 != 1 || hi < lo) {
                rx_fail(r, k2 != 1 ? "a class escape as a range's end" : "a range out of order");
                return -1;
            }
            cs_add(s, lo, hi);
        } else if (k == 1) {
            cs_add(s, lo, lo);
        }
    }
    if (r->p >= r->end) {
        rx_fail(r, "a '[' without ']'");
        return -1;
    }
    r->p++;
    if (neg)
        cs_negate(s);
    cs_norm(s);
    return 0;
}

/* {m}, {m,}, {m,n} at r->p (at the '{'): 1 and the counts (hi -1: unbounded), 0 when it is
 * not one. */
static int rx_braces(struct rx *r, long *lo, long *hi)
{
    const char *p = r->p + 1;
    long m = 0, n;
    if (p >= r->end || *p < '0' || *p > '9')
        return 0;
    for (; p < r->end && *p >= '0' && *p <= '9'; p++)
        m = m > 100000 ? m : m * 10 + (*p - '0');
    n = m;
    if (p < r->end && *p == ',') {
        p++;
        n = -1;
        if (p < r->end && *p >= '0' && *p <= '9')
            for (n = 0; p < r->end && *p >= '0' && *p <= '9'; p++)
                n = n > 100000 ? n : n * 10 + (*p - '0');
    }
    if (p >= r->end || *p != '}')
        return 0;
    r->p = p + 1;
    *lo = m;
    *hi = n;
    return 1;
}

/* One item (an atom and its quantifier) into b; *nullable: whether it can match nothing.
 * Returns 0, 1 at the end of a sequence ('|', ')' or the end), -1 refused. */
static int rx_item(struct rx *r, struct sb *b, int *nullable)
{
    struct sb atom = {0};
    struct cset s = {0};
    int null = 0, group = *r->p == '(';
    char ch = *r->p;
    if (ch == '|' || ch == ')')
        return 1;
    if (ch == '*' || ch == '+' || ch == '?' || (ch == '{' && rx_braces(r, &(long){0},
                                                                         &(long){0}))) {
        rx_fail(r, "a quantifier with nothing to repeat");
        return -1;
    }
    if (ch == '{') {
        rx_fail(r, "a '{' that is no quantifier (escape it)");
        return -1;
    }
    if (ch == '^' || ch == '$') {
        rx_fail(r, ch == '^' ? "'^' past the start of an alternative"
                             : "'$' before the end of an alternative");
        return -1;
    }
    if (ch == '(') {
        r->p++;
        if (r->p < r->end && *r->p == '?') {
            if (r->p + 1 < r->end && r->p[1] == ':') {
                r->p += 2;
            } else if (r->p + 2 < r->end && r->p[1] == '<' && r->p[2] != '=' && r->p[2] != '!') {
                const char *e = memchr(r->p, '>', (size_t)(r->end - r->p));
                if (!e) {
                    rx_fail(r, "a group name without '>'");
                    return -1;
                }
                r->p = e + 1; /* a named group matches as a plain one */
            } else {
                rx_fail(r, "lookaround or a group modifier '(?'");
                return -1;
            }
        }
        if (++r->groups > MAX_PATTERN_GROUPS) {
            rx_fail(r, "groups nested this deep");
            return -1;
        }
        struct sb body = {0};
        null = rx_alt(r, &body, 0);
        r->groups--;
        if (null < 0) {
            free(body.p);
            return -1;
        }
        if (r->p >= r->end || *r->p != ')') {
            free(body.p);
            rx_fail(r, "a '(' without ')'");
            return -1;
        }
        r->p++;
        r->c->pattern_repeat++; /* a rule */
        char h[128];
        snprintf(h, sizeof h, "%s-group", r->hint);
        const char *name = add_rule(r->c, h, &body);
        if (!name)
            return -1;
        sb_add(&atom, name);
    } else {
        r->p++;
        uint32_t cp;
        if (ch == '[') {
            if (rx_class(r, &s) != 0) {
                free(s.r);
                return -1;
            }
        } else if (ch == '.') { /* anything but the line terminators */
            cs_add(&s, '\n', '\n'), cs_add(&s, '\r', '\r'), cs_add(&s, 0x2028, 0x2029);
            cs_negate(&s);
        } else if (ch == '\\') {
            int k = rx_escape(r, &s, &cp, 0);
            if (!k) {
                free(s.r);
                return -1;
            }
            if (k == 1)
                cs_add(&s, cp, cp);
            cs_norm(&s);
        } else {
            r->p--;
            cp = rx_cp(r);
            cs_add(&s, cp, cp);
        }
        if (s.oom) {
            free(s.r);
            cerr(r->c, r->path, "out of memory");
            return -1;
        }
        if (!s.n) {
            free(s.r);
            rx_fail(r, "a class that matches nothing");
            return -1;
        }
        sb_cset(&atom, &s);
        free(s.r);
    }
    /* the quantifier; a lazy one ('?' after it) matches the same strings */
    long lo = 1, hi = 1;
    if (r->p < r->end) {
        ch = *r->p;
        if (ch == '*' || ch == '+' || ch == '?') {
            lo = ch == '+', hi = ch == '?' ? 1 : -1;
            r->p++;
        } else if (ch == '{' && !rx_braces(r, &lo, &hi)) {
            free(atom.p);
            rx_fail(r, "a '{' that is no quantifier (escape it)");
            return -1;
        }
        if ((lo != 1 || hi != 1) && r->p < r->end && *r->p == '?')
            r->p++;
    }
    if ((hi >= 0 && hi < lo) || lo > MAX_BOUND || hi > MAX_BOUND) {
        free(atom.p);
        rx_fail(r, hi >= 0 && hi < lo ? "a quantifier {m,n} with n < m"
                                      : "a repetition count over 1000");
        return -1;
    }
    if (hi < 0 && null) {
        free(atom.p);
        rx_fail(r, "an unbounded repetition of a group that can match nothing");
        return -1;
    }
    if (lo != 1 || hi != 1) /* rules and copies in the grammar */
        r->c->pattern_repeat += hi < 0 ? lo + 1 : hi;
    if (r->c->pattern_repeat > MAX_PATTERN_REPEAT) {
        free(atom.p);
        rx_fail(r, "repetition counts and groups over 4000 in all");
        return -1;
    }
    *nullable = lo == 0 || null;
    if (hi != 0) {
        /* a set may be several items ([\\] and an escape): repeated as one */
        int wrap = !group && (lo != 1 || hi != 1) && strchr(atom.p, ' ');
        sb_add(b, wrap ? "(" : "");
        sb_add(b, atom.p);
        sb_add(b, wrap ? ")" : "");
        if (lo == 0 && hi == 1)
            sb_add(b, "?");
        else if (lo == 0 && hi < 0)
            sb_add(b, "*");
        else if (lo == 1 && hi < 0)
            sb_add(b, "+");
        else if (hi < 0)
            sb_addf(b, "{%ld,}", lo);
        else if (lo != 1 || hi != 1)
            sb_addf(b, lo == hi ? "{%ld}" : "{%ld,%ld}", lo, hi);
        sb_add(b, " ");
    }
    free(atom.p);
    return 0;
}

/* Alternatives up to ')' or the end, into b. At the top, each one may start with '^' and end
 * with '$'; one without is matched anywhere in the string. Returns whether it can match nothing
 * (0, 1), -1 refused. */
static int rx_alt(struct rx *r, struct sb *b, int top)
{
    int nullable = 0;
    for (int alt = 0;; alt++) {
        if (alt)
            sb_add(b, "| ");
        int start = top && r->p < r->end && *r->p == '^', end = 0, seq_null = 1;
        r->p += start;
        if (top && !start)
            sb_add(b, "char* ");
        size_t at = b->n;
        for (;;) {
            if (r->p >= r->end)
                break;
            if (top && *r->p == '$' && (r->p + 1 == r->end || r->p[1] == '|')) {
                r->p++;
                end = 1;
                break;
            }
            int item_null, k = rx_item(r, b, &item_null);
            if (k < 0)
                return -1;
            if (k)
                break;
            seq_null &= item_null;
        }
        if (top && !end)
            sb_add(b, "char* ");
        else if (b->n == at)
            sb_add(b, "\"\" ");
        nullable |= seq_null;
        if (r->p >= r->end || *r->p != '|')
            break;
        r->p++;
    }
    if (top && r->p < r->end) {
        rx_fail(r, "a ')' without '('");
        return -1;
    }
    return nullable;
}

static const char *visit_pattern(struct conv *c, json_t *pat, const char *hint, const char *path)
{
    if (!json_is_string(pat)) {
        cerr(c, path, "'pattern' must be a string");
        return NULL;
    }
    size_t n = json_string_length(pat);
    if (n > MAX_PATTERN) {
        cerr(c, path, "'pattern' longer than %d bytes is not supported", MAX_PATTERN);
        return NULL;
    }
    if (!prim(c, "char") || !prim(c, "space"))
        return NULL;
    char h[128];
    snprintf(h, sizeof h, "%s-pattern", hint);
    const char *text = json_string_value(pat);
    struct rx r = {c, text, text, text + n, path, h, 0};
    struct sb body = {0};
    if (rx_alt(&r, &body, 1) < 0) {
        free(body.p);
        return NULL;
    }
    const char *inner = add_rule(c, h, &body);
    if (!inner)
        return NULL;
    struct sb b = {0};
    sb_addf(&b, "\"\\\"\" %s \"\\\"\" space", inner);
    return add_rule(c, hint, &b);
}

static const char *visit_string(struct conv *c, json_t *s, const char *hint, const char *path)
{
    json_t *pat = json_object_get(s, "pattern");
    if (pat) {
        static const char *other[] = {"format", "minLength", "maxLength"};
        for (size_t i = 0; i < sizeof other / sizeof *other; i++)
            if (json_object_get(s, other[i])) {
                cerr(c, path, "'pattern' next to '%s' is not supported", other[i]);
                return NULL;
            }
        return visit_pattern(c, pat, hint, path);
    }
    json_t *f = json_object_get(s, "format");
    if (f) {
        const char *fmt = json_string_value(f);
        if (!fmt) {
            cerr(c, path, "'format' must be a string");
            return NULL;
        }
        if (strcmp(fmt, "date") == 0)
            return prim(c, "date-string");
        if (strcmp(fmt, "time") == 0)
            return prim(c, "time-string");
        if (strcmp(fmt, "date-time") == 0)
            return prim(c, "date-time-string");
        if (strcmp(fmt, "uuid") == 0)
            return prim(c, "uuid");
        cerr(c, path, "format '%s' is not supported (date, time, date-time, uuid are)", fmt);
        return NULL;
    }
    long lo = get_uint(c, s, "minLength", 0, path), hi = get_uint(c, s, "maxLength", -1, path);
    if (lo == -2 || hi == -2)
        return NULL;
    if (lo > MAX_BOUND) {
        cerr(c, path, "minLength over %d is not supported", MAX_BOUND);
        return NULL;
    }
    if (hi > MAX_BOUND)
        hi = -1;
    if (hi >= 0 && hi < lo) {
        cerr(c, path, "maxLength < minLength: no string matches");
        return NULL;
    }
    if (lo == 0 && hi < 0)
        return prim(c, "string");
    if (!prim(c, "char") || !prim(c, "space"))
        return NULL;
    struct sb b = {0};
    sb_add(&b, "\"\\\"\" char");
    if (hi < 0)
        sb_addf(&b, "{%ld,}", lo);
    else
        sb_addf(&b, "{%ld,%ld}", lo, hi);
    sb_add(&b, " \"\\\"\" space");
    return add_rule(c, hint, &b);
}

/* The items of an array with prefixItems: element i (0-based) with i already written, to the end
 * (each tail starts with a comma). rest: the rule of the items past the prefix; hi < 0 unbounded. */
static const char *prefix_tail(struct conv *c, const char **pn, size_t k, size_t i, long lo,
                               long hi, const char *rest, const char *hint)
{
    struct sb b = {0};
    char th[128];
    snprintf(th, sizeof th, "%s-rest%zu", hint, i);
    if (i == k || (hi >= 0 && (long)i >= hi))
        return add_rule(c, th, &(struct sb){0});
    const char *next = i + 1 < k ? prefix_tail(c, pn, k, i + 1, lo, hi, rest, hint) : rest;
    if (!next)
        return NULL;
    if ((long)i >= lo)
        sb_addf(&b, "(\",\" space %s %s)?", pn[i], next);
    else
        sb_addf(&b, "\",\" space %s %s", pn[i], next);
    return add_rule(c, th, &b);
}

static const char *visit_array(struct conv *c, json_t *s, const char *hint, const char *path)
{
    json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    const char *item = NULL; /* NULL: no items (past the prefix) */
    char sub[512], ih[128];
    path_join(sub, sizeof sub, path, "items", NULL);
    snprintf(ih, sizeof ih, "%s-item", hint);
    if (prefix && (!json_is_array(prefix) || json_array_size(prefix) == 0)) {
        cerr(c, path, "'prefixItems' must be a non-empty array of schemas");
        return NULL;
    }
    if (!items || json_is_true(items)) {
        item = prim(c, "value");
    } else if (json_is_object(items)) {
        item = visit(c, items, ih, sub);
    } else if (!json_is_false(items)) {
        cerr(c, path, "'items' must be a schema (for tuples, 'prefixItems' is)");
        return NULL;
    }
    if ((!item && !json_is_false(items)) || !prim(c, "space"))
        return NULL;
    long lo = get_uint(c, s, "minItems", 0, path), hi = get_uint(c, s, "maxItems", -1, path);
    if (lo == -2 || hi == -2)
        return NULL;
    if (lo > MAX_BOUND) {
        cerr(c, path, "minItems over %d is not supported", MAX_BOUND);
        return NULL;
    }
    if (hi > MAX_BOUND)
        hi = -1;
    size_t k = prefix ? json_array_size(prefix) : 0;
    if (!item && (hi < 0 || hi > (long)k))
        hi = (long)k;
    if (hi >= 0 && hi < lo) {
        cerr(c, path, "%s < minItems: no array matches",
             !item && hi == (long)k ? "the items allowed ('items' false)" : "maxItems");
        return NULL;
    }
    char sep_item[160] = "";
    if (item)
        snprintf(sep_item, sizeof sep_item, "\",\" space %s", item);
    struct sb b = {0};
    if (k) {
        /* the items past the prefix, then the prefix's tails */
        const char **pn = calloc(k, sizeof *pn);
        if (!pn) {
            cerr(c, path, "out of memory");
            return NULL;
        }
        size_t i;
        json_t *ps;
        json_array_foreach(prefix, i, ps) {
            char idx[24], ph[128];
            snprintf(idx, sizeof idx, "%zu", i);
            path_join(sub, sizeof sub, path, "prefixItems", idx);
            snprintf(ph, sizeof ph, "%s-%zu", hint, i);
            if (!(pn[i] = visit(c, ps, ph, sub)))
                break;
        }
        const char *rest = NULL, *tail = NULL;
        if (i == k) {
            if (item)
                sb_repeat(&b, sep_item, lo > (long)k ? lo - (long)k : 0,
                          hi < 0 ? -1 : hi - (long)k);
            char th[128];
            snprintf(th, sizeof th, "%s-rest", hint);
            rest = add_rule(c, th, &b);
            tail = rest && k > 1 ? prefix_tail(c, pn, k, 1, lo, hi, rest, hint) : rest;
        }
        b = (struct sb){0};
        if (tail) {
            sb_add(&b, "\"[\" space");
            if (hi != 0)
                sb_addf(&b, lo ? " %s %s" : " ( %s %s )?", pn[0], tail);
            sb_add(&b, " \"]\" space");
        }
        free(pn);
        return tail ? add_rule(c, hint, &b) : NULL;
    }
    sb_add(&b, "\"[\" space");
    if (hi != 0) {
        if (lo == 0) {
            sb_addf(&b, " ( %s", item);
            sb_repeat(&b, sep_item, 0, hi < 0 ? -1 : hi - 1);
            sb_add(&b, " )?");
        } else {
            sb_addf(&b, " %s", item);
            sb_repeat(&b, sep_item, lo - 1, hi < 0 ? -1 : hi - 1);
        }
    }
    sb_add(&b, " \"]\" space");
    return add_rule(c, hint, &b);
}

static const char *kv_rule(struct conv *c, const char *key, const char *value, const char *hint)
{
    struct sb b = {0};
    json_t *ks = json_string(key);
    char *kj = ks ? json_dumps(ks, JSON_ENCODE_ANY) : NULL;
    json_decref(ks);
    if (!kj) {
        cerr(c, "", "out of memory");
        return NULL;
    }
    sb_literal(&b, kj, strlen(kj));
    free(kj);
    sb_addf(&b, " space \":\" space %s", value);
    return add_rule(c, hint, &b);
}

/* Keys that are none of the declared property names: a rule over the trie of the names (as
 * JSON writes them). At each node: end here (when no name ends here), take a child's character
 * and go on, or take any other character and then anything. Names that need escapes in JSON are
 * not excluded (see docs/grammar.md). */
struct knode {
    long child, sibling;
    uint32_t cp;
    int end;
};

static const char *not_keys_node(struct conv *c, struct knode *t, long i, const char *hint)
{
    if (!prim(c, "char"))
        return NULL;
    struct sb b = {0};
    int alts = 0;
    if (!t[i].end) {
        sb_add(&b, "\"\"");
        alts++;
    }
    for (long k = t[i].child; k >= 0; k = t[k].sibling) {
        const char *sub = not_keys_node(c, t, k, hint);
        if (!sub) {
            free(b.p);
            return NULL;
        }
        if (alts++)
            sb_add(&b, " | ");
        sb_literal_cp(&b, t[k].cp);
        sb_addf(&b, " %s", sub);
    }
    if (alts++)
        sb_add(&b, " | ");
    sb_add(&b, "[^\"\\\\\\x7F\\x00-\\x1F");
    for (long k = t[i].child; k >= 0; k = t[k].sibling)
        sb_class_cp(&b, t[k].cp);
    sb_add(&b, "] char* | [\\\\] ([\"\\\\bfnrt/] | \"u\" [0-9a-fA-F]{4}) char*");
    return add_rule(c, hint, &b);
}

static const char *not_keys(struct conv *c, json_t *props, const char *hint)
{
    size_t cap = 1;
    const char *key;
    json_t *v;
    json_object_foreach(props, key, v) cap += strlen(key);
    struct knode *t = malloc(cap * sizeof *t);
    if (!t) {
        cerr(c, "", "out of memory");
        return NULL;
    }
    long n = 1;
    t[0] = (struct knode){-1, -1, 0, 0};
    json_object_foreach(props, key, v) {
        int plain = 1;
        for (const unsigned char *q = (const unsigned char *)key; *q; q++)
            plain &= *q >= 0x20 && *q != 0x7f && *q != '"' && *q != '\\';
        if (!plain)
            continue;
        long at = 0;
        for (const char *q = key; *q;) {
            uint32_t cp = next_cp(&q);
            long k = t[at].child;
            while (k >= 0 && t[k].cp != cp)
                k = t[k].sibling;
            if (k < 0) {
                k = n++;
                t[k] = (struct knode){-1, t[at].child, cp, 0};
                t[at].child = k;
            }
            at = k;
        }
        t[at].end = 1;
    }
    char h[128];
    snprintf(h, sizeof h, "%s-other-key", hint);
    const char *inner = not_keys_node(c, t, 0, h);
    free(t);
    if (!inner || !prim(c, "space"))
        return NULL;
    struct sb b = {0};
    sb_addf(&b, "\"\\\"\" %s \"\\\"\" space", inner);
    return add_rule(c, h, &b);
}

static const char *visit_object(struct conv *c, json_t *props, json_t *required, json_t *addl,
                                const char *hint, const char *path)
{
    if (!prim(c, "space"))
        return NULL;
    if (props && !json_is_object(props)) {
        cerr(c, path, "'properties' must be an object");
        return NULL;
    }
    if (required && !json_is_array(required)) {
        cerr(c, path, "'required' must be an array of names");
        return NULL;
    }
    size_t n = props ? json_object_size(props) : 0;
    size_t i;
    json_t *r;
    json_array_foreach(required, i, r) {
        if (!json_is_string(r)) {
            cerr(c, path, "'required' must be an array of names");
            return NULL;
        }
        if (!props || !json_object_get(props, json_string_value(r))) {
            cerr(c, path, "required property '%s' is not in 'properties'", json_string_value(r));
            return NULL;
        }
    }
    /* extra key-value pairs: none (additionalProperties false, or absent next to properties,
     * as llama.cpp's converter does), any value, or a schema */
    const char *akv = NULL;
    if (addl && !json_is_boolean(addl) && !json_is_object(addl)) {
        cerr(c, path, "'additionalProperties' must be a boolean or a schema");
        return NULL;
    }
    if ((!addl && n == 0) || json_is_true(addl) || json_is_object(addl)) {
        const char *val;
        char sub[512], ah[128];
        path_join(sub, sizeof sub, path, "additionalProperties", NULL);
        snprintf(ah, sizeof ah, "%s-additional", hint);
        val = json_is_object(addl) ? visit(c, addl, ah, sub) : prim(c, "value");
        const char *keyr = n ? not_keys(c, props, hint) : prim(c, "string");
        if (!val || !keyr)
            return NULL;
        struct sb b = {0};
        sb_addf(&b, "%s \":\" space %s", keyr, val);
        snprintf(ah, sizeof ah, "%s-additional-kv", hint);
        akv = add_rule(c, ah, &b);
        if (!akv)
            return NULL;
    }
    if (n == 0 && akv && !addl && !required)
        return prim(c, "object");
    /* kv[i], and the rule names of the tails: t[i] (a pair was written already, so each one
     * starts with a comma) and f[i] (none was) over properties i.. in their order */
    const char **kv = calloc(n + 1, sizeof *kv);
    const char **opt = calloc(n + 1, sizeof *opt);
    if (!kv || !opt) {
        free(kv);
        free(opt);
        cerr(c, path, "out of memory");
        return NULL;
    }
    const char *key;
    json_t *ps;
    i = 0;
    json_object_foreach(props, key, ps) {
        char sub[512], ph[160];
        path_join(sub, sizeof sub, path, "properties", key);
        snprintf(ph, sizeof ph, "%s-%s", hint, key);
        const char *val = visit(c, ps, ph, sub);
        if (!val)
            break;
        snprintf(ph, sizeof ph, "%s-%s-kv", hint, key);
        kv[i] = kv_rule(c, key, val, ph);
        if (!kv[i])
            break;
        int req = 0;
        size_t j;
        json_array_foreach(required, j, r) req |= strcmp(json_string_value(r), key) == 0;
        opt[i] = req ? NULL : "";
        i++;
    }
    const char *result = NULL;
    if (i == n) {
        struct sb b = {0};
        char th[128];
        /* t[n] and f[n]: <hint>-tail<k> after a pair was written, <hint>-from<k> before */
        if (akv)
            sb_addf(&b, "(\",\" space %s)*", akv);
        snprintf(th, sizeof th, "%s-tail%zu", hint, n);
        const char *t_next = add_rule(c, th, &b);
        b = (struct sb){0};
        if (akv)
            sb_addf(&b, "( %s (\",\" space %s)* )?", akv, akv);
        snprintf(th, sizeof th, "%s-from%zu", hint, n);
        const char *f_next = t_next ? add_rule(c, th, &b) : NULL;
        for (size_t k = n; k-- > 0 && f_next;) {
            b = (struct sb){0};
            if (opt[k])
                sb_addf(&b, "(\",\" space %s)? %s", kv[k], t_next);
            else
                sb_addf(&b, "\",\" space %s %s", kv[k], t_next);
            snprintf(th, sizeof th, "%s-tail%zu", hint, k);
            const char *t = add_rule(c, th, &b);
            b = (struct sb){0};
            if (opt[k])
                sb_addf(&b, "%s %s | %s", kv[k], t_next, f_next);
            else
                sb_addf(&b, "%s %s", kv[k], t_next);
            snprintf(th, sizeof th, "%s-from%zu", hint, k);
            f_next = t ? add_rule(c, th, &b) : NULL;
            t_next = t;
        }
        if (f_next) {
            b = (struct sb){0};
            sb_addf(&b, "\"{\" space %s \"}\" space", f_next);
            result = add_rule(c, hint, &b);
        }
    }
    free(kv);
    free(opt);
    return result;
}

/* allOf of object schemas: their properties (later ones win), required names and
 * additionalProperties (the last one given) merged. */
static const char *visit_all_of(struct conv *c, json_t *all, const char *hint, const char *path)
{
    if (!json_is_array(all) || json_array_size(all) == 0) {
        cerr(c, path, "'allOf' must be a non-empty array");
        return NULL;
    }
    if (json_array_size(all) == 1) {
        char sub[512];
        path_join(sub, sizeof sub, path, "allOf", "0");
        return visit(c, json_array_get(all, 0), hint, sub);
    }
    json_t *props = json_object(), *req = json_array(), *addl = NULL;
    size_t i;
    json_t *s;
    const char *result = NULL;
    json_array_foreach(all, i, s) {
        char sub[512], idx[24];
        snprintf(idx, sizeof idx, "%zu", i);
        path_join(sub, sizeof sub, path, "allOf", idx);
        for (int hops = 0; json_is_object(s) && json_object_get(s, "$ref") && hops < 16; hops++) {
            const char *ref = json_string_value(json_object_get(s, "$ref"));
            s = ref ? resolve(c, ref) : NULL;
        }
        json_t *t = json_is_object(s) ? json_object_get(s, "type") : NULL;
        if (!json_is_object(s) || (t && !(json_is_string(t) &&
                                          strcmp(json_string_value(t), "object") == 0))) {
            cerr(c, sub, "'allOf' is supported for object schemas only");
            goto out;
        }
        const char *k;
        json_t *v;
        json_object_foreach(s, k, v) {
            if (strcmp(k, "type") && strcmp(k, "properties") && strcmp(k, "required") &&
                strcmp(k, "additionalProperties") && !is_annotation(k)) {
                cerr(c, sub, "keyword '%s' inside 'allOf' is not supported", k);
                goto out;
            }
        }
        json_t *p = json_object_get(s, "properties");
        if (p && json_object_update(props, p) != 0) {
            cerr(c, sub, "'properties' must be an object");
            goto out;
        }
        json_t *r = json_object_get(s, "required");
        if (r && json_array_extend(req, r) != 0) {
            cerr(c, sub, "'required' must be an array of names");
            goto out;
        }
        if (json_object_get(s, "additionalProperties"))
            addl = json_object_get(s, "additionalProperties");
    }
    /* drop duplicate required names */
    json_t *uniq = json_array();
    json_array_foreach(req, i, s) {
        size_t j;
        json_t *u;
        int seen = 0;
        json_array_foreach(uniq, j, u) seen |= json_equal(u, s);
        if (!seen)
            json_array_append(uniq, s);
    }
    result = visit_object(c, props, uniq, addl, hint, path);
    json_decref(uniq);
out:
    json_decref(props);
    json_decref(req);
    return result;
}

static const char *visit_literals(struct conv *c, json_t *vals, const char *hint,
                                  const char *path)
{
    if (!prim(c, "space"))
        return NULL;
    struct sb b = {0};
    size_t i;
    json_t *v;
    sb_add(&b, "(");
    json_array_foreach(vals, i, v) {
        char *j = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
        if (!j) {
            free(b.p);
            cerr(c, path, "out of memory");
            return NULL;
        }
        if (i)
            sb_add(&b, " | ");
        sb_literal(&b, j, strlen(j));
        free(j);
    }
    sb_add(&b, ") space");
    return add_rule(c, hint, &b);
}

static const char *visit_type(struct conv *c, json_t *s, const char *type, const char *hint,
                              const char *path)
{
    if (strcmp(type, "string") == 0)
        return visit_string(c, s, hint, path);
    if (strcmp(type, "integer") == 0 || strcmp(type, "number") == 0)
        return visit_numeric(c, s, type[0] == 'i', hint, path);
    if (strcmp(type, "boolean") == 0)
        return prim(c, "boolean");
    if (strcmp(type, "null") == 0)
        return prim(c, "null");
    if (strcmp(type, "array") == 0)
        return visit_array(c, s, hint, path);
    if (strcmp(type, "object") == 0)
        return visit_object(c, json_object_get(s, "properties"), json_object_get(s, "required"),
                            json_object_get(s, "additionalProperties"), hint, path);
    cerr(c, path, "unknown type '%s'", type);
    return NULL;
}

/* Alternatives: names[0..n) as one rule. */
static const char *alternation(struct conv *c, const char **names, size_t n, const char *hint)
{
    if (n == 1)
        return names[0];
    struct sb b = {0};
    for (size_t i = 0; i < n; i++) {
        if (i)
            sb_add(&b, " | ");
        sb_add(&b, names[i]);
    }
    return add_rule(c, hint, &b);
}

static const char *visit_inner(struct conv *c, json_t *s, const char *hint, const char *path)
{
    if (json_is_true(s))
        return prim(c, "value");
    if (json_is_false(s)) {
        cerr(c, path, "schema 'false' matches nothing");
        return NULL;
    }
    if (!json_is_object(s)) {
        cerr(c, path, "a schema must be an object or a boolean");
        return NULL;
    }
    if (check_keywords(c, s, path) != 0)
        return NULL;
    json_t *v;
    const char *bk = bound_keyword(s);
    if (!bk && json_object_get(s, "pattern"))
        bk = "pattern";
    if (bk) { /* enforced by the rule of their type only */
        static const char *other[] = {"$ref", "const", "enum", "anyOf", "oneOf", "allOf"};
        for (size_t i = 0; i < sizeof other / sizeof *other; i++)
            if (json_object_get(s, other[i])) {
                cerr(c, path, "'%s' next to '%s' is not supported", bk, other[i]);
                return NULL;
            }
        if (!json_object_get(s, "type")) {
            cerr(c, path, "'%s' needs 'type' %s", bk,
                 strcmp(bk, "pattern") ? "integer or number" : "string");
            return NULL;
        }
    }
    if ((v = json_object_get(s, "$ref"))) {
        if (!json_is_string(v)) {
            cerr(c, path, "'$ref' must be a string");
            return NULL;
        }
        return visit_ref(c, json_string_value(v), path);
    }
    const char *base = NULL;
    if ((v = json_object_get(s, "const"))) {
        json_t *one = json_pack("[O]", v);
        base = visit_literals(c, one, hint, path);
        json_decref(one);
    } else if ((v = json_object_get(s, "enum"))) {
        if (!json_is_array(v) || json_array_size(v) == 0) {
            cerr(c, path, "'enum' must be a non-empty array");
            return NULL;
        }
        base = visit_literals(c, v, hint, path);
    } else if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf"))) {
        const char *kw = json_object_get(s, "anyOf") ? "anyOf" : "oneOf";
        if (!json_is_array(v) || json_array_size(v) == 0) {
            cerr(c, path, "'%s' must be a non-empty array", kw);
            return NULL;
        }
        size_t n = json_array_size(v), i;
        const char **names = calloc(n, sizeof *names);
        if (!names) {
            cerr(c, path, "out of memory");
            return NULL;
        }
        json_t *sub;
        json_array_foreach(v, i, sub) {
            char sp[512], idx[24], h[128];
            snprintf(idx, sizeof idx, "%zu", i);
            path_join(sp, sizeof sp, path, kw, idx);
            snprintf(h, sizeof h, "%s-%zu", hint, i);
            names[i] = visit(c, sub, h, sp);
            if (!names[i])
                break;
        }
        if (i == n)
            base = alternation(c, names, n, hint);
        free(names);
    } else if ((v = json_object_get(s, "allOf"))) {
        base = visit_all_of(c, v, hint, path);
    } else if ((v = json_object_get(s, "type"))) {
        if (json_is_string(v)) {
            base = visit_type(c, s, json_string_value(v), hint, path);
        } else if (json_is_array(v) && json_array_size(v) > 0) {
            size_t n = json_array_size(v), i;
            const char **names = calloc(n, sizeof *names);
            if (!names) {
                cerr(c, path, "out of memory");
                return NULL;
            }
            json_t *t;
            json_array_foreach(v, i, t) {
                char h[128];
                snprintf(h, sizeof h, "%s-%s", hint, json_is_string(t) ? json_string_value(t) : "");
                if (!json_is_string(t)) {
                    cerr(c, path, "'type' must be a string or an array of strings");
                    break;
                }
                names[i] = visit_type(c, s, json_string_value(t), h, path);
                if (!names[i])
                    break;
            }
            if (i == n)
                base = alternation(c, names, n, hint);
            free(names);
        } else {
            cerr(c, path, "'type' must be a string or an array of strings");
            return NULL;
        }
    } else if (json_object_get(s, "properties") || json_object_get(s, "additionalProperties")) {
        base = visit_type(c, s, "object", hint, path);
    } else if (json_object_get(s, "items") || json_object_get(s, "prefixItems")) {
        base = visit_type(c, s, "array", hint, path);
    } else {
        base = prim(c, "value");
    }
    if (base && json_is_true(json_object_get(s, "nullable"))) {
        const char *alts[2] = {base, prim(c, "null")};
        char h[128];
        snprintf(h, sizeof h, "%s-nullable", hint);
        base = alts[1] ? alternation(c, alts, 2, h) : NULL;
    }
    return base;
}

static const char *visit(struct conv *c, json_t *s, const char *hint, const char *path)
{
    if (c->failed)
        return NULL;
    if (++c->depth > MAX_DEPTH) {
        cerr(c, path, "schema nested deeper than %d", MAX_DEPTH);
        return NULL;
    }
    const char *r = visit_inner(c, s, hint, path);
    c->depth--;
    return c->failed ? NULL : r;
}

int moe_json_schema_to_gbnf(json_t *schema, char **gbnf, char *err, size_t errlen)
{
    *gbnf = NULL;
    if (err && errlen)
        err[0] = '\0';
    struct conv c = {.root = schema, .err = err, .errlen = errlen};
    long root = reserve(&c, "root");
    const char *top = root >= 0 ? visit(&c, schema, "root-value", "") : NULL;
    int rc = -1;
    if (top) {
        c.rules[root].body = strdup(top);
        struct sb out = {0};
        for (size_t i = 0; i < c.n_rules; i++) {
            if (!c.rules[i].body)
                continue;
            sb_addf(&out, "%s ::= ", c.rules[i].name);
            /* an empty body is written "" (after "::=" the rule may continue on the next line) */
            sb_add(&out, c.rules[i].body[0] ? c.rules[i].body : "\"\"");
            sb_add(&out, "\n");
        }
        if (out.oom) {
            free(out.p);
            cerr(&c, "", "out of memory");
        } else {
            *gbnf = out.p;
            rc = 0;
        }
    }
    for (size_t i = 0; i < c.n_rules; i++) {
        free(c.rules[i].name);
        free(c.rules[i].body);
    }
    for (size_t i = 0; i < c.n_refs; i++)
        free(c.refs[i].ptr);
    free(c.rules);
    free(c.refs);
    free(c.names.slot);
    free(c.bodies.slot);
    return rc;
}

const char *moe_json_object_gbnf(void)
{
    return "root ::= object\n"
           "value ::= object | array | string | number | boolean | null\n"
           "object ::= \"{\" space ( string \":\" space value (\",\" space string \":\" space "
           "value)* )? \"}\" space\n"
           "array ::= \"[\" space ( value (\",\" space value)* )? \"]\" space\n"
           "string ::= \"\\\"\" char* \"\\\"\" space\n"
           "char ::= [^\"\\\\\\x7F\\x00-\\x1F] | [\\\\] ([\"\\\\bfnrt/] | \"u\" [0-9a-fA-F]{4})\n"
           "number ::= (\"-\"? integral-part) (\".\" decimal-part)? ([eE] [-+]? integral-part)? "
           "space\n"
           "integral-part ::= [0] | [1-9] [0-9]{0,15}\n"
           "decimal-part ::= [0-9]{1,16}\n"
           "boolean ::= (\"true\" | \"false\") space\n"
           "null ::= \"null\" space\n"
           "space ::= | \" \" | \"\\n\" [ \\t]{0,20}\n";
}
