"""The CPU platform: always available, gloo for collectives, reference kernels."""

from __future__ import annotations

import os

import torch

from deepinfer_core.platform import Availability, Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    kernel_backend = "reference"
    core_api_version = "1.0"
    probe_priority = 1000  # the last resort of auto-detection
    kv_cache_memory_fraction = 0.1  # host memory is shared with everything else

    @classmethod
    def probe(cls) -> Availability:
        return Availability.yes()

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return free, total

    def preferred_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def kv_cache_dtypes(self) -> tuple[str, ...]:
        return ("auto", "bf16", "fp8")  # the reference ops read FP8 latent rows (kernels_cpu/kv_fp8.py)

    def linear_weight_layout(self, w: torch.Tensor) -> torch.Tensor:
        # Stored K-major ([K, N] contiguous, seen as its transpose): a decode GEMM then streams the
        # weight in the order the BLAS reads it. Weights of a small model fall out of cache between
        # steps, and with the default layout a [1, K] x [N, K]^T product ran 1.2-2.6x slower cold.
        if w.dim() < 2 or not w.is_floating_point():
            return w
        return w.transpose(-1, -2).contiguous().transpose(-1, -2)
