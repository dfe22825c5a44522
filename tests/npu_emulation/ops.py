"""Plain-torch semantics of the torch_npu 2.14.0 ops kernels_ascend calls.

Each function takes exactly its op's schema parameters (checked when the emulation is built) and
follows the op's docstring in ``torch_npu/_op_plugin_docs.py`` of the pinned wheel (cited as
"docs: <op>, <section>"). Documented constraints the kernels rely on are enforced (``_need``);
features the kernels do not use raise ``NotImplementedError`` rather than guess. Outputs the docs
call undefined are filled with NaN, so a caller that reads them fails the conformance check.
"""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _need(cond: bool, op: str, what: str) -> None:
    if not cond:
        raise ValueError(f"torch_npu.{op}: {what}")


def _unused(op: str, **given) -> None:
    for name, value in given.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"torch_npu.{op}: argument {name!r} is not emulated")


# ---- norms, activation, rotary --------------------------------------------------------------
def npu_rms_norm(self, gamma, epsilon):
    """docs: npu_rms_norm, 参数说明/输出说明: y = x * rsqrt(mean(x^2) + eps) * gamma over gamma's
    dims; gamma has self's dtype; outputs (y, rstd)."""
    op = "npu_rms_norm"
    _need(self.dtype in _FLOATS, op, f"self dtype {self.dtype} (float16, bfloat16, float32 only)")
    _need(gamma.dtype == self.dtype, op, f"gamma dtype {gamma.dtype} must equal self's {self.dtype}")
    dims = tuple(range(-gamma.dim(), 0))
    xf = self.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(self.dtype), rstd


def npu_swiglu(self, dim):
    """docs: npu_swiglu, 功能描述: out = A * sigmoid(A) * B with x = [A | B] split along dim."""
    _need(self.dtype in _FLOATS, "npu_swiglu", f"dtype {self.dtype} (FP32, FP16, BF16 only)")
    a, b = self.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(self.dtype)


def npu_clipped_swiglu(x, group_index, dim, alpha, limit, bias, interleaved):
    """docs: npu_clipped_swiglu, 计算公式 (1)-(5): split x along dim into A, B (halves, or even/odd
    when interleaved); A = A.clamp(max=limit), B = B.clamp(-limit, limit); y = A * sigmoid(alpha * A) *
    (B + bias); 参数说明: float16/bfloat16/float32, contiguous, more than 1-D, dim even."""
    op = "npu_clipped_swiglu"
    _unused(op, group_index=group_index)
    _need(x.dtype in _FLOATS and x.is_contiguous() and x.dim() > 1, op,
          "x must be a contiguous float16/bfloat16/float32 tensor of more than 1 dim")
    _need(x.shape[dim] % 2 == 0, op, f"dim {dim} of x has odd size {x.shape[dim]}")
    xf = x.float().movedim(dim, -1)
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
    return (a * torch.sigmoid(alpha * a) * (b + bias)).movedim(-1, dim).to(x.dtype)


def npu_rotary_mul(self, r1, r2, rotary_mode, rotate):
    """docs: npu_rotary_mul, 功能描述 (interleave: x_new pairs (-x[2i+1], x[2i]); out = r1*x + r2*x_new)
    and 约束说明 (4-D input, interleave with BSND input takes r1/r2 laid out 1S1D, D even and < 896,
    B*N < 1000)."""
    op = "npu_rotary_mul"
    _unused(op, rotate=rotate)
    _need(self.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, op, "input, r1 and r2 must be 4-D")
    _need(self.dtype in _FLOATS and r1.dtype == r2.dtype == self.dtype, op, "r1/r2 must have the input's dtype")
    B, S, N, D = self.shape
    _need(D % 2 == 0 and D < 896 and B * N < 1000, op, f"D={D} must be even and < 896, B*N={B * N} < 1000")
    if rotary_mode != "interleave":
        raise NotImplementedError(f"torch_npu.{op}: rotary_mode={rotary_mode!r} is not emulated")
    _need(tuple(r1.shape) == (1, S, 1, D) and r1.shape == r2.shape, op,
          f"interleave mode with a BSND input takes r1/r2 of shape 1S1D {(1, S, 1, D)}, got {tuple(r1.shape)}")
    x = self.float()
    x_new = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (r1.float() * x + r2.float() * x_new).to(self.dtype)


# ---- cache writes -----------------------------------------------------------------------------
def npu_scatter_nd_update_(self, indices, updates):
    """docs: npu_scatter_nd_update_, 约束说明: indices at least 2-D, last dim a <= self.dim();
    updates shape = indices.shape[:-1] + self.shape[a:]; same dtype; no out-of-range index."""
    op = "npu_scatter_nd_update_"
    _need(indices.dtype in (torch.int32, torch.int64) and indices.dim() >= 2, op, "indices: int32/int64, >= 2-D")
    a = indices.shape[-1]
    _need(a <= self.dim(), op, "indices' last dim exceeds input's rank")
    _need(updates.dtype == self.dtype, op, f"updates dtype {updates.dtype} != input dtype {self.dtype}")
    want = tuple(indices.shape[:-1]) + tuple(self.shape[a:])
    _need(tuple(updates.shape) == want, op, f"updates shape {tuple(updates.shape)}, expected {want}")
    for d in range(a):
        idx = indices[..., d]
        _need(bool(((idx >= 0) & (idx < self.shape[d])).all()), op, "an index is out of range (not supported)")
    self[tuple(indices.long().unbind(-1))] = updates
    return self


# ---- MoE --------------------------------------------------------------------------------------
def npu_moe_gating_top_k(x, k, bias, input_ids, tid2eid, k_group, group_count, group_select_mode, renorm,
                         norm_type, out_flag, routed_scaling_factor, eps):
    """docs: npu_moe_gating_top_k, 参数说明 and 返回值说明: norm = softmax (norm_type 0) or sigmoid (1) of
    x; selection on norm + bias: groups scored by their max (group_select_mode 0) or top-2 sum (1),
    the best k_group of group_count groups kept, then the top k experts; expert_idx_out int32;
    norm_out float32. y_out is "the result of norm and grouped top-k": emulated as the selected
    norm values times routed_scaling_factor (whether the op renormalises them is not documented;
    kernels_ascend reads norm_out instead)."""
    op = "npu_moe_gating_top_k"
    _unused(op, input_ids=input_ids, tid2eid=tid2eid)
    _need(x.dim() == 2 and x.dtype in _FLOATS, op, "x must be 2-D float16/bfloat16/float32")
    T, E = x.shape
    _need(E <= 2048, op, f"{E} experts (at most 2048)")
    _need(bias is None or (bias.dim() == 1 and bias.shape[0] == E and bias.dtype == x.dtype), op,
          "bias must be 1-D [E] with x's dtype")
    _need(group_count > 0 and E % group_count == 0 and E // group_count > 2, op,
          f"E={E} must split into group_count={group_count} groups of more than 2")
    _need(-(-(E // group_count) // 32) * 32 * group_count <= 2048, op, "32-aligned group size * group_count > 2048")
    _need(1 <= k_group <= group_count, op, f"k_group={k_group} not in [1, group_count]")
    _need(1 <= k <= E // group_count * k_group, op, f"k={k} not in [1, E / group_count * k_group]")
    norm = x.float().softmax(-1) if norm_type == 0 else x.float().sigmoid()
    choice = norm if bias is None else norm + bias.float()
    if group_count > 1:
        grouped = choice.view(T, group_count, E // group_count)
        score = grouped.amax(-1) if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(k_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // group_count, dim=1), float("-inf"))
    idx = choice.topk(k, dim=-1).indices
    y = (norm.gather(1, idx) * routed_scaling_factor).to(x.dtype)
    return y, idx.to(torch.int32), norm


def npu_moe_init_routing_v2(x, expert_idx, scale, offset, active_num, expert_capacity, expert_num, drop_pad_mode,
                            expert_tokens_num_type, expert_tokens_num_flag, quant_mode, active_expert_range,
                            row_idx_type, x_dtype):
    """docs: npu_moe_init_routing_v2, 参数说明/输出说明 (formulas as in npu_moe_init_routing: sort the
    flattened expert_idx -> sorted_row_idx; expanded_row_idx[sorted_row_idx[i]] = i; expanded_x[i] =
    x[sorted_row_idx[i] // K]). Only ids in active_expert_range [start, end) are routed: the first
    available_idx_num rows of expanded_x are valid (the rest undefined: NaN here); with row_idx_type 0
    (gather index) expanded_row_idx holds -1 for the others; expert_tokens_num_type 1 gives the count
    per expert of the range (int64). The flattening is token-major (i * K + k), the order
    npu_moe_token_permute documents for its sorted_indices."""
    op = "npu_moe_init_routing_v2"
    _unused(op, scale=scale, offset=offset, x_dtype=x_dtype)
    _need(x.dim() == 2 and x.dtype in _FLOATS, op, "x must be 2-D float16/bfloat16/float32")
    _need(expert_idx.dim() == 2 and expert_idx.dtype == torch.int32 and expert_idx.shape[0] == x.shape[0], op,
          "expert_idx must be int32 [NUM_ROWS, K]")
    _need(expert_num > 0 and bool(((expert_idx >= 0) & (expert_idx < expert_num)).all()), op,
          "expert ids must lie in [0, expert_num)")
    if quant_mode != -1 or expert_tokens_num_type != 1 or row_idx_type != 0 or active_num > 0:
        raise NotImplementedError(f"torch_npu.{op}: only quant_mode=-1, expert_tokens_num_type=1, row_idx_type=0 "
                                  "and active_num<=0 are emulated")
    _need(len(active_expert_range) == 2, op, "active_expert_range must be [expert_start, expert_end]")
    start, end = active_expert_range
    _need(0 <= start < end <= expert_num, op, f"active_expert_range {active_expert_range} outside [0, expert_num]")
    N, K = expert_idx.shape
    flat = expert_idx.flatten().long()
    active = (flat >= start) & (flat < end)
    order = torch.argsort(torch.where(active, flat, end), stable=True)
    n_valid = int(active.sum())
    expanded_x = torch.full((N * K, x.shape[1]), float("nan"), dtype=x.dtype)
    expanded_x[:n_valid] = x[order[:n_valid] // K]
    row_idx = torch.full((N * K,), -1, dtype=torch.int32)
    row_idx[order[:n_valid]] = torch.arange(n_valid, dtype=torch.int32)
    counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
    return expanded_x, row_idx, counts, torch.full((N * K,), float("nan"))


def npu_grouped_matmul(x, weight, bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                       group_list, activation_input, activation_quant_scale, activation_quant_offset, split_item,
                       group_type, group_list_type, act_type, tuning_config, output_dtype, x_dtype, weight_dtype,
                       scale_dtype, per_token_scale_dtype):
    """docs: npu_grouped_matmul, 计算公式 (non-quantised: y_i = x_i @ weight_i) and 参数说明: one x and
    one 3-D weight [E, K, N] grouped along m (group_type 0) by a tensor group_list (int64; cumsum for
    group_list_type 0, counts for 1); split_item 2/3 returns one tensor. Rows past the last group are
    not computed (NaN here)."""
    op = "npu_grouped_matmul"
    _unused(op, bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
            antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, activation_input=activation_input,
            activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
            tuning_config=tuning_config, output_dtype=output_dtype, x_dtype=x_dtype, weight_dtype=weight_dtype,
            scale_dtype=scale_dtype, per_token_scale_dtype=per_token_scale_dtype)
    if len(x) != 1 or len(weight) != 1 or weight[0].dim() != 3 or split_item not in (2, 3) or group_type != 0 \
            or act_type != 0:
        raise NotImplementedError(f"torch_npu.{op}: only one x, one 3-D weight, split_item 2/3, group_type 0 and "
                                  "act_type 0 are emulated")
    a, w = x[0], weight[0]
    _need(a.dim() == 2 and a.dtype in _FLOATS and w.dtype == a.dtype, op, "x and weight: 2-D/3-D, same float dtype")
    E, Kd, N = w.shape
    _need(a.shape[1] == Kd, op, f"x has K={a.shape[1]}, weight K={Kd}")
    _need(Kd < 65536 and N < 65536, op, "inner axis limit 65536")
    _need(group_list is not None and group_list.dtype == torch.int64 and group_list.shape == (E,), op,
          "group_list must be an int64 tensor [E]")
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    _need(bool((counts >= 0).all()) and int(counts.sum()) <= a.shape[0], op, "group_list exceeds x's rows")
    out = torch.full((a.shape[0], N), float("nan"), dtype=a.dtype)
    start = 0
    for e, n in enumerate(counts.tolist()):
        out[start : start + n] = (a[start : start + n].float() @ w[e].float()).to(a.dtype)
        start += n
    return [out]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode, k):
    """docs: npu_moe_finalize_routing, 计算公式: out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] *
    (rows[expanded_src_to_dst_row[i + k * num_rows]] + bias[expert[i, k]]); 参数说明: src_to_dst int32
    in [0, NUM_ROWS * K - 1]; scales [NUM_ROWS, K] with the rows' dtype; skip1 needs skip2."""
    op = "npu_moe_finalize_routing"
    rows = expanded_permuted_rows
    _need(rows.dim() == 2 and rows.dtype in _FLOATS, op, "expanded_permuted_rows must be 2-D float")
    _need(skip2 is not None or skip1 is None, op, "skip1 given without skip2")
    _need(bias is None or export_for_source_row is not None, op, "bias needs export_for_source_row")
    K = scales.shape[1] if scales is not None else k
    idx = expanded_src_to_dst_row
    _need(idx.dtype == torch.int32 and idx.dim() == 1 and idx.numel() % K == 0, op,
          "expanded_src_to_dst_row must be int32 [NUM_ROWS * K]")
    num_rows = idx.numel() // K
    _need(rows.shape[0] == num_rows * K, op, "expanded_permuted_rows must have NUM_ROWS * K rows")
    _need(bool(((idx >= 0) & (idx < num_rows * K)).all()), op, "expanded_src_to_dst_row outside [0, NUM_ROWS*K-1]")
    _need(scales is None or (scales.dtype == rows.dtype and tuple(scales.shape) == (num_rows, K)), op,
          "scales must be [NUM_ROWS, K] with the rows' dtype")
    gathered = rows.float()[idx.long().view(K, num_rows)]  # [K, NUM_ROWS, H]
    if bias is not None:
        gathered = gathered + bias.float()[export_for_source_row.long().t()]
    w = scales.float().t()[..., None] if scales is not None else 1.0
    out = (gathered * w).sum(0)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows.dtype)


# ---- sampling ---------------------------------------------------------------------------------
def npu_top_k_top_p(logits, p, k):
    """docs: npu_top_k_top_p, 计算公式 steps 1-9: ascending stable sort; top-k keeps values >= the
    k-th largest; softmax; ascending cumsum; top-p masks positions with cumsum <= 1 - p, never the
    last (largest); masked entries become -inf, in the original order."""
    op = "npu_top_k_top_p"
    _need(logits.dim() == 2 and logits.dtype in _FLOATS, op, "logits must be 2-D bfloat16/float16/float32")
    _need(p is not None or k is not None, op, "p and k cannot both be None")
    B, V = logits.shape
    _need(p is None or (p.dtype == logits.dtype and tuple(p.shape) == (B,)), op, "p must be [B] with logits' dtype")
    _need(k is None or (k.dtype == torch.int32 and tuple(k.shape) == (B,) and bool(((k >= 1) & (k <= 1024)
                                                                                       & (k <= V)).all())),
          op, "k must be int32 [B] in [1, min(1024, V)]")
    values, indices = logits.sort(dim=-1, descending=False, stable=True)
    if k is not None:
        kth = values.gather(1, (V - k.long())[:, None])
        values = values.masked_fill(values < kth, float("-inf"))
    if p is not None:
        cum = values.float().softmax(-1).cumsum(-1)
        mask = cum <= 1 - p.float()[:, None]
        mask[:, -1] = False
        values = values.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, indices, values)


# ---- attention --------------------------------------------------------------------------------
_MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def npu_fused_infer_attention_score_v2(
    query, key, value, query_rope, key_rope, pse_shift, atten_mask, actual_seq_qlen, actual_seq_kvlen,
    block_table, dequant_scale_query, dequant_scale_key, dequant_offset_key, dequant_scale_value,
    dequant_offset_value, dequant_scale_key_rope, quant_scale_out, quant_offset_out, quant_scale_p, learnable_sink,
    num_query_heads, num_key_value_heads, softmax_scale, pre_tokens, next_tokens, input_layout, sparse_mode,
    block_size, query_quant_mode, key_quant_mode, value_quant_mode, inner_precise, return_softmax_lse, query_dtype,
    key_dtype, value_dtype, query_rope_dtype, key_rope_dtype, key_shared_prefix_dtype, value_shared_prefix_dtype,
    dequant_scale_query_dtype, dequant_scale_key_dtype, dequant_scale_value_dtype, dequant_scale_key_rope_dtype,
    out_dtype,
):
    """docs: npu_fused_infer_attention_score_v2. 功能描述: out = softmax(scale * q k^T + mask) v; MLA
    (query_rope/key_rope given): scores add query_rope . key_rope, query S 1-16, N in 1..128 (powers of
    2), key N 1 and D 512, rope D 64 (约束说明, MLA). query/key/value/rope: float16/bfloat16,
    contiguous (参数说明). page attention: block_table int32 [B, >= max blocks], key/value
    (blocknum, blocksize, H) for BSH/BSND queries, actual_seq_kvlen per batch required, block size 16 or
    128 in MLA mode, where Q_S 1 takes sparse_mode 0 without a mask and Q_S > 1 sparse_mode 3
    (约束说明, MLA). TND: actual_seq_qlen/kvlen are cumulative. sparse_mode 0 without mask (full), 3
    rightDownCausal with the optimised 2048x2048 mask: query i of a batch sees keys <= kv_len - q_len + i.
    Emulated: BSND (paged) and TND (unpaged), sparse modes 0 and 3, no quantisation."""
    op = "npu_fused_infer_attention_score_v2"
    _unused(op, pse_shift=pse_shift, dequant_scale_query=dequant_scale_query, dequant_scale_key=dequant_scale_key,
            dequant_offset_key=dequant_offset_key, dequant_scale_value=dequant_scale_value,
            dequant_offset_value=dequant_offset_value, dequant_scale_key_rope=dequant_scale_key_rope,
            quant_scale_out=quant_scale_out, quant_offset_out=quant_offset_out, quant_scale_p=quant_scale_p,
            learnable_sink=learnable_sink, return_softmax_lse=return_softmax_lse, query_dtype=query_dtype,
            key_dtype=key_dtype, value_dtype=value_dtype, query_rope_dtype=query_rope_dtype,
            key_rope_dtype=key_rope_dtype, key_shared_prefix_dtype=key_shared_prefix_dtype,
            value_shared_prefix_dtype=value_shared_prefix_dtype, dequant_scale_query_dtype=dequant_scale_query_dtype,
            dequant_scale_key_dtype=dequant_scale_key_dtype, dequant_scale_value_dtype=dequant_scale_value_dtype,
            dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype, out_dtype=out_dtype)
    if pre_tokens != 2147483647 or next_tokens != 2147483647 or inner_precise != 0 or query_quant_mode \
            or key_quant_mode or value_quant_mode:
        raise NotImplementedError(f"torch_npu.{op}: only the default pre/next_tokens, precision and quant modes "
                                  "are emulated")
    tensors = {"query": query, "key": key, "value": value, "query_rope": query_rope, "key_rope": key_rope}
    for name, t in tensors.items():
        if t is not None:
            _need(t.dtype in _HALF, op, f"{name} dtype {t.dtype} (float16/bfloat16 only)")
            _need(t.is_contiguous(), op, f"{name} is not contiguous (non-contiguous tensors are not supported)")
    _need(key.dtype == value.dtype == query.dtype, op, "query, key and value must share a dtype")
    _need((query_rope is None) == (key_rope is None), op, "query_rope and key_rope go together")
    mla = query_rope is not None
    if sparse_mode == 0:
        _need(atten_mask is None, op, "sparse_mode 0 with a mask is not emulated")
    elif sparse_mode == 3:
        _need(atten_mask is not None and atten_mask.dtype == torch.bool
              and tuple(atten_mask.shape[-2:]) == (2048, 2048), op, "sparse_mode 3 needs the 2048x2048 mask")
        _need(bool(torch.equal(atten_mask.reshape(2048, 2048),
                               torch.ones(2048, 2048, dtype=torch.bool).triu(1))), op,
              "sparse_mode 3 mask must be the lower-triangular optimised mask (True above the diagonal)")
    else:
        raise NotImplementedError(f"torch_npu.{op}: sparse_mode={sparse_mode} is not emulated")
    kv_heads = num_key_value_heads or num_query_heads

    if input_layout == "BSND":
        B, S, N, D = query.shape
        _need(N == num_query_heads, op, f"num_query_heads={num_query_heads} but query has N={N}")
        _need(block_table is not None, op, "BSND is emulated with page attention only")
        _need(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == B, op,
              "block_table must be int32 [B, max_blocks]")
        _need(actual_seq_kvlen is not None and len(actual_seq_kvlen) == B, op,
              "page attention needs actual_seq_kvlen (one length per batch)")
        _need(key.dim() == 3 and key.shape[1] == block_size and value.shape[:2] == key.shape[:2], op,
              "paged key/value must be (blocknum, block_size, H)")
        _need(max(actual_seq_kvlen) <= block_table.shape[1] * block_size, op, "block_table is too narrow")
        q_lens = list(actual_seq_qlen) if actual_seq_qlen is not None else [S] * B
        _need(all(0 <= q <= S for q in q_lens), op, "actual_seq_qlen exceeds the query's S")
        if mla:
            _need(1 <= S <= 16 and N in _MLA_HEADS and kv_heads == 1 and key.shape[2] == 512 and D == 512
                  and query_rope.shape == (B, S, N, 64) and key_rope.shape == (*key.shape[:2], 64), op,
                  "MLA needs query S 1-16, N a power of 2 <= 128, key N 1 and D 512, rope D 64")
            _need(block_size in (16, 128), op, f"MLA page attention block_size {block_size} (16 or 128)")
            _need(sparse_mode == (0 if S == 1 else 3), op, "MLA with query D 512: Q_S 1 takes only sparse_mode 0 "
                  "without a mask, Q_S > 1 only sparse_mode 3 with the mask")
        Dk, Dv = key.shape[2] // kv_heads, value.shape[2] // kv_heads
        out = torch.zeros(B, S, N, Dv, dtype=query.dtype)
        for b in range(B):
            nq, nk = q_lens[b], actual_seq_kvlen[b]
            blocks = block_table[b, : -(-nk // block_size)].long()
            k = key[blocks].reshape(-1, kv_heads, Dk)[:nk]
            v = value[blocks].reshape(-1, kv_heads, Dv)[:nk]
            q = query[b, :nq]
            extra = None
            if mla:
                extra = (query_rope[b, :nq], key_rope[blocks].reshape(-1, 1, 64)[:nk])
            out[b, :nq] = _attend(q, k, v, extra, softmax_scale, sparse_mode)
        return out, torch.zeros(1)

    if input_layout == "TND":
        _need(not mla and block_table is None, op, "TND is emulated without rope and page attention")
        T, N, Dq = query.shape
        _need(N == num_query_heads and key.shape[1] == kv_heads, op, "head counts do not match the shapes")
        _need((Dq, value.shape[2]) in ((128, 128), (192, 128), (192, 192)) and key.shape[2] == Dq, op,
              f"TND without rope needs Q_D=K_D=V_D=128 or Q_D=K_D=192 with V_D 128/192, got {Dq}/{value.shape[2]}")
        for name, lens, total in (("actual_seq_qlen", actual_seq_qlen, T), ("actual_seq_kvlen", actual_seq_kvlen,
                                                                            key.shape[0])):
            _need(lens is not None and list(lens) == sorted(lens) and lens[-1] == total and lens[0] >= 0, op,
                  f"TND {name} must be non-decreasing cumulative lengths ending at {total}")
        _need(len(actual_seq_qlen) == len(actual_seq_kvlen), op, "one q and one kv length per batch")
        out = torch.zeros(T, N, value.shape[2], dtype=query.dtype)
        q0 = k0 = 0
        for q1, k1 in zip(actual_seq_qlen, actual_seq_kvlen):
            _need(q1 - q0 <= k1 - k0, op, "each batch needs Q_S <= KV_S")
            out[q0:q1] = _attend(query[q0:q1], key[k0:k1], value[k0:k1], None, softmax_scale, sparse_mode)
            q0, k0 = q1, k1
        return out, torch.zeros(1)
    raise NotImplementedError(f"torch_npu.{op}: input_layout={input_layout!r} is not emulated")


def _attend(q, k, v, rope, scale, sparse_mode):
    """q [nq, N, D], k [nk, KV_N, D], v [nk, KV_N, Dv] -> [nq, N, Dv] in q's dtype (float32 math)."""
    nq, N, _ = q.shape
    nk, kvh, _ = k.shape
    if nq == 0:
        return q.new_zeros(0, N, v.shape[-1])
    rep = N // kvh
    kf, vf = k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf)
    if rope is not None:
        qr, kr = rope
        scores = scores + torch.einsum("qhd,khd->hqk", qr.float(), kr.float().repeat_interleave(rep, dim=1))
    scores = scores * scale
    if sparse_mode == 3:
        allowed = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


IMPLEMENTED = {f.__name__: f for f in (
    npu_rms_norm, npu_swiglu, npu_clipped_swiglu, npu_rotary_mul, npu_scatter_nd_update_, npu_moe_gating_top_k,
    npu_moe_init_routing_v2, npu_grouped_matmul, npu_moe_finalize_routing, npu_top_k_top_p,
    npu_fused_infer_attention_score_v2,
)}
