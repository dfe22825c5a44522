"""MLA's cache entry in one launch (TileLang): RMSNorm of the latent, rope of the key's rope part, and the
paged cache write, for ``mla_kv_write``.

Unfused, a layer spends five launches on it at decode (rms_norm, rope, the concatenation, the cache
write, plus a copy of the strided rope slice), each 1-3 us of mostly idle device for 1 KB per token.
Here one CTA per token reads the kv_a row once (through strides: the model passes a column slice of
the fused q_a + kv_a projection), and writes the entry both to the returned tensor (prefill reads it)
and to its cache slot (slot -1: not written). Numerics are the reference's: float32 sum of squares,
``w * (x * rsqrt(mean + eps))`` rounded once, rope in float32 rounded once.
"""

import torch

from kernels_cuda import _tl
from kernels_cuda.norm import _threads


def build_mla_kv_write(L: int, R: int, BS: int, stride_t: int, dtype: str, table_dtype: str):
    T = _tl.language()
    NT, NB, P = T.dynamic("NT"), T.dynamic("NB"), T.dynamic("P")
    D = L + R
    half = R // 2
    threads = _threads(L)

    @T.prim_func
    def mla_kv_write_kernel(
        KV: T.StridedTensor((NT, D), (stride_t, 1), dtype),
        W: T.Tensor((L,), dtype),
        Pos: T.Tensor((NT,), "int64"),
        CS: T.Tensor((P, R), table_dtype),
        Cache: T.Tensor((NB, BS, D), dtype),
        Slots: T.Tensor((NT,), "int64"),
        Entry: T.Tensor((NT, D), dtype),
        eps: T.float32,
    ):
        with T.Kernel(NT, threads=threads) as t:
            x = T.alloc_fragment((1, L), "float32")
            sq = T.alloc_fragment((1, L), "float32")
            ss = T.alloc_fragment((1,), "float32")
            y = T.alloc_fragment((1, L), dtype)
            slot = Slots[t]
            p = Pos[t]
            for i, j in T.Parallel(1, L):
                x[i, j] = T.cast(KV[t, j], "float32")
            for i, j in T.Parallel(1, L):
                sq[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(1):
                ss[i] = T.rsqrt(ss[i] / L + eps)
            for i, j in T.Parallel(1, L):
                y[i, j] = T.cast(T.cast(W[j], "float32") * (x[i, j] * ss[i]), dtype)
            T.copy(y, Entry[t:t + 1, 0:L])
            if slot >= 0:
                for i, j in T.Parallel(1, L):
                    Cache[slot // BS, slot % BS, j] = y[i, j]
            for i in T.Parallel(half):
                x0 = T.cast(KV[t, L + 2 * i], "float32")
                x1 = T.cast(KV[t, L + 2 * i + 1], "float32")
                c = T.cast(CS[p, i], "float32")
                s = T.cast(CS[p, half + i], "float32")
                r0 = T.cast(x0 * c - x1 * s, dtype)
                r1 = T.cast(x0 * s + x1 * c, dtype)
                Entry[t, L + 2 * i] = r0
                Entry[t, L + 2 * i + 1] = r1
                if slot >= 0:
                    Cache[slot // BS, slot % BS, L + 2 * i] = r0
                    Cache[slot // BS, slot % BS, L + 2 * i + 1] = r1

    return mla_kv_write_kernel


_kernel = _tl.kernel_cache(build_mla_kv_write)


def _kernel_applies(kv_a: torch.Tensor, norm_w: torch.Tensor, cos_sin: torch.Tensor, cache) -> bool:
    if not isinstance(cache, torch.Tensor) or cache.dtype != kv_a.dtype or not cache.is_contiguous():
        return False  # cache planes or a quantised cache: the reference composition (the platform's write)
    if kv_a.dtype not in (torch.bfloat16, torch.float16) or kv_a.dim() != 2 or kv_a.stride(-1) != 1:
        return False
    if kv_a.data_ptr() % 16 or (kv_a.stride(0) * kv_a.element_size()) % 16:
        return False  # rows are read in vectors of up to 16 bytes
    L, R = norm_w.shape[0], kv_a.shape[1] - norm_w.shape[0]
    return (L % 32 == 0 and R > 0 and R % 2 == 0 and cache.shape[-1] == L + R and cos_sin.shape[-1] == R
            and cos_sin.dtype in (torch.float32, kv_a.dtype))


def mla_kv_write(kv_a: torch.Tensor, norm_w: torch.Tensor, eps: float, positions: torch.Tensor,
                 cos_sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    if not _kernel_applies(kv_a, norm_w, cos_sin, cache):
        from kernels_cpu import fused as ref

        return ref.mla_kv_write(kv_a, norm_w, eps, positions, cos_sin, cache, slot_mapping)
    NT, D = kv_a.shape
    L = norm_w.shape[0]
    entry = torch.empty(NT, D, dtype=kv_a.dtype, device=kv_a.device)
    if NT:
        kernel = _kernel(L, D - L, cache.shape[1], kv_a.stride(0), _tl.tl_dtype(kv_a.dtype),
                         _tl.tl_dtype(cos_sin.dtype))
        kernel(kv_a, norm_w.to(kv_a.dtype).contiguous(), positions.long().contiguous(), cos_sin.contiguous(), cache,
               slot_mapping.long().contiguous(), entry, float(eps))
    return entry


def representative_kernels():
    # V2-Lite: kv_a is the last 576 columns of the fused [q (16 x 192) | kv_a] projection output
    return [("mla_kv_write L512 R64 bs64 strided", lambda: build_mla_kv_write(512, 64, 64, 3648, "bfloat16",
                                                                               "float32"))]
