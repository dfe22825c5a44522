"""Communicator conformance: the collectives the engine uses, across real processes.

:func:`check_communicator` spawns ``world_size`` processes (``torch.multiprocessing``, spawn),
initialises a ``torch.distributed`` process group over a free TCP port on 127.0.0.1, builds the
communicator under test in each and checks every collective against values each rank can compute
on its own. A failure on any rank becomes an AssertionError carrying that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.communicator import Communicator, TorchDistCommunicator
from deepinfer_core.ports import free_port


def _expect(name: str, got: torch.Tensor, want: torch.Tensor, rank: int) -> None:
    got = got.detach().cpu()
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(
            f"rank {rank}: {name} returned {got.dtype} {tuple(got.shape)} {got.tolist()}, "
            f"expected {want.dtype} {tuple(want.shape)} {want.tolist()}"
        )


def _send_count(src: int, dst: int) -> int:
    """Rows rank ``src`` sends to rank ``dst`` in the all_to_all check: uneven, zero for some pairs."""
    return (src + 2 * dst) % 3


def run_checks(comm: Communicator, rank: int, world_size: int, device: torch.device) -> None:
    """The checks one rank runs; every rank must call it (collectives are in lock step)."""
    W = world_size
    if (comm.rank, comm.world_size) != (rank, W):
        raise AssertionError(f"rank {rank}: communicator reports rank {comm.rank} of {comm.world_size}, "
                             f"expected {rank} of {W}")

    def t(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    # all_reduce: sum, max, min, float and int
    x = t([rank + 1.0, -2.0 * rank, 0.5])
    _expect("all_reduce(sum)", comm.all_reduce(x, "sum"),
            torch.tensor([W * (W + 1) / 2, -float(W * (W - 1)), 0.5 * W]), rank)
    _expect("all_reduce(max)", comm.all_reduce(t([rank, -rank, 7.0]), "max"),
            torch.tensor([W - 1.0, 0.0, 7.0]), rank)
    _expect("all_reduce(min)", comm.all_reduce(t([rank, -rank]), "min"), torch.tensor([0.0, 1.0 - W]), rank)
    _expect("all_reduce(sum, int64)", comm.all_reduce(t([rank, 1 << 40], torch.int64), "sum"),
            torch.tensor([W * (W - 1) // 2, W << 40]), rank)

    # all_gather: rank r contributes two rows of r
    x = torch.full((2, 3), float(rank), device=device) + torch.arange(3.0, device=device)
    want = torch.cat([torch.full((2, 3), float(r)) + torch.arange(3.0) for r in range(W)])
    _expect("all_gather", comm.all_gather(x), want, rank)

    # reduce_scatter: row i of rank r is 100 * r + i; rank r gets the summed rows 2r, 2r + 1
    rows = 2 * W
    x = (100.0 * rank + torch.arange(rows, dtype=torch.float32, device=device))[:, None].repeat(1, 3)
    summed = 100.0 * sum(range(W)) + W * torch.arange(rows, dtype=torch.float32)
    want = summed[2 * rank : 2 * rank + 2, None].repeat(1, 3)
    _expect("reduce_scatter", comm.reduce_scatter(x), want, rank)

    # all_to_all with uneven splits, some zero: row j sent from src to dst holds 1000 src + 10 dst + j
    send = [_send_count(rank, d) for d in range(W)]
    recv = [_send_count(s, rank) for s in range(W)]
    def rows_of(src: int, dst: int, n: int) -> torch.Tensor:
        return 1000.0 * src + 10.0 * dst + torch.arange(n, dtype=torch.float32)

    x = torch.cat([rows_of(rank, d, n) for d, n in enumerate(send)])[:, None].repeat(1, 2).to(device)
    want = torch.cat([rows_of(s, rank, n) for s, n in enumerate(recv)])
    _expect(f"all_to_all(send_splits={send}, recv_splits={recv})", comm.all_to_all(x, send, recv),
            want[:, None].repeat(1, 2), rank)

    # broadcast from the first and the last rank
    for src in (0, W - 1):
        x = t([src * 10.0 + 1, 2.0]) if rank == src else t([-1.0, -1.0])
        _expect(f"broadcast(src={src})", comm.broadcast(x, src), torch.tensor([src * 10.0 + 1, 2.0]), rank)
        _expect(f"broadcast(src={src}) in place", x, torch.tensor([src * 10.0 + 1, 2.0]), rank)

    # barrier: nobody leaves before the last rank arrives (one host, so wall clocks agree)
    if rank == W - 1:
        time.sleep(0.1)
    arrived = time.time()
    comm.barrier()
    left = time.time()
    last_arrival = comm.all_gather(t([arrived], torch.float64)).max().item()
    if left < last_arrival - 1e-3:
        raise AssertionError(f"rank {rank}: barrier returned {last_arrival - left:.3f}s before the last rank "
                             "arrived")


def _default_factory() -> Communicator:
    return TorchDistCommunicator()


def _worker(rank: int, world_size: int, backend: str, port: int, factory: Callable[[], Communicator] | None,
            device_type: str, timeout_s: float, report_dir: str) -> None:
    try:
        device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, rank)
        if device_type != "cpu":
            getattr(torch, device_type).set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        _report(report_dir, rank)
        raise
    try:
        comm = (factory or _default_factory)()
        run_checks(comm, rank, world_size, device)
    except BaseException:
        # Record the traceback before tearing the group down: the peers may abort once we leave.
        _report(report_dir, rank)
        raise
    finally:
        dist.destroy_process_group()


def _report(report_dir: str, rank: int) -> None:
    with open(os.path.join(report_dir, f"rank{rank}.txt"), "w") as f:
        f.write(traceback.format_exc())


def check_communicator(
    world_size: int = 2,
    backend: str = "gloo",
    factory: Callable[[], Communicator] | None = None,
    *,
    device_type: str = "cpu",
    timeout_s: float = 60.0,
) -> None:
    """Run the collective checks on ``world_size`` spawned ranks.

    ``factory`` builds the communicator under test in each rank after the process group is up
    (default :class:`TorchDistCommunicator`); it must be picklable (a module-level function or
    class). ``device_type`` is where tensors live ("cpu" for gloo, "cuda" for nccl, ...).
    """
    if world_size < 2:
        raise ValueError("check_communicator needs world_size >= 2")
    what = f"communicator check ({backend}, {world_size} ranks)"
    with tempfile.TemporaryDirectory(prefix="deepinfer-comm-") as report_dir:
        ctx = mp.start_processes(
            _worker, args=(world_size, backend, free_port(), factory, device_type, timeout_s, report_dir),
            nprocs=world_size, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s + 30
        failure: BaseException | None = None
        try:
            while not ctx.join(timeout=0.5, grace_period=2.0):
                if time.monotonic() > deadline:
                    failure = TimeoutError(f"timed out after {timeout_s + 30:.0f}s")
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            failure = exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        if failure is None:
            return
        # Report the rank that failed first: its peers' errors (or aborts) usually follow from it.
        reports = []
        for rank in range(world_size):
            path = os.path.join(report_dir, f"rank{rank}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    reports.append((os.stat(path).st_mtime_ns, rank, f.read()))
        if reports:
            reports.sort()
            _, rank, text = reports[0]
            others = "".join(
                f"\n(rank {r} failed afterwards: {t.strip().splitlines()[-1]})" for _, r, t in reports[1:]
            )
            raise AssertionError(f"{what} failed on rank {rank}:\n{text}{others}") from None
        if isinstance(failure, mp.ProcessExitedException):
            raise AssertionError(
                f"{what}: rank {failure.error_index} exited with code {failure.exit_code}"
            ) from None
        raise AssertionError(f"{what} failed: {failure}") from None
