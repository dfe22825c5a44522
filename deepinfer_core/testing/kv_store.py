"""KV store conformance: the :class:`deepinfer_core.kv_store.KVStore` contract.

:func:`check_kv_store` takes a factory returning a fresh, empty store and checks round trips
(bit-exact, several dtypes), that ``put`` copies, ``contains`` / ``match_prefix`` (metadata only:
no bytes read), ``evict``, misses, statistics where the store keeps them, concurrent use, and,
for a store that reports ``capacity_bytes``, that it never holds more than its capacity and keeps
the block put last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from deepinfer_core.kv_store import KVStore, KVStoreStats
from deepinfer_core.version import check_api_version

BLOCK_SHAPE = (3, 16, 24)  # [layers, block_size, entry_dim]


def _block(seed: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = BLOCK_SHAPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fail(name: str, detail: str) -> None:
    raise AssertionError(f"KV store {name}: {detail}")


def _same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return (
        isinstance(got, torch.Tensor) and got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
        and torch.equal(got.detach().cpu(), want)
    )


def _check_basics(store: KVStore, name: str) -> None:
    key = 0x5EED_0001
    if store.get(key) is not None:
        _fail(name, "get() of a key never put did not return None")
    if store.contains(key):
        _fail(name, "contains() is True for a key never put")
    if store.evict(key):
        _fail(name, "evict() of a key never put returned True")

    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        k = key + 1 + i
        block = _block(i, dtype)
        if store.put(k, block) is not True:
            _fail(name, f"put() of a {tuple(block.shape)} {dtype} block into an empty store did not return "
                  "True")
        if not store.contains(k):
            _fail(name, f"contains() is False right after put() ({dtype})")
        got = store.get(k)
        if not _same(got, block):
            detail = "None" if got is None else f"{getattr(got, 'dtype', type(got))} {tuple(got.shape)}"
            _fail(name, f"get() after put() is not bit-exact for {dtype} (got {detail})")

    # put copies: the engine reuses the device block right after offloading it
    k = key + 10
    block = _block(10)
    original = block.clone()
    store.put(k, block)
    block.fill_(-7.0)
    if not _same(store.get(k), original):
        _fail(name, "changing the tensor after put() changed the stored block (put must copy)")

    # putting the same key again keeps it (equal keys mean equal KV)
    if store.put(k, original) is not True or not _same(store.get(k), original):
        _fail(name, "put() of an already held key did not keep the block")

    # evict
    if store.evict(k) is not True:
        _fail(name, "evict() of a held key did not return True")
    if store.contains(k) or store.get(k) is not None:
        _fail(name, "the key is still held after evict()")
    if store.evict(k):
        _fail(name, "a second evict() of the same key returned True")


def _check_match_prefix(store: KVStore, name: str) -> None:
    chain = [0xC4A1_0000 + i for i in range(5)]
    for i in (0, 1, 2, 4):  # chain[3] is missing
        store.put(chain[i], _block(100 + i))
    before = store.stats()
    cases = [(chain, 3), (chain[:2], 2), ([], 0), (chain[3:], 0), ([0xDEAD, *chain], 0), (chain[4:], 1)]
    for keys, want in cases:
        got = store.match_prefix(keys)
        if got != want:
            _fail(name, f"match_prefix({[hex(k) for k in keys]}) = {got}, expected {want} (it stops at the "
                  "first missing key)")
    after = store.stats()
    if isinstance(before, KVStoreStats) and isinstance(after, KVStoreStats) and (
        after.read_bytes != before.read_bytes
    ):
        _fail(name, f"match_prefix()/contains() read data (read_bytes {before.read_bytes} -> "
              f"{after.read_bytes}); they must be metadata only")


def _check_stats(store: KVStore, name: str) -> None:
    stats = store.stats()
    if not isinstance(stats, KVStoreStats):
        _fail(name, f"stats() returned {type(stats).__name__}, expected KVStoreStats")
    if stats == KVStoreStats():
        return  # the store keeps no statistics
    s0 = stats
    k = 0x57A7_0000
    block = _block(7)
    store.put(k, block)
    store.get(k)
    store.get(k + 1)
    s1 = store.stats()
    if s1.puts < s0.puts + 1 or s1.hits < s0.hits + 1 or s1.misses < s0.misses + 1:
        _fail(name, f"stats did not count a put, a hit and a miss: {s0} -> {s1}")
    if s1.read_bytes and s1.read_bytes < s0.read_bytes + _nbytes(block):
        _fail(name, f"read_bytes grew by {s1.read_bytes - s0.read_bytes} for a {_nbytes(block)}-byte hit")


def _check_threads(store: KVStore, name: str, threads: int = 4, ops: int = 40) -> None:
    errors: list[BaseException] = []
    blocks = [_block(200 + i) for i in range(8)]

    def work(t: int) -> None:
        try:
            for i in range(ops):
                j = (t + i) % len(blocks)
                key = 0x7A8E_0000 + j
                store.put(key, blocks[j])
                got = store.get(key)
                if got is not None and not _same(got, blocks[j]):
                    raise AssertionError(f"thread {t}: get({key:#x}) returned another block's data")
                if i % 7 == 0:
                    store.evict(key)
                store.match_prefix([0x7A8E_0000 + m for m in range(len(blocks))])
        except BaseException as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if errors:
        _fail(name, f"concurrent use failed: {type(errors[0]).__name__}: {errors[0]}")


def _check_capacity(store: KVStore, name: str) -> None:
    capacity = store.capacity_bytes
    block_bytes = capacity // 4  # four blocks fit, a fifth does not
    numel = block_bytes // 4
    if numel < 1:
        _fail(name, f"capacity_bytes={capacity} is too small to test")
    keys = [0xCA9A_0000 + i for i in range(7)]
    blocks = [_block(300 + i, shape=(numel,)) for i in range(len(keys))]
    for k, b in zip(keys, blocks, strict=True):
        if store.put(k, b) is not True:
            _fail(name, f"put() of a block of {_nbytes(b)} bytes (capacity {capacity}) was refused")
        if not store.contains(k):
            _fail(name, "the block just put is not held (eviction must make room for the new block)")
    held = [k for k in keys if store.contains(k)]
    if len(held) * _nbytes(blocks[0]) > capacity:
        _fail(name, f"holds {len(held)} blocks of {_nbytes(blocks[0])} bytes, over capacity_bytes={capacity}")
    if len(held) < 2:
        _fail(name, f"holds only {len(held)} of 7 blocks although 4 fit")
    for k, b in zip(keys, blocks, strict=True):
        if k in held and not _same(store.get(k), b):
            _fail(name, "a block kept through evictions changed")
    stats = store.stats()
    if stats != KVStoreStats() and stats.evictions < len(keys) - len(held):
        _fail(name, f"stats().evictions = {stats.evictions}, but {len(keys) - len(held)} blocks were evicted")
    too_big = _block(1, shape=(capacity // 4 + 1,))
    if store.put(0xB16, too_big) is not False or store.contains(0xB16):
        _fail(name, f"put() of a block larger than the whole capacity ({_nbytes(too_big)} > {capacity} "
              "bytes) must return False and store nothing")


def check_kv_store(
    factory: Callable[[], KVStore],
    capacity_factory: Callable[[int], KVStore] | None = None,
    *,
    capacity_bytes: int = 64 * 1024,
) -> list[str]:
    """Check the store ``factory()`` returns (a fresh, empty one per call); returns the checks run.

    A store with a capacity reports it as the attribute ``capacity_bytes``. Pass
    ``capacity_factory(capacity_bytes)`` to have eviction tested on a small store; without it the
    check uses ``factory()`` when its capacity is at most 16 MiB, and skips it otherwise.
    """
    done: list[str] = []
    store = factory()
    name = type(store).__name__
    check_api_version(store, f"KV store {name}")
    if not isinstance(store, KVStore):
        _fail(name, f"{type(store).__qualname__} is not a deepinfer_core.kv_store.KVStore")
    try:
        for check in (_check_basics, _check_match_prefix, _check_stats, _check_threads):
            check(store, name)
            done.append(check.__name__.removeprefix("_check_"))
    finally:
        store.close()

    cap_store = capacity_factory(capacity_bytes) if capacity_factory else None
    if cap_store is None:
        cap = getattr(store, "capacity_bytes", None)
        if isinstance(cap, int) and 16 <= cap <= 16 << 20:
            cap_store = factory()
    if cap_store is not None:
        if not isinstance(getattr(cap_store, "capacity_bytes", None), int):
            _fail(name, "capacity_factory() returned a store without an int capacity_bytes")
        try:
            _check_capacity(cap_store, name)
            done.append("capacity")
        finally:
            cap_store.close()
    return done
