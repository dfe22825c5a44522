"""The Ascend platform with its device calls moved to the CPU, for engine tests through the emulated
torch_npu: everything the engine asks of the platform that shapes the run (the kernel backend, the
KV cache planes, graph capture and replay through torch_npu.npu) is AscendPlatform's own; only the
device, memory, streams and events are the CPU's. Registered as accelerator ``ascend_emulated`` by
the tests (available while :func:`npu_emulation.install` is active)."""

from __future__ import annotations

import sys

import torch

from deepinfer_core.platform import Availability
from hardware.ascend import AscendPlatform
from hardware.cpu import CpuPlatform


class EmulatedAscendPlatform(AscendPlatform):
    name = "ascend_emulated"
    device_type = "cpu"
    dist_backend = "gloo"
    kv_cache_memory_fraction = CpuPlatform.kv_cache_memory_fraction

    @classmethod
    def probe(cls) -> Availability:
        from npu_emulation import EmulatedTorchNpu

        if isinstance(sys.modules.get("torch_npu"), EmulatedTorchNpu):
            return Availability.yes()
        return Availability.no("the emulated torch_npu is not installed (npu_emulation.install())")

    def device_count(self) -> int:
        return 1

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        pass

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        return CpuPlatform().memory_info(index)

    def synchronize(self, device: torch.device | None = None) -> None:
        pass

    def stream(self, device: torch.device | None = None):
        return None

    def stream_context(self, stream):
        return CpuPlatform().stream_context(stream)

    def event(self, enable_timing: bool = False):
        return CpuPlatform().event(enable_timing)

    def supports_graph_capture(self) -> bool:
        # the emulated NPUGraph replays only the FIA launches it recorded (npu_emulation.EmulatedNPUGraph):
        # the engine must not rely on it; tests drive DecodeGraphs' capture and replay directly
        return False

    def preferred_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float32)

    def supports_pinned_memory(self) -> bool:
        return False  # pinning needs an accelerator runtime

    def supports_async_overlap(self) -> bool:
        return False
