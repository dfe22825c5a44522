#!/usr/bin/env python
"""Numbers for structured output and batch-invariant mode, on CPU.

    python examples/so_bench.py                 # all three sections
    python examples/so_bench.py --mask          # mask overhead per token per request (32k vocabulary)
    python examples/so_bench.py --json200       # 200 mixed JSON-Schema requests on the embedded model
    python examples/so_bench.py --bi            # throughput cost of batch_invariant=True

* ``--mask``: a 32k byte-level BPE (trained once on the Python standard library, cached under
  $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer) and JSON-Schema, regex and EBNF grammars. Each
  constrained request-token costs a mask fill (xgrammar) and its preparation for CPU logits (a list
  of allowed ids, or a {0, -inf} row), both on the mask worker thread in the engine, plus applying
  it to the [1, 32000] float32 logits row on the engine thread. They are timed over random walks
  through the grammars (a token drawn uniformly from the allowed set each step), each state measured
  5 times; the median and p99 of each part and of the sum are printed for the first measurement and
  for the best of the 5 (which drops the preemptions a shared machine adds). Then the time
  ``process_logits`` spends per masked row is measured inside the engine on a random 32k-vocabulary
  checkpoint (the fills overlap the forward pass there, so this is what the step loop pays).
* ``--json200``: 200 requests over 10 schemas, temperature 0.8, seeds 0..19, one batch on one LLM;
  every output must parse (``json.loads``) and validate (``jsonschema``).
* ``--bi``: the same workload with and without ``batch_invariant=True``, interleaved repetitions;
  prints output tokens/s and the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deepinfer_core import LLM, SamplingParams  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 4},
                                      "active": {"type": "boolean"}},
     "required": ["id", "tags", "active"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error", "pending"]},
                                      "code": {"type": "integer", "minimum": 100, "maximum": 599}},
     "required": ["status", "code"]},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 6},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -999, "maximum": 999},
        "y": {"type": "integer", "minimum": -999, "maximum": 999}}, "required": ["x", "y"]},
        "label": {"type": "string", "maxLength": 12}}, "required": ["point", "label"]},
    {"type": "object", "properties": {"user": {"type": "string", "pattern": "^[a-z]{3,10}$"},
                                      "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}},
     "required": ["user", "email"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["ok", "note"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 6},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"lang": {"enum": ["python", "c", "rust", "go"]},
                                      "version": {"type": "string", "pattern": "^[0-9]\\.[0-9]{1,2}$"},
                                      "typed": {"type": "boolean"}},
     "required": ["lang", "version"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
]
REGEXES = [r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", r"[a-z_][a-z0-9_]{0,30}\(\)",
           r"(GET|POST) /[a-z]{1,10}(/[a-z0-9]{1,10}){0,3} HTTP/1\.[01]"]
EBNF = r'''
root ::= stmt ("\n" stmt){0,4}
stmt ::= name " = " expr
expr ::= term (" " op " " term){0,3}
term ::= name | [0-9]{1,4} | "(" name ")"
op ::= "+" | "-" | "*" | "//"
name ::= [a-z] [a-z_0-9]{0,7}
'''


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ---- mask overhead ----------------------------------------------------------------------------------
def bpe32k_path() -> Path:
    """A 32000-token byte-level BPE trained on the Python standard library (cached)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cache = Path(os.environ.get("DEEPINFER_CACHE_DIR", Path.home() / ".cache" / "deepinfer"))
    path = cache / "so_bench_bpe32k.json"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for p in sorted(stdlib.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts:
            continue
        try:
            texts.append(p.read_text())
        except (UnicodeDecodeError, OSError):
            continue
        size += len(texts[-1])
        if size > 12_000_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    print(f"training a 32k byte-level BPE on {size / 1e6:.0f} MB of stdlib sources (once) ...", flush=True)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def bench_mask(walks: int, engine_check: bool, repeats: int = 5) -> None:
    from tokenizers import Tokenizer

    from plugins.structured_output.bitmask import apply_cpu_masks
    from plugins.structured_output.grammar import GrammarCompiler, parse_so_args, tokenizer_info
    from plugins.structured_output.matcher import GrammarState

    torch.set_num_threads(1)
    tk = Tokenizer.from_file(str(bpe32k_path()))
    V = 32000
    info = tokenizer_info(tk, V, [1])
    compiler = GrammarCompiler(info, 2, 512, 1 << 30)
    specs = ([parse_so_args({"schema_type": "json", "schema": s}, V) for s in SCHEMAS]
             + [parse_so_args({"schema_type": "regex", "schema": r}, V) for r in REGEXES]
             + [parse_so_args({"schema_type": "ebnf", "schema": EBNF}, V)])
    t0 = time.perf_counter()
    compiled = [compiler.compile_now(s.key) for s in specs]
    print(f"compiled {len(specs)} grammars for a 32k vocabulary in {time.perf_counter() - t0:.2f} s "
          f"(2 builder threads)")
    rng = random.Random(0)
    logits = torch.randn(1, V)
    first: dict[str, list[float]] = {"fill": [], "apply": [], "total": []}
    best: dict[str, list[float]] = {"fill": [], "apply": [], "total": []}
    tokens = 0
    for w in range(walks):
        k = w % len(specs)
        st = GrammarState(compiled[k], specs[k], [1], V, cpu_masks=True)
        for _ in range(300):
            runs = []
            for _ in range(repeats):  # the same state again: filling does not change the matcher
                row = logits.clone()
                st.mask_valid = False
                t0 = time.perf_counter()
                mask = st.next_cpu_mask()  # fill + preparation: the mask worker's part
                t1 = time.perf_counter()
                apply_cpu_masks(row, [0], [mask])  # the engine thread's part
                t2 = time.perf_counter()
                runs.append((t1 - t0, t2 - t1, t2 - t0))
            for i, name in enumerate(("fill", "apply", "total")):
                first[name].append(runs[0][i])
                best[name].append(min(r[i] for r in runs))
            allowed = torch.isfinite(row[0]).nonzero().flatten().tolist()
            tok = rng.choice(allowed)
            tokens += 1
            if not st.accept_token(tok) or not st.active:
                break
    us = 1e6
    print(f"mask overhead per token per request, 32k vocabulary ({tokens} request-tokens over {walks} walks "
          f"through {len(specs)} grammars; first measurement / best of {repeats} per token):")
    for name, label in (("fill", "fill + prepare (mask worker)"), ("apply", "apply (engine thread)"),
                        ("total", "total")):
        a, b = first[name], best[name]
        print(f"  {label:<28} median {statistics.median(a) * us:6.1f} / {statistics.median(b) * us:5.1f} us   "
              f"p99 {pct(a, 0.99) * us:7.1f} / {pct(b, 0.99) * us:7.1f} us")
    compiler.shutdown()
    if engine_check:
        bench_mask_in_engine(tk)


def bench_mask_in_engine(tk) -> None:
    """process_logits time per masked row on a random 32k-vocabulary checkpoint (overlap on)."""
    from random_checkpoint import make_random_checkpoint, shape_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(shape_config("v3-tiny"), vocab_size=32000)
        path = make_random_checkpoint(Path(tmp), cfg)
        tk.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": "<|end_of_text|>"}))
        llm = LLM(model=str(path), features=["structured_output"], kv_cache_memory=256 << 20)
        feat = llm.engine.features[0]
        params = [SamplingParams(max_tokens=48, temperature=1.0, seq_seed=i, ignore_eos=True,
                                 so_args={"schema_type": "json", "schema": SCHEMAS[i % len(SCHEMAS)]})
                  for i in range(16)]
        llm.generate(["x = "] * 4, params[:4], use_tqdm=False)  # compile and warm up
        s0 = dict(feat.stats)
        llm.generate(["x = "] * 16, params, use_tqdm=False)
        rows = feat.stats["masked_rows"] - s0["masked_rows"]
        wait = feat.stats["mask_wait_s"] - s0["mask_wait_s"]
        app = feat.stats["apply_s"] - s0["apply_s"]
        print(f"in the engine (16 JSON requests, batch 16, 32k vocab, fills overlapped): {rows} masked rows, "
              f"process_logits {1e6 * (wait + app) / rows:.1f} us per row (waiting for fills "
              f"{1e6 * wait / rows:.1f} us, applying {1e6 * app / rows:.1f} us)")
        llm.shutdown()


# ---- 200 JSON-Schema requests -----------------------------------------------------------------------
def bench_json200(n: int = 200) -> None:
    import jsonschema

    llm = LLM(features=["structured_output"], kv_cache_memory=256 << 20)
    prompts = ["data = ", "# JSON\n", "config = ", "payload = json.loads('"]
    reqs = [(prompts[i % len(prompts)], SCHEMAS[i % len(SCHEMAS)],
             SamplingParams(max_tokens=256, temperature=0.8, seq_seed=i // len(SCHEMAS),
                            so_args={"schema_type": "json", "schema": SCHEMAS[i % len(SCHEMAS)]}))
            for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate([r[0] for r in reqs], [r[2] for r in reqs], use_tqdm=False)
    dt = time.perf_counter() - t0
    parsed = valid = 0
    reasons: dict[str, int] = {}
    failures = []
    for (_, schema, _), out in zip(reqs, outs):
        comp = out.outputs[0]
        reasons[comp.finish_reason] = reasons.get(comp.finish_reason, 0) + 1
        try:
            value = json.loads(comp.text)
            parsed += 1
            jsonschema.validate(value, schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((comp.text[:80], str(exc).splitlines()[0]))
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} JSON-Schema requests ({len(SCHEMAS)} schemas) on the embedded model: parsed {parsed}/{n}, "
          f"valid {valid}/{n} ({100 * valid / n:.0f}%), finish reasons {reasons}, {ntok} tokens in {dt:.1f} s, "
          f"mean {ntok / n:.1f} tokens per output")
    m = llm.metrics()
    print(f"  compile: {m['so_cache_misses']} grammars in {m['so_compile_s']:.2f} s builder time, "
          f"cache hits {m['so_cache_hits']}")
    for text, err in failures[:5]:
        print(f"  FAIL {text!r}: {err}")
    llm.shutdown()


# ---- batch-invariant throughput cost ----------------------------------------------------------------
def bench_bi(reps: int, requests: int, out_tokens: int) -> None:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 4000) for _ in range(rng.randrange(20, 200))]}
               for _ in range(requests)]
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    llms = {mode: LLM(batch_invariant=mode, kv_cache_memory=256 << 20) for mode in (False, True)}
    for llm in llms.values():
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm up (and the invariant GEMM self-checks)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for mode, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[mode].append(time.perf_counter() - t0)
    ptok = sum(len(p["prompt_token_ids"]) for p in prompts)
    otok = requests * out_tokens
    print(f"batch-invariant cost ({requests} requests, {ptok} prompt + {otok} output tokens, embedded model, "
          f"{torch.get_num_threads()} thread(s), {reps} interleaved repetitions):")
    for mode in (False, True):
        t = times[mode]
        print(f"  batch_invariant={mode!s:<5}  median {statistics.median(t):.2f} s  best {min(t):.2f} s  "
              f"-> {otok / statistics.median(t):.0f} output tok/s")
    cost = statistics.median(times[True]) / statistics.median(times[False]) - 1
    best = min(times[True]) / min(times[False]) - 1
    print(f"  throughput cost: {100 * cost:.0f}% (median), {100 * best:.0f}% (best of {reps})")
    for llm in llms.values():
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mask", action="store_true")
    p.add_argument("--json200", action="store_true")
    p.add_argument("--bi", action="store_true")
    p.add_argument("--walks", type=int, default=60, help="--mask: random walks through the grammars")
    p.add_argument("--no-engine", action="store_true", help="--mask: skip the in-engine measurement")
    p.add_argument("--reps", type=int, default=5, help="--bi: interleaved repetitions")
    p.add_argument("--requests", type=int, default=32, help="--bi: requests per run")
    p.add_argument("--out-tokens", type=int, default=32, help="--bi: output tokens per request")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "examples"))
    everything = not (args.mask or args.json200 or args.bi)
    if args.mask or everything:
        bench_mask(args.walks, not args.no_engine)
    if args.json200 or everything:
        bench_json200()
    if args.bi or everything:
        bench_bi(args.reps, args.requests, args.out_tokens)


if __name__ == "__main__":
    main()
