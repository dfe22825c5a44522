"""The FP8 latent KV cache (``kv_cache_dtype = "fp8"``, ``kernels_cpu/kv_fp8.py``): the row format and
its rounding rules, the declared layout and what the engine derives from it, configuration errors,
prefix caching, the host/3FS tiers and the P/D hand-off carrying the rows unchanged (and never mixing
them with unquantised ones), and accuracy against the unquantised cache on the trained tiny model."""

from __future__ import annotations

import dataclasses
import sys
import uuid
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.handoff_format import layout_signature
from deepinfer_core.kv_cache_spec import KVCacheSpec
from deepinfer_core.kv_store import KVLayout
from kernels_cpu import ops as ref
from kernels_cpu.kv_fp8 import dequantize_latent_rows, latent_dims, quantize_latent_rows, row_bytes

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    return [4 + (seed * 31 + i * 7 + (i * i) % 13) % 120 for i in range(n)]


def tokens(outs) -> list[list[int]]:
    for o in outs:
        assert o.error is None, o.error
    return [o.outputs[0].token_ids for o in outs]


# ---- the row format -------------------------------------------------------------------------------
def test_row_layout_is_flashmla_656_bytes():
    assert row_bytes(512, 64) == 656 and row_bytes(64, 16) == 100 and row_bytes(16, 8) == 36
    assert latent_dims(576, 656) == (512, 64) and latent_dims(80, 100) == (64, 16)
    with pytest.raises(ValueError, match="row of 650 bytes cannot hold 576 values"):
        latent_dims(576, 650)
    x = torch.randn(3, 576) * 5
    rows = quantize_latent_rows(x, 656)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 656)
    # bytes: e4m3 latent, then 4 float32 scales, then the bf16 rope key unchanged
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    latent = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float() * scales.repeat_interleave(128, -1)
    assert torch.equal(latent, dequantize_latent_rows(rows, 576, torch.float32)[:, :512])
    assert torch.equal(rows[:, 528:].contiguous().view(torch.bfloat16), x[:, 512:].to(torch.bfloat16))


def test_scale_rule_is_the_ue8m0_power_of_two_of_the_finite_amax():
    x = torch.zeros(4, 256 + 16)
    x[0, :128] = torch.linspace(-3.0, 3.0, 128)  # amax 3: scale 2**ceil(log2(3 / 448)) = 2**-7
    x[0, 128:256] = 448.0  # amax exactly 448: scale 1, no saturation
    x[1, :128] = 1e-9  # below the 1e-4 amax floor: scale 2**ceil(log2(1e-4 / 448)) = 2**-22
    x[2, 5], x[2, 6], x[2, 7] = float("inf"), -float("inf"), 1.5  # the finite amax sets the scale
    x[3, 9], x[3, 10] = float("nan"), 2.0
    rows = quantize_latent_rows(x, row_bytes(256, 16))
    s = rows[:, 256:264].contiguous().view(torch.float32)
    assert s[0].tolist() == [2.0 ** -7, 1.0]
    assert s[1, 0].item() == 2.0 ** -22 and s[1, 1].item() == 2.0 ** -22  # the all-zero tile too
    assert s[2, 0].item() == 2.0 ** -8  # 1.5 / 448 -> 2**-8
    y = dequantize_latent_rows(rows, 272, torch.float32)
    assert y[0, 128:256].eq(448.0).all() and y[1, 128:].eq(0).all()
    assert y[2, 5].item() == 448 * 2.0 ** -8 and y[2, 6].item() == -448 * 2.0 ** -8  # inf saturates
    assert y[2, 7].item() == 1.5
    assert rows[3, 9].item() == 0x7F and torch.isnan(y[3, 9]) and y[3, 10].item() == 2.0  # NaN stays local
    assert torch.isfinite(y[3, torch.arange(272) != 9]).all()


def test_round_trip_error_is_half_an_e4m3_ulp():
    x = torch.randn(64, 576) * torch.logspace(-3, 3, 64)[:, None]
    y = dequantize_latent_rows(quantize_latent_rows(x, 656), 576, torch.float32)
    err = (y[:, :512] - x[:, :512]).abs()
    tile_amax = x[:, :512].abs().view(64, 4, 128).amax(-1).repeat_interleave(128, -1)
    assert bool((err <= 2.0 ** -4 * x[:, :512].abs() + 2.0 ** -9 * tile_amax / 224).all())
    assert torch.equal(y[:, 512:], x[:, 512:].to(torch.bfloat16).float())  # the rope key: bf16 rounding only


def test_reference_write_and_decode_read_the_rows():
    """paged_kv_write quantises into a uint8 cache (slot -1 skipped); mla_decode over it equals mla_decode
    over the dequantised values."""
    L, R, H = 64, 16, 4
    W = row_bytes(L, R)
    cache = torch.zeros(6, BS, W, dtype=torch.uint8)
    kv = torch.randn(20, L + R)
    slots = torch.tensor([*range(19), -1])
    ref.paged_kv_write(cache, slots, kv)
    assert torch.equal(cache.view(-1, W)[:19], quantize_latent_rows(kv[:19], W))
    assert cache.view(-1, W)[19:].eq(0).all()
    plain = dequantize_latent_rows(cache, L + R, torch.float32)
    q = torch.randn(3, H, L + R)
    tables = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]], dtype=torch.int32)
    args = (tables, torch.tensor([0, 1, 2, 3]), torch.tensor([5, 12, 19]), 0.125, L)
    assert torch.equal(ref.mla_decode(q, cache, *args), ref.mla_decode(q, plain, *args))


# ---- the declared layout and configuration --------------------------------------------------------
def test_spec_declares_bytes_and_the_engine_allocates_them(tiny_v3_path):
    budget = 1 << 20
    auto = LLM(model=tiny_v3_path, dtype="float32", block_size=BS, kv_cache_memory=budget)
    fp8 = LLM(model=tiny_v3_path, dtype="float32", block_size=BS, kv_cache_memory=budget, kv_cache_dtype="fp8")
    g = fp8.engine.cache_layout.group("latent")
    assert (g.entry_dim, g.dtype, g.encoding) == (36, torch.uint8, "fp8_ds_mla")  # L 16, R 8: 16 + 4 + 16 bytes
    assert g.bytes_per_token(torch.float32) == 2 * 36  # two layers
    assert auto.engine.cache_layout.group("latent").bytes_per_token(torch.float32) == 2 * 24 * 4
    caches = fp8.engine.kv_caches["latent"]
    assert caches[0].dtype == torch.uint8 and caches[0].shape[1:] == (BS, 36)
    assert fp8.engine.blocks.num_blocks == budget // (2 * BS * 36)
    assert auto.engine.blocks.num_blocks == budget // (2 * BS * 96)
    bf16 = LLM(model=tiny_v3_path, dtype="float32", block_size=BS, kv_cache_memory=budget, kv_cache_dtype="bf16")
    assert bf16.engine.kv_caches["latent"][0].dtype == torch.bfloat16
    assert bf16.engine.blocks.num_blocks == budget // (2 * BS * 48)
    for llm in (auto, fp8, bf16):
        assert tokens(llm.generate([{"prompt_token_ids": prompt(1, 9)}], GREEDY, use_tqdm=False))
        llm.engine.blocks.check_no_leaks()


def test_encoded_groups_are_bytes():
    with pytest.raises(ValueError, match="stored as bytes"):
        KVCacheSpec("latent", (0,), 656, dtype=torch.bfloat16, encoding="fp8_ds_mla")


def test_config_errors_name_the_field(tiny_v3_path, monkeypatch):
    with pytest.raises(ConfigError, match="config key 'kv_cache_dtype' must be one of .*got 'fp16'"):
        LLM(model=tiny_v3_path, kv_cache_dtype="fp16")
    v4 = Path(__file__).resolve().parent.parent / "deepinfer_core" / "assets" / "tiny_v4"
    with pytest.raises(ConfigError, match="'kv_cache_dtype' is 'fp8' but architecture .*V4.* stores only"):
        LLM(model=str(v4), kv_cache_dtype="fp8")
    from hardware.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "kv_cache_dtypes", lambda self: ("auto", "bf16"))
    with pytest.raises(ConfigError, match="'kv_cache_dtype' is 'fp8' but platform 'cpu' reads only"):
        LLM(model=tiny_v3_path, kv_cache_dtype="fp8")


# ---- prefix caching, tiers, hand-off --------------------------------------------------------------
def test_prefix_hits_equal_a_fresh_prefill(tiny_v3_path):
    """Prefill reads the context back from the FP8 cache, so a prefix hit and chunked prefill give
    the tokens and logprobs of computing each prompt at once."""
    prompts = [{"prompt_token_ids": prompt(2, 23) + prompt(s, 3 + s)} for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    common = dict(model=tiny_v3_path, dtype="float32", block_size=BS, kv_cache_dtype="fp8")
    want = LLM(enable_prefix_caching=False, **common).generate(prompts, params, use_tqdm=False)
    warm = LLM(max_num_batched_tokens=7, **common)
    warm.generate(prompts[:1], params, use_tqdm=False)
    got = warm.generate(prompts, params, use_tqdm=False)
    assert [o.metrics.num_cached_tokens for o in got] == [24, 20, 20, 20]
    assert tokens(got) == tokens(want)

    def logprobs(o):
        return [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]

    # float32 noise of other batch shapes only; attending over unquantised prompt keys would move them ~1e-2
    for g, w in zip(got, want):
        assert logprobs(g) == pytest.approx(logprobs(w), abs=1e-4)
    warm.engine.blocks.check_no_leaks()


def test_fingerprints_separate_fp8_and_plain_rows(tiny_v3_path):
    fp8 = LLM(model=tiny_v3_path, dtype="float32", block_size=BS, kv_cache_dtype="fp8").engine
    auto = LLM(model=tiny_v3_path, dtype="float32", block_size=BS).engine
    assert layout_signature(fp8.cache_layout, BS, fp8.dtype) != layout_signature(auto.cache_layout, BS, auto.dtype)
    a = KVLayout.for_model("f" * 16, 2, BS, 36, torch.uint8, "fp8_ds_mla")
    assert a.model_fingerprint != KVLayout.for_model("f" * 16, 2, BS, 36, torch.uint8).model_fingerprint
    assert KVLayout.for_model("f" * 16, 2, BS, 24, torch.float32).model_fingerprint == \
        KVLayout.for_model("f" * 16, 2, BS, 24, torch.float32, "").model_fingerprint  # plain rows: unchanged


def _store_engine(path: str, store: Path, **kw) -> LLM:
    section = {"backend": "3fs", "path": str(store), "offload_on_finish": True}
    return LLM(model=path, dtype="float32", block_size=BS, kv_store=section, **kw)


@pytest.mark.parametrize("writer,reader", [("fp8", "fp8"), ("fp8", "auto"), ("auto", "fp8")])
def test_store_carries_fp8_rows_and_never_mixes_them(tiny_v3_path, tmp_path, writer, reader):
    """The host/3FS tiers keep FP8 rows as bytes: an fp8 reader hits an fp8 writer's blocks with the
    tokens of a fresh fp8 engine; across kv_cache_dtypes nothing is a hit."""
    store = tmp_path / "store"
    prompts = [{"prompt_token_ids": prompt(s, 21)} for s in range(3)]
    fresh = LLM(model=tiny_v3_path, dtype="float32", block_size=BS, kv_cache_dtype=reader, enable_prefix_caching=False)
    want = tokens(fresh.generate(prompts, GREEDY, use_tqdm=False))
    w = _store_engine(tiny_v3_path, store, kv_cache_dtype=writer)
    w.generate(prompts, GREEDY, use_tqdm=False)
    w.shutdown()
    assert list(store.rglob("*.kvb")), "the writer stored nothing"
    r = _store_engine(tiny_v3_path, store, kv_cache_dtype=reader)
    outs = r.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == want
    hits = r.metrics()["kv_tiers"]["persistent"]["hits"]
    assert (hits > 0 and all(o.metrics.num_cached_tokens == 20 for o in outs)) if writer == reader else hits == 0
    r.engine.blocks.check_no_leaks()
    r.shutdown()


@pytest.mark.parametrize("decode_kv", ["fp8", "auto"])
def test_handoff_carries_fp8_rows(tiny_v3_path, decode_kv):
    """P/D hand-off of FP8 rows: an fp8 decode engine continues with the colocated fp8 tokens from the
    handed-off rows; an unquantised one refuses the payload (another layout) and recomputes."""
    section = {"backend": "shm", "namespace": f"fp8kv-{uuid.uuid4().hex[:8]}"}
    prompts = [{"prompt_token_ids": prompt(s, 13 + s)} for s in range(4)]
    common = dict(model=tiny_v3_path, dtype="float32", block_size=BS)
    want = tokens(LLM(kv_cache_dtype=decode_kv, **common).generate(prompts, GREEDY, use_tqdm=False))
    p = LLM(kv_role="prefill", kv_transfer=section, kv_cache_dtype="fp8", **common)
    pouts = p.generate(prompts, GREEDY, use_tqdm=False)
    d = LLM(kv_role="decode", kv_transfer=section, kv_cache_dtype=decode_kv, **common)
    params = [dataclasses.replace(GREEDY, kv_transfer_params=o.kv_transfer_params) for o in pouts]
    douts = d.generate(prompts, params, use_tqdm=False)
    assert tokens(douts) == want
    m = d.metrics()
    if decode_kv == "fp8":
        assert m["handoff_received"] == 4 and m.get("handoff_recomputed", 0) == 0
    else:
        assert m["handoff_recomputed"] == 4
    d.engine.blocks.check_no_leaks()
    p.shutdown()
    d.shutdown()


# ---- accuracy on the trained tiny model -------------------------------------------------------------
def test_accuracy_against_the_unquantised_cache():
    """The embedded tiny model (trained), float32 reference cache: logprob drift and greedy agreement
    over a Python prompt set stay within bounds (examples/kv_fp8_accuracy.py measures the full set)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from kv_fp8_accuracy import PROMPTS, measure

    common = dict(dtype="float32", enable_prefix_caching=False)
    res = measure(LLM(**common), LLM(kv_cache_dtype="fp8", **common), PROMPTS[:6], max_tokens=24)
    assert res["prefill_drift_mean"] < 0.05 and res["prefill_drift_max"] < 1.0, res
    assert res["decode_drift_mean"] < 0.05 and res["decode_drift_max"] < 0.5, res
    assert res["greedy_agreement_tokens"] >= 0.6, res
    assert res["prefill_drift_mean"] > 0, res  # the rows are quantised: a drift of 0 would mean they are not
