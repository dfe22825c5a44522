#!/usr/bin/env python
"""FP8 latent KV cache on one GPU: the largest batch of ``--context``-token requests that fits, with
``kv_cache_dtype`` bf16 and fp8, and decode tok/s at that batch.

1. **Capacity** (the whole model, e.g. V2-Lite's 27 layers with random bf16 weights): an engine with the
   default KV budget (``kv_cache_memory_fraction`` of the free memory after the weights) is built
   ``--runs`` times per KV dtype, each in a fresh process; the max batch is its block count over the
   blocks one request of ``--context`` tokens holds. The bytes per token come from the model's declared cache spec.
2. **Decode tok/s at that batch**: prefilling that many 32k-token prompts through all 27 layers takes
   minutes, so the decode is measured on a slice of the same widths with ``--decode-layers`` layers and a
   KV budget sized for exactly that batch (``kv_cache_memory``): every request really holds its own
   ``--context`` cached tokens, and each decode step reads all of them (at 32k the KV dominates the
   step). ``--runs`` timed windows per KV dtype. (Scaling the slice's step to all layers is no estimate
   of the full model: the step has per-step costs that do not grow with layers; one layer's attention
   kernel is timed by ``examples/kv_fp8_decode_bench.py``.)

    python examples/kv_fp8_capacity.py --shape v2-lite --context 32768 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_checkpoint import shape_config, write_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


def _engine(model_dir: Path, kv: str, **kw) -> LLM:
    return LLM(str(model_dir), dtype="bfloat16", load_format="random", kv_cache_dtype=kv, enable_prefix_caching=False,
               **kw)


def kv_bytes_per_token(llm: LLM) -> float:
    e = llm.engine
    return sum(g.bytes_per_token(e.dtype) for g in e.cache_layout.groups)


def _free_gib() -> float | None:
    import torch

    return torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else None


def capacity(model_dir: Path, kv: str, context: int, block_size: int, share: float | None) -> dict:
    free = _free_gib()
    llm = _engine(model_dir, kv, block_size=block_size, max_model_len=context + 1024, max_num_seqs=2048,
                  enforce_eager=True, max_num_batched_tokens=8192, kv_cache_memory=share)
    e = llm.engine
    per_request = -(-context // block_size)
    row = {"kv_cache_dtype": kv, "kv_bytes_per_token": kv_bytes_per_token(llm), "num_blocks": e.blocks.num_blocks,
           "kv_gib": e.blocks.num_blocks * block_size * kv_bytes_per_token(llm) / 2**30,
           "max_batch": e.blocks.num_blocks // per_request, "free_gib_before": free}
    llm.shutdown()
    del llm, e
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def _capacity_process(args, kv: str) -> dict:
    """One capacity measurement in a fresh process: each engine starts from the same free memory."""
    cmd = [sys.executable, __file__, "--shape", args.shape, "--context", str(args.context), "--block-size",
           str(args.block_size), "--capacity-of", kv]
    if args.kv_cache_memory is not None:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("CAPACITY ")]
    if out.returncode or not lines:
        raise RuntimeError(f"capacity run for {kv} failed (rc {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("CAPACITY "))


def decode_at(model_dir: Path, kv: str, batch: int, context: int, block_size: int, layer_bytes: float, warmup: int,
              window: int, runs: int, seed: int = 0) -> dict:
    """``layer_bytes``: KV bytes per token and layer (from the capacity run's cache spec)."""
    # requests prefilled early decode while the others prefill (one prompt per step): up to ``batch`` tokens more
    steps = 2 * batch + warmup + runs * window + 4
    per_request = -(-(context + steps) // block_size) + 1
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    block_bytes = int(layer_bytes * layers * block_size)
    llm = _engine(model_dir, kv, block_size=block_size, max_model_len=context + steps + 64, max_num_seqs=batch,
                  max_num_batched_tokens=context + batch, kv_cache_memory=(batch * per_request + 4) * block_bytes,
                  graph_batch_sizes=[batch])
    e = llm.engine
    rng = random.Random(seed)
    vocab = e.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    t = time.perf_counter()
    seqs = [e.add_request({"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(context)]}, sp)
            for _ in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        e.step()
    prefill_s = time.perf_counter() - t
    for _ in range(warmup):
        e.step()
    windows = []
    mean_ctx = sum(s.num_tokens for s in seqs) / batch
    for _ in range(runs):
        e.platform.synchronize()
        t = time.perf_counter()
        for _ in range(window):
            e.step()
        e.platform.synchronize()
        dt = time.perf_counter() - t
        windows.append({"step_ms": dt / window * 1e3, "tok_s": batch * window / dt})
    if any(s.is_finished for s in seqs) or e.stats.preemptions:
        raise RuntimeError("a request finished or was preempted inside the window: the batch did not stay whole")
    layers = e.model_config.num_hidden_layers
    llm.shutdown()
    return {"kv_cache_dtype": kv, "batch": batch, "context": context, "decode_layers": layers,
            "mean_context_at_start": mean_ctx, "prefill_s": prefill_s, "windows": windows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--decode-layers", type=int, default=2, help="0: skip the decode measurement")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="capacity runs: share of free memory "
                    "(default: the platform's)")
    ap.add_argument("--max-batch", default=None, help="skip the capacity runs and decode at these batches, e.g. "
                    "bf16=86,fp8=151 (a previous capacity run's; the KV bytes then come from the row layouts)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--capacity-of", default=None, help=argparse.SUPPRESS)  # one capacity run (a subprocess)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvfp8-"))
    cfg = {**shape_config(args.shape), "max_position_embeddings": args.context + 4096}
    full = write_config(tmp / "full", cfg)
    if args.capacity_of:
        print("CAPACITY " + json.dumps(capacity(full, args.capacity_of, args.context, args.block_size,
                                                args.kv_cache_memory)), flush=True)
        return
    res = {"shape": args.shape, "context": args.context, "block_size": args.block_size, "capacity": [],
           "decode": []}
    kvs = args.kv.split(",")
    if args.max_batch:
        from kernels_cpu.kv_fp8 import row_bytes

        L, R = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        given = dict(item.split("=") for item in args.max_batch.split(","))
        for kv in kvs:
            per_layer = row_bytes(L, R) if kv == "fp8" else (L + R) * 2
            res["capacity"].append({"run": "given", "kv_cache_dtype": kv, "max_batch": int(given[kv]),
                                    "kv_bytes_per_token": per_layer * cfg["num_hidden_layers"]})
    for run in range(0 if args.max_batch else args.runs):
        for kv in kvs:
            t = time.perf_counter()
            row = {"run": run, **_capacity_process(args, kv), "s": time.perf_counter() - t}
            res["capacity"].append(row)
            print(json.dumps(row), flush=True)
    if args.decode_layers:
        sliced = write_config(tmp / "slice", {**cfg, "num_hidden_layers": args.decode_layers})
        for kv in kvs:
            cap = [r for r in res["capacity"] if r["kv_cache_dtype"] == kv]
            batch = min(r["max_batch"] for r in cap)
            layer_bytes = cap[0]["kv_bytes_per_token"] / cfg["num_hidden_layers"]
            row = decode_at(sliced, kv, batch, args.context, args.block_size, layer_bytes, args.warmup, args.window,
                            args.runs)
            res["decode"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
