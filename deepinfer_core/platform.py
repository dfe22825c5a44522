"""The device interface: everything the engine may ask of a backend.

A backend plugin subclasses :class:`Platform` and registers it in the ``deepinfer.hardware``
entry-point group. The engine never branches on a device name; it asks the platform.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.kv_cache_spec import KVCacheSpec

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.communicator import Communicator


@dataclass(frozen=True)
class Availability:
    """Result of an availability probe: ``ok`` or a human-readable reason why not."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> Availability:
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)


class Platform(ABC):
    """One kind of device (cpu, nvidia, ascend, or a third party's).

    Class attributes every backend sets:
      name             short name used by ``DEEPINFER_ACCELERATOR`` and ``accelerator=``
      device_type      torch device type string ("cpu", "cuda", "npu", ...)
      dist_backend     torch.distributed backend ("gloo", "nccl", "hccl", ...)
      kernel_backend   name in the ``deepinfer.kernels`` group that holds its fast ops
      batch_invariant_kernel_backend  the ``deepinfer.kernels`` backend whose ops replace the others
                       when ``batch_invariant`` is on (per-token results independent of the batch)
      core_api_version the core API this plugin was written for
    """

    name: str = ""
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    kernel_backend: str = "reference"
    batch_invariant_kernel_backend: str = "batch_invariant"
    core_api_version: str = ""
    #: Order in which auto-detection probes this platform (lower first). Third parties pick >= 100.
    probe_priority: int = 100
    #: Share of the device memory left after loading weights that the KV cache takes by default.
    kv_cache_memory_fraction: float = 0.9

    # ---- availability -------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def probe(cls) -> Availability:
        """Say whether this platform can run here and, if not, why. Must be cheap and not raise."""

    # ---- devices ------------------------------------------------------------------------
    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""

    def device(self, index: int = 0) -> torch.device:
        """The torch device for local rank ``index``."""
        return torch.device(self.device_type, index) if self.device_count() > 1 or index else torch.device(
            self.device_type
        )

    def set_device(self, index: int) -> None:
        """Make ``index`` the current device of this process (no-op where devices are implicit)."""

    @abstractmethod
    def memory_info(self, index: int = 0) -> tuple[int, int]:
        """(free_bytes, total_bytes) of device ``index``."""

    # ---- streams, events, sync ----------------------------------------------------------
    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for all work queued on the device."""

    def stream(self, device: torch.device | None = None) -> Any:
        """A new side stream, or None where the device has a single in-order queue."""
        return None

    def stream_context(self, stream: Any) -> AbstractContextManager:
        """Context manager that makes ``stream`` current (a null context for ``None``)."""
        import contextlib

        return contextlib.nullcontext()

    def event(self, enable_timing: bool = False) -> Any:
        """A device event with ``record(stream=None)``, ``synchronize()``, ``query()`` and
        ``elapsed_time()``; on platforms with streams also ``wait()`` (the current stream waits)."""
        return HostEvent()

    # ---- graphs -------------------------------------------------------------------------
    def supports_graph_capture(self) -> bool:
        """Whether decode steps can be captured and replayed as device graphs."""
        return False

    def graph_capture_dtypes(self) -> tuple[torch.dtype, ...]:
        """Activation dtypes whose decode ops (this platform's kernel backend) never synchronise with
        the host, so a decode step in them can be captured. Empty where graphs are unsupported."""
        return self.preferred_dtypes() if self.supports_graph_capture() else ()

    def graph(self) -> Any:
        """A graph object (torch.cuda.CUDAGraph-like) with ``replay()`` and, once captured, ``pool()``
        (its memory pool, passed to later captures to share it); only if supported."""
        raise NotImplementedError(f"platform {self.name!r} does not support graph capture")

    def graph_capture(self, graph: Any, pool: Any = None) -> AbstractContextManager:
        """Context manager capturing into ``graph``."""
        raise NotImplementedError(f"platform {self.name!r} does not support graph capture")

    def supports_verify_graphs(self) -> bool:
        """Whether decode graphs with several query rows per sequence (speculative verify steps, a
        fixed number R per sequence, ``cu_q_lens`` constant) can be captured: the decode attention
        maps rows to sequences on the device. ``graph_replay`` then gets each sequence's padded
        context length."""
        return False

    def graph_replay(self, graph: Any, seq_lens: list[int]) -> None:
        """Replay a captured decode graph. ``seq_lens``: every row's context length (padding rows
        included) on the host, for platforms whose captured kernels take lengths as host arguments
        that must be updated before each replay. Default: ``graph.replay()``."""
        graph.replay()

    # ---- numerics -----------------------------------------------------------------------
    def preferred_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtypes in order of preference for weights and activations."""
        return (torch.float32,)

    def linear_weight_layout(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` (a GEMM weight ``[..., N, K]``) in the memory layout this platform's kernels read
        fastest: same shape, dtype and values, any strides. Applied once to every GEMM weight after
        loading (``deepinfer_core.models.loader.apply_weight_layout``); embeddings keep theirs."""
        return w

    def kv_cache_planes(self, spec: KVCacheSpec) -> tuple[int, ...]:
        """Widths of the planes in which this platform's kernels want cache group ``spec`` stored: one
        tensor per plane and layer (``deepinfer_core.kv_cache_spec``, "Planes"). Default: one plane
        holding the whole entry. A platform may only group the parts ``spec.parts`` declares, in order."""
        return (spec.entry_dim,)

    def supports_fp8_gemm(self) -> bool:
        """Whether block-scaled FP8 weights can be used without dequantizing at load."""
        return False

    def kv_cache_dtypes(self) -> tuple[str, ...]:
        """The config ``kv_cache_dtype`` values this platform's attention kernels read ("auto": the model
        dtype; "bf16"; "fp8": the FP8 latent rows of ``kernels_cpu/kv_fp8.py``). Default: the plain ones;
        a platform lists "fp8" only where its ``paged_kv_write`` / ``mla_decode`` implement those rows (or
        take the reference's)."""
        return ("auto", "bf16")

    def supports_pinned_memory(self) -> bool:
        """Whether host buffers should be pinned for faster, asynchronous copies (host KV tiers, and the
        engine's per-step inputs and results)."""
        return False

    def supports_async_overlap(self) -> bool:
        """Whether kernel launches return before the work is done, so the CPU may run ahead.

        When True the engine overlaps ``schedule(N+1)`` with ``forward(N)`` by default (config
        ``async_scheduling`` overrides it; see ``deepinfer_core/engine/engine.py``)."""
        return False

    def communicator(self) -> Communicator:
        """The :class:`~deepinfer_core.communicator.Communicator` ranks on this platform use, built
        after ``torch.distributed.init_process_group(self.dist_backend, ...)``. Default: one over the
        torch.distributed world group; a platform with its own collective library returns its own."""
        from deepinfer_core.communicator import TorchDistCommunicator

        return TorchDistCommunicator()

    def describe(self) -> dict[str, Any]:
        """Facts shown by ``deepinfer plugins`` and logs."""
        return {
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "kernel_backend": self.kernel_backend,
            "graph_capture": self.supports_graph_capture(),
            "graph_capture_dtypes": [str(d).removeprefix("torch.") for d in self.graph_capture_dtypes()],
            "pinned_memory": self.supports_pinned_memory(),
            "async_overlap": self.supports_async_overlap(),
            "fp8_gemm": self.supports_fp8_gemm(),
            "kv_cache_dtypes": list(self.kv_cache_dtypes()),
        }


class HostEvent:
    """Event for devices that execute synchronously: records wall time."""

    def __init__(self) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``."""
        assert self._t is not None and end._t is not None, "record() both events first"
        return (end._t - self._t) * 1000.0
