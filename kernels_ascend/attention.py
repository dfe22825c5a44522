"""Paged latent-cache writes and MLA attention through torch_npu.

``npu_fused_infer_attention_score_v2`` (FIA) is used where its documented constraints hold:

* decode (absorbed MLA, paged): fp16/bf16, latent 512 + rope 64, 1..128 query heads (a power of
  two), block size 16 or 128, at most 16 query tokens per sequence;
* prefill (expanded MLA, ragged ``TND``): fp16/bf16, qk head dim 192 with v 128/192, or 128/128.

Everything else (float32 models, test-sized shapes, and decode steps being captured into an NPU
graph, since FIA takes sequence lengths as host lists) runs the same math in plain torch on the NPU,
written without host synchronisation so that it can be captured.

Layout gap: FIA's MLA mode reads the latent and rope keys as two contiguous caches
(``[blocks, block_size, 512]`` and ``[blocks, block_size, 64]``); the registry's latent cache is one
``[blocks, block_size, 576]`` tensor. Until the platform can declare a split latent cache, the FIA
decode path first copies the blocks the batch reads into the two planes (see docs/ascend.md).
"""

from __future__ import annotations

import math

import torch

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


def paged_kv_write(cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """One ``npu_scatter_nd_update_`` with no host synchronisation. The scatter takes no negative
    index, so a row with slot -1 (padding) rewrites the row of a real slot of the same call with that
    slot's own new value (every duplicate index carries the same value), or, when no slot of the call
    is real, slot 0 with its current value."""
    import torch_npu

    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    first = keep.to(torch.int32).argmax()  # a real row, or 0 when there is none
    rows = torch.where(keep, torch.arange(keep.shape[0], device=keep.device), first)
    slots = slot_mapping[rows].clamp(min=0)
    values = torch.where(keep[rows, None], kv[rows].to(cache.dtype), flat[slots])
    torch_npu.npu_scatter_nd_update_(flat, slots.view(-1, 1), values)


# ---- decode --------------------------------------------------------------------------------
def _capturing() -> bool:
    import torch_npu

    return bool(torch_npu.npu.is_current_stream_capturing())


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, cu_q_lens: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, dv: int) -> torch.Tensor:
    T, H, D = q.shape
    fits = (q.dtype in (torch.float16, torch.bfloat16) and dv == 512 and D - dv == 64 and H in _FIA_MLA_HEADS
            and cache.shape[1] in (16, 128))
    # the FIA path reads lengths on the host anyway, so its last check may too
    if fits and not _capturing() and int((cu_q_lens[1:] - cu_q_lens[:-1]).max()) <= 16:
        return _mla_decode_fia(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv)
    return _mla_decode_torch(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv)


def _mla_decode_fia(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv):
    import torch_npu

    B, bs = seq_lens.shape[0], cache.shape[1]
    T, H, D = q.shape
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).tolist()
    kv_lens = seq_lens.tolist()
    max_q = max(q_lens)
    # the blocks each sequence reads, copied into contiguous latent and rope planes (the layout gap)
    nblocks = [math.ceil(n / bs) for n in kv_lens]
    width = max(nblocks)
    cols = torch.arange(width, device=q.device)
    used = cols[None, :] < torch.tensor(nblocks, device=q.device)[:, None]
    blocks = cache[block_tables[:, :width].long()[used]]  # [sum(nblocks), bs, D]
    k_nope, k_rope = blocks[..., :dv].contiguous(), blocks[..., dv:].contiguous()
    table = torch.zeros(B, width, dtype=torch.int32, device=q.device)
    table[used] = torch.arange(blocks.shape[0], dtype=torch.int32, device=q.device)
    # queries in a [B, max_q] grid (BSND), left-aligned; padded rows are ignored via actual_seq_qlen
    seq_of_tok = torch.repeat_interleave(torch.arange(B, device=q.device), cu_q_lens[1:] - cu_q_lens[:-1],
                                         output_size=T)
    j_of_tok = torch.arange(T, device=q.device) - cu_q_lens[:-1][seq_of_tok]
    grid = q.new_zeros(B, max_q, H, D).index_put_((seq_of_tok, j_of_tok), q)
    causal = max_q > 1
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        grid[..., :dv].contiguous(), k_nope, k_nope,
        query_rope=grid[..., dv:].contiguous(), key_rope=k_rope,
        atten_mask=_causal_mask(q.device) if causal else None,
        actual_seq_qlen=q_lens if causal else None, actual_seq_kvlen=kv_lens,
        block_table=table, num_query_heads=H, num_key_value_heads=1, softmax_scale=scale,
        input_layout="BSND", sparse_mode=3 if causal else 0, block_size=bs,
    )
    return out[seq_of_tok, j_of_tok]


def _mla_decode_torch(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv):
    """The reference math with every width fixed by shapes (no host synchronisation): queries per
    sequence are at most T - B + 1, keys at most the block table's width times the block size."""
    B, bs = seq_lens.shape[0], cache.shape[1]
    T, H, D = q.shape
    max_q = T - B + 1
    max_len = block_tables.shape[1] * bs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    pos = torch.arange(max_len, device=q.device)
    slots = block_tables.long()[:, pos // bs].clamp(min=0) * bs + pos % bs  # [B, max_len]
    kv = cache.view(-1, D)[slots]
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
