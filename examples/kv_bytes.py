#!/usr/bin/env python
"""KV-cache bytes of DeepSeek-V4-Flash (its real config shape, through DeepInfer's ``cache_layout``)
against DeepSeek-V3, per token per cache group, and the number of concurrent long requests one GiB of
KV memory holds. No weights are built.

Per request a FULL group holds ``ceil(L / block)`` blocks; a WINDOW group holds
``KVCacheSpec.max_blocks_per_request`` blocks (window + one decode token, block-aligned) however long the
request, so small-window groups pay whole blocks.

Usage::

    python examples/kv_bytes.py [--tokens 32768] [--block-size 128] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch

from deepinfer_core.models.config_v4 import V4Config
from deepinfer_core.models.deepseek_v4 import cache_layout

GiB = 1 << 30

#: DeepSeek-V4-Flash's config.json fields that shape the cache (``../shared/V4.md`` table)
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "sliding_window": 128, "hc_mult": 4, "num_hash_layers": 3, "compress_rate_csa": 4, "compress_rate_hca": 128,
    # 2 SWA-only layers, then CSA/HCA alternating (21 CSA, 20 HCA), plus the MTP layer's 0
    "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
}
#: DeepSeek-V3: one latent group, 61 layers x (kv_lora 512 + rope 64) values per token
V3_LAYERS, V3_ENTRY = 61, 512 + 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="request length for the concurrency figure")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", help="the model's activation (KV) dtype")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    L, bs = args.tokens, args.block_size
    layout = cache_layout(V4Config.from_dict(FLASH))
    layout.check_block_size(bs)

    print(f"DeepSeek-V4-Flash cache groups ({args.dtype} KV, {bs}-token blocks), one request of {L:,} tokens:")
    print(f"{'group':<10} {'layers':>6} {'entry':>6} {'tok/entry':>9} {'window':>6} {'dtype':>8} "
          f"{'B/token':>10} {'blocks':>7} {'MiB/request':>12}")
    total = 0
    for g in layout.groups:
        if g.window is None:
            blocks = -(-L // bs)
        else:
            blocks = g.max_blocks_per_request(bs, L, max_step_tokens=1)
        size = blocks * g.block_bytes(bs, dtype)
        total += size
        print(f"{g.name:<10} {len(g.layers):>6} {g.entry_dim:>6} {g.tokens_per_entry:>9} {g.window or '-':>6} "
              f"{str(g.dtype or dtype).removeprefix('torch.'):>8} {g.bytes_per_token(dtype):>10,.0f} "
              f"{blocks:>7} {size / 2**20:>12.2f}")
    full = sum(g.bytes_per_token(dtype) for g in layout.groups if g.window is None)
    v3_per_token = V3_LAYERS * V3_ENTRY * dtype.itemsize
    v3_request = v3_per_token * L
    print(f"\nlong-range (FULL groups): {full:,.0f} B/token; V3: {v3_per_token:,} B/token "
          f"({v3_per_token / full:.1f}x more)")
    print(f"per {L:,}-token request: V4-Flash {total / 2**20:,.1f} MiB (FULL groups "
          f"{full * L / 2**20:,.1f} MiB + window groups {(total - full * L) / 2**20:,.1f} MiB), "
          f"V3 {v3_request / 2**20:,.1f} MiB")
    print(f"concurrent {L:,}-token requests per GiB of KV: V4-Flash {GiB / total:.2f}, V3 {GiB / v3_request:.3f} "
          f"({v3_request / total:.1f}x)")


if __name__ == "__main__":
    main()
