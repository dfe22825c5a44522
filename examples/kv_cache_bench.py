#!/usr/bin/env python
"""Benchmark of the tiered KV cache with the ``3fs`` persistent store, on this machine.

1. Time to first token for one long prompt in a cold process (a real subprocess each time):
   a full miss (empty store; the process writes its KV blocks on finish) vs a warm store (a new
   process that fetches the prompt's blocks instead of computing them). The tokens must match.
2. The store's read throughput while fetching (the whole fetch: records read, checked and handed
   to the host tier), vs plain sequential reads of the same files in the same order, each side in
   its own fresh process with the same page-cache state, alternating, ``--reps`` times.
   ``--page-cache warm`` (default): the files are in the page cache for both sides (they were just
   written and read); ``cold``: each side first syncs them and drops them from the page cache
   (``posix_fadvise(DONTNEED)``), so both read from the disk.
3. GC churn: many distinct prefixes into a store sized for a tenth of them; usage must stay under
   the high watermark.

The model is a random dense DeepSeek-V3-shaped checkpoint written to a temporary directory (no
download), big enough that prefilling the prompt on CPU takes seconds.

    python examples/kv_cache_bench.py                 # hidden 768, 6 layers, a 2,048-token prompt
    python examples/kv_cache_bench.py --page-cache cold --reps 7
    python examples/kv_cache_bench.py --hidden 1024 --layers 8 --prompt-len 2048 --block-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEADY_REPS = 15


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--io-threads", default="auto", help="store read threads (default: the store's 'auto')")
    p.add_argument("--reps", type=int, default=5, help="warm-store runs, each paired with a plain-read run")
    p.add_argument("--miss-reps", type=int, default=3,
                   help="extra full-miss runs (each into an empty store of its own), spread among the warm runs")
    p.add_argument("--page-cache", choices=("warm", "cold"), default="warm",
                   help="page-cache state of the store files before each warm run and each plain read")
    p.add_argument("--churn-prefixes", type=int, default=10_000)
    p.add_argument("--churn-capacity-prefixes", type=int, default=1_000)
    p.add_argument("--workdir", default=None, help="where the model and stores go (default: a temp dir)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plain-read", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the model --------------------------------------------------------------------------------

def write_model(out: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random dense DeepSeek-V3 checkpoint (MLA attention, no experts), float32."""
    import torch
    from safetensors.torch import save_file

    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.loader import expected_tensors

    heads = max(1, hidden // 64)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 4096,
        "hidden_size": hidden, "intermediate_size": hidden * 8 // 3 // 64 * 64, "num_hidden_layers": layers,
        "first_k_dense_replace": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
        "v_head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensors(ModelConfig.from_dict(config)).items():
        tensors[name] = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---- one cold process -------------------------------------------------------------------------

def child(args: argparse.Namespace) -> None:
    """Run one request in this (fresh) process and print what happened as JSON."""
    import torch

    from deepinfer_core import LLM, SamplingParams

    torch.manual_seed(0)
    prompt = torch.randint(2, 4096, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    io_threads = args.io_threads if args.io_threads == "auto" else int(args.io_threads)
    kv = {"backend": "3fs", "path": args.store, "offload_on_finish": True, "io_threads": io_threads}
    llm = LLM(model=args.model, dtype="float32", block_size=args.block_size, kv_cache_memory=512 << 20,
              kv_store=kv)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    m = llm.metrics()["kv_tiers"]
    tiers = llm.engine.pm.get_plugin("kv_tiers")
    llm.shutdown()  # flushes the queued writes
    print(json.dumps({
        "ttft": out.metrics.time_to_first_token, "wall": wall, "tokens": out.outputs[0].token_ids,
        "cached": out.metrics.num_cached_tokens, "by_tier": out.metrics.num_cached_tokens_by_tier,
        "error": repr(out.error) if out.error else None, "fetch": m["fetch"],
        "store_read_bytes": m["persistent"]["read_bytes"], "written": m["offload"]["written"],
        "keys": tiers_keys(prompt, args.block_size), "store_root": tiers.store.root,
        "io_threads": tiers.store.io_threads, "host_pool_bytes": m["host"]["pool_allocated_bytes"],
    }))


def tiers_keys(prompt: list[int], block_size: int) -> list[int]:
    from deepinfer_core.engine.hashing import chain

    return chain(prompt, block_size, (len(prompt) - 1) // block_size)


def run_child(args: argparse.Namespace, model: Path, store: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--store", str(store),
           "--prompt-len", str(args.prompt_len), "--block-size", str(args.block_size),
           "--io-threads", str(args.io_threads)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- read throughput --------------------------------------------------------------------------

def drop_from_page_cache(files: list[str]) -> None:
    """Write the files back and evict them from the page cache (only them: nothing else is touched)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_child(list_file: str) -> None:
    """In a fresh process: read the listed files once, in order, each with one ``readinto`` into
    its slot of a buffer allocated and touched beforehand (as the host tier's pool is)."""
    files = Path(list_file).read_text().split()
    size = max(os.path.getsize(f) for f in files)
    dest = memoryview(bytearray(len(files) * size))  # zero-filled: its pages are faulted in
    total = 0
    t = time.perf_counter()
    for i, f in enumerate(files):
        with open(f, "rb", buffering=0) as fh:
            total += fh.readinto(dest[i * size : (i + 1) * size])
    print(json.dumps({"seconds": time.perf_counter() - t, "bytes": total}))


def run_plain(files: list[str], work: Path) -> dict:
    listing = work / "files.txt"
    listing.write_text("\n".join(files))
    proc = subprocess.run([sys.executable, __file__, "--plain-read", str(listing)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"plain read failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plain_read(files: list[str], dest: memoryview | None = None) -> float:
    """Seconds to read the files one after another with ``readinto``: each into its own slot of
    ``dest`` (memory that keeps the data, like the store's staging buffer), or, without ``dest``,
    all into one reused buffer (which stays in the CPU cache: an upper bound, not a loader)."""
    size = max(os.path.getsize(f) for f in files)
    reused = memoryview(bytearray(size))
    t = time.perf_counter()
    for i, f in enumerate(files):
        with open(f, "rb", buffering=0) as fh:
            fh.readinto(reused if dest is None else dest[i * size : (i + 1) * size])
    return time.perf_counter() - t


def steady_read(store_path: Path, root: str, keys: list[int], io_threads, reps: int = STEADY_REPS):
    """Medians of (store get_many, plain reads into a buffer, plain reads into one reused buffer)
    seconds, alternating, over the same records."""
    import torch

    from deepinfer_core.kv_store import KVLayout
    from plugins.kv_3fs.record import HEADER_SIZE, unpack_header
    from plugins.kv_3fs.store import ThreeFSStore

    files = [f"{root}/{hx[:2]}/{hx}.kvb" for hx in (f"{k:016x}" for k in keys)]
    with open(files[0], "rb") as f:
        hdr = unpack_header(f.read(HEADER_SIZE))
    layout = KVLayout(hdr.fingerprint, *hdr.shape, hdr.dtype)
    store = ThreeFSStore(path=str(store_path), layout=layout,
                         io_threads=io_threads if io_threads == "auto" else int(io_threads))
    assert [store._path(k) for k in keys] == files
    staging = torch.zeros((len(keys), *layout.block_shape), dtype=layout.dtype)
    size = max(os.path.getsize(f) for f in files)
    dest = memoryview(torch.zeros(len(files) * size, dtype=torch.uint8).numpy()).cast("B")
    store_t, plain_t, reused_t = [], [], []
    for rep in range(reps):  # alternating which goes first: the second finds the files' pages in the CPU cache
        if rep % 2:
            plain_t.append(plain_read(files, dest))
        t = time.perf_counter()
        got = store.get_many(keys, out=staging)
        store_t.append(time.perf_counter() - t)
        assert all(g is not None for g in got)
        if rep % 2 == 0:
            plain_t.append(plain_read(files, dest))
        reused_t.append(plain_read(files))
    store.close()
    return statistics.median(store_t), statistics.median(plain_t), statistics.median(reused_t), files


# ---- GC churn ---------------------------------------------------------------------------------

def churn(path: Path, prefixes: int, capacity_prefixes: int, blocks_per_prefix: int = 2) -> dict:
    import torch

    from deepinfer_core.engine.hashing import chain
    from deepinfer_core.kv_store import KVLayout
    from plugins.kv_3fs.record import HEADER_SIZE
    from plugins.kv_3fs.store import ThreeFSStore

    layout = KVLayout("churnchurnchurn0", 2, 16, 64, torch.float32)
    record_bytes = HEADER_SIZE + 2 * 16 * 64 * 4
    capacity = capacity_prefixes * blocks_per_prefix * record_bytes
    store = ThreeFSStore(path=str(path), layout=layout, capacity_bytes=capacity, high_watermark=0.9,
                         low_watermark=0.7)
    block = torch.randn(layout.block_shape)
    peak = 0
    t = time.perf_counter()
    for p in range(prefixes):
        for key in chain([p, p * 7 + 1, 3] * 16, 16, blocks_per_prefix):
            store.put(key, block)
            peak = max(peak, store.usage_bytes)
    elapsed = time.perf_counter() - t
    st = store.stats()
    on_disk = sum(f.stat().st_size for f in Path(store.root).rglob("*.kvb"))
    out = {"prefixes": prefixes, "puts": prefixes * blocks_per_prefix, "capacity": capacity, "peak": peak,
           "high": 0.9 * capacity, "final": store.usage_bytes, "on_disk": on_disk, "gc_runs": st.extra["gc_runs"],
           "evictions": st.evictions, "seconds": elapsed}
    store.close()
    return out


# ---- main -------------------------------------------------------------------------------------

def spread(values: list[float], fmt: str = "{:.0%}") -> str:
    """median (min-max) of ``values``"""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    if args.plain_read:
        plain_child(args.plain_read)
        return
    sys.path.insert(0, str(REPO))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kv_bench_"))
    print(f"workdir {work}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    model = write_model(work / "model", args.hidden, args.layers)
    store = work / "store"

    miss = run_child(args, model, store)  # empty store: computes everything, writes its blocks
    if miss["error"]:
        raise SystemExit(f"miss run failed: {miss['error']}")
    root = miss["store_root"]
    files = [f"{root}/{hx[:2]}/{hx}.kvb" for hx in (f"{k:016x}" for k in miss["keys"])]
    file_bytes = sum(os.path.getsize(f) for f in files)
    warms, plains, misses = [], [], [miss]
    for rep in range(args.reps):  # pairs of fresh processes, alternating which side goes first
        if rep < args.miss_reps:  # more misses, at the same (shared-machine) load as the warm runs
            extra = run_child(args, model, work / f"miss{rep}")
            shutil.rmtree(work / f"miss{rep}", ignore_errors=True)
            if extra["error"] or extra["tokens"] != miss["tokens"]:
                raise SystemExit(f"miss run {rep} failed or differs: {extra['error']}")
            misses.append(extra)
        for side in ("warm", "plain") if rep % 2 == 0 else ("plain", "warm"):
            if args.page_cache == "cold":
                drop_from_page_cache(files)
            if side == "warm":
                r = run_child(args, model, store)  # a new process: fetches the blocks
                if r["error"]:
                    raise SystemExit(f"warm run failed: {r['error']}")
                warms.append(r)
            else:
                plains.append(run_plain(files, work))
    same = all(w["tokens"] == miss["tokens"] for w in warms)
    full = all(w["store_read_bytes"] == file_bytes for w in warms)
    plain_bps = [p["bytes"] / p["seconds"] for p in plains]
    fetch_bps = [w["store_read_bytes"] / w["fetch"]["seconds"] for w in warms]
    read_bps = [w["store_read_bytes"] / w["fetch"]["store_read_seconds"] for w in warms]
    fetch_ratio = [f / p for f, p in zip(fetch_bps, plain_bps)]
    read_ratio = [f / p for f, p in zip(read_bps, plain_bps)]
    miss_ttft = statistics.median(m["ttft"] for m in misses)
    ttft_x = [miss_ttft / w["ttft"] for w in warms]

    store_s, plain_s, reused_s, _ = steady_read(store, root, miss["keys"], args.io_threads)
    c = churn(work / "churn", args.churn_prefixes, args.churn_capacity_prefixes)

    gb = 1e9
    w0 = warms[0]
    rows = [
        (f"TTFT, full miss (cold process, empty store, {len(misses)} runs)", f"{miss_ttft * 1e3:9.1f} ms",
         spread([m["ttft"] * 1e3 for m in misses], "{:.0f}") + " ms"),
        (f"TTFT, warm store (cold process, {args.reps} runs)",
         f"{statistics.median(w['ttft'] for w in warms) * 1e3:9.1f} ms",
         f"{spread(ttft_x, '{:.1f}x')} faster than the median miss (target >= 5x)"),
        ("  prompt tokens reused / by tier", f"{w0['cached']:>9d}", json.dumps(w0["by_tier"])),
        ("  same generated token, every run", f"{str(same):>9s}", ""),
        ("Fetch during the warm run (read, check, into host tier)", f"{statistics.median(fetch_bps) / gb:9.2f} GB/s",
         f"{spread(fetch_ratio)} of plain reads, per pair (target >= 70%)"),
        ("  store reads alone", f"{statistics.median(read_bps) / gb:9.2f} GB/s",
         f"{spread(read_ratio)} of plain reads"),
        ("Plain sequential reads, same files (fresh process)", f"{statistics.median(plain_bps) / gb:9.2f} GB/s",
         f"{len(files)} files, {file_bytes / 2**20:.1f} MiB, page cache {args.page_cache}; readinto a "
         f"pre-faulted buffer; every block fetched: {full}"),
        (f"Store read, steady state in one process (median of {STEADY_REPS})",
         f"{file_bytes / store_s / gb:9.2f} GB/s",
         f"{plain_s / store_s:.0%} of plain reads in that process ({file_bytes / plain_s / gb:.2f} GB/s), "
         f"{reused_s / store_s:.0%} of reads into one cache-resident buffer"),
        (f"GC churn: {c['prefixes']:,} prefixes, room for {args.churn_capacity_prefixes:,}",
         f"{c['peak'] / c['capacity']:9.2%}", f"peak usage of capacity ({c['peak']:,} <= high watermark "
         f"{c['high']:,.0f} bytes: {c['peak'] <= c['high']}); {c['gc_runs']} GC runs, {c['evictions']:,} "
         f"evictions, {c['puts'] / c['seconds']:.0f} puts/s"),
        ("  final usage: index / on disk", f"{c['final'] / c['capacity']:9.1%}",
         f"{c['on_disk'] / c['capacity']:.1%} on disk"),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, note in rows:
        print(f"{name:<{width}}  {value}  {note}")
    print("\nper pair: fetch/plain " + " ".join(f"{r:.0%}" for r in fetch_ratio)
          + "; TTFT speed-up " + " ".join(f"{x:.1f}x" for x in ttft_x))
    print(f"model: hidden {args.hidden}, {args.layers} layers, prompt {args.prompt_len} tokens, block "
          f"{args.block_size}; store {store}; io_threads {w0['io_threads']}")
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))


if __name__ == "__main__":
    main()
