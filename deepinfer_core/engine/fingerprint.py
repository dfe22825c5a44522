"""The stable id of a model's weights (KV-store keys, cached step-time curves, draft checks)."""

from __future__ import annotations

import hashlib

import torch


def model_fingerprint(model_dir, dtype: torch.dtype, load_format: str = "auto", seed: int = 0,
                      fp8_weights: bool = False) -> str:
    """Stable id of the weights the engine computes with: config.json (quantisation included), the
    dtype, whether FP8 weights stay FP8, and for ``load_format="random"`` the seed; else each
    shard's name, size, header and 64 KiB samples of its data at the start, middle and end. Content,
    not mtimes: copies of a checkpoint on other machines share a KV store. The KV store adds the
    cache layout (``KVLayout.for_model``)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    h.update(f"{dtype}|{load_format}".encode())
    if fp8_weights:  # other numerics than the dequantised weights: other KV
        h.update(b"|fp8-weights")
    if load_format == "random":
        h.update(f"|seed={seed}".encode())
        return h.hexdigest()[:16]
    sample = 1 << 16
    for shard in sorted(model_dir.glob("*.safetensors")):
        size = shard.stat().st_size
        h.update(f"|{shard.name}|{size}|".encode())
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(n))
            start = 8 + n
            for offset in (start, start + max(0, size - start - sample) // 2, max(start, size - sample)):
                f.seek(offset)
                h.update(f.read(sample))
    return h.hexdigest()[:16]
