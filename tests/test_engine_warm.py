"""``examples/engine_warm.py`` compiles the kernels the engine's decode steps use (CPU, dry run: every kernel cache
of ``kernels_cuda`` is replaced by a recorder of its configuration, so nothing is traced or compiled).

The configurations the warm-up asks for must include every one a decode step of the real model asks for, with and
without q_lora (the query is then q_b's own output, else a strided slice of the fused q + kv_a projection: the
GEMV kernels compile per stride).
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


def _decode_configs(raw: dict, batches: list[int], asked: list) -> set:
    from deepinfer_core.engine.graph_runner import DecodeGraphs
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.loader import build_model
    from kernels_cpu import ReferenceKernels
    from kernels_cuda import CudaKernels

    cfg = ModelConfig.from_dict(raw)
    model = build_model(Kernels(CudaKernels, ReferenceKernels), cfg, torch.bfloat16, torch.device("cpu"), 1024)
    model.post_load()
    kv = [torch.zeros(4, 64, cfg.kv_entry_dim, dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
    graphs = DecodeGraphs(model, {"latent": kv}, batches, 1024 // 64, torch.device("cpu"), capture=False)
    asked.clear()
    with torch.inference_mode():
        for B in batches:
            graphs._forward(B)
    return set(asked)


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_warm_covers_decode_kernels(kernel_configs, q_lora):
    """Decode batches 1..8 (the GEMVs' row buckets, the fused decode query) of the model: each kernel
    configuration is one the warm-up compiles."""
    import engine_warm

    from deepinfer_core.models.config import ModelConfig

    raw = _mini(q_lora)
    used = _decode_configs(raw, [1, 2, 4, 8], kernel_configs)
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


@pytest.mark.parametrize("shape", ["v2-lite", "v3-slice"])
def test_warm_real_shapes(kernel_configs, shape):
    """The full-size shapes (on the meta device: no memory) build every input; the decode query has the model's
    strides: V3's q_b output is contiguous, V2-Lite's q is a slice of the fused q + kv_a projection's rows."""
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
