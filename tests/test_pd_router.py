"""``deepinfer router`` in front of two prefill and two decode ``deepinfer serve`` processes.

Greedy outputs through the router equal a colocated engine's; under a skewed workload the Prefill
LB (uncached tokens) and the Decode LB (running requests) keep max/mean per-engine load <= 1.15;
a decode engine drained mid-run forwards its requests with their KV and the router finishes them
on the other decode engine, with identical outputs and none lost (whole and streamed). Streamed
completions and chat (whole and streamed) through the router equal the colocated engine's greedy
text with valid SSE framing and usage; a client that leaves mid-stream frees the decode engine's
request. n > 1, best_of, list prompts and hostile values: ``test_pd_router_n.py``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_helpers import ROOT, free_port, servers
from tiny_models import rand_ids

from deepinfer_core import LLM, SamplingParams

BS = 4
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def skewed_workload(n: int = 64) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): 4 shared prefixes; one request in four has a long tail and a long output."""
    prefixes = [rand_ids(8 + 4 * k, 300 + k) for k in range(4)]
    out = []
    for i in range(n):
        long = i % 4 == 3
        tail = rand_ids(24 + i % 16 if long else 1 + i % 4, 900 + i)
        out.append((prefixes[(i * 7) % 4] + tail, 20 + i % 8 if long else 2 + i % 5))
    return out


def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        exc.msg = f"{exc.msg}: {exc.read().decode()[:2000]}"  # the server's error in the test report
        raise


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def router(prefill: list[str], decode: list[str], *options: str):
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_core.cli", "router", "--port", str(port), "--prefill", *prefill,
           "--decode", *decode, *options]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited: {proc.stderr.read()[-3000:]}")
            with contextlib.suppress(OSError):
                get(base + "/health")
                break
            if time.time() > deadline:
                raise RuntimeError("router did not start")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(tiny_v3_path, tmp_path_factory):
    store = tmp_path_factory.mktemp("pd_store")
    ns = f"router-test-{uuid.uuid4().hex[:8]}"
    common = ["--dtype", "float32", "--chat-template", CHAT_TEMPLATE, "-o", f"block_size={BS}",
               "-o", f'kv_transfer={{backend="shm", namespace="{ns}"}}']
    kv_store = ["-o", f'kv_store={{backend="3fs", path="{store}", offload_on_finish=true}}']
    # four engines share the host: the prefill engines get one intra-op thread each, so neither stalls behind
    # the others' spinning threads (a stalled prefill engine holds its in-flight load whatever the balancer does)
    one = {"OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        prefill = ((tiny_v3_path, *common, *kv_store, "-o", 'kv_role="prefill"'), one)
        decode = ((tiny_v3_path, *common, "-o", 'kv_role="decode"'), None)
        urls = stack.enter_context(servers(prefill, prefill, decode, decode))  # their start-ups overlap
        p, d = urls[:2], urls[2:]
        # the router looks blocks up the moment they are written: no negative caching of misses
        lookups = ["-o", f'kv_store={{backend="3fs", path="{store}", negative_cache="0s"}}']
        r = stack.enter_context(router(p, d, "--model", tiny_v3_path, "--chat-template", CHAT_TEMPLATE,
                                       "-o", f"block_size={BS}", *lookups))
        yield p, d, r


def reference(path: str, work) -> list[str]:
    llm = LLM(model=path, dtype="float32", block_size=BS)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work],
                        use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def stream(url: str, body: dict) -> list[dict]:
    """POST with stream=true; the SSE events' JSON payloads, checked for framing (``data: `` lines,
    blank-line separated, ending with one ``[DONE]``)."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    frames = [json.loads(e[6:]) for e in events[:-1]]
    assert all("error" not in f and "kv_transfer_params" not in f for f in frames), frames
    assert len({f["id"] for f in frames}) == 1
    return frames


def streamed_text(frames: list[dict]) -> str:
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for f in frames for c in f["choices"])


def run_all(base: str, work, concurrency: int = 16, streamed: bool = False) -> list[dict]:
    def one(i_item):
        i, (p, m) = i_item
        body = {"prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True}
        if streamed and i % 4:
            frames = stream(base + "/v1/completions", body)
            assert not any(c["finish_reason"] == "forwarded" for f in frames for c in f["choices"])
            return {"choices": [{"text": streamed_text(frames)}]}
        return post(base + "/v1/completions", body)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, enumerate(work)))


def test_router_identical_and_balanced(cluster, tiny_v3_path):
    p, d, r = cluster
    work = skewed_workload()
    ref = reference(tiny_v3_path, work)
    outs = run_all(r, work)
    assert [o["choices"][0]["text"] for o in outs] == ref
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
    assert [o["usage"]["completion_tokens"] for o in outs] == [m for _, m in work]
    # a second pass: the store now holds the prompts' blocks, the router's metadata match sees them (the
    # whole workload again: 128 routing decisions average the balance over more placements of long prompts)
    again = run_all(r, work)
    assert [o["choices"][0]["text"] for o in again] == ref
    stats = get(r + "/router/stats")
    print("router stats:", json.dumps(stats))
    assert stats["requests"] == 128 and stats["prefix_cached_tokens"] > 0
    # per-engine load, averaged over the routing decisions: uncached prompt tokens being prefilled,
    # running decode requests
    assert stats["prefill"]["in_flight"] <= 1.15, stats["prefill"]
    assert stats["decode"]["in_flight"] <= 1.15, stats["decode"]


def metric(base: str, name: str, label: str = "") -> float:
    """A Prometheus sample of an engine's /metrics (summed over series whose labels contain ``label``)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name + "{") and label in x)


def test_streams_chat_and_refusals(cluster, tiny_v3_path):
    from deepinfer_core.engine.tokenizer import HFTokenizer
    from deepinfer_core.serving.chat import ChatEncoder

    p, d, r = cluster
    work = [(prompt, 6 + i) for i, (prompt, _) in enumerate(skewed_workload(3))]
    messages = [{"role": "user", "content": "the stone is red"}, {"role": "assistant", "content": "it is"},
                {"role": "user", "content": "on the hill"}]
    model_dir = Path(tiny_v3_path)
    chat_ids = ChatEncoder(model_dir, HFTokenizer.load(model_dir, 0, [1]), CHAT_TEMPLATE).encode(
        messages, add_generation_prompt=True)
    ref = reference(tiny_v3_path, [*work, (chat_ids, 9)])
    for (prompt, m), want in zip(work, ref):
        frames = stream(r + "/v1/completions", {"prompt": prompt, "max_tokens": m, "temperature": 0,
                                                "ignore_eos": True, "stream_options": {"include_usage": True}})
        assert streamed_text(frames) == want
        assert [c["finish_reason"] for f in frames for c in f["choices"] if c["finish_reason"]] == ["length"]
        assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == m
        assert frames[-1]["usage"]["prompt_tokens"] == len(prompt)
        assert all("usage" not in f for f in frames[:-1])
    chat = {"messages": messages, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    whole = post(r + "/v1/chat/completions", chat)
    assert whole["object"] == "chat.completion" and "kv_transfer_params" not in whole
    assert whole["choices"][0]["message"]["content"] == ref[-1]
    assert whole["usage"]["prompt_tokens"] == len(chat_ids) and whole["usage"]["completion_tokens"] == 9
    frames = stream(r + "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(f["object"] == "chat.completion.chunk" for f in frames)
    assert streamed_text(frames) == ref[-1] and frames[-1]["usage"]["completion_tokens"] == 9
    # a client that leaves mid-stream: the decode engine aborts its request and frees its KV
    # (400 tokens decode in about a second here: on a loaded machine a request can finish before the client's
    # leaving reaches the decode engine, so up to 5 clients leave; one abort is needed, and none may be lost)
    kv0 = [metric(u, "deepinfer:kv_cache_usage_perc") for u in d]
    req = urllib.request.Request(r + "/v1/completions", json.dumps(
        {"prompt": work[0][0], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}).encode(),
        {"Content-Type": "application/json"})

    def finished(reason: str) -> float:
        return sum(metric(u, "deepinfer:request_success_total", f'finished_reason="{reason}"') for u in d)

    for _ in range(5):
        aborted0, done0 = finished("abort"), finished("length")
        with urllib.request.urlopen(req, timeout=300) as resp:
            assert resp.readline().startswith(b"data: {")  # decoding has started
        deadline = time.time() + 60
        while finished("abort") + finished("length") < aborted0 + done0 + 1:
            assert time.time() < deadline, "the request of the client that left neither aborted nor finished"
            time.sleep(0.05)
        if finished("abort") == aborted0 + 1:
            break
    else:
        raise AssertionError("the decode engine never aborted the request of a client that left (5 tries)")
    assert [metric(u, "deepinfer:num_requests_running") for u in d] == [0, 0]
    assert [metric(u, "deepinfer:kv_cache_usage_perc") for u in d] == kv0


def test_drain_forwards_through_the_router(cluster, tiny_v3_path):
    p, d, r = cluster
    # long enough outputs that the drain finds several requests, streamed ones among them, still decoding
    # (with 96 tokens a loaded CI box once forwarded a single, non-streamed one)
    work = [(prompt, 160) for prompt, _ in skewed_workload(24)]
    ref = reference(tiny_v3_path, work)
    before = get(r + "/router/stats")["forwarded"]
    with ThreadPoolExecutor(1) as side:
        pending = side.submit(run_all, r, work, 12, True)  # three in four streamed
        deadline = time.time() + 120
        # decoding on the first engine, as it reports itself (the router's view can lag behind)
        while metric(d[0], "deepinfer:num_requests_running") < 4:
            assert time.time() < deadline, "no request reached the first decode engine"
            time.sleep(0.02)
        assert post(d[0] + "/v1/drain", {"grace_s": 0.05}) == {"draining": True}
        outs = pending.result(timeout=600)
    assert [o["choices"][0]["text"] for o in outs] == ref  # 0 lost, identical, no token twice in a stream
    stats = get(r + "/router/stats")
    print("router stats after the drain:", json.dumps(stats))
    assert stats["forwarded"] > before and stats["forwarded_streams"] > 0
    with pytest.raises(urllib.error.HTTPError) as err:  # the drained engine admits nothing new
        post(d[0] + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
    assert err.value.code == 503
