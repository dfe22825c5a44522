"""Decode fusion on the CPU (reference ops): the shared experts folded into the routed ``fused_moe`` as
always-selected experts (their slots appended by ``moe_gate`` with the router), MLA's cache entry through
``mla_kv_write``, its decode query through ``mla_q_absorb`` and its attention with W_UV through ``mla_decode_uv``,
the router through ``linear_f32``.
The fused and unfused paths (``set_decode_fusion``) give the same greedy tokens and logprobs, on the
trained embedded model (one shared expert: the shared MLP becomes a view of the stacked tensors) and on
the V2-Lite shape (two shared experts of the shared MLP's width split in two); a placement change of the
routed experts turns the folding off instead of reading stale weights; the fused ops run only where the
backend implements them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.deepseek import MoE
from deepinfer_core.models.loader import EMBEDDED_MODEL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

pytestmark = pytest.mark.usefixtures("one_thread")


def _moes(llm: LLM) -> list[MoE]:
    return [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, MoE)]


def _greedy(llm: LLM, prompts, n: int):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [[o.outputs[0].logprobs[j][t].logprob for j, t in enumerate(o.outputs[0].token_ids)] for o in outs]
    return tokens, lps


def _fused_vs_unfused(llm: LLM, prompts, n: int, tol: float) -> None:
    fused, fused_lp = _greedy(llm, prompts, n)
    llm.engine.model.set_decode_fusion(False)
    assert not any(m._folded() for m in _moes(llm))
    plain, plain_lp = _greedy(llm, prompts, n)
    llm.engine.model.set_decode_fusion(True)
    assert fused == plain
    err = max(abs(a - b) for x, y in zip(fused_lp, plain_lp) for a, b in zip(x, y))
    assert err < tol, f"logprobs of the fused and unfused paths differ by {err:.2e}"


def test_trained_model_fused_and_unfused_agree():
    if not (EMBEDDED_MODEL / "config.json").is_file():
        pytest.skip("the embedded default model is not trained yet")
    llm = LLM(dtype="float32", accelerator="cpu", kv_cache_memory=8 << 20, enable_prefix_caching=False)
    try:
        moes = _moes(llm)
        assert moes and all(m._folded() for m in moes)
        for m in moes:  # one shared expert: routed and shared parameters are views of the stacked tensors
            E = m.num_local
            assert m.w13_all.shape[0] == E + 1 and m.w13.data_ptr() == m.w13_all.data_ptr()
            assert m.shared.w13.data_ptr() == m.w13_all[E].data_ptr()
            assert m.shared.w2.data_ptr() == m.w2_all[E].data_ptr()
        prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Stack:\n", "# read the config\n"]
        _fused_vs_unfused(llm, prompts, 24, 1e-4)
    finally:
        llm.shutdown()


def test_v2_lite_shape_two_shared_experts(tmp_path):
    from h200_suite import suite_config
    from random_checkpoint import write_config

    cfg = suite_config("v2-lite", "tiny", None)
    assert cfg["n_shared_experts"] == 2
    model_dir = write_config(tmp_path / "v2-lite", cfg)
    llm = LLM(str(model_dir), dtype="float32", accelerator="cpu", load_format="random", seed=3,
              kv_cache_memory=4 << 20, enable_prefix_caching=False)
    try:
        model = llm.engine.model
        with torch.no_grad():  # far from flat logits, so that a wrong expert layout shows
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(15.0)
        model.post_load()  # weights changed: restack
        moe = _moes(llm)[0]
        E, I = moe.num_local, cfg["moe_intermediate_size"]
        assert moe._folded() and moe.w13_all.shape == (E + 2, 2 * I, cfg["hidden_size"])
        # shared expert j = channels j*I..(j+1)*I of the shared MLP: gate rows, up rows, down columns
        sh = moe.shared
        assert torch.equal(moe.w13_all[E + 1, :I], sh.w13[I : 2 * I])
        assert torch.equal(moe.w13_all[E + 1, I:], sh.w13[3 * I : 4 * I])
        assert torch.equal(moe.w2_all[E + 1], sh.w2[:, I : 2 * I])
        x = torch.randn(5, cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
        fused = moe(x)
        moe.fold_shared = False
        plain = moe(x)
        moe.fold_shared = True
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
        g = torch.Generator().manual_seed(1)
        prompts = [{"prompt_token_ids": torch.randint(2, 500, (n,), generator=g).tolist()} for n in (7, 30, 64)]
        _fused_vs_unfused(llm, prompts, 12, 1e-4)
        # a placement change (expert parallelism installs new routed weights): the shared MLP runs on its own
        moe.w13.data = moe.w13.data.clone()
        assert not moe._folded()
        torch.testing.assert_close(moe(x), plain, rtol=1e-5, atol=1e-5)
    finally:
        llm.shutdown()


def test_gemv_dispatch_rules(monkeypatch):
    """Which projections the CUDA backend's ``linear`` / ``linear_f32`` run as its GEMV (the rest go to cuBLAS),
    and the GEMV's tiles: one warp per weight row with at least two CTAs per SM, or split-K for small N."""
    from kernels_cuda import _tl
    from kernels_cuda.gemv import MAX_M, applies, m_bucket, tile_config

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")  # CPU tensors stand in for device ones
    bf = torch.bfloat16
    w = torch.empty(3648, 2048, dtype=bf)
    assert MAX_M == 8  # one row: gemv's kernel; 2..8 rows: gemv_rows; more: cuBLAS
    assert applies(torch.empty(1, 2048, dtype=bf), w) and applies(torch.empty(1, 1, 2048, dtype=bf), w)
    assert applies(torch.empty(8, 2048, dtype=bf), w) and not applies(torch.empty(9, 2048, dtype=bf), w)
    assert not applies(torch.empty(0, 2048, dtype=bf), w)
    assert not applies(torch.empty(1, 2048), w.float())  # float32 activations: cuBLAS (the reference)
    assert applies(torch.empty(1, 2048, dtype=bf), torch.empty(64, 2048))  # the router's float32 gate
    assert not applies(torch.empty(1, 2044, dtype=bf), torch.empty(64, 2044, dtype=bf))  # K not in 16-byte vectors
    assert applies(torch.empty(1, 2044, dtype=bf), torch.empty(64, 2044))  # ... of float32 it is
    assert not applies(torch.empty(1, 2042, dtype=bf), torch.empty(64, 2042))
    assert not applies(torch.empty(1, 2048, dtype=bf), torch.empty(64, 4096, dtype=bf)[:, ::2])  # strided W
    assert not applies(torch.empty(1, 2048, dtype=bf), torch.empty(65 * 2048 + 1, dtype=bf)[1:].view(65, 2048))
    assert [m_bucket(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert tile_config(3648, 2048, 132) == (8, 32)  # 456 CTAs of 8 rows
    assert tile_config(2048, 2048, 132) == (4, 32)  # 8 rows would give 256 < 2 x 132 CTAs
    assert tile_config(64, 2048, 132, VEC=4) == (1, 128)  # router: a row per CTA, K split over 4 warps
    assert tile_config(256, 7168, 132, VEC=4) == (1, 256)


def test_moe_streaming_dispatch_rules(monkeypatch):
    """Which ``fused_moe`` calls the CUDA backend runs on the weight-streaming path (``kernels_cuda.moe_gemv``:
    decode batches, decided from shapes alone) and its CTA shapes; the rest take the tensor-core pipeline."""
    from kernels_cuda import _tl
    from kernels_cuda.moe_gemv import MAX_TOKENS, applies, m_bucket, mma_fits, split

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")  # CPU tensors stand in for device ones
    bf, e = torch.bfloat16, torch.empty
    w13, w2 = e(66, 2 * 1408, 2048, dtype=bf), e(66, 2048, 1408, dtype=bf)  # V2-Lite, shared experts folded

    def call(T, k=8, dtype=bf, wdt=bf, idt=torch.long, w13=w13, w2=w2, max_tokens=8):
        return applies(e(T, w13.shape[2], dtype=dtype), w13, w2, e(T, k, dtype=wdt), e(T, k, dtype=idt),
                       max_tokens=max_tokens)

    assert MAX_TOKENS == 8  # measured: 1-8 tokens win, 16 is even with the pipeline (moe_gemv.py)
    assert all(call(T, max_tokens=MAX_TOKENS) for T in (1, 2, 5, 8)) and not call(9, max_tokens=MAX_TOKENS)
    assert not call(0)
    assert call(1, wdt=torch.float32) and call(1, idt=torch.int32)
    assert not call(1, idt=torch.int16)
    assert not call(1, dtype=torch.float32)  # float32 activations: the reference
    assert not applies(e(1, 2048, dtype=bf), w13.float(), w2, e(1, 8, dtype=bf), e(1, 8, dtype=torch.long))
    assert not applies(e(1, 2048, dtype=bf), w13[:, :, ::2], w2, e(1, 8, dtype=bf), e(1, 8, dtype=torch.long))
    assert call(1, w13=e(6, 48, 32, dtype=bf), w2=e(6, 32, 24, dtype=bf))  # tiny widths, 8-element vectors
    assert not call(1, w13=e(6, 40, 32, dtype=bf), w2=e(6, 32, 20, dtype=bf))  # width 20: not whole vectors
    assert not call(8, k=40)  # 320 slots: more than a CTA lists
    assert [m_bucket(T) for T in (1, 2, 3, 5, 8, 16)] == [1, 2, 4, 8, 8, 8]
    assert split(2048) == (32, 8) and split(1408) == (32, 8)  # a warp per column, 8 columns per CTA
    assert split(7168) == (128, 2) and split(4096) == (64, 4)  # V3 / V4 hidden: K over 4 / 2 warps
    # the tensor-core up kernel takes V2-Lite / V3 / V4 hidden widths (8 warps x 32-element steps), not the kit's 32
    assert mma_fits(2048) and mma_fits(7168) and mma_fits(4096) and not mma_fits(32) and not mma_fits(2560 + 8)


def test_gemv_rows_dispatch_and_tiles(monkeypatch):
    """``gemv_rows`` (2..8 rows, ``head_linear``, ``mla_q_absorb``): which inputs it takes, and its tiles: K
    split over warps until about 16 warps per SM are in flight, half a warp per row where K is 128 (W_UK)."""
    from kernels_cuda import _tl
    from kernels_cuda.gemv_rows import RowsConfig, applies, faster_than_cublas, rows_config

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")
    bf = torch.bfloat16
    w_uk = torch.empty(16, 512, 128, dtype=bf)
    q = torch.empty(3, 16, 192, dtype=bf)
    assert applies(q[..., :128], w_uk)  # a column slice of the projection output (strides multiples of 8)
    assert not applies(torch.empty(3, 16, 200, dtype=bf)[..., 1:129], w_uk)  # not 16-byte aligned
    assert not applies(torch.empty(9, 16, 128, dtype=bf), w_uk)  # 9 tokens: the reference's batched GEMM
    assert not applies(torch.empty(3, 16, 128), w_uk.float())  # float32: the reference
    assert not applies(torch.empty(0, 16, 128, dtype=bf), w_uk)
    assert rows_config(16, 512, 128, 1, 132) == RowsConfig(RN=2, RT=16, KS=1, BNW=8, CH=1)
    assert rows_config(1, 3648, 2048, 8, 132) == RowsConfig(RN=4, RT=32, KS=4, BNW=2, CH=2)
    assert rows_config(1, 102400, 2048, 8, 132) == RowsConfig(RN=4, RT=32, KS=1, BNW=8, CH=4)
    assert rows_config(1, 48, 32, 2, 132) == RowsConfig(RN=4, RT=4, KS=1, BNW=8, CH=1)
    # measured against cuBLAS on the H200: one row always; 2..4 rows only of a small weight (<= 4 MB)
    assert faster_than_cublas(1, 1 << 30) and faster_than_cublas(4, 2 << 20)
    assert not faster_than_cublas(2, 15 << 20) and not faster_than_cublas(8, 1 << 20)


def _tiny_model(kernels):
    import json

    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.loader import build_model

    cfg = ModelConfig.from_dict(json.loads((EMBEDDED_MODEL / "config.json").read_text()))
    torch.manual_seed(0)
    model = build_model(kernels, cfg, torch.float32, torch.device("cpu"), 256)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.post_load()
    return model, cfg


def _decode_once(model, cfg) -> None:
    from deepinfer_core.engine.graph_runner import DecodeGraphs

    bs = 16
    kv = [torch.zeros(4, bs, cfg.kv_entry_dim) for _ in range(cfg.num_hidden_layers)]
    graphs = DecodeGraphs(model, {"latent": kv}, [2], 256 // bs + 1, torch.device("cpu"), capture=False)
    with torch.inference_mode():
        graphs._forward(2)


@pytest.mark.parametrize("native", [True, False])
def test_fused_ops_only_where_the_backend_implements_them(native):
    """``mla_q_absorb_kv_write``, ``mla_decode_uv``, ``add_rms_norm_moe_gate`` and ``add_rms_norm_linear`` run at
    decode when the backend has them (the reference has every op); a backend without them (Ascend) keeps its own
    ``rope``, ``moe_route``, norms and ``mla_decode`` instead of the reference's composition of them."""
    from deepinfer_core.kernels import KernelBackend, Kernels
    from kernels_cpu import ReferenceKernels

    class NoFusedOps(KernelBackend):
        name = "no-fused-ops"
        core_api_version = "1.0"
        ops = {k: v for k, v in ReferenceKernels.ops.items()
               if k not in ("mla_q_absorb", "moe_gate", "add_rms_norm_linear", "add_rms_norm_moe_gate",
                            "mla_q_absorb_kv_write", "mla_decode_uv")}

    k = Kernels(ReferenceKernels if native else NoFusedOps, ReferenceKernels)
    calls: list[str] = []
    for op in ("mla_q_absorb", "moe_gate", "moe_route", "rope", "add_rms_norm_linear", "add_rms_norm", "rms_norm",
               "add_rms_norm_moe_gate", "mla_q_absorb_kv_write", "mla_kv_write", "mla_decode_uv", "mla_decode"):
        fn = getattr(k, op)
        k.override(op, lambda *a, _fn=fn, _op=op, **kw: calls.append(_op) or _fn(*a, **kw))
    model, cfg = _tiny_model(k)
    _decode_once(model, cfg)
    layers, moes = cfg.num_hidden_layers, len(model.moe_layers())
    q_norms = layers if cfg.q_lora_rank else 0  # q_a_layernorm
    if native:
        # the router behind the post-attention norm (add_rms_norm_moe_gate) in every MoE layer
        # the query and the cache write in one op (a decode-only step)
        assert calls.count("mla_q_absorb_kv_write") == layers and "mla_q_absorb" not in calls
        # the attention and W_UV in one op
        assert calls.count("mla_decode_uv") == layers and "mla_decode" not in calls
        assert "mla_kv_write" not in calls and calls.count("add_rms_norm_moe_gate") == moes
        assert "rope" not in calls and "moe_route" not in calls  # the key's rope is inside mla_kv_write
        # every input norm inside the q + kv_a projection, a dense layer's post-attention norm inside its w13
        # GEMV; only the final norm stays
        assert calls.count("add_rms_norm_linear") == 2 * layers - moes and calls.count("rms_norm") == q_norms
        assert calls.count("add_rms_norm") == 1
    else:
        assert not {"mla_q_absorb", "moe_gate", "add_rms_norm_linear", "add_rms_norm_moe_gate",
                    "mla_q_absorb_kv_write", "mla_decode_uv"} & set(calls)
        assert calls.count("mla_decode") == layers
        assert calls.count("rope") == layers and calls.count("moe_route") == moes
        assert calls.count("rms_norm") == q_norms + 1 and calls.count("add_rms_norm") == 2 * layers


def test_linear_dispatch_by_rows_and_weight(monkeypatch):
    """The CUDA ``linear`` per row count (CPU tensors, the kernels replaced by recorders: nothing compiles), as
    measured on the H200: one row on ``gemv``; 2..8 rows of a weight of <= 4096 rows whose K splits evenly on
    the tensor-core GEMV; 2..4 rows of another small weight on ``gemv_rows``; the rest on cuBLAS (the reference)."""
    from kernels_cuda import _tl, gemv, gemv_mma, gemv_rows

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")
    launched: list[str] = []
    for mod in (gemv, gemv_rows, gemv_mma):
        monkeypatch.setattr(mod, "_kernel", lambda *cfg, _m=mod.__name__: lambda *a: launched.append(_m))
    bf = torch.bfloat16
    qkv, dense, odd = (torch.zeros(3648, 2048, dtype=bf), torch.zeros(21888, 2048, dtype=bf),
                       torch.zeros(2048, 2816, dtype=bf))  # V2-Lite q+kv_a, dense w13, shared w2 (11 steps)
    small_odd = torch.zeros(512, 2816, dtype=bf)
    cases = ((1, qkv, "gemv"), (2, qkv, "gemv_mma"), (8, qkv, "gemv_mma"), (4, dense, None), (8, odd, None),
             (3, small_odd, "gemv_rows"))
    for M, w, want in cases:
        launched.clear()
        y = gemv.linear(torch.zeros(M, w.shape[1], dtype=bf), w)
        assert y.shape == (M, w.shape[0])
        assert launched == ([f"kernels_cuda.{want}"] if want else []), (M, w.shape, launched)


def test_mla_decode_uv_poisoned_token_empty_batch_and_two_threads():
    """The fused op's meaning (``kernels_cpu.fused.mla_decode_uv``), attacked: a NaN query row poisons its own
    token's output only (the other sequences equal a clean call), an empty batch gives [0, H, V], and two threads
    calling it on one cache get each their own single-threaded answer."""
    import threading

    from kernels_cpu.fused import mla_decode_uv

    g = torch.Generator().manual_seed(3)
    H, L, R, V, bs, lens = 4, 64, 8, 16, 16, [5, 17, 33]
    tables = torch.arange(9, dtype=torch.int32).view(3, 3)
    cache = torch.randn(9, bs, L + R, generator=g)
    w_uv = torch.randn(H, V, L, generator=g) * L**-0.5
    q = torch.randn(3, H, L + R, generator=g)
    cu, sl = torch.tensor([0, 1, 2, 3]), torch.tensor(lens)
    clean = mla_decode_uv(q, cache, tables, cu, sl, (L + R) ** -0.5, L, w_uv)
    bad = q.clone()
    bad[1, 2, 5] = float("nan")
    out = mla_decode_uv(bad, cache, tables, cu, sl, (L + R) ** -0.5, L, w_uv)
    assert torch.isnan(out[1]).any() and torch.equal(out[[0, 2]], clean[[0, 2]])
    empty = mla_decode_uv(q[:0], cache, tables[:0], cu[:1], sl[:0], (L + R) ** -0.5, L, w_uv)
    assert empty.shape == (0, H, V)
    got = [None, None]

    def run(i):
        got[i] = mla_decode_uv(q[i:i + 1], cache, tables[i:i + 1], cu[:2], sl[i:i + 1], (L + R) ** -0.5, L, w_uv)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert torch.allclose(got[i][0], clean[i], rtol=1e-5, atol=1e-6)
