"""Reference kernels: the meaning of every op, in plain torch, on any device."""

from deepinfer_core.kernels import OP_NAMES, KernelBackend

#: ops defined in ``kernels_cpu.v4_ops`` (DeepSeek-V4); every other op is in ``kernels_cpu.ops``
V4_OPS = ("rope_inverse", "v4_compress", "v4_indexer_topk", "v4_sparse_attention", "mhc_pre", "mhc_post",
          "mhc_head", "moe_route_v4", "silu_and_mul_clamped", "fused_moe_clamped")


class ReferenceKernels(KernelBackend):
    name = "reference"
    core_api_version = "1.0"
    ops = {name: f"kernels_cpu.{'v4_ops' if name in V4_OPS else 'ops'}:{name}" for name in OP_NAMES}
