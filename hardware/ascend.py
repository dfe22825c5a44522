"""The Ascend platform: npu devices, HCCL, streams and events, NPU graphs, torch_npu kernels.

``torch_npu`` is imported lazily, only here and in ``kernels_ascend`` and only when the platform is
probed or used: an installed torch_npu without CANN makes ``import torch`` itself fail, so nothing
else may touch it. Every ``torch_npu.npu.*`` name used here is checked against the pinned wheel's
``torch_npu.npu.__all__`` (kernels_ascend/schemas/check.py).
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import AbstractContextManager
from typing import Any

import torch

from deepinfer_core.platform import Availability, Platform


class AscendPlatform(Platform):
    name = "ascend"
    device_type = "npu"
    dist_backend = "hccl"
    kernel_backend = "ascend"
    core_api_version = "1.0"
    probe_priority = 20

    @classmethod
    def probe(cls) -> Availability:
        if importlib.util.find_spec("torch_npu") is None:
            return Availability.no("torch_npu is not installed (pip install torch-npu, with Ascend CANN)")
        if not (os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
                or os.path.isdir("/usr/local/Ascend")):
            return Availability.no("Ascend CANN toolkit not found (ASCEND_HOME_PATH unset, no /usr/local/Ascend)")
        try:
            import torch_npu

            n = torch_npu.npu.device_count()
        except Exception as exc:
            return Availability.no(f"torch_npu failed to load: {type(exc).__name__}: {exc}")
        if n == 0:
            return Availability.no("no Ascend NPU is visible (torch_npu.npu.device_count() == 0)")
        return Availability.yes()

    # ---- devices ------------------------------------------------------------------------
    def device_count(self) -> int:
        import torch_npu

        return torch_npu.npu.device_count()

    def device(self, index: int = 0) -> torch.device:
        return torch.device("npu", index)

    def set_device(self, index: int) -> None:
        import torch_npu

        torch_npu.npu.set_device(index)

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        import torch_npu

        return torch_npu.npu.mem_get_info(index)

    # ---- streams, events, sync ----------------------------------------------------------
    def synchronize(self, device: torch.device | None = None) -> None:
        import torch_npu

        torch_npu.npu.synchronize(device)

    def stream(self, device: torch.device | None = None) -> Any:
        import torch_npu

        return torch_npu.npu.Stream(device)

    def stream_context(self, stream: Any) -> AbstractContextManager:
        import torch_npu

        return torch_npu.npu.stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        import torch_npu

        return torch_npu.npu.Event(enable_timing=enable_timing)

    # ---- graphs -------------------------------------------------------------------------
    def supports_graph_capture(self) -> bool:
        return True

    def graph_capture_dtypes(self) -> tuple[torch.dtype, ...]:
        # kernels_ascend's decode ops never read device values on the host in these dtypes; while a
        # graph is captured, mla_decode takes its torch path (FIA takes sequence lengths as host lists)
        return (torch.bfloat16, torch.float16)

    def graph(self) -> Any:
        import torch_npu

        return torch_npu.npu.NPUGraph()

    def graph_capture(self, graph: Any, pool: Any = None) -> AbstractContextManager:
        import torch_npu

        return torch_npu.npu.graph(graph, pool=pool)

    # ---- numerics and memory ------------------------------------------------------------
    def preferred_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def linear_weight_layout(self, w: torch.Tensor) -> torch.Tensor:
        # Expert stacks [E, N, K] are stored K-major so that kernels_ascend.moe reads
        # w.transpose(1, 2) ([E, K, N], what npu_grouped_matmul multiplies by) as a contiguous tensor.
        if w.dim() == 3 and w.is_floating_point():
            return w.transpose(-1, -2).contiguous().transpose(-1, -2)
        return w

    def supports_pinned_memory(self) -> bool:
        return True

    def supports_async_overlap(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        # nothing here has run on an NPU yet: checked by schema and CPU emulation only (docs/ascend.md)
        return {**super().describe(), "verified_on_hardware": False}
