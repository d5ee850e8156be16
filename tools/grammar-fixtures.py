#!/usr/bin/env python3
"""Writes tests/fixtures/grammar/schemas.json: JSON schemas with documents the grammar made from
each one must accept ("valid") and reject ("invalid"), and schemas the converter must refuse.

Every expectation is checked against the jsonschema package (Draft 2020-12) first, so the fixture
says what JSON Schema says, except where the grammar is deliberately narrower or wider (listed per
case in grammar_rejects / grammar_accepts, see docs/grammar.md). Documents given as objects are
written compact, with ", "/": " separators and indented; {"raw": text} is used as is.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install jsonschema
    /tmp/v/bin/python tools/grammar-fixtures.py
"""
import decimal
import json
import os
import sys

import jsonschema

RAW = "raw"


def raw(s):
    return {RAW: s}


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ABC = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}},
    "required": ["b"],
    "additionalProperties": False,
}

CASES = [
    ("string", {"type": "string"}, ["abc", "", "é😀", "a\"b\\c\n", raw('"\\u00e9\\/"')],
     [1, None, raw("abc"), raw('"a\x01"'), raw('"\\x"')]),
    ("integer", {"type": "integer"}, [0, -5, 123456], [1.5, "1", raw("01"), raw("-"), raw("1e5")]),
    ("number", {"type": "number"}, [1.5, -0.25, 10, raw("2.5E-3"), raw("1e+10")],
     ["1", raw(".5"), raw("1."), raw("+1"), raw("1e")]),
    ("boolean", {"type": "boolean"}, [True, False], [1, "true", raw("True")]),
    ("null", {"type": "null"}, [None], [0, raw("nul")]),
    ("enum", {"enum": ["red", "green", 1, None]}, ["red", "green", 1, None], ["blue", 2, "Red"]),
    ("const", {"const": "fixed"}, ["fixed"], ["other", raw("fixed")]),
    ("required-props", PERSON, [{"name": "Al", "age": 3}],
     [{"name": "Al"}, {"name": "Al", "age": 3, "x": 1}, {"name": 1, "age": 3},
      {"age": 3, "name": "Al"}]),
    ("optional-props", ABC,
     [{"b": 1}, {"a": "x", "b": 1}, {"b": 1, "c": True}, {"a": "x", "b": 1, "c": False}],
     [{}, {"a": "x"}, {"a": "x", "c": True}, {"b": 1, "b2": 1}, raw('{"b":1,}'),
      raw('{,"b":1}')]),
    ("all-optional",
     {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "additionalProperties": False},
     [{}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}], [{"c": 1}, raw('{"a":1 "b":2}'), raw('{,}')]),
    ("additional-true",
     {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     [{"a": 1, "z": [1]}, {"z": "q"}, {}, {"ab": "s", "": 1}],
     [{"a": "s"}, {"z": 1, "a": "s"}, {"b": 2, "a": 1}, raw('{"z"}')]),
    ("additional-schema-with-props",
     {"type": "object", "properties": {"id": {"type": "integer"}, "ide": {"type": "string"}},
      "required": ["id"], "additionalProperties": {"type": "boolean"}},
     [{"id": 1}, {"id": 1, "ide": "x", "i": True, "idea": False, "x": True}],
     [{"id": 1, "i": 2}, {"id": 1, "ide": True}, {"i": True}]),
    ("additional-schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     [{}, {"x": 1, "y": 2}], [{"x": "s"}, [1]]),
    ("any-object", {"type": "object"}, [{}, {"a": [1, {"b": None}], "c": "d"}],
     [[], raw("{"), "x"]),
    ("nested-objects",
     {"type": "object", "properties": {
         "name": {"type": "string"},
         "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                      "city": {"type": "string"}},
                     "required": ["street", "city"], "additionalProperties": False}},
      "required": ["name", "address"], "additionalProperties": False},
     [{"name": "A", "address": {"street": "S", "city": "C"}}],
     [{"name": "A", "address": {"street": "S"}}, {"name": "A", "address": "x"}]),
    ("int-array", {"type": "array", "items": {"type": "integer"}}, [[], [1, 2, 3]],
     [[1, "a"], {}, raw("[1,]"), raw("[,1]")]),
    ("bounded-array", {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
     [["a", "b"], ["a", "b", "c"]], [["a"], ["a", "b", "c", "d"], []]),
    ("nonempty-array", {"type": "array", "minItems": 1}, [[1], [1, "2", None, [3], {}]], [[]]),
    ("empty-array", {"type": "array", "maxItems": 0}, [[]], [[1]]),
    ("array-of-objects",
     {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}},
                                 "required": ["id"], "additionalProperties": False}},
     [[{"id": 1}, {"id": 2}], []], [[{"id": "x"}], [{}], [{"id": 1, "x": 2}]]),
    ("string-length", {"type": "string", "minLength": 2, "maxLength": 4},
     ["ab", "abcd", "éé", "\\n\\t"], ["a", "abcde", ""]),
    ("date", {"type": "string", "format": "date"}, ["2024-01-31", "1999-12-01"],
     [raw('"2024-13-01"'), raw('"24-01-01"'), 5]),
    ("date-time", {"type": "string", "format": "date-time"},
     ["2024-01-31T12:30:00Z", "2024-01-31T12:30:00.123+02:00"],
     [raw('"2024-01-31 12:30:00"'), raw('"2024-01-31T12:30:00"')]),
    ("uuid", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"],
     [raw('"123e4567"'), raw('"123e4567-e89b-12d3-a456-42661417400g"')]),
    ("time", {"type": "string", "format": "time"}, ["23:59:59Z", "08:00:00+01:00"],
     [raw('"24:00:00Z"'), raw('"8:00:00Z"')]),
    ("ref-defs",
     {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"},
                                                       "y": {"type": "number"}},
                       "required": ["x", "y"], "additionalProperties": False}},
      "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
      "required": ["a", "b"], "additionalProperties": False},
     [{"a": {"x": 1, "y": 2.5}, "b": {"x": -1, "y": 0}}],
     [{"a": {"x": 1}, "b": {"x": 1, "y": 2}}, {"a": {"x": 1, "y": 2}}]),
    ("ref-recursive",
     {"definitions": {"node": {"type": "object", "properties": {
         "value": {"type": "integer"},
         "children": {"type": "array", "items": {"$ref": "#/definitions/node"}}},
         "required": ["value"], "additionalProperties": False}},
      "$ref": "#/definitions/node"},
     [{"value": 1, "children": [{"value": 2}, {"value": 3, "children": []}]}, {"value": 0}],
     [{"value": 1, "children": [{"v": 2}]}, {"children": []}]),
    ("anyof", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, ["a", 5], [True, 1.5, None]),
    ("oneof-tagged",
     {"oneOf": [
         {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
          "required": ["kind", "x"], "additionalProperties": False},
         {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string"}},
          "required": ["kind", "y"], "additionalProperties": False}]},
     [{"kind": "a", "x": 1}, {"kind": "b", "y": "s"}],
     [{"kind": "a", "y": "s"}, {"kind": "c", "x": 1}]),
    ("nullable-type-array", {"type": ["string", "null"]}, ["x", None], [1, False]),
    ("type-array", {"type": ["number", "boolean"]}, [1.5, True, 3], ["s", None]),
    ("nullable-openapi", {"type": "integer", "nullable": True}, [1, None], ["x"]),
    ("allof-objects",
     {"type": "object", "allOf": [
         {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
         {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     [{"a": 1, "b": "x"}], [{"a": 1}, {"b": "x"}]),
    ("any-value", {}, [1, "s", [1, {"a": None}], {"k": True}, None],
     [raw("tru"), raw("[1,]"), raw("")]),
    ("enum-composite", {"enum": [[1, 2], {"a": 1}]}, [raw("[1,2]"), raw('{"a":1}')],
     [[1], {"a": 2}]),
    ("odd-keys",
     {"type": "object", "properties": {"a b": {"type": "string"}, "q\"uote": {"type": "integer"},
                                       "ü": {"type": "null"}},
      "required": ["a b", "q\"uote", "ü"], "additionalProperties": False},
     [{"a b": "x", "q\"uote": 1, "ü": None}], [{"a b": "x", "q\"uote": 1}]),
    ("nested-arrays",
     {"type": "array", "items": {"type": "array", "items": {"type": "array",
                                                           "items": {"type": "integer"}}}},
     [[[[1], [2, 3]], []], []], [[[["x"]]], [[1]]]),
    ("unicode-const", {"const": "héllo😀"}, ["héllo😀"], ["hello", raw('"h\\u00e9llo\\ud83d\\ude00"')]),
    ("whitespace",
     {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
     [raw('{ "a" : 1 }'), raw('{\n  "a": 1\n}'), raw('{"a":1}\n')],
     [raw('{"a":     1}'), raw('{"a":1}' + " " * 30), raw('{\n\n"a":1}')]),
    ("int-range", {"type": "integer", "minimum": 0, "maximum": 10},
     [0, 5, 10, raw("-0")], [-1, 11, 50, 100, "5", raw("05"), raw("5.0")]),
    ("int-fractional-bounds", {"type": "integer", "minimum": 1.5, "exclusiveMaximum": 120.5},
     [2, 9, 10, 99, 119, 120], [1, 0, -2, 121, 200, 1000]),
    ("int-min-only", {"type": "integer", "minimum": 17},
     [17, 18, 99, 100, 1234567890123456], [16, 0, -17, -1, raw("-0"), raw("017")]),
    ("int-max-only", {"type": "integer", "exclusiveMaximum": -2},
     [-3, -10, -99, -1000, -1234567890123456], [-2, -1, 0, 2, 3, raw("-0")]),
    ("int-negative-range", {"type": "integer", "exclusiveMinimum": -1000, "maximum": -999},
     [-999], [-1000, -998, 999, 0]),
    ("number-range", {"type": "number", "minimum": 0, "maximum": 1},
     [0, 1, 0.5, 0.999, raw("1.000"), raw("-0"), raw("-0.0"), raw("0.0000000000000001")],
     [-0.5, 1.5, 1.001, 2, -1, raw("1e0"), raw("0.5e1")]),
    ("number-exclusive", {"type": "number", "exclusiveMinimum": -3, "exclusiveMaximum": 10},
     [-2.999, -2, 0, 9.99, raw("-2.9999999999999999")],
     [-3, raw("-3.0"), 10, raw("10.00"), 10.5, -3.5]),
    ("number-exclusive-min", {"type": "number", "exclusiveMinimum": 5},
     [5.01, raw("5.0000000000000001"), 6, 100000],
     [5, raw("5.000"), 4.99, -6, 0]),
    # non-whole bounds on numbers, exact in binary so that jsonschema's float bounds are the
    # decimals written here; documents at each bound with trailing zeros and 10^-16 either side
    ("number-fractional-range", {"type": "number", "minimum": 0.5, "exclusiveMaximum": 2.75},
     [0.5, raw("0.50"), raw("0.5000000000000000"), raw("0.5000000000000001"), 1, raw("1.0"), 2,
      2.7, raw("2.74"), raw("2.7499999999999999"), raw("2.7")],
     [raw("0.4999999999999999"), 0.4, 0, raw("-0"), -0.5, 2.75, raw("2.750"),
      raw("2.7500000000000001"), 2.8, 3, raw("0.5e0"), raw("00.5"), raw(".5")]),
    ("number-negative-fractional",
     {"type": "number", "exclusiveMinimum": -2.75, "maximum": -0.125},
     [-0.125, raw("-0.1250"), raw("-0.1250000000000001"), -1, -2, -2.7,
      raw("-2.7499999999999999")],
     [raw("-0.1249999999999999"), -0.12, raw("-0.0"), 0, raw("-0"), 0.125, -2.75,
      raw("-2.7500"), raw("-2.7500000000000001"), -3, -100]),
    ("number-straddling-zero",
     {"type": "number", "minimum": -0.0000152587890625, "maximum": 1.0000152587890625},
     [raw("-0.0000152587890625"), raw("-0.0000152587890624"),
      raw("-0.00001"), raw("-0"), raw("-0.0"), 0, 0.5, 1, raw("1.0000152587890625"),
      raw("1.0000152587890624"), raw("1.00001")],
     [raw("-0.0000152587890626"), -0.0001, raw("-0.00002"), raw("1.0000152587890626"),
      raw("1.00002"), 2, -1]),
    ("number-one-integral-part",
     {"type": "number", "exclusiveMinimum": 7.25, "exclusiveMaximum": 7.5},
     [raw("7.2500000000000001"), 7.3, raw("7.26"), raw("7.4999999999999999"), 7.4],
     [7.25, raw("7.250"), 7.5, raw("7.50"), raw("7.5000000000000001"), 7, raw("7.0"), 7.2, 8,
      -7.3]),
    ("number-fractional-min-only", {"type": "number", "minimum": -1.5},
     [-1.5, raw("-1.50000"), raw("-1.4999999999999999"), -1, raw("-0"), 0, 1000.5,
      raw("1234567890123456.5")],
     [raw("-1.5000000000000001"), -1.6, -2, -1000, raw("12345678901234567")]),
    # a bound that is no exact binary fraction is the shortest decimal that reads back as the
    # same double: 0.1, where jsonschema compares 0.1 with the double a little over it
    ("number-decimal-bound", {"type": "number", "minimum": 0.1, "maximum": 0.2},
     [0.15, raw("0.1000000000000001"), raw("0.2"), raw("0.1"), raw("0.1000")],
     [raw("0.0999999999999999"), raw("0.2000000000000001"), 0, 0.3]),
    ("bounds-in-type-array", {"type": ["integer", "null"], "minimum": 1, "maximum": 3},
     [1, 3, None], [0, 4, "2"]),
    # patterns: jsonschema searches with Python's re, which reads these as ECMA-262 does (the
    # documents keep to ASCII where \d, \w, \s and '.' differ between the two)
    ("pattern-anchored", {"type": "string", "pattern": "^[a-z]+\\d{2,3}$"},
     ["abc12", "x999", "zz000"],
     ["abc1", "abc1234", "ABC12", "abc12 ", "1abc12", "", 12, raw('"abc12')]),
    ("pattern-search", {"type": "string", "pattern": "\\d{3}"},
     ["abc123def", "123", "x1234", 'q"1234\\', "\n999\t"], ["12", "a1b2c3", "", "1 23"]),
    ("pattern-end-anchor", {"type": "string", "pattern": "\\.json$"},
     ["a.json", ".json", "x.json.json"], ["a.json5", "ajson", "a.json "]),
    ("pattern-alternation", {"type": "string", "pattern": "^(cat|dog)s?$|^bird$"},
     ["cat", "dogs", "bird"], ["cats!", "catdog", "birds", "a bird", ""]),
    ("pattern-escaped-chars", {"type": "string", "pattern": '^a"b\\\\c\\/$'},
     ['a"b\\c/'], ["ab\\c/", 'a"bc/', 'a"b\\\\c/']),
    ("pattern-negated-class", {"type": "string", "pattern": "^[^0-9]*$"},
     ["abc", "", 'q"uote', "tab\there\\", "é😀", "\u0001"], ["a1", "9"]),
    ("pattern-dot", {"type": "string", "pattern": "^a.c$"},
     ["abc", "a c", 'a"c', "a😀c", "a\\c", "a\tc"], ["a\nc", "ac", "abbc"]),
    ("pattern-quantifiers", {"type": "string", "pattern": "^(ab){2}x{1,}y{0,2}z?[0-3]{2}$"},
     ["ababx00", "ababxxyyz33", "ababxy12"],
     ["abx00", "ababyy00", "ababxyyy00", "ababx0", "ababx04"]),
    ("pattern-email-like", {"type": "string", "pattern": "^[\\w.+-]+@[\\w-]+\\.[a-z]{2,}$"},
     ["john.doe+x@ex-ample.com", "a@b.io"], ["john@com", "@x.com", "a@b.c", "a b@c.de"]),
    ("pattern-groups", {"type": "string", "pattern": "^(?:[A-Z](?:[a-z]|-)*)+([0-9])?$"},
     ["Abc", "A-bC", "ABC", "Ab-c7"], ["abc", "A_b", "", "A77"]),
    ("pattern-escapes", {"type": "string", "pattern": "^\\x41\\u00e9[\\t ]\\d+?\\$$"},
     ["Aé\t1$", "Aé 12$"], ["Ae 1$", "Aé 1", "Aé\n1$"]),
    ("pattern-nullable", {"type": ["string", "null"], "pattern": "^x"},
     ["x", "xyz", None], ["", "yx", 1]),
    ("tuple-closed",
     {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     [[], ["a"], ["a", 1]], [["a", 1, 2], [1], ["a", "b"], [1, "a"], raw('["a",]')]),
    ("tuple-rest",
     {"prefixItems": [{"type": "string"}, {"type": "integer"}, {"type": "null"}],
      "items": {"type": "boolean"}, "minItems": 2, "maxItems": 5},
     [["a", 1], ["a", 1, None], ["a", 1, None, True, False]],
     [["a"], ["a", 1, True], ["a", 1, None, True, False, True], ["a", 1, None, 3], []]),
    ("tuple-any-rest", {"type": "array", "prefixItems": [{"const": "x"}], "minItems": 1},
     [["x"], ["x", 1, "y", None]], [[], ["y"], [1, "x"]]),
    ("tuple-nested",
     {"type": "array", "items": {"type": "array", "prefixItems": [
         {"type": "number", "minimum": -90, "maximum": 90},
         {"type": "number", "minimum": -180, "maximum": 180}],
         "minItems": 2, "items": False}},
     [[], [[0, 0], [45.5, -122.25]], [[90, 180]]],
     [[[91, 0]], [[0]], [[0, 0, 0]], [[0, 180.5]]]),
    ("no-items", {"type": "array", "items": False}, [[]], [[1], [None]]),
    ("title-and-description",
     {"title": "T", "description": "D", "$schema": "https://json-schema.org/draft/2020-12/schema",
      "type": "object", "properties": {"id": {"type": "string", "description": "x"}},
      "required": ["id"], "additionalProperties": False},
     [{"id": "a"}], [{"id": 1}]),
]

# Documents where the grammar deliberately differs from JSON Schema (see docs/grammar.md).
GRAMMAR_REJECTS = {  # valid for the schema, rejected by the grammar
    "required-props": [{"age": 3, "name": "Al"}],  # properties in schema order only
    "integer": [raw("1e5")],  # integers are written without fraction or exponent
    "int-range": [raw("5.0")],
    "number-range": [raw("1e0")],  # bounded numbers are written without exponent
    "number-fractional-range": [raw("0.5e0")],
    "number-fractional-min-only": [raw("12345678901234567")],  # 16 integral digits at most
    "whitespace": [raw('{"a":     1}'), raw('{"a":1}' + " " * 30), raw('{\n\n"a":1}')],
    "unicode-const": [raw('"h\\u00e9llo\\ud83d\\ude00"')],  # const/enum as written
    "additional-true": [{"b": 2, "a": 1}],  # declared properties come before the others
    "pattern-anchored": [raw('"\\u0061bc12"')],  # a pattern's characters as themselves
}
GRAMMAR_ACCEPTS = {  # invalid for the schema, accepted by the grammar
    "nullable-openapi": [None],  # OpenAPI's nullable, not JSON Schema
    "number-decimal-bound": [raw("0.1"), raw("0.1000")],  # the bound read as 0.1 (see above)
}

ERRORS = [
    ({"type": "object", "patternProperties": {"x": {}}}, "keyword 'patternProperties'"),
    ({"not": {"type": "string"}}, "keyword 'not'"),
    ({"type": "string", "format": "email"}, "format 'email' is not supported"),
    ({"$ref": "http://example.com/s.json"}, "not a local reference"),
    ({"$ref": "#/$defs/missing"}, "not a local reference"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}},
     "keyword 'multipleOf' is not supported (at /properties/a)"),
    ({"type": "array", "items": [{"type": "integer"}]}, "tuples"),
    ({"allOf": [{"type": "string"}, {"type": "object"}]}, "object schemas only"),
    ({"type": "array", "minItems": 5, "maxItems": 2}, "maxItems < minItems"),
    (False, "matches nothing"),
    ({"type": "foo"}, "unknown type 'foo'"),
    ({"type": "object", "properties": {}, "required": ["x"]}, "required property 'x'"),
    ({"type": "array", "uniqueItems": True}, "keyword 'uniqueItems'"),
    ({"if": {}, "then": {}}, "keyword 'if'"),
    ({"enum": []}, "non-empty array"),
    ({"type": "string", "pattern": "(a)\\1"}, "the escape '\\1' (a backreference)"),
    ({"type": "string", "pattern": "a(?=b)"}, "lookaround"),
    ({"type": "string", "pattern": "(?<!a)b"}, "lookaround"),
    ({"type": "string", "pattern": "\\bword"}, "(a word boundary)"),
    ({"type": "string", "pattern": "\\p{L}"}, "(a Unicode property)"),
    ({"type": "string", "pattern": "a^b"}, "'^' past the start"),
    ({"type": "string", "pattern": "(a$)"}, "'$' before the end"),
    ({"type": "string", "pattern": "(ab"}, "a '(' without ')'"),
    ({"type": "string", "pattern": "ab)"}, "a ')' without '('"),
    ({"type": "string", "pattern": "[ab"}, "a '[' without ']'"),
    ({"type": "string", "pattern": "a{2,1}"}, "n < m"),
    ({"type": "string", "pattern": "a{5000}"}, "a repetition count over 1000"),
    ({"type": "string", "pattern": "a{1000}b{1000}c{1000}d{1000}e{2}"}, "over 4000 in all"),
    ({"type": "string", "pattern": "*a"}, "nothing to repeat"),
    ({"type": "string", "pattern": "^(a*)*$"}, "can match nothing"),
    ({"type": "string", "pattern": "a{,3}"}, "no quantifier"),
    ({"type": "string", "pattern": "[z-a]"}, "out of order"),
    ({"type": "string", "pattern": "\\u{41}"}, "'\\u' without 4 hex digits"),
    ({"type": "string", "pattern": 5}, "'pattern' must be a string"),
    ({"type": "string", "pattern": "^a", "maxLength": 3}, "'pattern' next to 'maxLength'"),
    ({"pattern": "^a"}, "'pattern' needs 'type' string"),
    ({"type": "array", "prefixItems": []}, "'prefixItems' must be a non-empty array"),
    ({"type": "array", "prefixItems": {"type": "string"}}, "'prefixItems' must be a non-empty"),
    ({"type": "array", "prefixItems": [{}, {}], "items": False, "minItems": 3},
     "the items allowed ('items' false) < minItems"),
    ({"type": "array", "prefixItems": [{"type": "string", "format": "email"}]},
     "(at /prefixItems/0)"),
    ({"type": "number", "minimum": 1e-20}, "'minimum' 1e-20 has more than 16 fraction digits"),
    ({"type": "number", "exclusiveMaximum": 0.12345678901234567},
     "'exclusiveMaximum' 0.12345678901234566 has more than 16 fraction digits"),
    ({"type": "number", "exclusiveMinimum": 0.1234567890123456,
      "exclusiveMaximum": 0.1234567890123457},
     "no number of at most 16 fraction digits satisfies the bounds"),
    ({"type": "number", "minimum": 2.5, "maximum": 2.25}, "no number satisfies the bounds"),
    ({"type": "number", "exclusiveMinimum": -0.5, "maximum": -0.5},
     "no number satisfies the bounds"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer satisfies the bounds"),
    ({"type": "integer", "minimum": 4.2, "maximum": 4.8}, "no integer satisfies the bounds"),
    ({"type": "number", "exclusiveMinimum": 3, "maximum": 3}, "no number satisfies the bounds"),
    ({"type": "integer", "minimum": 1e20}, "at most 16 integral digits"),
    ({"type": "integer", "maximum": "10"}, "'maximum' must be a number"),
    ({"minimum": 0}, "'minimum' needs 'type' integer or number"),
    ({"type": "integer", "enum": [1, 2], "maximum": 1}, "'maximum' next to 'enum'"),
]


def texts(doc):
    if isinstance(doc, dict) and set(doc) == {RAW}:
        return [doc[RAW]]
    out = [json.dumps(doc, ensure_ascii=False, separators=(",", ":")),
           json.dumps(doc, ensure_ascii=False)]
    if isinstance(doc, (dict, list)) and doc:
        out.append(json.dumps(doc, ensure_ascii=False, indent=2))
    return list(dict.fromkeys(out))


def exact_float(text):
    """A fraction as a Decimal (exact against the bounds); integral ones as a float, which
    jsonschema counts as an integer."""
    d = decimal.Decimal(text)
    return float(text) if d == d.to_integral_value() else d


def schema_valid(schema, text):
    try:  # decimals exactly: 5.0000000000000001 is over 5
        doc = json.loads(text, parse_float=exact_float)
    except ValueError:
        return None
    if isinstance(schema, dict) and schema.get("format") == "time" and isinstance(doc, str):
        # jsonschema's own time check refuses the RFC 3339 offset "Z"; check it as a date-time
        schema, doc = dict(schema, format="date-time"), "1970-01-01T" + doc
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return v.is_valid(doc)


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = {"cases": [], "errors": []}
    bad = 0
    for name, schema, valid, invalid in CASES:
        rej = [t for d in GRAMMAR_REJECTS.get(name, []) for t in texts(d)]
        acc = [t for d in GRAMMAR_ACCEPTS.get(name, []) for t in texts(d)]
        vt = [t for d in valid for t in texts(d)]
        it = [t for d in invalid for t in texts(d)]
        for t in vt:
            want = t not in acc
            if schema_valid(schema, t) is not want:
                print(f"{name}: {t!r} should be {'valid' if want else 'invalid'} per the schema")
                bad += 1
        for t in it:
            ok = schema_valid(schema, t)
            if t in rej:
                if ok is not True:
                    print(f"{name}: {t!r} is listed as rejected by the grammar only")
                    bad += 1
            elif ok:
                print(f"{name}: {t!r} is valid per the schema")
                bad += 1
        if len(vt) == 0 or len(it) == 0:
            print(f"{name}: needs documents both ways")
            bad += 1
        out["cases"].append({"name": name, "schema": schema, "valid": vt, "invalid": it})
    for schema, msg in ERRORS:
        out["errors"].append({"schema": schema, "error": msg})
    if bad:
        sys.exit(f"{bad} expectations disagree with jsonschema")
    path = os.path.join(root, "tests/fixtures/grammar/schemas.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{os.path.relpath(path, root)}: {len(out['cases'])} schemas, "
          f"{sum(len(c['valid']) + len(c['invalid']) for c in out['cases'])} documents, "
          f"{len(out['errors'])} refused schemas")


if __name__ == "__main__":
    main()
