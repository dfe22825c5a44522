"""``deepinfer router`` in front of two prefill and two decode ``deepinfer serve`` processes.

Greedy outputs through the router equal a colocated engine's; under a skewed workload the Prefill
LB (uncached tokens) and the Decode LB (running requests) keep max/mean per-engine load <= 1.15;
a decode engine drained mid-run forwards its requests with their KV and the router finishes them
on the other decode engine, with identical outputs and none lost.
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

import pytest
from server_helpers import ROOT, free_port, server
from tiny_models import rand_ids

from deepinfer_core import LLM, SamplingParams

BS = 4


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
    common = ["--dtype", "float32", "-o", f"block_size={BS}", "-o", f'kv_transfer={{backend="shm", namespace="{ns}"}}']
    kv_store = ["-o", f'kv_store={{backend="3fs", path="{store}", offload_on_finish=true}}']
    with contextlib.ExitStack() as stack:
        p = [stack.enter_context(server(tiny_v3_path, *common, *kv_store, "-o", 'kv_role="prefill"'))
             for _ in range(2)]
        d = [stack.enter_context(server(tiny_v3_path, *common, "-o", 'kv_role="decode"')) for _ in range(2)]
        # the router looks blocks up the moment they are written: no negative caching of misses
        lookups = ["-o", f'kv_store={{backend="3fs", path="{store}", negative_cache="0s"}}']
        r = stack.enter_context(router(p, d, "--model", tiny_v3_path, "-o", f"block_size={BS}", *lookups))
        yield p, d, r


def reference(path: str, work) -> list[str]:
    llm = LLM(model=path, dtype="float32", block_size=BS)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work],
                        use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def run_all(base: str, work, concurrency: int = 16) -> list[dict]:
    def one(item):
        p, m = item
        return post(base + "/v1/completions", {"prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True})

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, work))


def test_router_identical_and_balanced(cluster, tiny_v3_path):
    p, d, r = cluster
    work = skewed_workload()
    ref = reference(tiny_v3_path, work)
    outs = run_all(r, work)
    assert [o["choices"][0]["text"] for o in outs] == ref
    assert all(o["choices"][0]["finish_reason"] == "length" for o in outs)
    assert [o["usage"]["completion_tokens"] for o in outs] == [m for _, m in work]
    # a second pass: the store now holds the prompts' blocks, the router's metadata match sees them
    again = run_all(r, work[:16])
    assert [o["choices"][0]["text"] for o in again] == ref[:16]
    stats = get(r + "/router/stats")
    print("router stats:", json.dumps(stats))
    assert stats["requests"] == 80 and stats["prefix_cached_tokens"] > 0
    # per-engine load, averaged over the routing decisions: uncached prompt tokens being prefilled,
    # running decode requests
    assert stats["prefill"]["in_flight"] <= 1.15, stats["prefill"]
    assert stats["decode"]["in_flight"] <= 1.15, stats["decode"]


def test_drain_forwards_through_the_router(cluster, tiny_v3_path):
    p, d, r = cluster
    work = [(prompt, 64) for prompt, _ in skewed_workload(24)]
    ref = reference(tiny_v3_path, work)
    before = get(r + "/router/stats")["forwarded"]
    with ThreadPoolExecutor(1) as side:
        pending = side.submit(run_all, r, work, 12)
        deadline = time.time() + 120
        while get(r + "/router/stats")["decode"]["running_per_engine"][0] < 3:  # decoding on the first engine
            assert time.time() < deadline, "no request reached the first decode engine"
            time.sleep(0.05)
        assert post(d[0] + "/v1/drain", {"grace_s": 0.2}) == {"draining": True}
        outs = pending.result(timeout=600)
    assert [o["choices"][0]["text"] for o in outs] == ref  # 0 lost, identical
    stats = get(r + "/router/stats")
    assert stats["forwarded"] > before
    with pytest.raises(urllib.error.HTTPError) as err:  # the drained engine admits nothing new
        post(d[0] + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
    assert err.value.code == 503
