"""Prefill/decode disaggregation: a prefill engine hands a request's KV to a decode engine.

Every test compares the decode engine's greedy tokens with a colocated engine's over the same
requests: a hand-off through any transport, a corrupt, missing or foreign one (then the decode
engine recomputes), must never change a token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from tiny_models import rand_ids

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.handoff_format import HandoffError, layout_signature, unpack
from deepinfer_core.ports import free_port as _free_port

BS = 4
HERE = Path(__file__).resolve().parent
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def workload(n: int = 64) -> list[dict]:
    """``n`` prompts over 4 shared prefixes (9..21 tokens) with tails of 1..8 tokens."""
    prefixes = [rand_ids(9 + 4 * k, 70 + k) for k in range(4)]
    return [{"prompt_token_ids": prefixes[i % 4] + rand_ids(1 + i % 8, 500 + i)} for i in range(n)]


def kw(path: str, **extra) -> dict:
    return dict(model=path, dtype="float32", block_size=BS, **extra)


def tokens(outs) -> list[list[int]]:
    for o in outs:
        assert o.error is None, o.error
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return workload()


@pytest.fixture(scope="module")
def colocated(tiny_v3_path, prompts):
    llm = LLM(**kw(tiny_v3_path))
    out = tokens(llm.generate(prompts, PARAMS, use_tqdm=False))
    llm.shutdown()
    return out


def transfer_section(backend: str, tmp_path: Path) -> dict:
    if backend == "shm":
        return {"backend": "shm", "namespace": f"pd-test-{uuid.uuid4().hex[:8]}"}
    return {"backend": "3fs", "path": str(tmp_path / "store")}


def prefill(path: str, section: dict, prompts, params=PARAMS, **extra):
    p = LLM(kv_role="prefill", kv_transfer=section, **kw(path, **extra))
    outs = p.generate(prompts, params, use_tqdm=False)
    p.engine.blocks.check_no_leaks()
    return p, outs


def decode_params(outs, params=PARAMS) -> list[SamplingParams]:
    return [dataclasses.replace(params, kv_transfer_params=o.kv_transfer_params) for o in outs]


@pytest.mark.parametrize("backend", ["shm", "3fs"])
def test_handoff_identical_to_colocated(tiny_v3_path, prompts, colocated, backend, tmp_path):
    section = transfer_section(backend, tmp_path)
    p, pouts = prefill(tiny_v3_path, section, prompts)
    assert [o.outputs[0].token_ids for o in pouts] == [c[:1] for c in colocated]  # P emits the first token
    assert all(o.kv_transfer_params for o in pouts)
    d = LLM(kv_role="decode", kv_transfer=section, **kw(tiny_v3_path))
    douts = d.generate(prompts, decode_params(pouts), use_tqdm=False)
    assert tokens(douts) == colocated
    # D computed one token per request (the first sampled one): the prompt KV came from P
    assert [o.metrics.num_cached_tokens_by_tier.get("handoff") for o in douts] == [
        len(q["prompt_token_ids"]) for q in prompts]
    m = d.metrics()
    assert m["handoff_received"] == len(prompts) and m.get("handoff_recomputed", 0) == 0
    assert m["prefill_tokens"] == len(prompts)
    d.engine.blocks.check_no_leaks()
    p.shutdown()
    d.shutdown()


def test_handoff_async_scheduling_and_logprobs(tiny_v3_path, prompts, colocated, tmp_path):
    """Both engines pipelined; logprobs and the cumulative logprob survive the hand-off."""
    section = transfer_section("shm", tmp_path)
    params = dataclasses.replace(PARAMS, logprobs=2)
    ref = LLM(**kw(tiny_v3_path)).generate(prompts[:8], params, use_tqdm=False)
    _, pouts = prefill(tiny_v3_path, section, prompts[:8], params, async_scheduling=True)
    d = LLM(kv_role="decode", kv_transfer=section, async_scheduling=True, **kw(tiny_v3_path))
    douts = d.generate(prompts[:8], decode_params(pouts, params), use_tqdm=False)
    assert tokens(douts) == colocated[:8]
    for r, o in zip(ref, douts):
        assert o.outputs[0].cumulative_logprob == pytest.approx(r.outputs[0].cumulative_logprob, abs=1e-4)
        first_ref, first = r.outputs[0].logprobs[0], o.outputs[0].logprobs[0]
        assert sorted(first) == sorted(first_ref)  # the first token's top-2 came over with it
        assert all(first[t].logprob == pytest.approx(first_ref[t].logprob, abs=1e-5) for t in first)


def _corrupt(section: dict, tmp_path: Path, key: str, at: int) -> None:
    root = Path("/dev/shm") / section["namespace"] if section["backend"] == "shm" else tmp_path / "store"
    f = root / "handoff" / key
    data = bytearray(f.read_bytes())
    data[at] ^= 0x5A
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("backend", ["shm", "3fs"])
def test_bad_handoff_recomputes_identically(tiny_v3_path, prompts, colocated, backend, tmp_path):
    """Corrupt body, corrupt header, a missing payload and a key for another prompt: D recomputes
    those requests from their prompts, with the colocated tokens."""
    section = transfer_section(backend, tmp_path)
    p, pouts = prefill(tiny_v3_path, section, prompts[:12])
    params = decode_params(pouts)
    _corrupt(section, tmp_path, pouts[0].kv_transfer_params["key"], -5)  # in the KV rows
    _corrupt(section, tmp_path, pouts[1].kv_transfer_params["key"], 60)  # in the JSON header
    missing = pouts[2].kv_transfer_params["key"][:17] + "0" * 16
    params[2] = dataclasses.replace(PARAMS, kv_transfer_params={"key": missing})
    params[3] = dataclasses.replace(PARAMS, kv_transfer_params=pouts[4].kv_transfer_params)  # another prompt's
    d = LLM(kv_role="decode", kv_transfer=section, **kw(tiny_v3_path))
    douts = d.generate(prompts[:12], params, use_tqdm=False)
    assert tokens(douts) == colocated[:12]
    tiers = [o.metrics.num_cached_tokens_by_tier.get("handoff") for o in douts]
    assert tiers[:4] == [None] * 4 and all(t for t in tiers[5:])
    m = d.metrics()
    assert m["handoff_recomputed"] == 4 and m["handoff_received"] == 8
    d.engine.blocks.check_no_leaks()


def test_payload_for_another_model_or_layout_is_refused(tiny_v3_path, prompts, tmp_path):
    section = transfer_section("shm", tmp_path)
    p = LLM(kv_role="prefill", kv_transfer=section, **kw(tiny_v3_path))
    seq = p.engine.add_request(prompts[0], PARAMS)
    while p.engine.has_unfinished():
        p.engine.step()
    key = seq.kv_transfer_out["key"]
    data = p.engine.handoff.transport.recv(key, "", 1 << 30)
    e = p.engine
    sig = layout_signature(e.cache_layout, e.block_size, e.dtype)
    assert unpack(data, e.fingerprint, sig, e.blocks.pool_of).num_computed == len(prompts[0]["prompt_token_ids"])
    with pytest.raises(HandoffError, match="model fingerprint"):
        unpack(data, "0" * 16, sig, e.blocks.pool_of)
    with pytest.raises(HandoffError, match="cache layout"):
        unpack(data, e.fingerprint, layout_signature(e.cache_layout, 2 * e.block_size, e.dtype), e.blocks.pool_of)
    with pytest.raises(HandoffError, match="bad magic"):
        unpack(b"\x80\x04pickle" + data[10:], e.fingerprint, sig, e.blocks.pool_of)


def test_role_and_params_errors(tiny_v3_path, tmp_path):
    with pytest.raises(ConfigError, match="kv_role='prefill' needs a \\[kv_transfer\\]"):
        LLM(kv_role="prefill", **kw(tiny_v3_path))
    with pytest.raises(ConfigError, match="kv_role"):
        LLM(kv_role="decoder", **kw(tiny_v3_path))
    with pytest.raises(ConfigError, match="backend 'nope' is not installed; installed: 3fs, p2p, shm"):
        LLM(kv_role="decode", kv_transfer={"backend": "nope"}, **kw(tiny_v3_path))
    with pytest.raises(ConfigError, match="backend 'p2p' names one endpoint per engine, which the dp=2, ep=2"):
        LLM(kv_transfer={"backend": "p2p"}, dp=2, ep=2, **kw(tiny_v3_path))
    with pytest.raises(ConfigError, match="knows only 'namespace'"):
        LLM(kv_role="decode", kv_transfer={"backend": "shm", "nmespace": "x"}, **kw(tiny_v3_path))
    d = LLM(kv_role="decode", kv_transfer=transfer_section("shm", tmp_path), **kw(tiny_v3_path))
    bad = [dataclasses.replace(PARAMS, kv_transfer_params={"key": "../../etc/passwd"}),
           dataclasses.replace(PARAMS, kv_transfer_params="abc"), PARAMS]
    outs = d.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, bad, use_tqdm=False)
    assert "kv_transfer_params['key'] must be a hand-off key" in str(outs[0].error)
    assert "kv_transfer_params must be a dict" in str(outs[1].error)
    assert outs[2].error is None and len(outs[2].outputs[0].token_ids) == 8


def test_p2p_handoff_between_processes(tiny_v3_path, prompts, colocated, tmp_path):
    """P in this process (rank 0), D in another (rank 1): the KV travels over gloo send/recv."""
    port = _free_port()
    section = {"backend": "p2p", "world_size": 2, "master_port": port}
    requests = tmp_path / "requests.json"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"llm": kw(tiny_v3_path, kv_role="decode", kv_transfer=dict(section, rank=1)),
                                "requests": str(requests), "out": str(tmp_path / "d.json")}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(HERE / "pd_worker.py"), str(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        p = LLM(kv_role="prefill", kv_transfer=dict(section, rank=0), **kw(tiny_v3_path))
        pouts = p.generate(prompts, PARAMS, use_tqdm=False)
        assert all(o.kv_transfer_params["locator"] == "0" for o in pouts)
        tmp = tmp_path / "requests.tmp"
        tmp.write_text(json.dumps({"prompts": prompts,
                                   "params": [dataclasses.asdict(sp) for sp in decode_params(pouts)]}))
        tmp.replace(requests)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["tokens"] == colocated
    assert result["metrics"]["handoff_received"] == len(prompts)
    assert result["tiers"] == [{"handoff": len(q["prompt_token_ids"])} for q in prompts]


def test_prompt_logprobs_are_computed_on_the_decode_engine(tiny_v3_path, prompts, colocated, tmp_path):
    """A request asking for prompt logprobs scores every prompt position, so D does not take the KV."""
    section = transfer_section("shm", tmp_path)
    _, pouts = prefill(tiny_v3_path, section, prompts[:2])
    params = [dataclasses.replace(PARAMS, prompt_logprobs=0, kv_transfer_params=o.kv_transfer_params) for o in pouts]
    d = LLM(kv_role="decode", kv_transfer=section, **kw(tiny_v3_path))
    outs = d.generate(prompts[:2], params, use_tqdm=False)
    assert tokens(outs) == colocated[:2]
    assert [len(o.prompt_logprobs) for o in outs] == [len(q["prompt_token_ids"]) for q in prompts[:2]]
    assert d.metrics()["handoff_recomputed"] == 2
