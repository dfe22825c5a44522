"""The NVIDIA platform: CUDA devices, NCCL, streams and events, CUDA graphs, TileLang kernels."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from deepinfer_core.platform import Availability, Platform


class NvidiaPlatform(Platform):
    name = "nvidia"
    device_type = "cuda"
    dist_backend = "nccl"
    kernel_backend = "cuda"
    core_api_version = "1.0"
    probe_priority = 10

    @classmethod
    def probe(cls) -> Availability:
        if torch.version.cuda is None:
            return Availability.no(f"this torch build ({torch.__version__}) has no CUDA support")
        try:
            n = torch.cuda.device_count()
        except Exception as exc:  # driver problems surface here
            return Availability.no(f"CUDA driver error: {exc}")
        if n == 0:
            return Availability.no("no CUDA device is visible (torch.cuda.device_count() == 0)")
        return Availability.yes()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cuda", index)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        return torch.cuda.mem_get_info(index)

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(device)

    def stream(self, device: torch.device | None = None) -> Any:
        return torch.cuda.Stream(device)

    def stream_context(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=enable_timing)

    def supports_graph_capture(self) -> bool:
        return True

    def graph_capture_dtypes(self) -> tuple[torch.dtype, ...]:
        # kernels_cuda runs the tensor-core kernels for these; float32 takes the reference ops, which
        # read lengths and expert counts on the host
        return (torch.bfloat16, torch.float16)

    def supports_verify_graphs(self) -> bool:
        # kernels_cuda.mla_decode maps ragged rows to sequences with a device searchsorted
        return True

    def graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def graph_capture(self, graph: Any, pool: Any = None) -> AbstractContextManager:
        return torch.cuda.graph(graph, pool=pool)

    def preferred_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def supports_fp8_gemm(self) -> bool:
        # Both FP8 weight ops must be this platform's kernels (kernels_cuda registers them once they pass the
        # H200 conformance), and the device must be Hopper: kernels_cuda.fp8_gemm is e4m3 wgmma + TMA
        # (sm_90a). Ada (sm_89) has FP8 tensor cores but neither; Blackwell's tcgen05 path is not written.
        from deepinfer_core import plugins

        ops = plugins.load("deepinfer.kernels", self.kernel_backend, what="kernel backend").ops
        return ({"fp8_linear", "fused_moe_fp8"} <= ops.keys() and torch.cuda.is_available()
                and torch.cuda.get_device_capability()[0] == 9)

    def kv_cache_dtypes(self) -> tuple[str, ...]:
        # kernels_cuda.kv_cache / mla_decode quantise and read FP8 latent rows with e4m3 conversions: sm_89+
        if torch.cuda.is_available() and torch.cuda.get_device_capability(0) < (8, 9):
            return ("auto", "bf16")
        return ("auto", "bf16", "fp8")

    def supports_pinned_memory(self) -> bool:
        return True

    def supports_async_overlap(self) -> bool:
        return True
