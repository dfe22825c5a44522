"""Collective communication over ``torch.distributed`` process groups.

:class:`Communicator` is the interface the engine uses (expert-parallel dispatch and combine, DP
synchronisation). :class:`TorchDistCommunicator` implements it for any backend that
``torch.distributed`` supports (gloo, nccl, hccl); a platform names its backend in
``Platform.dist_backend``.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist


class Communicator(ABC):
    """Collectives among ``world_size`` ranks. All calls are blocking and in-order on every rank."""

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``x`` over ranks (op: sum|max|min); returns the result (may be ``x`` itself)."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0 (same shape on every rank)."""

    @abstractmethod
    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, then give rank r the r-th of ``world_size`` equal chunks along dim 0."""

    @abstractmethod
    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Send rows ``x[sum(send_splits[:r]):...]`` to rank r; return received rows in rank order."""

    @abstractmethod
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy ``x`` from rank ``src`` into ``x`` on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank arrives."""

    @abstractmethod
    def abort(self) -> None:
        """Give the group up after a peer died (elastic EP re-forms without it): close this rank's
        connections and communicators, so that collectives blocked on this rank, and on backends that
        support it (NCCL, HCCL) this rank's own collectives blocked on the dead peer, end with an
        error now instead of at the group's timeout. The communicator is unusable afterwards. Safe
        from any thread and more than once."""


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 deprecates the *_tensor spellings (a FutureWarning on every call); older torch lacks *_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# aborts every backend of a group (NCCL communicators, gloo connections) and forgets it; torch >= 2.3
_abort_process_group = getattr(dist.distributed_c10d, "_abort_process_group", None) or dist.destroy_process_group
logger = logging.getLogger("deepinfer.communicator")


class TorchDistCommunicator(Communicator):
    """Communicator over an initialised ``torch.distributed`` process group."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchDistCommunicator needs torch.distributed.init_process_group() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self._abort_lock = threading.Lock()
        self.aborted = False

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in _OPS:
            raise ValueError(f"all_reduce op must be one of {sorted(_OPS)}, got {op!r}")
        dist.all_reduce(x, op=_OPS[op], group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.world_size:
            raise ValueError(
                f"reduce_scatter: dim 0 ({x.shape[0]}) must divide by world size {self.world_size}"
            )
        if self.backend == "gloo":  # gloo has no reduce_scatter: reduce, then slice our chunk
            x = x.clone()
            dist.all_reduce(x, group=self.group)
            return x.chunk(self.world_size)[self.rank].clone()
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        _reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        if sum(send_splits) != x.shape[0]:
            raise ValueError(f"all_to_all: send_splits sum to {sum(send_splits)} but x has {x.shape[0]} rows")
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src=src, group=self.group)
        return x

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def abort(self) -> None:
        """torch's abort of the group: NCCL/HCCL abort their communicators (a collective blocked on a
        dead peer returns with an error); gloo closes this rank's connections at once, which fails
        the collectives of peers blocked on this rank (its own blocked ones fail when the dead
        peer's connections reset, which the kernel does when that process dies)."""
        with self._abort_lock:
            if self.aborted:
                return
            self.aborted = True
            if not dist.is_initialized():
                return
            try:
                _abort_process_group(self.group)
            except Exception as exc:  # already torn down by a concurrent failure: nothing left to close
                logger.warning("aborting the %s process group: %s: %s", self.backend, type(exc).__name__, exc)


class SingleRankCommunicator(Communicator):
    """The trivial communicator of a one-rank job (no process group needed)."""

    rank = 0
    world_size = 1

    def all_reduce(self, x, op="sum"):
        return x

    def all_gather(self, x):
        return x

    def reduce_scatter(self, x):
        return x

    def all_to_all(self, x, send_splits, recv_splits):
        return x

    def broadcast(self, x, src=0):
        return x

    def barrier(self):
        pass

    def abort(self):
        pass
