"""Decode step time with CUDA graphs vs ``enforce_eager=True``, same engine settings, same requests.

    python examples/decode_graphs.py                                  # the embedded default model
    python examples/decode_graphs.py --shape v2-lite --batches 1,8,64  # random DeepSeek-V2-Lite weights

For each batch B: B requests of ``--context`` prompt tokens are prefilled, a few decode steps warm up,
then ``--steps`` pure-decode steps are timed (wall time to the last one's completion, so the host's
launch work counts). Prints one JSON line per (mode, B) and the capture time.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import shape_config, write_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


def decode_ms(llm: LLM, batch: int, context: int, steps: int, warmup: int) -> float:
    """Milliseconds per decode step at ``batch`` requests of about ``context`` tokens."""
    e = llm.engine
    g = torch.Generator().manual_seed(batch)
    vocab = e.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 8, ignore_eos=True)
    seqs = [e.add_request({"prompt_token_ids": torch.randint(2, vocab, (context,), generator=g).tolist()}, params)
            for _ in range(batch)]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        e.step()
    for _ in range(warmup):
        e.step()
    e.platform.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        e.step()
    e.platform.synchronize()
    ms = (time.perf_counter() - t0) * 1000 / steps
    for s in seqs:
        e.abort(s.request_id)
    while e.has_unfinished():
        e.step()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=None, help="random_checkpoint shape (v2-lite, v3-slice); default: embedded")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers of --shape")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    opts = dict(dtype="bfloat16", block_size=args.block_size, max_num_seqs=max(batches),
                max_num_batched_tokens=max(8192, args.context), max_model_len=args.context + args.steps + 64)
    tmp = None
    if args.shape:
        tmp = tempfile.TemporaryDirectory()
        cfg = shape_config(args.shape)
        if args.layers:
            cfg["num_hidden_layers"] = args.layers
        opts.update(model=str(write_config(Path(tmp.name) / args.shape, cfg)), load_format="random")
    for eager in (False, True):
        t0 = time.perf_counter()
        llm = LLM(enforce_eager=eager, **opts)
        start_s = time.perf_counter() - t0
        graphs = llm.engine.runner.graphs
        info = {"mode": "eager" if eager else "graphs", "engine_start_s": round(start_s, 2),
                "capture_s": round(graphs.capture_seconds, 3) if graphs else None,
                "graphs_off_reason": llm.engine.runner.graphs_off_reason or None}
        print(json.dumps(info), flush=True)
        for b in batches:
            ms = decode_ms(llm, b, args.context, args.steps, args.warmup)
            print(json.dumps({"mode": info["mode"], "batch": b, "context": args.context, "ms_per_step": round(ms, 3),
                              "tok_per_s": round(b * 1000 / ms, 1)}), flush=True)
        llm.shutdown()
        del llm, graphs
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
