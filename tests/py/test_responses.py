"""moed's Responses API (POST /v1/responses) through the official openai SDK.

The same daemon as test_openai.py (bin/moed, CPU workers, the golden tiny model). A Response is
the chat completion of the same conversation, answered in the Responses shape: greedy text and
usage equal /v1/chat/completions', streaming concatenates to the same text and ends with the
Response, text.format constrains the output, a length cut is an incomplete Response, function
tools give function_call items, and what moed cannot honour is a 400.
"""
import json

import openai
import pytest

from test_openai import client, daemon  # noqa: F401 (the daemon and SDK client fixtures)

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False},
          "strict": True}]


def chat(client, msgs, n):
    return client.chat.completions.create(model="tiny", messages=msgs, max_tokens=n, temperature=0)


def test_text_equals_chat(client):
    c = chat(client, [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "Hello there"}], 10)
    r = client.responses.create(model="tiny", instructions="You are terse.", input="Hello there",
                                max_output_tokens=10, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == c.choices[0].message.content
    assert len(r.output) == 1
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "You are terse." and r.max_output_tokens == 10 and r.temperature == 0
    assert r.tools == [] and r.error is None
    if c.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_input_items(client):
    """Both input item forms (role and content, type message with parts) and an assistant turn."""
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to three"}]
    c = chat(client, msgs, 6)
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Count "},
                                          {"type": "input_text", "text": "to three"}]}]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_length_cut_is_incomplete(client):
    r = client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=2,
                                temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2
    assert r.output[0].status == "incomplete"


def test_stream_events(client):
    full = client.responses.create(model="tiny", input="Hello there", max_output_tokens=8,
                                   temperature=0)
    events = list(client.responses.create(model="tiny", input="Hello there", max_output_tokens=8,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response." + full.status]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(d.item_id == events[2].item.id and d.output_index == 0 and
                          d.content_index == 0 for d in deltas)
    text = "".join(d.delta for d in deltas)
    assert text == full.output_text
    last = events[-1].response
    assert last.output_text == text and last.id == events[0].response.id
    assert last.usage.output_tokens == full.usage.output_tokens


def test_json_schema_format_and_stream_helper(client):
    fmt = {"format": {"type": "json_schema", "name": "yn", "schema": SCHEMA, "strict": True}}
    r = client.responses.create(model="tiny", input="Is the sky blue?", text=fmt,
                                max_output_tokens=40, temperature=0)
    assert r.status == "completed"
    assert json.loads(r.output_text)["answer"] in ("yes", "no")
    assert r.text.format.type == "json_schema"
    with client.responses.stream(model="tiny", input="Is the sky blue?", text=fmt,
                                 max_output_tokens=40, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    r = client.responses.create(model="tiny", input="Hi", text={"format": {"type": "json_object"}},
                                max_output_tokens=60, temperature=0)
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_function_tools(client):
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS,
                                tool_choice="required", max_output_tokens=80, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert r.tools[0].name == "get_weather"
    # The call and its output sent back: the conversation continues.
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]
    r2 = client.responses.create(model="tiny", input=items, tools=TOOLS, max_output_tokens=4,
                                 temperature=0)
    assert r2.status in ("completed", "incomplete")
    c = client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees"}])
    assert r2.usage.input_tokens == c.usage.prompt_tokens
    # A named function, streamed: the call's events, then the Response.
    events = list(client.responses.create(
        model="tiny", input="Weather?", tools=TOOLS, max_output_tokens=80, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[-1].arguments == done.arguments


LP = ["message.output_text.logprobs"]


def test_logprobs_equal_chat(client):
    """include message.output_text.logprobs: the output_text's logprobs are the chat completion's
    for the same greedy request (its tokens with text), each with top_logprobs entries; streamed
    deltas' logprobs concatenate to the done event's list and the final one."""
    msgs = [{"role": "user", "content": "Hello there"}]
    c = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=3)
    r = client.responses.create(model="tiny", input="Hello there", max_output_tokens=12,
                                temperature=0, include=LP, top_logprobs=3)
    assert r.top_logprobs == 3
    part = r.output[-1].content[0]
    assert part.type == "output_text" and part.text == c.choices[0].message.content
    got, want = part.logprobs, c.choices[0].logprobs.content
    assert got and b"".join(bytes(e.bytes) for e in got) == part.text.encode()
    # The end-of-generation token (chat lists it) has no text in the output.
    assert len(want) - len(got) in ((0, 1) if c.choices[0].finish_reason == "stop" else (0,))
    for a, b in zip(got, want):
        assert a.token == b.token and a.bytes == b.bytes and abs(a.logprob - b.logprob) < 1e-3
        assert len(a.top_logprobs) == 3
        assert [(t.token, t.bytes) for t in a.top_logprobs] == [(t.token, t.bytes) for t in b.top_logprobs]
    events = list(client.responses.create(model="tiny", input="Hello there", max_output_tokens=12,
                                          temperature=0, include=LP, top_logprobs=3, stream=True))
    deltas = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    done = [e for e in events if e.type == "response.output_text.done"][-1]
    assert [(x.token, x.logprob) for x in deltas] == [(x.token, x.logprob) for x in done.logprobs]
    # (A request's logprobs can differ in the last float digits with the KV cache it continues.)
    assert [x.token for x in done.logprobs] == [x.token for x in got]
    assert all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(done.logprobs, got))
    assert all(len(x.top_logprobs) == 3 for x in deltas)
    final = events[-1].response.output[-1].content[0]
    assert [(x.token, x.bytes) for x in final.logprobs] == [(x.token, x.bytes) for x in got]
    # top_logprobs 0 (or left out): the entries, empty top lists.
    z = client.responses.create(model="tiny", input="Hello there", max_output_tokens=12,
                                temperature=0, include=LP)
    zp = z.output[-1].content[0].logprobs
    assert [x.token for x in zp] == [x.token for x in got] and all(x.top_logprobs == [] for x in zp)
    assert z.top_logprobs == 0
    # A function call is no output_text: its tokens are in no logprobs list.
    t = client.responses.create(model="tiny", input="Weather?", tools=TOOLS, tool_choice="required",
                                max_output_tokens=80, temperature=0, include=LP, top_logprobs=2)
    assert t.output[-1].type == "function_call"
    assert all(p.logprobs == [] for o in t.output if o.type == "message" for p in o.content)


def test_no_logprobs_without_include(client):
    r = client.responses.create(model="tiny", input="Hello there", max_output_tokens=6, temperature=0)
    assert r.output[-1].content[0].logprobs == []
    events = list(client.responses.create(model="tiny", input="Hello there", max_output_tokens=6,
                                          temperature=0, stream=True))
    assert all(e.logprobs == [] for e in events if e.type in ("response.output_text.delta",
                                                             "response.output_text.done"))


@pytest.mark.parametrize("kwargs, param", [
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": LP, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
])
def test_refused(client, kwargs, param):
    args = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**args)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


def test_bad_input(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=5)
    assert "'input' must be a string or an array" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="Hi", stream=True, temperature="hot")
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="Hi")
