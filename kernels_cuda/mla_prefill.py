"""Expanded-form MLA prefill: varlen causal flash attention in TileLang.

Each sequence's q_len queries are the last q_len of its k_len keys (chunked prefill and prefix-cache
hits give k_len > q_len): query j sees keys 0 .. j + (k_len - q_len). A tiny scheduling kernel turns
``cu_q_lens`` into a list of (sequence, query tile) pairs on the device, so the attention grid needs no
host synchronisation; tiles past the end of the list exit at once.
"""

import torch

from kernels_cuda import _tl

LOG2E = 1.4426950408889634


def build_tile_schedule(G: int):
    """TileSeq[i], TileM[i]: the i-th tile of ceil(q_len / G) tiles per sequence (the last tile of a
    sequence first, so the longest causal rows start early); -1 past the last tile."""
    T = _tl.language()
    B1, CAP = T.dynamic("B1"), T.dynamic("CAP")

    @T.prim_func
    def tile_schedule(CuQ: T.Tensor((B1,), "int64"), TileSeq: T.Tensor((CAP,), "int32"),
                      TileM: T.Tensor((CAP,), "int32")):
        with T.Kernel(1, threads=32):
            tx = T.get_thread_binding()
            if tx == 0:
                n = T.alloc_var("int32", 0)
                for b in T.serial(B1 - 1):
                    nt = T.ceildiv(T.cast(CuQ[b + 1] - CuQ[b], "int32"), G)
                    for m in T.serial(nt):
                        if n + m < CAP:
                            TileSeq[n + m] = b
                            TileM[n + m] = nt - 1 - m
                    n += nt
                for i in T.serial(T.max(CAP - n, 0)):
                    TileSeq[n + i] = -1
                    TileM[n + i] = 0

    return tile_schedule


def build_prefill(H: int, DQK: int, DV: int, BM: int, BN: int, stages: int, threads: int,
                  dtype: str = "bfloat16"):
    T = _tl.language()
    NT, S, B1, NTILE = T.dynamic("NT"), T.dynamic("S"), T.dynamic("B1"), T.dynamic("NTILE")
    accum = "float32"

    @T.prim_func
    def mla_prefill_kernel(
        Q: T.Tensor((NT, H, DQK), dtype),
        K: T.Tensor((S, H, DQK), dtype),
        V: T.Tensor((S, H, DV), dtype),
        CuQ: T.Tensor((B1,), "int64"),
        CuK: T.Tensor((B1,), "int64"),
        TileSeq: T.Tensor((NTILE,), "int32"),
        TileM: T.Tensor((NTILE,), "int32"),
        Out: T.Tensor((NT, H, DV), dtype),
        scale_log2: T.float32,
    ):
        with T.Kernel(NTILE, H, threads=threads) as (tile, h):
            Q_s = T.alloc_shared((BM, DQK), dtype)
            K_s = T.alloc_shared((BN, DQK), dtype)
            V_s = T.alloc_shared((BN, DV), dtype)
            P_s = T.alloc_shared((BM, BN), dtype)
            acc_s = T.alloc_fragment((BM, BN), accum)
            acc_o = T.alloc_fragment((BM, DV), accum)
            m_i = T.alloc_fragment((BM,), accum)
            m_prev = T.alloc_fragment((BM,), accum)
            alpha = T.alloc_fragment((BM,), accum)
            row_sum = T.alloc_fragment((BM,), accum)
            l_i = T.alloc_fragment((BM,), accum)

            b_raw = TileSeq[tile]
            live = b_raw >= 0
            b = T.max(b_raw, 0)
            q_seq = T.cast(CuQ[b], "int32")
            q_len = T.cast(CuQ[b + 1], "int32") - q_seq
            k0 = T.cast(CuK[b], "int32")
            k_len = T.cast(CuK[b + 1], "int32") - k0
            m_blk = TileM[tile]
            q0 = q_seq + m_blk * BM
            diag = k_len - q_len + m_blk * BM  # query row i sees keys <= diag + i
            k_end = T.min(k_len, diag + BM)
            n_iter = T.if_then_else(live, T.ceildiv(k_end, BN), 0)

            T.copy(Q[q0:q0 + BM, h, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, -T.infinity(accum))
            for kk in T.Pipelined(n_iter, num_stages=stages):
                T.copy(K[k0 + kk * BN:k0 + (kk + 1) * BN, h, :], K_s)
                T.copy(V[k0 + kk * BN:k0 + (kk + 1) * BN, h, :], V_s)
                T.gemm(Q_s, K_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if (kk * BN + BN - 1 > diag) | (kk * BN + BN > k_len):  # only tiles on the diagonal or the end
                    for i, j in T.Parallel(BM, BN):
                        acc_s[i, j] = T.if_then_else(
                            (kk * BN + j <= diag + i) & (kk * BN + j < k_len), acc_s[i, j], -T.infinity(accum))
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_i, dim=1, clear=False)
                for i in T.Parallel(BM):
                    alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
                for i, j in T.Parallel(BM, BN):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(BM):
                    l_i[i] = l_i[i] * alpha[i] + row_sum[i]
                for i, j in T.Parallel(BM, DV):
                    acc_o[i, j] *= alpha[i]
                T.copy(acc_s, P_s)
                T.gemm(P_s, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(BM, DV):
                if live & (m_blk * BM + i < q_len):
                    Out[q0 + i, h, j] = acc_o[i, j] / l_i[i]

    return mla_prefill_kernel


_schedule_kernel = _tl.kernel_cache(build_tile_schedule)
_prefill_kernel = _tl.kernel_cache(build_prefill)

DEFAULT_CFG = {"BM": 128, "BN": 64, "stages": 2, "threads": 256}


def tile_schedule(cu_q_lens: torch.Tensor, n_tokens: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, tile) pairs for tiles of G queries, computed on the device (no host sync)."""
    B = cu_q_lens.shape[0] - 1
    cap = (n_tokens + G - 1) // G + B  # each sequence wastes less than one tile
    dev = cu_q_lens.device
    tile_seq = torch.empty(cap, dtype=torch.int32, device=dev)
    tile_m = torch.empty(cap, dtype=torch.int32, device=dev)
    _schedule_kernel(G)(cu_q_lens, tile_seq, tile_m)
    return tile_seq, tile_m


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def mla_prefill(q, k, v, cu_q_lens, cu_k_lens, scale, *, cfg: dict | None = None):
    NT, H, DQK = q.shape
    DV = v.shape[-1]
    if q.dtype not in (torch.bfloat16, torch.float16) or NT == 0:
        from kernels_cpu.ops import mla_prefill as ref  # float32: tensor cores would round to tf32

        return ref(q, k, v, cu_q_lens, cu_k_lens, scale)
    dqk_p, dv_p = _round(DQK, 16), _round(DV, 16)
    if dqk_p != DQK:  # odd test shapes only (real models: 192 and 128)
        q = torch.nn.functional.pad(q, (0, dqk_p - DQK))
        k = torch.nn.functional.pad(k, (0, dqk_p - DQK))
    if dv_p != DV:
        v = torch.nn.functional.pad(v, (0, dv_p - DV))
    c = cfg or DEFAULT_CFG
    cu_q = cu_q_lens.to(torch.int64).contiguous()
    cu_k = cu_k_lens.to(torch.int64).contiguous()
    tile_seq, tile_m = tile_schedule(cu_q, NT, c["BM"])
    out = torch.empty(NT, H, dv_p, dtype=q.dtype, device=q.device)
    kern = _prefill_kernel(H, dqk_p, dv_p, c["BM"], c["BN"], c["stages"], c["threads"], _tl.tl_dtype(q.dtype))
    kern(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, tile_seq, tile_m, out, float(scale * LOG2E))
    return out if dv_p == DV else out[..., :DV].contiguous()


def representative_kernels():
    c = DEFAULT_CFG
    return [
        ("mla_prefill H16 192/128", lambda: build_prefill(16, 192, 128, c["BM"], c["BN"], c["stages"], c["threads"])),
        ("tile_schedule", lambda: build_tile_schedule(128)),
    ]
