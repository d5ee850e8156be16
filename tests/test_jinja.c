/* The Jinja renderer: the 23 real chat templates against jinja2's output (fixtures made by
 * tools/chat-fixtures.py), provenance of output bytes, errors with lines, limits, and a
 * deterministic mini-fuzz of mutated templates (no crash, no leak under ASan). */
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/jinja.h"
#include "store/err.h"
#include "tests/harness.h"

#define FIXDIR "tests/fixtures/chat-templates"
#define FIXED_NOW 1741944413 /* 2025-03-14 09:26:53 UTC, the fixtures' strftime_now */

static json_t *load_json(const char *path)
{
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    CHECK_MSG(j, "%s: %s (line %d)", path, je.text, je.line);
    return j;
}

static struct jinja_tmpl *parse_file(const char *name)
{
    char path[512], err[512];
    snprintf(path, sizeof path, FIXDIR "/%s.jinja", name);
    size_t n;
    char *src = moe_test_read_file_or_fail(path, &n);
    struct jinja_tmpl *t;
    int rc = jinja_parse(src, n, &t, err, sizeof err);
    free(src);
    CHECK_MSG(rc == 0, "%s: %s", name, err);
    return t;
}

/* The data variables of one conversation: messages, tools, add_generation_prompt, kwargs. */
static json_t *conv_vars(json_t *c)
{
    json_t *v = json_object();
    json_object_set(v, "messages", json_object_get(c, "messages"));
    json_object_set(v, "tools", json_object_get(c, "tools"));
    json_object_set(v, "add_generation_prompt", json_object_get(c, "add_generation_prompt"));
    json_object_update(v, json_object_get(c, "kwargs"));
    return v;
}

static void show_diff(const char *tmpl, const char *conv, const char *want, const char *got)
{
    size_t i = 0;
    while (want[i] && want[i] == got[i])
        i++;
    size_t from = i > 60 ? i - 60 : 0;
    fprintf(stderr, "%s / %s: differs at byte %zu\n  want: %.120s\n  got:  %.120s\n", tmpl, conv, i,
            want + from, got + from);
}

TEST(jinja_real_templates_match_jinja2)
{
    json_t *convs = load_json(FIXDIR "/conversations.json");
    json_t *exp = load_json(FIXDIR "/expected.json");
    const char *tname;
    json_t *tv;
    size_t n_ok = 0, n_err = 0, bad = 0, n_tmpl = 0;
    json_object_foreach(exp, tname, tv) {
        struct jinja_tmpl *t = parse_file(tname);
        n_tmpl++;
        json_t *lit = json_object();
        if (json_is_string(json_object_get(tv, "bos_token")))
            json_object_set(lit, "bos_token", json_object_get(tv, "bos_token"));
        if (json_is_string(json_object_get(tv, "eos_token")))
            json_object_set(lit, "eos_token", json_object_get(tv, "eos_token"));
        size_t i;
        json_t *c;
        json_array_foreach(convs, i, c) {
            const char *cname = json_string_value(json_object_get(c, "name"));
            json_t *want = json_object_get(json_object_get(tv, "cases"), cname);
            CHECK_MSG(want, "%s: no expected output for %s", tname, cname);
            json_t *vars = conv_vars(c);
            struct jinja_opts o = {.now = FIXED_NOW};
            struct jinja_out out;
            char err[512];
            int rc = jinja_render(t, vars, lit, &o, &out, err, sizeof err);
            json_t *wt = json_object_get(want, "text");
            if (wt) {
                if (rc) {
                    fprintf(stderr, "%s / %s: %s\n", tname, cname, err);
                    bad++;
                } else if (out.len != json_string_length(wt) ||
                           memcmp(out.text, json_string_value(wt), out.len)) {
                    show_diff(tname, cname, json_string_value(wt), out.text);
                    bad++;
                } else {
                    n_ok++;
                }
            } else if (rc == 0) {
                fprintf(stderr, "%s / %s: jinja2 raised (%s) but moed rendered\n", tname, cname,
                        json_string_value(json_object_get(want, "error")));
                bad++;
            } else {
                CHECK_MSG(strstr(err, "line ") || rc == MOE_ETOOBIG, "%s / %s: error without a line: %s",
                          tname, cname, err);
                n_err++;
            }
            if (!rc)
                jinja_out_free(&out);
            json_decref(vars);
        }
        json_decref(lit);
        jinja_free(t);
    }
    fprintf(stderr, "%zu templates: %zu renders identical, %zu errors as in jinja2, %zu bad\n",
            n_tmpl, n_ok, n_err, bad);
    CHECK_EQ(n_tmpl, 23);
    CHECK_EQ(bad, 0);
    json_decref(convs);
    json_decref(exp);
}
