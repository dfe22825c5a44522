"""CUDA kernels (TileLang) for the nvidia platform.

Op implementations live in submodules that import TileLang lazily (inside the kernel builders), so
listing this backend costs nothing. Ops not named here fall back to the reference (``kernels_cpu``):
``linear`` (cuBLAS through torch), ``paged_kv_gather`` and ``apply_penalties`` are plain torch on
the device.

The attention and MoE kernels use the tensor cores for bfloat16/float16 only; called with float32
tensors they run the reference (tf32 tensor-core math would miss float32 tolerances).
"""

from deepinfer_core.kernels import KernelBackend

#: module name per kernel submodule; each has ``representative_kernels()`` for the compile test.
KERNEL_MODULES = ("norm", "elementwise", "kv_cache", "mla_decode", "mla_prefill", "moe", "moe_route", "sampling")


class CudaKernels(KernelBackend):
    name = "cuda"
    core_api_version = "1.0"
    ops: dict[str, str] = {
        "rms_norm": "kernels_cuda.norm:rms_norm",
        "add_rms_norm": "kernels_cuda.norm:add_rms_norm",
        "rope": "kernels_cuda.elementwise:rope",
        "silu_and_mul": "kernels_cuda.elementwise:silu_and_mul",
        "paged_kv_write": "kernels_cuda.kv_cache:paged_kv_write",
        "mla_decode": "kernels_cuda.mla_decode:mla_decode",
        "mla_prefill": "kernels_cuda.mla_prefill:mla_prefill",
        "moe_route": "kernels_cuda.moe_route:moe_route",
        "fused_moe": "kernels_cuda.moe:fused_moe",
        "sample": "kernels_cuda.sampling:sample",
    }
