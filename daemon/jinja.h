/* A Jinja renderer for chat templates: the subset of Jinja2 that model publishers' templates use,
 * with the conventions of Hugging Face's apply_chat_template (trim_blocks, lstrip_blocks, loop
 * controls, raise_exception, strftime_now, tojson without ASCII escaping); docs/jinja.md lists
 * what is supported and what is refused.
 *
 *   struct jinja_tmpl *t;
 *   jinja_parse(src, len, &t, err, sizeof err);               once per template
 *   jinja_render(t, data, literal, &opts, &out, err, errlen);  once per request
 *
 * Provenance: every byte of the output is either template text (string literals, text between
 * tags, the literal variables such as bos_token) or data (anything reached from the data
 * variables: messages, tools, request keyword arguments), and a string computed from data stays
 * data through every string operation. The caller may look for special tokens in template text
 * only, so that a message cannot smuggle a control token in as text.
 *
 * The renderer never crashes on any template or input: template size, output size, loop
 * iterations, call depth and memory are bounded, and every error names the construct and the
 * template line ("line 12: 'dict object' has no attribute 'x'"). */
#ifndef MOED_JINJA_H
#define MOED_JINJA_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <time.h>

struct jinja_tmpl;

#define JINJA_MAX_TEMPLATE (1u << 20) /* bytes of template source */

/* Parses a template (at most JINJA_MAX_TEMPLATE bytes). Returns 0, MOE_EFORMAT (syntax error),
 * MOE_EUNSUPPORTED (a construct moed does not implement, named in err), MOE_ETOOBIG or -ENOMEM. */
int jinja_parse(const char *src, size_t len, struct jinja_tmpl **out, char *err, size_t errlen);
void jinja_free(struct jinja_tmpl *t);

struct jinja_opts {
    size_t max_output;      /* bytes of output; 0: 4 MiB */
    size_t max_memory;      /* bytes the render may allocate; 0: 64 MiB */
    size_t max_iterations;  /* loop iterations plus macro calls; 0: 1,000,000 */
    unsigned max_depth;     /* nested macro calls; 0: 64 */
    time_t now;             /* strftime_now's clock (UTC); 0: the local time when rendering */
};

/* One run of output bytes of one provenance. */
struct jinja_span {
    size_t off, len;
    bool data;
};

struct jinja_out {
    char *text;             /* NUL-terminated */
    size_t len;
    struct jinja_span *spans; /* cover text exactly; adjacent spans differ in provenance */
    size_t n_spans;
};

/* Renders t. data: a JSON object whose members become template variables of data provenance;
 * literal: the same for template-text provenance (bos_token); either may be NULL. Returns 0,
 * MOE_EFORMAT (the template raised: raise_exception, an undefined attribute, a type error;
 * message in err), MOE_ETOOBIG (a limit) or -ENOMEM. */
int jinja_render(const struct jinja_tmpl *t, json_t *data, json_t *literal,
                 const struct jinja_opts *opts, struct jinja_out *out, char *err, size_t errlen);
void jinja_out_free(struct jinja_out *o);

#endif
