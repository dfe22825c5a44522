"""``deepinfer serve``: a real server process on 127.0.0.1 with the embedded model, driven by the real
``openai`` client (and raw HTTP where the framing itself is under test)."""

from __future__ import annotations

import asyncio
import json

import pytest

try:
    import httpx
except ImportError:  # newer openai clients ship the same API as httpx2
    import httpx2 as httpx

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.loader import EMBEDDED_MODEL

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_helpers import metric_samples, server, wait_for  # noqa: E402

MAX_NUM_SEQS, MAX_QUEUE = 8, 56  # 64 requests in flight at most
PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:", "# parse the arguments\n"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def base():
    with server("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue-len", str(MAX_QUEUE),
                "-o", 'features=["structured_output"]', "--served-model-name", "tiny") as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def llm():
    with LLM(features=["structured_output"]) as llm:
        yield llm


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ---- text identical to LLM.generate ---------------------------------------------------------------
def test_completions_match_llm_generate(client, llm):
    for prompt in PROMPTS:
        ref = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert whole.choices[0].text == ref.text
        assert whole.choices[0].finish_reason == ref.finish_reason
        assert whole.usage.completion_tokens == len(ref.token_ids)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_strings_stream_like_the_whole_text(client, llm):
    ref = llm.generate([PROMPTS[0]], greedy(40), use_tqdm=False)[0].outputs[0].text
    stop = ref[12:15]
    want = llm.generate([PROMPTS[0]], greedy(40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and want.stop_reason == stop and want.text == ref[: ref.index(stop)]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_matches_llm_chat(client, llm):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A sort function"}]
    ref = llm.chat(messages, greedy(), use_tqdm=False)[0]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids) == len(llm.chat_encoder.encode(messages))
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


# ---- SSE framing, usage, n, logprobs --------------------------------------------------------------
def test_sse_framing_and_usage(base):
    body = {"prompt": PROMPTS[1], "max_tokens": 9, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")[:-1]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames)
    events = [json.loads(f[6:]) for f in frames[:-1]]
    assert len({e["id"] for e in events}) == 1
    finals = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1] and {c["finish_reason"] for c in finals} == {"length"}
    assert events[-1]["choices"] == []
    prompt_len = len(LLM_TOKENIZER().encode(PROMPTS[1]))
    assert events[-1]["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 18, "total_tokens":
                                   prompt_len + 18, "prompt_tokens_details": {"cached_tokens": 0}}


def LLM_TOKENIZER():
    from deepinfer_core.engine.tokenizer import HFTokenizer

    return HFTokenizer.load(EMBEDDED_MODEL, 0, [1])


def test_n_samples_with_seed_are_reproducible_and_share_the_prompt(client):
    prompt = "x = 1\n" * 40  # several full KV blocks for the siblings to reuse
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # different seeds per sample
    assert b.usage.prompt_tokens_details.cached_tokens > 0


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    c = client.completions.create(model="tiny", prompt="def f(", max_tokens=4, temperature=0, logprobs=1)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 4


# ---- structured output and tool calls -------------------------------------------------------------
def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a number"}],
                                       max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "num", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["n"], int)


def test_tool_call_streaming_reassembles_to_the_whole_result(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=200,
              temperature=0, tools=[WEATHER_TOOL], tool_choice="required")
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    names, args, ids, finish = [], [], set(), None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                if tc.function.name:
                    names.append(tc.function.name)
                args.append(tc.function.arguments or "")
    assert names == ["get_weather"] and len(ids) == 1 and finish == "tool_calls"
    assert len([a for a in args if a]) > 1  # the arguments arrived in fragments
    assert "".join(args) == call.function.arguments


# ---- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_token": 5}, "max_token"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [], "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
])
def test_bad_fields_are_400_naming_the_field(base, path, body, param):
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param.split(".")[0] in err["message"]
    assert httpx.get(base + "/health").status_code == 200


def test_a_request_that_fails_alone_is_400_and_others_run(client, base):
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "guided_regex": "(("}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    s = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True,
                                                   "guided_regex": "(("}, timeout=60)
    frames = [f for f in s.text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]" and json.loads(frames[-2][6:])["error"]["code"] == 400
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"guided_regex": "[a-c]{3}"})
    assert len(ok.choices[0].text) == 3 and set(ok.choices[0].text) <= set("abc")
    too_many = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 100}, timeout=60)
    assert too_many.status_code == 429  # n completions count against the admission limit


def test_unknown_model_is_404_and_openai_client_raises(client, base):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert "gpt-9" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, top_p=3.0)
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_models_and_metrics(client, base):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    client.completions.create(model="tiny", prompt="x = ", max_tokens=3, temperature=0)
    m = metric_samples(base)
    assert m[("deepinfer:request_success_total", (("finished_reason", "length"),))] >= 1
    assert m[("deepinfer:time_to_first_token_seconds_count", ())] >= 1
    assert m[("deepinfer:inter_token_latency_seconds_count", ())] >= 1
    assert m[("deepinfer:generation_tokens_total", ())] >= 3
    assert ("deepinfer:kv_cache_usage_perc", ()) in m and ("deepinfer:num_requests_running", ()) in m


# ---- disconnects, concurrency, admission -----------------------------------------------------------
def test_client_disconnect_mid_stream_frees_the_request(base):
    aborted0 = metric_samples(base).get(("deepinfer:request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric_samples(base)[("deepinfer:num_requests_running", ())] == 1
        assert metric_samples(base)[("deepinfer:kv_cache_usage_perc", ())] > 0
    # the connection is closed: the request is aborted and its KV blocks return
    wait_for(lambda: metric_samples(base)[("deepinfer:kv_cache_usage_perc", ())] == 0, what="KV usage back to 0")
    m = metric_samples(base)
    assert m[("deepinfer:num_requests_running", ())] == 0
    assert m[("deepinfer:request_success_total", (("finished_reason", "abort"),))] == aborted0 + 1


def test_64_concurrent_streams_lose_nothing(base):
    async def main():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)

        async def one(i):
            stream = await client.completions.create(model="tiny", prompt=f"item_{i} = ", max_tokens=6,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True})
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
            return finish, usage.completion_tokens

        results = await asyncio.gather(*(one(i) for i in range(64)))
        await client.close()
        return results

    results = asyncio.run(main())
    assert results == [("length", 6)] * 64


def test_queue_overflow_is_429_and_the_server_stays_healthy(base):
    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            body = {"prompt": "while True:", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
            return await asyncio.gather(*(c.post(base + "/v1/completions", json=body) for _ in range(100)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429} and codes.count(200) >= MAX_NUM_SEQS + MAX_QUEUE // 2
    err = next(r for r in responses if r.status_code == 429)
    assert err.json()["error"]["type"] == "rate_limit_error" and "capacity" in err.json()["error"]["message"]
    assert err.headers["retry-after"] == "1"
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in responses if r.status_code == 200)
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_speculation_behind_the_server_streams_plain_decodings_tokens():
    """A server drafting with ``ngram`` (async scheduling on, several tokens a step): streamed and whole
    completions, with logprobs, equal plain decoding offline; seeded sampled choices (n = 2) too, since
    point-mass drafts are verified by coupling."""
    prompt = "import os\nimport sys\nimport os\nimport"  # (its greedy continuation repeats: drafts are kept)
    greedy = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    sampled = {"prompt": "hello world hello world hello", "max_tokens": 24, "temperature": 0.8, "seed": 7, "n": 2,
               "ignore_eos": True}
    plain = LLM(async_scheduling=True)
    want = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    want_s = plain.generate(sampled["prompt"], SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=24,
                                                             ignore_eos=True), use_tqdm=False)
    with server("-o", 'speculative={proposer="ngram", k=4, device="on"}', "-o", "async_scheduling=true") as url:
        whole = httpx.post(url + "/v1/completions", json=greedy, timeout=120).json()["choices"][0]
        with httpx.stream("POST", url + "/v1/completions", json={**greedy, "stream": True}, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        seeded = httpx.post(url + "/v1/completions", json=sampled, timeout=120).json()["choices"]
        spec = metric_samples(url)
    assert whole["text"] == want[0].outputs[0].text and len(whole["logprobs"]["tokens"]) == 48
    streamed = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in streamed) == whole["text"]
    assert sum(len(c["logprobs"]["tokens"]) for c in streamed if c.get("logprobs")) == 48
    assert sorted(c["text"] for c in seeded) == sorted(o.text for o in want_s[0].outputs)
    drafts, kept = (spec[f"deepinfer:spec_decode_num_{w}_tokens_total", ()] for w in ("draft", "accepted"))
    assert drafts > 0 and 0 < kept <= drafts  # every proposer's drafts are counted, not DSpark's only
    assert 1 <= spec["deepinfer:spec_decode_acceptance_rate_count", ()] <= 4  # per completion with drafts
