"""CUDA kernels (TileLang) for the nvidia platform.

Op implementations live in submodules that import TileLang lazily (inside the kernel builders), so
listing this backend costs nothing. Ops not named here fall back to the reference (``kernels_cpu``):
``paged_kv_gather``, ``latent_kv_dequant`` (prefill's read of FP8 latent rows) and ``apply_penalties``
are plain torch on the device. ``linear``, ``linear_f32`` and ``head_linear`` run a TileLang GEMV for at
most 8 rows (``gemv``, ``gemv_rows``) and cuBLAS through torch above. ``paged_kv_write`` and ``mla_decode``
also take the uint8 caches of FP8 latent rows (``kv_cache_dtype = "fp8"``: ``kv_cache``, ``mla_decode``).

The attention and MoE kernels use the tensor cores for bfloat16/float16 only; called with float32
tensors they run the reference (tf32 tensor-core math would miss float32 tolerances).
"""

from deepinfer_core.kernels import KernelBackend

#: module name per kernel submodule; each has ``representative_kernels()`` for the compile test.
KERNEL_MODULES = ("gemv", "gemv_rows", "gemv_mma", "norm_gemv", "mla_kv_write",
                  "norm", "elementwise", "kv_cache", "mla_decode", "mla_decode_ws", "mla_decode_uv",
                  "mla_prefill", "moe", "moe_gemv",
                  "moe_stream",
                  "moe_route", "moe_gate", "sampling", "draft_lengths",
                  "v4_attention", "v4_compress", "v4_indexer", "v4_mhc", "v4_moe",
                  "mxfp8", "fp8_gemm", "fp8_gemv", "moe_gemv_fp8", "moe_stream_fp8")


class CudaKernels(KernelBackend):
    name = "cuda"
    core_api_version = "1.0"

    @classmethod
    def check_environment(cls) -> None:
        """The kernels' switches (each also read where it applies): on/off ``DEEPINFER_TL_DRYRUN``, ``_PDL``,
        ``_NORM_GEMV``, ``_KV_FUSION``, ``_UV_FUSION``, ``_FP8_GEMV``; ``DEEPINFER_MOE_DOWN`` (loop | slots) and
        ``DEEPINFER_FP8_MOE_UP`` (fma | mma)."""
        from kernels_cuda import _tl, fp8_gemm, gemv_rows, mla_decode_uv, moe_gemv, moe_gemv_fp8, norm_gemv

        for read in (_tl.dry_run, _tl.pdl, norm_gemv.enabled, gemv_rows.kv_fusion_enabled, mla_decode_uv.enabled,
                     fp8_gemm.gemv_enabled, moe_gemv.down_choice, moe_gemv_fp8.up_kind):
            read()
    ops: dict[str, str] = {
        "linear": "kernels_cuda.gemv:linear",
        "linear_f32": "kernels_cuda.gemv:linear_f32",
        "add_rms_norm_linear": "kernels_cuda.norm_gemv:add_rms_norm_linear",
        "head_linear": "kernels_cuda.gemv_rows:head_linear",
        "mla_q_absorb": "kernels_cuda.gemv_rows:mla_q_absorb",
        "mla_q_absorb_kv_write": "kernels_cuda.gemv_rows:mla_q_absorb_kv_write",
        "mla_kv_write": "kernels_cuda.mla_kv_write:mla_kv_write",
        "rms_norm": "kernels_cuda.norm:rms_norm",
        "add_rms_norm": "kernels_cuda.norm:add_rms_norm",
        "rope": "kernels_cuda.elementwise:rope",
        "silu_and_mul": "kernels_cuda.elementwise:silu_and_mul",
        "paged_kv_write": "kernels_cuda.kv_cache:paged_kv_write",
        "mla_decode": "kernels_cuda.mla_decode:mla_decode",
        "mla_decode_uv": "kernels_cuda.mla_decode_uv:mla_decode_uv",
        "mla_prefill": "kernels_cuda.mla_prefill:mla_prefill",
        "moe_route": "kernels_cuda.moe_route:moe_route",
        "moe_gate": "kernels_cuda.moe_route:moe_gate",
        "add_rms_norm_moe_gate": "kernels_cuda.moe_gate:add_rms_norm_moe_gate",
        "fused_moe": "kernels_cuda.moe:fused_moe",
        "sample": "kernels_cuda.sampling:sample",
        "greedy_sample": "kernels_cuda.sampling:greedy_sample",
        "draft_lengths": "kernels_cuda.draft_lengths:draft_lengths",
        # DeepSeek-V4 (``mhc_head``, ``rope_inverse`` and ``silu_and_mul_clamped`` stay the reference: one
        # call per step, or torch element-wise ops the clamped fused MoE already replaces on the hot path)
        "v4_sparse_attention": "kernels_cuda.v4_attention:v4_sparse_attention",
        "v4_compress": "kernels_cuda.v4_compress:v4_compress",
        "v4_indexer_topk": "kernels_cuda.v4_indexer:v4_indexer_topk",
        "mhc_pre": "kernels_cuda.v4_mhc:mhc_pre",
        "mhc_post": "kernels_cuda.v4_mhc:mhc_post",
        "moe_route_v4": "kernels_cuda.v4_moe:moe_route_v4",
        "fused_moe_clamped": "kernels_cuda.v4_moe:fused_moe_clamped",
        "ue8m0_scale": "kernels_cuda.mxfp8:ue8m0_scale",
        "mxfp8_quant": "kernels_cuda.mxfp8:mxfp8_quant",
        "mxfp8_dequant": "kernels_cuda.mxfp8:mxfp8_dequant",
        # block-scaled FP8 weights (sm_90a e4m3 wgmma; dense prefill through cuBLAS's blockwise _scaled_mm)
        "fp8_linear": "kernels_cuda.fp8_gemm:fp8_linear",
        "fused_moe_fp8": "kernels_cuda.fp8_gemm:fused_moe_fp8",
    }
