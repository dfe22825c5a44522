"""The host-memory tier's buffer pool: recycled memory, never under a holder's feet."""

from __future__ import annotations

import threading

import torch

from deepinfer_core.engine.host_store import HostMemoryStore
from deepinfer_core.testing.kv_store import check_kv_store

SHAPE = (2, 4, 8)
BB = 2 * 4 * 8 * 4  # float32 bytes of one block


def blk(value: float) -> torch.Tensor:
    return torch.full(SHAPE, float(value))


def pooled(n_blocks: int) -> HostMemoryStore:
    return HostMemoryStore(capacity_bytes=n_blocks * BB, block_shape=SHAPE, dtype=torch.float32)


def test_pooled_store_conforms():
    assert "capacity" in check_kv_store(lambda: HostMemoryStore(capacity_bytes=1 << 20, block_shape=(3, 16, 24),
                                                                dtype=torch.float32))


def test_evicted_buffers_are_recycled():
    s = pooled(4)
    for k in range(40):
        assert s.put(k, blk(k))
    assert list(s.keys()) == [36, 37, 38, 39]
    assert [s.get(k)[0, 0, 0].item() for k in range(36, 40)] == [36.0, 37.0, 38.0, 39.0]
    st = s.stats()
    assert st.evictions == 36 and st.extra["pool_allocated_bytes"] == 4 * BB  # no fresh memory after the first 4


def test_a_held_block_is_never_overwritten():
    """A tensor returned by get() keeps its data after its block is evicted and others are put."""
    s = pooled(3)
    for k in range(3):
        s.put(k, blk(k))
    held = s.get(0)
    for k in range(3, 12):
        s.put(k, blk(k))
    assert not s.contains(0) and torch.equal(held, blk(0))
    assert s.stats().extra["pool_allocated_bytes"] == 4 * BB  # one more buffer replaced the held one
    del held
    for k in range(12, 30):
        s.put(k, blk(k))
    assert s.stats().extra["pool_allocated_bytes"] == 4 * BB


def test_allocate_adopt_recycle_and_capacity():
    s = pooled(4)
    bufs = [s.allocate() for _ in range(4)]
    assert all(b is not None for b in bufs) and s.allocate() is None  # every byte is handed out
    for i, b in enumerate(bufs[:3]):
        b.fill_(i + 100)
        s.adopt(i, b)
    s.recycle(bufs[3])
    del bufs, b
    assert s.used_bytes == 3 * BB and s.stats().extra["pool_free_bytes"] == BB
    assert torch.equal(s.get(2), blk(102))
    again = [s.allocate() for _ in range(4)]  # the free buffer, then the 3 LRU blocks' buffers
    assert all(b is not None for b in again) and len(s) == 0
    assert s.stats().extra["pool_allocated_bytes"] == 4 * BB


def test_prefault_fills_the_pool_within_capacity():
    s = pooled(8)
    s.put(1, blk(1))
    assert s.prefault(100 * BB) == 7 * BB  # one block is held
    st = s.stats().extra
    assert st["pool_free_bytes"] == 7 * BB and st["pool_allocated_bytes"] == 8 * BB
    for k in range(2, 9):
        s.put(k, blk(k))
    assert s.stats().extra["pool_allocated_bytes"] == 8 * BB and len(s) == 8
    assert all(torch.equal(s.get(k), blk(k)) for k in range(1, 9))


def test_other_shapes_still_fit_under_capacity():
    s = pooled(4)
    s.prefault(4 * BB)
    odd = torch.ones(3 * BB // 4)  # 3 blocks' worth in another shape: spares are dropped to make room
    assert s.put(99, odd) and s.put(1, blk(1))
    st = s.stats().extra
    assert st["bytes"] == 4 * BB and st["bytes"] + st["pool_free_bytes"] <= s.capacity_bytes


def test_concurrent_puts_and_gets_keep_data_intact():
    s = pooled(16)
    errors = []

    def worker(base: int) -> None:
        for i in range(300):
            k = base + i % 40
            s.put(k, blk(k))
            got = s.get(k)
            if got is not None and not torch.equal(got, blk(k)):
                errors.append(k)

    threads = [threading.Thread(target=worker, args=(1000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and s.used_bytes <= 16 * BB
