"""The Ascend platform: npu devices, HCCL, NPU graphs, written against torch_npu's API.

``torch_npu`` is imported lazily, only here and only when the platform is probed or used: an
installed torch_npu without CANN makes ``import torch`` itself fail, so nothing else may touch it.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import AbstractContextManager
from typing import Any

import torch

from deepinfer_core.platform import Availability, Platform


def _torch_npu():
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu


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
            npu = _torch_npu()
            n = npu.device_count()
        except Exception as exc:
            return Availability.no(f"torch_npu failed to load: {type(exc).__name__}: {exc}")
        if n == 0:
            return Availability.no("no Ascend NPU is visible (torch.npu.device_count() == 0)")
        return Availability.yes()

    def device_count(self) -> int:
        return _torch_npu().device_count()

    def device(self, index: int = 0) -> torch.device:
        return torch.device("npu", index)

    def set_device(self, index: int) -> None:
        _torch_npu().set_device(index)

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        return _torch_npu().mem_get_info(index)

    def synchronize(self, device: torch.device | None = None) -> None:
        _torch_npu().synchronize(device)

    def stream(self, device: torch.device | None = None) -> Any:
        return _torch_npu().Stream(device)

    def stream_context(self, stream: Any) -> AbstractContextManager:
        return _torch_npu().stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        return _torch_npu().Event(enable_timing=enable_timing)

    def supports_graph_capture(self) -> bool:
        return True

    def graph_capture_dtypes(self) -> tuple[torch.dtype, ...]:
        # kernels_ascend has no mla_decode / fused_moe yet: the reference ops read lengths and expert
        # counts on the host, so a decode step cannot be captured
        return ()

    def graph(self) -> Any:
        return _torch_npu().NPUGraph()

    def graph_capture(self, graph: Any, pool: Any = None) -> AbstractContextManager:
        return _torch_npu().graph(graph, pool=pool)

    def preferred_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def supports_pinned_memory(self) -> bool:
        return True

    def supports_async_overlap(self) -> bool:
        return True
