"""Paged latent-cache writes and MLA attention through torch_npu.

The platform stores an MLA latent cache as two planes per layer (``AscendPlatform.kv_cache_planes``):
``[blocks, block_size, kv_lora_rank]`` (latent, "nope") and ``[blocks, block_size, rope_dim]`` (rope
key), the two contiguous paged caches FIA's MLA mode reads through ``block_table``. The ops here take
a layer's cache as those planes (``cache_planes``) or as one tensor (groups without parts), and never
copy the cache.

``npu_fused_infer_attention_score_v2`` (FIA) is used where its documented constraints hold:

* decode (absorbed MLA, paged): fp16/bf16, latent plane 512 + rope plane 64, 1..128 query heads (a
  power of two), block size 16 or 128, at most 16 query tokens per sequence;
* prefill (expanded MLA, ragged ``TND``): fp16/bf16, qk head dim 192 with v 128/192, or 128/128.

Everything else (float32 models, test-sized shapes, a cache stored as one plane) runs the same math
in plain torch on the NPU, written without host synchronisation so that it can be captured. Decode
steps captured into an NPU graph take FIA too when the graph's lengths are given as host lists that
the runner updates before each replay (``kernels_ascend.graph``, docs/ascend.md).
"""

from __future__ import annotations

import torch

from deepinfer_core.kv_cache_spec import LayerCache, cache_planes
from kernels_ascend import graph
from kernels_cpu import ops as reference

#: sparse_mode=3 ("rightDownCausal") takes this fixed, optimised lower-triangular mask (docs: 2048x2048).
_CAUSAL_MASK_SIZE = 2048
_masks: dict[torch.device, torch.Tensor] = {}
_FIA_MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def _causal_mask(device: torch.device) -> torch.Tensor:
    """True where attention is masked out (key after query), as FIA's sparse modes 2-4 expect."""
    if device not in _masks:
        n = _CAUSAL_MASK_SIZE
        _masks[device] = torch.ones(n, n, dtype=torch.bool, device=device).triu(diagonal=1)
    return _masks[device]


def paged_kv_write(cache: LayerCache, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """One ``npu_scatter_nd_update_`` per plane with no host synchronisation. The scatter takes no
    negative index, so a row with slot -1 (padding) rewrites the row of a real slot of the same call
    with that slot's own new value (every duplicate index carries the same value), or, when no slot of
    the call is real, slot 0 with its current value."""
    import torch_npu

    keep = slot_mapping >= 0
    first = keep.to(torch.int32).argmax()  # a real row, or 0 when there is none
    rows = torch.where(keep, torch.arange(keep.shape[0], device=keep.device), first)
    slots = slot_mapping[rows].clamp(min=0)
    col = 0
    for plane in cache_planes(cache):
        flat = plane.view(-1, plane.shape[-1])
        new = kv[rows, col : col + flat.shape[1]].to(plane.dtype)
        values = torch.where(keep[rows, None], new, flat[slots])
        torch_npu.npu_scatter_nd_update_(flat, slots.view(-1, 1), values)
        col += flat.shape[1]


def paged_kv_gather(cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Plain torch (prefill with a cached prefix only): the reference gather of each plane, joined."""
    planes = cache_planes(cache)
    if len(planes) == 1:
        return reference.paged_kv_gather(planes[0], block_tables, seq_lens)
    return torch.cat([reference.paged_kv_gather(p, block_tables, seq_lens) for p in planes], dim=-1)


# ---- decode --------------------------------------------------------------------------------
def fia_decode_fits(q: torch.Tensor, cache: LayerCache, dv: int) -> bool:
    """Whether FIA's MLA mode takes this decode (docs: npu_fused_infer_attention_score_v2, 约束说明,
    MLA), the query-length limit (<= 16 per sequence) aside."""
    planes = cache_planes(cache)
    T, H, D = q.shape
    return (q.dtype in (torch.float16, torch.bfloat16) and len(planes) == 2 and dv == 512 == planes[0].shape[-1]
            and D - dv == 64 == planes[1].shape[-1] and H in _FIA_MLA_HEADS and planes[0].shape[1] in (16, 128)
            and all(p.dtype == q.dtype for p in planes))


def mla_decode(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, cu_q_lens: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, dv: int) -> torch.Tensor:
    if fia_decode_fits(q, cache, dv):
        B = seq_lens.shape[0]
        if not _capturing():
            # FIA reads lengths on the host anyway: one copy brings both
            q_lens, kv_lens = torch.stack((cu_q_lens[1:] - cu_q_lens[:-1], seq_lens.to(cu_q_lens.dtype))).tolist()
            if max(q_lens) <= 16:
                return _mla_decode_fia(q, cache, block_tables, cu_q_lens, q_lens, kv_lens, scale, dv)
        elif q.shape[0] == B and graph.host_lengths_updated():
            # a decode graph (one query per sequence) whose FIA lengths the platform updates before every
            # replay (AscendPlatform.graph_replay). Captured with the longest lengths the block table
            # allows, so that the workspace torch_npu sizes at capture covers every replay.
            longest = block_tables.shape[1] * cache_planes(cache)[0].shape[1]
            return _mla_decode_fia(q, cache, block_tables, cu_q_lens, [1] * B, [longest] * B, scale, dv)
    return _mla_decode_torch(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv)


def _capturing() -> bool:
    import torch_npu

    return bool(torch_npu.npu.is_current_stream_capturing())


def _mla_decode_fia(q, cache, block_tables, cu_q_lens, q_lens: list[int], kv_lens: list[int], scale, dv):
    """FIA over the two planes in place: the engine's block table is FIA's ``block_table``."""
    import torch_npu

    nope, rope = cache_planes(cache)
    B, bs = len(kv_lens), nope.shape[1]
    T, H, D = q.shape
    max_q = max(q_lens)
    # queries in a [B, max_q] grid (BSND), left-aligned; padded rows are ignored via actual_seq_qlen
    seq_of_tok = torch.repeat_interleave(torch.arange(B, device=q.device), cu_q_lens[1:] - cu_q_lens[:-1],
                                         output_size=T)
    j_of_tok = torch.arange(T, device=q.device) - cu_q_lens[:-1][seq_of_tok]
    grid = q.new_zeros(B, max_q, H, D).index_put_((seq_of_tok, j_of_tok), q)
    causal = max_q > 1
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        grid[..., :dv].contiguous(), nope, nope,
        query_rope=grid[..., dv:].contiguous(), key_rope=rope,
        atten_mask=_causal_mask(q.device) if causal else None,
        actual_seq_qlen=q_lens if causal else None, actual_seq_kvlen=kv_lens,
        block_table=block_tables.to(torch.int32), num_query_heads=H, num_key_value_heads=1, softmax_scale=scale,
        input_layout="BSND", sparse_mode=3 if causal else 0, block_size=bs,
    )
    return out[seq_of_tok, j_of_tok]


def _mla_decode_torch(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv):
    """The reference math with every width fixed by shapes (no host synchronisation): queries per
    sequence are at most T - B + 1, keys at most the block table's width times the block size."""
    planes = cache_planes(cache)
    B, bs = seq_lens.shape[0], planes[0].shape[1]
    T, H, D = q.shape
    max_q = T - B + 1
    max_len = block_tables.shape[1] * bs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    pos = torch.arange(max_len, device=q.device)
    slots = block_tables.long()[:, pos // bs].clamp(min=0) * bs + pos % bs  # [B, max_len]
    kv = torch.cat([p.view(-1, p.shape[-1])[slots] for p in planes], dim=-1)
    seq_of_tok = torch.repeat_interleave(torch.arange(B, device=q.device), q_lens, output_size=T)
    j_of_tok = torch.arange(T, device=q.device) - cu_q_lens[:-1][seq_of_tok]
    qg = q.new_zeros(B, max_q, H, D).index_put_((seq_of_tok, j_of_tok), q)
    qpos = seq_lens[:, None] - q_lens[:, None] + torch.arange(max_q, device=q.device)[None, :]
    mask = (pos[None, None, :] <= qpos[:, :, None]) & (pos[None, None, :] < seq_lens[:, None, None])
    scores = torch.einsum("bqhd,bld->bqhl", qg.float(), kv.float()) * scale
    probs = scores.masked_fill(~mask[:, :, None, :], float("-inf")).softmax(-1)
    out = torch.einsum("bqhl,bld->bqhd", probs.nan_to_num(0.0), kv[..., :dv].float())
    return out[seq_of_tok, j_of_tok].to(q.dtype)


# ---- prefill -------------------------------------------------------------------------------
def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q_lens: torch.Tensor,
                cu_k_lens: torch.Tensor, scale: float) -> torch.Tensor:
    T, H, dqk = q.shape
    dv = v.shape[-1]
    fits = q.dtype in (torch.float16, torch.bfloat16) and ((dqk, dv) in ((128, 128), (192, 128), (192, 192)))
    if not fits:
        return reference.mla_prefill(q, k, v, cu_q_lens, cu_k_lens, scale)
    import torch_npu

    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        q.contiguous(), k.contiguous(), v.contiguous(), atten_mask=_causal_mask(q.device),
        actual_seq_qlen=cu_q_lens[1:].tolist(), actual_seq_kvlen=cu_k_lens[1:].tolist(),
        num_query_heads=H, num_key_value_heads=k.shape[1], softmax_scale=scale, input_layout="TND",
        sparse_mode=3,
    )
    return out
