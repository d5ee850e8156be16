/* Jinja lexer and parser; see jinja.h. Whitespace follows Jinja2 with trim_blocks and
 * lstrip_blocks: a block or comment tag's first newline after it is dropped, spaces and tabs
 * before it on its line are dropped, '-' strips all whitespace on its side, '+' keeps it. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/jinja.h"
#include "daemon/jinja_int.h"
#include "store/err.h"

/* ---- Arena ---- */

struct jchunk {
    struct jchunk *next;
    size_t cap, used;
};
#define CHUNK_HDR ((sizeof(struct jchunk) + 15) & ~(size_t)15)
#define CHUNK_SIZE 65536

void *j_alloc(struct jbase *b, size_t n)
{
    if (n > SIZE_MAX / 2)
        j_die(b, MOE_ETOOBIG, 0, "allocation of %zu bytes", n);
    n = (n + 15) & ~(size_t)15;
    struct jchunk *c = b->head;
    if (c && c->cap - c->used >= n) {
        void *p = (char *)c + CHUNK_HDR + c->used;
        c->used += n;
        return p;
    }
    size_t cap = n > CHUNK_SIZE / 4 ? n : CHUNK_SIZE;
    if (b->total + cap + CHUNK_HDR > b->limit)
        j_die(b, MOE_ETOOBIG, 0, "the template needs more than %zu bytes of memory", b->limit);
    struct jchunk *nc = malloc(CHUNK_HDR + cap);
    if (!nc)
        j_die(b, -ENOMEM, 0, "out of memory");
    b->total += CHUNK_HDR + cap;
    nc->cap = cap;
    nc->used = n;
    if (c && cap == n) { /* a large block of its own: keep the current chunk in front */
        nc->next = c->next;
        c->next = nc;
    } else {
        nc->next = c;
        b->head = nc;
    }
    return (char *)nc + CHUNK_HDR;
}

void *j_zalloc(struct jbase *b, size_t n)
{
    void *p = j_alloc(b, n);
    memset(p, 0, n);
    return p;
}

char *j_strndup(struct jbase *b, const char *s, size_t n)
{
    char *p = j_alloc(b, n + 1);
    if (n)
        memcpy(p, s, n);
    p[n] = 0;
    return p;
}

void j_arena_free(struct jbase *b)
{
    struct jchunk *c = b->head;
    while (c) {
        struct jchunk *n = c->next;
        free(c);
        c = n;
    }
    b->head = NULL;
    b->total = 0;
}

void j_die(struct jbase *b, int code, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = line > 0 ? snprintf(b->msg, sizeof b->msg, "line %d: ", line) : 0;
    vsnprintf(b->msg + k, sizeof b->msg - (size_t)k, fmt, ap);
    va_end(ap);
    b->code = code;
    longjmp(b->jb, 1);
}

/* ---- Filters and tests by name ---- */

static const char *const filter_names[] = {
    "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first",
    "float", "forceescape", "indent", "int", "items", "join", "last", "length", "list", "lower",
    "map", "max", "min", "reject", "rejectattr", "replace", "reverse", "round", "safe", "select",
    "selectattr", "sort", "string", "sum", "title", "tojson", "trim", "unique", "upper",
    "wordcount", "center", "batch", "format", "slice", "truncate", "groupby", NULL,
};
static const char *const test_names[] = {
    "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "escaped", "even", "false",
    "filter", "float", "ge", "gt", "in", "integer", "iterable", "le", "lower", "lt", "mapping",
    "ne", "none", "number", "odd", "sameas", "sequence", "string", "test", "true", "undefined",
    "upper", "==", "!=", "<", "<=", ">", ">=", "greaterthan", "lessthan", NULL,
};
/* jinja2's own filters that moed does not implement: a template naming one parses (jinja2 knows
 * them), and the render fails where one is applied. */
static const char *const refused_filters[] = {
    "filesizeformat", "pprint", "random", "striptags", "urlencode", "urlize", "wordwrap", "xmlattr",
    NULL,
};

static int find_name(const char *const *names, const char *n)
{
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], n))
            return i;
    return -1;
}
int j_filter_id(const char *name) { return find_name(filter_names, name); }
int j_test_id(const char *name) { return find_name(test_names, name); }
bool j_filter_refused(const char *name) { return find_name(refused_filters, name) >= 0; }

/* ---- Lexer ---- */

enum tk { T_TEXT, T_VBEGIN, T_VEND, T_BBEGIN, T_BEND, T_NAME, T_STR, T_INT, T_FLOAT, T_OP, T_EOF };

struct tok {
    uint8_t k;
    int line;
    const char *p; /* T_NAME, T_OP: NUL-terminated text; T_TEXT, T_STR: bytes */
    size_t n;
    int64_t i;
    double f;
};

struct parser {
    struct jbase *b;
    const char *src;
    size_t len;
    struct tok *t;
    size_t n, cap, pos;
    int depth;
    size_t refs[3]; /* names 'caller', 'varargs', 'kwargs' parsed so far */
    const char *blocks[256]; /* names of the {% block %}s so far */
    size_t n_blocks;
    int loops; /* for loops around, in the same function as jinja2 compiles it (break and continue) */
};

#define MAX_NEST 100

static void push_tok(struct parser *P, struct tok t)
{
    if (P->n == P->cap) {
        size_t nc = P->cap ? P->cap * 2 : 256;
        struct tok *nt = j_alloc(P->b, nc * sizeof *nt);
        if (P->n)
            memcpy(nt, P->t, P->n * sizeof *nt);
        P->t = nt;
        P->cap = nc;
    }
    P->t[P->n++] = t;
}

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
static bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

size_t j_put_utf8(char *o, unsigned long cp)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xc0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* A string literal at s[0] (the quote); Python escapes as Jinja2 decodes them. */
static size_t lex_string(struct parser *P, size_t i, int *line)
{
    const char *s = P->src;
    char q = s[i];
    size_t j = i + 1, start_line = (size_t)*line;
    while (j < P->len && s[j] != q) {
        if (s[j] == '\\' && j + 1 < P->len)
            j++;
        if (s[j] == '\n')
            (*line)++;
        j++;
    }
    if (j >= P->len)
        j_die(P->b, MOE_EFORMAT, (int)start_line, "unterminated string literal");
    char *o = j_alloc(P->b, (j - i) * 2 + 1);
    size_t n = 0;
    for (size_t k = i + 1; k < j; k++) {
        if (s[k] != '\\') {
            o[n++] = s[k];
            continue;
        }
        char c = s[++k];
        switch (c) {
        case 'n': o[n++] = '\n'; break;
        case 't': o[n++] = '\t'; break;
        case 'r': o[n++] = '\r'; break;
        case 'a': o[n++] = '\a'; break;
        case 'b': o[n++] = '\b'; break;
        case 'f': o[n++] = '\f'; break;
        case 'v': o[n++] = '\v'; break;
        case '\\': o[n++] = '\\'; break;
        case '\'': o[n++] = '\''; break;
        case '"': o[n++] = '"'; break;
        case '\n': break;
        case 'N': /* \N{name}: needs Unicode's names */
            j_die(P->b, MOE_EUNSUPPORTED, (int)start_line, "\\N{...} escapes in string literals are not supported");
        case 'x': case 'u': case 'U': {
            int w = c == 'x' ? 2 : c == 'u' ? 4 : 8;
            unsigned long cp = 0;
            int d = 0;
            while (d < w && k + 1 < j && hexval(s[k + 1]) >= 0) {
                cp = cp * 16 + (unsigned long)hexval(s[k + 1]);
                k++;
                d++;
            }
            if (d < w || cp > 0x10ffff || (cp >= 0xd800 && cp < 0xe000))
                j_die(P->b, MOE_EFORMAT, (int)start_line, "bad \\%c escape in a string literal", c);
            n += j_put_utf8(o + n, cp);
            break;
        }
        default:
            if (c >= '0' && c <= '7') {
                unsigned cp = 0;
                int d = 0;
                k--;
                while (d < 3 && k + 1 < j && s[k + 1] >= '0' && s[k + 1] <= '7') {
                    cp = cp * 8 + (unsigned)(s[k + 1] - '0');
                    k++;
                    d++;
                }
                n += j_put_utf8(o + n, cp);
            } else {
                o[n++] = '\\';
                o[n++] = c;
            }
        }
    }
    o[n] = 0;
    push_tok(P, (struct tok){.k = T_STR, .line = (int)start_line, .p = o, .n = n});
    return j + 1;
}

static const char *const ops2[] = {"**", "//", "==", "!=", "<=", ">=", NULL};
static const char ops1[] = "+-*/%~<>=()[]{},.:|";

/* Tokens of one tag from i (past the opener) up to its closer; returns the index past the closer
 * and sets *strip_after ('-'), *keep_after ('+'). */
static size_t lex_tag(struct parser *P, size_t i, bool block, int *line, bool *strip_after,
                      bool *keep_after)
{
    const char *s = P->src;
    int depth = 0;
    int open_line = *line;
    for (;;) {
        while (i < P->len && is_ws(s[i])) {
            if (s[i] == '\n')
                (*line)++;
            i++;
        }
        if (i >= P->len)
            j_die(P->b, MOE_EFORMAT, open_line, "unterminated %s tag", block ? "{% %}" : "{{ }}");
        if (depth == 0) {
            char c = s[i];
            size_t k = i + ((c == '-' || c == '+') ? 1 : 0);
            if (k + 1 < P->len && ((block && s[k] == '%' && s[k + 1] == '}') ||
                                   (!block && s[k] == '}' && s[k + 1] == '}'))) {
                *strip_after = c == '-';
                *keep_after = c == '+';
                push_tok(P, (struct tok){.k = block ? T_BEND : T_VEND, .line = *line});
                return k + 2;
            }
        }
        char c = s[i];
        if (is_alpha(c)) {
            size_t j = i;
            while (j < P->len && (is_alpha(s[j]) || is_digit(s[j])))
                j++;
            push_tok(P, (struct tok){.k = T_NAME, .line = *line, .p = j_strndup(P->b, s + i, j - i),
                                     .n = j - i});
            i = j;
        } else if (c == '0' && i + 2 < P->len && strchr("xXoObB", s[i + 1]) && s[i + 1]) {
            /* 0x1f, 0o17, 0b101 (digits may be separated by single underscores) */
            int base = s[i + 1] == 'x' || s[i + 1] == 'X' ? 16 : s[i + 1] == 'o' || s[i + 1] == 'O' ? 8 : 2;
            size_t j = i + 2;
            uint64_t v = 0;
            bool any = false;
            for (;;) {
                size_t k = j + (j < P->len && s[j] == '_');
                int d = k >= P->len ? -1 : is_digit(s[k]) ? s[k] - '0'
                      : (s[k] | 0x20) >= 'a' && (s[k] | 0x20) <= 'f' ? (s[k] | 0x20) - 'a' + 10 : -1;
                if (d < 0 || d >= base)
                    break;
                if (v > (uint64_t)INT64_MAX / (uint64_t)base)
                    j_die(P->b, MOE_EUNSUPPORTED, *line, "integer literal is too large");
                v = v * (uint64_t)base + (uint64_t)d;
                any = true;
                j = k + 1;
            }
            if (!any || v > INT64_MAX)
                j_die(P->b, any ? MOE_EUNSUPPORTED : MOE_EFORMAT, *line,
                      any ? "integer literal is too large" : "invalid number literal");
            push_tok(P, (struct tok){.k = T_INT, .line = *line, .i = (int64_t)v});
            i = j;
        } else if (is_digit(c)) {
            size_t j = i;
            bool fl = false;
            while (j < P->len && (is_digit(s[j]) || (s[j] == '_' && j + 1 < P->len && is_digit(s[j + 1]))))
                j++;
            if (j + 1 < P->len && s[j] == '.' && is_digit(s[j + 1])) {
                fl = true;
                j++;
                while (j < P->len && is_digit(s[j]))
                    j++;
            }
            if (j < P->len && (s[j] == 'e' || s[j] == 'E')) {
                size_t e = j + 1;
                if (e < P->len && (s[e] == '+' || s[e] == '-'))
                    e++;
                if (e < P->len && is_digit(s[e])) {
                    fl = true;
                    j = e;
                    while (j < P->len && is_digit(s[j]))
                        j++;
                }
            }
            char buf[64];
            size_t bn = 0;
            for (size_t k = i; k < j && bn + 1 < sizeof buf; k++)
                if (s[k] != '_')
                    buf[bn++] = s[k];
            buf[bn] = 0;
            if (j - i >= sizeof buf - 1)
                j_die(P->b, MOE_EFORMAT, *line, "number literal too long");
            struct tok t = {.k = fl ? T_FLOAT : T_INT, .line = *line};
            if (fl) {
                t.f = strtod(buf, NULL);
            } else {
                errno = 0;
                unsigned long long v = strtoull(buf, NULL, 10);
                if (errno || v > INT64_MAX)
                    j_die(P->b, MOE_EUNSUPPORTED, *line, "integer literal %s is too large", buf);
                t.i = (int64_t)v;
            }
            push_tok(P, t);
            i = j;
        } else if (c == '\'' || c == '"') {
            i = lex_string(P, i, line);
        } else {
            const char *op = NULL;
            for (int k = 0; ops2[k]; k++)
                if (i + 1 < P->len && s[i] == ops2[k][0] && s[i + 1] == ops2[k][1])
                    op = ops2[k];
            if (!op) {
                const char *hit = c ? strchr(ops1, c) : NULL;
                if (!hit)
                    j_die(P->b, MOE_EFORMAT, *line, "unexpected character '%c' in a tag",
                          (c > 32 && c < 127) ? c : '?');
                char *o = j_alloc(P->b, 2);
                o[0] = c;
                o[1] = 0;
                op = o;
                if (c == '(' || c == '[' || c == '{')
                    depth++;
                else if ((c == ')' || c == ']' || c == '}') && depth > 0)
                    depth--;
            }
            push_tok(P, (struct tok){.k = T_OP, .line = *line, .p = op, .n = strlen(op)});
            i += strlen(op);
        }
    }
}

/* The text of a {% raw %} block from i (past the raw tag; strip_after: it ended with '-%}') up to
 * {% endraw %}, as jinja2 takes it: no newline dropped after the raw tag, the end tag's
 * lstrip_blocks and trim_blocks applied. Returns the index past the end tag. */
static size_t lex_raw(struct parser *P, size_t i, bool strip_after, int *line)
{
    const char *s = P->src;
    while (strip_after && i < P->len && is_ws(s[i])) {
        if (s[i] == '\n')
            (*line)++;
        i++;
    }
    int text_line = *line;
    for (size_t q = i; q + 1 < P->len; q++) {
        if (s[q] != '{' || s[q + 1] != '%')
            continue;
        size_t k = q + 2;
        char open = k < P->len && (s[k] == '-' || s[k] == '+') ? s[k] : 0;
        if (open)
            k++;
        while (k < P->len && is_ws(s[k]))
            k++;
        if (P->len - k < 6 || memcmp(s + k, "endraw", 6))
            continue;
        k += 6;
        while (k < P->len && is_ws(s[k]))
            k++;
        char close = k < P->len && (s[k] == '-' || s[k] == '+') ? s[k] : 0;
        if (close)
            k++;
        if (k + 1 >= P->len || s[k] != '%' || s[k + 1] != '}')
            continue;
        size_t te = q;
        if (open == '-') {
            while (te > i && is_ws(s[te - 1]))
                te--;
        } else if (!open) {
            size_t lp = te;
            while (lp > i && s[lp - 1] != '\n')
                lp--;
            bool blank = true;
            for (size_t x = lp; x < te; x++)
                blank &= s[x] == ' ' || s[x] == '\t';
            if (blank && (lp > i || (i > 0 && s[i - 1] == '\n')))
                te = lp;
        }
        if (te > i)
            push_tok(P, (struct tok){.k = T_TEXT, .line = text_line, .p = s + i, .n = te - i});
        k += 2;
        for (size_t x = i; x < k; x++)
            if (s[x] == '\n')
                (*line)++;
        if (close == '-') {
            while (k < P->len && is_ws(s[k])) {
                if (s[k] == '\n')
                    (*line)++;
                k++;
            }
        } else if (close != '+' && k < P->len && s[k] == '\n') {
            k++;
            (*line)++;
        }
        return k;
    }
    j_die(P->b, MOE_EFORMAT, text_line, "missing 'endraw' (the template ended)");
}

static void lex(struct parser *P)
{
    const char *s = P->src;
    size_t i = 0;
    int line = 1;
    bool line_starting = true;
    while (i <= P->len) {
        /* next tag opener */
        size_t q = i;
        while (q + 1 < P->len && !(s[q] == '{' && (s[q + 1] == '{' || s[q + 1] == '%' || s[q + 1] == '#')))
            q++;
        if (q + 1 >= P->len)
            q = P->len;
        size_t ts = i, te = q;
        int text_line = line;
        for (size_t k = i; k < q; k++)
            if (s[k] == '\n')
                line++;
        if (q == P->len) {
            if (te > ts)
                push_tok(P, (struct tok){.k = T_TEXT, .line = text_line, .p = s + ts, .n = te - ts});
            break;
        }
        char c = s[q + 1];
        char sign = q + 2 < P->len && (s[q + 2] == '-' || s[q + 2] == '+') ? s[q + 2] : 0;
        if (sign == '-') {
            while (te > ts && is_ws(s[te - 1]))
                te--;
        } else if (sign != '+' && c != '{') {
            size_t lp = te;
            while (lp > ts && s[lp - 1] != '\n')
                lp--;
            bool only_blank = true;
            for (size_t k = lp; k < te; k++)
                if (s[k] != ' ' && s[k] != '\t')
                    only_blank = false;
            if ((lp > ts || line_starting) && only_blank)
                te = lp;
        }
        if (te > ts)
            push_tok(P, (struct tok){.k = T_TEXT, .line = text_line, .p = s + ts, .n = te - ts});
        size_t p = q + 2 + (sign ? 1 : 0);
        bool strip_after = false, keep_after = false, block = c != '{';
        size_t end;
        if (c == '#') {
            size_t k = p;
            while (k + 1 < P->len && !(s[k] == '#' && s[k + 1] == '}'))
                k++;
            if (k + 1 >= P->len)
                j_die(P->b, MOE_EFORMAT, line, "unterminated comment");
            for (size_t x = p; x < k; x++)
                if (s[x] == '\n')
                    line++;
            strip_after = k > p && s[k - 1] == '-';
            keep_after = k > p && s[k - 1] == '+'; /* +#}: the newline after stays */
            end = k + 2;
        } else {
            push_tok(P, (struct tok){.k = block ? T_BBEGIN : T_VBEGIN, .line = line});
            end = lex_tag(P, p, block, &line, &strip_after, &keep_after);
            struct tok *t3 = P->n >= 3 ? &P->t[P->n - 3] : NULL;
            if (block && t3 && t3[0].k == T_BBEGIN && t3[1].k == T_NAME && !strcmp(t3[1].p, "raw") &&
                t3[2].k == T_BEND) {
                P->n -= 3;
                i = lex_raw(P, end, strip_after, &line);
                line_starting = i > 0 && s[i - 1] == '\n';
                if (i == P->len)
                    break;
                continue;
            }
        }
        i = end;
        if (strip_after) {
            while (i < P->len && is_ws(s[i])) {
                if (s[i] == '\n')
                    line++;
                i++;
            }
        } else if (block && !keep_after && i < P->len && s[i] == '\n') {
            i++;
            line++;
        }
        line_starting = i > end && s[i - 1] == '\n';
        if (i == P->len)
            break;
    }
    push_tok(P, (struct tok){.k = T_EOF, .line = line});
}

/* ---- Parser ---- */

static struct tok *cur(struct parser *P) { return &P->t[P->pos]; }
static struct tok *nexttok(struct parser *P) { return &P->t[P->pos < P->n - 1 ? P->pos + 1 : P->pos]; }

static bool is_op(const struct tok *t, const char *op) { return t->k == T_OP && !strcmp(t->p, op); }
static bool is_name(const struct tok *t, const char *n) { return t->k == T_NAME && !strcmp(t->p, n); }

static const char *tok_desc(const struct tok *t, char *buf, size_t cap)
{
    switch (t->k) {
    case T_NAME: case T_OP: snprintf(buf, cap, "'%.40s'", t->p); break;
    case T_STR: snprintf(buf, cap, "a string"); break;
    case T_INT: case T_FLOAT: snprintf(buf, cap, "a number"); break;
    case T_VEND: snprintf(buf, cap, "'}}'"); break;
    case T_BEND: snprintf(buf, cap, "'%%}'"); break;
    case T_EOF: snprintf(buf, cap, "the end of the template"); break;
    default: snprintf(buf, cap, "template text");
    }
    return buf;
}

static _Noreturn void unexpected(struct parser *P, const char *what)
{
    char buf[64];
    j_die(P->b, MOE_EFORMAT, cur(P)->line, "unexpected %s, expected %s",
          tok_desc(cur(P), buf, sizeof buf), what);
}

static void expect_op(struct parser *P, const char *op)
{
    if (!is_op(cur(P), op)) {
        char w[16];
        snprintf(w, sizeof w, "'%s'", op);
        unexpected(P, w);
    }
    P->pos++;
}

static bool accept_op(struct parser *P, const char *op)
{
    if (is_op(cur(P), op)) {
        P->pos++;
        return true;
    }
    return false;
}

static bool accept_name(struct parser *P, const char *n)
{
    if (is_name(cur(P), n)) {
        P->pos++;
        return true;
    }
    return false;
}

/* In a comma-separated list that close ends: true when an item follows (the comma before it
 * consumed), false at close (consumed; a trailing comma is allowed). */
static bool more_items(struct parser *P, const char *close, bool first)
{
    if (!first && !is_op(cur(P), close))
        expect_op(P, ",");
    return !accept_op(P, close);
}

static const char *expect_ident(struct parser *P, const char *what)
{
    if (cur(P)->k != T_NAME)
        unexpected(P, what);
    return P->t[P->pos++].p;
}

static void expect_bend(struct parser *P)
{
    if (cur(P)->k != T_BEND)
        unexpected(P, "'%}'");
    P->pos++;
}

static struct jnode *mk(struct parser *P, int kind, int line)
{
    struct jnode *n = j_zalloc(P->b, sizeof *n);
    n->kind = (uint8_t)kind;
    n->line = line;
    return n;
}

static void nl_push(struct parser *P, struct jnlist *l, struct jnode *n, size_t *cap)
{
    if (l->n == *cap) {
        size_t nc = *cap ? *cap * 2 : 4;
        struct jnode **nv = j_alloc(P->b, nc * sizeof *nv);
        if (l->n)
            memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        *cap = nc;
    }
    l->v[l->n++] = n;
}

static jval str_lit(struct parser *P, const char *s, size_t n)
{
    struct jstr *js = j_zalloc(P->b, sizeof *js);
    js->s = s;
    js->len = n;
    return (jval){.t = V_STR, .u.s = js};
}

static struct jnode *parse_expr(struct parser *P);
static struct jnode *parse_or(struct parser *P);
static struct jnode *parse_unary(struct parser *P, bool with_filter);
static struct jnode *parse_primary(struct parser *P);
static struct jnode *parse_postfix(struct parser *P, struct jnode *n);

static void enter(struct parser *P)
{
    if (++P->depth > MAX_NEST)
        j_die(P->b, MOE_ETOOBIG, cur(P)->line, "expressions or blocks nested more than %d deep", MAX_NEST);
}

/* (args) of a call, filter or test: positional then keyword arguments. */
static void parse_call_args(struct parser *P, struct jnode *n)
{
    expect_op(P, "(");
    size_t cap = 0, kcap = 0, kncap = 0;
    while (more_items(P, ")", n->args.n + n->kwargs.n == 0 && !n->b && !n->c)) {
        if (is_op(cur(P), "*") || is_op(cur(P), "**")) { /* f(*seq, **mapping) */
            bool two = cur(P)->p[1] == '*';
            struct jnode **slot = two ? &n->c : &n->b;
            if (*slot || (!two && n->c))
                j_die(P->b, MOE_EFORMAT, cur(P)->line, "a misplaced or repeated %s in a call", two ? "**" : "*");
            P->pos++;
            *slot = parse_expr(P);
        } else if (cur(P)->k == T_NAME && is_op(nexttok(P), "=")) {
            if (n->c)
                j_die(P->b, MOE_EFORMAT, cur(P)->line, "a keyword argument follows **");
            const char *k = P->t[P->pos].p;
            for (size_t i = 0; i < n->kwargs.n; i++)
                if (!strcmp(n->kwnames[i], k))
                    j_die(P->b, MOE_EFORMAT, cur(P)->line, "keyword argument repeated: %s", k);
            P->pos += 2;
            if (n->kwargs.n == kncap) {
                size_t nc = kncap ? kncap * 2 : 4;
                const char **nk = j_alloc(P->b, nc * sizeof *nk);
                if (n->kwargs.n)
                    memcpy(nk, n->kwnames, n->kwargs.n * sizeof *nk);
                n->kwnames = nk;
                kncap = nc;
            }
            nl_push(P, &n->kwargs, parse_expr(P), &kcap);
            n->kwnames[n->kwargs.n - 1] = k;
        } else {
            if (n->kwargs.n || n->b || n->c)
                j_die(P->b, MOE_EFORMAT, cur(P)->line, "a positional argument follows keyword or * arguments");
            nl_push(P, &n->args, parse_expr(P), &cap);
        }
    }
}

static struct jnode *parse_filter_or_test(struct parser *P, struct jnode *n)
{
    for (;;) {
        struct tok *t = cur(P);
        if (is_op(t, "|")) {
            P->pos++;
            int line = cur(P)->line;
            const char *name = expect_ident(P, "a filter name");
            int id = j_filter_id(name);
            /* an unknown name (id -1) is checked after parsing: see check_names */
            struct jnode *f = mk(P, E_FILTER, line);
            f->name = name;
            f->id = id;
            f->a = n;
            if (is_op(cur(P), "("))
                parse_call_args(P, f);
            n = f;
        } else if (is_name(t, "is")) {
            P->pos++;
            int line = cur(P)->line;
            bool neg = accept_name(P, "not");
            const char *name;
            if (cur(P)->k == T_NAME || (cur(P)->k == T_OP && j_test_id(cur(P)->p) >= 0))
                name = P->t[P->pos++].p;
            else
                unexpected(P, "a test name");
            int id = j_test_id(name); /* unknown (-1): checked after parsing */
            struct jnode *te = mk(P, E_TEST, line);
            te->name = name;
            te->id = id;
            te->op = neg;
            te->a = n;
            struct tok *c = cur(P);
            if (is_op(c, "(")) {
                parse_call_args(P, te);
            } else if ((c->k == T_NAME || c->k == T_STR || c->k == T_INT || c->k == T_FLOAT ||
                        is_op(c, "[") || is_op(c, "{")) &&
                       !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
                if (is_name(c, "is"))
                    j_die(P->b, MOE_EFORMAT, c->line, "tests cannot be chained with 'is'");
                size_t cap = 0;
                nl_push(P, &te->args, parse_postfix(P, parse_primary(P)), &cap);
            }
            n = te;
        } else if (is_op(t, "(")) {
            struct jnode *c = mk(P, E_CALL, t->line);
            c->a = n;
            parse_call_args(P, c);
            n = c;
        } else {
            return n;
        }
    }
}

static struct jnode *parse_subscript(struct parser *P, struct jnode *base, int line)
{
    /* after '[' */
    struct jnode *parts[3] = {NULL, NULL, NULL};
    bool slice = false;
    if (!is_op(cur(P), ":"))
        parts[0] = parse_expr(P);
    if (accept_op(P, ":")) {
        slice = true;
        if (!is_op(cur(P), ":") && !is_op(cur(P), "]"))
            parts[1] = parse_expr(P);
        if (accept_op(P, ":") && !is_op(cur(P), "]"))
            parts[2] = parse_expr(P);
    }
    expect_op(P, "]");
    struct jnode *n = mk(P, slice ? E_SLICE : E_ITEM, line);
    n->a = base;
    if (slice) {
        n->b = parts[0];
        n->c = parts[1];
        size_t cap = 0;
        nl_push(P, &n->args, parts[2], &cap);
    } else {
        if (!parts[0])
            unexpected(P, "an index");
        n->b = parts[0];
    }
    return n;
}

static struct jnode *parse_postfix(struct parser *P, struct jnode *n)
{
    for (;;) {
        struct tok *t = cur(P);
        if (is_op(t, ".")) {
            P->pos++;
            struct tok *a = cur(P);
            if (a->k == T_NAME) {
                struct jnode *x = mk(P, E_ATTR, a->line);
                x->a = n;
                x->name = a->p;
                P->pos++;
                n = x;
            } else if (a->k == T_INT) {
                struct jnode *x = mk(P, E_ITEM, a->line);
                x->a = n;
                x->b = mk(P, E_LIT, a->line);
                x->b->lit = (jval){.t = V_INT, .u.i = a->i};
                P->pos++;
                n = x;
            } else {
                unexpected(P, "an attribute name");
            }
        } else if (is_op(t, "[")) {
            P->pos++;
            enter(P);
            n = parse_subscript(P, n, t->line);
            P->depth--;
        } else if (is_op(t, "(")) {
            struct jnode *c = mk(P, E_CALL, t->line);
            c->a = n;
            enter(P);
            parse_call_args(P, c);
            P->depth--;
            n = c;
        } else {
            return n;
        }
    }
}

static struct jnode *parse_primary(struct parser *P)
{
    struct tok *t = cur(P);
    struct jnode *n;
    enter(P);
    switch (t->k) {
    case T_NAME:
        P->pos++;
        n = mk(P, E_LIT, t->line);
        if (!strcmp(t->p, "true") || !strcmp(t->p, "True"))
            n->lit = (jval){.t = V_BOOL, .u.b = true};
        else if (!strcmp(t->p, "false") || !strcmp(t->p, "False"))
            n->lit = (jval){.t = V_BOOL, .u.b = false};
        else if (!strcmp(t->p, "none") || !strcmp(t->p, "None"))
            n->lit = (jval){.t = V_NONE};
        else {
            n->kind = E_NAME;
            n->name = t->p;
            static const char *const special[] = {"caller", "varargs", "kwargs"};
            for (int k = 0; k < 3; k++)
                if (!strcmp(t->p, special[k]))
                    P->refs[k]++;
        }
        break;
    case T_STR: {
        P->pos++;
        const char *s = t->p;
        size_t len = t->n;
        while (cur(P)->k == T_STR) { /* adjacent literals concatenate */
            char *c = j_alloc(P->b, len + cur(P)->n + 1);
            memcpy(c, s, len);
            memcpy(c + len, cur(P)->p, cur(P)->n + 1);
            len += cur(P)->n;
            s = c;
            P->pos++;
        }
        n = mk(P, E_LIT, t->line);
        n->lit = str_lit(P, s, len);
        break;
    }
    case T_INT:
        P->pos++;
        n = mk(P, E_LIT, t->line);
        n->lit = (jval){.t = V_INT, .u.i = t->i};
        break;
    case T_FLOAT:
        P->pos++;
        n = mk(P, E_LIT, t->line);
        n->lit = (jval){.t = V_FLOAT, .u.f = t->f};
        break;
    case T_OP:
        if (is_op(t, "(")) {
            P->pos++;
            if (accept_op(P, ")")) {
                n = mk(P, E_TUPLE, t->line);
                break;
            }
            struct jnode *first = parse_expr(P);
            if (is_op(cur(P), ",")) {
                n = mk(P, E_TUPLE, t->line);
                size_t cap = 0;
                nl_push(P, &n->args, first, &cap);
                while (accept_op(P, ",") && !is_op(cur(P), ")"))
                    nl_push(P, &n->args, parse_expr(P), &cap);
            } else {
                n = first;
            }
            expect_op(P, ")");
            break;
        }
        if (is_op(t, "[")) {
            P->pos++;
            n = mk(P, E_LIST, t->line);
            size_t cap = 0;
            while (more_items(P, "]", n->args.n == 0))
                nl_push(P, &n->args, parse_expr(P), &cap);
            break;
        }
        if (is_op(t, "{")) {
            P->pos++;
            n = mk(P, E_DICT, t->line);
            size_t cap = 0;
            while (more_items(P, "}", n->args.n == 0)) {
                nl_push(P, &n->args, parse_expr(P), &cap);
                expect_op(P, ":");
                nl_push(P, &n->args, parse_expr(P), &cap);
            }
            break;
        }
        /* fall through */
    default:
        unexpected(P, "an expression");
    }
    P->depth--;
    return n;
}

static struct jnode *parse_unary(struct parser *P, bool with_filter)
{
    struct tok *t = cur(P);
    struct jnode *n;
    enter(P);
    if (is_op(t, "-") || is_op(t, "+")) {
        P->pos++;
        n = mk(P, is_op(t, "-") ? E_NEG : E_POS, t->line);
        n->a = parse_unary(P, false);
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter)
        n = parse_filter_or_test(P, n);
    P->depth--;
    return n;
}

static struct jnode *bin(struct parser *P, int kind, int op, int line, struct jnode *a, struct jnode *b)
{
    struct jnode *n = mk(P, kind, line);
    n->op = (uint8_t)op;
    n->a = a;
    n->b = b;
    return n;
}

/* Binary operators by precedence, loosest first; levels 2 (not) and 3 (comparisons) have their
 * own functions, level 8 is the unary level. */
struct binop {
    const char *tok;
    bool word;
    uint8_t kind, op;
};
static const struct binop lv_or[] = {{"or", true, E_OR, 0}, {0}};
static const struct binop lv_and[] = {{"and", true, E_AND, 0}, {0}};
static const struct binop lv_add[] = {{"+", false, E_BIN, OP_ADD}, {"-", false, E_BIN, OP_SUB}, {0}};
static const struct binop lv_concat[] = {{"~", false, E_CONCAT, 0}, {0}};
static const struct binop lv_mul[] = {{"*", false, E_BIN, OP_MUL}, {"/", false, E_BIN, OP_DIV},
                                      {"//", false, E_BIN, OP_FDIV}, {"%", false, E_BIN, OP_MOD}, {0}};
static const struct binop lv_pow[] = {{"**", false, E_BIN, OP_POW}, {0}};
static const struct binop *const levels[] = {lv_or, lv_and, NULL, NULL, lv_add, lv_concat, lv_mul, lv_pow};

static struct jnode *parse_not(struct parser *P);
static struct jnode *parse_compare(struct parser *P);

static struct jnode *parse_level(struct parser *P, int lv)
{
    if (lv == 2)
        return parse_not(P);
    if (lv == 3)
        return parse_compare(P);
    if (lv == 8)
        return parse_unary(P, true);
    struct jnode *n = parse_level(P, lv + 1);
    for (;;) {
        struct tok *t = cur(P);
        const struct binop *b = levels[lv];
        while (b->tok && !(b->word ? is_name(t, b->tok) : is_op(t, b->tok)))
            b++;
        if (!b->tok)
            return n;
        P->pos++;
        n = bin(P, b->kind, b->op, t->line, n, parse_level(P, lv + 1));
    }
}

static struct jnode *parse_compare(struct parser *P)
{
    struct jnode *n = parse_level(P, 4), *prev = NULL;
    for (;;) {
        struct tok *t = cur(P);
        int op = is_op(t, "==") ? OP_EQ : is_op(t, "!=") ? OP_NE : is_op(t, "<") ? OP_LT
               : is_op(t, "<=") ? OP_LE : is_op(t, ">") ? OP_GT : is_op(t, ">=") ? OP_GE
               : is_name(t, "in") ? OP_IN : -1;
        if (op < 0 && is_name(t, "not") && is_name(nexttok(P), "in")) {
            op = OP_NOTIN;
            P->pos++;
        }
        if (op < 0)
            return n;
        P->pos++;
        struct jnode *rhs = parse_level(P, 4);
        if (!prev) {
            n = bin(P, E_BIN, op, t->line, n, rhs);
            prev = n;
        } else { /* a < b < c: (a < b) and (b < c) */
            struct jnode *c = bin(P, E_BIN, op, t->line, prev->b, rhs);
            n = bin(P, E_AND, 0, t->line, n, c);
            prev = c;
        }
    }
}

static struct jnode *parse_not(struct parser *P)
{
    if (is_name(cur(P), "not")) {
        int line = cur(P)->line;
        P->pos++;
        enter(P);
        struct jnode *n = mk(P, E_NOT, line);
        n->a = parse_not(P);
        P->depth--;
        return n;
    }
    return parse_compare(P);
}

static struct jnode *parse_or(struct parser *P) { return parse_level(P, 0); }

static struct jnode *parse_expr(struct parser *P)
{
    enter(P);
    struct jnode *n = parse_or(P);
    while (is_name(cur(P), "if")) {
        int line = cur(P)->line;
        P->pos++;
        struct jnode *c = mk(P, E_COND, line);
        c->a = parse_or(P);
        c->b = n;
        if (accept_name(P, "else"))
            c->c = parse_expr(P);
        n = c;
    }
    P->depth--;
    return n;
}

/* expr or expr, expr, ... (a tuple without parentheses); without condexpr, as jinja2 parses an
 * if's test and a for's iterable, the items are not conditional expressions (the for's `if`
 * filter follows them, and `recursive` ends them too). */
static struct jnode *parse_tuple_of(struct parser *P, bool condexpr)
{
    int line = cur(P)->line;
    struct jnode *n = condexpr ? parse_expr(P) : parse_or(P);
    if (!is_op(cur(P), ","))
        return n;
    struct jnode *t = mk(P, E_TUPLE, line);
    size_t cap = 0;
    nl_push(P, &t->args, n, &cap);
    while (accept_op(P, ",")) {
        if (cur(P)->k == T_BEND || cur(P)->k == T_VEND || (!condexpr && is_name(cur(P), "recursive")))
            break;
        nl_push(P, &t->args, condexpr ? parse_expr(P) : parse_or(P), &cap);
    }
    return t;
}

static struct jnode *parse_tuple(struct parser *P) { return parse_tuple_of(P, true); }

/* ---- Statements ---- */

static struct jnlist parse_body(struct parser *P, const char *const *ends, const char **which);

/* A body with `loops` for loops around it that break and continue may leave: a for loop's body
 * one more, a macro's, a call block's, a block's and generation's none (jinja2 compiles them as
 * functions of their own). */
static struct jnlist parse_body_in(struct parser *P, const char *const *ends, const char **which, int loops)
{
    int saved = P->loops;
    P->loops = loops;
    struct jnlist r = parse_body(P, ends, which);
    P->loops = saved;
    return r;
}

/* One assignment target in parentheses or at the top: a name, ns.attr (top level of a set only,
 * as jinja2's with_namespace) or a parenthesized tuple of targets, which may be empty or end in a
 * comma; (a) is a. */
static struct jnode *parse_target_item(struct parser *P, bool ns)
{
    struct tok *t = cur(P);
    if (t->k == T_NAME) {
        struct jnode *n = mk(P, E_NAME, t->line);
        n->name = t->p;
        P->pos++;
        if (ns && accept_op(P, "."))
            n->attr = expect_ident(P, "an attribute name");
        return n;
    }
    if (!is_op(t, "("))
        unexpected(P, "a variable name");
    if (++P->depth > MAX_NEST)
        j_die(P->b, MOE_ETOOBIG, t->line, "expressions or blocks nested more than %d deep", MAX_NEST);
    P->pos++;
    struct jnode *tup = mk(P, E_TUPLE, t->line);
    size_t cap = 0;
    bool comma = false;
    while (more_items(P, ")", tup->args.n == 0)) {
        nl_push(P, &tup->args, parse_target_item(P, false), &cap);
        if (is_op(cur(P), ","))
            comma = true;
    }
    P->depth--;
    return tup->args.n == 1 && !comma ? tup->args.v[0] : tup;
}

/* The target of a for loop or a set: items separated by commas, a tuple when there is a comma. A
 * trailing comma only before '%}' (a set block), as in jinja2. */
static struct jnode *parse_target(struct parser *P, bool ns)
{
    int line = cur(P)->line;
    struct jnode *first = parse_target_item(P, ns);
    if (!is_op(cur(P), ","))
        return first;
    struct jnode *tup = mk(P, E_TUPLE, line);
    size_t cap = 0;
    nl_push(P, &tup->args, first, &cap);
    while (accept_op(P, ",") && cur(P)->k != T_BEND)
        nl_push(P, &tup->args, parse_target_item(P, ns), &cap);
    return tup;
}

/* f1(args) | f2 | ... of a filter block or set block: a chain whose each filter's a is the one
 * applied before it. */
static struct jnode *parse_filter_chain(struct parser *P)
{
    struct jnode *chain = NULL;
    do {
        int fl = cur(P)->line;
        const char *fname = expect_ident(P, "a filter name");
        struct jnode *f = mk(P, E_FILTER, fl);
        f->name = fname;
        if ((f->id = j_filter_id(fname)) < 0 && !j_filter_refused(fname))
            j_die(P->b, MOE_EUNSUPPORTED, fl, "no filter named '%s'", fname);
        if (is_op(cur(P), "("))
            parse_call_args(P, f);
        f->a = chain;
        chain = f;
    } while (accept_op(P, "|"));
    return chain;
}

/* Parameters up to ')' (the '(' consumed): names with optional defaults. */
static void parse_params(struct parser *P, struct jnode *n)
{
    const char **params = j_alloc(P->b, 64 * sizeof *params);
    size_t cap = 0;
    while (more_items(P, ")", n->n_targets == 0)) {
        if (n->n_targets == 64)
            j_die(P->b, MOE_EUNSUPPORTED, cur(P)->line, "too many macro parameters");
        params[n->n_targets++] = expect_ident(P, "a parameter name");
        nl_push(P, &n->defaults, accept_op(P, "=") ? parse_expr(P) : NULL, &cap);
    }
    n->targets = params;
}

static struct jnode *parse_statement(struct parser *P)
{
    struct tok *kw = cur(P);
    if (kw->k != T_NAME)
        unexpected(P, "a statement name");
    const char *name = kw->p;
    int line = kw->line;
    P->pos++;
    if (!strcmp(name, "if")) {
        struct jnode *n = mk(P, N_IF, line), *top = n;
        n->a = parse_tuple_of(P, false);
        expect_bend(P);
        static const char *const ends[] = {"elif", "else", "endif", NULL};
        for (;;) {
            const char *which;
            n->body = parse_body(P, ends, &which);
            if (!strcmp(which, "elif")) {
                struct jnode *e = mk(P, N_IF, cur(P)->line);
                e->a = parse_tuple_of(P, false);
                expect_bend(P);
                size_t cap = 0;
                nl_push(P, &n->orelse, e, &cap);
                n = e;
                continue;
            }
            if (!strcmp(which, "else")) {
                expect_bend(P);
                static const char *const e2[] = {"endif", NULL};
                n->orelse = parse_body(P, e2, &which);
            }
            expect_bend(P);
            return top;
        }
    }
    if (!strcmp(name, "for")) {
        struct jnode *n = mk(P, N_FOR, line);
        n->tgt = parse_target(P, false);
        if (!accept_name(P, "in"))
            unexpected(P, "'in'");
        n->a = parse_tuple_of(P, false);
        if (accept_name(P, "if"))
            n->b = parse_expr(P);
        if (accept_name(P, "recursive"))
            n->op = 1;
        expect_bend(P);
        static const char *const ends[] = {"else", "endfor", NULL};
        const char *which;
        n->body = parse_body_in(P, ends, &which, P->loops + 1);
        if (!strcmp(which, "else")) {
            expect_bend(P);
            static const char *const e2[] = {"endfor", NULL};
            n->orelse = parse_body(P, e2, &which);
        }
        expect_bend(P);
        return n;
    }
    if (!strcmp(name, "set")) {
        struct jnode *n = mk(P, N_SET, line);
        n->tgt = parse_target(P, true);
        if (accept_op(P, "=")) {
            n->a = parse_tuple(P);
            expect_bend(P);
            return n;
        }
        n->kind = N_SETBLOCK;
        n->a = accept_op(P, "|") ? parse_filter_chain(P) : NULL; /* {% set x | filter %} */
        expect_bend(P);
        static const char *const ends[] = {"endset", NULL};
        const char *which;
        n->body = parse_body(P, ends, &which);
        expect_bend(P);
        return n;
    }
    if (!strcmp(name, "macro")) {
        struct jnode *n = mk(P, N_MACRO, line);
        n->name = expect_ident(P, "a macro name");
        expect_op(P, "(");
        parse_params(P, n);
        expect_bend(P);
        size_t refs[3];
        memcpy(refs, P->refs, sizeof refs);
        static const char *const ends[] = {"endmacro", NULL};
        const char *which;
        n->body = parse_body_in(P, ends, &which, 0);
        for (int k = 0; k < 3; k++)
            if (P->refs[k] != refs[k])
                n->op |= (uint8_t)(1 << k);
        if (cur(P)->k == T_NAME)
            P->pos++;
        expect_bend(P);
        return n;
    }
    if (!strcmp(name, "call")) {
        struct jnode *n = mk(P, N_CALLBLOCK, line), *c = mk(P, N_MACRO, line);
        c->name = "caller";
        if (accept_op(P, "("))
            parse_params(P, c);
        n->a = parse_expr(P);
        if (n->a->kind != E_CALL)
            j_die(P->b, MOE_EFORMAT, line, "{%% call %%} needs a macro call");
        n->c = c;
        expect_bend(P);
        static const char *const ends[] = {"endcall", NULL};
        const char *which;
        size_t refs[3];
        memcpy(refs, P->refs, sizeof refs);
        c->body = parse_body_in(P, ends, &which, 0);
        for (int k = 0; k < 3; k++) /* as a macro's: its own caller (none), varargs and kwargs */
            if (P->refs[k] != refs[k])
                c->op |= (uint8_t)(1 << k);
        expect_bend(P);
        return n;
    }
    if (!strcmp(name, "filter")) {
        struct jnode *n = mk(P, N_FILTERBLOCK, line);
        n->a = parse_filter_chain(P);
        expect_bend(P);
        static const char *const ends[] = {"endfilter", NULL};
        const char *which;
        n->body = parse_body(P, ends, &which);
        expect_bend(P);
        return n;
    }
    if (!strcmp(name, "with")) { /* {% with a = 1, b = x %}: a scope with those variables */
        struct jnode *n = mk(P, N_WITH, line);
        const char **names = j_alloc(P->b, 64 * sizeof *names);
        size_t cap = 0;
        while (cur(P)->k != T_BEND) {
            if (n->n_targets == 64)
                j_die(P->b, MOE_EUNSUPPORTED, cur(P)->line, "too many with targets");
            if (n->n_targets)
                expect_op(P, ",");
            names[n->n_targets++] = expect_ident(P, "a variable name");
            expect_op(P, "=");
            nl_push(P, &n->args, parse_expr(P), &cap);
        }
        n->targets = names;
        expect_bend(P);
        static const char *const ends[] = {"endwith", NULL};
        const char *which;
        n->body = parse_body(P, ends, &which);
        expect_bend(P);
        return n;
    }
    if (!strcmp(name, "block")) { /* without extends: rendered in place */
        struct jnode *n = mk(P, N_BLOCK, line);
        n->name = expect_ident(P, "a block name");
        n->op = BLK_NAMED;
        for (size_t i = 0; i < P->n_blocks; i++)
            if (!strcmp(P->blocks[i], n->name))
                j_die(P->b, MOE_EFORMAT, line, "block '%s' defined twice", n->name);
        if (P->n_blocks == sizeof P->blocks / sizeof P->blocks[0])
            j_die(P->b, MOE_EUNSUPPORTED, line, "more than %zu blocks", P->n_blocks);
        P->blocks[P->n_blocks++] = n->name;
        for (;;) {
            if (accept_name(P, "scoped"))
                n->op |= BLK_SCOPED;
            else if (accept_name(P, "required"))
                n->op |= BLK_REQUIRED;
            else
                break;
        }
        expect_bend(P);
        static const char *const ends[] = {"endblock", NULL};
        const char *which;
        n->body = parse_body_in(P, ends, &which, 0);
        if (cur(P)->k == T_NAME)
            P->pos++;
        expect_bend(P);
        for (size_t i = 0; (n->op & BLK_REQUIRED) && i < n->body.n; i++) {
            const struct jnode *b = n->body.v[i];
            bool blank = b->kind == N_TEXT;
            for (size_t k = 0; blank && k < b->lit.u.s->len; k++)
                blank = strchr(" \t\n\r\v\f", b->lit.u.s->s[k]) != NULL;
            if (!blank)
                j_die(P->b, MOE_EFORMAT, line, "required blocks can only contain comments or whitespace");
        }
        return n;
    }
    if (!strcmp(name, "generation")) {
        struct jnode *n = mk(P, N_BLOCK, line);
        expect_bend(P);
        static const char *const ends[] = {"endgeneration", NULL};
        const char *which;
        n->body = parse_body_in(P, ends, &which, 0);
        expect_bend(P);
        return n;
    }
    if (!strcmp(name, "break") || !strcmp(name, "continue")) {
        if (!P->loops)
            j_die(P->b, MOE_EFORMAT, line, "'%s' outside a loop", name);
        struct jnode *n = mk(P, name[0] == 'b' ? N_BREAK : N_CONTINUE, line);
        expect_bend(P);
        return n;
    }
    static const char *const unsupported[] = {"include", "import", "from", "extends", "do",
                                              "autoescape", "trans", NULL};
    for (int i = 0; unsupported[i]; i++)
        if (!strcmp(name, unsupported[i]))
            j_die(P->b, MOE_EUNSUPPORTED, line, "the '%s' statement is not supported", name);
    j_die(P->b, MOE_EFORMAT, line, "unknown statement '%s'", name);
}

/* Nodes up to a {% end %} tag named in ends (NULL ends: the end of the template). Leaves the
 * position after that tag's name, *which set to it. */
static struct jnlist parse_body(struct parser *P, const char *const *ends, const char **which)
{
    struct jnlist l = {0};
    size_t cap = 0;
    int open_line = cur(P)->line;
    enter(P);
    for (;;) {
        struct tok *t = cur(P);
        if (t->k == T_EOF) {
            if (ends) {
                const char *const *e = ends;
                while (e[1])
                    e++;
                j_die(P->b, MOE_EFORMAT, open_line, "missing '%s' (the template ended)", *e);
            }
            break;
        }
        if (t->k == T_TEXT) {
            struct jnode *n = mk(P, N_TEXT, t->line);
            n->lit = str_lit(P, t->p, t->n);
            nl_push(P, &l, n, &cap);
            P->pos++;
        } else if (t->k == T_VBEGIN) {
            P->pos++;
            struct jnode *n = mk(P, N_OUT, t->line);
            n->a = parse_tuple(P);
            if (cur(P)->k != T_VEND)
                unexpected(P, "'}}'");
            P->pos++;
            nl_push(P, &l, n, &cap);
        } else if (t->k == T_BBEGIN) {
            struct tok *kw = nexttok(P);
            bool end = false;
            for (int i = 0; ends && ends[i]; i++)
                if (is_name(kw, ends[i])) {
                    *which = ends[i];
                    end = true;
                }
            if (end) {
                P->pos += 2;
                break;
            }
            if (kw->k == T_NAME && (!strncmp(kw->p, "end", 3) || !strcmp(kw->p, "elif") ||
                                    !strcmp(kw->p, "else")))
                j_die(P->b, MOE_EFORMAT, kw->line, "unexpected '%s'%s%s", kw->p,
                      ends ? ", expected " : "", ends ? ends[0] : "");
            P->pos++;
            nl_push(P, &l, parse_statement(P), &cap);
        } else {
            unexpected(P, "template text or a tag");
        }
    }
    P->depth--;
    return l;
}

/* An unknown filter or test name is an error at parse time, except where jinja2's compiler is in
 * a "soft" frame: the test and branches of an if statement or a conditional expression, up to the
 * next construct with its own frame (a for loop's body, filter and else; a macro; a call block's
 * caller; a filter block; a set block; a with block's body; a block). There jinja2 raises only
 * when the filter or test is evaluated, and so does moed (see eval). */
static void check_names(struct parser *P, const struct jnode *n, bool soft);

static void check_list(struct parser *P, const struct jnlist *l, bool soft)
{
    for (size_t i = 0; i < l->n; i++)
        check_names(P, l->v[i], soft);
}

static void check_names(struct parser *P, const struct jnode *n, bool soft)
{
    for (; n; ) { /* iterates along a, where long left-leaning chains are */
        if ((n->kind == E_FILTER || n->kind == E_TEST) && n->id < 0 && !soft &&
            !(n->kind == E_FILTER && j_filter_refused(n->name)))
            j_die(P->b, MOE_EUNSUPPORTED, n->line, "no %s named '%s'", n->kind == E_FILTER ? "filter" : "test",
                  n->name);
        bool sa = soft, inner = soft; /* a's softness; b, c, arguments and bodies */
        switch (n->kind) {
        case N_IF: case E_COND:
            sa = inner = true;
            break;
        case N_FOR: /* the iterable in the frame around; the filter, body and else in the loop's */
            inner = false;
            break;
        case N_SETBLOCK: case N_MACRO: case N_FILTERBLOCK: case N_BLOCK:
            sa = inner = false;
            break;
        case N_CALLBLOCK: case N_WITH: /* the call and the values in the frame around */
            check_names(P, n->c, false);
            check_list(P, &n->args, soft);
            check_list(P, &n->body, false);
            n = n->a;
            continue;
        default:
            break;
        }
        check_names(P, n->b, inner);
        check_names(P, n->c, inner);
        check_list(P, &n->args, inner);
        check_list(P, &n->kwargs, inner);
        check_list(P, &n->body, inner);
        check_list(P, &n->orelse, inner);
        check_list(P, &n->defaults, inner);
        soft = sa;
        n = n->a;
    }
}

int jinja_parse(const char *src, size_t len, struct jinja_tmpl **out, char *err, size_t errlen)
{
    *out = NULL;
    if (len > JINJA_MAX_TEMPLATE)
        return moe_fail(err, errlen, MOE_ETOOBIG, "the chat template is %zu bytes (at most %u)", len,
                        JINJA_MAX_TEMPLATE);
    struct jinja_tmpl *t = calloc(1, sizeof *t);
    if (!t)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    t->b.limit = 64u << 20;
    struct parser P = {.b = &t->b};
    if (setjmp(t->b.jb)) {
        int code = t->b.code;
        moe_fail(err, errlen, code, "chat template: %s", t->b.msg);
        j_arena_free(&t->b);
        free(t);
        return code;
    }
    /* newlines normalized to \n; one trailing newline dropped (keep_trailing_newline off) */
    char *s = j_alloc(&t->b, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n && s[n - 1] == '\n')
        n--;
    s[n] = 0;
    P.src = s;
    P.len = n;
    lex(&P);
    const char *which = NULL;
    t->body = parse_body(&P, NULL, &which);
    check_list(&P, &t->body, false);
    *out = t;
    return 0;
}

void jinja_free(struct jinja_tmpl *t)
{
    if (!t)
        return;
    j_arena_free(&t->b);
    free(t);
}
