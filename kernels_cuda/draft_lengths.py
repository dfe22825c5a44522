"""Speculative draft lengths on the device (TileLang): one CTA per request, no sort.

The reference (``kernels_cpu.ops.draft_lengths``) sorts every (request, position) slot by its
cumulative confidence product and keeps the ``budget`` best. A slot's place in that order is its
rank: the number of valid slots that beat it (larger product; equal product and earlier position;
then lower request). CTA ``b`` computes the ranks of its own K slots by one pass over every request
(each thread walks whole rows, so it forms their products left to right as the reference does),
and counts the slots that pass the threshold with rank < budget: the length, written straight to
the request's place in the output (no gather or scatter after it). With B requests that is
B * B * K * K comparisons, a few microseconds at serving batch sizes.
"""

import torch

from kernels_cuda import _tl

NTHR = 128


def build_draft_lengths(K: int):
    T = _tl.language()
    B = T.dynamic("B")
    NW = NTHR // 32
    f32, i32 = "float32", "int32"

    @T.prim_func
    def draft_lengths_kernel(Conf: T.Tensor((B, K), f32), MaxD: T.Tensor((B,), "int64"),
                             Budget: T.Tensor((1,), "int64"), MinConf: T.Tensor((1,), f32),
                             Out: T.Tensor((B,), "int64")):
        with T.Kernel(B, threads=NTHR) as row:
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            part = T.alloc_shared((NW, K), i32)
            own = T.alloc_local((K,), f32)
            cnt = T.alloc_local((K,), i32)
            cp = T.alloc_var(f32, 1.0)
            beats = T.alloc_var("bool", False)
            cp = 1.0
            for j in T.serial(K):
                cp = cp * Conf[row, j]
                own[j] = cp
                cnt[j] = 0
            for it in T.serial(T.ceildiv(B, NTHR)):
                b = it * NTHR + tx
                if b < B:
                    n = MaxD[b]
                    cp = 1.0
                    for j2 in T.serial(K):
                        cp = cp * Conf[b, j2]
                        if T.cast(j2, "int64") < n:
                            for j in T.unroll(K):
                                beats = (cp > own[j]) | ((cp == own[j]) & ((j2 < j) | ((j2 == j) & (b < row))))
                                if beats:
                                    cnt[j] += 1
            for j in T.unroll(K):
                for s in T.unroll(5):
                    cnt[j] += T.shfl_xor(cnt[j], 16 >> s)
                if lane == 0:
                    part[warp, j] = cnt[j]
            T.sync_threads()
            if tx == 0:
                won = T.alloc_var("int64", 0)
                for j in T.serial(K):
                    rank = T.alloc_var(i32, 0)
                    for w in T.serial(NW):
                        rank += part[w, j]
                    if (T.cast(j, "int64") < MaxD[row]) & (own[j] >= MinConf[0]) & \
                            (T.cast(rank, "int64") < Budget[0]):
                        won += 1
                Out[row] = won

    return draft_lengths_kernel


_kernel = _tl.kernel_cache(build_draft_lengths)


def draft_lengths(conf: torch.Tensor, max_drafts: torch.Tensor, budget: int, min_conf: float) -> torch.Tensor:
    B, K = conf.shape
    dev = conf.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out
    # from pinned memory: a copy from pageable memory would make the host wait for the queued work
    # (this op runs while the step before is still on the device)
    pin = dev.type == "cuda"
    scalars = torch.tensor([max(int(budget), 0)], dtype=torch.int64, pin_memory=pin).to(dev, non_blocking=True)
    thr = torch.tensor([float(min_conf)], dtype=torch.float32, pin_memory=pin).to(dev, non_blocking=True)
    _kernel(K)(conf.float().contiguous(), max_drafts.to(dev, torch.int64).contiguous(), scalars, thr, out)
    return out


def representative_kernels():
    return [("draft_lengths K8", lambda: build_draft_lengths(8))]
