"""The KV cache a model declares (``CausalLM.cache_layout()``): bytes per token per group, and how many
requests of a given length fit in a GiB of KV memory. Any registered architecture; no weights are read.

    python examples/kv_layout.py --shape v3                      # a random_checkpoint.py shape
    python examples/kv_layout.py --model DIR [DIR ...] --tokens 32768 --block-size 256
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import SHAPES, shape_config  # noqa: E402

from deepinfer_core.engine.kv_cache_manager import pool_specs  # noqa: E402
from deepinfer_core.kernels import Kernels  # noqa: E402
from deepinfer_core.models.registry import parse_config  # noqa: E402
from kernels_cpu import ReferenceKernels  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: full-size published shapes (config.json fields), besides random_checkpoint.py's small ones
FULL = {
    "v3-671b": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
                    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                    num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                    num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
                    max_position_embeddings=163840),
}


def layout_of(raw: dict):
    """(config, CacheLayout) of a config.json dict, the model built on the meta device."""
    cls, cfg = parse_config(raw)
    k = Kernels(ReferenceKernels, ReferenceKernels)
    model = cls.create(k, cfg, torch.bfloat16, torch.device("meta"), min(cfg.max_position_embeddings, 1 << 20))
    return cfg, model.cache_layout()


def report(name: str, raw: dict, tokens: int, block_size: int, dtype: torch.dtype, step_tokens: int) -> dict:
    cfg, layout = layout_of(raw)
    bs = math.lcm(block_size, layout.block_size_multiple)
    groups = {g.name: {"layers": len(g.layers), "entry_dim": g.entry_dim, "tokens_per_entry": g.tokens_per_entry,
                       "window": g.window, "bytes_per_token": g.bytes_per_token(dtype)} for g in layout.groups}
    per_request = 0  # bytes one request of ``tokens`` tokens holds at its peak
    for p in pool_specs(layout):
        need = min(-(-tokens // bs), p.max_blocks_per_request(bs, tokens + step_tokens, step_tokens))
        per_request += need * p.block_bytes(bs, dtype)
    long_range = sum(g["bytes_per_token"] for g in groups.values() if g["window"] is None)
    return {"model": name, "architecture": cfg.architecture, "block_size": bs, "groups": groups,
            "full_bytes_per_token": long_range, "request_bytes": per_request,
            "requests_per_gib": (1 << 30) / per_request}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="*", default=[], help="checkpoint dirs (config.json is read)")
    ap.add_argument("--shape", nargs="*", default=[], choices=sorted({*SHAPES, *FULL}))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--step-tokens", type=int, default=8192, help="max_num_batched_tokens (window headroom)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory():
        for d in args.model:
            rows.append(report(d, json.loads((Path(d) / "config.json").read_text()), args.tokens, args.block_size,
                               DTYPES[args.dtype], args.step_tokens))
        for s in args.shape or ([] if args.model else ["v3-671b"]):
            raw = FULL[s] if s in FULL else shape_config(s)
            rows.append(report(s, raw, args.tokens, args.block_size, DTYPES[args.dtype],
                               args.step_tokens))
    for r in rows:
        print(f"{r['model']} ({r['architecture']}), block {r['block_size']}, {args.dtype}:")
        for name, g in r["groups"].items():
            win = f"window {g['window']}" if g["window"] else "full"
            print(f"  {name:10s} {g['layers']:3d} layers x {g['entry_dim']:5d} / {g['tokens_per_entry']:3d} tokens, "
                  f"{win:11s} {g['bytes_per_token']:10.1f} B/token")
        print(f"  long-range {r['full_bytes_per_token']:.0f} B/token; a {args.tokens}-token request holds "
              f"{r['request_bytes'] / 2**20:.1f} MiB: {r['requests_per_gib']:.2f} requests per GiB")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
