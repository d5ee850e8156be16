#!/usr/bin/env python3
"""Renders small templates, one per Jinja feature, with Python's jinja2 in the environment that
tools/chat-fixtures.py sets up (Hugging Face's: trim_blocks, lstrip_blocks, loop controls,
raise_exception, tojson without ASCII escaping); writes tests/fixtures/jinja-cases.json (each
case's template, data variables and jinja2's output, or the error it raised). tests/test_jinja.c
renders the same with moed's renderer and compares byte for byte. Also writes
daemon/jinja_printable.h, the code points that Python's repr escapes (not str.isprintable()),
from this Python's Unicode data.

    tools/jinja-cases.py            regenerate the fixture
    tools/jinja-cases.py --check    fail when the committed fixture differs"""
import importlib.util
import json
import os
import sys

import jinja2
import jinja2.ext
import jinja2.nodes

TOOLS = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(TOOLS, "..", "tests", "fixtures", "jinja-cases.json")
PRINTABLE = os.path.join(TOOLS, "..", "daemon", "jinja_printable.h")

spec = importlib.util.spec_from_file_location("chat_fixtures", os.path.join(TOOLS, "chat-fixtures.py"))
chat_fixtures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chat_fixtures)

TREE = [{"name": "a", "children": [{"name": "a1", "children": []},
                                   {"name": "a2", "children": [{"name": "a2x", "children": []}]}]},
        {"name": "b", "children": []}]
PEOPLE = [{"name": "Ann", "city": "Paris", "age": 31}, {"name": "bob", "city": "berlin", "age": 25},
          {"name": "Cy", "city": "paris", "age": 40}, {"name": "Di", "city": "Berlin", "age": 19}]

# (name, template[, data])
CASES = [
    # the % operator
    ("pct_s", "{{ '%s' % 'x' }}|{{ '%s' % 3 }}|{{ '%s' % none }}|{{ '%s' % [1, 'a'] }}|{{ '%s' % 1.5 }}"),
    ("pct_d", "{{ '%d items' % 3 }}|{{ '%d' % 3.9 }}|{{ '%i' % -7 }}|{{ '%+d' % 5 }}|{{ '%05d' % 42 }}|{{ '%-5d|' % 42 }}|{{ '%5d' % -42 }}"),
    ("pct_f", "{{ '%.2f' % 3.14159 }}|{{ '%f' % 2 }}|{{ '%8.3f' % -1.5 }}|{{ '%-8.1f|' % 2.25 }}|{{ '%.0f' % 2.5 }}|{{ '%+.1f' % 1 }}"),
    ("pct_tuple", "{{ '%s and %s' % ('a', 'b') }}|{{ '%s=%d' % ('n', 4) }}|{{ '(%s)' % ((1, 2),) }}"),
    ("pct_other", "{{ '%x %X %o %c %%' % (255, 255, 8, 65) }}|{{ '%r' % 'a' }}|{{ '%5s|%-5s|' % ('ab', 'cd') }}|{{ '%.1s' % 'xyz' }}"),
    ("pct_e_g", "{{ '%e' % 12345.678 }}|{{ '%.2e' % 0.000123 }}|{{ '%g' % 0.0001 }}|{{ '%g' % 1234567.0 }}|{{ '%g' % 100 }}|{{ '%.3g' % 3.14159 }}"),
    ("pct_dict", "{{ '%(name)s is %(age)d' % {'name': 'Ann', 'age': 31} }}"),
    ("pct_data", "{{ 'Hi %s, you are %d' % (m.name, m.age) }}", {"m": {"name": "Zoë", "age": 7}}),
    ("pct_too_few", "{{ '%s %s' % ('a',) }}"),
    ("pct_too_many", "{{ '%s' % ('a', 'b') }}"),
    ("pct_bad_type", "{{ '%d' % 'x' }}"),
    ("pct_format_filter", "{{ '%s-%s' | format(1, 'b') }}|{{ '%(a)s!' | format(a='x') }}|{{ '%.1f' | format(2) }}"),
    # str.format
    ("pct_edge", "{{ '%5.1s|%-6.2f|%+05d|% d|%#x|%#o|%3c' % ('xyz', 1.234, 7, 3, 255, 8, 'q') }}|{{ '%s%%' % 50 }}|{{ '%(a)s %(a)r' % {'a': 'v'} }}|{{ 'none' % {} }}"),
    ("pct_octal_prefix", "{{ '%#06o|%-#6o|%#o|%#X' % (8, 8, -8, 255) }}"),
    ("pct_more", "{{ '%d|%s|%.3s|%x|%e|%g|%r|%r|%s' % (true, true, 12345, -255, 0, 1e16, 1.5, [1, 'a'], ((),)) }}|{{ '' % () }}|{{ '%-+6d|%06.2f|%5.0e' % (3, -1.5, 12345) }}"),
    ("pct_char_string", "{{ '%c' % 'ab' }}"),
    ("pct_empty_tuple", "{{ '%s' % () }}"),
    ("pct_unknown_conv", "{{ '%y' % 1 }}"),
    ("pct_missing_key", "{{ '%(b)s' % {'a': 1} }}"),
    ("pct_not_mapping", "{{ '%(a)s' % (1,) }}"),
    ("fmt_positional", "{{ '{} {}'.format('a', 1) }}|{{ '{0}{1}{0}'.format('a', 'b') }}|{{ '{}'.format(none) }}|{{ '{}'.format([1, 'x']) }}"),
    ("fmt_named", "{{ '{name} is {age}'.format(name='Ann', age=31) }}|{{ '{0} {x}'.format(1, x=2) }}"),
    ("fmt_spec", "{{ '{:>5}|{:<5}|{:^5}|{:05d}|{:.2f}'.format('a', 'b', 'c', 42, 3.14159) }}|{{ '{:*^9}'.format('mid') }}|{{ '{:x}'.format(255) }}|{{ '{:+d}'.format(3) }}"),
    ("fmt_escape_conv", "{{ '{{literal}} {}'.format(1) }}|{{ '{!r}'.format('a') }}|{{ '{!s}'.format(2) }}|{{ '{:>6.2f}'.format(1.005) }}"),
    ("fmt_index", "{{ '{0[x]} {1[1]} {0.x}'.format({'x': 'X'}, [1, 2]) }}"),
    ("fmt_data", "{{ '<{}>'.format(m) }}", {"m": "dätä"}),
    ("fmt_missing", "{{ '{} {}'.format(1) }}"),
    # call blocks
    ("fmt_numbers", "{{ '{:5}|{:<5}|{:=+8.2f}|{:#x}|{:08.3f}|{:e}|{:.1%}|{:g}|{:.3}|{: d}|{:c}'.format(42, 1.5, 3.14159, 255, -2.5, 1234.5, 0.256, 0.00001234, 3.14159, 7, 65) }}"),
    ("fmt_strings", "{{ '[{:10}]|[{:>10.3}]|[{:_<6}]|[{:\u00e9^7}]'.format('left', 'truncated', 'ab', 'mid') }}|{{ '{}{}'.format(true, none) }}|{{ '{:d}'.format(true) }}"),
    ("fmt_more", "{{ '{:.2}|{:.2}|{:.3}|{}|{:}|{:5}|{:<5}|{!r:>6}'.format(3.0, 1e20, 2.5, 1e16, none, true, false, 'q') }}|{{ '{:^6}|{:^7}|{:*>3}|{:.0f}|{:.0f}'.format('ab', 'ab', 'toolong', 2.5, 3.5) }}"),
    ("fmt_mixed_numbering", "{{ '{}{0}'.format(1) }}"),
    ("pct_hex_octal", "{{ '%x|%#x|%#X|%.4x|%#8x|%-#8o|%#08x|%+x|%o' % (-255, -255, 255, 10, 255, 8, 255, 5, -8) }}"),
    ("fmt_none_spec", "{{ '{:5}'.format(none) }}"),
    ("fmt_bad_code", "{{ '{:d}'.format('x') }}"),
    ("fmt_single_brace", "{{ 'a } b'.format() }}"),
    ("fmt_missing_key", "{{ '{x}'.format(y=1) }}"),
    ("call_simple", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold{% endcall %}"),
    ("call_args", "{% macro each(items) %}{% for i in items %}{{ caller(i, loop.index) }}{% endfor %}{% endmacro %}"
                  "{% call(x, n) each(['a', 'b']) %}[{{ n }}:{{ x }}]{% endcall %}"),
    ("call_outer_vars", "{% set y = 5 %}{% macro twice() %}{{ caller() }}{{ caller() }}{% endmacro %}"
                        "{% for i in [1, 2] %}{% call twice() %}{{ i }}{{ y }}{% endcall %};{% endfor %}"),
    ("call_whitespace", "{% macro box() %}\n  [{{ caller() }}]\n{% endmacro %}\n{% call box() %}\n  inner\n{% endcall %}\nend"),
    ("call_kwargs", "{% macro m(a, b='B') %}{{ a }}{{ b }}{{ caller() }}{% endmacro %}{% call m(b='x', a='y') %}!{% endcall %}"),
    ("call_nested", "{% macro w(t) %}<{{ t }}>{{ caller() }}</{{ t }}>{% endmacro %}{% call w('a') %}{% call w('b') %}x{% endcall %}{% endcall %}"),
    ("call_no_caller_param", "{% macro m() %}plain{% endmacro %}{% call m() %}x{% endcall %}"),
    ("caller_undefined", "{% macro m() %}[{{ caller is defined }}]{% endmacro %}{{ m() }}"),
    # recursive loops
    ("call_in_loop_and_macro", "{% macro li(x) %}<li>{{ caller(x | upper) }}</li>{% endmacro %}{% macro ul(xs) %}<ul>{% for x in xs %}{% call(y) li(x) %}{{ y }}{{ loop.index }}{% endcall %}{% endfor %}</ul>{% endmacro %}{{ ul(['a', 'b']) }}"),
    ("call_caller_default", "{% macro m() %}{{ caller() }}{{ caller('z') }}{% endmacro %}{% call(v='d') m() %}[{{ v }}]{% endcall %}"),
    ("call_not_macro", "{% call range(3) %}x{% endcall %}"),
    ("recursive", "{% for item in tree recursive %}{{ item.name }}{% if item.children %}({{ loop(item.children) }}){% endif %}"
                  "{% if not loop.last %},{% endif %}{% endfor %}", {"tree": TREE}),
    ("recursive_depth", "{% for item in tree recursive %}{{ loop.depth }}{{ loop.depth0 }}{{ item.name }}/{{ loop.index }}"
                        "{{ loop(item.children) }};{% endfor %}", {"tree": TREE}),
    ("recursive_filter_else", "{% for item in tree if item.name != 'a1' recursive %}{{ item.name }}"
                              "[{{ loop(item.children) }}]{% else %}-{% endfor %}", {"tree": TREE}),
    ("recursive_lines", "{% for item in tree recursive %}\n{{ '  ' * loop.depth0 }}- {{ item.name }}\n"
                        "{% if item.children %}\n{{ loop(item.children) }}{% endif %}\n{% endfor %}", {"tree": TREE}),
    ("macro_varargs_kwargs", "{% macro m(a) %}{{ a }}|{{ varargs }}|{{ kwargs | dictsort }}{% endmacro %}{{ m(1, 2, 3, x=4, a2=5) }}|{{ m(0) }}"),
    ("call_splats", "{{ range(*[1, 4]) | list }}|{% macro m(a, b, c='C') %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ m(*[1], **{'b': 2}) }}{{ m(0, *[1, 2]) }}{{ m(c='z', **{'a': 'x', 'b': 'y'}) }}"
                    "|{{ 'x{}{}'.format(*['a', 'b']) }}|{{ '{k}'.format(**{'k': 'v'}) }}|{{ dict(b=2, **{'a': 1}) | dictsort }}|{{ [1, 2] | join(*['-']) }}|{{ 'a' is in(*['abc']) }}"),
    ("call_keyword_after_splat", "{{ dict(**{'a': 1}, b=2) }}"),
    ("call_splat_not_mapping", "{{ range(**[1]) }}"),
    ("call_splat_duplicate", "{% macro m(a) %}{% endmacro %}{{ m(a=1, **{'a': 2}) }}"),
    ("macro_no_varargs", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}"),
    ("macro_no_kwargs", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, b=2) }}"),
    ("loop_changed", "{% for p in people | sort(attribute='city') %}{% if loop.changed(p.city | lower) %}[{{ p.city }}]{% endif %}{{ p.name }} {% endfor %}", {"people": PEOPLE}),
    ("with_block", "{% set a = 1 %}{% with a = 2, b = a %}{{ a }}{{ b }}{% set c = 3 %}{{ c }}{% endwith %}{{ a }}{{ c is defined }}"),
    ("with_whitespace", "<\n  {% with x = 'v' %}\n  {{ x }}\n  {% endwith %}\n>"),
    ("raw_block", "a\n  {% raw %}\n  {{ x }} {% if %}\n  {% endraw %}\nb|{% raw %}{% endraw %}|{%raw%}x{%endraw%}|{% raw %}{# c #}{% endraw +%}\n."),
    ("raw_minus", "a {%- raw -%}  {{ y }}  {%- endraw -%} b|{%- raw %} {% endraw -%} c"),
    ("raw_unterminated", "{% raw %}{{ x }}"),
    ("block_in_place", "{% set a = 1 %}{% block b %}[{{ a }}]{% endblock %}{% for x in [1, 2] %}{% block c %}{{ x }}{% endblock %}{% block d scoped %}{{ x }}{% endblock d %}{% endfor %}"
                       "{% block e %}{% set q = 1 %}{% endblock %}{{ q }}|\n  {% block f %}\n  body\n  {% endblock %}\nend"),
    ("block_twice", "{% block b %}x{% endblock %}{% block b %}y{% endblock %}"),
    ("block_required_text", "{% block b required %}x{% endblock %}"),
    ("block_required_empty", "{% block b required %} {# c #} {% endblock %}"),
    # filter blocks
    ("recursive_outer_vars", "{% set sep = '/' %}{% for item in tree recursive %}{{ sep }}{{ item.name }}{% if loop.depth < 2 %}{{ loop(item.children) }}{% endif %}{% endfor %}", {"tree": TREE}),
    ("recursive_loop_not_marked", "{% for x in [[1]] %}{{ loop(x) }}{% endfor %}"),
    ("recursive_macro", "{% macro walk(items, d) %}{% for i in items %}{{ d }}{{ i.name }} {{ walk(i.children, d ~ '-') }}{% endfor %}{% endmacro %}{{ walk(tree, '') }}", {"tree": TREE}),
    ("filter_block", "{% filter upper %}abc {{ 'x' }}{% endfilter %}|{% filter replace('a', 'o') | title %}a cat{% endfilter %}"),
    ("filter_block_indent", "{% filter indent(2) %}\nline1\nline2\n{% endfilter %}"),
    # case mapping
    ("case_latin1", "{{ 'àéîõü çñ ÿ' | upper }}|{{ 'ÀÉÎÕÜ ÇÑ Þ' | lower }}|{{ 'straße' | upper }}|{{ 'ÆØÅ' | lower }}"),
    ("case_latin_ext", "{{ 'łódź żółć ő ű ğ ş ı' | upper }}|{{ 'ŁÓDŹ ŻÓŁĆ Ő Ű Ğ Ş İ' | lower }}|{{ 'ŉ' | upper }}"),
    ("case_greek", "{{ 'αβγ δέλτα ω' | upper }}|{{ 'ΑΒΓ ΔΈΛΤΑ Ω' | lower }}|{{ 'ΟΔΟΣ ΣΑΣ Σ' | lower }}|{{ 'ΐ' | upper }}"),
    ("case_cyrillic", "{{ 'привет мир ёж ї' | upper }}|{{ 'ПРИВЕТ МИР ЁЖ Ї' | lower }}|{{ 'привет' | capitalize }}"),
    ("case_title", "{{ 'élan vital-ñu (éx) [ça] <ßa>' | title }}|{{ 'ÉCOLE ÉTÉ' | title }}|{{ 'hello 1st world' | title }}"),
    ("case_methods", "{{ 'élan ÉTÉ'.upper() }}|{{ 'ÉLAN'.lower() }}|{{ 'éLAN vital 1st'.title() }}|{{ 'ÉLAN'.capitalize() }}|{{ 'ǆemal'.title() }}"),
    ("case_tests", "{{ 'é' is lower }}{{ 'É' is upper }}{{ 'É' is lower }}{{ '1' is lower }}{{ 'ab1' is lower }}{{ ['a'] is lower }}{{ none is upper }}{{ x is lower }}{{ 5 is lower }}"),
    ("case_data", "{{ m | upper }}", {"m": "ünïcödé Ωmega"}),
    # loop objects
    ("case_more", "{{ 'ǆ ǈ' | upper }}|{{ 'ǅ' | lower }}|{{ 'ΣΑΣ. Σ' | lower }}|{{ 'ﬁ' | upper }}|{{ 'ᾳ' | upper }}|{{ 'ǆungla' | capitalize }}|{{ '日本abc'.title() }}|{{ 'x-ǆ' | title }}"),
    ("case_isupper", "{{ 'ÉTÉ 1'.isupper() }}{{ 'été'.islower() }}{{ 'Été'.isupper() }}{{ '日本'.islower() }}{{ 'ǅ'.isupper() }}"),
    ("loop_stored", "{% set ns = namespace() %}{% for x in [1, 2, 3] %}{% if loop.first %}{% set ns.l = loop %}{% endif %}"
                    "{{ ns.l.index }}{% endfor %}{{ ns.l.index }}{{ ns.l.last }}"),
    ("loop_stored_nested", "{% for x in [1, 2] %}{% set outer = loop %}{% for y in 'ab' %}{{ outer.index }}{{ loop.index }}{{ y }},{% endfor %}{% endfor %}"),
    ("loop_iteration_scope", "{% for x in [1, 2] %}{% if loop.first %}{% set z = 5 %}{% endif %}{{ z }};{% endfor %}{{ x }}"),
    ("loop_attrs", "{% for x in 'abc' %}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.length }}{{ loop.cycle('o', 'e') }} {% endfor %}"),
    ("loop_filtered", "{% for x in range(6) if x is odd %}{{ loop.index }}/{{ loop.length }}/{{ loop.revindex }}/{{ loop.previtem }}/{{ loop.nextitem }} {% endfor %}"),
    ("loop_nested_shadow", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{% endfor %}{{ loop.index }}{{ loop.cycle('a', 'b') }};{% endfor %}"),
    ("loop_else_break", "{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% else %}none{% endfor %}|{% for x in [] if x %}{% else %}empty{% endfor %}"),
    ("loop_unpack_items", "{% for k, v in {'a': [1, 2], 'b': []} | dictsort %}{{ k }}{% for x in v %}{{ x }}{% else %}-{% endfor %}{% endfor %}"),
    # filters real templates use
    ("loop_stored_list", "{% set ns = namespace(l=[]) %}{% for x in [1, 2, 3] %}{% set ns.l = ns.l + [loop] %}{% endfor %}{% for l in ns.l %}{{ l.index }}{% endfor %}"),
    ("loop_var_after", "{% for x in [1, 2] %}{% set l = loop %}{% endfor %}{{ l is defined }}{{ x is defined }}"),
    ("macro_no_caller_scope", "{% macro m() %}[{{ y }}]{% endmacro %}{% for y in [7] %}{{ m() }}{% endfor %}{% set x = 0 %}{% macro n() %}{{ x }}{% endmacro %}{% set x = 5 %}{{ n() }}"),
    ("dictsort", "{{ {'b': 1, 'A': 2, 'c': 0} | dictsort }}|{{ {'b': 1, 'A': 2} | dictsort(true) }}|{{ {'b': 1, 'a': 2, 'c': 0} | dictsort(by='value', reverse=true) }}"),
    ("batch", "{{ [1, 2, 3, 4, 5] | batch(2) | list }}|{{ [1, 2, 3] | batch(2, 'x') | list }}|{% for r in 'abcd' | batch(3) %}{{ r | join }};{% endfor %}"),
    ("slice", "{{ [1, 2, 3, 4, 5] | slice(2) | list }}|{{ [1, 2, 3, 4] | slice(3, 0) | list }}|{{ [1] | slice(3) | list }}"),
    ("sum_min_max", "{{ [1, 2.5, 3] | sum }}|{{ people | sum(attribute='age') }}|{{ [1, 2] | sum(start=10) }}|{{ [3, 1, 2] | min }}|{{ ['b', 'A', 'c'] | max }}"
                    "|{{ ['b', 'A', 'c'] | min }}|{{ ['b', 'A', 'c'] | max(case_sensitive=true) }}|{{ (people | max(attribute='age')).name }}|{{ (people | min(attribute='name')).name }}",
     {"people": PEOPLE}),
    ("filters_edges", "{{ [1.5, 2.25] | sum }}|{{ 1234.5678 | round(-2) }}|{{ 'abcdefghij' | truncate(5, leeway=0) }}|{{ 'abcdefghij' | truncate(10, leeway=0) }}"
                      "|{{ [1, 2, 3, 4] | batch(2, 'x') | list }}|{{ [1, 2, 3] | slice(3, 'f') | list }}|{{ [] | min }}|{{ [] | batch(3) | list }}"
                      "|{{ people | groupby('missing', default='none') | map('first') | list }}|{{ [[1, 'a'], [2, 'b'], [1, 'c']] | groupby(0) | map('last') | list }}"
                      "|{{ people | max(attribute='city') | attr('name') }}|{{ [1, 1.0, true] | unique | list }}", {"people": PEOPLE}),
    ("abs_round", "{{ -3 | abs }}|{{ -2.5 | abs }}|{{ 2.5 | round }}|{{ 3.5 | round }}|{{ 2.675 | round(2) }}|{{ 1234 | round(-2) }}|{{ 5 | round }}"
                  "|{{ 2.1 | round(method='ceil') }}|{{ 2.9 | round(0, 'floor') }}|{{ -0.5 | round }}|{{ 7.25 | round(1) }}"),
    ("wordcount", "{{ 'hello, world!' | wordcount }}|{{ 'a-b c_d  e.f' | wordcount }}|{{ '' | wordcount }}|{{ 'héllo wörld' | wordcount }}"),
    ("indent", "{{ 'a\nb\n\nc' | indent }}|{{ 'a\nb' | indent(2, true) }}|{{ 'a\n\nb' | indent(width='> ', blank=true) }}"),
    ("center", "[{{ 'ab' | center(7) }}]|[{{ 'abc' | center(6) }}]|[{{ 'héllo' | center(9) }}]|[{{ 'long' | center(2) }}]|[{{ 'x' | center }}]"),
    ("justify_methods", "[{{ 'ab'.center(7) }}|{{ 'ab'.center(6, '*') }}|{{ 'é'.ljust(4, 'ü') }}|{{ 'x'.rjust(3) }}|{{ 'long'.rjust(2) }}|{{ '42'.zfill(5) }}|{{ '-42'.zfill(5) }}|{{ '+7'.zfill(1) }}|{{ ''.zfill(2) }}]"),
    ("justify_bad_fill", "{{ 'a'.center(5, 'xy') }}"),
    ("truncate", "{{ 'foo bar baz qux' | truncate(9) }}|{{ 'foo bar baz qux' | truncate(9, true) }}|{{ 'foo bar baz qux' | truncate(11, false, '..', 0) }}"
                 "|{{ 'short' | truncate(3, leeway=5) }}|{{ ('x' * 300) | truncate | length }}|{{ 'héllo wörld again' | truncate(10, leeway=0) }}"),
    ("reverse", "{{ 'abc' | reverse }}|{{ [1, 2, 3] | reverse | list }}|{{ 'héllo' | reverse }}"),
    ("sort_attr", "{{ people | sort(attribute='age') | map(attribute='name') | join(',') }}|{{ people | sort(attribute='name', reverse=true) | map(attribute='name') | join(',') }}"
                  "|{{ people | sort(attribute='city,age') | map(attribute='name') | join(',') }}|{{ ['b', 'A', 'c'] | sort }}|{{ ['b', 'A', 'c'] | sort(case_sensitive=true) }}",
     {"people": PEOPLE}),
    ("groupby", "{% for g in people | groupby('city') %}{{ g.grouper }}:{{ g.list | map(attribute='name') | join('+') }};{% endfor %}"
                "|{% for city, ps in people | groupby('city', case_sensitive=true) %}{{ city }}={{ ps | length }};{% endfor %}",
     {"people": PEOPLE}),
    ("groupby_printed", "{{ [{'a': 1}, {'a': 2}, {'a': 1}] | groupby('a') }}|{{ ([{'a': 'x'}] | groupby('a'))[0].grouper }}"),
    ("tojson_indent", "{{ {'a': [1, {'b': none}], 'c': 'é'} | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|{{ {'x': 1} | tojson(indent='\t') }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}"),
    # operators
    ("in_strings_dicts", "{{ 'ell' in 'hello' }}{{ '' in 'x' }}{{ 'z' not in 'abc' }}{{ 'a' in {'a': 1} }}{{ 1 in {'a': 1} }}{{ 'b' in ['a', 'b'] }}{{ 'x' in m }}", {"m": {"x": 0}}),
    ("string_mul", "{{ 'ab' * 3 }}|{{ 2 * 'x' }}|{{ 'x' * 0 }}|{{ '-' * -1 }}|{{ [1] * 2 }}"),
    ("tilde_numbers", "{{ 1 ~ 2 }}|{{ 1.5 ~ 'x' }}|{{ 'n' ~ none ~ true }}|{{ [1] ~ '' }}"),
    ("int_div_pow", "{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7.5 // 2 }}|{{ 2 ** 10 }}|{{ 2 ** -1 }}|{{ 2.0 ** 3 }}|{{ 2 ** 3 ** 2 }}|{{ -2 ** 2 }}|{{ 7 % 3 }}|{{ -7 % 3 }}|{{ 7.5 % 2 }}"),
    # tests
    ("test_divisibleby", "{{ 9 is divisibleby 3 }}{{ 10 is divisibleby(3) }}{{ 0 is divisibleby 5 }}{{ 4 is even }}{{ 3 is even }}{{ -3 is odd }}{{ 0 is odd }}"),
    ("test_sameas", "{{ none is sameas none }}{{ true is sameas true }}{{ false is sameas 0 }}{{ 1 is sameas true }}{{ x is sameas x }}{{ [1] is sameas [1] }}{{ x is sameas y }}", {"x": [1], "y": [1]}),
    # namespaces
    ("namespace_basic", "{% set ns = namespace(a=1, b='x') %}{% set ns.a = ns.a + 1 %}{% set ns.c = [ns.b] %}{{ ns.a }}{{ ns.b }}{{ ns.c }}{{ ns.d is defined }}"),
    ("namespace_in_loop", "{% set ns = namespace(found=false, items=[]) %}{% for x in [1, 2, 3] %}{% if x == 2 %}{% set ns.found = true %}{% endif %}"
                          "{% set ns.items = ns.items + [x * 2] %}{% endfor %}{{ ns.found }}{{ ns.items }}"),
    ("namespace_from_dict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}{% set ns.a = 'z' %}{{ ns['a'] }}"),
    ("namespace_macro", "{% set ns = namespace(n=0) %}{% macro bump(n) %}{% set ns.n = ns.n + n %}{% endmacro %}{{ bump(2) }}{{ bump(3) }}{{ ns.n }}"),
    ("namespace_not_ns", "{% set d = {} %}{% set d.x = 1 %}"),
    # whitespace control
    ("ws_lstrip", "<\n    {% if true %}\n    yes\n    {% endif %}\n>"),
    ("ws_plus_open", "<\n    {%+ if true %}x{% endif %}\n>"),
    ("ws_plus_close", "<{% if true +%}\nx{% endif +%}\n>"),
    ("ws_minus", "a   {%- if true -%}   b   {%- endif -%}   c"),
    ("ws_vars_not_lstripped", "<\n    {{ 'v' }}\n    {# c #}\n>"),
    ("ws_comment_minus", "a  {#- c -#}  b\n  {# c2 #}\nc"),
    ("ws_text_before_tag", "x {% if true %}y{% endif %}\n  z {% if true %}\nw{% endif %}"),
    ("ws_trailing_newline", "{% for x in [1, 2] %}\n{{ x }}\n{% endfor %}\n"),
    ("ws_tab_crlf", "a\r\n\t{% if true %}\r\nb\r\n\t{% endif %}\r\nc"),
    ("ws_plus_minus_mix", "a\n  {%+ if true -%}\n  b\n  {%- endif +%}\nc"),
    ("ws_comment_plus", "a\n{# c +#}\nb\n  {# d +#}\nc\n{#- e +#}\nd {#+ f #}\ne"),
    # unknown filter and test names: an error at parse time, except in an if or a conditional
    # expression (up to the next loop, macro, call, filter, set or with body), where only evaluating
    # them fails
    ("unknown_filter_soft", "{% if false %}{{ x | nosuch }}{% elif false and x | nosuch2 %}{% else %}[{{ 'a' if true else y | nosuch }}]{% endif %}|{% if true %}{% set z = 1 if true else (2 | nosuch) %}{{ z }}{% endif %}|{% if false %}{% for x in y | nosuch %}{% endfor %}{% with a = 1 | nosuch %}{% endwith %}{% endif %}|{{ 1 if x is defined else x is nosuch }}", {"x": 0}),
    ("unknown_test_top", "{{ x is defined and x is nosuch }}"),
    ("unknown_filter_soft_taken", "{% if true %}{{ 1 | nosuch }}{% endif %}"),
    ("unknown_test_soft_taken", "{{ 'y' if 1 is nosuch else 'n' }}"),
    ("unknown_filter_top", "{{ 1 | nosuch }}"),
    ("unknown_filter_loop_body", "{% if false %}{% for x in [] %}{{ x | nosuch }}{% endfor %}{% endif %}"),
    ("unknown_filter_loop_filter", "{% if false %}{% for x in [] if x is nosuch %}{% endfor %}{% endif %}"),
    ("unknown_filter_macro", "{% if false %}{% macro m() %}{{ 1 | nosuch }}{% endmacro %}{% endif %}"),
    ("unknown_filter_caller", "{% macro m() %}{{ caller() }}{% endmacro %}{% if false %}{% call m() %}{{ 1 | nosuch }}{% endcall %}{% endif %}"),
    ("unknown_filter_with_body", "{% if false %}{% with a = 1 %}{{ a | nosuch }}{% endwith %}{% endif %}"),
    ("unknown_filter_set_block", "{% if false %}{% set a | nosuch %}x{% endset %}{% endif %}"),
    # str.splitlines at every line boundary Python knows; floats as repr writes them
    ("splitlines_boundaries", "{{ 'a\\r\\nb\\rc\\x0bd\\x0ce\\x1cf\\x85g\\u2028h\\u2029i'.splitlines() }}|{{ 'a\\r\\nb\\n'.splitlines(true) }}"
                              "|{{ ''.splitlines() }}|{{ '\\n'.splitlines() }}|{{ 'x\\n\\n'.splitlines(keepends=true) }}|{{ m.splitlines() }}", {"m": "línea 1\r\nlínea 2\r\n"}),
    ("float_repr_small", "{{ [0.0001, 0.00001, 0.000123, 1.5e-5, 1e-4] }}|{{ [1e-5, 0.0001] | tojson }}|{{ 1e-05 ~ '' }}|{{ m | tojson }}", {"m": {"minimum": 1e-05}}),
    # repr escapes what is not printable (\xa0, \u200b, \u2028, \U000e0001), as Python's does
    ("repr_not_printable", "{{ m }}|{{ m | string }}|{{ '%r' % m.d }}|{{ '{!r}'.format(m.d) }}|{{ [m.d ~ 'é😀'] }}|{{ m.d }}|{{ ['\\u00ad\\u3000', '\\x85'] }}",
     {"m": {"d": "a\u00a0b\u200bc\u2028d\U000e0001e", "ok": "café ✓ 日本 😀"}}),
    ("str_isspace_unicode", "{{ '\\u00a0\\u3000 \\x1c'.isspace() }}{{ m.isspace() }}{{ 'a '.isspace() }}{{ ''.isspace() }}{{ '\\u200b'.isspace() }}", {"m": "\u2028\t\u2003"}),
    # str.join takes strings only (the join filter converts)
    ("str_join_strings", "{{ '-'.join(['a', m]) }}|{{ ''.join('xyz') }}|{{ ', '.join(d) }}|{{ [1, none] | join('-') }}", {"m": "b", "d": {"k": 1, "l": 2}}),
    ("str_join_not_string", "{{ '-'.join(['a', 1]) }}"),
    # more str methods: rfind and rindex find the last match even where matches overlap
    ("str_find_partition", "{{ 'aaa'.rfind('aa') }}{{ 'aaa'.rindex('a') }}{{ m.rfind('-') }}{{ m.find('-') }}{{ 'abc'.rfind('') }}{{ 'ab'.rfind('x') }}"
                           "|{{ m.partition('-') }}{{ m.rpartition('-') }}{{ m.partition('?') }}{{ m.rpartition('?') }}|{{ m.isascii() }}{{ 'ab'.isascii() }}",
     {"m": "é-a-b"}),
    ("str_rindex_missing", "{{ 'abc'.rindex('z') }}"),
    ("str_partition_empty", "{{ 'abc'.partition('') }}"),
    # ** as Python's: (-1) ** n by parity, float overflow is an error
    ("pow_edges", "{{ (-1) ** 3 }}|{{ (-1) ** 4 }}|{{ m ** 9223372036854775807 }}|{{ 0 ** 0 }}|{{ 1 ** 99 }}|{{ (-2) ** 3 }}|{{ 2 ** -2 }}|{{ (-8.0) ** 2 }}|{{ 4 ** 0.5 }}", {"m": -1}),
    ("pow_float_overflow", "{{ 2.5 ** m }}", {"m": 1000}),
    ("pow_zero_negative", "{{ 0 ** m }}", {"m": -1}),
    # odd, even and divisibleby take floats as Python's % does
    ("test_parity_floats", "{{ 1000.0 is even }}{{ 2.5 is odd }}{{ -3.0 is odd }}{{ 2.5 is divisibleby 0.5 }}{{ 7 is divisibleby 2.0 }}{{ 3.0 is even }}{{ m is odd }}", {"m": 5.0}),
    # truncate and indent take strings (truncate: or a list short enough); % of a list or dict
    # does not check for arguments left over
    ("truncate_not_string", "{{ 5 | truncate(3) }}"),
    ("truncate_none", "{{ m | truncate }}", {"m": None}),
    ("truncate_short_list", "{{ [1, 2] | truncate(3, leeway=0) }}|{{ {'a': 1} | truncate }}"),
    ("indent_not_string", "{{ 5 | indent(2) }}"),
    ("indent_list", "{{ [1] | indent(2) }}"),
    ("pct_list_mapping", "{{ 'abc' % [1] }}|{{ 'abc' % {'a': 1} }}|{{ 'x%sy' % [1, 2] }}|{{ '%(a)s' % m }}", {"m": {"a": "é"}}),
    # what is undefined, in jinja2's words (the test compares UndefinedError messages)
    ("undefined_attr", "{{ m.k.x }}", {"m": {"j": 1}}),
    ("undefined_attr_str", "{{ m.items() }}", {"m": "s"}),
    ("undefined_attr_none", "{{ m.x.y }}", {"m": None}),
    ("undefined_attr_ns", "{% set ns = namespace(a=1) %}{{ ns.b.c }}"),
    ("undefined_attr_loop", "{% for x in [1] %}{{ loop.nope.x }}{% endfor %}"),
    ("undefined_element", "{{ m[5] + 1 }}", {"m": [1, 2]}),
    ("undefined_element_str", "{{ 'ab'[7].x }}"),
    ("undefined_element_key", "{{ m[1].x }}", {"m": {"1": "one"}}),
    ("undefined_element_tuple", "{{ (1, 2)[-3].x }}"),
    ("undefined_item_name", "{{ m['nope'].x }}", {"m": [1]}),
    # {% generation %}: rendered in place, in its own scope
    ("generation_scope", "{% set a = 1 %}{% set ns = namespace(n=0) %}{% for i in [1, 2] %}{% generation %}{% set a = i * 10 %}{% set b = 2 %}"
                         "{% set ns.n = ns.n + i %}[{{ a }}{{ b }}{{ loop.index }}]{% endgeneration %}{{ a }}{{ b is defined }};{% endfor %}{{ ns.n }}"
                         "\n  {% generation %}\n  x\n  {% endgeneration %}\n."),
    ("tests_more_names", "{{ 3 is greaterthan 2 }}{{ 1 is lessthan(0) }}{{ 'wordwrap' is filter }}{{ 'nosuch' is filter }}{{ 'lessthan' is test }}"),
    # str methods' start and end arguments (code points, negative from the end, none)
    ("str_method_ranges", "{{ 'abc'.startswith('b', 1) }}{{ 'abc'.startswith('', 3) }}{{ 'abc'.startswith('', 4) }}"
                          "{{ 'abc'.endswith('b', 0, -1) }}{{ 'abc'.endswith(('x', 'c'), -1, none) }}|{{ 'éaéb'.find('é', 1) }}"
                          "|{{ 'éaéb'.rfind('é', 0, -2) }}|{{ 'abc'.find('', 3) }}|{{ 'abc'.find('', 4) }}|{{ 'abcabc'.find('c', -20, -4) }}"
                          "|{{ 'abcabc'.count('b', 2) }}|{{ 'abc'.count('', 1) }}|{{ 'abc'.count('', 5) }}|{{ 'abcabc'.index('c', 3, 6) }}"),
    ("str_method_range_not_found", "{{ 'abc'.index('a', 1) }}"),
    ("str_method_range_bad_index", "{{ 'abc'.find('a', 'x') }}"),
    ("str_method_range_bad_prefix", "{{ 'é'.startswith(none, 2) }}"),
    ("splitlines_keepends_not_int", "{{ 'a\nb'.splitlines(keepends=1) }}{{ 'a\nb'.splitlines(',') }}"),
    # split(None, maxsplit): the rest keeps its whitespace on the far side
    ("split_whitespace_maxsplit", "{{ '  a b  c  '.split(none, 1) }}{{ '  a b  c  '.rsplit(none, 1) }}{{ ' a '.split(none, 0) }}"
                                  "{{ ' a '.rsplit(none, 0) }}{{ 'a  '.split(none, 1) }}{{ ' x\ty\n'.split(maxsplit=1) }}"),
    # strftime_now formats a naive datetime: no zone
    ("strftime_no_zone", "{{ strftime_now('%d|%Z|%z|%%Z|%%%z|%H') }}"),
    # an undefined value formats as '' with %s (jinja2's str of Undefined), but is no number or mapping
    ("pct_undefined", "{{ 'Hi %s!' % m.nope }}|{{ '%s-%s' % (nope, 1) }}|{{ '[%5s]' % m.nope }}", {"m": {}}),
    ("pct_undefined_number", "{{ '%d' % m.nope }}", {"m": {}}),
    ("pct_undefined_mapping", "{{ '%(a)s' % m.nope }}", {"m": {}}),
    ("list_plus_tuple", "{{ [1] + (2,) }}"),
    ("tuple_plus_tuple", "{{ (1,) + (2, 3) }}|{{ [1] + [2] }}"),
    # an if's test and a for's iterable may be tuples without parentheses
    ("tuple_unparenthesized_tests", "{% for a in 1, 2 %}{{ a }}{% endfor %}|{% for a in 'x', 'y', 'z' if a != 'y' %}{{ a }}{% endfor %}"
                                    "|{% for a in 'p', 'q' recursive %}{{ a }}{% endfor %}|{% if 0, %}t{% endif %}"
                                    "|{% if false %}{% elif 1, 2 %}e{% endif %}"),
    # first, last, min and max of an empty sequence: jinja2's undefined with its hint
    ("first_empty_undefined", "[{{ []|first }}{{ []|last|default('L') }}{{ []|min is defined }}]{{ []|first|attr('x') }}"),
    ("last_empty_undefined", "{{ ([]|last).x }}"),
    ("max_empty_undefined", "{{ ([]|max).y }}"),
    # the undefined values jinja2 gives a hint: a parameter left out, no caller, no previous item
    ("macro_param_missing_hint", "{% macro f(a, b) %}[{{ a }}]{{ b is defined }}{{ a.x }}{% endmacro %}{{ f() }}"),
    ("macro_no_caller_hint", "{% macro f() %}{{ caller is defined }}{{ caller().x }}{% endmacro %}{{ f() }}"),
    ("loop_previtem_hint", "{% for x in [1, 2] %}{{ loop.previtem is defined }}{% if not loop.first %}{{ loop.nextitem.a }}{% endif %}{% endfor %}"),
    # a modifying method is an undefined attribute (the immutable sandbox), even over a dict's key
    ("modifying_methods_undefined", "{% set s = {'pop': 1, 'update': 2, 'get': 3} %}{{ s.pop is defined }}{{ s.update is defined }}"
                                    "{{ s|attr('clear') is defined }}{{ s.get is callable }}{{ s['pop'] }}|{{ [1].append is defined }}"
                                    "{{ [1].sort is defined }}{{ (1, 2).count(2) }}[{{ [1].reverse }}]"),
    ("modifying_method_called", "{% set d = {'a': 1} %}{{ d.setdefault('b', 2) }}"),
    # integer literals in base 16, 8 and 2, with underscores as in decimal ones
    ("int_literal_bases", "{{ 0x1F }}|{{ 0o17 }}|{{ 0b101 }}|{{ 0X_ff }}|{{ 0B1_0 }}|{{ 0x10 + 1_000 }}|{{ 0x7fffffffffffffff }}"),
    ("int_literal_base_empty", "{{ 0x }}"),
    # round's ceil and floor go through Python's int: no negative zero
    ("round_ceil_floor_zero", "{{ -0.2|round(0, 'ceil') }}|{{ -0.004|round(2, 'ceil') }}|{{ -0.0|round(1, 'floor') }}|{{ -0.2|round }}|{{ -0.5|round(0, 'floor') }}"),
    # filters of an undefined value: truncate keeps it (its length is 0); int, float, indent and
    # dictsort fail with jinja2's UndefinedError
    ("undefined_truncate", "[{{ m.nope|truncate(5) }}{{ ([]|min)|truncate(3, end='') }}{{ m.nope|truncate is defined }}]", {"m": {}}),
    ("undefined_int", "{{ m.nope|int(5) }}", {"m": {}}),
    ("undefined_float", "{{ m.nope|float }}", {"m": {}}),
    ("undefined_indent", "{{ m.nope|indent(2) }}", {"m": {}}),
    ("undefined_dictsort", "{{ m.nope|dictsort }}", {"m": {}}),
    # a list or dict is not a key a dict can have
    ("in_dict_unhashable", "{{ 'a' in {'a': 1} }}{{ (1, 2) in {'a': 1} }}{{ ['a'] in {'a': 1} }}"),
    # a for's else block has the loop's scope: what it sets stays inside
    ("for_else_scope", "{% set e = 0 %}{% set ns = namespace(n=0) %}{% for i in [] %}{% else %}{% set e = 1 %}{% set f = 2 %}"
                       "{% set ns.n = 3 %}{{ e }}{{ f }}{% endfor %}|{{ e }}{{ f is defined }}{{ ns.n }}"),
    # a filter jinja2 has and moed does not (wordwrap, striptags, ...) fails only where applied
    ("unimplemented_filter_unused", "{% if false %}{{ x|wordwrap }}{% endif %}{% for i in [] %}{{ i|striptags }}{% endfor %}"
                                    "{% macro f() %}{% filter urlencode %}{{ x|pprint }}{% endfilter %}{% endmacro %}ok"),
    # jinja2's joiner and cycler globals
    ("joiner_cycler", "{% set j = joiner(sep=' | ') %}{% for x in [3, 1, 2] %}{{ j() }}{{ x }}{% endfor %}"
                      "|{% set c = cycler('a', 'b', 'c') %}{{ c.current }}{{ c.next() }}{{ c.next() }}{{ c.current }}{{ c.reset() }}"
                      "{{ c.next() }}|{{ c is callable }}{{ joiner() is callable }}{{ c.nope is defined }}"
                      "|{% set k = joiner('-') %}{% macro f() %}{{ k() }}x{% endmacro %}{{ f() }}{{ f() }}{{ f() }}"),
    ("cycler_empty", "{{ cycler() }}"),
    ("cycler_not_callable", "{{ cycler(1)() }}"),
    # a block set may assign a namespace's attribute
    ("set_block_namespace_attr", "{% set ns = namespace(x='') %}{% set ns.x | upper %}block {{ 3 }}{% endset %}{{ ns.x }}|"
                                 "{% for i in [1, 2] %}{% set ns.x %}{{ ns.x }}{{ i }}{% endset %}{% endfor %}{{ ns.x }}"),
    # nested unpacking targets, in for loops and sets, as Python unpacks
    ("unpack_for_nested", "{% for a, (b, c) in [[1, [2, 3]], (4, 'xy')] %}{{ a }}{{ b }}{{ c }};{% endfor %}"
                          "|{% for (a, b) in [[1, 2]] %}{{ a }}{{ b }}{% endfor %}|{% for (a) in [1, 2] %}{{ a }}{% endfor %}"
                          "|{% for (a,) in [[1], 'z'] %}{{ a }}{% endfor %}|{% for ((a, b), c) in [[[1, 2], 3]] %}{{ a }}{{ b }}{{ c }}{% endfor %}"
                          "|{% for (a, b,) in [[1, 2]] %}{{ a }}{{ b }}{% endfor %}|{% for a, (b,) in [[1, [2]]] %}{{ a }}{{ b }}{% endfor %}"
                          "|{% for () in [[], ''] %}e{% endfor %}|{% for a, b in {'k': 1, 'l': 2}.items() %}{{ a }}{{ b }}{% endfor %}"),
    ("unpack_for_filter_recursive", "{% for a, (b, c) in [[1, [2, 3]], [4, [5, 1]]] if c > 2 %}{{ a }}{{ b }}{{ c }}{% endfor %}"
                                    "|{% for n, (k, v) in [['a', ['x', [['b', ['y', []]]]]]] recursive %}{{ n }}{{ k }}[{{ loop(v) }}]{% endfor %}"),
    ("unpack_set_nested", "{% set a, (b, c) = [1, [2, 3]] %}{{ a }}{{ b }}{{ c }}|{% set (a, b) = 4, 5 %}{{ a }}{{ b }}"
                          "|{% set ((a, b), (c, d)) = ((1, 2), (3, 4)) %}{{ a }}{{ b }}{{ c }}{{ d }}|{% set ((a)) = 6 %}{{ a }}"
                          "|{% set (a,) = [7] %}{{ a }}|{% set () = [] %}|{% set a, (b, c) = 'a', 'bc' %}{{ a }}{{ b }}{{ c }}"
                          "|{% set a, b = b, a %}{{ a }}{{ b }}|{% set a, b = {'x': 1, 'y': 2} %}{{ a }}{{ b }}|{% set a, b = 'xy' %}{{ a }}{{ b }}"),
    ("unpack_set_namespace", "{% set ns = namespace(a=0) %}{% set ns.a, b = 1, 2 %}{{ ns.a }}{{ b }}|{% set b, ns.a = 3, 4 %}{{ ns.a }}{{ b }}"
                             "|{% set ns.a, ns.b = 5, 6 %}{{ ns.a }}{{ ns.b }}|{% set ns.a, (b, c) = 7, (8, 9) %}{{ ns.a }}{{ b }}{{ c }}"),
    ("unpack_set_block", "{% set a, b %}xy{% endset %}{{ a }}|{{ b }}|{% set a, b | upper %}pq{% endset %}{{ a }}{{ b }}"
                         "|{% set (a) %}xy{% endset %}{{ a }}|{% set ns = namespace() %}{% set ns.a, %}z{% endset %}{{ ns.a }}"
                         "|{% set ns.a, b %}uv{% endset %}{{ ns.a }}{{ b }}"),
    ("unpack_too_many", "{% set a, b = 1, 2, 3 %}"),
    ("unpack_too_many_nested", "{% for a, (b, c) in [[1, [2, 3, 4]]] %}{% endfor %}"),
    ("unpack_too_many_str", "{% set a, (b, c) = [1, 'xyz'] %}"),
    ("unpack_not_enough", "{% set a, b, c = 1, 2 %}"),
    ("unpack_not_enough_nested", "{% set a, (b, c) = [1, [2]] %}"),
    ("unpack_not_enough_str", "{% for a, b in 'ab' %}{% endfor %}"),
    ("unpack_not_enough_undefined", "{% set a, (b, c) = 1, nothing %}"),
    ("unpack_not_enough_block", "{% set ns = namespace() %}{% set ns.a, b %}x{% endset %}"),
    ("unpack_non_iterable_int", "{% set a, (b, c) = [1, 2] %}"),
    ("unpack_non_iterable_none", "{% for a, (b, c) in [[1, none]] %}{% endfor %}"),
    ("unpack_non_iterable_for", "{% for a, b in [1] if a %}{% endfor %}"),
    ("unpack_non_iterable_empty", "{% for () in [1] %}{% endfor %}"),
    ("unpack_non_iterable_float", "{% set a, b = 1.5 %}"),
    ("unpack_non_iterable_bool", "{% set a, b = true %}"),
    ("unpack_non_iterable_namespace", "{% set a, b = namespace() %}"),
    ("unpack_non_iterable_ns_attr", "{% set ns = namespace() %}{% set ns.a, b = 1 %}"),
    ("unpack_attr_not_namespace", "{% set x = 1 %}{% set x.a, b = 1, 2 %}"),
    ("unpack_trailing_comma_set", "{% set a, = [1] %}"),
    ("unpack_trailing_comma_for", "{% for a, in [[1]] %}{% endfor %}"),
    ("unpack_paren_ns_attr", "{% set ns = namespace() %}{% set (ns.a, b) = 1, 2 %}"),
    ("unpack_nested_ns_attr", "{% set ns = namespace() %}{% set a, (ns.b, c) = 1, (2, 3) %}"),
    ("unpack_for_ns_attr", "{% set ns = namespace() %}{% for a, ns.a in [[1, 2]] %}{% endfor %}"),
    ("unpack_paren_expression", "{% set (a + b) = 1 %}"),
    ("unpack_paren_literal", "{% set (a, 1) = 1, 2 %}"),
    ("unpack_for_literal", "{% for 1 in [1] %}{% endfor %}"),
    ("unpack_unclosed", "{% for (a, (b in [1] %}{% endfor %}"),
    ("unpack_nested_deep", "{% set " + "(" * 20 + "a, b" + ")" * 20 + " = 1, 2 %}{{ a }}{{ b }}"),
    ("unpack_deep", "{% set " + "(" * 150 + "a" + ")" * 150 + " = 1 %}{{ a }}"),
    # range() is a range: printed as Python prints it, sliced to a range, compared as a sequence
    # with other ranges only, not JSON, without list methods and operators
    ("range_print", "{{ range(3) }}|{{ range(1, 5) }}|{{ range(1, 10, 2) }}|{{ range(0) }}|{{ range(5, 1, -1) }}|{{ range(-3) }}"
                    "|{{ [range(2)] }}|{{ (range(2), 1) }}|{{ {'a': range(2)} }}|{{ range(3) | string }}|{{ range(3) ~ '' }}"
                    "|{{ '%s' % range(2) }}|{{ range(3) | string | length }}"),
    ("range_as_sequence", "{{ range(3) | list }}|{{ range(3) | length }}|{{ range(3)[1] }}|{{ range(3) | join(',') }}"
                          "|{{ range(3) | reverse | list }}|{{ range(3) | sum }}|{{ range(3) | map('string') | list }}"
                          "|{% set a, b = range(2) %}{{ a }}{{ b }}|{{ range(3) is sequence }}|{{ range(3) | first }}"),
    ("range_slice", "{{ range(10)[2:5] }}|{{ range(10)[::2] }}|{{ range(10)[::-1] }}|{{ range(1, 20, 3)[1:-1:2] }}"
                    "|{{ range(5)[9:] }}|{{ range(3)[-1] }}|{{ range(10)[2:5] | list }}"),
    ("range_compare", "{{ range(3) == range(0, 3, 1) }}|{{ range(0) == range(2, 2) }}|{{ range(3) == [0, 1, 2] }}"
                      "|{{ range(3) != [0, 1, 2] }}|{{ range(3) | list == [0, 1, 2] }}|{{ range(1, 3) == range(1, 4) }}"),
    ("range_methods", "{{ range(3).index(2) }}|{{ range(3).count(1) }}|{{ range(3).append is defined }}|{{ range(3).copy is defined }}"),
    ("range_tojson", "{{ range(3) | tojson }}"),
    ("range_tojson_nested", "{{ {'a': [range(1)]} | tojson }}"),
    ("range_add", "{{ range(3) + [1] }}"),
    ("range_add_range", "{{ range(3) + range(2) }}"),
    ("range_mul", "{{ range(3) * 2 }}"),
    ("range_list_tojson", "{{ range(3) | list | tojson }}"),
    # the body of a block set or a filter block has its own scope
    ("set_filter_block_scope", "{% set i = 1 %}{% set blk %}a{% set i = 5 %}{% set j = 6 %}{{ i }}{% endset %}{{ blk }}{{ i }}{{ j is defined }}"
                               "|{% filter upper %}{% set i = 7 %}x{{ i }}{% endfilter %}{{ i }}"),
    # break and continue: only in a loop body of the same function (not in a loop's else, a macro
    # or a call block); the else block runs when no iteration reached the end of the body; a
    # filter block left by continue writes nothing
    ("break_outside_loop", "{% for x in [1] %}{% else %}{% break %}{% endfor %}"),
    ("continue_in_macro_in_loop", "{% for x in [1] %}{% macro f() %}{% continue %}{% endmacro %}{% endfor %}"),
    ("continue_in_call_block", "{% macro w() %}{{ caller() }}{% endmacro %}{% for x in [1] %}{% call w() %}{% continue %}{% endcall %}{% endfor %}"),
    ("for_else_after_break_continue", "{% for x in [1, 2] %}{% break %}{% else %}E{% endfor %}|{% for x in [1, 2] %}{{ x }}{% continue %}"
                                      "{% else %}E{% endfor %}|{% for x in [1, 2] %}{{ x }}{% if x == 1 %}{% continue %}{% endif %}"
                                      "{% else %}E{% endfor %}|{% for x in [1, 2] %}{{ x }}{% if x == 2 %}{% break %}{% endif %}{% else %}E{% endfor %}"),
    ("filter_block_continue", "{% for x in [1, 2] %}{% filter upper %}a{% if x == 1 %}{% continue %}{% endif %}b{% endfilter %}{{ x }}"
                              "{% with %}{% if x == 2 %}{% break %}{% endif %}w{% endwith %}{% endfor %}"),
    # a call block's body is a macro of its own: varargs and kwargs of caller(...), and no caller
    ("call_block_own_varargs", "{% macro f() %}{{ caller(1, 2, k=3) }}{% endmacro %}{% call f() %}{{ varargs }}{{ kwargs }}"
                               "{{ caller is defined }}{% endcall %}"),
    ("call_block_no_caller", "{% macro f() %}{{ caller() }}{% endmacro %}{% macro g() %}{% call f() %}in g {{ caller() }}{% endcall %}"
                             "{% endmacro %}{% call g() %}outer{% endcall %}"),
    # %a and !a: Python's ascii(), the repr with escapes beyond ASCII
    ("pct_ascii_conversion", "{{ '%a|%r' % ('é\n', 'é') }}|{{ '%a' % [['ü', '😀'], {'k': 'ÿ\u2028'}] }}|{{ '{!a:>10}|{!a}'.format('é', 'plain') }}"
                             "|{{ '%6a|' % 'é' }}"),
    ("call_keyword_repeated", "{% macro f(a) %}{{ a }}{% endmacro %}{{ f(a=1, a=2) }}"),
]

with open(os.path.join(TOOLS, "..", "tests", "fuzz-corpus", "jinja", "features.jinja"), encoding="utf-8") as f:
    CASES.append(("fuzz_seed_features", f.read(), {
        "messages": [{"role": "user", "content": "hi %"}, {"role": "assistant", "content": "Ça va"}],
        "tools": [{"function": {"name": "f"}, "children": [{"function": {"name": "g"}}]}]}))


class Generation(jinja2.ext.Extension):
    """transformers' {% generation %} tag (AssistantTracker): the body rendered as a call block's
    caller, so what it sets stays inside."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def render_cases():
    e = chat_fixtures.env()
    e.add_extension(Generation)
    out = []
    for c in CASES:
        name, src = c[0], c[1]
        data = c[2] if len(c) > 2 else {}
        case = {"name": name, "template": src, "data": data}
        try:
            case["text"] = e.from_string(src).render(**data)
        except Exception as ex:  # jinja2 raised: moed must raise too
            case["error"] = f"{type(ex).__name__}: {ex}"
        out.append(case)
    return out


def printable_table():
    """The ranges of code points that are not printable: repr writes them as \\x, \\u or \\U
    escapes (Unicode categories Cc, Cf, Cs, Co, Cn, Zl, Zp and Zs but the space)."""
    ranges, start = [], None
    for cp in range(0x110000):
        if not chr(cp).isprintable():
            if start is None:
                start = cp
        elif start is not None:
            ranges.append((start, cp - 1))
            start = None
    if start is not None:
        ranges.append((start, 0x10FFFF))
    import unicodedata
    text = ("/* Generated by tools/jinja-cases.py from Python " + sys.version.split()[0] +
            " (Unicode " + unicodedata.unidata_version + "); do not edit.\n"
            " * The code points Python's repr escapes (not str.isprintable()): first and last of each\n"
            " * range, sorted. */\n"
            "static const uint32_t jprint_escaped[][2] = {\n")
    for a, b in ranges:
        text += f"    {{0x{a:04x}, 0x{b:04x}}},\n"
    return text + "};\n"


def main():
    text = json.dumps(render_cases(), ensure_ascii=False, indent=1) + "\n"
    return chat_fixtures.write_or_check({OUT: text, PRINTABLE: printable_table()}, "tools/jinja-cases.py")


if __name__ == "__main__":
    sys.exit(main())
