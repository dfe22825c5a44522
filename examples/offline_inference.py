"""Generate from a DeepSeek checkpoint (default: the embedded tiny model trained on Python sources).

    python examples/offline_inference.py
    python examples/offline_inference.py --model tiny-v4     # the embedded tiny DeepSeek-V4
    python examples/offline_inference.py --model /path/to/DeepSeek-V2-Lite --dtype bfloat16
    python examples/offline_inference.py --dspark      # speculative decoding with the shipped draft
    python examples/offline_inference.py --cp 2        # each prompt's prefill over 2 context-parallel ranks
"""

from __future__ import annotations

import argparse

from deepinfer_core import LLM, SamplingParams

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i, line in enumerate(",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF-format checkpoint dir, Hugging Face id, or embedded model name "
                   "(tiny-v3, tiny-v4; default: tiny-v3)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--accelerator", default=None)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="per-request seq_seed")
    p.add_argument("--features", default="", help="comma-separated feature plugins to enable")
    p.add_argument("--dspark", action="store_true",
                   help="speculative decoding (the dspark feature; prints accept_rate per sample)")
    p.add_argument("--config", default=None, help="TOML config file")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--check_structured_output", action="store_true",
                   help="run regex, JSON Schema, EBNF and EOS-terminated requests with the structured_output "
                        "feature and print pass/fail for each")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context parallelism: split each prompt's prefill over CP "
                   "gloo processes (deepinfer_core/parallel/context_parallel.py); rank 0 then decodes")
    return p.parse_args(argv)


def run_context_parallel(args: argparse.Namespace) -> None:
    import tempfile

    from deepinfer_core.parallel import cp_worker

    llm_kw = {k: v for k, v in (("model", args.model), ("dtype", args.dtype), ("accelerator", args.accelerator),
                                ("config", args.config)) if v is not None}
    tokenizer = LLM(**llm_kw).tokenizer
    params = {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens,
              "seq_seed": args.seed}
    for prompt in args.prompt or DEFAULT_PROMPTS:
        with tempfile.TemporaryDirectory() as out:
            res = cp_worker.run(llm_kw, tokenizer.encode(prompt), params, args.cp, out)
        print("=" * 72)
        print(prompt + tokenizer.decode(res["tokens"]))
        print(f"-- cp={args.cp} prefill {res['prefill_s'] * 1000:.1f}ms, {res['loaded']} prompt tokens' KV loaded "
              f"on rank 0, {len(res['tokens'])} tokens decoded there")


def build_llm(args: argparse.Namespace, **extra) -> LLM:
    features = [f for f in args.features.split(",") if f]
    if getattr(args, "dspark", False) and "dspark" not in features:
        features.append("dspark")
    kw = dict(extra)
    if features:
        kw["features"] = features
    if args.dp != 1 or args.ep != 1:
        kw.update(dp=args.dp, ep=args.ep)
    return LLM(model=args.model, dtype=args.dtype, accelerator=args.accelerator, config=args.config, **kw)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.check_structured_output:
        return check_structured_output(args)
    if args.cp > 1:
        return run_context_parallel(args)
    llm = build_llm(args)
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seq_seed=args.seed)
    outputs = llm.generate(prompts, params)
    for out in outputs:
        m = out.metrics
        print("=" * 72)
        if out.error is not None:
            print(f"request failed: {out.error}")
            continue
        print(out.prompt + out.outputs[0].text)
        extra = "".join(f" {k}={v:.3f}" for k, v in sorted(m.extra.items()) if isinstance(v, float))
        ppl = f"{m.decode_ppl:.2f}" if m.decode_ppl is not None else "n/a"
        print(f"-- finish={out.outputs[0].finish_reason} tokens={len(out.outputs[0].token_ids)} "
              f"decode_ppl={ppl} ttft={m.time_to_first_token * 1000:.1f}ms{extra}")
    llm.shutdown()


def check_structured_output(args: argparse.Namespace) -> None:
    from plugins.structured_output.selfcheck import run_check

    if "structured_output" not in args.features.split(","):
        args.features = ",".join(f for f in (args.features, "structured_output") if f)
    llm = build_llm(args)
    results = run_check(llm, seed=args.seed, temperature=args.temperature)
    llm.shutdown()
    for r in results:
        print(f"{'PASS' if r.ok else 'FAIL'}  {r.name:<13} {r.detail}")
    print(f"{sum(r.ok for r in results)} passed, {sum(not r.ok for r in results)} failed")
    if not all(r.ok for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
