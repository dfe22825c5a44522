"""Reference kernels: the meaning of every op, in plain torch, on any device."""

from deepinfer_core.kernels import OP_NAMES, KernelBackend

#: ops defined in ``kernels_cpu.v4_ops`` (DeepSeek-V4); every other op is in ``kernels_cpu.ops``
V4_OPS = ("rope_inverse", "v4_compress", "v4_indexer_topk", "v4_sparse_attention", "mhc_pre", "mhc_post",
          "mhc_head", "moe_route_v4", "silu_and_mul_clamped", "fused_moe_clamped")
#: ops defined in ``kernels_cpu.mxfp8`` (window KV snapshots)
MXFP8_OPS = ("ue8m0_scale", "mxfp8_quant", "mxfp8_dequant")
#: ops defined in ``kernels_cpu.fp8_ops`` (block-scaled FP8 weights)
FP8_OPS = ("fp8_linear", "fused_moe_fp8")
#: ops defined in ``kernels_cpu.fused`` (compositions a backend may run as one launch)
FUSED_OPS = ("add_rms_norm_linear", "linear_f32", "mla_kv_write", "mla_q_absorb", "moe_gate",
             "add_rms_norm_moe_gate", "mla_q_absorb_kv_write", "mla_decode_uv")
#: ops defined in ``kernels_cpu.kv_fp8`` (the FP8 latent KV cache)
KV_FP8_OPS = ("latent_kv_dequant",)
_MODULES = {**dict.fromkeys(V4_OPS, "v4_ops"), **dict.fromkeys(MXFP8_OPS, "mxfp8"), **dict.fromkeys(FP8_OPS, "fp8_ops"),
            **dict.fromkeys(FUSED_OPS, "fused"), **dict.fromkeys(KV_FP8_OPS, "kv_fp8")}


def _module(op: str) -> str:
    return _MODULES.get(op, "ops")


class ReferenceKernels(KernelBackend):
    name = "reference"
    core_api_version = "1.0"
    ops = {name: f"kernels_cpu.{_module(name)}:{name}" for name in OP_NAMES}
