"""Ascend kernels through torch_npu's fused ops (imported lazily inside each op)."""

from deepinfer_core.kernels import KernelBackend


class AscendKernels(KernelBackend):
    name = "ascend"
    core_api_version = "1.0"
    ops = {
        "rms_norm": "kernels_ascend.ops:rms_norm",
        "add_rms_norm": "kernels_ascend.ops:add_rms_norm",
        "moe_route": "kernels_ascend.ops:moe_route",
        "paged_kv_write": "kernels_ascend.ops:paged_kv_write",
    }
