"""The tiered KV cache in the engine: device -> host memory -> the ``3fs`` persistent store.

Every test checks the generated tokens against an engine without any KV store: a reused,
damaged or missing block may change how many tokens are recomputed, never what is generated.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.hashing import chain
from deepinfer_core.plugins import PluginNotFoundError
from plugins.kv_3fs import record
from plugins.kv_3fs import store as store_mod

BS = 4
REPO = Path(__file__).resolve().parent.parent
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK_BYTES = 2 * BS * 24 * 4  # tiny_v3: 2 layers, kv_lora_rank 16 + rope 8, float32


def prompt(seed: int, n: int) -> list[int]:
    return [4 + (seed * 31 + i * 7 + (i * i) % 13) % 120 for i in range(n)]


def make_llm(model: str, store: Path | None = None, kv: dict | None = None, **kw) -> LLM:
    section = None
    if store is not None:
        section = {"backend": "3fs", "path": str(store), "offload_on_finish": True, **(kv or {})}
    return LLM(model=model, dtype="float32", block_size=BS, kv_store=section, **kw)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o in outs:
        assert o.error is None and o.outputs[0].finish_reason == "length", o.error
    return [(o.outputs[0].token_ids, o.metrics.num_cached_tokens, dict(o.metrics.num_cached_tokens_by_tier))
            for o in outs]


def full_blocks(p: list[int]) -> int:
    """Prompt tokens a hit can supply: every full block except the one holding the last token."""
    return (len(p) - 1) // BS * BS


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    """Greedy tokens of an engine without prefix caching or stores."""
    llm = LLM(model=tiny_v3_path, dtype="float32", block_size=BS, enable_prefix_caching=False)
    cache: dict[tuple, list[int]] = {}

    def tokens(p: list[int]) -> list[int]:
        if tuple(p) not in cache:
            cache[tuple(p)] = run(llm, [p])[0][0]
        return cache[tuple(p)]

    yield tokens
    llm.shutdown()


def record_file(store: Path, llm: LLM, key: int) -> Path:
    tiers = llm.engine.pm.get_plugin("kv_tiers")
    return Path(tiers.store._path(key))


def tier_metrics(llm: LLM) -> dict:
    return llm.metrics()["kv_tiers"]


# ---- cross-process reuse --------------------------------------------------------------------

PROCESS_B = r"""
import json, sys
import torch
torch.set_num_threads(1)
from deepinfer_core import LLM, SamplingParams
model, config, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model=model, dtype="float32", block_size=4, config=config)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
m = llm.metrics()["kv_tiers"]
llm.shutdown()
print(json.dumps({"outs": [[o.outputs[0].token_ids, o.metrics.num_cached_tokens,
                            o.metrics.num_cached_tokens_by_tier, repr(o.error)] for o in outs],
                  "persistent_hits": m["persistent"]["hits"], "fetched": m["fetch"]["blocks"]}))
"""


def test_cross_process_reuse(tiny_v3_path, reference, tmp_path):
    """Process A writes its blocks; a new process B (same store, configured by a TOML file) reads
    them instead of computing: same tokens, the reused prompt tokens counted as persistent."""
    store = tmp_path / "kv"
    prompts = [prompt(1, 37), prompt(2, 22), prompt(3, 3)]
    a = make_llm(tiny_v3_path, store)
    first = run(a, prompts)
    assert [o[1] for o in first] == [0, 0, 0]
    assert [o[0] for o in first] == [reference(p) for p in prompts]
    again = run(a, prompts)  # the device tier
    assert [(o[0], o[1], o[2]) for o in again][:2] == [(first[0][0], 36, {"device": 36}),
                                                        (first[1][0], 20, {"device": 20})]
    a.shutdown()  # flushes queued writes

    config = tmp_path / "deepinfer.toml"
    config.write_text(f'[kv_store]\nbackend = "3fs"\npath = "{store}"\n')
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", PROCESS_B, tiny_v3_path, str(config), json.dumps(prompts)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    b = json.loads(proc.stdout.strip().splitlines()[-1])
    for p, (tokens, cached, by_tier, err), (want, *_) in zip(prompts, b["outs"], first):
        assert err == "None" and tokens == want
        assert cached == full_blocks(p)
        assert by_tier == ({"persistent": cached} if cached else {})
    assert b["fetched"] == b["persistent_hits"] == (36 + 20) // BS


# ---- prefix-chain correctness -------------------------------------------------------------------

def test_partial_block_is_not_reused(tiny_v3_path, reference, tmp_path):
    base = prompt(4, 30)
    a = make_llm(tiny_v3_path, tmp_path)
    run(a, [base])
    a.shutdown()
    b = make_llm(tiny_v3_path, tmp_path)
    # shares 6 tokens (one full block and half of the next), then 8 (two full blocks), then 0
    cases = [(base[:6] + prompt(5, 20), 4), (base[:8] + prompt(6, 20), 8), (prompt(7, 3) + base[3:], 0)]
    for p, cached in cases:
        tokens, n, by_tier = run(b, [p])[0]
        assert tokens == reference(p)
        assert n == cached and sum(by_tier.values()) == cached  # earlier cases left blocks on the device
        assert set(by_tier) <= {"device", "persistent"}
    b.shutdown()


# ---- faults ----------------------------------------------------------------------------------

def _rewrite_header(path: Path, **changes) -> None:
    raw = bytearray(path.read_bytes())
    fields = list(record._HEADER.unpack(bytes(raw[: record.HEADER_SIZE])))
    index = {"version": 1, "fingerprint": 5}
    for name, value in changes.items():
        fields[index[name]] = value
    head = record._HEADER.pack(*fields)
    raw[: record.HEADER_SIZE] = head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]) & 0xFFFFFFFF)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("writer,reader", [
    (dict(load_format="random"), {}),  # the same checkpoint directory, loaded as random weights
    (dict(load_format="random"), dict(load_format="random", seed=1)),  # another random seed
    (dict(block_size=8), {}),  # another block size
])
def test_blocks_of_other_weights_or_layouts_are_never_hits(tiny_v3_path, tmp_path, writer, reader):
    """The store is keyed by everything that determines the KV bytes (issue 14): a reader whose weights
    or layout differ from the writer's gets no hits, and the outputs it would get without a store."""
    store = tmp_path / "store"
    prompts = [prompt(s, 21) for s in range(4)]

    def engine(opts: dict, with_store: bool) -> LLM:
        kv = {"backend": "3fs", "path": str(store), "offload_on_finish": True} if with_store else None
        return LLM(model=tiny_v3_path, dtype="float32", kv_store=kv, **{"block_size": BS, **opts})

    want = [o[0] for o in run(engine(dict(reader, enable_prefix_caching=False), False), prompts)]
    w = engine(writer, True)
    run(w, prompts)
    w.shutdown()
    assert list(store.rglob("*.kvb")), "the writer stored nothing"
    llm = engine(reader, True)
    outs = run(llm, prompts)
    assert [o[0] for o in outs] == want
    assert tier_metrics(llm)["persistent"]["hits"] == 0 and all(o[1] == 0 for o in outs)


def test_damaged_records_are_misses(tiny_v3_path, reference, tmp_path):
    """A flipped byte, a truncated file, another model's record, another format version: each
    chain stops at its bad block and recomputes from there, with the right tokens."""
    prompts = {name: prompt(10 + i, 33) for i, name in enumerate(["flip", "truncate", "model", "version"])}
    a = make_llm(tiny_v3_path, tmp_path)
    run(a, list(prompts.values()))
    files = {name: [record_file(tmp_path, a, h) for h in chain(p, BS)] for name, p in prompts.items()}
    a.shutdown()
    bad_block = {"flip": 5, "truncate": 2, "model": 0, "version": 7}
    f = files["flip"][5]
    raw = bytearray(f.read_bytes())
    raw[record.HEADER_SIZE + 77] ^= 0x10
    f.write_bytes(bytes(raw))
    os.truncate(files["truncate"][2], record.HEADER_SIZE + BLOCK_BYTES // 2)
    _rewrite_header(files["model"][0], fingerprint=b"0000000000000000")
    _rewrite_header(files["version"][7], version=record.FORMAT_VERSION + 1)

    b = make_llm(tiny_v3_path, tmp_path)
    for name, p in prompts.items():
        tokens, cached, _ = run(b, [p])[0]
        assert tokens == reference(p), name
        assert cached == bad_block[name] * BS, name
    corrupt = tier_metrics(b)["persistent"]["corrupt"]
    assert corrupt == {"corrupt": 1, "truncated": 1, "wrong_model": 1, "wrong_version": 1}
    b.shutdown()


@contextlib.contextmanager
def read_only(path: Path):
    """Make ``path`` unwritable by a real mechanism: permissions for a normal user; for root (who
    ignores them) the immutable attribute. Yields the mechanism's name."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")] if p.is_dir()}
        for p in modes:
            p.chmod(0o555)
        try:
            yield "chmod"
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    chattr = shutil.which("chattr")
    ok = chattr and subprocess.run([chattr, "-R", "+i", str(path)], capture_output=True).returncode == 0
    if ok:
        try:
            (path / "probe").touch()
            ok = False  # the file system ignored it
            (path / "probe").unlink()
        except PermissionError:
            pass
    if not ok:
        if chattr:
            subprocess.run([chattr, "-R", "-i", str(path)], capture_output=True)
        pytest.skip("no real way to make a directory read-only for root here (chattr +i unsupported)")
    try:
        yield "chattr +i"
    finally:
        subprocess.run([chattr, "-R", "-i", str(path)], check=True)


def test_store_becomes_read_only_mid_run(tiny_v3_path, reference, tmp_path):
    store = tmp_path / "kv"
    a = make_llm(tiny_v3_path, store)
    p1, p2, p3 = prompt(20, 25), prompt(21, 25), prompt(22, 17)
    run(a, [p1])
    tiers = a.engine.pm.get_plugin("kv_tiers")
    assert tiers.flush(30)
    with read_only(store):
        out = run(a, [p2, p3])  # still served; their blocks cannot be written
        assert [o[0] for o in out] == [reference(p2), reference(p3)]
        assert tiers.flush(30)
        m = tier_metrics(a)
        assert m["offload"]["failed"] >= (24 + 16) // BS and m["persistent"]["write_failures"]
        a.shutdown()
        b = make_llm(tiny_v3_path, store)  # a read-only store still serves what it holds
        out = run(b, [p1, p2])
        assert [o[0] for o in out] == [reference(p1), reference(p2)]
        assert [o[1] for o in out] == [full_blocks(p1), 0]
        b.shutdown()


@contextlib.contextmanager
def tiny_file_system(path: Path, size: str = "48k"):
    """A real file system of ``size`` at ``path`` (tmpfs; needs root with CAP_SYS_ADMIN)."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True)
    if r.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_store_fills_up_mid_run(tiny_v3_path, reference, tmp_path, monkeypatch):
    store = tmp_path / "kv"
    with tiny_file_system(store) as real:
        if not real:  # no tmpfs mount allowed here: fail writes after the first few instead
            calls = {"n": 0}
            original = store_mod.write_all

            def enospc(fd, buffers):
                calls["n"] += 1
                if calls["n"] > 10:
                    raise OSError(28, "No space left on device")
                original(fd, buffers)

            monkeypatch.setattr(store_mod, "write_all", enospc)
        a = make_llm(tiny_v3_path, store)
        prompts = [prompt(30 + i, 41) for i in range(6)]
        out = run(a, prompts)
        assert [o[0] for o in out] == [reference(p) for p in prompts]
        tiers = a.engine.pm.get_plugin("kv_tiers")
        assert tiers.flush(30)
        m = tier_metrics(a)["persistent"]
        assert set(m["write_failures"]) & {"ENOSPC", "index_ENOSPC"}, m["write_failures"]
        assert tier_metrics(a)["offload"]["failed"] > 0
        a.shutdown()
        b = make_llm(tiny_v3_path, store)  # whatever was written is reused, the rest recomputed
        out = run(b, prompts)
        assert [o[0] for o in out] == [reference(p) for p in prompts]
        assert 0 < sum(o[1] for o in out) < sum(full_blocks(p) for p in prompts)
        b.shutdown()


# ---- eviction to host memory, traffic classes, metrics ------------------------------------------------

def test_evicted_device_blocks_move_to_host_and_store(tiny_v3_path, reference, tmp_path):
    """With a small device cache, a prompt's blocks are evicted by later requests, copied to host
    memory (and written to the store) on the way out, and come back from host memory."""
    llm = make_llm(tiny_v3_path, tmp_path, kv={"offload_on_finish": False}, kv_cache_memory=24 * BLOCK_BYTES)
    p1 = prompt(40, 37)
    others = [prompt(41 + i, 37) for i in range(3)]
    run(llm, [p1])
    for p in others:
        run(llm, [p])
    tokens, cached, by_tier = run(llm, [p1])[0]
    assert tokens == reference(p1) and cached == 36
    assert by_tier.get("host", 0) > 0 and sum(by_tier.values()) == 36, by_tier
    tiers = llm.engine.pm.get_plugin("kv_tiers")
    assert tiers.flush(30)
    m = tier_metrics(llm)
    assert m["offload"]["to_host"] > 0 and m["offload"]["written"] > 0
    assert m["host"]["hits"] > 0 and 0 < m["host"]["hit_rate"] <= 1
    assert m["cached_tokens"]["host"] == by_tier["host"]
    for key in ("read_bytes_per_s", "write_bytes_per_s", "hit_rate", "evictions", "gc_runs"):
        assert key in m["persistent"] and key in m["host"]
    llm.shutdown()


def test_fetch_reads_into_the_host_pool(tiny_v3_path, reference, tmp_path):
    """Fetched blocks are read straight into the host tier's pre-faulted buffers: no memory is
    allocated for them and they are not counted as host hits."""
    p = prompt(45, 41)
    a = make_llm(tiny_v3_path, tmp_path)
    run(a, [p])
    a.shutdown()
    b = make_llm(tiny_v3_path, tmp_path)
    before = tier_metrics(b)["host"]
    assert before["pool_free_bytes"] == before["pool_allocated_bytes"] > 10 * BLOCK_BYTES
    tokens, cached, by_tier = run(b, [p])[0]
    assert tokens == reference(p) and by_tier == {"persistent": cached} and cached == full_blocks(p)
    m = tier_metrics(b)
    assert m["fetch"]["blocks"] == cached // BS and m["host"]["blocks"] == cached // BS
    assert m["host"]["pool_allocated_bytes"] == before["pool_allocated_bytes"]
    assert m["host"]["hits"] == 0 and m["persistent"]["hits"] == cached // BS
    b.shutdown()


def test_traffic_class_sets_the_records_ttl(tiny_v3_path, tmp_path):
    llm = make_llm(tiny_v3_path, tmp_path, kv={"ttl": {"agent": "90m", "chatbot": "2d"}})
    pa, pc = prompt(50, 13), prompt(51, 13)
    llm.generate([{"prompt_token_ids": pa}], SamplingParams(max_tokens=1, traffic_class="agent"),
                 use_tqdm=False)
    llm.generate([{"prompt_token_ids": pc}], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.engine.pm.get_plugin("kv_tiers").flush(30)
    for p, cls, ttl in ((pa, "agent", 5400), (pc, "chatbot", 2 * 86400)):
        for h in chain(p, BS):
            hdr = record.unpack_header(record_file(tmp_path, llm, h).read_bytes()[: record.HEADER_SIZE])
            assert (hdr.ttl_class, hdr.ttl_seconds) == (cls, ttl)
    llm.shutdown()


def test_bad_kv_store_config(tiny_v3_path, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = [
        ({"path": str(tmp_path)}, ConfigError, "backend"),
        ({"backend": "nope", "path": str(tmp_path)}, PluginNotFoundError, "nope"),
        ({"backend": "3fs", "path": str(blocker / "kv")}, ConfigError, str(blocker / "kv")),
        ({"backend": "3fs", "path": str(tmp_path), "high_watermark": 0.5, "low_watermark": 0.6}, ConfigError,
         "high_watermark"),
        ({"backend": "3fs", "path": str(tmp_path), "ttl": {"agent": "soon"}}, ConfigError, "ttl.agent"),
        ({"backend": "3fs", "path": str(tmp_path), "usrbio": "maybe"}, ConfigError, "usrbio"),
        ({"backend": "3fs", "path": str(tmp_path), "host_capacity_bytes": "big"}, ConfigError,
         "host_capacity"),
    ]
    for section, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            LLM(model=tiny_v3_path, dtype="float32", block_size=BS, kv_store=section)
