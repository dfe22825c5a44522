"""MXFP8 quantisation of window KV snapshots in TileLang (semantics: ``kernels_cpu/mxfp8.py``).

One thread per 32-value block: it finds the block's finite amax, derives the ue8m0 exponent from the
float's bits (``ceil(log2(a))`` = the biased exponent, plus one when any mantissa bit is set: exact,
as the reference's ``frexp``), scales by the exact power of two and converts with the hardware's
round-to-nearest-even e4m3 conversion (values are clamped to +-448 first, so +-inf saturates; a NaN
is converted as a positive NaN, 0x7F). The packed row [D e4m3 | D/32 scales] is written in place
through two strided views of one uint8 buffer. A snapshot is 43 layers x 128 tokens x 512 values for
V4-Flash: a few microseconds, so the kernel favours exactness over coalescing.
"""


import torch

from kernels_cuda import _tl

BLOCK = 32
THREADS = 128
_FLOAT_MAX = 3.4028234663852886e38


def build_mxfp8_quant(D: int, in_dtype: str):
    T = _tl.language()
    N = T.dynamic("N")
    NB = D // BLOCK
    W = D + NB

    @T.prim_func
    def mxfp8_quant_kernel(X: T.Tensor((N, D), in_dtype), Q: T.StridedTensor((N, D), (W, 1), "float8_e4m3"),
                           S: T.StridedTensor((N, NB), (W, 1), "uint8")):
        with T.Kernel(T.ceildiv(N * NB, THREADS), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            blk = bx * THREADS + tx
            if blk < N * NB:
                row = blk // NB
                col = (blk % NB) * BLOCK
                amax = T.alloc_var("float32", 0.0)
                for i in T.serial(BLOCK):
                    a = T.abs(T.cast(X[row, col + i], "float32"))
                    amax = T.max(amax, T.if_then_else(a <= _FLOAT_MAX, a, T.float32(0.0)))  # finite only
                r = T.max(amax, T.float32(1e-4)) / T.float32(448.0)
                bits = T.reinterpret("int32", r)
                e = ((bits >> 23) & 0xFF) - 127 + T.if_then_else((bits & 0x7FFFFF) != 0, 1, 0)
                e = T.min(T.max(e, -127), 127)
                inv = T.reinterpret("float32", (127 - e) << 23)  # 2**-e, exact (e >= -22 after the floor)
                S[row, col // BLOCK] = T.cast(e + 127, "uint8")
                for i in T.serial(BLOCK):
                    x = T.cast(X[row, col + i], "float32")
                    y = T.min(T.max(x * inv, T.float32(-448.0)), T.float32(448.0))
                    # NaN from the bits (the simplifier folds x != x to false): a positive quiet NaN
                    nan = (T.reinterpret("int32", x) & 0x7FFFFFFF) > 0x7F800000
                    Q[row, col + i] = T.cast(T.if_then_else(nan, T.reinterpret("float32", T.int32(0x7FC00000)), y),
                                             "float8_e4m3")

    return mxfp8_quant_kernel


def build_mxfp8_dequant(D: int, out_dtype: str):
    T = _tl.language()
    N = T.dynamic("N")
    NB = D // BLOCK
    W = D + NB

    @T.prim_func
    def mxfp8_dequant_kernel(Q: T.StridedTensor((N, D), (W, 1), "float8_e4m3"),
                             S: T.StridedTensor((N, NB), (W, 1), "uint8"), Y: T.Tensor((N, D), out_dtype)):
        with T.Kernel(T.ceildiv(N * D, THREADS), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            i = bx * THREADS + tx
            if i < N * D:
                row = i // D
                col = i % D
                scale = T.reinterpret("float32", T.cast(S[row, col // BLOCK], "int32") << 23)  # 2**(s - 127)
                Y[row, col] = T.cast(T.cast(Q[row, col], "float32") * scale, out_dtype)

    return mxfp8_dequant_kernel


def build_ue8m0_scale():
    T = _tl.language()
    N = T.dynamic("N")

    @T.prim_func
    def ue8m0_kernel(A: T.Tensor((N,), "float32"), S: T.Tensor((N,), "uint8")):
        with T.Kernel(T.ceildiv(N, THREADS), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            i = bx * THREADS + tx
            if i < N:
                r = T.max(A[i], T.float32(1e-4)) / T.float32(448.0)
                bits = T.reinterpret("int32", r)
                e = ((bits >> 23) & 0xFF) - 127 + T.if_then_else((bits & 0x7FFFFF) != 0, 1, 0)
                S[i] = T.cast(T.min(T.max(e, -127), 127) + 127, "uint8")

    return ue8m0_kernel


_quant = _tl.kernel_cache(build_mxfp8_quant)
_dequant = _tl.kernel_cache(build_mxfp8_dequant)
_ue8m0 = _tl.kernel_cache(build_ue8m0_scale)


def _on_cuda(*ts: torch.Tensor) -> bool:
    """On the GPU, or compiling only (``DEEPINFER_TL_DRYRUN``: the kernels are built, not run)."""
    return all(t.is_cuda for t in ts) or _tl.dry_run()


def mxfp8_quant(x: torch.Tensor) -> torch.Tensor:
    from kernels_cpu import mxfp8 as ref

    if not _on_cuda(x) or x.dim() != 2 or x.shape[-1] % BLOCK or x.dtype not in (torch.bfloat16, torch.float16,
                                                                                   torch.float32):
        return ref.mxfp8_quant(x)
    N, D = x.shape
    packed = torch.empty(N, D + D // BLOCK, dtype=torch.uint8, device=x.device)
    if N:
        _quant(D, _tl.tl_dtype(x.dtype))(x.contiguous(), packed[:, :D].view(torch.float8_e4m3fn), packed[:, D:])
    return packed


def mxfp8_dequant(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from kernels_cpu import mxfp8 as ref

    N, W = packed.shape
    D = W * BLOCK // (BLOCK + 1)
    if (not _on_cuda(packed) or packed.dtype != torch.uint8 or D + D // BLOCK != W or D % BLOCK
            or dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        return ref.mxfp8_dequant(packed, dtype)
    packed = packed.contiguous()
    y = torch.empty(N, D, dtype=dtype, device=packed.device)
    if N:
        _dequant(D, _tl.tl_dtype(dtype))(packed[:, :D].view(torch.float8_e4m3fn), packed[:, D:], y)
    return y


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    from kernels_cpu import mxfp8 as ref

    if not _on_cuda(amax):
        return ref.ue8m0_scale(amax)
    flat = amax.float().reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=torch.uint8, device=amax.device)
    if flat.numel():
        _ue8m0()(flat, out)
    return out.reshape(amax.shape)


def representative_kernels():
    return [
        ("mxfp8_quant D512 bf16 (V4-Flash window KV)", lambda: build_mxfp8_quant(512, "bfloat16")),
        ("mxfp8_dequant D512 bf16", lambda: build_mxfp8_dequant(512, "bfloat16")),
        ("ue8m0_scale", build_ue8m0_scale),
    ]
