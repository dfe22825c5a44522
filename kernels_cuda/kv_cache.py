"""Paged KV-cache write (scatter rows into cache slots; slot -1 skips the token), in TileLang.

A uint8 cache holds FP8 latent rows (``kv_cache_dtype = "fp8"``; layout and rules in
``kernels_cpu/kv_fp8.py``): :func:`build_kv_write_fp8` quantises while it scatters. One CTA per token;
thread g < G owns latent tile g (its finite amax, the exact ue8m0 exponent from the float's bits as in
``kernels_cuda/mxfp8.py``, then e4m3 with the hardware's round-to-nearest-even conversion after clamping
to +-448); the first R threads copy the rope key as bfloat16. The row is written through three strided
views of the cache's bytes (e4m3 latent, float32 scales, bfloat16 rope). A decode step writes a few
hundred rows per layer, so the kernel favours exactness over coalescing.
"""

import torch

from kernels_cuda import _tl

TILE = 128
FP8_THREADS = 128
_FLOAT_MAX = 3.4028234663852886e38


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


def build_kv_write_fp8(L: int, R: int, W: int, dtype: str):
    """Quantise kv[NT, L + R] into FP8 latent rows of W bytes at the flat slots (NS = all slots)."""
    T = _tl.language()
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    G = -(-L // TILE)
    assert G <= FP8_THREADS and W % 4 == 0 and L % 4 == 0

    @T.prim_func
    def paged_kv_write_fp8_kernel(
        Lat: T.StridedTensor((NS, L), (W, 1), "float8_e4m3"),
        Scales: T.StridedTensor((NS, G), (W // 4, 1), "float32"),
        Rope: T.StridedTensor((NS, R), (W // 2, 1), "bfloat16"),
        Slots: T.Tensor((NT,), "int64"),
        KV: T.Tensor((NT, L + R), dtype),
    ):
        with T.Kernel(NT, threads=FP8_THREADS) as t:
            tx = T.get_thread_binding()
            slot = Slots[t]
            if slot >= 0:
                if tx < G:
                    n = T.min(TILE, L - tx * TILE)
                    amax = T.alloc_var("float32", 0.0)
                    for i in T.serial(n):
                        a = T.abs(T.cast(KV[t, tx * TILE + i], "float32"))
                        amax = T.max(amax, T.if_then_else(a <= _FLOAT_MAX, a, T.float32(0.0)))  # finite only
                    r = T.max(amax, T.float32(1e-4)) / T.float32(448.0)
                    bits = T.reinterpret("int32", r)
                    e = ((bits >> 23) & 0xFF) - 127 + T.if_then_else((bits & 0x7FFFFF) != 0, 1, 0)
                    e = T.min(T.max(e, -127), 127)
                    inv = T.reinterpret("float32", (127 - e) << 23)  # 2**-e, exact
                    Scales[slot, tx] = T.reinterpret("float32", (e + 127) << 23)
                    for i in T.serial(n):
                        x = T.cast(KV[t, tx * TILE + i], "float32")
                        y = T.min(T.max(x * inv, T.float32(-448.0)), T.float32(448.0))
                        nan = (T.reinterpret("int32", x) & 0x7FFFFFFF) > 0x7F800000  # from the bits, see mxfp8.py
                        Lat[slot, tx * TILE + i] = T.cast(
                            T.if_then_else(nan, T.reinterpret("float32", T.int32(0x7FC00000)), y), "float8_e4m3")
                for k in T.serial(-(-R // FP8_THREADS)):
                    c = k * FP8_THREADS + tx
                    if c < R:
                        Rope[slot, c] = T.cast(KV[t, L + c], "bfloat16")

    return paged_kv_write_fp8_kernel


_kernel = _tl.kernel_cache(build_kv_write)
_fp8_kernel = _tl.kernel_cache(build_kv_write_fp8)


def fp8_row_views(cache: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The e4m3 latent [NS, L], float32 scales [NS, G] and bf16 rope [NS, R] views of a uint8 cache's rows."""
    W = cache.shape[-1]
    G = -(-L // TILE)
    rows = cache.view(-1, W)
    return (rows[:, :L].view(torch.float8_e4m3fn), rows.view(torch.float32)[:, L // 4:L // 4 + G],
            rows.view(torch.bfloat16)[:, (L + 4 * G) // 2:])


def paged_kv_write(cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    if kv.shape[0] == 0:
        return
    if not cache.is_contiguous():
        raise ValueError("paged_kv_write: the cache must be contiguous")
    if cache.dtype == torch.uint8 and kv.is_floating_point():  # FP8 latent rows (kernels_cpu/kv_fp8.py)
        from kernels_cpu.kv_fp8 import latent_dims

        D = kv.shape[-1]
        L, R = latent_dims(D, cache.shape[-1])
        lat, scales, rope = fp8_row_views(cache, L)
        dtype = kv.dtype if kv.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        _fp8_kernel(L, R, cache.shape[-1], _tl.tl_dtype(dtype))(
            lat, scales, rope, slot_mapping.to(torch.int64).contiguous(), kv.to(dtype).reshape(-1, D).contiguous())
        return
    NB, BS, D = cache.shape
    _kernel(BS, D, _tl.tl_dtype(cache.dtype))(
        cache, slot_mapping.to(torch.int64).contiguous(), kv.to(cache.dtype).reshape(-1, D).contiguous()
    )


def representative_kernels():
    return [("paged_kv_write bs64 D576", lambda: build_kv_write(64, 576, "bfloat16")),
            ("paged_kv_write fp8 rows L512 R64 (656 bytes)", lambda: build_kv_write_fp8(512, 64, 656, "bfloat16"))]
