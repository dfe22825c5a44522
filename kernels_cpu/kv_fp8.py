"""The FP8 latent KV row of MLA (``kv_cache_dtype = "fp8"``): the reference, and its exact rules.

**Layout** (FlashMLA's ``V32_FP8Sparse`` row, also vLLM's ``fp8_ds_mla``), per token and layer, for
a latent of L values (``kv_lora_rank``, a multiple of 16) and a rope key of R values, G = ceil(L/128):

====================  ===========  ===================================================
bytes                 what         encoding
====================  ===========  ===================================================
``[0, L)``            latent       float8 e4m3fn, ``latent[i] / scale[i // 128]``
``[L, L + 4G)``       scales       float32, one per 128-value tile (a power of two)
``[L + 4G, W)``       rope key     bfloat16, unquantised (``W = L + 4G + 2R``)
====================  ===========  ===================================================

DeepSeek V2/V3 (L = 512, R = 64): 512 + 16 + 128 = **656 bytes** per token and layer against 1152 in
bfloat16 (0.57x). The embedded tiny model (L = 64, R = 16): 64 + 4 + 32 = 100 bytes.

Why this layout: it is the one FlashMLA's FP8 decode kernels read, so a future FlashMLA (or a
peer's KV dump) reads our bytes as they are; the rope key stays bfloat16 because it carries the
position signal in only 64 values (quantising it costs accuracy for 64 of 656 bytes); a 128-value
tile keeps the scale overhead at 4 bytes per 128 (3%) and matches the 128-wide blocks of the FP8
GEMMs. Row-major per token, so a block of the cache is ``[block_size, W]`` bytes and the paged
machinery (block tables, prefix cache, host and 3FS tiers, P/D hand-off) moves rows as opaque bytes.

**Scale rule**: per tile, ``amax`` = the largest *finite* ``|x|`` (NaN and infinities ignored), and the
scale is the power of two ``2**ceil(log2(max(amax, 1e-4) / 448))`` (the ue8m0 rule of
``kernels_cpu.mxfp8.ue8m0_scale``, stored as its float32 value, as FlashMLA stores its ue8m0-rounded
scales). Rounding the exponent up keeps ``|x| / scale <= 448``: finite values never saturate, and
dequantisation (``e4m3 * scale``) is exact in bfloat16 and float32, so a kernel that dequantises
into bfloat16 tiles sees exactly the reference's keys.

**Elements**: ``x / scale`` rounded to the nearest e4m3fn value (ties to even). ``+-inf`` saturates to
``+-448 * scale``; NaN stays NaN (byte 0x7F), so a NaN latent poisons its own request exactly as it
would in a bfloat16 cache; an all-zero tile gets the smallest scale and zero bytes.
"""

from __future__ import annotations

import torch

from kernels_cpu.mxfp8 import E4M3_MAX, NAN_BYTE, _scale_of, ue8m0_scale

TILE = 128
#: the name every fingerprint and layout signature records for rows in this layout (kv_cache_spec)
ENCODING = "fp8_ds_mla"


def row_bytes(latent: int, rope: int) -> int:
    """Bytes of one token's row: L e4m3 bytes, a float32 scale per 128-value tile, R bfloat16 values."""
    return latent + 4 * -(-latent // TILE) + 2 * rope


def latent_dims(values: int, width: int) -> tuple[int, int]:
    """(L, R) of rows of ``width`` bytes that hold ``values`` = L + R values. Unique for L a multiple of
    16 (``row_bytes`` then grows with L at fixed L + R); anything else is an error naming both."""
    for latent in range(16, values + 1, 16):
        if row_bytes(latent, values - latent) == width:
            return latent, values - latent
    raise ValueError(f"an FP8 latent KV row of {width} bytes cannot hold {values} values (L + R) for a latent "
                     f"width L that is a multiple of 16 (row = L + 4 * ceil(L / 128) + 2 * R bytes)")


def quantize_latent_rows(kv: torch.Tensor, width: int) -> torch.Tensor:
    """kv[T, L + R] (any float dtype) -> rows[T, width] uint8 in the layout above."""
    T, D = kv.shape
    L, R = latent_dims(D, width)
    G = -(-L // TILE)
    x = kv[:, :L].float()
    x = torch.nn.functional.pad(x, (0, G * TILE - L)).view(T, G, TILE)
    amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype)).amax(-1)  # [T, G]
    scale = _scale_of(ue8m0_scale(amax))  # powers of two, float32
    y = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)  # inf -> +-448; NaN stays NaN
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(torch.isnan(x), torch.full((), NAN_BYTE, dtype=torch.uint8), q)
    rows = torch.empty(T, width, dtype=torch.uint8, device=kv.device)
    rows[:, :L] = q.reshape(T, G * TILE)[:, :L]
    rows[:, L:L + 4 * G] = scale.contiguous().view(torch.uint8).reshape(T, 4 * G)
    rows[:, L + 4 * G:] = kv[:, L:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(T, 2 * R)
    return rows


def dequantize_latent_rows(rows: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
    """rows[..., W] uint8 -> [..., values] of ``dtype``: the latent (e4m3 * tile scale) then the rope key."""
    lead, W = rows.shape[:-1], rows.shape[-1]
    L, R = latent_dims(values, W)
    G = -(-L // TILE)
    flat = rows.reshape(-1, W)
    q = flat[:, :L].contiguous().view(torch.float8_e4m3fn).float()
    scale = flat[:, L:L + 4 * G].contiguous().view(torch.float32)  # [N, G]
    latent = q * scale.repeat_interleave(TILE, dim=-1)[:, :L]
    rope = flat[:, L + 4 * G:].contiguous().view(torch.bfloat16).float()
    return torch.cat((latent, rope), dim=-1).to(dtype).reshape(*lead, values)


def latent_kv_dequant(rows: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
    """The op: rows[S, W] uint8 (FP8 latent rows, e.g. ``paged_kv_gather``'s output) -> [S, values]."""
    return dequantize_latent_rows(rows, values, dtype)
