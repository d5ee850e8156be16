/* GBNF parser, incremental matcher and token mask. See grammar.h and docs/grammar.md.
 *
 * A parsed grammar is a flat array of elements (kind in the top two bits, a value below):
 * each rule is its alternatives one after another, each ended by ALT, the last by END. REF names a
 * rule; CLS a character class (a literal character is a class of one range). Groups and
 * repetitions become generated rules, so every element matches one code point or is a REF.
 *
 * The matcher holds a set of parse stacks. A stack is a node of a pool shared by the state:
 * (element position, parent node), hash-consed so that equal stacks are the same node and a set
 * of stacks deduplicates as a set of integers. The top of every stack in the set is a CLS element;
 * node 0 is the empty stack (the grammar is complete). */
#include "store/grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define K_END 0u
#define K_ALT 1u
#define K_REF 2u
#define K_CLS 3u
#define EL(k, v) (((uint32_t)(k) << 30) | (uint32_t)(v))
#define EL_KIND(e) ((e) >> 30)
#define EL_VAL(e) ((e) & 0x3fffffffu)

struct gclass {
    uint64_t ascii[2]; /* code points 0..127, negation applied */
    uint32_t off, n;   /* sorted, merged ranges (lo, hi pairs) in g->ranges */
    uint8_t neg;
};

struct moe_grammar {
    uint32_t *el;
    uint32_t n_el;
    uint32_t n_rules;
    uint32_t *alt_off; /* rule r's alternatives start at alts[alt_off[r] .. alt_off[r+1]) */
    uint32_t *alts;
    struct gclass *cls;
    uint32_t n_cls;
    uint32_t *ranges;
    uint32_t root;
};

/* ---------------------------------------------------------------- small vectors */

struct u32v {
    uint32_t *p;
    uint32_t n, cap;
};

static int u32v_reserve(struct u32v *v, size_t want)
{
    if (want <= v->cap)
        return 0;
    size_t cap = v->cap ? v->cap : 16;
    while (cap < want)
        cap *= 2;
    if (cap > UINT32_MAX)
        return -1;
    uint32_t *p = realloc(v->p, cap * sizeof *p);
    if (!p)
        return -1;
    v->p = p;
    v->cap = (uint32_t)cap;
    return 0;
}

static int u32v_push(struct u32v *v, uint32_t x)
{
    if (v->n == v->cap && u32v_reserve(v, (size_t)v->n + 1) != 0)
        return -1;
    v->p[v->n++] = x;
    return 0;
}

/* ---------------------------------------------------------------- parser */

struct prule {
    char *name;
    struct u32v el;
    const char *ref_at; /* first reference, for "undefined rule" */
    uint8_t defined, generated;
};

struct parser {
    const char *start, *end;
    struct prule *rules;
    uint32_t n_rules, cap_rules;
    uint32_t *hash; /* open addressing, rule id + 1; named rules only */
    uint32_t hash_cap;
    struct gclass *cls;
    uint32_t n_cls, cap_cls;
    struct u32v ranges;
    size_t total_el;
    int depth;
    uint32_t gen_count;
    char *err;
    size_t errlen;
    int failed;
};

static void perr(struct parser *ps, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void perr(struct parser *ps, const char *at, const char *fmt, ...)
{
    if (ps->failed)
        return;
    ps->failed = 1;
    if (!ps->err || !ps->errlen)
        return;
    size_t off = 0;
    if (at) {
        unsigned line = 1, col = 1;
        for (const char *q = ps->start; q < at && q < ps->end; q++) {
            if (*q == '\n') {
                line++;
                col = 1;
            } else if (((unsigned char)*q & 0xc0) != 0x80) {
                col++;
            }
        }
        int w = snprintf(ps->err, ps->errlen, "line %u, column %u: ", line, col);
        off = w > 0 && (size_t)w < ps->errlen ? (size_t)w : 0;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ps->err + off, ps->errlen - off, fmt, ap);
    va_end(ap);
}

static uint32_t name_hash(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

static int new_rule(struct parser *ps, const char *name, size_t nlen, int generated,
                    const char *at)
{
    if (ps->n_rules >= MOE_GRAMMAR_MAX_RULES) {
        perr(ps, at, "more than %d rules", MOE_GRAMMAR_MAX_RULES);
        return -1;
    }
    if (ps->n_rules == ps->cap_rules) {
        uint32_t cap = ps->cap_rules ? ps->cap_rules * 2 : 32;
        struct prule *r = realloc(ps->rules, cap * sizeof *r);
        if (!r) {
            perr(ps, at, "out of memory");
            return -1;
        }
        ps->rules = r;
        ps->cap_rules = cap;
    }
    struct prule *r = &ps->rules[ps->n_rules];
    memset(r, 0, sizeof *r);
    r->name = malloc(nlen + 1);
    if (!r->name) {
        perr(ps, at, "out of memory");
        return -1;
    }
    memcpy(r->name, name, nlen);
    r->name[nlen] = '\0';
    r->generated = (uint8_t)generated;
    return (int)ps->n_rules++;
}

/* The id of the named rule, created (undefined) on first use. */
static int rule_by_name(struct parser *ps, const char *name, size_t nlen, const char *at)
{
    if (ps->hash_cap < 2 * (ps->n_rules + 1)) {
        uint32_t cap = ps->hash_cap ? ps->hash_cap * 2 : 64;
        while (cap < 2 * (ps->n_rules + 1))
            cap *= 2;
        uint32_t *h = calloc(cap, sizeof *h);
        if (!h) {
            perr(ps, at, "out of memory");
            return -1;
        }
        for (uint32_t i = 0; i < ps->hash_cap; i++) {
            if (!ps->hash[i])
                continue;
            const char *nm = ps->rules[ps->hash[i] - 1].name;
            uint32_t j = name_hash(nm, strlen(nm)) & (cap - 1);
            while (h[j])
                j = (j + 1) & (cap - 1);
            h[j] = ps->hash[i];
        }
        free(ps->hash);
        ps->hash = h;
        ps->hash_cap = cap;
    }
    uint32_t j = name_hash(name, nlen) & (ps->hash_cap - 1);
    while (ps->hash[j]) {
        const char *nm = ps->rules[ps->hash[j] - 1].name;
        if (strlen(nm) == nlen && memcmp(nm, name, nlen) == 0)
            return (int)ps->hash[j] - 1;
        j = (j + 1) & (ps->hash_cap - 1);
    }
    int id = new_rule(ps, name, nlen, 0, at);
    if (id < 0)
        return -1;
    ps->hash[j] = (uint32_t)id + 1;
    return id;
}

static int gen_rule(struct parser *ps, int parent, const char *at)
{
    char nm[300];
    int w = snprintf(nm, sizeof nm, "%.256s~%u", ps->rules[parent].name, ++ps->gen_count);
    return new_rule(ps, nm, (size_t)w, 1, at);
}

static void emit(struct parser *ps, int rule, uint32_t e, const char *at)
{
    if (ps->failed)
        return;
    if (++ps->total_el > MOE_GRAMMAR_MAX_ELEMENTS) {
        perr(ps, at, "grammar too large (more than %u elements)", MOE_GRAMMAR_MAX_ELEMENTS);
        return;
    }
    if (u32v_push(&ps->rules[rule].el, e) != 0)
        perr(ps, at, "out of memory");
}

static int is_word(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '_';
}

static const char *skip_space(struct parser *ps, const char *p, int newline_ok)
{
    while (p < ps->end) {
        char c = *p;
        if (c == ' ' || c == '\t' || (newline_ok && (c == '\r' || c == '\n'))) {
            p++;
        } else if (c == '#') {
            while (p < ps->end && *p != '\n' && *p != '\r')
                p++;
        } else {
            break;
        }
    }
    return p;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Decodes one UTF-8 code point at *pp (advancing), or -1 on malformed input. */
static long utf8_decode(const char **pp, const char *end)
{
    const unsigned char *p = (const unsigned char *)*pp;
    unsigned c = p[0];
    int n;
    uint32_t cp, min;
    if (c < 0x80) {
        *pp += 1;
        return c;
    } else if ((c & 0xe0) == 0xc0) {
        n = 1, cp = c & 0x1f, min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
        n = 2, cp = c & 0x0f, min = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
        n = 3, cp = c & 0x07, min = 0x10000;
    } else {
        return -1;
    }
    if (end - (const char *)p <= n)
        return -1;
    for (int i = 1; i <= n; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return -1;
        cp = (cp << 6) | (p[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return -1;
    *pp += n + 1;
    return (long)cp;
}

/* One character of a literal or class: an escape or a UTF-8 code point. -1 on error. */
static long parse_char(struct parser *ps, const char **pp)
{
    const char *p = *pp;
    if (p >= ps->end) {
        perr(ps, p, "unexpected end of grammar");
        return -1;
    }
    if (*p != '\\') {
        long cp = utf8_decode(pp, ps->end);
        if (cp < 0)
            perr(ps, p, "invalid UTF-8");
        return cp;
    }
    if (p + 1 >= ps->end) {
        perr(ps, p, "unexpected end of grammar after '\\'");
        return -1;
    }
    char c = p[1];
    int digits = 0;
    switch (c) {
    case 'n': *pp = p + 2; return '\n';
    case 't': *pp = p + 2; return '\t';
    case 'r': *pp = p + 2; return '\r';
    case '\\': case '"': case '[': case ']': case '-': case '/': case '^': case '.':
    case '\'': case '(': case ')': case '*': case '+': case '?': case '|': case '{':
    case '}':
        *pp = p + 2;
        return c;
    case 'x': digits = 2; break;
    case 'u': digits = 4; break;
    case 'U': digits = 8; break;
    default:
        perr(ps, p, "unknown escape '\\%c'", c);
        return -1;
    }
    uint32_t v = 0;
    for (int i = 0; i < digits; i++) {
        int h = p + 2 + i < ps->end ? hexval(p[2 + i]) : -1;
        if (h < 0) {
            perr(ps, p, "'\\%c' needs %d hex digits", c, digits);
            return -1;
        }
        v = v * 16 + (uint32_t)h;
    }
    if (v > 0x10ffff) {
        perr(ps, p, "code point U+%X is out of range", v);
        return -1;
    }
    *pp = p + 2 + digits;
    return (long)v;
}

static int cmp_range(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : 0;
}

/* Adds a class from the pairs in ranges[off..] (sorted and merged here). Returns its id. */
static int add_class(struct parser *ps, uint32_t off, int neg, const char *at)
{
    uint32_t n = (ps->ranges.n - off) / 2;
    uint32_t *r = ps->ranges.p + off;
    if (n > 1)
        qsort(r, n, 2 * sizeof *r, cmp_range);
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (m && r[2 * i] <= r[2 * (m - 1) + 1] + 1) {
            if (r[2 * i + 1] > r[2 * (m - 1) + 1])
                r[2 * (m - 1) + 1] = r[2 * i + 1];
        } else {
            r[2 * m] = r[2 * i];
            r[2 * m + 1] = r[2 * i + 1];
            m++;
        }
    }
    ps->ranges.n = off + 2 * m;
    if (ps->n_cls == ps->cap_cls) {
        uint32_t cap = ps->cap_cls ? ps->cap_cls * 2 : 64;
        struct gclass *c = realloc(ps->cls, cap * sizeof *c);
        if (!c) {
            perr(ps, at, "out of memory");
            return -1;
        }
        ps->cls = c;
        ps->cap_cls = cap;
    }
    struct gclass *c = &ps->cls[ps->n_cls];
    memset(c, 0, sizeof *c);
    c->off = off;
    c->n = m;
    c->neg = (uint8_t)neg;
    for (uint32_t cp = 0; cp < 128; cp++) {
        int in = 0;
        for (uint32_t i = 0; i < m && !in; i++)
            in = cp >= r[2 * i] && cp <= r[2 * i + 1];
        if (in != neg)
            c->ascii[cp >> 6] |= 1ull << (cp & 63);
    }
    return (int)ps->n_cls++;
}

static int add_range(struct parser *ps, uint32_t lo, uint32_t hi, const char *at)
{
    if (++ps->total_el > MOE_GRAMMAR_MAX_ELEMENTS) {
        perr(ps, at, "grammar too large (more than %u elements)", MOE_GRAMMAR_MAX_ELEMENTS);
        return -1;
    }
    if (u32v_push(&ps->ranges, lo) != 0 || u32v_push(&ps->ranges, hi) != 0) {
        perr(ps, at, "out of memory");
        return -1;
    }
    return 0;
}

static int single_char_class(struct parser *ps, uint32_t cp, const char *at)
{
    uint32_t off = ps->ranges.n;
    if (add_range(ps, cp, cp, at) != 0)
        return -1;
    return add_class(ps, off, 0, at);
}

static const char *parse_alternates(struct parser *ps, const char *p, int rule, int nested);

static int parse_uint(struct parser *ps, const char **pp, uint32_t *out)
{
    const char *p = *pp;
    uint64_t v = 0;
    if (p >= ps->end || *p < '0' || *p > '9')
        return 0;
    while (p < ps->end && *p >= '0' && *p <= '9') {
        v = v * 10 + (uint64_t)(*p - '0');
        if (v > MOE_GRAMMAR_MAX_REPEAT + 1ull)
            v = MOE_GRAMMAR_MAX_REPEAT + 1ull;
        p++;
    }
    *pp = p;
    *out = (uint32_t)v;
    return 1;
}

/* Replaces rule's elements from `from` with a repetition of them, min..max times (max
 * UINT32_MAX: unbounded). */
static void repeat(struct parser *ps, int rule, uint32_t from, uint32_t min, uint32_t max,
                   const char *at)
{
    struct u32v *el = &ps->rules[rule].el;
    uint32_t item;
    if (el->n - from == 1 && EL_KIND(el->p[from]) != K_ALT) {
        item = el->p[from];
    } else {
        int sub = gen_rule(ps, rule, at);
        if (sub < 0)
            return;
        el = &ps->rules[rule].el;
        for (uint32_t i = from; i < el->n; i++)
            emit(ps, sub, el->p[i], at);
        emit(ps, sub, EL(K_END, 0), at);
        item = EL(K_REF, (uint32_t)sub);
    }
    el = &ps->rules[rule].el;
    ps->total_el -= el->n - from;
    el->n = from;
    for (uint32_t i = 0; i < min && !ps->failed; i++)
        emit(ps, rule, item, at);
    if (max == UINT32_MAX) {
        /* star ::= item star | */
        int star = gen_rule(ps, rule, at);
        if (star < 0)
            return;
        emit(ps, star, item, at);
        emit(ps, star, EL(K_REF, (uint32_t)star), at);
        emit(ps, star, EL(K_ALT, 0), at);
        emit(ps, star, EL(K_END, 0), at);
        emit(ps, rule, EL(K_REF, (uint32_t)star), at);
    } else if (max > min) {
        /* opt1 ::= item | ; optk ::= item opt(k-1) | */
        int prev = -1;
        for (uint32_t k = 0; k < max - min && !ps->failed; k++) {
            int opt = gen_rule(ps, rule, at);
            if (opt < 0)
                return;
            emit(ps, opt, item, at);
            if (prev >= 0)
                emit(ps, opt, EL(K_REF, (uint32_t)prev), at);
            emit(ps, opt, EL(K_ALT, 0), at);
            emit(ps, opt, EL(K_END, 0), at);
            prev = opt;
        }
        emit(ps, rule, EL(K_REF, (uint32_t)prev), at);
    }
}

static const char *parse_sequence(struct parser *ps, const char *p, int rule, int nested)
{
    long last = -1; /* where the last item starts in the rule's elements */
    while (p < ps->end && !ps->failed) {
        const char *at = p;
        char c = *p;
        if (c == '"') {
            last = ps->rules[rule].el.n;
            p++;
            while (!ps->failed && (p >= ps->end || *p != '"')) {
                if (p >= ps->end) {
                    perr(ps, at, "unterminated string literal");
                    break;
                }
                long cp = parse_char(ps, &p);
                if (cp < 0)
                    break;
                int id = single_char_class(ps, (uint32_t)cp, at);
                if (id >= 0)
                    emit(ps, rule, EL(K_CLS, id), at);
            }
            if (ps->failed)
                break;
            p++;
            if (ps->rules[rule].el.n == (uint32_t)last)
                last = -1; /* "" matches nothing: no item to repeat */
        } else if (c == '[') {
            last = ps->rules[rule].el.n;
            p++;
            int neg = 0;
            if (p < ps->end && *p == '^') {
                neg = 1;
                p++;
            }
            uint32_t off = ps->ranges.n;
            while (!ps->failed && (p >= ps->end || *p != ']')) {
                if (p >= ps->end) {
                    perr(ps, at, "unterminated character class");
                    break;
                }
                long lo = parse_char(ps, &p), hi = lo;
                if (lo < 0)
                    break;
                if (p + 1 < ps->end && *p == '-' && p[1] != ']') {
                    const char *rat = p;
                    p++;
                    hi = parse_char(ps, &p);
                    if (hi < 0)
                        break;
                    if (hi < lo) {
                        perr(ps, rat, "character range is reversed");
                        break;
                    }
                }
                add_range(ps, (uint32_t)lo, (uint32_t)hi, at);
            }
            if (ps->failed)
                break;
            p++;
            int id = add_class(ps, off, neg, at);
            if (id >= 0)
                emit(ps, rule, EL(K_CLS, id), at);
        } else if (c == '.') {
            last = ps->rules[rule].el.n;
            p++;
            int id = add_class(ps, ps->ranges.n, 1, at);
            if (id >= 0)
                emit(ps, rule, EL(K_CLS, id), at);
        } else if (is_word(c)) {
            last = ps->rules[rule].el.n;
            const char *s = p;
            while (p < ps->end && is_word(*p))
                p++;
            if (p - s > 256) {
                perr(ps, at, "rule name longer than 256 characters");
                break;
            }
            int id = rule_by_name(ps, s, (size_t)(p - s), at);
            if (id < 0)
                break;
            if (!ps->rules[id].ref_at)
                ps->rules[id].ref_at = at;
            emit(ps, rule, EL(K_REF, id), at);
        } else if (c == '(') {
            last = ps->rules[rule].el.n;
            if (++ps->depth > MOE_GRAMMAR_MAX_NESTING) {
                perr(ps, at, "groups nested deeper than %d", MOE_GRAMMAR_MAX_NESTING);
                break;
            }
            int sub = gen_rule(ps, rule, at);
            if (sub < 0)
                break;
            p = parse_alternates(ps, skip_space(ps, p + 1, 1), sub, 1);
            if (ps->failed)
                break;
            if (p >= ps->end || *p != ')') {
                perr(ps, at, "unclosed '('");
                break;
            }
            p++;
            ps->depth--;
            emit(ps, rule, EL(K_REF, sub), at);
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (last < 0) {
                perr(ps, at, "'%c' must follow an item", c);
                break;
            }
            uint32_t min = 0, max = UINT32_MAX;
            p++;
            if (c == '+') {
                min = 1;
            } else if (c == '?') {
                max = 1;
            } else if (c == '{') {
                p = skip_space(ps, p, 0);
                int has_min = parse_uint(ps, &p, &min);
                p = skip_space(ps, p, 0);
                if (p < ps->end && *p == ',') {
                    p = skip_space(ps, p + 1, 0);
                    if (!parse_uint(ps, &p, &max))
                        max = UINT32_MAX;
                } else if (has_min) {
                    max = min;
                } else {
                    perr(ps, at, "expected a number in '{'");
                    break;
                }
                p = skip_space(ps, p, 0);
                if (p >= ps->end || *p != '}') {
                    perr(ps, at, "expected '}' to end the repetition");
                    break;
                }
                p++;
                if (min > MOE_GRAMMAR_MAX_REPEAT ||
                    (max != UINT32_MAX && max > MOE_GRAMMAR_MAX_REPEAT)) {
                    perr(ps, at, "repetition bound over %d", MOE_GRAMMAR_MAX_REPEAT);
                    break;
                }
                if (max < min) {
                    perr(ps, at, "repetition {%u,%u} has max < min", min, max);
                    break;
                }
            }
            repeat(ps, rule, (uint32_t)last, min, max, at);
            last = -1;
        } else {
            break;
        }
        p = skip_space(ps, p, nested);
    }
    return p;
}

static const char *parse_alternates(struct parser *ps, const char *p, int rule, int nested)
{
    p = parse_sequence(ps, p, rule, nested);
    while (!ps->failed && p < ps->end && *p == '|') {
        emit(ps, rule, EL(K_ALT, 0), p);
        p = parse_sequence(ps, skip_space(ps, p + 1, 1), rule, nested);
    }
    emit(ps, rule, EL(K_END, 0), p);
    return p;
}

static const char *parse_rule(struct parser *ps, const char *p)
{
    const char *at = p, *s = p;
    while (p < ps->end && is_word(*p))
        p++;
    if (p == s) {
        perr(ps, at, "expected a rule name");
        return p;
    }
    if (p - s > 256) {
        perr(ps, at, "rule name longer than 256 characters");
        return p;
    }
    int id = rule_by_name(ps, s, (size_t)(p - s), at);
    if (id < 0)
        return p;
    if (ps->rules[id].defined) {
        perr(ps, at, "rule '%s' is defined twice", ps->rules[id].name);
        return p;
    }
    ps->rules[id].defined = 1;
    p = skip_space(ps, p, 0);
    if (ps->end - p < 3 || memcmp(p, "::=", 3) != 0) {
        perr(ps, p, "expected '::=' after rule name '%s'", ps->rules[id].name);
        return p;
    }
    p = parse_alternates(ps, skip_space(ps, p + 3, 1), id, 0);
    if (ps->failed)
        return p;
    if (p < ps->end) {
        if (*p == '\r')
            p += (p + 1 < ps->end && p[1] == '\n') ? 2 : 1;
        else if (*p == '\n')
            p++;
        else if (*p == ')')
            perr(ps, p, "unbalanced ')'");
        else
            perr(ps, p, "unexpected '%c' (expected an item, '|' or the end of the line)", *p);
    }
    return p;
}

/* Depth-first over "can start with" edges: rule A starts with REF B when every element before
 * it can match the empty string. A cycle is left recursion, which would never consume input. */
static int check_left(struct parser *ps, uint32_t r, uint8_t *color, uint8_t *nullable)
{
    color[r] = 1;
    const struct u32v *el = &ps->rules[r].el;
    int alt_null = 1;
    for (uint32_t i = 0; i < el->n; i++) {
        uint32_t e = el->p[i];
        uint32_t k = EL_KIND(e);
        if (k == K_ALT || k == K_END) {
            if (alt_null)
                nullable[r] = 1;
            alt_null = 1;
            continue;
        }
        if (!alt_null)
            continue;
        if (k == K_CLS) {
            alt_null = 0;
            continue;
        }
        uint32_t x = EL_VAL(e);
        if (color[x] == 1) {
            perr(ps, ps->rules[r].ref_at,
                 "left recursion: rule '%s' can reach itself without consuming input (via '%s')",
                 ps->rules[x].name, ps->rules[r].name);
            return -1;
        }
        if (color[x] == 0 && check_left(ps, x, color, nullable) != 0)
            return -1;
        if (!nullable[x])
            alt_null = 0;
    }
    color[r] = 2;
    return 0;
}

static void parser_free(struct parser *ps)
{
    for (uint32_t i = 0; i < ps->n_rules; i++) {
        free(ps->rules[i].name);
        free(ps->rules[i].el.p);
    }
    free(ps->rules);
    free(ps->hash);
    free(ps->cls);
    free(ps->ranges.p);
}

static struct moe_grammar *build(struct parser *ps, int root)
{
    struct moe_grammar *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->n_rules = ps->n_rules;
    g->root = (uint32_t)root;
    uint32_t *start = calloc(ps->n_rules + 1, sizeof *start);
    g->alt_off = calloc(ps->n_rules + 1, sizeof *g->alt_off);
    size_t n_el = 0, n_alt = 0;
    for (uint32_t r = 0; r < ps->n_rules; r++) {
        n_el += ps->rules[r].el.n;
        for (uint32_t i = 0; i < ps->rules[r].el.n; i++)
            n_alt += EL_KIND(ps->rules[r].el.p[i]) <= K_ALT;
    }
    g->el = malloc((n_el + 1) * sizeof *g->el);
    g->alts = malloc((n_alt + 1) * sizeof *g->alts);
    if (!start || !g->alt_off || !g->el || !g->alts) {
        free(start);
        moe_grammar_free(g);
        return NULL;
    }
    uint32_t o = 0, a = 0;
    for (uint32_t r = 0; r < ps->n_rules; r++) {
        start[r] = o;
        memcpy(g->el + o, ps->rules[r].el.p, ps->rules[r].el.n * sizeof *g->el);
        g->alt_off[r] = a;
        g->alts[a++] = o;
        for (uint32_t i = 0; i + 1 < ps->rules[r].el.n; i++)
            if (EL_KIND(ps->rules[r].el.p[i]) == K_ALT)
                g->alts[a++] = o + i + 1;
        o += ps->rules[r].el.n;
    }
    g->alt_off[ps->n_rules] = a;
    g->n_el = o;
    free(start);
    g->cls = ps->cls;
    g->n_cls = ps->n_cls;
    g->ranges = ps->ranges.p;
    ps->cls = NULL;
    ps->ranges.p = NULL;
    return g;
}

struct moe_grammar *moe_grammar_parse(const char *text, size_t len, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    struct parser ps = {.start = text, .end = text + len, .err = err, .errlen = errlen};
    if (len > MOE_GRAMMAR_MAX_TEXT) {
        perr(&ps, NULL, "grammar longer than %u bytes", MOE_GRAMMAR_MAX_TEXT);
        return NULL;
    }
    if (u32v_reserve(&ps.ranges, 16) != 0) {
        perr(&ps, NULL, "out of memory");
        return NULL;
    }
    const char *p = skip_space(&ps, text, 1);
    while (p < ps.end && !ps.failed)
        p = skip_space(&ps, parse_rule(&ps, p), 1);
    int root = -1;
    if (!ps.failed) {
        for (uint32_t i = 0; i < ps.n_rules; i++) {
            if (!ps.rules[i].generated && !ps.rules[i].defined) {
                perr(&ps, ps.rules[i].ref_at, "undefined rule '%s'", ps.rules[i].name);
                break;
            }
            if (!ps.rules[i].generated && strcmp(ps.rules[i].name, "root") == 0)
                root = (int)i;
        }
        if (!ps.failed && root < 0)
            perr(&ps, NULL, "the grammar has no 'root' rule");
    }
    if (!ps.failed) {
        uint8_t *color = calloc(ps.n_rules, 1), *nullable = calloc(ps.n_rules, 1);
        if (!color || !nullable)
            perr(&ps, NULL, "out of memory");
        for (uint32_t r = 0; r < ps.n_rules && !ps.failed; r++)
            if (!color[r])
                check_left(&ps, r, color, nullable);
        free(color);
        free(nullable);
    }
    struct moe_grammar *g = NULL;
    if (!ps.failed) {
        g = build(&ps, root);
        if (!g)
            perr(&ps, NULL, "out of memory");
    }
    parser_free(&ps);
    return g;
}

void moe_grammar_free(struct moe_grammar *g)
{
    if (!g)
        return;
    free(g->el);
    free(g->alt_off);
    free(g->alts);
    free(g->cls);
    free(g->ranges);
    free(g);
}

uint32_t moe_grammar_n_rules(const struct moe_grammar *g) { return g->n_rules; }
uint32_t moe_grammar_n_elements(const struct moe_grammar *g) { return g->n_el; }

/* ---------------------------------------------------------------- matcher */

struct gnode {
    uint32_t pos, parent, next, depth;
};

struct utf8p {
    uint32_t val; /* bits so far */
    uint8_t rem;  /* continuation bytes still to come */
    uint8_t len;  /* bytes of the whole sequence */
};

struct mask_cache;
static void mask_cache_free(struct mask_cache *c);

struct moe_grammar_state {
    const struct moe_grammar *g;
    struct gnode *nodes;
    uint32_t *mark;
    uint32_t n_nodes, cap_nodes;
    uint32_t *bucket;
    uint32_t n_bucket; /* power of two */
    uint32_t gen;
    struct u32v set; /* current stacks */
    struct utf8p part;
    struct u32v work, tmp, tmp2, arena;
    struct mask_cache *cache; /* the mask's step cache, kept between masks for its memory */
    uint32_t cache_nodes;     /* nodes the cache may keep during one mask (0: no cache) */
    uint32_t live; /* nodes after the last collection */
    uint32_t out_limit; /* a step may not append past this */
    int limit;     /* set by a step that hit a limit */
    char err[160];
};

static inline uint32_t node_hash(uint32_t pos, uint32_t parent)
{
    return (pos * 0x9e3779b1u) ^ (parent * 0x85ebca77u) ^ (parent >> 15);
}

static void st_limit(struct moe_grammar_state *st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void st_limit(struct moe_grammar_state *st, const char *fmt, ...)
{
    st->limit = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->err, sizeof st->err, fmt, ap);
    va_end(ap);
}

/* Rebuilds the hash chains in creation order, so that the newest node heads its chain (rollback
 * relies on it). */
static void rechain(struct moe_grammar_state *st)
{
    memset(st->bucket, 0, st->n_bucket * sizeof *st->bucket);
    for (uint32_t i = 1; i < st->n_nodes; i++) {
        uint32_t h = node_hash(st->nodes[i].pos, st->nodes[i].parent) & (st->n_bucket - 1);
        st->nodes[i].next = st->bucket[h];
        st->bucket[h] = i;
    }
}

static int rehash(struct moe_grammar_state *st, uint32_t n_bucket)
{
    uint32_t *b = calloc(n_bucket, sizeof *b);
    if (!b)
        return -1;
    free(st->bucket);
    st->bucket = b;
    st->n_bucket = n_bucket;
    rechain(st);
    return 0;
}

/* The stack (pos, parent), UINT32_MAX on a limit. */
static uint32_t mk(struct moe_grammar_state *st, uint32_t pos, uint32_t parent)
{
    uint32_t h = node_hash(pos, parent) & (st->n_bucket - 1);
    for (uint32_t i = st->bucket[h]; i; i = st->nodes[i].next)
        if (st->nodes[i].pos == pos && st->nodes[i].parent == parent)
            return i;
    uint32_t depth = st->nodes[parent].depth + 1;
    if (depth > MOE_GRAMMAR_MAX_DEPTH) {
        st_limit(st, "grammar nesting deeper than %d", MOE_GRAMMAR_MAX_DEPTH);
        return UINT32_MAX;
    }
    if (st->n_nodes == st->cap_nodes) {
        if (st->cap_nodes >= MOE_GRAMMAR_MAX_NODES) {
            st_limit(st, "more than %u grammar stack nodes", MOE_GRAMMAR_MAX_NODES);
            return UINT32_MAX;
        }
        uint32_t cap = st->cap_nodes * 2;
        struct gnode *n = realloc(st->nodes, cap * sizeof *n);
        if (!n) {
            st_limit(st, "out of memory");
            return UINT32_MAX;
        }
        st->nodes = n;
        uint32_t *m = realloc(st->mark, cap * sizeof *m);
        if (!m) {
            st_limit(st, "out of memory");
            return UINT32_MAX;
        }
        memset(m + st->cap_nodes, 0, (cap - st->cap_nodes) * sizeof *m);
        st->mark = m;
        st->cap_nodes = cap;
    }
    uint32_t id = st->n_nodes++;
    st->nodes[id] = (struct gnode){pos, parent, st->bucket[h], depth};
    st->bucket[h] = id;
    st->mark[id] = 0;
    if (st->n_nodes > st->n_bucket && st->n_bucket < (1u << 30)) {
        if (rehash(st, st->n_bucket * 2) != 0) {
            st_limit(st, "out of memory");
            return UINT32_MAX;
        }
    }
    return id;
}

/* Forgets the nodes made since n (they head their chains, newest first). */
static void rollback(struct moe_grammar_state *st, uint32_t n)
{
    while (st->n_nodes > n) {
        uint32_t id = --st->n_nodes;
        uint32_t h = node_hash(st->nodes[id].pos, st->nodes[id].parent) & (st->n_bucket - 1);
        st->bucket[h] = st->nodes[id].next;
    }
}

static void next_gen(struct moe_grammar_state *st)
{
    if (++st->gen == 0) {
        memset(st->mark, 0, st->cap_nodes * sizeof *st->mark);
        st->gen = 1;
    }
}

/* Adds to out the leaf stacks (CLS on top, or the empty stack) that stack s stands for, each once
 * per generation. -1 on a limit. */
static int expand(struct moe_grammar_state *st, uint32_t s, struct u32v *out)
{
    const struct moe_grammar *g = st->g;
    st->work.n = 0;
    if (u32v_push(&st->work, s) != 0)
        goto oom;
    while (st->work.n) {
        s = st->work.p[--st->work.n];
        for (;;) {
            if (st->mark[s] == st->gen)
                break;
            st->mark[s] = st->gen;
            if (s == 0) {
                if (u32v_push(out, 0) != 0)
                    goto oom;
                break;
            }
            uint32_t pos = st->nodes[s].pos, e = g->el[pos];
            uint32_t k = EL_KIND(e);
            if (k <= K_ALT) {
                s = st->nodes[s].parent;
                continue;
            }
            if (k == K_CLS) {
                if (out->n >= st->out_limit) {
                    st_limit(st, "more than %d parse stacks at once (grammar too ambiguous)",
                             MOE_GRAMMAR_MAX_STACKS);
                    return -1;
                }
                if (u32v_push(out, s) != 0)
                    goto oom;
                break;
            }
            uint32_t r = EL_VAL(e), parent = st->nodes[s].parent;
            uint32_t cont = parent;
            if (EL_KIND(g->el[pos + 1]) > K_ALT) {
                cont = mk(st, pos + 1, parent);
                if (cont == UINT32_MAX)
                    return -1;
            }
            for (uint32_t a = g->alt_off[r]; a < g->alt_off[r + 1]; a++) {
                uint32_t at = g->alts[a], x = cont;
                if (EL_KIND(g->el[at]) > K_ALT) {
                    x = mk(st, at, cont);
                    if (x == UINT32_MAX)
                        return -1;
                }
                if (u32v_push(&st->work, x) != 0)
                    goto oom;
            }
            break;
        }
    }
    return 0;
oom:
    st_limit(st, "out of memory");
    return -1;
}

static inline int cls_match(const struct moe_grammar *g, const struct gclass *c, uint32_t cp)
{
    if (cp < 128)
        return (int)((c->ascii[cp >> 6] >> (cp & 63)) & 1);
    const uint32_t *r = g->ranges + c->off;
    int in = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        if (cp < r[2 * i])
            break;
        if (cp <= r[2 * i + 1]) {
            in = 1;
            break;
        }
    }
    return in != c->neg;
}

/* Whether the class matches some code point in [lo, hi]. */
static int cls_match_range(const struct moe_grammar *g, const struct gclass *c, uint32_t lo,
                           uint32_t hi)
{
    const uint32_t *r = g->ranges + c->off;
    if (!c->neg) {
        for (uint32_t i = 0; i < c->n; i++)
            if (r[2 * i] <= hi && r[2 * i + 1] >= lo)
                return 1;
        return 0;
    }
    uint64_t cur = lo;
    for (uint32_t i = 0; i < c->n && cur <= hi; i++)
        if (r[2 * i] <= cur && r[2 * i + 1] >= cur)
            cur = (uint64_t)r[2 * i + 1] + 1;
    return cur <= hi;
}

/* Feeds byte b to the UTF-8 decoder *p (changed only when the byte is taken). -1: not UTF-8
 * (overlong, a surrogate, past U+10FFFF, a stray or missing continuation byte), whatever follows;
 * 1: the code point *cp is complete; 0: inside a code point whose completions are the valid ones
 * in [lo[0], hi[0]] and [lo[1], hi[1]] (the second empty when lo > hi; the first never). */
static int utf8_feed(struct utf8p *part, uint8_t b, uint32_t *cp, uint32_t lo[2], uint32_t hi[2])
{
    struct utf8p p = *part;
    if (p.rem == 0) {
        if (b < 0x80) {
            *cp = b;
            return 1;
        } else if ((b & 0xe0) == 0xc0 && b >= 0xc2) {
            p = (struct utf8p){b & 0x1fu, 1, 2};
        } else if ((b & 0xf0) == 0xe0) {
            p = (struct utf8p){b & 0x0fu, 2, 3};
        } else if ((b & 0xf8) == 0xf0 && b <= 0xf4) {
            p = (struct utf8p){b & 0x07u, 3, 4};
        } else {
            return -1;
        }
    } else {
        if ((b & 0xc0) != 0x80)
            return -1;
        p.val = (p.val << 6) | (b & 0x3fu);
        p.rem--;
        if (p.rem == 0) {
            uint32_t c = p.val;
            if ((p.len == 3 && (c < 0x800 || (c >= 0xd800 && c <= 0xdfff))) ||
                (p.len == 4 && (c < 0x10000 || c > 0x10ffff)))
                return -1;
            *part = (struct utf8p){0, 0, 0};
            *cp = c;
            return 1;
        }
    }
    uint32_t sh = 6u * p.rem;
    uint32_t l = p.val << sh, h = l | ((1u << sh) - 1);
    uint32_t min = p.len == 2 ? 0x80 : p.len == 3 ? 0x800 : 0x10000;
    if (l < min)
        l = min;
    if (h > 0x10ffff)
        h = 0x10ffff;
    lo[1] = 1, hi[1] = 0;
    /* surrogates are not characters: [l, h] less D800..DFFF is one or two ranges */
    if (l <= 0xdfff && h >= 0xd800) {
        if (h > 0xdfff)
            lo[1] = 0xe000, hi[1] = h;
        if (l < 0xd800)
            h = 0xd7ff;
        else if (lo[1] <= hi[1])
            l = lo[1], h = hi[1], lo[1] = 1, hi[1] = 0;
        else
            return -1;
    }
    if (l > h)
        return -1;
    lo[0] = l, hi[0] = h;
    *part = p;
    return 0;
}

/* One byte: the stacks in[0..n) with UTF-8 state *part become out (appended). Returns the number
 * of stacks appended (0: the byte is rejected), or -1 on a limit. */
static long step(struct moe_grammar_state *st, const uint32_t *in, uint32_t n,
                 struct utf8p *part, uint8_t b, struct u32v *out)
{
    const struct moe_grammar *g = st->g;
    uint32_t cp, lo[2], hi[2];
    struct utf8p p = *part;
    int k = utf8_feed(&p, b, &cp, lo, hi);
    if (k < 0)
        return 0;
    if (k == 0) {
        /* inside a code point: keep the stacks that some completion could match */
        uint32_t n0 = out->n;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t s = in[i];
            const struct gclass *cl = s ? &g->cls[EL_VAL(g->el[st->nodes[s].pos])] : NULL;
            if (cl && (cls_match_range(g, cl, lo[0], hi[0]) ||
                       (lo[1] <= hi[1] && cls_match_range(g, cl, lo[1], hi[1]))))
                if (u32v_push(out, s) != 0) {
                    st_limit(st, "out of memory");
                    return -1;
                }
        }
        if (out->n > n0)
            *part = p;
        return out->n - n0;
    }
    next_gen(st);
    uint32_t n0 = out->n;
    st->out_limit = n0 + MOE_GRAMMAR_MAX_STACKS;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = in[i];
        if (!s)
            continue;
        uint32_t pos = st->nodes[s].pos;
        if (!cls_match(g, &g->cls[EL_VAL(g->el[pos])], cp))
            continue;
        uint32_t nx = st->nodes[s].parent;
        if (EL_KIND(g->el[pos + 1]) > K_ALT) {
            nx = mk(st, pos + 1, nx);
            if (nx == UINT32_MAX)
                return -1;
        }
        if (expand(st, nx, out) != 0)
            return -1;
    }
    *part = p;
    return out->n - n0;
}

struct moe_grammar_state *moe_grammar_state_new(const struct moe_grammar *g, char *err,
                                                size_t errlen)
{
    struct moe_grammar_state *st = calloc(1, sizeof *st);
    if (!st)
        goto oom;
    st->g = g;
    st->cap_nodes = 1024;
    st->nodes = malloc(st->cap_nodes * sizeof *st->nodes);
    st->mark = calloc(st->cap_nodes, sizeof *st->mark);
    if (!st->nodes || !st->mark)
        goto oom;
    st->nodes[0] = (struct gnode){0, 0, 0, 0};
    st->n_nodes = 1;
    if (rehash(st, 1024) != 0)
        goto oom;
    st->gen = 1;
    st->out_limit = MOE_GRAMMAR_MAX_STACKS;
    st->cache_nodes = MOE_GRAMMAR_MASK_CACHE_NODES;
    for (uint32_t a = g->alt_off[g->root]; a < g->alt_off[g->root + 1]; a++) {
        uint32_t at = g->alts[a], x = 0;
        if (EL_KIND(g->el[at]) > K_ALT)
            x = mk(st, at, 0);
        if (x == UINT32_MAX || expand(st, x, &st->set) != 0) {
            if (err && errlen)
                snprintf(err, errlen, "%s", st->err);
            moe_grammar_state_free(st);
            return NULL;
        }
    }
    st->live = st->n_nodes;
    return st;
oom:
    if (err && errlen)
        snprintf(err, errlen, "out of memory");
    moe_grammar_state_free(st);
    return NULL;
}

void moe_grammar_state_free(struct moe_grammar_state *st)
{
    if (!st)
        return;
    free(st->nodes);
    free(st->mark);
    free(st->bucket);
    free(st->set.p);
    free(st->work.p);
    free(st->tmp.p);
    free(st->tmp2.p);
    free(st->arena.p);
    mask_cache_free(st->cache);
    free(st);
}

struct moe_grammar_state *moe_grammar_state_clone(const struct moe_grammar_state *src)
{
    struct moe_grammar_state *st = calloc(1, sizeof *st);
    if (!st)
        return NULL;
    st->g = src->g;
    st->n_nodes = src->n_nodes;
    st->cap_nodes = src->cap_nodes;
    st->nodes = malloc(st->cap_nodes * sizeof *st->nodes);
    st->mark = calloc(st->cap_nodes, sizeof *st->mark);
    st->bucket = malloc(src->n_bucket * sizeof *st->bucket);
    st->n_bucket = src->n_bucket;
    if (!st->nodes || !st->mark || !st->bucket || u32v_reserve(&st->set, src->set.n + 1) != 0) {
        moe_grammar_state_free(st);
        return NULL;
    }
    memcpy(st->nodes, src->nodes, st->n_nodes * sizeof *st->nodes);
    memcpy(st->bucket, src->bucket, st->n_bucket * sizeof *st->bucket);
    memcpy(st->set.p, src->set.p, src->set.n * sizeof *st->set.p);
    st->set.n = src->set.n;
    st->part = src->part;
    st->gen = 1;
    st->live = src->live;
    st->cache_nodes = src->cache_nodes;
    memcpy(st->err, src->err, sizeof st->err);
    return st;
}

/* Drops the nodes no current stack uses, renumbering the rest (parents keep smaller ids). */
static void collect(struct moe_grammar_state *st)
{
    uint32_t *map = st->mark; /* reused: 0 dead, else new id + 1 */
    memset(map, 0, st->n_nodes * sizeof *map);
    map[0] = 1;
    for (uint32_t i = 0; i < st->set.n; i++)
        for (uint32_t s = st->set.p[i]; s && !map[s]; s = st->nodes[s].parent)
            map[s] = 1;
    uint32_t n = 1;
    for (uint32_t i = 1; i < st->n_nodes; i++) {
        if (!map[i])
            continue;
        struct gnode nd = st->nodes[i];
        nd.parent = map[nd.parent] - 1;
        st->nodes[n] = nd;
        map[i] = ++n;
    }
    for (uint32_t i = 0; i < st->set.n; i++)
        st->set.p[i] = map[st->set.p[i]] - 1;
    st->n_nodes = n;
    memset(st->mark, 0, st->cap_nodes * sizeof *st->mark);
    st->gen = 1;
    uint32_t nb = 1024;
    while (nb < n)
        nb *= 2;
    if (nb >= st->n_bucket || rehash(st, nb) != 0)
        rechain(st); /* the table keeps its size (no memory needed) */
    st->live = n;
}

int moe_grammar_state_accept_bytes(struct moe_grammar_state *st, const void *bytes, size_t n)
{
    const uint8_t *b = bytes;
    struct utf8p part = st->part;
    /* The state's set is only read until every byte is accepted; the steps alternate between
     * two scratch vectors. */
    const uint32_t *in = st->set.p;
    uint32_t n_in = st->set.n;
    struct u32v *buf[2] = {&st->tmp, &st->tmp2};
    int w = 0;
    st->limit = 0;
    for (size_t i = 0; i < n; i++) {
        struct u32v *out = buf[w];
        out->n = 0;
        long r = step(st, in, n_in, &part, b[i], out);
        if (r <= 0)
            return r < 0 ? -1 : 0;
        in = out->p;
        n_in = out->n;
        w ^= 1;
    }
    if (n) {
        struct u32v t = st->set;
        st->set = *buf[w ^ 1];
        *buf[w ^ 1] = t;
    }
    st->part = part;
    if (st->n_nodes > 2 * st->live + 65536)
        collect(st);
    return 1;
}

bool moe_grammar_state_is_accepting(const struct moe_grammar_state *st)
{
    if (st->part.rem)
        return false;
    for (uint32_t i = 0; i < st->set.n; i++)
        if (st->set.p[i] == 0)
            return true;
    return false;
}

bool moe_grammar_state_can_continue(const struct moe_grammar_state *st)
{
    for (uint32_t i = 0; i < st->set.n; i++)
        if (st->set.p[i] != 0)
            return true;
    return false;
}

size_t moe_grammar_state_n_stacks(const struct moe_grammar_state *st) { return st->set.n; }

void moe_grammar_state_set_mask_cache(struct moe_grammar_state *st, uint32_t max_nodes)
{
    st->cache_nodes = max_nodes;
}
const char *moe_grammar_state_error(const struct moe_grammar_state *st) { return st->err; }

/* ---------------------------------------------------------------- vocabulary and mask */

struct tnode {
    uint32_t first_child;
    uint32_t lo, hi;   /* the subtree's tokens are ord[lo .. hi), those ending here first */
    uint32_t n_tok;    /* tokens ending here */
    uint64_t below[2]; /* ASCII bytes on the edges below this node */
    uint16_t n_child;
    uint8_t byte;
    uint8_t non_ascii_below;
    uint8_t bad_utf8_below; /* some token below is not UTF-8 (decoded from its first byte) */
};

struct moe_grammar_vocab {
    uint32_t n;
    struct tnode *nodes;
    uint32_t n_nodes;
    uint32_t *ord; /* token ids sorted by their bytes (eog and empty tokens left out) */
    uint32_t *eog;
    uint32_t n_eog;
};

struct sort_ctx {
    const char *const *t;
    const uint32_t *len;
};

static int cmp_tok(const void *a, const void *b, void *arg)
{
    const struct sort_ctx *c = arg;
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    uint32_t lx = c->len[x], ly = c->len[y];
    int r = memcmp(c->t[x], c->t[y], lx < ly ? lx : ly);
    if (r)
        return r;
    return lx < ly ? -1 : lx > ly ? 1 : (x < y ? -1 : x > y);
}

struct moe_grammar_vocab *moe_grammar_vocab_new(const char *const *tokens, const uint32_t *lens,
                                                uint32_t n, const uint8_t *eog, char *err,
                                                size_t errlen)
{
    struct moe_grammar_vocab *v = calloc(1, sizeof *v);
    uint32_t *ord = malloc((size_t)(n ? n : 1) * sizeof *ord);
    uint32_t *lo = NULL, *hi = NULL, *dep = NULL;
    uint32_t cap = 1024;
    if (!v || !ord)
        goto oom;
    v->n = n;
    v->eog = malloc((size_t)(n ? n : 1) * sizeof *v->eog);
    if (!v->eog)
        goto oom;
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (lens[i] > MOE_GRAMMAR_MAX_TOKEN) {
            if (err && errlen)
                snprintf(err, errlen, "token %u has %u bytes (more than %d)", i, lens[i],
                         MOE_GRAMMAR_MAX_TOKEN);
            goto fail;
        }
        if (eog && eog[i])
            v->eog[v->n_eog++] = i;
        else if (lens[i] > 0)
            ord[m++] = i;
    }
    struct sort_ctx sc = {tokens, lens};
    qsort_r(ord, m, sizeof *ord, cmp_tok, &sc);
    /* Breadth first: node i covers ord[lo[i] .. hi[i]), whose first dep[i] bytes it spells. */
    v->nodes = malloc(cap * sizeof *v->nodes);
    lo = malloc(cap * sizeof *lo);
    hi = malloc(cap * sizeof *hi);
    dep = malloc(cap * sizeof *dep);
    if (!v->nodes || !lo || !hi || !dep)
        goto oom;
    v->nodes[0] = (struct tnode){0};
    lo[0] = 0, hi[0] = m, dep[0] = 0;
    v->n_nodes = 1;
    for (uint32_t i = 0; i < v->n_nodes; i++) {
        uint32_t l = lo[i], h = hi[i], d = dep[i];
        v->nodes[i].lo = l;
        v->nodes[i].hi = h;
        while (l < h && lens[ord[l]] == d)
            l++;
        v->nodes[i].n_tok = l - lo[i];
        v->nodes[i].first_child = v->n_nodes;
        while (l < h) {
            uint8_t b = (uint8_t)tokens[ord[l]][d];
            uint32_t e = l + 1;
            while (e < h && (uint8_t)tokens[ord[e]][d] == b)
                e++;
            if (v->n_nodes == cap) {
                cap *= 2;
                struct tnode *nn = realloc(v->nodes, cap * sizeof *nn);
                if (!nn)
                    goto oom;
                v->nodes = nn;
                uint32_t **arrs[3] = {&lo, &hi, &dep};
                for (int k = 0; k < 3; k++) {
                    uint32_t *x = realloc(*arrs[k], cap * sizeof *x);
                    if (!x)
                        goto oom;
                    *arrs[k] = x;
                }
            }
            uint32_t c = v->n_nodes++;
            v->nodes[c] = (struct tnode){0};
            v->nodes[c].byte = b;
            lo[c] = l, hi[c] = e, dep[c] = d + 1;
            v->nodes[i].n_child++;
            l = e;
        }
    }
    /* children come after their parent: decode the prefixes top down (bad: not UTF-8), then fold
     * the byte sets and the bad flags bottom up */
    struct utf8p *dec = malloc(v->n_nodes * sizeof *dec);
    uint8_t *bad = calloc(v->n_nodes, 1);
    if (!dec || !bad) {
        free(dec);
        free(bad);
        goto oom;
    }
    dec[0] = (struct utf8p){0, 0, 0};
    for (uint32_t i = 0; i < v->n_nodes; i++) {
        const struct tnode *nd = &v->nodes[i];
        for (uint32_t c = nd->first_child; c < nd->first_child + nd->n_child; c++) {
            uint32_t cp, l[2], h[2];
            dec[c] = dec[i];
            bad[c] = bad[i] || utf8_feed(&dec[c], v->nodes[c].byte, &cp, l, h) < 0;
        }
    }
    for (uint32_t i = v->n_nodes; i-- > 0;) {
        struct tnode *nd = &v->nodes[i];
        for (uint32_t c = nd->first_child; c < nd->first_child + nd->n_child; c++) {
            const struct tnode *ch = &v->nodes[c];
            nd->bad_utf8_below |= ch->bad_utf8_below | bad[c];
            nd->below[0] |= ch->below[0];
            nd->below[1] |= ch->below[1];
            nd->non_ascii_below |= ch->non_ascii_below | (ch->byte >= 0x80);
            if (ch->byte < 0x80)
                nd->below[ch->byte >> 6] |= 1ull << (ch->byte & 63);
        }
    }
    free(dec);
    free(bad);
    v->ord = ord;
    free(lo);
    free(hi);
    free(dep);
    return v;
oom:
    if (err && errlen)
        snprintf(err, errlen, "out of memory");
fail:
    free(ord);
    free(lo);
    free(hi);
    free(dep);
    moe_grammar_vocab_free(v);
    return NULL;
}

void moe_grammar_vocab_free(struct moe_grammar_vocab *v)
{
    if (!v)
        return;
    free(v->nodes);
    free(v->ord);
    free(v->eog);
    free(v);
}

uint32_t moe_grammar_vocab_n(const struct moe_grammar_vocab *v) { return v->n; }
uint32_t moe_grammar_vocab_n_nodes(const struct moe_grammar_vocab *v) { return v->n_nodes; }

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static void sort_u32(uint32_t *p, uint32_t n)
{
    if (n > 16) {
        qsort(p, n, sizeof *p, cmp_u32);
        return;
    }
    for (uint32_t i = 1; i < n; i++) {
        uint32_t x = p[i], j = i;
        for (; j > 0 && p[j - 1] > x; j--)
            p[j] = p[j - 1];
        p[j] = x;
    }
}

/* What the mask walk knows about the state's own set S0 (at a code point boundary): the ASCII
 * bytes that lead from S0 back to S0, and whether every non-ASCII character does (a loop such as
 * the inside of a string). Then the walk needs no steps along such bytes, only UTF-8 decoding,
 * and a trie node reached with S0 whose subtree holds only such bytes (and valid UTF-8) has all
 * its tokens allowed without being walked. */
/* The step cache of one mask: stack sets interned by content (set i at store[rec[i].off ..]),
 * and transitions (set, UTF-8 state, byte) -> (set or -1, UTF-8 state). While it is on, the nodes
 * its sets use are kept; past st->cache_nodes new nodes it is turned off for the rest of the
 * mask and the walk rolls back the nodes of each edge again. */

struct setrec {
    uint32_t off, n, hash;
};

struct trans {
    uint32_t set, part, part_out;
    int32_t res; /* -1: rejected */
    uint32_t used; /* == the cache's generation */
    uint8_t byte;
};

struct mask_cache {
    struct u32v store;
    struct setrec *rec;
    uint32_t n_rec, cap_rec;
    uint32_t *intern; /* pairs: rec index + 1, generation */
    uint32_t cap_intern;
    uint32_t gen; /* entries of other generations are empty (no clearing between masks) */
    struct trans *tr;
    uint32_t n_tr, cap_tr;
};

static void mask_cache_free(struct mask_cache *c)
{
    if (!c)
        return;
    free(c->store.p);
    free(c->rec);
    free(c->intern);
    free(c->tr);
    free(c);
}

static uint32_t set_hash(const uint32_t *p, uint32_t n)
{
    uint32_t h = 2166136261u ^ n;
    for (uint32_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 16777619u;
    return h ? h : 1;
}

static uint32_t part_pack(struct utf8p p) { return p.val | (uint32_t)p.rem << 21 | (uint32_t)p.len << 24; }

static struct utf8p part_unpack(uint32_t x)
{
    return (struct utf8p){x & 0x1fffffu, (uint8_t)((x >> 21) & 7), (uint8_t)(x >> 24)};
}

static uint32_t trans_hash(uint32_t set, uint32_t part, uint8_t b)
{
    return (set * 0x9e3779b1u) ^ (part * 0x85ebca77u) ^ ((uint32_t)b * 0xc2b2ae3du);
}

/* The index of the (sorted) set p[0..n), added when new; -1 out of memory. */
static long intern_set(struct mask_cache *c, const uint32_t *p, uint32_t n)
{
    uint32_t h = set_hash(p, n);
    if (2 * (c->n_rec + 1) > c->cap_intern) {
        uint32_t cap = c->cap_intern ? c->cap_intern * 2 : 1024;
        uint32_t *t = calloc(2 * (size_t)cap, sizeof *t);
        if (!t)
            return -1;
        for (uint32_t i = 0; i < c->n_rec; i++) {
            uint32_t j = c->rec[i].hash & (cap - 1);
            while (t[2 * j + 1] == c->gen)
                j = (j + 1) & (cap - 1);
            t[2 * j] = i + 1;
            t[2 * j + 1] = c->gen;
        }
        free(c->intern);
        c->intern = t;
        c->cap_intern = cap;
    }
    uint32_t j = h & (c->cap_intern - 1);
    for (; c->intern[2 * j + 1] == c->gen; j = (j + 1) & (c->cap_intern - 1)) {
        const struct setrec *r = &c->rec[c->intern[2 * j] - 1];
        if (r->hash == h && r->n == n && memcmp(c->store.p + r->off, p, n * sizeof *p) == 0)
            return (long)c->intern[2 * j] - 1;
    }
    if (c->n_rec == c->cap_rec) {
        uint32_t cap = c->cap_rec ? c->cap_rec * 2 : 1024;
        struct setrec *r = realloc(c->rec, cap * sizeof *r);
        if (!r)
            return -1;
        c->rec = r;
        c->cap_rec = cap;
    }
    if (u32v_reserve(&c->store, (size_t)c->store.n + n + 1) != 0)
        return -1;
    c->rec[c->n_rec] = (struct setrec){c->store.n, n, h};
    memcpy(c->store.p + c->store.n, p, n * sizeof *p);
    c->store.n += n;
    c->intern[2 * j] = c->n_rec + 1;
    c->intern[2 * j + 1] = c->gen;
    return (long)c->n_rec++;
}

static struct trans *trans_find(struct mask_cache *c, uint32_t set, uint32_t part, uint8_t b)
{
    if (!c->cap_tr)
        return NULL;
    for (uint32_t j = trans_hash(set, part, b) & (c->cap_tr - 1); c->tr[j].used == c->gen;
         j = (j + 1) & (c->cap_tr - 1))
        if (c->tr[j].set == set && c->tr[j].part == part && c->tr[j].byte == b)
            return &c->tr[j];
    return NULL;
}

static int trans_put(struct mask_cache *c, struct trans t)
{
    if (2 * (c->n_tr + 1) > c->cap_tr) {
        uint32_t cap = c->cap_tr ? c->cap_tr * 2 : 4096;
        struct trans *n = calloc(cap, sizeof *n);
        if (!n)
            return -1;
        for (uint32_t i = 0; i < c->cap_tr; i++) {
            if (c->tr[i].used != c->gen)
                continue;
            uint32_t j = trans_hash(c->tr[i].set, c->tr[i].part, c->tr[i].byte) & (cap - 1);
            while (n[j].used == c->gen)
                j = (j + 1) & (cap - 1);
            n[j] = c->tr[i];
        }
        free(c->tr);
        c->tr = n;
        c->cap_tr = cap;
    }
    uint32_t j = trans_hash(t.set, t.part, t.byte) & (c->cap_tr - 1);
    while (c->tr[j].used == c->gen)
        j = (j + 1) & (c->cap_tr - 1);
    t.used = c->gen;
    c->tr[j] = t;
    c->n_tr++;
    return 0;
}

static void mask_cache_reset(struct mask_cache *c)
{
    c->store.n = 0;
    c->n_rec = 0;
    c->n_tr = 0;
    if (++c->gen == 0) { /* wrapped: clear once */
        if (c->intern)
            memset(c->intern, 0, 2 * (size_t)c->cap_intern * sizeof *c->intern);
        if (c->tr)
            memset(c->tr, 0, c->cap_tr * sizeof *c->tr);
        c->gen = 1;
    }
}

/* What the mask walk knows about the state's own set S0 (at a code point boundary): the ASCII
 * bytes that lead from S0 back to S0, and whether every non-ASCII character does (a loop such as
 * the inside of a string). Then the walk needs no steps along such bytes, only UTF-8 decoding,
 * and a trie node reached with S0 whose subtree holds only such bytes (and valid UTF-8) has all
 * its tokens allowed without being walked. */
struct mask_ctx {
    const struct moe_grammar_vocab *v;
    uint8_t *mask;
    const uint32_t *s0; /* sorted */
    uint32_t n0;
    uint64_t loop[2];
    int loop_na;
    uint64_t work; /* stacks stepped so far */
    struct mask_cache *c;
    int cache_on;
    uint32_t node_limit; /* the cache turns off past this many nodes */
};

enum { W_SET, W_S0, W_S0_INSIDE }; /* a cached set; S0; S0 inside a code point */

/* The children of trie node t, reached with cached set `set` and UTF-8 state part, or with S0
 * (mode W_S0, W_S0_INSIDE; set is S0's index then). */
static long walk(struct moe_grammar_state *st, struct mask_ctx *mc, uint32_t t, uint32_t set,
                 struct utf8p part, int mode)
{
    const struct moe_grammar_vocab *v = mc->v;
    struct mask_cache *cc = mc->c;
    long allowed = 0;
    const struct tnode *nd = &v->nodes[t];
    for (uint32_t c = nd->first_child; c < nd->first_child + nd->n_child; c++) {
        const struct tnode *ch = &v->nodes[c];
        uint32_t mark = st->n_nodes, top = st->arena.n;
        struct utf8p p = part;
        uint32_t nset = set, cp, lo[2], hi[2];
        uint8_t b = ch->byte;
        int next;
        if (mode == W_S0_INSIDE) {
            int k = utf8_feed(&p, b, &cp, lo, hi);
            if (k < 0)
                continue;
            next = k ? W_S0 : W_S0_INSIDE;
        } else if (mode == W_S0 && b < 0x80 && ((mc->loop[b >> 6] >> (b & 63)) & 1)) {
            next = W_S0;
        } else if (mode == W_S0 && b >= 0x80 && mc->loop_na) {
            if (utf8_feed(&p, b, &cp, lo, hi) < 0)
                continue;
            next = W_S0_INSIDE;
        } else {
            uint32_t pk = part_pack(part);
            struct trans *hit = mc->cache_on ? trans_find(cc, set, pk, b) : NULL;
            if (hit) {
                if (hit->res < 0)
                    continue;
                nset = (uint32_t)hit->res;
                p = part_unpack(hit->part_out);
            } else {
                /* step() reads the set from the cache's store and appends to the arena */
                if (u32v_reserve(&st->arena, (size_t)top + MOE_GRAMMAR_MAX_STACKS + 1) != 0) {
                    st_limit(st, "out of memory");
                    return -1;
                }
                const struct setrec *in = &cc->rec[set];
                long r = step(st, cc->store.p + in->off, in->n, &p, b, &st->arena);
                if (r < 0)
                    return -1;
                mc->work += in->n + (uint64_t)r;
                if (mc->work > MOE_GRAMMAR_MAX_MASK_WORK) {
                    st_limit(st, "mask needs more than %u stack steps (grammar too ambiguous)",
                             MOE_GRAMMAR_MAX_MASK_WORK);
                    return -1;
                }
                long id = -1;
                if (r > 0) {
                    sort_u32(st->arena.p + top, (uint32_t)r);
                    id = intern_set(cc, st->arena.p + top, (uint32_t)r);
                    if (id < 0) {
                        st_limit(st, "out of memory");
                        return -1;
                    }
                }
                if (mc->cache_on && st->n_nodes > mc->node_limit)
                    mc->cache_on = 0;
                if (mc->cache_on &&
                    trans_put(cc, (struct trans){set, pk, part_pack(p), (int32_t)id, 0, b}) != 0)
                    mc->cache_on = 0;
                if (r == 0) {
                    st->arena.n = top;
                    if (!mc->cache_on)
                        rollback(st, mark);
                    continue;
                }
                nset = (uint32_t)id;
            }
            st->arena.n = top;
            /* sets are interned: back at S0 (at a code point boundary) is index 0 */
            next = nset == 0 && p.rem == 0 && st->part.rem == 0 ? W_S0 : W_SET;
        }
        if (next != W_SET && !(ch->below[0] & ~mc->loop[0]) && !(ch->below[1] & ~mc->loop[1]) &&
            !ch->bad_utf8_below && (!ch->non_ascii_below || mc->loop_na)) {
            /* every byte below loops back to S0: the whole subtree is allowed */
            for (uint32_t k = ch->lo; k < ch->hi; k++)
                mc->mask[v->ord[k]] = 1;
            allowed += ch->hi - ch->lo;
        } else {
            for (uint32_t k = 0; k < ch->n_tok; k++)
                mc->mask[v->ord[ch->lo + k]] = 1;
            allowed += ch->n_tok;
            if (ch->n_child) {
                long a = walk(st, mc, c, nset, p, next);
                if (a < 0)
                    return -1;
                allowed += a;
            }
        }
        st->arena.n = top;
        if (!mc->cache_on)
            rollback(st, mark);
    }
    return allowed;
}

/* Whether the class matches all characters from U+0080 on or none of them. */
static int cls_uniform_non_ascii(const struct moe_grammar *g, const struct gclass *c)
{
    const uint32_t *r = g->ranges + c->off;
    int all = 0;
    if (c->neg) {
        all = c->n == 0 || r[2 * (c->n - 1) + 1] < 0x80;
    } else {
        for (uint32_t i = 0; i < c->n; i++)
            all |= r[2 * i] <= 0x80 && r[2 * i + 1] >= 0x10ffff;
    }
    return all || !cls_match_range(g, c, 0x80, 0x10ffff);
}

/* Fills mc->loop and mc->loop_na for S0 = arena[0 .. n0) (see struct mask_ctx). The arena has
 * room for 2 * n0 + MOE_GRAMMAR_MAX_STACKS entries, so that the steps here never move it. */
static int find_loops(struct moe_grammar_state *st, struct mask_ctx *mc)
{
    uint32_t n0 = mc->n0, mark = st->n_nodes;
    for (uint32_t b = 0; b < 128; b++) {
        struct utf8p p = st->part;
        long r = step(st, st->arena.p, n0, &p, (uint8_t)b, &st->arena);
        if (r < 0)
            return -1;
        if ((uint32_t)r == n0) {
            sort_u32(st->arena.p + n0, n0);
            if (memcmp(st->arena.p + n0, mc->s0, n0 * sizeof *mc->s0) == 0)
                mc->loop[b >> 6] |= 1ull << (b & 63);
        }
        st->arena.n = n0;
        rollback(st, mark);
    }
    /* Every stack's class takes all non-ASCII characters or none: then all of them lead where
     * U+00E9 (C3 A9) leads. */
    const struct moe_grammar *g = st->g;
    for (uint32_t i = 0; i < n0; i++) {
        uint32_t s = st->arena.p[i];
        if (s && !cls_uniform_non_ascii(g, &g->cls[EL_VAL(g->el[st->nodes[s].pos])]))
            return 0;
    }
    struct utf8p p = st->part;
    long r1 = step(st, st->arena.p, n0, &p, 0xc3, &st->arena);
    long r2 = r1 > 0 ? step(st, st->arena.p + n0, (uint32_t)r1, &p, 0xa9, &st->arena) : r1;
    if (r1 < 0 || r2 < 0)
        return -1;
    if ((uint32_t)r2 == n0) {
        uint32_t *out = st->arena.p + n0 + r1;
        sort_u32(out, n0);
        mc->loop_na = memcmp(out, mc->s0, n0 * sizeof *mc->s0) == 0;
    }
    st->arena.n = n0;
    rollback(st, mark);
    return 0;
}

long moe_grammar_mask(struct moe_grammar_state *st, const struct moe_grammar_vocab *v,
                      uint8_t *mask)
{
    memset(mask, 0, v->n);
    st->limit = 0;
    long allowed = 0;
    if (moe_grammar_state_is_accepting(st)) {
        for (uint32_t i = 0; i < v->n_eog; i++)
            mask[v->eog[i]] = 1;
        allowed += v->n_eog;
    }
    uint32_t n0 = st->set.n;
    if (u32v_reserve(&st->arena, 2 * (size_t)n0 + MOE_GRAMMAR_MAX_STACKS + 1) != 0 ||
        u32v_reserve(&st->tmp, (size_t)n0 + 1) != 0) {
        st_limit(st, "out of memory");
        return -1;
    }
    memcpy(st->arena.p, st->set.p, n0 * sizeof *st->set.p);
    memcpy(st->tmp.p, st->set.p, n0 * sizeof *st->set.p);
    sort_u32(st->tmp.p, n0);
    st->arena.n = n0;
    if (!st->cache && !(st->cache = calloc(1, sizeof *st->cache))) {
        st_limit(st, "out of memory");
        return -1;
    }
    mask_cache_reset(st->cache);
    uint32_t mark = st->n_nodes;
    struct mask_ctx mc = {v, mask, st->tmp.p, n0, {0, 0}, 0, 0, st->cache, st->cache_nodes > 0,
                          mark + st->cache_nodes};
    if (intern_set(st->cache, mc.s0, n0) != 0) { /* S0 is set 0 */
        st_limit(st, "out of memory");
        return -1;
    }
    if (st->part.rem == 0 && n0 && find_loops(st, &mc) != 0) {
        rollback(st, mark);
        st->arena.n = 0;
        return -1;
    }
    long a = walk(st, &mc, 0, 0, st->part, st->part.rem ? W_SET : W_S0);
    rollback(st, mark);
    st->arena.n = 0;
    if (a < 0)
        return -1;
    return allowed + a;
}
