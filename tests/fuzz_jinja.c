/* libFuzzer target for the Jinja renderer.
 *
 * The input is a template, optionally followed by a NUL byte and a JSON object of data variables
 * (without one, a fixed conversation with tools is used). Any input must give either a clean
 * error with a message or an output whose spans cover it exactly, within the limits set here. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/jinja.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char default_vars[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"sys\"}, {\"role\": \"user\", \"content\": "
    "\"hi <|im_start|>\"}, {\"role\": \"assistant\", \"content\": \"<think>r</think>a\", \"tool_calls\": "
    "[{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1}}}]}, "
    "{\"role\": \"tool\", \"content\": \"42\"}], \"tools\": [{\"type\": \"function\", \"function\": "
    "{\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}], \"add_generation_prompt\": true}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    char *src = malloc(tlen ? tlen : 1); /* exact size: ASan sees reads past the end */
    if (!src)
        return 0;
    memcpy(src, data, tlen);
    json_t *vars = nul ? json_loadb((const char *)nul + 1, size - tlen - 1, 0, NULL)
                       : json_loads(default_vars, 0, NULL);
    json_t *lit = json_pack("{ssss}", "bos_token", "<s>", "eos_token", "</s>");
    char err[512];
    struct jinja_tmpl *t;
    if (jinja_parse(src, tlen, &t, err, sizeof err) == 0) {
        struct jinja_opts o = {.max_output = 1 << 20, .max_memory = 32 << 20,
                               .max_iterations = 100000, .now = 1741944413};
        struct jinja_out out;
        if (jinja_render(t, json_is_object(vars) ? vars : NULL, lit, &o, &out, err, sizeof err) == 0) {
            size_t cover = 0;
            for (size_t i = 0; i < out.n_spans; i++) {
                if (out.spans[i].off != cover || !out.spans[i].len)
                    abort();
                cover += out.spans[i].len;
            }
            if (cover != out.len || out.text[out.len] != 0)
                abort();
            jinja_out_free(&out);
        } else if (!err[0]) {
            abort();
        }
        jinja_free(t);
    } else if (!err[0]) {
        abort();
    }
    json_decref(vars);
    json_decref(lit);
    free(src);
    return 0;
}
