"""Rotary embedding and SiLU-gate in TileLang: one launch each instead of the reference's chain of
torch element-wise kernels (about ten for ``rope``, three for ``silu_and_mul``). At decode a layer
calls ``rope`` twice and ``silu_and_mul`` once or twice, and each launch costs 1-3 us even inside
a CUDA graph, so the launch count, not the bytes, is what these kernels save.

``rope`` reads its input through strides: the model passes ``q_pe`` / ``k_pe``, column slices of
the projection output, without a copy.
"""

import torch

from kernels_cuda import _tl


def build_rope(heads: int, dim: int, stride_t: int, stride_h: int, dtype: str, table_dtype: str,
               out_strides: tuple[int, int] | None = None):
    """``out_strides``: (token, head) strides of the output, a column slice of wider rows (None: contiguous)."""
    T = _tl.language()
    N = T.dynamic("N")
    P = T.dynamic("P")
    half = dim // 2
    y_type = T.Tensor((N, heads, dim), dtype) if out_strides is None else \
        T.StridedTensor((N, heads, dim), (*out_strides, 1), dtype)

    @T.prim_func
    def rope_kernel(
        X: T.StridedTensor((N, heads, dim), (stride_t, stride_h, 1), dtype),
        Pos: T.Tensor((N,), "int64"),
        CS: T.Tensor((P, dim), table_dtype),
        Y: y_type,
    ):
        with T.Kernel(N, threads=128) as t:
            p = Pos[t]
            for h, i in T.Parallel(heads, half):
                x0 = T.cast(X[t, h, 2 * i], "float32")
                x1 = T.cast(X[t, h, 2 * i + 1], "float32")
                c = T.cast(CS[p, i], "float32")
                s = T.cast(CS[p, half + i], "float32")
                Y[t, h, 2 * i] = T.cast(x0 * c - x1 * s, dtype)
                Y[t, h, 2 * i + 1] = T.cast(x0 * s + x1 * c, dtype)

    return rope_kernel


def _block(width: int) -> int:
    return next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if width % b == 0)


def build_silu_and_mul(width: int, dtype: str):
    T = _tl.language()
    N = T.dynamic("N")
    blk = _block(width)

    @T.prim_func
    def silu_and_mul_kernel(X: T.Tensor((N, 2 * width), dtype), Y: T.Tensor((N, width), dtype)):
        with T.Kernel(width // blk, N, threads=min(blk, 128)) as (bx, t):
            for j in T.Parallel(blk):
                g = T.cast(X[t, bx * blk + j], "float32")
                u = T.cast(X[t, width + bx * blk + j], "float32")
                # rounded to the activation dtype before the product, as torch's silu(g) * u is
                act = T.cast(T.cast(g / (1.0 + T.exp(-g)), dtype), "float32")
                Y[t, bx * blk + j] = T.cast(act * u, dtype)

    return silu_and_mul_kernel


_rope = _tl.kernel_cache(build_rope)
_silu = _tl.kernel_cache(build_silu_and_mul)


def _reference_needed(*ts: torch.Tensor) -> bool:
    return any(t.dtype not in (torch.bfloat16, torch.float16) for t in ts)


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, out: torch.Tensor | None = None
         ) -> torch.Tensor:
    """The registry's ``rope``. ``out`` (this backend's callers): written in place, e.g. the columns of a wider
    buffer, so that no copy follows (a unit last stride; x's shape and dtype)."""
    from kernels_cpu import ops as ref

    T_, H, D = x.shape
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(f"rope: out must be {tuple(x.shape)} {x.dtype} with a unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if _reference_needed(x) or x.stride(-1) != 1 or D % 2 or cos_sin.dtype not in (torch.float32, x.dtype):
        y = ref.rope(x, positions, cos_sin)
        return y if out is None else out.copy_(y)
    strided = out is not None and not out.is_contiguous()
    y = out if out is not None else torch.empty(T_, H, D, dtype=x.dtype, device=x.device)
    if T_:
        kernel = _rope(H, D, x.stride(0), x.stride(1), _tl.tl_dtype(x.dtype), _tl.tl_dtype(cos_sin.dtype),
                       *((tuple(y.stride()[:2]),) if strided else ()))
        kernel(x, positions.long().contiguous(), cos_sin.contiguous(), y)
    return y


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from kernels_cpu import ops as ref

    if _reference_needed(x) or x.dim() != 2 or x.shape[-1] % 2:
        return ref.silu_and_mul(x)
    x = x.contiguous()
    y = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _silu(x.shape[1] // 2, _tl.tl_dtype(x.dtype))(x, y)
    return y


def representative_kernels():
    return [
        ("rope H128 D64 strided (V3 q_pe)", lambda: build_rope(128, 64, 128 * 192, 192, "bfloat16", "float32")),
        ("rope H16 D64 into the wide query's columns (V2-Lite)",
         lambda: build_rope(16, 64, 16 * 192, 192, "bfloat16", "float32", (16 * 576, 576))),
        ("silu_and_mul I2048", lambda: build_silu_and_mul(2048, "bfloat16")),
    ]
