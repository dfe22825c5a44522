"""Expert parallelism: MoE tokens go to the ranks that hold their experts and come back.

Each rank holds ``slots_per_rank`` physical expert slots of every MoE layer; physical slot ``p``
lives on rank ``p // slots_per_rank`` and holds logical expert ``phys_to_log[p]``. Without EPLB the
placement is contiguous (rank r holds logical experts [r E/W, (r+1) E/W)) and physical == logical;
EPLB adds replicas and moves experts (:func:`migrate_layer`), and its route hook turns the gate's
logical ids into physical ones before :meth:`ExpertParallel.run` sees them.

Per MoE layer, every rank makes the same three collectives, even with zero tokens:
  1. ``all_gather`` of the per-slot pair counts [S] -> [W, S] (every rank then knows every split
     size and every rank's load, which gives the ``moe_lb`` statistics for free);
  2. ``all_to_all`` of the token rows, sorted by physical slot (hence by destination rank);
  3. the experts run on the received rows, and a second ``all_to_all`` returns the outputs.
The combine then sums each token's expert outputs in ascending *logical* expert order, the order
of the single-rank ``fused_moe`` reference, so float32 results do not depend on where an expert ran.
"""

from __future__ import annotations

import torch

from deepinfer_core.communicator import Communicator


class ExpertParallel:
    """Dispatch/combine over a :class:`Communicator`; set as ``moe.expert_parallel`` on every MoE."""

    def __init__(self, comm: Communicator, num_experts: int, moe_layers: list, device: torch.device) -> None:
        W = comm.world_size
        if num_experts % W:
            raise ValueError(f"{num_experts} routed experts do not divide among {W} expert-parallel ranks")
        self.comm, self.rank, self.world_size = comm, comm.rank, W
        self.num_experts = num_experts
        self.device = device
        self.moes = {m.layer_idx: m for m in moe_layers}
        ident = torch.arange(num_experts, dtype=torch.long, device=device)
        self.phys_to_log: dict[int, torch.Tensor] = {i: ident for i in self.moes}
        #: Cumulative (token, expert) pairs each rank computed, per MoE layer: the global view.
        self.rank_pairs: dict[int, torch.Tensor] = {i: torch.zeros(W, dtype=torch.long) for i in self.moes}
        self.calls = 0  # MoE layer invocations (a step without any means this rank ran no forward)
        self.where = "idle"  # the collective in progress, for the driver's hang diagnosis
        for m in moe_layers:
            m.expert_parallel = self

    # ---- placement -----------------------------------------------------------------------
    def set_placement(self, layer: int, phys_to_log: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> None:
        """Install a new placement of ``layer`` with this rank's weights for its slots."""
        S = phys_to_log.numel()
        if S % self.world_size:
            raise ValueError(f"{S} physical slots do not divide among {self.world_size} ranks")
        spr = S // self.world_size
        if spr != w13.shape[0] or spr != w2.shape[0]:
            raise ValueError(f"layer {layer}: {spr} slots per rank but weights for {w13.shape[0]}")
        moe = self.moes[layer]
        moe.w13.data, moe.w2.data = w13, w2
        moe.num_local, moe.expert_start = spr, self.rank * spr
        self.phys_to_log[layer] = phys_to_log.to(device=self.device, dtype=torch.long)

    def regroup(self, comm: Communicator) -> None:
        """Join a re-formed group (elastic EP): the placement stays until the next ``set_placement``."""
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.rank_pairs = {i: torch.zeros(self.world_size, dtype=torch.long) for i in self.moes}

    def slots_per_rank(self, layer: int) -> int:
        return self.phys_to_log[layer].numel() // self.world_size

    # ---- the MoE collective --------------------------------------------------------------
    def run(self, moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed-expert output [T, C] for this rank's tokens ``x`` routed to physical ``ids`` [T, K]."""
        self.calls += 1
        comm, W, me = self.comm, self.world_size, self.rank
        T, K = ids.shape
        C = x.shape[1]
        layer = moe.layer_idx
        spr = self.slots_per_rank(layer)
        S = spr * W
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=S)[None]  # [1, S]
        if counts.shape[1] != S:
            raise ValueError(f"layer {layer}: routed to physical slot {int(flat.max())} of only {S}")
        self.where = f"MoE layer {layer}: all_gather of counts"
        all_counts = comm.all_gather(counts.to(torch.long)).cpu()  # [W src, S]
        pairs = all_counts.view(W, W, spr).sum(-1)  # [src, dst]
        self.rank_pairs[layer] += pairs.sum(0)
        send_splits = pairs[me].tolist()
        recv_splits = pairs[:, me].tolist()

        order = torch.argsort(flat, stable=True)  # by slot, hence by destination rank
        self.where = f"MoE layer {layer}: dispatch all_to_all"
        recv = comm.all_to_all(x[order // K], send_splits, recv_splits)
        mine = all_counts[:, me * spr : (me + 1) * spr].reshape(-1)  # [src * spr] rows per (src, slot)
        local_slot = torch.repeat_interleave(torch.arange(spr).repeat(W), mine).to(x.device)
        ones = torch.ones(recv.shape[0], 1, dtype=x.dtype, device=x.device)
        # each row's expert output; a MoE whose experts are not plain fused_moe SwiGLUs (V4's clamp)
        # declares ``local_experts(x, weights, ids)`` over its expert ids
        if hasattr(moe, "local_experts"):
            y = moe.local_experts(recv, ones, local_slot[:, None] + moe.expert_start)
        else:
            y = moe.k.fused_moe(recv, moe.w13, moe.w2, ones, local_slot[:, None])
        self.where = f"MoE layer {layer}: combine all_to_all"
        back = comm.all_to_all(y, recv_splits, send_splits)  # [T K, C] in ``order``
        self.where = "idle"

        per_pair = torch.empty_like(back)
        per_pair[order] = back
        return combine(per_pair.view(T, K, C), weights, self.phys_to_log[layer][ids], x.dtype)

    # ---- statistics ----------------------------------------------------------------------
    def rank_pairs_matrix(self) -> tuple[list[int], torch.Tensor]:
        layers = sorted(self.moes)
        return layers, torch.stack([self.rank_pairs[i] for i in layers]) if layers else torch.zeros(0, 0)


def moe_lb_from_pairs(pairs: dict[int, list[int]]) -> tuple[float, dict[int, float]]:
    """(overall, per layer) ``moe_lb`` from per-layer per-rank (token, expert) pair counts: the busiest
    rank over the mean; overall = sum over layers of the busiest rank / sum of the means."""
    per_layer, top, mean = {}, 0.0, 0.0
    for layer, row in sorted(pairs.items()):
        t = torch.tensor(row, dtype=torch.float64)
        m = float(t.mean()) if t.numel() else 0.0
        per_layer[int(layer)] = float(t.max()) / m if m > 0 else 1.0
        top += float(t.max()) if t.numel() else 0.0
        mean += m
    return (top / mean if mean > 0 else 1.0), per_layer


def combine(per_pair: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """sum_k weights[t, k] * per_pair[t, k] in float32, adding the K terms of every token in
    ascending logical-expert order (the single-rank ``fused_moe`` order), then cast to ``dtype``."""
    T, K, C = per_pair.shape
    slot = torch.argsort(logical_ids, dim=1, stable=True)
    y = per_pair.gather(1, slot[..., None].expand(T, K, C))
    w = weights.to(dtype).gather(1, slot)
    out = torch.zeros(T, C, dtype=torch.float32, device=per_pair.device)
    for j in range(K):
        out += y[:, j].float() * w[:, j, None].float()
    return out.to(dtype)


def transfer_plan(old_p2l: list[int], new_p2l: list[int], world_size: int,
                  missing_ok: bool = False) -> list[tuple[int, int, int, int]]:
    """Moves that turn placement ``old`` into ``new``: (src rank, src local slot, dst rank, dst local
    slot) for every new slot; src == dst is a local copy. Deterministic (every rank computes the
    same plan). A slot already holding its expert needs no move and is left out. ``old`` may mark
    lost slots -1 (a dead rank's); with ``missing_ok`` an expert no slot holds any more gets
    src (-1, -1): the destination loads it from the checkpoint."""
    W = world_size
    o_spr, n_spr = len(old_p2l) // W, len(new_p2l) // W
    where: dict[int, list[tuple[int, int]]] = {}
    for p, e in enumerate(old_p2l):
        where.setdefault(int(e), []).append((p // o_spr, p % o_spr))
    plan = []
    for p, e in enumerate(new_p2l):
        d, j = divmod(p, n_spr)
        if j < o_spr and old_p2l[d * o_spr + j] == e:
            continue
        holders = where.get(int(e))
        if not holders and missing_ok:
            plan.append((-1, -1, d, j))
            continue
        if not holders:
            raise ValueError(f"logical expert {e} has no replica in the old placement")
        local = [h for h in holders if h[0] == d]
        src = local[0] if local else holders[p % len(holders)]
        plan.append((src[0], src[1], d, j))
    return plan


def migrate_layer(comm: Communicator, moe, old_p2l: list[int], new_p2l: list[int],
                  load_expert=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's (w13, w2) for placement ``new_p2l``, fetching experts it lacks from the ranks
    that hold them (one ``all_to_all``, skipped on every rank when nothing crosses ranks).
    ``load_expert(logical id) -> (w13, w2)`` reads an expert no rank holds any more (``old_p2l``
    marks lost slots -1) from the checkpoint. Returns the new weights and the number of experts
    that crossed ranks."""
    W, me = comm.world_size, comm.rank
    n_spr = len(new_p2l) // W
    plan = transfer_plan(old_p2l, new_p2l, W, missing_ok=load_expert is not None)
    w13, w2 = moe.w13.data, moe.w2.data
    new13 = w13.new_empty((n_spr, *w13.shape[1:]))
    new2 = w2.new_empty((n_spr, *w2.shape[1:]))
    o_spr = w13.shape[0]
    keep = min(o_spr, n_spr)
    new13[:keep], new2[:keep] = w13[:keep], w2[:keep]  # slots that stay; the plan overwrites the rest
    remote = [m for m in plan if m[0] not in (m[2], -1)]
    for s, sj, d, dj in plan:
        if s == d == me:
            new13[dj], new2[dj] = w13[sj], w2[sj]
        elif s == -1 and d == me:
            new13[dj], new2[dj] = load_expert(int(new_p2l[d * n_spr + dj]))
    if remote:
        n13, n2 = w13[0].numel(), w2[0].numel()
        sends = sorted((m for m in remote if m[0] == me), key=lambda m: (m[2], m[3]))
        recvs = sorted((m for m in remote if m[2] == me), key=lambda m: (m[0], m[3]))
        rows = [torch.cat((w13[sj].reshape(-1), w2[sj].reshape(-1))) for _, sj, _, _ in sends]
        nbytes = (n13 + n2) * w13.element_size()  # sent as bytes: any dtype, any backend
        buf = torch.stack(rows).view(torch.uint8) if rows else torch.empty((0, nbytes), dtype=torch.uint8,
                                                                            device=w13.device)
        send_splits = [sum(1 for m in sends if m[2] == r) for r in range(W)]
        recv_splits = [sum(1 for m in recvs if m[0] == r) for r in range(W)]
        got = comm.all_to_all(buf, send_splits, recv_splits).view(w13.dtype)  # [recvs, n13 + n2]
        for row, (_, _, _, dj) in zip(got, recvs):
            new13[dj] = row[:n13].view(w13.shape[1:])
            new2[dj] = row[n13:].view(w2.shape[1:])
    return new13, new2, len(remote)
