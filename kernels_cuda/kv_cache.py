"""Paged KV-cache write (scatter rows into cache slots; slot -1 skips the token), in TileLang."""

import torch

from kernels_cuda import _tl


def build_kv_write(BS: int, D: int, dtype: str):
    T = _tl.language()
    NT, NB = T.dynamic("NT"), T.dynamic("NB")
    threads = 64

    @T.prim_func
    def paged_kv_write_kernel(
        Cache: T.Tensor((NB, BS, D), dtype),
        Slots: T.Tensor((NT,), "int64"),
        KV: T.Tensor((NT, D), dtype),
    ):
        with T.Kernel(NT, threads=threads) as t:
            slot = Slots[t]
            if slot >= 0:
                for d in T.Parallel(D):
                    Cache[slot // BS, slot % BS, d] = KV[t, d]

    return paged_kv_write_kernel


_kernel = _tl.kernel_cache(build_kv_write)


def paged_kv_write(cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    if kv.shape[0] == 0:
        return
    if not cache.is_contiguous():
        raise ValueError("paged_kv_write: the cache must be contiguous")
    NB, BS, D = cache.shape
    _kernel(BS, D, _tl.tl_dtype(cache.dtype))(
        cache, slot_mapping.to(torch.int64).contiguous(), kv.to(cache.dtype).reshape(-1, D).contiguous()
    )


def representative_kernels():
    return [("paged_kv_write bs64 D576", lambda: build_kv_write(64, 576, "bfloat16"))]
