"""Kernel launches per decode layer of the CUDA backend, counted without a GPU: the model is built with the
TileLang ops in dry-run mode (``DEEPINFER_TL_DRYRUN=1``: kernels compile into ``TILELANG_CACHE_DIR`` and are
not run) on CPU tensors, and one decode step is traced: every TileLang kernel call, and every torch op that
launches a device kernel (``TorchDispatchMode``; views, allocations and metadata ops launch none). On the
GPU, cuBLAS may add a split-K reduction kernel to a GEMM, so this is a lower bound for those.

    DEEPINFER_TL_DRYRUN=1 TILELANG_CACHE_DIR=... python examples/launch_count.py --shape v2-lite --batch 1

Prints the launches of the dense layer, of one MoE layer, and of the rest of the step (embedding, final
norm, LM head), fused (``decode_fusion`` on) and unfused, with the ops of a MoE layer in order.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: aten ops that launch no kernel on a CUDA device
NO_KERNEL = {"view", "_unsafe_view", "slice", "split", "split_with_sizes", "select", "expand", "t", "transpose",
             "permute", "as_strided", "empty", "empty_strided", "empty_like", "detach", "alias", "unsqueeze",
             "squeeze", "reshape", "unbind", "narrow", "lift_fresh", "_reshape_alias", "new_empty"}

#: aten ops that launch a kernel only when they copy (their result is a new tensor)
MAYBE_COPY = {"to", "contiguous", "reshape", "_to_copy"}


class Launches(TorchDispatchMode):
    """Records (layer, op) for every kernel-launching torch op and (through ``tl_launch``) TileLang call."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = "other"
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        out = func(*args, **(kwargs or {}))
        if name in MAYBE_COPY and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor) \
                and out.data_ptr() == args[0].data_ptr():
            return out  # no conversion or copy was needed: no kernel
        if name not in NO_KERNEL:
            self.ops.append((self.layer, name))
        return out

    def tl_launch(self, name: str) -> None:
        self.ops.append((self.layer, f"tilelang:{name}"))


def count(shape: str, batch: int, fused: bool) -> tuple[Counter, list[str]]:
    import json

    from random_checkpoint import shape_config

    from deepinfer_core.engine.graph_runner import DecodeGraphs
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.deepseek import MoE
    from deepinfer_core.models.loader import EMBEDDED_MODEL, build_model
    from kernels_cpu import ReferenceKernels
    from kernels_cuda import CudaKernels, _tl

    raw = json.loads((EMBEDDED_MODEL / "config.json").read_text()) if shape == "default" else shape_config(shape)
    raw.update(num_hidden_layers=raw.get("first_k_dense_replace", 1) + 1)  # the dense layer(s) and one MoE layer
    cfg = ModelConfig.from_dict(raw)
    model = build_model(Kernels(CudaKernels, ReferenceKernels), cfg, torch.bfloat16, torch.device("cpu"), 4096)
    model.post_load()
    model.set_decode_fusion(fused)
    bs = 64
    kv = [torch.zeros(4, bs, cfg.kv_entry_dim, dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
    graphs = DecodeGraphs(model, {"latent": kv}, [batch], 4096 // bs + 1, torch.device("cpu"), capture=False)
    mode = Launches()
    for layer_i, layer in enumerate(model.layers):
        kind = "moe" if isinstance(layer.mlp, MoE) else "dense"

        def enter(_m, _a, name=f"layer {layer_i} ({kind})"):
            mode.layer = name

        def leave(_m, _a, _o):
            mode.layer = "other"

        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    with torch.inference_mode():
        graphs._forward(batch)  # once untraced: what ops make on their first call (moe_gate's counters) is not a step's
    _tl.dry_launch_hook = mode.tl_launch
    try:
        with torch.inference_mode(), mode:
            graphs._forward(batch)
    finally:
        _tl.dry_launch_hook = None
    per_layer = Counter(layer for layer, _ in mode.ops)
    moe_ops = [op for layer, op in mode.ops if layer.endswith("(moe)")]
    return per_layer, moe_ops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite", help="a random_checkpoint shape, or 'default' (the embedded model)")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    if os.environ.get("DEEPINFER_TL_DRYRUN", "") in ("", "0"):
        raise SystemExit("launch_count.py traces dry-run kernels: set DEEPINFER_TL_DRYRUN=1 (and TILELANG_CACHE_DIR)")
    for fused in (False, True):
        per_layer, moe_ops = count(args.shape, args.batch, fused)
        print(f"{args.shape} decode batch {args.batch}, decode_fusion={'on' if fused else 'off'}: "
              + ", ".join(f"{k}: {v}" for k, v in sorted(per_layer.items())), flush=True)
        print(f"  MoE layer ops: {' '.join(moe_ops)}", flush=True)


if __name__ == "__main__":
    main()
