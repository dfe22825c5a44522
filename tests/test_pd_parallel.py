"""P/D disaggregation with data/expert-parallel engines: each rank of a dp = ep = 2 engine receives
(decode) or sends (prefill) the hand-offs of its own requests, and the driver reports them exactly
as a single-rank engine does (``RequestOutput.kv_transfer_params``, the ``handoff_*`` metrics).
Greedy tokens equal a colocated single-rank engine's; a corrupt hand-off on a rank recomputes; no
rank leaks a KV block."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest
from parallel_helpers import ep_checkpoint
from tiny_models import rand_ids

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return ep_checkpoint(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    """16 prompts over 3 shared prefixes (8..16 tokens) with tails of 1..6 tokens."""
    prefixes = [rand_ids(8 + 4 * k, 40 + k) for k in range(3)]
    return [{"prompt_token_ids": prefixes[i % 3] + rand_ids(1 + i % 6, 800 + i)} for i in range(16)]


def kw(path: str, **extra) -> dict:
    return dict(model=path, dtype="float32", block_size=4, kv_cache_memory=2 << 20, worker_timeout_s=60.0, **extra)


@pytest.fixture(scope="module")
def colocated(ckpt, prompts) -> list[list[int]]:
    llm = LLM(**kw(ckpt))
    out = tokens(llm.generate(prompts, PARAMS, use_tqdm=False))
    llm.shutdown()
    return out


def tokens(outs) -> list[list[int]]:
    for o in outs:
        assert o.error is None, o.error
    return [o.outputs[0].token_ids for o in outs]


def section(backend: str, tmp_path: Path) -> dict:
    if backend == "shm":
        return {"backend": "shm", "namespace": f"pdpar-{uuid.uuid4().hex[:8]}"}
    return {"backend": "3fs", "path": str(tmp_path / "store")}


def decode_params(outs) -> list[SamplingParams]:
    return [dataclasses.replace(PARAMS, kv_transfer_params=o.kv_transfer_params) for o in outs]


def check_no_leaks(llm: LLM) -> None:
    """Every rank (or the one engine) has every KV block free."""
    eng = llm.engine
    (eng.check_no_leaks if hasattr(eng, "check_no_leaks") else eng.blocks.check_no_leaks)()


@pytest.mark.parametrize("backend", ["shm", "3fs"])
def test_prefill_one_rank_to_decode_dp2_ep2(ckpt, prompts, colocated, backend, tmp_path):
    """P (one rank) -> D (dp = ep = 2): each decode rank takes its requests' KV from the transport."""
    sec = section(backend, tmp_path)
    p = LLM(kv_role="prefill", kv_transfer=sec, **kw(ckpt))
    pouts = p.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in pouts] == [c[:1] for c in colocated]
    d = LLM(kv_role="decode", kv_transfer=sec, dp=2, ep=2, **kw(ckpt))
    try:
        douts = d.generate(prompts, decode_params(pouts), use_tqdm=False)
        assert tokens(douts) == colocated
        assert [o.metrics.num_cached_tokens_by_tier.get("handoff") for o in douts] == [
            len(q["prompt_token_ids"]) for q in prompts]
        m = d.metrics()
        assert m["handoff_received"] == len(prompts) and m.get("handoff_recomputed", 0) == 0
        assert [r["handoff_received"] for r in m["ranks"]] == [8, 8]  # both ranks received their own
        assert m["prefill_tokens"] == len(prompts)  # one token per request: the prompt KV came from P
        assert d.engine.kv_layout_info() == p.engine.kv_layout_info()  # what a router reads (/v1/kv_layout)
        # n = 2: child 0 continues the hand-off, child 1 (seeded sampling) computes the prompt itself
        two = dataclasses.replace(PARAMS, n=2, temperature=0.8, seq_seed=5)
        ref = LLM(**kw(ckpt))
        want = [[c.token_ids for c in o.outputs] for o in ref.generate(prompts[:2], two, use_tqdm=False)]
        ref.shutdown()
        again = p.generate(prompts[:2], dataclasses.replace(two, n=1), use_tqdm=False)
        outs = d.generate(prompts[:2], [dataclasses.replace(two, kv_transfer_params=o.kv_transfer_params)
                                        for o in again], use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == want
        assert d.metrics()["handoff_received"] == len(prompts) + 2
        check_no_leaks(d)
        check_no_leaks(p)
    finally:
        d.shutdown()
        p.shutdown()


def test_prefill_dp2_to_decode_one_rank(ckpt, prompts, colocated, tmp_path):
    """P (dp = ep = 2): each prefill rank sends its requests' KV; the driver reports their
    kv_transfer_params as a single-rank prefill engine does, and a one-rank D continues them."""
    sec = section("shm", tmp_path)
    p = LLM(kv_role="prefill", kv_transfer=sec, dp=2, ep=2, **kw(ckpt))
    try:
        pouts = p.generate(prompts, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in pouts] == [c[:1] for c in colocated]
        assert all(o.kv_transfer_params and o.outputs[0].finish_reason == "length" for o in pouts)
        pm = p.metrics()
        assert pm["handoff_sent"] == len(prompts) and [r["handoff_sent"] for r in pm["ranks"]] == [8, 8]
        check_no_leaks(p)
    finally:
        p.shutdown()
    d = LLM(kv_role="decode", kv_transfer=sec, **kw(ckpt))
    douts = d.generate(prompts, decode_params(pouts), use_tqdm=False)
    assert tokens(douts) == colocated
    assert d.metrics()["handoff_received"] == len(prompts)
    check_no_leaks(d)
    d.shutdown()


def test_corrupt_handoff_on_a_decode_rank_recomputes(ckpt, prompts, colocated, tmp_path):
    """One payload corrupted, one missing: the rank that owns each recomputes it from the prompt."""
    sec = section("3fs", tmp_path)
    p = LLM(kv_role="prefill", kv_transfer=sec, **kw(ckpt))
    pouts = p.generate(prompts[:6], PARAMS, use_tqdm=False)
    p.shutdown()
    files = tmp_path / "store" / "handoff"
    bad = files / pouts[1].kv_transfer_params["key"]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x5A  # inside the KV rows: only the hash check can see it
    bad.write_bytes(bytes(data))
    (files / pouts[4].kv_transfer_params["key"]).unlink()
    d = LLM(kv_role="decode", kv_transfer=sec, dp=2, ep=2, **kw(ckpt))
    try:
        douts = d.generate(prompts[:6], decode_params(pouts), use_tqdm=False)
        assert tokens(douts) == colocated[:6]
        m = d.metrics()
        assert m["handoff_received"] == 4 and m["handoff_recomputed"] == 2
        assert [o.metrics.num_cached_tokens_by_tier.get("handoff") is None for o in douts] == [
            False, True, False, False, True, False]
        check_no_leaks(d)
    finally:
        d.shutdown()


def test_drain_forwards_from_every_rank(ckpt, prompts, colocated, tmp_path):
    """start_drain on a dp = 2 engine: new requests are refused (a sibling sample of an admitted one
    is taken), each rank forwards its unfinished requests with their KV, and a one-rank engine
    finishes them with identical tokens."""
    sec = section("shm", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(**kw(ckpt))
    want = tokens(ref.generate(prompts[:7], params, use_tqdm=False))
    ref.shutdown()
    a = LLM(kv_transfer=sec, dp=2, ep=2, **kw(ckpt))
    try:
        eng = a.engine
        seqs = [eng.add_request(q, params) for q in prompts[:6]]
        for _ in range(4):
            eng.step()
        eng.start_drain(0.0)
        with pytest.raises(ValueError, match="draining"):
            eng.add_request(prompts[0], params)
        seqs.append(eng.add_request(prompts[6], params, sibling=True))  # e.g. child 1 of an n = 2 request
        while eng.has_unfinished():
            eng.step()
        assert {s.finish_reason for s in seqs} == {"forwarded"}
        assert all(s.kv_transfer_out for s in seqs)
        assert a.metrics()["drain_forwarded"] == 7
        check_no_leaks(a)
    finally:
        a.shutdown()
    b = LLM(kv_transfer=sec, **kw(ckpt))
    cont = [dataclasses.replace(params, kv_transfer_params=s.kv_transfer_out) for s in seqs]
    outs = b.generate(prompts[:7], cont, use_tqdm=False)
    assert tokens(outs) == want
    assert b.metrics()["handoff_received"] == 7
    b.shutdown()


def test_parallel_transport_errors(ckpt):
    with pytest.raises(ConfigError, match="backend 'p2p' names one endpoint per engine, which the dp=2, ep=2 ranks"):
        LLM(kv_role="decode", kv_transfer={"backend": "p2p", "rank": 1}, dp=2, ep=2, **kw(ckpt))
    d = LLM(kv_role="decode", kv_transfer={"backend": "shm", "namespace": f"pdpar-{uuid.uuid4().hex[:8]}"},
            dp=2, ep=2, **kw(ckpt))
    try:
        with pytest.raises(ValueError, match="kv_transfer_params\\['key'\\] must be a hand-off key"):
            d.engine.add_request({"prompt_token_ids": [5, 6, 7]},
                                 dataclasses.replace(PARAMS, kv_transfer_params={"key": "../../etc/passwd"}))
        outs = d.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == 6
    finally:
        d.shutdown()
