"""moed's OpenAI-compatible API through the official openai SDK, over the daemon's Unix socket.

Starts the real bin/moed (MOE_BIN, default bin/) with two CPU workers on the golden tiny model in
a temp dir. Checks that greedy completions equal the standalone worker's output (also with 8
clients at once), that SSE streaming parses in the SDK and concatenates to the same text, usage
counts, stop strings, and that bad requests raise the SDK's error classes with useful messages.
"""
import concurrent.futures
import json
import math
import os
import pathlib
import signal
import subprocess
import tempfile
import time

import openai
import pytest

try:  # openai >= 3 is built on httpx2 (same API); older releases on httpx
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("MOE_BIN", ROOT / "bin"))
if not BIN.is_absolute():
    BIN = ROOT / BIN
MODEL = ROOT / "tests/golden/models/tiny-qwen3moe-Q8_0.gguf"
PROMPTS = [ROOT / "tests/golden/prompts" / f"p{i}.txt" for i in (1, 2, 3)]
N = 16


def uds_client(sock, timeout=120.0):
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://moed",
                        timeout=timeout)


class Daemon:
    def __init__(self, tmp):
        self.dir = pathlib.Path(tmp)
        self.sock = self.dir / "moed.sock"
        self.log = self.dir / "moed.log"
        self.proc = None

    def start(self, *extra):
        args = [str(BIN / "moed"), "--model", str(MODEL), "--socket", str(self.sock),
                "--state-dir", str(self.dir / "state"), "--worker-bin", str(BIN / "moed-worker"),
                *extra]
        self.logf = open(self.log, "ab")
        self.proc = subprocess.Popen(args, stdout=self.logf, stderr=self.logf)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moed exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with uds_client(self.sock, 2) as c:
                    c.get("/health")
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("moed did not open its socket")

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                with uds_client(self.sock, 2) as c:
                    if c.get("/health").status_code == 200:
                        return True
                    st = c.get("/admin/status").json()
                    if st["workers"] and all(w["restarts"] >= 3 for w in st["workers"]):
                        return False
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        return False

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9
        return self.proc.returncode if self.proc else None


@pytest.fixture(scope="module")
def daemon():
    if not (BIN / "moed").exists():
        pytest.skip(f"{BIN}/moed is not built")
    with tempfile.TemporaryDirectory(prefix="moed-py-") as tmp:
        d = Daemon(tmp)
        d.start("--devices", "cpu", "--workers", "2", "--parallel", "4", "--threads", "1",
                "--model-alias", "tiny")
        try:
            if not d.wait_ready():
                lines = [l for l in d.log.read_text().splitlines() if "worker" in l]
                pytest.skip("moed's workers did not become ready: " + (lines[-1] if lines else "?"))
            yield d
        finally:
            rc = d.stop()
            assert rc == 0, f"moed exited with {rc} after SIGTERM"


@pytest.fixture(scope="module")
def client(daemon):
    http = uds_client(daemon.sock)
    yield openai.OpenAI(base_url="http://moed/v1", api_key="x", http_client=http, max_retries=0)
    http.close()


@pytest.fixture(scope="module")
def want():
    """The standalone worker's greedy text for each golden prompt."""
    out = {}
    for p in PROMPTS:
        r = subprocess.run([str(BIN / "moed-worker"), "--model", str(MODEL), "--prompt-file", str(p),
                            "-n", str(N), "--temp", "0", "--json"], capture_output=True, check=True)
        out[p.name] = json.loads(r.stdout)["text"]
    return out


def tokenize(client, text):
    """Token ids of text through llama-server's /tokenize (the SDK's own HTTP client)."""
    r = client._client.post("http://moed/tokenize", json={"content": text})
    assert r.status_code == 200
    return r.json()["tokens"]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_model_checked(client):
    """A model the daemon does not serve is OpenAI's 404 model_not_found, on both endpoints."""
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="tiny-qwen3moe-Q8_0", prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'tiny'" in e.value.body["message"]
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}],
                                       stream=True)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=7, prompt="Hi", max_tokens=2)


def test_completion_matches_worker(client, want):
    for p in PROMPTS:
        r = client.completions.create(model="tiny", prompt=p.read_text(), max_tokens=N, temperature=0)
        assert r.choices[0].text == want[p.name]
        assert r.object == "text_completion"
        assert r.usage.completion_tokens <= N
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_eight_concurrent_clients(daemon, want):
    def one(i):
        p = PROMPTS[i % 3]
        with uds_client(daemon.sock) as http:
            c = openai.OpenAI(base_url="http://moed/v1", api_key="x", http_client=http, max_retries=0)
            r = c.completions.create(model="tiny", prompt=p.read_text(), max_tokens=N, temperature=0)
            return p.name, r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        for name, text in ex.map(one, range(8)):
            assert text == want[name]


def test_stream_completion(client, want):
    p = PROMPTS[0]
    chunks = list(client.completions.create(model="tiny", prompt=p.read_text(), max_tokens=N,
                                            temperature=0, stream=True))
    assert len(chunks) >= 2
    assert "".join(c.choices[0].text for c in chunks) == want[p.name]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_stream_equals_non_stream(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for ch in stream:
        assert ch.object == "chat.completion.chunk"
        if ch.usage:
            usage = ch.usage
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
    assert "".join(parts) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert finish == full.choices[0].finish_reason


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_chat_tools_and_tool_messages(client):
    """The request shapes of a tool-calling conversation are accepted and reach the template."""
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="auto",
                                       max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "not among 'tools'" in str(e.value)


def test_tool_choice_forces_a_call(client):
    """tool_choice required / a named function: the answer is a tool call whose arguments follow
    the function's parameters (forced by a grammar), even from a model that never learnt tools."""
    import jsonschema
    # Bounded arguments, so that a random model ends its call well within max_tokens.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
             {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
            "additionalProperties": False}}}]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in range(3):
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            r = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, tool_choice=choice,
                                               max_tokens=300, temperature=1.0, seed=seed)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c.message
            assert len(c.message.tool_calls) == 1
            call = c.message.tool_calls[0].function
            if choice != "required":
                assert call.name == "add"
            jsonschema.validate(json.loads(call.arguments), params[call.name])


def test_chat_template_kwargs(daemon, client):
    """Qwen3's enable_thinking=false closes an empty <think> block in the prompt."""
    msgs = [{"role": "user", "content": "Hi"}]
    with uds_client(daemon.sock) as http:
        on = http.post("/apply-template", json={"messages": msgs}).json()["prompt"]
        off = http.post("/apply-template", json={"messages": msgs,
                                                 "chat_template_kwargs": {"enable_thinking": False}}).json()["prompt"]
        tools = http.post("/apply-template", json={"messages": msgs, "tools": TOOLS}).json()["prompt"]
    assert off == on + "<think>\n\n</think>\n\n"
    assert "get_weather" in tools and "<tools>" in tools
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens > 0


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt="The sea", max_tokens=10, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_stop_string(client, want):
    p = PROMPTS[0]
    text = want[p.name]
    if len(text) < 6:
        pytest.skip("greedy text too short to pick a stop string")
    stop = text[3:5]
    cut = text[: text.index(stop)]
    r = client.completions.create(model="tiny", prompt=p.read_text(), max_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny", prompt=p.read_text(), max_tokens=N, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_bad_requests(client):
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="hi", n=n)
        assert "'n' must be between 1 and 16" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", n=2, best_of=3)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 5000, max_tokens=4)
    body = e.value.body
    assert body["code"] == "context_length_exceeded"
    assert body["n_prompt_tokens"] >= 5000 and body["n_ctx"] == 4096
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_metrics_and_admin(daemon, client):
    client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    with uds_client(daemon.sock) as http:
        m = http.get("/metrics").text
        assert "moed_requests_total" in m and "moed_generated_tokens_total" in m
        st = http.get("/admin/status").json()
        assert len(st["workers"]) == 2
        assert all(w["state"] == "ready" for w in st["workers"])
        assert st["scheduler"]["requests_total"] >= 1


def test_logprobs_chat(client):
    """Chat logprobs in OpenAI's shape: one entry per generated token, the greedy token is the
    most likely one, the top list is ordered and the same text comes with or without them."""
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=5)
    assert r.choices[0].message.content == plain.choices[0].message.content
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 5
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert e.top_logprobs[0].token == e.token
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(x) for x in lps) <= 1 + 1e-5
    # Streamed: the same entries, spread over the chunks.
    got = []
    for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                             logprobs=True, top_logprobs=5, stream=True):
        if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content:
            got += ch.choices[0].logprobs.content
    assert [e.token for e in got] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(got, content))
    # logprobs without top_logprobs: empty top lists; sampled (seeded) text does not change.
    kw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=0.9, seed=99)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw, logprobs=True)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert all(e.top_logprobs == [] for e in b.choices[0].logprobs.content)
    assert a.choices[0].logprobs is None


def test_logprobs_completions(client):
    p = PROMPTS[0].read_text()
    r = client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == N
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(N)]
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and abs(max(top.values()) - x) < 1e-6 and top[tok] == x
    text, toks = "", []
    for ch in client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0, logprobs=3,
                                        stream=True):
        text += ch.choices[0].text
        toks += ch.choices[0].logprobs.tokens
    assert text == r.choices[0].text and toks == lp.tokens
    # A stop string's tokens are not listed.
    stop = r.choices[0].text[len(r.choices[0].text) // 2:][:3]
    s = client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0, logprobs=0, stop=[stop])
    cut = s.choices[0].text
    assert "".join(s.choices[0].logprobs.tokens).startswith(cut)
    assert len(s.choices[0].logprobs.tokens) < N and all(t == {} for t in s.choices[0].logprobs.top_logprobs)


def test_logit_bias(client):
    p = PROMPTS[1].read_text()
    r = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0, logprobs=1)
    first = r.choices[0].logprobs.tokens[0]
    ids = tokenize(client, first)
    assert len(ids) == 1
    # Banned: the greedy first token is not taken any more.
    b = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0, logprobs=1,
                                  logit_bias={str(ids[0]): -100})
    assert b.choices[0].logprobs.tokens[0] != first
    # Forced: every token is the favoured one (also sampled, and streamed); the logprobs are the
    # model's own, before the bias.
    word = next(t for t in r.choices[0].logprobs.tokens[1:] + [first]
                if t.isascii() and t != first and len(tokenize(client, t)) == 1)
    want = tokenize(client, word)
    for kw in (dict(temperature=0), dict(temperature=1, seed=5)):
        f = client.completions.create(model="tiny", prompt=p, max_tokens=6, logit_bias={str(want[0]): 100},
                                      logprobs=0, **kw)
        assert f.choices[0].text == word * 6
        assert all(x < -0.01 for x in f.choices[0].logprobs.token_logprobs)
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            logit_bias={want[0]: 100})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == word * 5


def test_echo_and_timings(client):
    r = client.completions.create(model="tiny", prompt="The sea", max_tokens=5, temperature=0)
    e = client.completions.create(model="tiny", prompt="The sea", max_tokens=5, temperature=0, echo=True)
    assert e.choices[0].text == "The sea" + r.choices[0].text
    ids = tokenize(client, "The sea")
    t = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert t.choices[0].text == e.choices[0].text
    s = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The sea", max_tokens=5, temperature=0, echo=True, stream=True))
    assert s == e.choices[0].text
    tm = e.model_extra["timings"]
    assert set(tm) >= {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                       "predicted_per_second", "cache_n", "prompt_per_token_ms", "predicted_per_token_ms"}
    assert tm["predicted_n"] == 5 and tm["prompt_n"] + tm["cache_n"] == e.usage.prompt_tokens
    assert tm["prompt_ms"] >= 0 and tm["predicted_ms"] >= 0
    last = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, stream=True))
    assert last[-1].model_extra["timings"]["predicted_n"] == 3


def test_bad_sampling_requests(client):
    msgs = [{"role": "user", "content": "x"}]
    bad_chat = [
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs="yes"), "logprobs"),
        (dict(logit_bias={"abc": 1}), "logit_bias"),
        (dict(logit_bias={"-1": 1}), "logit_bias"),
        (dict(logit_bias={"1": 101}), "logit_bias"),
        (dict(logit_bias={"1": "x"}), "logit_bias"),
        (dict(logit_bias={"99999999": 1}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
        (dict(extra_body={"echo": True}), "echo"),
    ]
    for kw, param in bad_chat:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    bad_cmpl = [
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(extra_body={"top_logprobs": 2}), "top_logprobs"),
        (dict(extra_body={"logprobs": True}), "logprobs"),
    ]
    for kw, param in bad_cmpl:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    # Still serving.
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_n_choices(client):
    """n > 1: one request per choice, seeded seed, seed + 1, ...; the prompt counted once."""
    p = PROMPTS[2].read_text()
    kw = dict(model="tiny", prompt=p, max_tokens=8, temperature=1.0)
    r = client.completions.create(**kw, n=3, seed=40, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    single = [client.completions.create(**kw, seed=40 + i) for i in range(3)]
    assert [c.text for c in r.choices] == [x.choices[0].text for x in single]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == single[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in single)
    assert all(len(c.logprobs.tokens) == 8 for c in r.choices)
    assert r.model_extra["timings"]["predicted_n"] == r.usage.completion_tokens
    # Chat, streamed: each choice's deltas under its index, each opened with the role.
    msgs = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0.8,
                                          seed=3, n=2)
    text, roles, finish, usage = {0: "", 1: ""}, set(), {}, None
    for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0.8,
                                             seed=3, n=2, stream=True, stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.role:
                roles.add(c.index)
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0, 1} and set(finish) == {0, 1}
    assert [text[0], text[1]] == [c.message.content for c in full.choices]
    assert usage.completion_tokens == full.usage.completion_tokens
    # A stop string ends one choice; the others go on.
    stop = single[0].choices[0].text[2:5]
    s = client.completions.create(**kw, n=2, seed=40, stop=[stop])
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == single[0].choices[0].text.split(stop)[0]
    assert s.choices[1].text.startswith(single[1].choices[0].text.split(stop)[0])


def test_several_prompts(client):
    """A list of prompts (strings, token ids, both): n choices each, indexed prompt * n + j, each the
    prompt's own answer; usage sums the prompts once and every choice; seeded choice k uses seed + k."""
    prompts = [p.read_text() for p in PROMPTS]
    kw = dict(model="tiny", max_tokens=6, temperature=0)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    r = client.completions.create(prompt=[prompts[0], tokenize(client, prompts[1]), prompts[2]], n=2, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    e = client.completions.create(prompt=["The sea", "And God"], echo=True, **kw)
    assert e.choices[0].text.startswith("The sea") and e.choices[1].text.startswith("And God")
    seeded = client.completions.create(prompt=["The sea", "And God"], n=2, max_tokens=6, temperature=1.0,
                                       seed=21, model="tiny")
    for k, c in enumerate(seeded.choices):
        one = client.completions.create(prompt=["The sea", "And God"][k // 2], max_tokens=6, temperature=1.0,
                                        seed=21 + k, model="tiny")
        assert c.text == one.choices[0].text
    text, finish, usage = {}, {}, None
    for ch in client.completions.create(prompt=["The sea", "And God"], n=2, stream=True,
                                        stream_options={"include_usage": True}, **kw):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1, 2, 3}
    assert [text[k] for k in range(4)] == [e.choices[k // 2].text[len(["The sea", "And God"][k // 2]):]
                                           for k in range(4)]
    assert usage.prompt_tokens == e.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=["a", ""], **kw)
    assert "'prompt[1]' is empty" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=["a"] * 65, **kw)
    assert "at most 64" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=["a"] * 9, n=16, **kw)
    assert "at most 128" in err.value.body["message"] and err.value.body["param"] == "n"


def test_n_choices_disconnect(daemon, client):
    """A client that leaves a 16-choice stream cancels every choice; the daemon keeps serving."""
    with uds_client(daemon.sock) as http:
        c = openai.OpenAI(base_url="http://moed/v1", api_key="x", http_client=http, max_retries=0)
        stream = c.completions.create(model="tiny", prompt="The sea", max_tokens=200, n=16, stream=True)
        for i, _ in enumerate(stream):
            if i == 5:
                break
        stream.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        with uds_client(daemon.sock) as http:
            if "moed_generations_in_flight 0" in http.get("/metrics").text:
                break
        time.sleep(0.05)
    else:
        raise AssertionError("the choices of a closed stream are still generating")
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=2).usage.completion_tokens == 4


def test_slots(daemon, client):
    """/slots (read-only, llama-server's shape): idle slots, then a running request on one."""
    with uds_client(daemon.sock) as http:
        deadline = time.time() + 30
        while len(slots := http.get("/slots").json()) < 8 and time.time() < deadline:
            time.sleep(0.05)  # both workers' slots, once both are ready
        assert len(slots) == 8 and [s["id"] for s in slots] == list(range(8))
        assert all(set(s) >= {"id", "id_task", "n_ctx", "is_processing", "state", "next_token"} for s in slots)
        assert all(s["n_ctx"] == 4096 for s in slots)
        assert http.post("/slots", json={}).status_code == 405
        # The tiny model decodes about 2000 tokens a second on one core, so a client that is slow to
        # read its first events (a loaded machine) can find the request already done: up to three
        # tries, each a fresh request of 4000 tokens.
        for _ in range(3):
            stream = client.completions.create(model="tiny", prompt="The sea", max_tokens=4000,
                                               stream=True, temperature=1.0, logit_bias={"0": -100})
            for i, _ in enumerate(stream):
                if i == 3:
                    break
            busy = [s for s in http.get("/slots").json() if s["is_processing"]]
            stream.close()
            if busy:
                break
        assert len(busy) == 1 and busy[0]["state"] == 1 and busy[0]["id_task"] > 0
        assert busy[0]["n_decoded"] >= 3 and busy[0]["next_token"]["n_remain"] <= 4000 - 3
        assert busy[0]["n_prompt_tokens"] == tokenize(client, "The sea").__len__()


def test_echo_with_logprobs(client):
    """echo with logprobs lists the prompt's tokens first (the first without a logprob), each
    scored given the ones before it, as OpenAI's legacy completions do."""
    p = PROMPTS[0].read_text()
    ids = tokenize(client, p)
    g = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2)
    first = g.choices[0].logprobs
    # The prompt extended by the greedy first token: its last prompt entry is that token.
    ext = ids + tokenize(client, first.tokens[0])
    assert len(ext) == len(ids) + 1
    r = client.completions.create(model="tiny", prompt=ext, max_tokens=3, temperature=0, logprobs=2,
                                  echo=True)
    lp = r.choices[0].logprobs
    n = len(ext)
    assert len(lp.tokens) == n + 3 and r.usage.prompt_tokens == n
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # every prompt position is evaluated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.tokens[n - 1] == first.tokens[0]
    assert abs(lp.token_logprobs[n - 1] - first.token_logprobs[0]) < 1e-3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 3)]
    assert r.choices[0].text.endswith("".join(lp.tokens[n:]))
    # Streamed: the echo chunk carries the prompt's entries.
    chunks = list(client.completions.create(model="tiny", prompt=ext, max_tokens=3, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].logprobs.tokens == lp.tokens[:n]
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == lp.tokens
    # Longer than one chunk of prompt rows (32 a step).
    long = client.completions.create(model="tiny", prompt=ids * 6, max_tokens=1, temperature=0, logprobs=0,
                                     echo=True)
    assert len(long.choices[0].logprobs.tokens) == len(ids) * 6 + 1
    assert all(x is not None for x in long.choices[0].logprobs.token_logprobs[1:])


SCHEMAS = [
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "count": {"type": "integer"}, "sure": {"type": "boolean"}},
     "required": ["answer", "count", "sure"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "maxItems": 3}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "null"},
                                                      {"const": "none"}]}},
     "required": ["v"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"type": ["number", "null"]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "point"},
                                      "ok": {"type": ["boolean", "null"]},
                                      "word": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["kind", "ok", "word"], "additionalProperties": False},
]


def test_structured_output_validates(client):
    """response_format json_schema (and llama-server's json_schema field) at temperature 1: every
    output parses and validates against its schema."""
    import jsonschema
    for i, schema in enumerate(SCHEMAS):
        for seed in range(3):
            if seed < 2:
                r = client.completions.create(
                    model="tiny", prompt="And God said", max_tokens=400, temperature=1.0, seed=seed,
                    extra_body={"response_format": {"type": "json_schema",
                                                    "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}}})
            else:
                r = client.completions.create(model="tiny", prompt="In the beginning", max_tokens=400,
                                              temperature=1.0, seed=seed,
                                              extra_body={"json_schema": schema})
            c = r.choices[0]
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)


def test_structured_output_chat_and_stream(client):
    schema = SCHEMAS[0]
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer."}],
                                       max_tokens=300, temperature=1.0, seed=5, response_format=rf)
    import jsonschema
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer."}],
                                            max_tokens=300, temperature=1.0, seed=5, response_format=rf,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    # json_object: a JSON object whenever generation ends on its own.
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=300, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        c = r.choices[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.finish_reason == "length"


def test_grammar_field(client):
    for seed in range(4):
        r = client.completions.create(model="tiny", prompt="And God said", max_tokens=20, temperature=1.0,
                                      seed=seed, extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
        assert r.choices[0].text in ("yes.", "no.") and r.choices[0].finish_reason == "stop"


def test_bad_constraints(client):
    bad = [
        {"grammar": "root ::= undefined-rule"},
        {"grammar": 'root ::= "a'},
        {"grammar": 5},
        {"json_schema": {"type": "object", "patternProperties": {"^a": {"type": "string"}}}},
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
        # Parses, but starts with more parse stacks than a state may hold: refused by the
        # daemon, not by the worker (which would lose its connection).
        {"grammar": "root ::= " + " | ".join('"%05d"' % i for i in range(80000))},
    ]
    for body in bad:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=body)
    # The daemon keeps serving, and no worker was restarted.
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).choices
    st = client._client.get("http://moed/admin/status").json()
    assert all(w["restarts"] == 0 for w in st["workers"]), st["workers"]
