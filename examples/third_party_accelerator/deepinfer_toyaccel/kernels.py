"""toyaccel's kernel backend: two ops of its own, the reference for the rest.

Ops are named as "module:function" strings so that listing the backend (``deepinfer plugins``)
imports nothing heavy; ``deepinfer_toyaccel.ops`` is imported when the engine resolves them.
"""

from deepinfer_core.kernels import KernelBackend


class ToyAccelKernels(KernelBackend):
    name = "toyaccel"
    core_api_version = "1.0"
    ops = {
        "rms_norm": "deepinfer_toyaccel.ops:rms_norm",
        "silu_and_mul": "deepinfer_toyaccel.ops:silu_and_mul",
    }
