/* Internals shared by the Jinja lexer/parser (jinja_parse.c) and evaluator (jinja.c): the arena,
 * error unwinding, values and the syntax tree. */
#ifndef MOED_JINJA_INT_H
#define MOED_JINJA_INT_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- Arena and errors: everything a parse or a render allocates comes from one arena, freed
 * at once; an error unwinds with longjmp to the entry point, which frees the arena. ---- */

struct jchunk;
struct jbase {
    struct jchunk *head;
    size_t total, limit;
    jmp_buf jb;
    int code;
    char msg[512];
};

void *j_alloc(struct jbase *b, size_t n);
void *j_zalloc(struct jbase *b, size_t n);
char *j_strndup(struct jbase *b, const char *s, size_t n);
void j_arena_free(struct jbase *b);
_Noreturn void j_die(struct jbase *b, int code, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- Values ---- */

enum { PROV_LIT = 0, PROV_DATA = 1, PROV_MIX = 2 };

struct jstr {
    const char *s;
    const uint8_t *m; /* PROV_MIX: one byte per byte of s, 1 for data */
    size_t len;
    uint8_t prov;
    bool markup; /* a Markup string (|safe, |escape): adding a plain string escapes it */
};

enum jvt {
    V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_DICT,
    V_NS, V_LOOP, V_MACRO, V_FUNC, V_METHOD,
    V_OBJ, /* jinja2's joiner and cycler: objects with a state */
};

struct jlist;
struct jdict;
struct jloop;
struct jmethod;
struct jmacro;
struct jnode;
struct jobj;

typedef struct jval {
    uint8_t t;
    union {
        bool b;
        int64_t i;
        double f;
        struct jstr *s;
        struct jlist *l;
        struct jdict *d;    /* V_DICT, V_NS */
        struct jloop *lp;
        struct jmacro *mac;   /* a macro and the scope it was defined in */
        int fn;
        struct jmethod *me;
        struct jobj *ob;
        const char *uname;  /* V_UNDEF: what was looked up, for messages (may be NULL) */
    } u;
} jval;

struct jlist {
    jval *v;
    size_t n;
    bool tuple;
    bool group; /* groupby's (grouper, list) pair: a tuple with those two attributes */
    const int64_t *range; /* range()'s result: its start, stop and step, as Python prints them */
};

struct jdict {
    jval *k, *v;
    size_t n, cap;
};

/* ---- Syntax tree ---- */

enum jnk {
    /* statements */
    N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_MACRO, N_FILTERBLOCK, N_BREAK, N_CONTINUE,
    N_BLOCK, /* a body in its own scope: {% generation %} (op 0), {% block %} (op BLK_*) */
    N_CALLBLOCK, /* {% call %}: a the macro call, c the caller (an N_MACRO) */
    N_WITH,      /* {% with %}: targets, values in args */
    /* expressions */
    E_LIT, E_NAME, E_LIST, E_TUPLE, E_DICT, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST,
    E_NOT, E_NEG, E_POS, E_BIN, E_AND, E_OR, E_COND, E_CONCAT,
};

enum jop { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FDIV, OP_MOD, OP_POW,
           OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN };

/* What a macro's body names (N_MACRO's op): the special variables it then gets. */
enum { MAC_CALLER = 1, MAC_VARARGS = 2, MAC_KWARGS = 4 };
/* A {% block %} (N_BLOCK's op): its own scope, seeing the loop around it when scoped. */
enum { BLK_NAMED = 1, BLK_SCOPED = 2, BLK_REQUIRED = 4 };

struct jnlist {
    struct jnode **v;
    size_t n;
};

struct jnode {
    uint8_t kind;
    uint8_t op;        /* E_BIN: enum jop; E_TEST: negated; N_FOR: recursive; N_MACRO: MAC_* */
    int line;
    int id;            /* E_FILTER / E_TEST: which one; N_FOR: number of targets */
    const char *name;  /* E_NAME, E_ATTR, E_FILTER, E_TEST, N_SET target, N_MACRO */
    const char *attr;  /* an assignment target's E_NAME: the namespace attribute (ns.attr) */
    jval lit;          /* E_LIT; N_TEXT (a string) */
    struct jnode *a, *b, *c; /* operands; N_IF/N_FOR: a condition / iterable, b loop filter;
                              * calls, filters, tests: b *args, c **kwargs */
    struct jnlist args;      /* call / filter / test arguments; list, tuple, dict (k,v pairs) items */
    const char **kwnames;    /* keyword arguments: names, values in kwargs */
    struct jnlist kwargs;
    struct jnlist body, orelse;
    struct jnode *tgt;       /* N_FOR, N_SET, N_SETBLOCK: what is assigned, an E_NAME (a variable,
                              * or ns.attr where attr is set) or an E_TUPLE of targets in args */
    const char **targets;    /* N_WITH: names; N_MACRO: parameter names */
    struct jnlist defaults;  /* N_MACRO: default per parameter (NULL entries: none) */
    size_t n_targets;
};

struct jinja_tmpl {
    struct jbase b;
    struct jnlist body;
};

/* Writes cp as UTF-8 (1 to 4 bytes) at o; returns the length. */
size_t j_put_utf8(char *o, unsigned long cp);

/* Filters and tests are resolved at parse time: an unknown one is an error then, except in an if
 * or a conditional expression, where (as in jinja2) it fails when evaluated (id -1). */
int j_filter_id(const char *name);
int j_test_id(const char *name);
/* One of jinja2's filters that moed refuses (wordwrap, urlize, ...). */
bool j_filter_refused(const char *name);

#endif
