"""Throughput benchmark: the prefill and decode phases measured apart, an end-to-end workload, and
optionally `transformers`' batched `generate` on the same checkpoint, side by side in one run.

    python examples/benchmark.py --shape v3-tiny --compare-transformers      # the CPU target
    python examples/benchmark.py --model DIR --decode-batches 1,8,64
    python examples/benchmark.py --dp 2 --ep 2 [--eplb]                        # CPU DP/EP: tok/s, moe_lb
    python examples/benchmark.py --suite h200 --shape v2-lite --out DIR        # the full-model GPU suite:
                                                   # rooflines, CUDA graphs, transformers (h200_suite.py)

Engine overhead is everything in a step but the model forward (scheduling, input preparation,
sampling, bookkeeping), reported as a share of step time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import SHAPES, make_random_checkpoint, shape_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = rng.randint(*prompt_range)
        reqs.append(([rng.randrange(2, vocab) for _ in range(p)], rng.randint(*output_range)))
    return reqs


def run_engine_workload(llm: LLM, reqs) -> dict:
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    s0 = _snapshot(llm)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p, _ in reqs)
    d = _delta(llm, s0)
    return {"seconds": dt, "output_tokens": out_tokens, "output_tok_s": out_tokens / dt,
            "total_tok_s": (out_tokens + in_tokens) / dt, "overhead_share": d["overhead_share"],
            "outputs": [o.outputs[0].token_ids for o in outs]}


def run_transformers_workload(model_dir: Path, reqs, batch: int, dtype: torch.dtype, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    t = time.perf_counter()
    useful = 0
    outputs = []
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        new = max(o for _, o in chunk)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        for j, (_, o) in enumerate(chunk):
            outputs.append(gen[j, width : width + o].tolist())
        useful += sum(o for _, o in chunk)
    dt = time.perf_counter() - t
    in_tokens = sum(len(p) for p, _ in reqs)
    return {"seconds": dt, "output_tokens": useful, "output_tok_s": useful / dt,
            "total_tok_s": (useful + in_tokens) / dt, "outputs": outputs}


def _snapshot(llm: LLM) -> dict:
    s = llm.engine.stats
    return {"step": s.step_time, "fwd": s.forward_time, "steps": s.steps}


def _delta(llm: LLM, s0: dict) -> dict:
    s1 = _snapshot(llm)
    step, fwd = s1["step"] - s0["step"], s1["fwd"] - s0["fwd"]
    return {"steps": s1["steps"] - s0["steps"], "step_time": step,
            "overhead_share": 0.0 if step == 0 else 1 - fwd / step}


def measure_prefill(llm: LLM, prompt_len: int, num: int, vocab: int, seed: int) -> dict:
    reqs = workload(num, (prompt_len, prompt_len), (1, 1), vocab, seed)
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:1]], SamplingParams(max_tokens=1), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                 SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t
    return {"prompt_len": prompt_len, "requests": num, "tok_s": num * prompt_len / dt}


def measure_decode(llm: LLM, batch: int, context: int, vocab: int, warmup: int, window: int, seed: int) -> dict:
    """Steady-state decode of ``batch`` requests at ``context`` tokens of context."""
    engine = llm.engine
    reqs = workload(batch, (context, context), (1, 1), vocab, seed)
    params = SamplingParams(temperature=0, max_tokens=warmup + window + 4, ignore_eos=True)
    seqs = [engine.add_request({"prompt_token_ids": p}, params) for p, _ in reqs]
    while any(s.num_output_tokens == 0 for s in seqs):  # all prefills done
        engine.step()
    for _ in range(warmup):
        engine.step()
    s0 = _snapshot(llm)
    t = time.perf_counter()
    for _ in range(window):
        engine.step()
    dt = time.perf_counter() - t
    d = _delta(llm, s0)
    while engine.has_unfinished():
        engine.step()
    return {"batch": batch, "context": context, "steps_s": window / dt, "tok_s": batch * window / dt,
            "overhead_share": d["overhead_share"]}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a.split("=")[0] == "--suite" for a in argv):
        from h200_suite import run  # the GPU suite (its own options; --scale tiny runs on a CPU)

        run(argv)
        return
    if any(a.split("=")[0] in ("--dp", "--ep") for a in argv):
        # data/expert-parallel runs: tokens/s and moe_lb from the multi-process engine
        from eplb_bench import main as eplb_main

        eplb_main(["throughput", *argv])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a random --shape checkpoint)")
    ap.add_argument("--shape", default="v3-tiny", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--accelerator", default=None)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-range", default="16:256")
    ap.add_argument("--output-range", default="16:128")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--prefill-lens", default="256,1024")
    ap.add_argument("--decode-batches", default="1,16,64")
    ap.add_argument("--decode-context", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--compare-transformers", action="store_true")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args(argv)

    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = make_random_checkpoint(Path(tmp.name) / args.shape, shape_config(args.shape), args.seed)
    else:
        model_dir = Path(args.model)
    llm = LLM(str(model_dir), dtype=args.dtype, accelerator=args.accelerator, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    pr = tuple(int(x) for x in args.prompt_range.split(":"))
    orr = tuple(int(x) for x in args.output_range.split(":"))
    results: dict = {"model": str(model_dir) if args.model else args.shape, "device": str(llm.engine.device),
                     "threads": torch.get_num_threads()}

    results["prefill"] = [measure_prefill(llm, int(n), max(1, 2048 // int(n)), vocab, args.seed)
                          for n in args.prefill_lens.split(",")]
    results["decode"] = [measure_decode(llm, int(b), args.decode_context, vocab, args.warmup, args.window,
                                        args.seed) for b in args.decode_batches.split(",")]
    reqs = workload(args.num_requests, pr, orr, vocab, args.seed)
    results["workload"] = run_engine_workload(llm, reqs)
    if args.compare_transformers:
        hf = run_transformers_workload(model_dir, reqs, args.hf_batch, getattr(torch, args.dtype),
                                       str(llm.engine.device))
        results["transformers"] = hf
        results["speedup_vs_transformers"] = results["workload"]["output_tok_s"] / hf["output_tok_s"]
        same = sum(a == b for a, b in zip(results["workload"]["outputs"], hf["outputs"]))
        results["greedy_agreement"] = f"{same}/{len(reqs)}"
        del hf["outputs"]
    del results["workload"]["outputs"]

    print(f"model {results['model']} on {results['device']} ({results['threads']} threads)")
    for p in results["prefill"]:
        print(f"prefill  len={p['prompt_len']:>5}  {p['tok_s']:>10.0f} tok/s")
    for d in results["decode"]:
        print(f"decode   batch={d['batch']:>4} ctx={d['context']}  {d['steps_s']:>8.1f} steps/s  "
              f"{d['tok_s']:>9.0f} tok/s  overhead {d['overhead_share'] * 100:.1f}%")
    w = results["workload"]
    print(f"workload {args.num_requests} reqs: {w['output_tok_s']:.0f} output tok/s, {w['total_tok_s']:.0f} total "
          f"tok/s, {w['seconds']:.2f}s, engine overhead {w['overhead_share'] * 100:.1f}%")
    if args.compare_transformers:
        h = results["transformers"]
        print(f"transformers generate (batches of {args.hf_batch}): {h['output_tok_s']:.0f} output tok/s, "
              f"{h['seconds']:.2f}s")
        print(f"speedup vs transformers: {results['speedup_vs_transformers']:.2f}x  "
              f"(greedy outputs identical: {results['greedy_agreement']})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    main()
