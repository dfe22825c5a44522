"""``n`` / ``best_of`` / list prompts through ``deepinfer router``, against a colocated ``deepinfer serve``.

One prefill and two decode engines behind the router, and a colocated server of the same model.
Every answer through the router (completions and chat, whole and streamed, greedy and seeded
sampling, with logprobs) equals the colocated server's choice by choice, index by index, with the
same usage. Hostile ``n`` / ``best_of`` / ``seed`` / ``prompt`` values are 400s naming the field while
a good request runs on. Last, a decode engine drained in the middle of an n > 1 request (streamed
with logprobs, whole best_of, streamed chat) forwards every completion; the router continues each on
the other decode engine and the client gets the undisturbed run's text and logprob entries once.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_helpers import server
from test_pd_router import CHAT_TEMPLATE, get, post, router
from tiny_models import rand_ids

BS = 4
PROMPT = rand_ids(13, 41)  # three full blocks and a partial one: the samples share the full ones
OTHER = rand_ids(6, 42)
MESSAGES = [{"role": "user", "content": "the stone is red"}]


@pytest.fixture(scope="module")
def engines(tiny_v3_path):
    """(prefill URL, decode URLs, router URL, colocated URL), all started at once."""
    common = ["--dtype", "float32", "--chat-template", CHAT_TEMPLATE, "-o", f"block_size={BS}"]
    ns = f"router-n-{uuid.uuid4().hex[:8]}"
    pd = [*common, "-o", f'kv_transfer={{backend="shm", namespace="{ns}"}}']
    args = [[tiny_v3_path, *pd, "-o", 'kv_role="prefill"'], [tiny_v3_path, *pd, "-o", 'kv_role="decode"'],
            [tiny_v3_path, *pd, "-o", 'kv_role="decode"'], [tiny_v3_path, *common]]
    with contextlib.ExitStack() as stack:
        managers = [server(*a) for a in args]
        with ThreadPoolExecutor(len(managers)) as pool:
            started = list(pool.map(lambda m: m.__enter__(), managers))
        for m in managers:
            stack.push(m.__exit__)
        p, d0, d1, colocated = started
        r = stack.enter_context(router([p], [d0, d1], "--model", tiny_v3_path, "--chat-template", CHAT_TEMPLATE,
                                       "-o", f"block_size={BS}"))
        yield p, [d0, d1], r, colocated


def sse(url: str, body: dict, started: threading.Event | None = None) -> list[dict]:
    """The frames of a stream (checked: framing, no router-internal field); ``started`` is set at the
    first frame that carries a token."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    raw = b""
    with urllib.request.urlopen(req, timeout=300) as r:
        while line := r.readline():
            raw += line
            if started is not None and b'"logprobs": {' in line:
                started.set()
    events = raw.decode()[:-2].split("\n\n")
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    frames = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("error" not in f and "kv_transfer_params" not in f for f in frames), frames
    for f in frames:
        for c in f["choices"]:
            assert c["finish_reason"] != "forwarded" and "pd" not in c and "kv_transfer_params" not in c, c
    return frames


def entries(lp: dict | None) -> list:
    """The per-token logprob entries of a choice's ``logprobs`` (completions or chat)."""
    if not lp:
        return []
    if "content" in lp:
        return list(lp["content"] or [])
    return [list(x) for x in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"])]


def assemble(frames: list[dict]) -> dict:
    """A stream as {"choices": {index: {text, logprobs entries, finish_reason}}, "usage"}."""
    out: dict = {}
    for f in frames:
        for c in f["choices"]:
            x = out.setdefault(c["index"], {"text": "", "logprobs": [], "finish_reason": None})
            x["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            x["logprobs"] += entries(c.get("logprobs"))
            if c.get("finish_reason") is not None:
                assert x["finish_reason"] is None, f"choice {c['index']} finished twice"
                x["finish_reason"] = c["finish_reason"]
    return {"choices": out, "usage": frames[-1].get("usage")}


def whole_choices(reply: dict) -> dict:
    return {c["index"]: {"text": c["text"] if "text" in c else c["message"]["content"],
                         "logprobs": entries(c.get("logprobs")), "finish_reason": c["finish_reason"]}
            for c in reply["choices"]}


def close(a, b, tol: float = 1e-4) -> bool:
    """Equal, floats within ``tol`` (the P/D engines batch differently from the colocated one)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=tol)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    return a == b


def first_diff(a, b, path: str = "") -> str | None:
    """Where ``close(a, b)`` fails first (for the assertion message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        return next((d for k in a if (d := first_diff(a[k], b[k], f"{path}[{k!r}]"))), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} entries != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_diff(x, y, f"{path}[{i}]"))), None)
    return None if close(a, b) else f"{path}: {a!r} != {b!r}"


def same_usage(a: dict, b: dict) -> None:
    assert (a["prompt_tokens"], a["completion_tokens"], a["total_tokens"]) == \
        (b["prompt_tokens"], b["completion_tokens"], b["total_tokens"]), (a, b)


CASES = [  # (endpoint, body)
    ("/v1/completions", {"prompt": PROMPT, "n": 3, "temperature": 0.9, "seed": 7, "logprobs": 2, "max_tokens": 9}),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "temperature": 0, "max_tokens": 6}),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "best_of": 4, "temperature": 1.0, "seed": 11, "max_tokens": 7}),
    ("/v1/completions", {"prompt": [PROMPT, OTHER], "n": 2, "temperature": 0.8, "seed": 3, "logprobs": 1,
                         "max_tokens": 5}),
    ("/v1/completions", {"prompt": ["the stone", "is red"], "temperature": 0.7, "seed": 5, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 3, "temperature": 0.9, "seed": 2, "logprobs": True,
                              "top_logprobs": 2, "max_tokens": 8}),
]


@pytest.mark.parametrize("endpoint,body", CASES, ids=["n3-seeded-logprobs", "n2-greedy", "best_of4-n2",
                                                      "list-n2", "list-text", "chat-n3"])
def test_whole_equals_colocated(engines, endpoint, body):
    _, _, r, colocated = engines
    body = {**body, "ignore_eos": True}
    want, got = post(colocated + endpoint, body), post(r + endpoint, body)
    assert close(whole_choices(got), whole_choices(want)), first_diff(whole_choices(got), whole_choices(want))
    assert sorted(whole_choices(got)) == list(range(len(want["choices"])))
    same_usage(got["usage"], want["usage"])
    assert "kv_transfer_params" not in got and got["object"] == want["object"]


@pytest.mark.parametrize("endpoint,body", [c for c in CASES if "best_of" not in c[1]],
                         ids=["n3-seeded-logprobs", "n2-greedy", "list-n2", "list-text", "chat-n3"])
def test_streamed_equals_colocated(engines, endpoint, body):
    _, _, r, colocated = engines
    body = {**body, "ignore_eos": True, "stream_options": {"include_usage": True}}
    want, got = assemble(sse(colocated + endpoint, body)), assemble(sse(r + endpoint, body))
    assert close(got["choices"], want["choices"]), first_diff(got["choices"], want["choices"])
    same_usage(got["usage"], want["usage"])
    # and a stream says what the whole answer says (text_offset counted from the tokens, not the chunks)
    whole = whole_choices(post(colocated + endpoint, {k: v for k, v in body.items() if k != "stream_options"}))
    assert close(want["choices"], whole), first_diff(want["choices"], whole)


def refused(url: str, body: dict) -> dict:
    with pytest.raises(urllib.error.HTTPError) as err:
        post(url, body)
    assert err.value.code == 400, err.value.msg
    return json.loads(err.value.msg.split(": ", 1)[1])["error"]


def test_hostile_samples_and_prompts(engines):
    """Each is a 400 naming the field (the router's cap on n and best_of is the engines': 128), while
    a good streamed n = 2 request runs on and equals its undisturbed answer."""
    _, d, r, colocated = engines
    good = {"prompt": PROMPT, "n": 2, "temperature": 0.9, "seed": 9, "max_tokens": 24, "ignore_eos": True}
    with ThreadPoolExecutor(1) as side:
        running = side.submit(sse, r + "/v1/completions", good)
        for extra, param in [({"n": 0}, "n"), ({"n": -3}, "n"), ({"n": 129}, "n"), ({"n": 10 ** 12}, "n"),
                             ({"n": "2"}, "n"), ({"n": 2.5}, "n"), ({"n": True}, "n"),
                             ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 129}, "best_of"),
                             ({"best_of": 0}, "best_of"), ({"best_of": "4"}, "best_of"),
                             ({"n": 1, "best_of": 2, "stream": True}, "best_of"), ({"seed": "x"}, "seed"),
                             ({"seed": 1.5}, "seed"), ({"prompt": ["a", 5]}, "prompt"),
                             ({"prompt": [[1, 2], []]}, "prompt"), ({"prompt": [[1, 2], [3, 10 ** 9]]}, "prompt"),
                             ({"prompt": [[1, 2], "ok", {"x": 1}]}, "prompt"), ({"prompt": []}, "prompt"),
                             ({"prompt": [PROMPT, [1] * 100_000]}, "prompt"),
                             ({"kv_transfer_params": {"key": "x"}}, "kv_transfer_params")]:
            e = refused(r + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
            assert e["param"] == param and e["type"] == "invalid_request_error" and param in e["message"], (extra, e)
        e = refused(r + "/v1/chat/completions", {"messages": MESSAGES, "n": 0})
        assert e["param"] == "n"
        for extra, param in [({"n": 129}, "n"), ({"best_of": 129}, "best_of")]:  # the same cap, colocated
            assert refused(colocated + "/v1/completions", {"prompt": PROMPT, **extra})["param"] == param
        got = assemble(running.result(timeout=300))
    assert got["choices"] == assemble(sse(colocated + "/v1/completions", good))["choices"]
    assert all(get_running(u) == 0 for u in d)


def get_running(base: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("deepinfer:num_requests_running"))


def test_drain_mid_n_request(engines, tiny_v3_path):
    """Three requests on the first decode engine (each through its own fresh router, whose first pick it
    is), drained mid-decode: every completion is forwarded, continued on the other decode engine, and
    the answers equal the undisturbed ones: a stream's text and logprob entries appear once each, and
    a whole best_of's candidates (logprobs included) are ranked as the engine ranks them."""
    p, d, r, colocated = engines
    m = 160  # tokens per completion: the drain lands mid-decode
    streamed = {"prompt": PROMPT, "n": 3, "temperature": 0.9, "seed": 21, "logprobs": 2, "max_tokens": m,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
    best = {"prompt": [PROMPT, OTHER], "n": 2, "best_of": 3, "temperature": 1.0, "seed": 4, "max_tokens": m,
            "logprobs": 2, "ignore_eos": True}
    chat = {"messages": MESSAGES, "n": 2, "temperature": 0.8, "seed": 6, "logprobs": True, "top_logprobs": 2,
            "max_tokens": m, "ignore_eos": True, "stream_options": {"include_usage": True}}
    want = [assemble(sse(r + "/v1/completions", streamed)), post(r + "/v1/completions", best),
            assemble(sse(r + "/v1/chat/completions", chat))]  # undisturbed, through the router
    opts = ("--model", tiny_v3_path, "--chat-template", CHAT_TEMPLATE, "-o", f"block_size={BS}")
    started = [threading.Event(), threading.Event()]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(3) as pool:
        fresh = [stack.enter_context(router([p], d, *opts)) for _ in range(3)]
        runs = [pool.submit(sse, fresh[0] + "/v1/completions", streamed, started[0]),
                pool.submit(post, fresh[1] + "/v1/completions", best),
                pool.submit(sse, fresh[2] + "/v1/chat/completions", chat, started[1])]
        deadline = time.time() + 120
        while not (all(e.is_set() for e in started) and  # both streams are decoding, all three on d[0]
                   all(get(u + "/router/stats")["decode"]["running_per_engine"][0] >= 1 for u in fresh)):
            assert time.time() < deadline, "the requests did not reach the first decode engine"
            assert not any(f.done() for f in runs), "a request finished before the drain"
            time.sleep(0.02)
        assert post(d[0] + "/v1/drain", {"grace_s": 0}) == {"draining": True}
        got = [assemble(runs[0].result(timeout=300)), runs[1].result(timeout=300),
               assemble(runs[2].result(timeout=300))]
        stats = [get(u + "/router/stats") for u in fresh]
    print("fresh routers after the drain:", [s["forwarded"] for s in stats])
    assert all(s["forwarded"] >= 1 for s in stats), stats  # each request crossed a forward
    assert stats[0]["forwarded_streams"] >= 1 and stats[2]["forwarded_streams"] >= 1
    # the stream: each choice's text and logprob entries exactly once, equal to the undisturbed run's
    for g, w in ((got[0], want[0]), (got[2], want[2])):
        assert sorted(g["choices"]) == sorted(w["choices"])
        for i in w["choices"]:
            assert len(g["choices"][i]["logprobs"]) == m, (i, len(g["choices"][i]["logprobs"]))
            assert close(g["choices"][i], w["choices"][i]), first_diff(g["choices"][i], w["choices"][i], str(i))
        same_usage(g["usage"], w["usage"])
    assert close(whole_choices(got[1]), whole_choices(want[1]))
    same_usage(got[1]["usage"], want[1]["usage"])
    assert get_running(d[0]) == 0 and get_running(d[1]) == 0
    assert close(whole_choices(got[1]), whole_choices(post(colocated + "/v1/completions", best)))
