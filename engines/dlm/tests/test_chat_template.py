"""sparsa's chat templates (`sparsa chat-template`, `generate --chat`) against Jinja itself.

The reference is the jinja2 package configured as transformers renders chat templates
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop controls, its tojson, the
raise_exception and strftime_now globals), written here, and transformers' own
apply_chat_template where it is installed. The templates are written for this test: a Llama-3
style one, a ChatML one with reasoning and tool calls (the constructs of Qwen3 / SDAR chat
templates), a tool-use one with macros, and one that exercises each expression, filter, test and
whitespace rule. Rendered text must be identical, byte for byte, on seeded random conversations.
"""
import datetime
import json
import os
import random
import subprocess

import pytest

jinja2 = pytest.importorskip("jinja2")
import jinja2.ext  # noqa: E402
import jinja2.nodes  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

import dlm_ref as R  # noqa: E402  (the shipped model's copy with a template)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

CHATML_THINK = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

TOOL_USE = """{{- bos_token }}
{%- macro render_args(args, sep=', ') -%}
{%- for name, value in args | items -%}
{{ name }}={{ value | tojson }}{% if not loop.last %}{{ sep }}{% endif %}
{%- endfor -%}
{%- endmacro %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You may call these functions:\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- "Names: " + tools | map(attribute='function.name') | join(', ') + "\\n" }}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}
{{- "(" ~ users | length ~ " user turns)" }}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("one tool call per turn") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + call.name + '(' + render_args(call.arguments) + ')<|eom_id|>' }}
    {%- elif message.role in ['tool', 'ipython'] %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Each expression, filter, test and whitespace rule the interpreter claims, in one template.
KITCHEN_SINK = r"""A{{ 1 + 2 * 3 - 4 / 2 }}|{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ -2 ** 2 }} {{ 2 ** -1 }}
{{ 1.0 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 1e-5 }} {{ 0.1 + 0.2 }} {{ 10 / 3 }} {{ 1_000 }} {{ 3.0 * 2 }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 7|round }}
{{ [1, 'a', none, true, 1.5, {'k': "it's"}, (1,), (1, 2), []] }} {{ {'a': [1, {'b': none}]} }} {{ ('x', "y\n") }}
{{ 'ab'[::-1] }} {{ 'héllo'[1] }} {{ 'héllo'[1:3] }} {{ [1,2,3,4,5][1:4:2] }} {{ [1,2,3][-1] }} {{ [1,2,3][::-2] }} {{ 'abc'[5] }}|{{ [0][3] }}|
{{ 'a' ~ none ~ 1 ~ true }} {{ 'x' * 3 }} {{ [1] * 2 }} {{ [1] + [2] }} {{ 'a' + 'b' }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }}
{{ 'x' in 'xyz' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'q' not in 'abc' }} {{ not none }} {{ none or 'd' }} {{ 0 and 1 }} {{ '' or [] }} {{ 'y' if 0 else 'n' }}|{{ 'z' if false }}|
{{ ' x '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\n a \n'.lstrip() }}|{{ 'ab  '.rstrip() }}|{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a b c'.rsplit(' ', 1) }} {{ 'a  b c '.split(none, 1) }}
{{ 'aXbX'.replace('X', '-') }} {{ 'aaa'.replace('a', 'b', 2) }} {{ 'ab'.replace('', '.') }} {{ 'Hi'.upper() }} {{ 'Hi'.lower() }} {{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }} {{ 'abcb'.find('b') }} {{ 'abcb'.count('b') }} {{ '-'.join(['a', 'b']) }}
{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'bc')) }} {{ '123'.isdigit() }} {{ ' \t'.isspace() }}
{{ '  t  '|trim }}|{{ 'xxtxx'|trim('x') }}|{{ 'ab'|upper }} {{ 'AB'|lower }} {{ "it's a-b (c)"|title }} {{ 'hELLO'|capitalize }} {{ 'abc'|length }} {{ 'héllo'|length }} {{ [1, 2]|count }} {{ {'a': 1}|length }}
{{ [3, 1, 2]|first }} {{ [3, 1, 2]|last }} {{ 'abc'|first }} {{ [1, 2]|join(', ') }} {{ [1, 2]|join }} {{ [{'n': 'a'}, {'n': 'b'}]|join('/', attribute='n') }} {{ 'abc'|reverse }} {{ [1, 2, 3]|reverse|list }}
{{ x|default('d') }} {{ ''|default('d', true) }} {{ none|default('d') }} {{ x|d('e') }} {{ 'a<b>&"\''|e }} {{ 'a<b'|safe }} {{ 5|string }} {{ '42'|int + 1 }} {{ '4.5'|float }} {{ 'x'|int }} {{ '3.7'|int }} {{ -3|abs }} {{ 2.5|int }}
{{ [3, 1, 2]|sort }} {{ ['b', 'A', 'c']|sort }} {{ ['b', 'A', 'c']|sort(case_sensitive=true) }} {{ [1, 2, 1, 3]|unique|list }} {{ [1, 2, 3]|sum }} {{ [4, 2, 8]|min }} {{ [4, 2, 8]|max }} {{ [3, 1]|sort(reverse=true) }}
{{ [{'a': 2}, {'a': 1}]|sort(attribute='a') }} {{ [{'r': 's'}, {'r': 'u'}]|selectattr('r', 'equalto', 's')|list }} {{ [{'r': 's'}, {'r': 'u'}]|rejectattr('r', 'equalto', 's')|list|length }}
{{ [1, 2, 3, 4]|select('even')|list }} {{ [1, 2, 3, 4]|reject('odd')|list }} {{ [0, 1, '', 'a']|select|list }} {{ ['a', 'b']|map('upper')|list }} {{ [{'a': 1}, {}]|map(attribute='a', default=0)|list }}
{{ {'b': 1, 'a': [1, 2.5, 'é"\n', none, true]}|tojson }} {{ {'b': 1, 'a': {}}|tojson(indent=2) }} {{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }} {{ 'é'|tojson(ensure_ascii=true) }} {{ [[], {}]|tojson(indent=1) }}
{{ {'a': 1}|items|list }} {{ {'a': 1, 'b': 2}.items()|list }} {{ {'a': 1}.keys()|list }} {{ {'a': 1}.values()|list }} {{ {'a': 1}.get('a') }} {{ {'a': 1}.get('z', 9) }} {{ {'a': 1}.get('z') }} {{ {'a': 1}.a }} {{ {'a': [5]}.a.0 }}
{{ 'line1\nline2\n\nline4'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent(3, blank=true) }}|{{ 'a\nb'|indent('> ') }}
{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ x is defined }} {{ x is undefined }} {{ none is none }} {{ 1 is number }} {{ true is number }} {{ 1 is integer }} {{ true is integer }} {{ 1.5 is float }}
{{ 'a' is string }} {{ {} is mapping }} {{ [] is sequence }} {{ 'a' is sequence }} {{ [] is iterable }} {{ 1 is iterable }} {{ true is boolean }} {{ true is true }} {{ false is false }} {{ 1 is sameas 1 }} {{ none is sameas none }}
{{ 2 is eq 2 }} {{ 2 is ne 3 }} {{ 2 is lt 3 }} {{ 2 is gt 3 }} {{ 2 is le 2 }} {{ 2 is ge 3 }} {{ 2 is in [2] }} {{ 'ab' is lower }} {{ 'AB' is upper }} {{ 3 is not odd }} {{ range is callable }}
{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(5, 0, -2)|list }} {{ range(0)|list }}
{% set ns = namespace(total=0, names=[]) %}{% for i in range(5) %}{% if i == 3 %}{% continue %}{% endif %}{% set ns.total = ns.total + i %}{% set ns.names = ns.names + [i] %}{% endfor %}{{ ns.total }} {{ ns.names }}
{% for a, b in [(1, 'x'), (2, 'y')] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ a }}{{ b }}{{ loop.cycle('o', 'e') }}{{ loop.previtem }}|{% endfor %}
{% for i in [1, 2, 3, 4] if i is even %}{{ loop.index }}:{{ i }};{% else %}none{% endfor %}{% for i in [] %}x{% else %}empty{% endfor %}{% for c in 'hé' %}[{{ c }}]{% endfor %}{% for k in {'p': 1, 'q': 2} %}{{ k }}{% endfor %}
{% for i in range(10) %}{% if i > 2 %}{% break %}{% endif %}{{ i }}{% endfor %}{% for i in range(3) %}{% set cut %}<{% if i == 1 %}{% break %}{% endif %}>{% endset %}{{ i }}{% endfor %}{% set x1 = 1 %}{% for i in range(2) %}{{ x1 }}{% set x1 = 5 %}{{ x1 }}{% endfor %}{{ x1 }}
{% set a, b = [1, 2] %}{{ a }}{{ b }}{% set t %}T{{ a }}{% endset %}{{ t }}{% set (c, d) = ('p', 'q') %}{{ c }}{{ d }}{% set tu = 1, 2 %}{{ tu }}
{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} {{ greet('b', '?') }} {{ greet(punct='.', name='c') }} {{ greet('d')|upper }}
{% macro rest(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ rest(1, 2, 3, k='v') }} {{ greet(*['e', ';']) }} {{ greet(**{'name': 'f'}) }} {{ 'x' not in nothing_here }} {{ 'x' in nothing_here }}
{% macro box(title) %}[{{ title }}:{{ caller() }}]{% endmacro %}{% for who in ['p', 'q'] %}{% call box(who|upper) %}<{{ who }}{{ loop.index }}>{% endcall %}{% endfor %}
{% generation %}generated {{ 1 + 1 }}{% endgeneration %} {{ strftime_now('[%%]') }} {{ strftime_now is defined }}
{%- if true %}
  stripped-left
{%- endif %}
  {% if true %}lstripped{% endif %}
    {%+ if true %}kept-indent{% endif %}
{% if true +%}
kept-newline
{%- endif -%}
   {{- ' joined ' -}}   
{# a comment #}
  {#- another -#}
after comments {{ 'x' }}
{% raw %}{{ not rendered }} {% if %}{% endraw %}
{{ 'adjacent' 'strings' }} {{ "double \"quoted\" \\ \t\x41\u00e9" }} {{ '\'single\'' }}
{{ messages[0].role if messages else 'none' }} {{ messages|length }} {{ bos_token }}{{ eos_token }}
Z
"""

TEMPLATES = {"llama3": LLAMA3, "chatml_think": CHATML_THINK, "tool_use": TOOL_USE, "kitchen_sink": KITCHEN_SINK}

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def jinja_reference(source, context):
    """transformers' environment for chat templates, written from its documented behaviour."""
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %} marker of the assistant's tokens: renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source).render(**context)


def sparsa_render(sparsa_bin, tmp_path, source, context, model_dir=None):
    template = tmp_path / "t.jinja"
    template.write_text(source, encoding="utf-8")
    ctx = tmp_path / "ctx.json"
    ctx.write_text(json.dumps(context, ensure_ascii=False), encoding="utf-8")
    cmd = [sparsa_bin, "chat-template", "--messages", str(ctx), "--json"]
    cmd += ["--model", str(model_dir)] if model_dir else ["--template", str(template)]
    r = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8")
    return r


CONTENTS = [
    "Hello!", "  padded  ", "line one\nline two\n", "quotes ' and \" and \\ backslash", "café 中文 😀",
    "<think>\nstep by step\n</think>\n\nThe answer is 4.", "<tool_response>42</tool_response>", "", "\t tab",
    "{{ not a template }} {% neither %}", "trailing newline\n\n", "<think>only reasoning</think>",
]


def random_conversation(rng, with_tools):
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(CONTENTS)})
    for _ in range(rng.randint(1, 5)):
        messages.append({"role": "user", "content": rng.choice(CONTENTS)})
        if rng.random() < 0.3 and with_tools:
            call = {"name": rng.choice(["get_weather", "add"]),
                    "arguments": {"city": rng.choice(["Paris", "東京"]), "days": rng.randint(1, 9),
                                  "units": rng.choice([None, "metric", 1.5, True, [1, "x"]])}}
            messages.append({"role": "assistant", "content": rng.choice(["", "Calling."]),
                             "tool_calls": [{"type": "function", "function": call} if rng.random() < 0.7 else call]})
            for _ in range(rng.randint(1, 2)):
                messages.append({"role": "tool", "content": rng.choice(["{\"t\": 21}", "ok"])})
        if rng.random() < 0.8:
            m = {"role": "assistant", "content": rng.choice(CONTENTS)}
            if rng.random() < 0.2:
                m["reasoning_content"] = "thought about it"
            messages.append(m)
    return messages


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"a": 1.0, "b": None}}}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_matches_jinja_on_random_conversations(sparsa_bin, tmp_path, name):
    rng = random.Random(sum(map(ord, name)))
    cases = 12 if name != "kitchen_sink" else 3
    for case in range(cases):
        with_tools = name in ("chatml_think", "tool_use") and case % 2 == 1
        messages = random_conversation(rng, with_tools)
        if name == "tool_use":  # one call per turn, as {"function": ...} (or the template refuses: below)
            for m in messages:
                if "tool_calls" in m:
                    call = m["tool_calls"][0]
                    m["tool_calls"] = [call if "function" in call else {"type": "function", "function": call}]
        context = {"messages": messages, "tools": TOOLS if with_tools else None, "documents": None,
                   "add_generation_prompt": case % 3 != 2, **SPECIAL}
        if name == "chatml_think" and case % 4 == 3:
            context["enable_thinking"] = False
        want = jinja_reference(TEMPLATES[name], context)
        r = sparsa_render(sparsa_bin, tmp_path, TEMPLATES[name], context)
        assert r.returncode == 0, f"{name} case {case}: {r.stderr}"
        got = json.loads(r.stdout)["text"]
        assert got == want, f"{name} case {case}:\n--- jinja ---\n{want!r}\n--- sparsa ---\n{got!r}"


def assert_renders_as_jinja(sparsa_bin, tmp_path, sources, errors, context):
    """Each template of `sources` renders byte for byte as jinja2 renders it; each of `errors` (a
    template and a word of its message) fails in jinja2 and in sparsa, whose error names the word
    and line 1."""
    for source in sources:
        want = jinja_reference(source, context)
        r = sparsa_render(sparsa_bin, tmp_path, source, context)
        assert r.returncode == 0, f"{source}: {r.stderr}"
        assert json.loads(r.stdout)["text"] == want, (source, want, json.loads(r.stdout)["text"])
    for source, needle in errors:
        with pytest.raises(Exception):
            jinja_reference(source, context)
        r = sparsa_render(sparsa_bin, tmp_path, source, context)
        assert r.returncode != 0 and needle in r.stderr and "line 1" in r.stderr, (source, r.stderr)


BLOCK_TAGS = [
    "{% filter upper %}{{ messages[0].content }} and {{ bos_token }}{% endfilter %}",
    "{% filter trim|replace('a', 'b') %}  {% for m in messages %}{{ m.role }} {% endfor %}  {% endfilter %}!",
    "{% set x = 'out' %}{% filter lower %}{% set x = 'IN' %}{{ x }}{% endfilter %}{{ x }}",
    "{%- filter indent(2, true) %}\nline1\n  line2\n{% endfilter -%}|",
    "{% for m in messages %}{% filter title %}{{ m.role }} {% if loop.last %}{% break %}{% endif %}{% endfilter %}"
    "{% endfor %}",
    "{% set a = 1 %}{% with a = 2, b = a %}{{ a }}{{ b }}{% set c = 3 %}{{ c }}{% endwith %}{{ a }}{{ c is defined }}",
    "{% with %}{{ messages | length }}{% endwith %}",
    "{% set t = 'none' %}{% for m in messages %}{% set t %}{{ m.role }}{% if loop.index == 2 %}{% break %}{% endif %}"
    "{% endset %}{% endfor %}{{ t }}",
    "{% for m in messages %}{% with r = m.role | upper, i = loop.index %}{{ i }}{{ r }};{% endwith %}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% with %}{% set ns.n = 5 %}{% endwith %}{{ ns.n }}",
    "{% for k, v in {'b': 1, 'A': 2, 'a': 0, 'C': -1} | dictsort %}{{ k }}={{ v }} {% endfor %}",
    "{{ {'b': 1, 'A': 2, 'a': 0} | dictsort(true) }} {{ {'x': 3, 'y': 1, 'z': 2} | dictsort(by='value', reverse=true) }}",
]


def test_filter_and_with_blocks_and_dictsort_match_jinja(sparsa_bin, tmp_path):
    """{% filter %} (the body's text through a chain, in its own scope), {% with %} (names for the
    body, values evaluated outside) and the dictsort filter, byte for byte with jinja2."""
    context = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a word"},
                            {"role": "assistant", "content": "Word."}], "add_generation_prompt": False, **SPECIAL}
    errors = (("{% filter nosuch %}x{% endfilter %}", "nosuch"), ("{% filter upper %}x", "endfilter"),
              ("{% with a %}{% endwith %}", "'='"), ("{{ [1] | dictsort }}", "dictsort"),
              ("{{ {'a': 1} | dictsort(by='size') }}", "by"))
    assert_renders_as_jinja(sparsa_bin, tmp_path, BLOCK_TAGS, errors, context)


PERCENT = [
    "{{ '%s and %r' % ('x', 'y') }}",
    "{{ '%5d|%-5d|%05d|%+d|% d|%i %u' % (42, 42, 42, 42, 42, -7, 7) }}",
    "{{ '%x %X %#x %#o %o %#X %08x %#010x' % (255, 255, 255, 8, 8, 0, 255, 255) }}",
    "{{ '%.3f %10.2e %g %G %#g %e' % (3.14159, 12345.678, 0.0001, 1e20, 2.0, -1.5) }}",
    "{{ '%f|%05.1f|%-8.3e|%+.0f|%010.3f|%#.0f' % (-0.0, 3.14159, 0.5, 2.5, -3.5, 3.0) }}",
    "{{ '%f %F %5f|%-6f|%+f' % (1e300 * 1e10, 1e300 * 1e10, 1e300 * 1e10, -1e300 * 1e10, 1e300 * 1e10) }}",
    "{{ '%s' % [1, 'a'] }} {{ '%s' % {'a': 1} }} {{ '%s' % none }} {{ '%s %d' % (true, true) }}",
    "{{ '%(name)s is %(age)d (%(name)r)' % {'name': 'Ann', 'age': 30.7} }}",
    "{{ '%c%c|%.2s|%5s|%-5s|' % (65, '\u00e9', 'h\u00e9llo', '\u00e9', 'ab') }}",
    "{{ '%*d|%.*f|%-*s|' % (6, 7, 2, 1.23456, 4, 'x') }}",
    "{{ '%d%%' % 50 }} {{ '%%' % () }} {{ '%d' % 3.99 }} {{ '%d' % -3.99 }}",
    "{{ '%s, %s' | format('a', 1) }} {{ '%(x)s=%(y)05.1f' | format(x='k', y=2) }} {{ 'plain' | format }}",
    "{% set row = '%-10s|%6.2f' %}{% for m in messages %}{{ row % (m.role, loop.index / 3) }}\n{% endfor %}",
]


def test_percent_formatting_and_the_format_filter_match_python(sparsa_bin, tmp_path):
    """Python's printf-style `%` on strings and Jinja's `format` filter: conversions, flags, width
    and precision (counted in characters), `*`, mappings, infinities, signed zero, byte for byte
    with jinja2; the errors Python raises are errors naming the line."""
    context = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], **SPECIAL}
    errors = (("{{ '%d' % 'x' }}", "real number"), ("{{ '%s %s' % ('a',) }}", "not enough"),
              ("{{ '%s' % ('a', 'b') }}", "not all arguments"), ("{{ '%y' % 1 }}", "'y'"),
              ("{{ '%(k)s' % {'j': 1} }}", "'k'"), ("{{ '%(k)s' % 1 }}", "mapping"),
              ("{{ '%x' % 1.5 }}", "integer"), ("{{ '%' % 1 }}", "incomplete"),
              ("{{ '%s' | format(1, x=2) }}", "format"))
    assert_renders_as_jinja(sparsa_bin, tmp_path, PERCENT, errors, context)
    # a width of a billion from `*` is refused before any padding is made (Python would build it)
    r = sparsa_render(sparsa_bin, tmp_path, "{{ '%*s' % (1000000000, 'x') }}", context)
    assert r.returncode != 0 and "100,000" in r.stderr, r.stderr


def test_raise_exception_and_errors_name_the_line(sparsa_bin, tmp_path):
    context = {"messages": [{"role": "assistant", "content": "",
                             "tool_calls": [{"function": {"name": "a", "arguments": {}}}] * 2}],
               "tools": None, "add_generation_prompt": True, **SPECIAL}
    r = sparsa_render(sparsa_bin, tmp_path, TOOL_USE, context)
    assert r.returncode == 1 and "one tool call per turn" in r.stderr, r.stderr
    bad = {
        "{% if x %}never closed": "{% endif %} missing",
        "line one\n{{ 1 + }}": "line 2",
        "{% for x in y %}{% endif %}": "endfor",
        "{{ x.y }}": "'x' is undefined",
        "{{ 'a' + 1 }}": "unsupported operand types for +",
        "{{ 1 / 0 }}": "division by zero",
        "{{ x|nosuchfilter }}": "unknown filter 'nosuchfilter'",
        "{{ 1 is nosuchtest }}": "unknown test 'nosuchtest'",
        "{% include 'other' %}": "unsupported tag 'include'",
        "{% break %}": "outside a for loop",
        "{{ range(200000)|length }}": "100,000",
        "{{ [1].append(2) }}": "would change a list",
        "{% set x = {} %}{% set x.a = 1 %}": "only a namespace() takes attributes",
        "{{ ((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((1" + ")" * 140 + " }}": "nest",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}": "too many steps",
        "{{ 'x' * 100000000 }}": "too large",
        "{% set s = 'x' * 10000000 %}{% set l = [s, s, s, s, s, s, s, s, s, s] %}{{ l * 5 }}": "256 MiB",
        "{# unterminated": "comment is not closed",
        "{{ 'unterminated }}": "string literal is not closed",
        "{{ 99999999999999999999 }}": "too large",
        "{{ 9223372036854775807 + 1 }}": "overflow",
        "{{ strftime_now('" + "%Y" * 70 + "') }}": "longer than 127",
    }
    for source, needle in bad.items():
        r = sparsa_render(sparsa_bin, tmp_path, source, {"messages": []})
        assert r.returncode != 0 and needle in r.stderr, f"{source[:60]!r}: rc {r.returncode}, {r.stderr!r}"


def write_tokenizer_dir(path, config):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>",
                "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["Hello there, how are you? I am fine. The answer is 4."] * 50 + CONTENTS * 10, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def test_model_directory_against_transformers(sparsa_bin, tmp_path):
    """The template and special tokens found where transformers finds them, rendered and tokenized
    as its apply_chat_template does."""
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "special": True},
              "eos_token": "<|eot_id|>",
              "chat_template": LLAMA3, "tokenizer_class": "PreTrainedTokenizerFast"}
    model = write_tokenizer_dir(tmp_path / "llama", config)
    messages = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "Hello there"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(model))
    want_text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(want_ids, dict) or hasattr(want_ids, "input_ids"):
        want_ids = want_ids["input_ids"]
    r = subprocess.run([sparsa_bin, "chat-template", "--model", str(model), "--system", " be brief ", "--prompt",
                        "Hello there", "--ids", "--json"], capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["text"] == want_text
    assert got["ids"] == list(want_ids)

    # chat_template.jinja wins over tokenizer_config.json's, as in transformers.
    (model / "chat_template.jinja").write_text(CHATML_THINK, encoding="utf-8")
    hf = transformers.AutoTokenizer.from_pretrained(str(model))
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, enable_thinking=False)
    r = subprocess.run([sparsa_bin, "chat-template", "--model", str(model), "--system", " be brief ", "--prompt",
                        "Hello there", "--no-generation-prompt", "--vars", '{"enable_thinking": false}', "--json"],
                       capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] == want

    # A list of named templates: "default" is the chat one.
    os.remove(model / "chat_template.jinja")
    config["chat_template"] = [{"name": "tool_use", "template": TOOL_USE}, {"name": "default", "template": LLAMA3}]
    (model / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    r = subprocess.run([sparsa_bin, "chat-template", "--model", str(model), "--prompt", "Hello there"],
                       capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, r.stderr
    assert r.stdout == jinja_reference(LLAMA3, {"messages": [{"role": "user", "content": "Hello there"}],
                                                "add_generation_prompt": True, **SPECIAL})


@pytest.mark.parametrize("config, needle", [
    ({"bos_token": "<s>"}, "no chat template"),
    ({"chat_template": 7}, "chat_template: expected a string or a list"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "without one named 'default'"),
    ({"chat_template": [{"name": 1}]}, "chat_template[0]"),
    ({"chat_template": "{{ x", "bos_token": "<s>"}, "chat_template line 1"),
    ({"chat_template": "x", "eos_token": 5}, "eos_token"),
    ({"chat_template": "x", "additional_special_tokens": "a"}, "additional_special_tokens"),
])
def test_bad_tokenizer_config_is_one_clear_error(sparsa_bin, tmp_path, config, needle):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    r = subprocess.run([sparsa_bin, "chat-template", "--model", str(tmp_path), "--prompt", "hi"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and needle in r.stderr, r.stderr


def test_malformed_tokenizer_config_json(sparsa_bin, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{\"chat_template\": ", encoding="utf-8")
    r = subprocess.run([sparsa_bin, "chat-template", "--model", str(tmp_path), "--prompt", "hi"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "tokenizer_config.json: not valid JSON" in r.stderr, r.stderr


def test_generate_chat_feeds_the_rendered_prompt(sparsa_bin, tmp_path):
    """generate --chat encodes what chat-template renders: the same tokens come out as from those
    ids given by hand; a model without a template is told so."""
    model = R.shipped_model_copy(tmp_path)

    def sparsa(*args):
        return subprocess.run([sparsa_bin, *args], capture_output=True, text=True, encoding="utf-8")

    r = sparsa("generate", "--model", str(model), "--chat", "--prompt", "hi", "--gen-len", "16", "--quiet")
    assert r.returncode == 1 and "no chat template" in r.stderr, r.stderr
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role | upper }}: {{ m.content | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT: the value is {% endif %}", encoding="utf-8")
    r = sparsa("chat-template", "--model", str(model), "--system", "Answer with digits.", "--prompt",
               " What is 12 + 30? ", "--ids", "--json")
    assert r.returncode == 0, r.stderr
    rendered = json.loads(r.stdout)
    assert rendered["text"] == "SYSTEM: Answer with digits.\nUSER: What is 12 + 30?\nASSISTANT: the value is "
    chat = sparsa("generate", "--model", str(model), "--chat", "--system", "Answer with digits.", "--prompt",
                  " What is 12 + 30? ", "--gen-len", "16", "--json", "--quiet")
    plain = sparsa("generate", "--model", str(model), "--prompt-ids", ",".join(map(str, rendered["ids"])),
                   "--gen-len", "16", "--json", "--quiet")
    assert chat.returncode == 0 and plain.returncode == 0, chat.stderr + plain.stderr
    assert json.loads(chat.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
    assert sparsa("generate", "--model", str(model), "--chat", "--prompt-ids", "1,2", "--quiet").returncode == 2


def test_chat_keeps_the_conversation(sparsa_bin, tmp_path):
    """`sparsa chat`: each stdin line a user turn; turn n's prompt is the whole conversation so far
    (earlier replies as assistant turns) through the template, its reply what `generate` gives for
    those ids (without the prompt cache the turns share); /reset forgets the turns but not --system."""
    model = R.shipped_model_copy(tmp_path)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: the value is {% endif %}", encoding="utf-8")
    flags = ["--gen-len", "16", "--temperature", "0.7", "--seed", "5"]
    lines = ["What is 12 + 30?", "And 7 more?", "/reset", "", "Say 9."]
    r = subprocess.run([sparsa_bin, "chat", "--model", str(model), "--system", "Digits only.", "--json", *flags],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, encoding="utf-8")
    assert r.returncode == 0, r.stderr
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [0, 1, 2]
    # The second turn reuses the K/V of the whole blocks it shares with the first turn's prompt and
    # reply (the prompt cache); the first and the one after /reset start from nothing.
    block = json.loads((model / "config.json").read_text())["block_size"]
    assert turns[0]["reused_tokens"] == 0 and turns[2]["reused_tokens"] == 0
    last_ids = None  # the last turn's prompt and reply
    history = [{"role": "system", "content": "Digits only."}]
    for t, user in zip(turns, ["What is 12 + 30?", "And 7 more?", "Say 9."]):
        if user == "Say 9.":
            history = history[:1]
        history.append({"role": "user", "content": user})
        ctx = tmp_path / "history.json"
        ctx.write_text(json.dumps(history), encoding="utf-8")
        rendered = subprocess.run([sparsa_bin, "chat-template", "--model", str(model), "--messages", str(ctx), "--ids",
                                   "--json"], capture_output=True, text=True, encoding="utf-8")
        ids = json.loads(rendered.stdout)["ids"]
        assert t["prompt_tokens"] == len(ids)
        if t["turn"] == 1:  # at least the whole blocks its prompt shares with the last prompt and reply
            shared = next((i for i, (a, b) in enumerate(zip(last_ids, ids)) if a != b), min(len(last_ids), len(ids)))
            assert shared >= block, (shared, last_ids, ids)
            assert shared // block * block <= t["reused_tokens"] <= len(ids) // block * block
            assert t["reused_tokens"] % block == 0
        last_ids = ids + t["tokens"]
        flags_turn = [f if f != "5" else str(5 + t["turn"]) for f in flags]
        want = subprocess.run([sparsa_bin, "generate", "--model", str(model), "--prompt-ids", ",".join(map(str, ids)),
                               "--json", "--quiet", *flags_turn], capture_output=True, text=True, encoding="utf-8")
        assert json.loads(want.stdout)["tokens"][0] == t["tokens"]
        history.append({"role": "assistant", "content": t["text"]})
    # --no-prompt-cache: the same turns, each prefilling the whole conversation.
    r = subprocess.run([sparsa_bin, "chat", "--model", str(model), "--system", "Digits only.", "--json",
                        "--no-prompt-cache", *flags], input="\n".join(lines) + "\n", capture_output=True, text=True,
                       encoding="utf-8")
    assert r.returncode == 0, r.stderr
    uncached = [json.loads(line) for line in r.stdout.splitlines()]
    assert [t["tokens"] for t in uncached] == [t["tokens"] for t in turns]
    assert all(t["reused_tokens"] == 0 for t in uncached)
    assert uncached[1]["forward_tokens"] == turns[1]["forward_tokens"] + turns[1]["reused_tokens"]
    r = subprocess.run([sparsa_bin, "chat", "--model", str(model), "--chat-vars", "[1]"], input="hi\n",
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--chat-vars" in r.stderr
