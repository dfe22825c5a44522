"""The toyaccel platform: a pretend accelerator whose "device" is the host CPU."""

from __future__ import annotations

import os

import torch

from deepinfer_core.platform import Availability, Platform


class ToyAccelPlatform(Platform):
    name = "toyaccel"
    device_type = "cpu"  # a real plugin names its torch device type ("cuda", "npu", "xpu", ...)
    dist_backend = "gloo"
    kernel_backend = "toyaccel"  # its ops, in the deepinfer.kernels group
    core_api_version = "1.0"
    probe_priority = 100  # third parties: >= 100, so before the CPU (1000) and after nvidia/ascend

    @classmethod
    def probe(cls) -> Availability:
        # A real probe checks for its runtime library and visible devices, cheaply and without raising.
        if os.environ.get("TOYACCEL_DISABLE"):
            return Availability.no("TOYACCEL_DISABLE is set")
        return Availability.yes()

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")

    def preferred_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)
