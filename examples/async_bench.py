"""Device idle time between engine steps with async scheduling off and on.

Runs the same decode-heavy workload (random weights of a named shape, greedy, ``ignore_eos``) with
``async_scheduling`` False and True, with ``measure_device_idle`` on: two timed events per step
bracket its device work, and the gaps between one step's end and the next one's start are the time
the device waited for the host (``deepinfer_core/engine/idle.py``). Each mode runs in a fresh engine
after a warm-up generate; the figures cover the measured generate only.

    python examples/async_bench.py                                   # H200: v2-lite shape, bf16
    python examples/async_bench.py --shape v3-tiny --num-requests 64 # a host-bound small model
    python examples/async_bench.py --shape v3-tiny --dtype float32 --num-requests 8 --output-len 16  # CPU
    python examples/async_bench.py --trace /tmp/async_trace          # + a torch.profiler trace per mode
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import SHAPES, shape_config, write_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402

IDLE_KEYS = ("device_idle_ms", "device_busy_ms", "device_idle_gaps", "steps", "overlapped_steps",
             "discarded_tokens", "decode_tokens")


def run_mode(model_dir: Path, async_on: bool, args) -> dict:
    llm = LLM(str(model_dir), load_format="random", dtype=args.dtype, accelerator=args.accelerator,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prompt_len + args.output_len + 16, kv_cache_memory=args.kv_fraction,
              async_scheduling=async_on, measure_device_idle=True, enforce_eager=args.enforce_eager)
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(args.prompt_len)]}
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[: min(8, len(prompts))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up: kernels compiled, allocator primed
    m0 = llm.metrics()
    t0 = time.perf_counter()
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            outs = llm.generate(prompts, params, use_tqdm=False)
        path = Path(args.trace) / f"async_{'on' if async_on else 'off'}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    m1 = llm.metrics()
    d = {k: m1[k] - m0[k] for k in IDLE_KEYS}
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    total = d["device_idle_ms"] + d["device_busy_ms"]
    res = {
        "async_scheduling": llm.engine.async_scheduling, "wall_s": round(wall, 3),
        "output_tok_s": round(out_tokens / wall, 1), "steps": d["steps"],
        "overlapped_steps": d["overlapped_steps"], "discarded_tokens": d["discarded_tokens"],
        "device_idle_share": round(d["device_idle_ms"] / total, 4) if total else 0.0,
        "device_idle_us_mean": round(1000 * d["device_idle_ms"] / d["device_idle_gaps"], 1)
        if d["device_idle_gaps"] else 0.0,
        "device_busy_us_per_step": round(1000 * d["device_busy_ms"] / max(1, d["steps"]), 1),
        "graphs": llm.engine.runner.graphs is not None,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--accelerator", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--kv-fraction", type=float, default=0.3, help="share of free device memory for the KV cache")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--modes", default="off,on", help="async_scheduling modes to run, in order")
    ap.add_argument("--trace", default=None, help="directory for a chrome trace of each mode's measured run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    modes = [{"off": False, "on": True}[m.strip()] for m in args.modes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / args.shape, shape_config(args.shape))
        results = [run_mode(model_dir, m, args) for m in modes]
    if len(results) == 2:
        same = results[0]["tokens"] == results[1]["tokens"]
        print(f"greedy outputs identical across modes: {same}")
    for r in results:
        r.pop("tokens")
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
