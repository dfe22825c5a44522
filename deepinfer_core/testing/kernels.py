"""Kernel-backend conformance: every op a backend overrides against the reference (``kernels_cpu``).

For each overridden op this generates random but realistic inputs (paged caches with shuffled block
tables and garbage in unused table columns, ragged decode queries, cached prefixes, remote experts,
seeded sampling rows, ...), runs the backend's op on ``device`` and compares the result with the
reference computed in float32 on the CPU from the same (already rounded) inputs:

* floating outputs: ``|out - ref| <= rtol * (|ref| + rms(ref))`` with ``rtol`` from
  :data:`TOLERANCES` (float32 1e-4, bfloat16 2e-2, float16 5e-3); ``fused_moe_fp8``, which re-quantises
  its hidden to e4m3, norm-wise: ``||out - ref|| <= rtol * ||ref||``;
* cache writes (FP8 latent rows included: a uint8 cache, ``kernels_cpu/kv_fp8.py``) and gathers, MXFP8
  quantisation, dequantisation and ue8m0 scales: bit-exact;
* ``moe_route``: the same expert set per token (inputs are drawn with a clear margin between the
  k-th and (k+1)-th choice, so this is well posed), weights within tolerance;
* ``moe_route_v4``, ``moe_gate`` (the router from the activations, shared experts appended) and
  ``add_rms_norm_moe_gate`` (the same behind the norm; normed row and residual as values) likewise;
  ``v4_indexer_topk``: the same set of entry ids per token (inputs drawn with a clear margin at the
  top-k boundary);
* ``sample``: bit-exact token ids, greedy and seeded rows alike (the counter-based RNG in
  ``kernels_cpu.rng`` gives every backend the same uniforms for a (seed, offset)), and a row's
  token must not change when it is sampled alone.

A mismatch raises AssertionError naming the op, the dtype, the case and the largest error.

Cache layout: ``planes`` (a platform's ``kv_cache_planes``) stores the latent caches that
``paged_kv_write``, ``paged_kv_gather`` and ``mla_decode`` take as that platform's planes; the kit's
cache entries declare the parts ``(D - 8, 8)`` (latent, rope key), and writes are compared on the
joined planes.

Input conventions (those of ``deepinfer_core.models.metadata``): ``block_tables`` int32,
``seq_lens``/``cu_q_lens``/``cu_k_lens``/``slot_mapping``/``positions`` int64, ``moe_route`` and
``sample``/``apply_penalties`` logits float32, ``fused_moe`` weights in the activation dtype.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from deepinfer_core.kernels import OP_NAMES, KernelBackend, import_path
from deepinfer_core.kv_cache_spec import KVCacheSpec, LayerCache, cache_planes
from deepinfer_core.testing.kernel_cases import CASES
from deepinfer_core.version import check_api_version

#: Relative tolerance per activation dtype.
TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
#: Ops whose inputs have one dtype whatever the model's activation dtype (the engine calls them so).
FIXED_DTYPE_OPS: dict[str, torch.dtype] = {
    "moe_route": torch.float32,
    "apply_penalties": torch.float32,
    "sample": torch.float32,
    "logsumexp": torch.float32,
    "greedy_sample": torch.float32,
    "draft_lengths": torch.float32,
    "moe_route_v4": torch.float32,
    "v4_compress": torch.float32,  # the compressor state is float32 whatever the model dtype
    "ue8m0_scale": torch.float32,
}




def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reference_fn(op: str) -> Callable:
    from kernels_cpu import ReferenceKernels

    return import_path(ReferenceKernels.ops[op])



_EXACT_OPS = {"paged_kv_write", "paged_kv_gather", "ue8m0_scale", "mxfp8_quant", "mxfp8_dequant", "latent_kv_dequant"}
#: ops whose reference truth is computed at the case's own dtype (they quantise activations on the fly)
_SAME_DTYPE_TRUTH = {"fp8_linear", "fused_moe_fp8"}
#: ops that re-quantise an intermediate to e4m3 (the MoE hidden): a hidden element whose rounded value sits
#: near an e4m3 rounding boundary may round the other way under any other summation order (FP8 tensor
#: cores keep 13 mantissa bits per wgmma), moving single outputs by about the elementwise bound; they are
#: compared norm-wise, ||out - ref|| <= rtol * ||ref|| (each launch is checked elementwise on its own
#: inputs at real shapes in tests/test_fp8_gemm_gpu.py)
_NORM_OPS = {"fused_moe_fp8"}
#: which argument of an op is a latent cache (stored in the platform's planes), and the rope width of
#: the kit's cache entries
_CACHE_ARG = {"paged_kv_write": 0, "paged_kv_gather": 0, "mla_decode": 1, "mla_decode_uv": 1}
_KIT_ROPE = 8


def _in_planes(cache: torch.Tensor, planes: Callable[[KVCacheSpec], tuple[int, ...]]) -> LayerCache:
    D = cache.shape[-1]
    spec = KVCacheSpec("kit", (0,), D, parts=(D - _KIT_ROPE, _KIT_ROPE))
    widths = tuple(planes(spec))
    spec.check_planes(widths)
    if len(widths) == 1:
        return cache
    bounds = [0, *itertools.accumulate(widths)]
    return tuple(cache[..., a:b].contiguous() for a, b in zip(bounds, bounds[1:]))


# ---- running and comparing ------------------------------------------------------------------
def _map(args: Iterable[Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple:
    return tuple(fn(a) if isinstance(a, torch.Tensor) else a for a in args)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.clone().float() if t.is_floating_point() else t.clone()


def _call(op: str, fn: Callable, args: tuple) -> tuple[torch.Tensor, ...]:
    """Run ``fn`` and return its outputs as a tuple (the updated cache for the in-place write)."""
    out = fn(*args)
    if op == "paged_kv_write":
        return (torch.cat(cache_planes(args[0]), dim=-1),)
    if op == "mla_kv_write":  # the returned entry and the written cache
        return (out, torch.cat(cache_planes(args[5]), dim=-1))
    if op == "mla_q_absorb_kv_write":  # the query and the written cache
        return (out, torch.cat(cache_planes(args[7]), dim=-1))
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _fail(where: str, detail: str) -> None:
    raise AssertionError(f"{where} differs from the reference: {detail}")


def _compare(where: str, out: torch.Tensor, ref: torch.Tensor, expected_dtype: torch.dtype, rtol: float, *,
             exact: bool, norm: bool = False) -> None:
    if not isinstance(out, torch.Tensor):
        _fail(where, f"returned {type(out).__name__}, expected a tensor")
    out = out.detach().cpu()
    if tuple(out.shape) != tuple(ref.shape):
        _fail(where, f"shape {tuple(out.shape)}, reference {tuple(ref.shape)}")
    if expected_dtype.is_floating_point and out.dtype != expected_dtype:
        _fail(where, f"dtype {_dtype_name(out.dtype)}, reference {_dtype_name(expected_dtype)}")
    if not expected_dtype.is_floating_point and out.dtype.is_floating_point:
        _fail(where, f"dtype {_dtype_name(out.dtype)}, expected an integer dtype")
    if exact or not ref.is_floating_point():
        ref_c = ref.to(out.dtype) if ref.is_floating_point() else ref
        if not torch.equal(out.to(ref_c.dtype), ref_c):
            bad = (out.to(ref_c.dtype) != ref_c).nonzero()
            idx = tuple(bad[0].tolist())
            err = (out.double() - ref.double()).abs().max().item()
            _fail(where, f"not bit-exact: {len(bad)} element(s) differ, first at {idx} ({out[idx].item()} vs "
                  f"{ref[idx].item()}); max error {err:.3e}")
        return
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        idx = tuple((~torch.isfinite(o)).nonzero()[0].tolist())
        _fail(where, f"non-finite output at {idx} ({o[idx].item()}); reference {r[idx].item()}")
    if norm:
        rel = ((o - r).norm() / r.norm().clamp_min(1e-12)).item()
        if rel > rtol:
            _fail(where, f"relative error norm {rel:.3e} > rtol={rtol:g} (compared norm-wise: it re-quantises "
                  "an intermediate)")
        return
    err = (o - r).abs()
    scale = r.pow(2).mean().sqrt().item() if r.numel() else 0.0
    bound = rtol * (r.abs() + max(scale, 1e-12))
    if r.numel() and bool((err > bound).any()):
        ratio = err / bound
        idx = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
        _fail(where, f"max error {err.max().item():.3e} (at {idx}: {o[idx].item():.6g} vs "
              f"{r[idx].item():.6g}), {ratio.max().item():.2f}x the tolerance rtol={rtol:g} * "
              f"(|ref| + rms(ref) {scale:.3g})")


def _check_moe_route(where, out, ref, rtol, weight_dtype=torch.float32):
    weights, ids = (t.detach().cpu() for t in out)
    ref_w, ref_ids = ref
    if tuple(ids.shape) != tuple(ref_ids.shape) or tuple(weights.shape) != tuple(ref_w.shape):
        _fail(where, f"shapes {tuple(weights.shape)}/{tuple(ids.shape)}, reference {tuple(ref_w.shape)}/"
              f"{tuple(ref_ids.shape)}")
    if weights.dtype != weight_dtype or ids.dtype != torch.int64:
        _fail(where, f"dtypes {_dtype_name(weights.dtype)}/{_dtype_name(ids.dtype)}, expected "
              f"{_dtype_name(weight_dtype)}/int64")
    ids_s, order = ids.sort(-1)
    ref_s, ref_order = ref_ids.sort(-1)
    if not torch.equal(ids_s, ref_s):
        t = int((ids_s != ref_s).any(-1).nonzero()[0])
        _fail(where, f"token {t} routed to experts {ids_s[t].tolist()}, reference {ref_s[t].tolist()}")
    _compare(where + " weights", weights.gather(1, order), ref_w.gather(1, ref_order), weight_dtype, rtol,
             exact=False)


def _check_id_sets(where, out, ref):
    """Per row the same set of ids (top-k selections come in any order)."""
    ids = out.detach().cpu()
    if tuple(ids.shape) != tuple(ref.shape) or ids.dtype != torch.int64:
        _fail(where, f"returned shape {tuple(ids.shape)} dtype {_dtype_name(ids.dtype)}, reference "
              f"{tuple(ref.shape)} int64")
    a, b = ids.sort(-1).values, ref.sort(-1).values
    if not torch.equal(a, b):
        t = int((a != b).any(-1).nonzero()[0])
        _fail(where, f"row {t} selected {a[t].tolist()}, reference {b[t].tolist()}")


def _check_sample(where, backend_fn, args, out, ref, device):
    tokens = out.detach().cpu().long()
    if tuple(tokens.shape) != tuple(ref.shape) or tokens.dtype.is_floating_point:
        _fail(where, f"returned shape {tuple(out.shape)} dtype {_dtype_name(out.dtype)}, reference "
              f"{tuple(ref.shape)} int64")
    greedy = args[1] <= 0
    wrong = (tokens != ref).nonzero().flatten().tolist()
    if wrong:
        b = wrong[0]
        kind = "greedy" if bool(greedy[b]) else f"seeded (seed={int(args[5][b])}, offset={int(args[6][b])})"
        _fail(where, f"{len(wrong)} of {ref.shape[0]} rows sampled other tokens (rows {wrong}); first: "
              f"{kind} row {b} sampled {int(tokens[b])}, reference {int(ref[b])}")
    # batch independence: each row alone gives the same token as in the batch
    for b in range(ref.shape[0]):
        alone = backend_fn(*_map(args, lambda t, b=b: t[b : b + 1].to(device)))
        token = int(alone.detach().cpu().reshape(-1)[0])
        if token != int(tokens[b]):
            _fail(where, f"row {b} sampled alone gives {token}, in the batch {int(tokens[b])}")


def kernel_conformance_cases(
    backend_cls: type[KernelBackend], dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES
) -> list[tuple[str, torch.dtype]]:
    """(op, dtype) pairs to check for ``backend_cls``: its overridden ops at each dtype (ops with a
    fixed input dtype, see :data:`FIXED_DTYPE_OPS`, once). Use with ``pytest.mark.parametrize``."""
    cases: list[tuple[str, torch.dtype]] = []
    for op in backend_cls.overrides():
        if op in FIXED_DTYPE_OPS:
            cases.append((op, FIXED_DTYPE_OPS[op]))
        else:
            cases.extend((op, dt) for dt in dtypes)
    return cases


def check_op(
    backend_cls: type[KernelBackend],
    op: str,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    block_size: int = 16,
    planes: Callable[[KVCacheSpec], tuple[int, ...]] | None = None,
    kv_cache_dtypes: Sequence[str] = ("auto", "bf16", "fp8"),
) -> None:
    """Check one op of ``backend_cls`` at ``dtype`` on ``device``; AssertionError on a mismatch.
    ``planes``: the platform's ``kv_cache_planes`` (module docstring, "Cache layout"); ``kv_cache_dtypes``:
    the platform's ``kv_cache_dtypes()`` (cases of FP8 latent rows run only where "fp8" is listed)."""
    if op not in OP_NAMES:
        raise ValueError(f"unknown op {op!r}; known: {OP_NAMES}")
    if op not in CASES:
        raise NotImplementedError(f"the conformance kit has no cases for op {op!r} yet "
                                  "(add them to deepinfer_core/testing/kernels.py)")
    if op not in backend_cls.ops:
        raise ValueError(f"kernel backend {backend_cls.name!r} does not override {op!r}")
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {[_dtype_name(d) for d in TOLERANCES]}")
    device = torch.device(device)
    backend_fn = import_path(backend_cls.ops[op])
    reference = _reference_fn(op)
    rtol = TOLERANCES[dtype]
    g = torch.Generator().manual_seed(seed)
    for case in CASES[op](g, dtype, block_size):
        if case.kv not in kv_cache_dtypes:
            continue
        where = (f"kernel op {op!r} of backend {backend_cls.name!r} "
                 f"[dtype {_dtype_name(dtype)}, case {case.label!r}]")
        shaped = _call(op, reference, _map(case.args, torch.Tensor.clone))  # output dtypes at this dtype
        # FP8 ops quantise their (intermediate) activations: a float32 run would round them otherwise
        truth = shaped if op in _SAME_DTYPE_TRUTH else _call(op, reference, _map(case.args, _upcast))
        dev_args = _map(case.args, lambda t: t.clone().to(device))
        if planes is not None and op in _CACHE_ARG:
            i = _CACHE_ARG[op]
            dev_args = (*dev_args[:i], _in_planes(dev_args[i], planes), *dev_args[i + 1 :])
        try:
            out = _call(op, backend_fn, dev_args)
        except Exception as exc:
            raise AssertionError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        if len(out) != len(truth):
            _fail(where, f"returned {len(out)} output(s), reference {len(truth)}")
        if op in ("moe_route", "moe_route_v4", "moe_gate"):
            _check_moe_route(where, out, truth, rtol, shaped[0].dtype)
        elif op == "add_rms_norm_moe_gate":  # (normed, new_residual) as values, then the routing
            for i, name in enumerate(("normed", "new residual")):
                _compare(f"{where} {name}", out[i], truth[i], shaped[i].dtype, rtol, exact=False, norm=False)
            _check_moe_route(where, out[2:], truth[2:], rtol, shaped[2].dtype)
        elif op == "v4_indexer_topk":
            _check_id_sets(where, out[0], truth[0])
        elif op == "sample":
            _check_sample(where, backend_fn, case.args, out[0], truth[0], device)
        else:
            for i, (o, r, s) in enumerate(zip(out, truth, shaped, strict=True)):
                name = where if len(out) == 1 else f"{where} output {i}"
                _compare(name, o, r, s.dtype, rtol, exact=op in _EXACT_OPS, norm=op in _NORM_OPS)


def check_kernel_backend(
    backend_cls: type[KernelBackend],
    device: str | torch.device = "cpu",
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    *,
    seed: int = 0,
    block_size: int = 16,
    planes: Callable[[KVCacheSpec], tuple[int, ...]] | None = None,
    kv_cache_dtypes: Sequence[str] = ("auto", "bf16", "fp8"),
) -> list[tuple[str, torch.dtype]]:
    """Check every op ``backend_cls`` overrides; returns the (op, dtype) pairs checked."""
    check_api_version(backend_cls, f"kernel backend {backend_cls.name!r}")
    cases = kernel_conformance_cases(backend_cls, dtypes)
    for op, dtype in cases:
        check_op(backend_cls, op, dtype, device, seed=seed, block_size=block_size, planes=planes,
                 kv_cache_dtypes=kv_cache_dtypes)
    return cases
