"""Reference kernels: the meaning of every op, in plain torch, on any device."""

from deepinfer_core.kernels import OP_NAMES, KernelBackend


class ReferenceKernels(KernelBackend):
    name = "reference"
    core_api_version = "1.0"
    ops = {name: f"kernels_cpu.ops:{name}" for name in OP_NAMES}
