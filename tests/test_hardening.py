"""Smaller hardening items of issue 14: concurrent ``generate()`` calls on one ``LLM``, the engine's
preemption counter, the prefill cost-model cache file, and the Python version the project needs."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path

import pytest
import tomllib
from tiny_models import kv_bytes_per_block, rand_ids

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.cost_model import CostModel, default_path

BS = 4


def make(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=8, kv_cache_memory=1 << 20)
    opts.update(kw)
    return LLM(str(path), **opts)


# ---- two threads, one LLM ------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, "ngram"])
def test_concurrent_generate_calls_are_serialised(tiny_v3_path, spec):
    """Two threads on one LLM, also drafting (async, the device path): each gets the outputs it gets alone
    (seeded sampling: speculation's coupled verify keeps them whatever the floor chose that time)."""
    kw = {} if spec is None else dict(async_scheduling=True, speculative={"proposer": spec, "k": 3, "device": "on"})
    llm = make(tiny_v3_path, **kw)
    batches = [[{"prompt_token_ids": rand_ids(6 + 3 * i + j, 40 * t + i)} for i in range(4)]
               for t, j in ((0, 0), (1, 1))]
    ps = [SamplingParams(temperature=0.7, seq_seed=5 + i, max_tokens=24, ignore_eos=True) for i in range(4)]
    want = [[o.outputs[0].token_ids for o in llm.generate(b, ps, use_tqdm=False)] for b in batches]
    start = threading.Barrier(2)
    got: dict[int, object] = {}

    def worker(t: int) -> None:
        start.wait()
        try:
            got[t] = [o.outputs[0].token_ids for o in llm.generate(batches[t], ps, use_tqdm=False)]
        except Exception as exc:  # reported below
            got[t] = exc

    for _ in range(3):
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert got == {0: want[0], 1: want[1]}
        assert not llm.engine.has_unfinished()
        llm.engine.blocks.check_no_leaks()
    if spec is not None:
        assert llm.engine.metrics()["spec_verified"] > 0


# ---- preemption counter ----------------------------------------------------------------------------
@pytest.mark.parametrize("async_on", [False, True])
def test_preemptions_are_counted_in_steps_that_schedule_nothing(tiny_v3_path, async_on):
    """A lone request outgrowing a 6-block cache preempts itself in a step that then schedules
    nothing (and it fails: it can never fit); the counter still counts that preemption."""
    llm = make(tiny_v3_path, async_scheduling=async_on, kv_cache_memory=6 * kv_bytes_per_block(tiny_v3_path, BS))
    ps = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": rand_ids(10, 1)}, {"prompt_token_ids": rand_ids(5, 2)}], ps,
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "needs 7 KV blocks" in str(outs[0].error)
    assert outs[1].error is None
    per_request = sum(o.metrics.num_preemptions for o in outs)
    assert per_request >= 1
    assert llm.metrics()["preemptions"] == per_request
    llm.engine.blocks.check_no_leaks()


# ---- the cost-model cache ----------------------------------------------------------------------------
def test_cost_model_cache_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "cm" / "cpu-x.json"
    CostModel(1.0, 2.0, 3.0, 4.0, platform="cpu").save(path)
    assert CostModel.load(path) == CostModel(1.0, 2.0, 3.0, 4.0, platform="cpu")

    def crash(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", crash)  # dies mid-write
    with pytest.raises(OSError):
        CostModel(9.0, 9.0, 9.0, 9.0).save(path)
    monkeypatch.undo()
    assert CostModel.load(path).a == 1.0  # the old file is intact
    assert [p.name for p in path.parent.iterdir()] == ["cpu-x.json"]  # no temporary left behind


def test_corrupt_cost_model_cache_is_ignored_with_a_warning(tiny_v3_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    llm = make(tiny_v3_path)
    path = default_path(llm.engine.platform.name, llm.engine.fingerprint)
    CostModel(1e-3, 1e-5, 0.0, 0.0).save(path)
    assert make(tiny_v3_path).engine.cost_model is not None
    path.write_text('{"a": 0.001, "b": ')  # half written
    with caplog.at_level(logging.WARNING, logger="deepinfer.engine"):
        llm = make(tiny_v3_path)
    assert llm.engine.cost_model is None
    assert any(str(path) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None
    # a file named explicitly (cost_model=...) that is corrupt is an error naming it
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        make(tiny_v3_path, cost_model=str(path))
    # a symlink to a device (it would read forever), a directory, an unreadable file: ignored, named
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"  # a file out of the cache directory
    outside.write_text("not json at all")
    for bad in ("device", "directory", "unreadable", "outside", "nan"):
        path.unlink() if path.is_file() or path.is_symlink() else path.rmdir()
        if bad == "device":
            path.symlink_to("/dev/zero")
        elif bad == "outside":
            path.symlink_to(outside)
        elif bad == "nan":  # a hand-edited coefficient: it would steer every prefill budget
            path.write_text(json.dumps({"a": float("nan"), "b": 1e-5, "d": 0.0, "e": -1.0}))
        elif bad == "directory":
            path.mkdir()
        else:
            CostModel(1e-3, 1e-5, 0.0, 0.0).save(path)
            path.chmod(0)
            if os.access(path, os.R_OK):  # (root reads it anyway)
                continue
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deepinfer.engine"):
            assert make(tiny_v3_path).engine.cost_model is None
        assert any(str(path) in r.getMessage() for r in caplog.records), (bad, [r.getMessage() for r in caplog.records])
        with pytest.raises(ConfigError, match=re.escape(str(path))):
            make(tiny_v3_path, cost_model=str(path))


def test_json_cache_files_are_bounded_and_checked(tmp_path):
    from deepinfer_core.engine.cost_model import load_json

    with pytest.raises(FileNotFoundError):
        load_json(tmp_path / "none.json")
    (tmp_path / "dev.json").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="not a regular file"):
        load_json(tmp_path / "dev.json")
    (tmp_path / "big.json").write_text("[" + "0," * 600_000 + "0]")
    with pytest.raises(ValueError, match="is over 1048576 bytes"):
        load_json(tmp_path / "big.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="is not JSON"):
        load_json(tmp_path / "bin.json")
    (tmp_path / "ok.json").write_text('{"a": [1, 2]}')
    assert load_json(tmp_path / "ok.json") == {"a": [1, 2]}


# ---- packaging ------------------------------------------------------------------------------------------
def test_requires_python_allows_only_versions_with_tomllib():
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    spec = meta["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert m and int(m.group(1)) >= 11, spec  # deepinfer_core/config.py imports tomllib (3.11+)
