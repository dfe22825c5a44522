"""``examples/engine_warm.py`` compiles the kernels the engine's steps use (CPU, dry run: every kernel cache of
``kernels_cuda`` is replaced by a recorder of its configuration, so nothing is traced or compiled).

The configurations the warm-up asks for must include every one a step of the real model asks for, with and without
q_lora (the query is then q_b's own output, else a strided slice of the fused q + kv_a projection: the GEMV kernels
compile per stride): decode steps at every captured batch size (split-KV or not, and its combine's tiles; the MoE's
weight-streaming rows and block rows), prefill chunks of 1..9 rows (the GEMVs' row counts, kv_b_proj's included) and
larger ones, with and without a cached prefix, and a mixed step; speculative verify steps of several draft lengths
(the verify graphs' keys and eager ragged steps: mla_decode over several query rows a request).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


@pytest.fixture
def kernel_configs(monkeypatch):
    """Records ``(module.cache, builder args)`` of every kernel a ``kernels_cuda`` op asks for (the kernels do
    nothing)."""
    import kernels_cuda
    from kernels_cuda import _tl

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")  # CPU tensors stand in for device ones
    asked: list[tuple[str, tuple]] = []

    def recorder(key):
        def get(*args):
            asked.append((key, args))
            return lambda *a, **k: None

        return get

    for name in kernels_cuda.KERNEL_MODULES:
        mod = importlib.import_module(f"kernels_cuda.{name}")
        for attr, value in list(vars(mod).items()):
            if hasattr(value, "builder"):  # a _tl.kernel_cache
                monkeypatch.setattr(mod, attr, recorder(f"{name}.{attr}"))
    return asked


def _mini(q_lora: bool) -> dict:
    """A small DeepSeek-V3 shape with real MLA head dimensions (16 heads: no padded heads in mla_decode); with
    q_lora, q_lora_rank + kv_lora_rank + rope < heads x (nope + rope), as in V3."""
    from random_checkpoint import shape_config

    raw = shape_config("v3-tiny")
    raw.update(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=2, q_lora_rank=256 if q_lora else None)
    return raw


def _model(raw: dict, fusion: bool = True):
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.loader import build_model
    from kernels_cpu import ReferenceKernels
    from kernels_cuda import CudaKernels

    cfg = ModelConfig.from_dict(raw)
    model = build_model(Kernels(CudaKernels, ReferenceKernels), cfg, torch.bfloat16, torch.device("cpu"), 1024)
    model.post_load()
    model.set_decode_fusion(fusion)
    kv = [torch.zeros(16, 64, cfg.kv_entry_dim, dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
    return model, {"latent": kv}


def _decode_configs(raw: dict, batches: list[int], asked: list, fusion: bool = True) -> set:
    from deepinfer_core.engine.graph_runner import DecodeGraphs

    model, kv = _model(raw, fusion)
    graphs = DecodeGraphs(model, kv, batches, 1024 // 64, torch.device("cpu"), capture=False)
    asked.clear()
    with torch.inference_mode():
        for B in batches:
            graphs._forward(B)
    return set(asked)


def _prefill_configs(raw: dict, chunks: list[tuple[int, int]], asked: list, decodes: int = 0,
                     fusion: bool = True) -> set:
    """Steps of one prefill chunk of ``n`` new tokens after ``p`` cached ones, for each ``(n, p)`` of ``chunks``
    (and ``decodes`` one-token decode sequences after it: a mixed step), their last rows' logits included."""
    from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, PrefillMeta

    model, kv = _model(raw, fusion)
    table = torch.arange(16, dtype=torch.int32)[None]
    asked.clear()
    with torch.inference_mode():
        for n, p in chunks:
            cu_q, cu_k = torch.tensor([0, n]), torch.tensor([0, p + n])
            prefill = PrefillMeta(cu_q, cu_k, cu_k[1:], table, has_prefix=p > 0)
            decode = DecodeMeta(torch.arange(decodes + 1), torch.full((decodes,), 10), table.expand(decodes, 16)) \
                if decodes else None
            T = n + decodes
            positions = torch.cat((torch.arange(p, p + n), torch.full((decodes,), 9)))
            meta = AttentionMetadata(n, torch.arange(T), prefill, decode)
            hidden = model(torch.zeros(T, dtype=torch.long), positions, meta, kv)
            model.logits(hidden[n - 1:])
    return set(asked)


def _verify_configs(raw: dict, ks: tuple[int, ...], asked: list) -> dict[int, set]:
    """Per draft length ``k`` of ``ks``, the configurations of speculative verify steps: every verify graph key
    ``(n, R)`` of the default sizes (``R`` = 2..k + 1 rows a request, ``n * R`` <= the verify token cap; the keys of
    a smaller k are some of a larger one's, so each runs once), through the graphs' padded buffers; then eager
    ones: requests of ragged rows (1..k + 1 a request: partial acceptances), and a batch of k + 1 rows a request
    past the graphs' cap."""
    from deepinfer_core.engine.graph_runner import DecodeGraphs, default_batch_sizes
    from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta

    model, kv = _model(raw)
    graphs = DecodeGraphs(model, kv, default_batch_sizes(256), 1024 // 64, torch.device("cpu"), capture=False,
                          verify_rows=max(ks) + 1)
    per_key = {}
    out = {}
    with torch.inference_mode():
        for n, R in graphs.keys:
            if R > 1:
                asked.clear()
                graphs._forward(n, R)
                per_key[(n, R)] = set(asked)
        for k in ks:
            asked.clear()
            cap = max(n * R for n, R in per_key if R <= k + 1)
            for q_lens in ([1 + i % (k + 1) for i in range(5)], [k + 1] * (cap // (k + 1) + 1)):
                B, T = len(q_lens), sum(q_lens)
                cu = torch.tensor([0, *q_lens]).cumsum(0)
                lens = torch.full((B,), 40)
                decode = DecodeMeta(cu, lens, torch.zeros(B, 16, dtype=torch.int32), max(q_lens))
                meta = AttentionMetadata(0, torch.full((T,), -1), None, decode, cu_q_lens=cu, seq_lens=lens)
                model.logits(model(torch.zeros(T, dtype=torch.long), torch.full((T,), 30), meta, kv))
            out[k] = set(asked).union(*(used for (n, R), used in per_key.items() if R <= k + 1))
    return out


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_warm_covers_decode_kernels(kernel_configs, q_lora):
    """Decode steps at every default captured batch size, 1..256 (the GEMVs' row buckets, the fused decode query,
    mla_decode with and without split-KV and both combine tilings, the MoE's weight-streaming and block-row
    variants): each kernel configuration is one the warm-up compiles."""
    import engine_warm

    from deepinfer_core.engine.graph_runner import default_batch_sizes
    from deepinfer_core.models.config import ModelConfig

    raw = _mini(q_lora)
    used = _decode_configs(raw, default_batch_sizes(256), kernel_configs)
    combine = {args[3:] for key, args in used if key == "mla_decode._combine_kernel"}
    assert combine == {(16, 2), (8, 1)}, combine  # small split grids, and mid-size batches still split
    # the key splits' merge with W_UV in one kernel (mla_decode_uv) at the smallest batches
    # (batch 1 with programmatic dependent launch: ``DEEPINFER_PDL`` unset, an sm_90a target)
    assert {args for key, args in used if key == "mla_decode_uv._kernel"} == {(16, 16, 512, 128, "bfloat16"),
                                                                             (16, 16, 512, 128, "bfloat16", True)}
    assert len({args[3] for key, args in used if key == "moe_stream._gemm1"}) == 3  # every block-row count
    # gemv_rows with R > 0 rope columns: mla_q_absorb(_kv_write)
    absorb = [args for key, args in used if key == "gemv_rows._kernel" and len(args) > 9 and args[9]]
    assert absorb, "the decode step ran no fused decode query"
    cfg = ModelConfig.from_dict(raw)
    H, NR = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    row = H * NR if q_lora else H * NR + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    # the query's (row, head) strides at 2..8 rows (one row's view has the row stride of a contiguous query)
    assert {args[5] for args in absorb if args[3] > 1} == {(row, NR)}
    kernel_configs.clear()
    engine_warm.warm_shape(cfg)
    missing = used - set(kernel_configs)
    assert not missing, sorted(missing, key=str)


#: speculative draft lengths (the device scripts and ``spec_async_figures.py`` run k = 4; up to 16)
SPEC_KS = (1, 2, 4, 5, 8)


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_warm_covers_verify_kernels(kernel_configs, q_lora):
    """Speculative verify steps at draft lengths ``SPEC_KS``: the verify graphs' keys (n requests of R = 2..k + 1
    rows: mla_decode over several query rows a request, split-KV or not, the GEMVs and the MoE at n * R rows) and
    eager verify steps (ragged rows, past the graphs' token cap) ask only for configurations
    ``warm_shape(spec_k=k)`` compiles, and so does the async launch's ``draft_lengths`` (its confidences padded
    to k columns: ``spec_async``)."""
    import engine_warm

    from deepinfer_core.models.config import ModelConfig

    raw = _mini(q_lora)
    cfg = ModelConfig.from_dict(raw)
    for k, used in _verify_configs(raw, SPEC_KS, kernel_configs).items():
        ragged = {args[8:10] for key, args in used if key == "mla_decode._decode_kernel" and args[9]}
        assert ragged == {(True, True), (False, True)}, ragged  # several rows a request, split-KV and not
        used.add(("draft_lengths._kernel", (k,)))
        kernel_configs.clear()
        engine_warm.warm_shape(cfg, spec_k=k)
        missing = used - set(kernel_configs)
        assert not missing, f"k={k}: " + ", ".join(sorted(map(str, missing)))


@pytest.mark.parametrize("shape", ["v2-lite", "v3-slice"])
def test_warm_real_shapes(kernel_configs, shape):
    """The full-size shapes (on the meta device: no memory) build every input; the decode query has the model's
    strides: V3's q_b output is contiguous, V2-Lite's q is a slice of the fused q + kv_a projection's rows; verify
    steps' ragged mla_decode comes split-KV and not (V3: the warp-specialised kernel)."""
    import engine_warm
    from random_checkpoint import shape_config

    from deepinfer_core.models.config import ModelConfig

    cfg = ModelConfig.from_dict(shape_config(shape))
    with torch.device("meta"):
        names = engine_warm.warm_shape(cfg)
    assert "sample" in names
    absorb = {args[5] for key, args in kernel_configs
              if key == "gemv_rows._kernel" and len(args) > 9 and args[9] and args[3] > 1}
    assert absorb == {{"v2-lite": (16 * 192 + 512 + 64, 192), "v3-slice": (128 * 192, 192)}[shape]}
    # speculative verify steps (the default draft length): the ragged kernel, split-KV and not (V3's 128 heads: the
    # warp-specialised one)
    key, at = {"v2-lite": ("mla_decode._decode_kernel", 8), "v3-slice": ("mla_decode_ws._decode_ws_kernel", 4)}[shape]
    assert {args[at:at + 2] for name, args in kernel_configs if name == key} == {(s, r) for s in (True, False)
                                                                           for r in (True, False)}


#: prefill chunks (new tokens, cached prefix)
CHUNKS = [(n, 0) for n in range(1, 10)] + [(64, 0), (256, 0), (3, 2), (64, 64)]


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_warm_covers_prefill_kernels(kernel_configs, q_lora):
    """Prefill chunks of 1..9 rows (kv_b_proj's GEMV over the chunk's latents at each row count, the prefill
    rows' q_pe rope at one row), larger chunks, chunks after a cached prefix (kv_b_proj over the whole context)
    and a mixed step: each kernel configuration is one the warm-up compiles."""
    import engine_warm

    from deepinfer_core.models.config import ModelConfig

    raw = _mini(q_lora)
    used = _prefill_configs(raw, CHUNKS, kernel_configs) | _prefill_configs(raw, [(5, 0), (40, 0)],
                                                                           kernel_configs, decodes=3)
    cfg = ModelConfig.from_dict(raw)
    kv_b = (cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    assert any(key == "gemv._kernel" and args[:2] == kv_b for key, args in used), "kv_b_proj ran no GEMV"
    kernel_configs.clear()
    engine_warm.warm_shape(cfg)
    missing = used - set(kernel_configs)
    assert not missing, sorted(missing, key=str)


def test_representative_decode_query_kernels_are_the_engines(kernel_configs, monkeypatch):
    """CPU CI compiles ``gemv_rows.representative_kernels()`` (tests/test_kernels_cuda_compile.py): its fused decode
    query kernels (rope columns R > 0) must be configurations V2-Lite's engine asks for, the query's strides
    included (a slice of the fused q + kv_a projection's rows), and one of them at two or more rows."""
    import engine_warm
    from random_checkpoint import shape_config

    from deepinfer_core.models.config import ModelConfig
    from kernels_cuda import gemv_rows

    monkeypatch.setattr(gemv_rows, "build_gemv_rows", lambda *args: args)
    reps = [thunk() for _, thunk in gemv_rows.representative_kernels()]
    query = [args for args in reps if len(args) > 9 and args[9]]
    assert any(args[3] > 1 for args in query), "no fused decode query kernel at two or more rows"
    with torch.device("meta"):
        engine_warm.warm_shape(ModelConfig.from_dict(shape_config("v2-lite")))
    engine = {args for key, args in kernel_configs if key == "gemv_rows._kernel"}
    missing = [args for args in query if args not in engine]
    assert not missing, missing


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_warm_unfused_covers_fusion_off(kernel_configs, q_lora):
    """``set_decode_fusion(False)`` (the debug path: k_pe's rope, the shared experts' own GEMVs, the routed
    experts' fused_moe without them): its decode steps and prefill chunks are covered by ``warm_shape(unfused=True)``
    (the default warm-up leaves them out)."""
    import engine_warm

    from deepinfer_core.engine.graph_runner import default_batch_sizes
    from deepinfer_core.models.config import ModelConfig

    raw = _mini(q_lora)
    used = _decode_configs(raw, default_batch_sizes(256), kernel_configs, fusion=False)
    used |= _prefill_configs(raw, CHUNKS, kernel_configs, fusion=False)
    used |= _prefill_configs(raw, [(5, 0), (40, 0)], kernel_configs, decodes=3, fusion=False)
    kernel_configs.clear()
    engine_warm.warm_shape(ModelConfig.from_dict(raw))
    assert used - set(kernel_configs), "the fusion-off path asks for nothing the default warm-up lacks"
    kernel_configs.clear()
    engine_warm.warm_shape(ModelConfig.from_dict(raw), unfused=True)
    missing = used - set(kernel_configs)
    assert not missing, sorted(missing, key=str)


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_warm_mtp_covers_lean_mtp(kernel_configs, q_lora):
    """DSpark's MTP draft (the mini model's last layer stands in for the MTP layer): its input projection
    (``eh_proj`` [C, 2C], as ``MTPSource._input`` runs it) and the lean decode path at draft steps and catch-up spans
    of 1..9, 64 and 256 rows ask for configurations the default warm-up lacks (the folded GEMMs, the rope over the
    query's and the key's parts at once) and ``warm_mtp`` adds."""
    import engine_warm

    from deepinfer_core.models.config import ModelConfig
    from plugins.dspark.lean import LeanDecoder, context_slot_table

    raw = _mini(q_lora)
    cfg = ModelConfig.from_dict(raw)
    model, kv = _model(raw)
    lean = LeanDecoder(None, [model.layers[-1]], model.cos_sin, cfg.rms_norm_eps)
    eh_proj = torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size, dtype=torch.bfloat16)
    kernel_configs.clear()
    with torch.inference_mode():
        for T in [*range(1, 10), 64, 256]:
            x = model.k.linear(torch.zeros(T, 2 * cfg.hidden_size, dtype=torch.bfloat16), eh_proj)
            ctx = context_slot_table(torch.zeros(T, 2, dtype=torch.int32), 64)
            lean.run_layers(x, torch.full((T,), 70), torch.full((T,), -1), ctx, kv["latent"][:1])
    used = set(kernel_configs)
    kernel_configs.clear()
    engine_warm.warm_shape(cfg)
    assert used - set(kernel_configs), "the MTP draft asks for nothing the default warm-up lacks"
    engine_warm.warm_mtp(cfg)
    missing = used - set(kernel_configs)
    assert not missing, ", ".join(sorted(map(str, missing)))


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_warm_pdl_covers_the_batch_one_chain(kernel_configs, monkeypatch, q_lora):
    """With ``DEEPINFER_PDL=1`` the decode steps of batches 1, 64 and 256 (the suite's) ask for the chain's
    programmatic-dependent-launch builds, which the default warm-up lacks and ``warm_pdl_b1`` adds; the
    environment is left as it was."""
    import os

    import engine_warm

    from deepinfer_core.models.config import ModelConfig

    raw = _mini(q_lora)
    cfg = ModelConfig.from_dict(raw)
    monkeypatch.setenv("DEEPINFER_PDL", "1")
    used = _decode_configs(raw, [1, 64, 256], kernel_configs)
    monkeypatch.delenv("DEEPINFER_PDL")
    pdl_keys = {key for key, args in used if any(a is True for a in args)}  # (the builders' pdl flag)
    assert {"norm_gemv._kernel", "mla_decode._decode_kernel", "mla_decode_uv._kernel", "moe_gate._kernel",
            "moe_gemv._up", "moe_gemv._down_slots", "gemv._kernel"} <= pdl_keys, pdl_keys
    kernel_configs.clear()
    engine_warm.warm_shape(cfg)
    assert used - set(kernel_configs), "the PDL builds are in the default warm-up"
    names = engine_warm.warm_pdl_b1(cfg)
    assert names and all(n.startswith("pdl ") for n in names)
    assert "DEEPINFER_PDL" not in os.environ
    missing = used - set(kernel_configs)
    assert not missing, ", ".join(sorted(map(str, missing)))
