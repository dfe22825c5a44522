"""The conformance kit on the in-tree CPU pieces, and proof that it catches broken backends."""

from __future__ import annotations

import logging
import textwrap
import threading

import pytest
import torch

from deepinfer_core import plugins
from deepinfer_core.engine.host_store import HostMemoryStore
from deepinfer_core.kernels import OP_NAMES, KernelBackend
from deepinfer_core.kv_store import KVStore, KVStoreStats
from deepinfer_core.testing import (
    check_communicator,
    check_kernel_backend,
    check_kv_store,
    check_op,
    kernel_conformance_cases,
)
from kernels_ascend import AscendKernels
from kernels_cpu import ReferenceKernels
from kernels_cpu import fp8_ops as ref_fp8
from kernels_cpu import fused as ref_fused
from kernels_cpu import ops as ref

ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- kernels: the reference passes its own kit ---------------------------------------------
@pytest.mark.parametrize("op,dtype", kernel_conformance_cases(ReferenceKernels, ALL_DTYPES))
def test_reference_backend_conforms(op, dtype):
    check_op(ReferenceKernels, op, dtype, "cpu")


@pytest.mark.parametrize("block_size", [1, 64])
def test_reference_backend_conforms_at_other_block_sizes(block_size):
    for op in ("paged_kv_write", "paged_kv_gather", "mla_decode"):
        check_op(ReferenceKernels, op, torch.float32, "cpu", block_size=block_size, seed=3)


def test_conformance_cases():
    empty = type("Empty", (KernelBackend,), {"name": "empty", "core_api_version": "1.0", "ops": {}})
    assert kernel_conformance_cases(empty) == []
    assert kernel_conformance_cases(AscendKernels)[:5] == [
        ("rms_norm", torch.float32), ("rms_norm", torch.bfloat16),
        ("add_rms_norm", torch.float32), ("add_rms_norm", torch.bfloat16),
        ("silu_and_mul", torch.float32),
    ]
    assert [c for c in kernel_conformance_cases(AscendKernels) if c[0] in ("moe_route", "sample")] == [
        ("moe_route", torch.float32), ("sample", torch.float32)]
    cases = kernel_conformance_cases(ReferenceKernels)
    assert {op for op, _ in cases} == set(OP_NAMES)
    assert [d for op, d in cases if op == "sample"] == [torch.float32]
    assert check_kernel_backend(empty) == []


def test_check_op_argument_errors():
    with pytest.raises(ValueError, match="kernel backend 'ascend' does not override 'linear'"):
        check_op(AscendKernels, "linear", torch.float32)
    with pytest.raises(ValueError, match="unknown op 'conv'"):
        check_op(ReferenceKernels, "conv", torch.float32)
    with pytest.raises(ValueError, match="no tolerance for dtype torch.float64"):
        check_op(ReferenceKernels, "linear", torch.float64)


# ---- kernels: broken backends are caught ---------------------------------------------------
def rms_norm_without_weight(x, w, eps):
    return ref.rms_norm(x, torch.ones_like(w), eps)


def rms_norm_in_float32(x, w, eps):
    return ref.rms_norm(x.float(), w, eps)


def slightly_off_silu(x):
    return ref.silu_and_mul(x) * 1.001


def mla_decode_not_causal(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv):
    # every query token sees its whole sequence (wrong for speculative rows with q_len > 1)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    per_tok = torch.repeat_interleave(torch.arange(len(seq_lens)), q_lens)
    ones = torch.arange(q.shape[0] + 1)
    return ref.mla_decode(q, cache, block_tables[per_tok], ones, seq_lens[per_tok], scale, dv)


def gather_ignoring_block_tables(cache, block_tables, seq_lens):
    width = block_tables.shape[1]
    linear = torch.arange(len(seq_lens) * width).view(len(seq_lens), width) % cache.shape[0]
    linear = linear.to(block_tables.dtype)
    return ref.paged_kv_gather(cache, linear, seq_lens)


def route_ignoring_bias(logits, bias, *rest):
    return ref.moe_route(logits, None, *rest)


def moe_clamping_remote_ids(x, w13, w2, weights, ids):
    return ref.fused_moe(x, w13, w2, weights, ids.clamp(0, w13.shape[0] - 1))


def moe_fp8_first_tile_scale(x, w13, s13, w2, s2, weights, ids):
    # every w2 tile scaled by its expert's first tile's scale (a tile-indexing bug)
    return ref_fp8.fused_moe_fp8(x, w13, s13, w2, s2[:, :1, :1].expand_as(s2), weights, ids)


def sample_with_torch_rng(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    greedy = temperature <= 0
    g = torch.Generator().manual_seed(int(seeds[0]))
    probs = (logits / temperature.clamp_min(1e-5)[:, None]).softmax(-1)
    drawn = torch.multinomial(probs, 1, generator=g)[:, 0]
    return torch.where(greedy, logits.argmax(-1), drawn)


def sample_batch_dependent(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    # right for every batch the kit builds, wrong for a row sampled on its own
    return ref.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets + int(len(seeds) == 1))


def norm_linear_stale_residual(x, residual, norm_w, eps, w):
    # the projection is right, but the residual handed on is the old one (the add forgotten)
    y, _ = ref_fused.add_rms_norm_linear(x, residual, norm_w, eps, w)
    return y, x if residual is None else residual


def q_absorb_without_kv_write(q, w_uk, positions, cos_sin, kv_a, norm_w, eps, cache, slot_mapping):
    return ref_fused.mla_q_absorb(q, w_uk, positions, cos_sin)


def decode_uv_first_split_only(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv, w_uv):
    # a merge that keeps the first split only: the first 64 keys of a longer context
    return ref_fused.mla_decode_uv(q, cache, block_tables, cu_q_lens, seq_lens.clamp(max=64), scale, dv, w_uv)


def linear_that_raises(x, w, bias=None):
    raise RuntimeError("kernel launch failed: invalid configuration")


def backend(op: str, fn) -> type[KernelBackend]:
    return type("Broken", (KernelBackend,), {"name": "broken", "core_api_version": "1.0",
                                              "ops": {op: f"{__name__}:{fn.__name__}"}})


@pytest.mark.parametrize("op,fn,dtype,pattern", [
    ("rms_norm", rms_norm_without_weight, torch.float32,
     r"^kernel op 'rms_norm' of backend 'broken' \[dtype float32, case 'basic'\] differs from the reference: "
     r"max error \d"),
    ("rms_norm", rms_norm_in_float32, torch.bfloat16,
     r"\[dtype bfloat16, case 'basic'\] differs from the reference: dtype float32, reference bfloat16$"),
    ("silu_and_mul", slightly_off_silu, torch.float32,
     r"'silu_and_mul'.*\[dtype float32, case 'basic'\].*max error"),
    ("mla_decode", mla_decode_not_causal, torch.float32,
     r"\[dtype float32, case 'ragged q_len'\].*max error"),
    ("paged_kv_gather", gather_ignoring_block_tables, torch.bfloat16,
     r"\[dtype bfloat16, case 'ragged'\] differs from the reference: not bit-exact: \d+ element\(s\) differ"),
    ("moe_route", route_ignoring_bias, torch.float32,
     r"case 'sigmoid bias top2sum'\] differs from the reference: token \d+ routed to experts \["),
    ("fused_moe", moe_clamping_remote_ids, torch.bfloat16,
     r"'fused_moe'.*\[dtype bfloat16, case 'with remote experts'\].*max error"),
    ("fused_moe_fp8", moe_fp8_first_tile_scale, torch.bfloat16,
     r"'fused_moe_fp8'.*\[dtype bfloat16, case 'with remote experts'\].*relative error norm .*\(compared norm-wise"),
    ("sample", sample_with_torch_rng, torch.float32,
     r"case 'mixed greedy and seeded'\] differs from the reference: \d+ of 16 rows sampled other tokens.*"
     r"first: seeded \(seed=\d+, offset=\d+\) row \d+"),
    ("sample", sample_batch_dependent, torch.float32, r"sampled alone gives \d+, in the batch \d+"),
    ("add_rms_norm_linear", norm_linear_stale_residual, torch.float32,
     r"'add_rms_norm_linear'.*\[dtype float32, case '1 row'\] output 1 differs from the reference: max error"),
    ("mla_q_absorb_kv_write", q_absorb_without_kv_write, torch.bfloat16,
     r"'mla_q_absorb_kv_write'.*case '5 tokens, -1 slots'\] output 1 differs from the reference"),
    ("mla_decode_uv", decode_uv_first_split_only, torch.float32,
     r"'mla_decode_uv'.*\[dtype float32, case 'H16 L512 one sequence'\] differs from the reference: max error"),
    ("linear", linear_that_raises, torch.float32,
     r"case '2d\+bias'\] raised RuntimeError: kernel launch failed: invalid configuration$"),
])
def test_kit_catches_broken_ops(op, fn, dtype, pattern):
    with pytest.raises(AssertionError, match=pattern):
        check_op(backend(op, fn), op, dtype, "cpu")


def test_kit_refuses_a_backend_for_another_api():
    old = type("Old", (KernelBackend,), {"name": "old", "core_api_version": "2.0", "ops": {}})
    from deepinfer_core.version import PluginAPIVersionError

    with pytest.raises(PluginAPIVersionError, match="kernel backend 'old' was written for core API 2.0"):
        check_kernel_backend(old)


# ---- communicator --------------------------------------------------------------------------
def test_communicator_kit_over_two_gloo_processes():
    check_communicator(world_size=2, backend="gloo")


BAD_COMM = """
    from deepinfer_core.communicator import TorchDistCommunicator

    class ReversingCommunicator(TorchDistCommunicator):
        # exchanges the right rows but returns them in the wrong order
        def all_to_all(self, x, send_splits, recv_splits):
            return super().all_to_all(x, send_splits, recv_splits).flip(0)
"""


def test_communicator_kit_reports_the_failing_rank_with_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "dit_bad_comm.py").write_text(textwrap.dedent(BAD_COMM))
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned children inherit sys.path
    import dit_bad_comm

    with pytest.raises(AssertionError) as info:
        check_communicator(world_size=2, factory=dit_bad_comm.ReversingCommunicator)
    text = str(info.value)
    # rank 1 receives two rows (from rank 0) and sees them reversed; rank 0 gets one row and cannot tell
    assert text.startswith("communicator check (gloo, 2 ranks) failed on rank 1:\nTraceback")
    assert "in run_checks" in text
    assert ("AssertionError: rank 1: all_to_all(send_splits=[1, 0], recv_splits=[2, 0]) returned "
            "torch.float32 (2, 2) [[11.0, 11.0], [10.0, 10.0]], expected torch.float32 (2, 2) "
            "[[10.0, 10.0], [11.0, 11.0]]\n") in text


def test_communicator_kit_needs_two_ranks():
    with pytest.raises(ValueError, match="world_size >= 2"):
        check_communicator(world_size=1)


# ---- KV stores -----------------------------------------------------------------------------
def test_host_store_conforms():
    assert check_kv_store(HostMemoryStore, capacity_factory=lambda n: HostMemoryStore(capacity_bytes=n)) == [
        "basics", "match_prefix", "stats", "threads", "capacity"]
    # a small enough capacity is tested through the plain factory too
    assert "capacity" in check_kv_store(lambda: HostMemoryStore(capacity_bytes=1 << 20))


def test_host_store_is_the_host_entry_point():
    cls = plugins.load("deepinfer.kv_stores", "host", what="KV store")
    assert cls is HostMemoryStore
    store = cls(capacity_bytes=1024, unrelated_setting=1)  # unknown settings are ignored
    assert store.capacity_bytes == 1024 and len(store) == 0


class DictStore(KVStore):
    """A minimal correct store; subclasses below break one rule each."""

    core_api_version = "1.0"

    def __init__(self):
        self.d = {}

    def contains(self, key):
        return key in self.d

    def put(self, key, block, **meta):
        self.d[key] = block.clone()
        return True

    def get(self, key):
        return self.d.get(key)

    def evict(self, key):
        return self.d.pop(key, None) is not None


class NoCopyStore(DictStore):
    def put(self, key, block, **meta):
        self.d[key] = block
        return True


class GreedyPrefixStore(DictStore):
    def match_prefix(self, keys):
        return sum(1 for k in keys if k in self.d)


class RaisingMissStore(DictStore):
    def get(self, key):
        return self.d[key]


class LossyStore(DictStore):
    def put(self, key, block, **meta):
        self.d[key] = block.float().to(block.dtype) if block.dtype == torch.float32 else block.float()
        return True


class OverfullStore(DictStore):
    capacity_bytes = 4096


class LyingStatsStore(DictStore):
    def stats(self):
        return KVStoreStats(puts=1)


def test_minimal_store_conforms():
    assert check_kv_store(DictStore) == ["basics", "match_prefix", "stats", "threads"]


@pytest.mark.parametrize("store,pattern", [
    (NoCopyStore, r"^KV store NoCopyStore: changing the tensor after put\(\) changed the stored block"),
    (GreedyPrefixStore, r"^KV store GreedyPrefixStore: match_prefix\(\[.*\]\) = 4, expected 3"),
    (RaisingMissStore, r"^KeyError"),
    (LossyStore, r"^KV store LossyStore: get\(\) after put\(\) is not bit-exact for torch.bfloat16 "
                 r"\(got torch.float32 \(3, 16, 24\)\)"),
    (OverfullStore, r"^KV store OverfullStore: holds 7 blocks of 1024 bytes, over capacity_bytes=4096"),
    (LyingStatsStore, r"^KV store LyingStatsStore: stats did not count a put, a hit and a miss"),
])
def test_kv_kit_catches_broken_stores(store, pattern):
    with pytest.raises((AssertionError, KeyError)) as info:
        check_kv_store(store)
    text = f"KeyError: {info.value}" if isinstance(info.value, KeyError) else str(info.value)
    assert __import__("re").search(pattern, text), text


# ---- HostMemoryStore specifics -------------------------------------------------------------
def block(value: float, numel: int = 64) -> torch.Tensor:
    return torch.full((numel,), float(value))  # 256 bytes


def test_host_store_lru_eviction_and_stats():
    s = HostMemoryStore(capacity_bytes=3 * 256)
    for k in (1, 2, 3):
        assert s.put(k, block(k))
    assert list(s.keys()) == [1, 2, 3]
    assert s.get(1) is not None  # 1 becomes the most recent
    assert list(s.keys()) == [2, 3, 1]
    assert s.put(4, block(4))  # evicts 2, the least recently used
    assert list(s.keys()) == [3, 1, 4]
    assert s.put(3, block(3))  # re-put refreshes without copying again
    assert list(s.keys()) == [1, 4, 3]
    assert s.put(5, block(5), layout="ignored")
    assert list(s.keys()) == [4, 3, 5]
    assert s.get(2) is None
    assert s.evict(4) and not s.evict(4)
    st = s.stats()
    assert (st.hits, st.misses, st.puts, st.evictions) == (1, 1, 6, 2)
    assert (st.read_bytes, st.write_bytes) == (256, 5 * 256)
    assert st.extra == {"bytes": 512, "blocks": 2, "capacity_bytes": 768, "pinned": False, "pool_free_bytes": 0,
                        "pool_allocated_bytes": 0}  # no block_shape: nothing pooled
    assert s.used_bytes == 512 and len(s) == 2
    assert torch.equal(s.get(5), block(5)) and s.get(5).device.type == "cpu"
    s.close()
    assert len(s) == 0 and s.used_bytes == 0


def test_host_store_refuses_blocks_larger_than_capacity():
    s = HostMemoryStore(capacity_bytes=255)
    assert s.put(1, block(1)) is False and not s.contains(1) and s.stats().puts == 0
    s = HostMemoryStore(capacity_bytes=0)
    assert s.put(1, block(1)) is False
    with pytest.raises(ValueError, match="capacity_bytes must be an int >= 0"):
        HostMemoryStore(capacity_bytes=-1)


def test_host_store_copies_non_contiguous_blocks():
    s = HostMemoryStore()
    src = torch.arange(24.0).view(4, 6).t()  # non-contiguous
    s.put(9, src)
    got = s.get(9)
    assert torch.equal(got, src) and got.is_contiguous()


@pytest.mark.skipif(torch.accelerator.is_available() if hasattr(torch, "accelerator") else False,
                    reason="an accelerator provides pinned memory")
def test_host_store_pinned_memory_falls_back_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="deepinfer.kv_store.host")
    s = HostMemoryStore(pin_memory=True)
    assert s.pinned is False
    assert caplog.records[0].getMessage().startswith("HostMemoryStore: pinned memory is not available here")
    assert s.put(1, block(1)) and torch.equal(s.get(1), block(1))


def test_host_store_concurrent_puts_respect_capacity():
    s = HostMemoryStore(capacity_bytes=10 * 256)
    errors = []

    def work(t):
        try:
            for i in range(200):
                k = (t * 1000 + i) % 37
                s.put(k, block(k))
                got = s.get(k)
                assert got is None or torch.equal(got, block(k))
                assert s.used_bytes <= 10 * 256
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(s) <= 10 and s.used_bytes == 256 * len(s)
    assert all(torch.equal(s.get(k), block(k)) for k in list(s.keys()))
