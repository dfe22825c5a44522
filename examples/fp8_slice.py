"""DeepSeek-V3 slice (full V3 widths, a few layers) with FP8 weights against the same weights dequantised to
bf16: weight memory, decode tok/s at batch 64 and 256 (each measured ``--repeats`` times), greedy agreement.

    python examples/fp8_slice.py --out DIR [--layers 4] [--batches 64,256] [--repeats 2]

Both engines start from the same seeded random weights (``load_format = "random"``): the FP8 one quantises
them per 128x128 tile (what ``random_checkpoint.py --fp8`` writes; ``weight_dtype = "fp8"``), the bf16 one
writes each weight back as its dequantised FP8 tiles (``quantize_model_fp8(round_trip=True)``, what
``weight_dtype = "bf16"`` loads from that checkpoint), so the two differ only in the GEMMs: block-scaled
FP8 with activations quantised per token and 128 channels, against bf16 cuBLAS. Greedy agreement: the
tokens of ``--prompts`` prompts up to their first difference; random weights give flat logits, so the telling
figure is the teacher-forced top-1 agreement (both engines score the FP8 engine's tokens) by the bf16 margin.
Decode tok/s come from ``h200_suite``'s steady-state sweep (prefill all, then ``window`` timed steps per batch).
"""

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


def score(llm, prompts: list[list[int]], forced: list[list[int]]) -> list[list[list]]:
    """Teacher-forced top-2 of every continuation position: ``[token, logprob]`` pairs per position, the
    continuation being ``forced`` (the FP8 engine's greedy tokens) so both engines see identical prefixes."""
    from deepinfer_core import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p + f} for p, f in zip(prompts, forced)], sp, use_tqdm=False)
    rows = []
    for p, o in zip(prompts, outs):
        pos = o.prompt_logprobs[len(p):]  # entry i: the distribution that predicted token len(p) + i
        rows.append([sorted(([t, lp.logprob] for t, lp in d.items() if lp.rank in (1, 2)), key=lambda r: -r[1])
                     for d in pos])
    return rows


def agreement(a: list[list[list]], b: list[list[list]]) -> dict:
    """Top-1 agreement of two engines on the same teacher-forced positions, by the bf16 engine's top-1 margin
    (random weights give flat logits: near-ties flip under any rounding, clear choices must not)."""
    out = {}
    for floor in (0.0, 0.05, 0.2, 0.5):
        n = same = 0
        for pa, pb in zip(a, b):
            for ra, rb in zip(pa, pb):
                if len(rb) < 2 or rb[0][1] - rb[1][1] < floor:
                    continue
                n += 1
                same += ra[0][0] == rb[0][0]
        out[f"margin>={floor}"] = f"{same}/{n}"
    drift = [abs(ra[0][1] - rb[0][1]) for pa, pb in zip(a, b) for ra, rb in zip(pa, pb) if ra[0][0] == rb[0][0]]
    out["top1_logprob_drift_mean"] = sum(drift) / max(len(drift), 1)
    return out


def run_engine(mode: str, model_dir: Path, args, prompts: list[list[int]],
               forced: list[list[int]] | None = None) -> dict:
    from gpu_timing import measure_ceilings
    from h200_suite import FULL, ExpertCounter, build_llm, decode_sweep

    from deepinfer_core import SamplingParams
    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.loader import quantize_model_fp8

    batches = [int(b) for b in args.batches.split(",")]
    opts = dict(FULL, context=args.context, prefill_lens=str(args.context), warmup=3, window=args.window,
                max_batched=8192)
    t = time.perf_counter()
    llm = build_llm(model_dir, opts, batches, [args.context], None, 0,
                    weight_dtype="fp8" if mode == "fp8" else "bf16")
    counter = ExpertCounter(llm.engine.runner)  # before any step (graphs are captured without its hook)
    model = llm.engine.model
    if mode != "fp8":
        quantize_model_fp8(model, round_trip=True)
    res = {"mode": mode, "build_s": round(time.perf_counter() - t, 1),
           "weight_bytes": sum(p.numel() * p.element_size() for p in (*model.parameters(), *model.buffers())),
           "fp8_parameters": sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)}
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
    res["scored"] = score(llm, prompts, forced or res["greedy"])  # the first engine: its own tokens
    mc = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    ceil = measure_ceilings(str(llm.engine.device)) if args.repeats else {}
    res["decode"] = []
    for r in range(args.repeats):
        rows = decode_sweep(llm, mc, batches, args.context, opts["warmup"], opts["window"], ceil,
                            counter, random.Random(r))
        res["decode"].append({row["batch"]: round(row["tok_s"], 1) for row in rows})
        print(f"{mode}: run {r + 1} decode tok/s {res['decode'][-1]}", flush=True)
    llm.shutdown()
    del llm, model, counter
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    from random_checkpoint import shape_config, write_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="v3-slice", help="random_checkpoint shape (v3-tiny: a CPU smoke run)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--repeats", type=int, default=2, help="decode sweeps per engine (0: memory and greedy only)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = shape_config(args.shape) | {"num_hidden_layers": args.layers}
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_config(Path(tmp.name) / args.shape, cfg)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg["vocab_size"]) for _ in range(64)] for _ in range(args.prompts)]
    result = {"layers": args.layers, "args": vars(args)}
    forced = None
    for mode in ("fp8", "bf16_dequantised"):
        result[mode] = run_engine(mode, model_dir, args, prompts, forced)
        forced = forced or result[mode]["greedy"]
        (out / "fp8_slice.json").write_text(json.dumps(result, indent=1))
    a, b = result["fp8"]["greedy"], result["bf16_dequantised"]["greedy"]
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    result["greedy_agreement"] = {"equal_prefix_per_prompt": prefix, "tokens_equal": f"{same}/{sum(map(len, a))}",
                                  "first_token_equal": f"{sum(p > 0 for p in prefix)}/{len(a)}",
                                  "prompts_identical": f"{sum(p == q for p, q in zip(a, b))}/{len(a)}"}
    result["teacher_forced_top1"] = agreement(result["fp8"]["scored"], result["bf16_dequantised"]["scored"])
    result["weight_memory_ratio_fp8_over_bf16"] = result["fp8"]["weight_bytes"] / result["bf16_dequantised"][
        "weight_bytes"]
    (out / "fp8_slice.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("fp8", "bf16_dequantised")}), flush=True)
    for mode in ("fp8", "bf16_dequantised"):
        r = result[mode]
        print(f"{mode}: weights {r['weight_bytes'] / 1e9:.2f} GB, decode tok/s {r['decode']}", flush=True)


if __name__ == "__main__":
    main()
