"""Ascend kernels through torch_npu's documented fused ops (torch_npu is imported lazily, inside
each op: listing this backend never loads it). The op table with the torch_npu call of each op is in
docs/ascend.md; ``kernels_ascend/schemas`` holds the pinned op schemas every call is checked against."""

from deepinfer_core.kernels import KernelBackend


class AscendKernels(KernelBackend):
    name = "ascend"
    core_api_version = "1.0"
    #: Not named here, so they run the reference ops (plain torch, on the NPU), as ``deepinfer plugins``
    #: lists: linear and head_linear (aclnn MatMul/BatchMatMul already are the NPU's GEMMs),
    #: apply_penalties, logsumexp and greedy_sample (elementwise/reductions). paged_kv_gather is plain torch too, but
    #: over the platform's cache planes (AscendPlatform.kv_cache_planes).
    ops = {
        "rms_norm": "kernels_ascend.dense:rms_norm",
        "add_rms_norm": "kernels_ascend.dense:add_rms_norm",
        "silu_and_mul": "kernels_ascend.dense:silu_and_mul",
        "rope": "kernels_ascend.dense:rope",
        "paged_kv_write": "kernels_ascend.attention:paged_kv_write",
        "paged_kv_gather": "kernels_ascend.attention:paged_kv_gather",
        "mla_decode": "kernels_ascend.attention:mla_decode",
        "mla_prefill": "kernels_ascend.attention:mla_prefill",
        "moe_route": "kernels_ascend.moe:moe_route",
        "fused_moe": "kernels_ascend.moe:fused_moe",
        "sample": "kernels_ascend.sampling:sample",
        # DeepSeek-V4 (v4_indexer_topk, v4_sparse_attention and the mHC ops run the reference: no
        # documented fused op computes them, docs/ascend.md)
        "rope_inverse": "kernels_ascend.v4:rope_inverse",
        "v4_compress": "kernels_ascend.v4:v4_compress",
        "moe_route_v4": "kernels_ascend.v4:moe_route_v4",
        "silu_and_mul_clamped": "kernels_ascend.v4:silu_and_mul_clamped",
        "fused_moe_clamped": "kernels_ascend.v4:fused_moe_clamped",
    }
