"""Self-check of expert-parallel dispatch/combine and expert-weight migration across real ranks.

:func:`check_expert_parallel` spawns ``world_size`` processes that form a ``torch.distributed``
group (gloo on cpu by default; pass nccl/hccl and the device type to check a GPU/NPU backend). Every
rank routes its own tokens (a different number per rank, one rank with none) and runs
:class:`ExpertParallel`; the result must equal, bit for bit, the single-process ``fused_moe`` over
all experts for the same tokens. Then the experts are moved to a placement with replicas
(:func:`migrate_layer`), tokens are routed to replicas, and the result must again be identical.
"""

from __future__ import annotations

import datetime
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.communicator import TorchDistCommunicator
from deepinfer_core.parallel.expert_parallel import ExpertParallel, migrate_layer
from deepinfer_core.ports import free_port as _free_port

E, K, C, I = 16, 4, 32, 16


def _same(name: str, got: torch.Tensor, want: torch.Tensor, rank: int) -> None:
    if got.shape != want.shape or not torch.equal(got.cpu(), want.cpu()):
        same_shape = got.shape == want.shape
        diff = (got.cpu().float() - want.cpu().float()).abs().max().item() if same_shape else "n/a"
        raise AssertionError(f"rank {rank}: {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}, "
                             f"max abs diff {diff}")


def _route(T: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    return torch.rand(T, K, generator=g) + 0.1, ids


def run_rank_checks(rank: int, world_size: int, device: torch.device) -> None:
    from kernels_cpu import ops

    comm = TorchDistCommunicator()
    W = world_size
    g = torch.Generator().manual_seed(1234)  # identical full weights on every rank
    w13 = torch.randn(E, 2 * I, C, generator=g) * 0.5
    w2 = torch.randn(E, C, I, generator=g) * 0.5
    # every rank can make every rank's tokens; the reference is one process running all of them
    batches = []
    for r in range(W):
        gr = torch.Generator().manual_seed(100 + r)
        Tr = 0 if r == 1 else 3 + 5 * r  # uneven, and rank 1 has no tokens (a dummy step)
        batches.append((torch.randn(Tr, C, generator=gr), *_route(Tr, gr)))
    x, weights, ids = batches[rank]
    T = x.shape[0]
    start = sum(b[0].shape[0] for b in batches[:rank])
    ref_all = ops.fused_moe(torch.cat([b[0] for b in batches]), w13, w2, torch.cat([b[1] for b in batches]),
                            torch.cat([b[2] for b in batches]))
    ref = ref_all[start : start + T]

    spr = E // W
    moe = SimpleNamespace(k=SimpleNamespace(fused_moe=ops.fused_moe), layer_idx=1,
                          w13=w13[rank * spr : (rank + 1) * spr].clone().to(device),
                          w2=w2[rank * spr : (rank + 1) * spr].clone().to(device), num_local=spr,
                          expert_start=rank * spr, expert_parallel=None)
    ep = ExpertParallel(comm, E, [moe], device)
    out = ep.run(moe, x.to(device), weights.to(device), ids.to(device))
    _same("dispatch/combine vs single-process fused_moe", out, ref, rank)
    totals = ep.rank_pairs[1]
    if int(totals.sum()) != int(comm.all_reduce(torch.tensor([T * K], device=device)).item()):
        raise AssertionError(f"rank {rank}: rank_pairs {totals.tolist()} do not add up to every routed pair")

    # a placement with one replica per rank of the experts 0..W-1, shuffled (the same on every rank)
    p = torch.Generator().manual_seed(7)
    new = torch.cat([torch.arange(E), torch.arange(W)])[torch.randperm(E + W, generator=p)].tolist()
    old = list(range(E))
    new13, new2, moved = migrate_layer(comm, moe, old, new)
    nspr = len(new) // W
    for j in range(nspr):
        e = new[rank * nspr + j]
        _same(f"migrated w13 slot {j} (expert {e})", new13[j], w13[e], rank)
        _same(f"migrated w2 slot {j} (expert {e})", new2[j], w2[e], rank)
    ep.set_placement(1, torch.tensor(new), new13, new2)
    replicas = {e: [s for s, v in enumerate(new) if v == e] for e in range(E)}
    first = torch.tensor([[replicas[int(e)][0] for e in row] for row in ids.tolist()], dtype=torch.long)
    out2 = ep.run(moe, x.to(device), weights.to(device), first.view(T, K).to(device))
    _same("dispatch/combine after migration", out2, ref, rank)
    # spreading an expert's tokens over its replicas changes only the GEMM batch of each row
    spread = torch.tensor([[replicas[int(e)][(t + rank) % len(replicas[int(e)])] for e in row]
                           for t, row in enumerate(ids.tolist())], dtype=torch.long).view(T, K)
    out3 = ep.run(moe, x.to(device), weights.to(device), spread.to(device))
    if not torch.allclose(out3.cpu(), ref, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"rank {rank}: routing to replicas changed the output by "
                             f"{(out3.cpu() - ref).abs().max().item():.3g}")


def _worker(rank: int, world_size: int, backend: str, port: int, device_type: str) -> None:
    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, rank)
    if device_type != "cpu":
        getattr(torch, device_type).set_device(rank)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        run_rank_checks(rank, world_size, device)
    finally:
        dist.destroy_process_group()


def check_expert_parallel(world_size: int = 2, backend: str = "gloo", device_type: str = "cpu",
                          timeout_s: float = 120.0) -> None:
    """Run the checks on ``world_size`` spawned ranks; AssertionError names the failing rank."""
    if E % world_size:
        raise ValueError(f"world_size must divide {E}")
    ctx = mp.start_processes(_worker, args=(world_size, backend, _free_port(), device_type),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise AssertionError(f"expert-parallel check ({backend}, {world_size} ranks) timed out")
    except mp.ProcessRaisedException as exc:
        raise AssertionError(f"expert-parallel check failed on rank {exc.error_index}:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise AssertionError(f"expert-parallel check: rank {exc.error_index} exited with code "
                             f"{exc.exit_code}") from None
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
