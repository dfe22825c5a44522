"""Shared TileLang plumbing: lazy import, the compile target, and a per-shape kernel cache.

Nothing here imports TileLang at module import time; ``tilelang`` is imported the first time a kernel
is built. Kernels are compiled once per static configuration (dtype, head counts, tile sizes, ...);
token counts, block counts and batch sizes are dynamic (``T.dynamic``), so a serving process compiles
each kernel a handful of times, not once per batch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.config import ConfigError, env_flag

#: Overrides the compile target's arch (e.g. ``sm_90a``); by default it comes from the device.
ARCH_ENV = "DEEPINFER_CUDA_ARCH"

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def tl_dtype(dtype: torch.dtype) -> str:
    return _DTYPES[dtype]


def tilelang():
    import tilelang as _tl  # noqa: PLC0415  (lazy: importing TileLang costs about a second)

    return _tl


def language():
    import tilelang.language as T  # noqa: PLC0415

    return T


@functools.cache
def device_arch(index: int = 0) -> str:
    """``sm_90a`` on Hopper (wgmma and TMA need the arch-specific target), else ``sm_XY``."""
    env = os.environ.get(ARCH_ENV)
    if env:
        return env
    if dry_run() and not torch.cuda.is_available():
        return "sm_90a"
    major, minor = torch.cuda.get_device_capability(index)
    arch = f"sm_{major}{minor}"
    return arch + "a" if major in (9, 10, 12) else arch


def target(arch: str | None = None) -> dict[str, str]:
    return {"kind": "cuda", "arch": arch or device_arch()}


def compile_kernel(func: Any, arch: str | None = None, out_idx: list[int] | None = None) -> Any:
    """Compile a ``T.prim_func`` for CUDA (works without a GPU: nvcc is enough)."""
    return tilelang().compile(func, out_idx=out_idx, target=target(arch))


def kernel_source(func: Any, arch: str | None = None) -> str:
    """The CUDA source TileLang generates for a ``T.prim_func``, without running nvcc (what
    ``compile_kernel(...).get_kernel_source()`` returns, in a fraction of the time: tests that read the code)."""
    tl = tilelang()
    tgt = tl.tvm.target.Target(target(arch))
    with tgt:
        return tl.lower(func, target=tgt).kernel_source


#: Set to 1 to compile kernels without running them (no GPU needed): fills TileLang's on-disk cache
#: (``TILELANG_CACHE_DIR``) so a GPU machine can start with every kernel already built.
DRYRUN_ENV = "DEEPINFER_TL_DRYRUN"


def dry_run() -> bool:
    return env_flag(DRYRUN_ENV, False)


#: Called with the kernel builder's name on every call of a dry-run kernel (``examples/launch_count.py``
#: counts a step's launches that way); None: dry-run kernels do nothing.
dry_launch_hook: Callable[[str], None] | None = None


def _dry_kernel(name: str) -> Callable[..., None]:
    def call(*args: Any, **kwargs: Any) -> None:
        if dry_launch_hook is not None:
            dry_launch_hook(name)

    return call


def kernel_cache(builder: Callable[..., Any]) -> Callable[..., Any]:
    """Memoise ``builder(*config)`` -> compiled kernel for the current device's arch."""

    @functools.cache
    def get(*args: Any) -> Any:
        kernel = compile_kernel(builder(*args))
        return _dry_kernel(builder.__name__) if dry_run() else kernel

    get.builder = builder  # type: ignore[attr-defined]
    return get


#: Programmatic dependent launch in the decode chain: each kernel that supports it is launched while the kernel
#: before it still runs, issues the loads that do not depend on it (its weights), then waits
#: (``griddepcontrol.wait``) before it reads an activation or writes anything, and lets the next launch start
#: (``griddepcontrol.launch_dependents``). The GEMVs (``gemv``'s one-row kernel, ``gemv_rows``), the norm-prologue
#: GEMVs (``norm_gemv``, ``moe_gate``'s ``norm_gate``), the norms, the MLA attention and its merge + W_UV, the
#: weight-streaming MoE's up and down kernels, and their FP8 counterparts. A kernel without it waits for the whole
#: kernel before it, as any launch does, so the chain may mix both.
#: ``DEEPINFER_PDL=1``: every launch that supports it; ``0``: none; unset: launches of one activation row (the
#: batch-1 decode chain) of the bf16 kernels, on devices that have it (sm_90 and later). That is what was measured
#: (docs/h200/s13): V2-Lite b1 2.094 / 2.080 -> 2.029 / 2.024 ms a step on the H200 (2.545 / 2.554 -> 2.480 / 2.491
#: on an H100), the same bits; the FP8 chain measured no gain (H100: 2.150 -> 2.163 ms); more rows were not measured.
PDL_ENV = "DEEPINFER_PDL"


def pdl(rows: int = 1, by_default: bool = True) -> bool:
    """Whether a launch over ``rows`` activation rows uses programmatic dependent launch (``PDL_ENV``);
    ``by_default``: whether the kernel takes it without the variable (a single row on sm_90+)."""
    if os.environ.get(PDL_ENV, "").strip():
        on = env_flag(PDL_ENV, False)
        if on and (torch.cuda.is_available() or dry_run()) and not has_pdl():
            raise ConfigError(f"environment variable {PDL_ENV}=1: programmatic dependent launch needs sm_90 or later, "
                              f"the compile target is {device_arch()}; unset it or set 0")
        return on
    return by_default and rows == 1 and has_pdl()


def pdl_arg(rows: int = 1, by_default: bool = True) -> tuple[bool, ...]:
    """A kernel builder's trailing ``pdl`` argument where :func:`pdl` holds (none: the builds without it)."""
    return (True,) if pdl(rows, by_default) else ()


def has_pdl() -> bool:
    """The compile target has ``griddepcontrol`` (sm_90 and later); False without a device to compile for."""
    if not (torch.cuda.is_available() or dry_run()):
        return False
    digits = "".join(c for c in device_arch() if c.isdigit())  # sm_90a -> "90": major 9, minor 0
    return int(digits[:-1] or 0) >= 9


def pdl_ops():
    """(trigger, sync): ``griddepcontrol.launch_dependents`` / ``.wait`` as TileLang intrinsics."""
    from tilelang.cuda.language import pdl_sync, pdl_trigger  # noqa: PLC0415

    return pdl_trigger, pdl_sync


def pdl_gate():
    """A macro for the point of a kernel where its own input becomes needed: wait for the kernel before it (all
    its writes visible), then let the next kernel launch. Every thread must pass it before it reads anything the
    kernel before wrote (or writes anything that kernel may still read: a freed and reused buffer). Launching the
    next kernel only here keeps at most two kernels of the chain in flight, and the next kernel's early loads
    (its weights) run while this one works."""
    T = language()
    trigger, sync = pdl_ops()

    @T.macro
    def gate():
        sync()
        trigger()

    return gate


_counters: dict[tuple[str, int], torch.Tensor] = {}


def launch_counters(name: str, n: int, device: torch.device) -> torch.Tensor | None:
    """``n`` zeroed int32 counters of device ``device`` for the kernels named ``name``: a launch whose CTAs count
    their finished parts on them (the last one merges) leaves them at 0 again, so a CUDA graph replays it as is.
    Made on the first call outside a graph capture (the engine's warm-up step; a capture runs on its own stream,
    so they are per device, not per stream); None while a capture runs and none exist yet (a tensor made during
    a capture would live in the graph's pool): the caller then takes its path without the counters. A device
    runs one model forward at a time, its kernels one after the other, so one set per kernel name suffices."""
    key = (name, (device.index or 0) if device.type == "cuda" else -1)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counters[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _counters[key]


@functools.cache
def num_sms(index: int = 0) -> int:
    if dry_run() and not torch.cuda.is_available():
        return 132  # H100/H200 SXM
    return torch.cuda.get_device_properties(index).multi_processor_count
