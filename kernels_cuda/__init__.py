"""CUDA kernels (TileLang) for the nvidia platform.

Op implementations live in submodules that import TileLang lazily, so listing this backend costs
nothing. Ops not named here fall back to the reference (``kernels_cpu``).
"""

from deepinfer_core.kernels import KernelBackend


class CudaKernels(KernelBackend):
    name = "cuda"
    core_api_version = "1.0"
    ops: dict[str, str] = {}
