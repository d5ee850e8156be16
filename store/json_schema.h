/* JSON Schema to GBNF, for response_format json_schema (strict) and json_object. The grammar
 * accepts the JSON text of the documents the schema describes, with bounded optional whitespace
 * between tokens (a model cannot loop on spaces). See docs/grammar.md for the subset. */
#ifndef MOE_STORE_JSON_SCHEMA_H
#define MOE_STORE_JSON_SCHEMA_H

#include <jansson.h>
#include <stddef.h>

/* Converts schema into GBNF text (*gbnf, malloc'ed, root rule `root`). 0 on success; -1 with a
 * message in err naming the keyword and where it is (a JSON pointer) for what is not supported:
 * the conversion is strict, it never drops a constraint it cannot express (numeric bounds and
 * patterns included: those it cannot enforce exactly are refused). */
int moe_json_schema_to_gbnf(json_t *schema, char **gbnf, char *err, size_t errlen);

/* The grammar of response_format json_object: any JSON object (values of any type inside). */
const char *moe_json_object_gbnf(void);

#endif
