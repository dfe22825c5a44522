"""Conformance kit for plugin authors: run it with pytest against your backend.

A kernel backend checks each op it overrides against the reference ops, a communicator checks its
collectives across spawned processes, a KV store checks the store contract. For example, in your
package's ``tests/test_conformance.py``::

    import pytest, torch
    from deepinfer_core.testing import check_op, kernel_conformance_cases
    from my_accel.kernels import MyKernels

    @pytest.mark.parametrize("op,dtype", kernel_conformance_cases(MyKernels))
    def test_kernel(op, dtype):
        check_op(MyKernels, op, dtype, device="cpu")   # your device, e.g. "cuda" or "npu"

and, as needed::

    def test_communicator():
        check_communicator(world_size=2, backend="gloo")       # or nccl / hccl with device_type=...

    def test_kv_store():
        check_kv_store(MyStore, capacity_factory=lambda n: MyStore(capacity_bytes=n))

Every check raises AssertionError saying what differs (op, dtype, case and largest error; the
failing rank and its traceback; the broken store rule).

This package imports only the core (and ``kernels_cpu`` for the reference ops), never a backend.
"""

from deepinfer_core.testing.communicator import check_communicator
from deepinfer_core.testing.kernels import (
    DEFAULT_DTYPES,
    TOLERANCES,
    check_kernel_backend,
    check_op,
    kernel_conformance_cases,
)
from deepinfer_core.testing.kv_store import check_kv_store

__all__ = [
    "DEFAULT_DTYPES",
    "TOLERANCES",
    "check_communicator",
    "check_kernel_backend",
    "check_kv_store",
    "check_op",
    "kernel_conformance_cases",
]
