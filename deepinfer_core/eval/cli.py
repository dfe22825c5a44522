"""``deepinfer eval ...`` subcommands (wired into ``deepinfer_core/cli.py`` by :func:`add_eval_parser`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: samples per item when --samples is not given (AIME and GPQA are sampled several times by convention)
DEFAULT_SAMPLES = {"aime": 32, "gpqa": 8, "hle": 1, "generic": 1}


def add_eval_parser(sub) -> None:
    """Add ``eval`` with its subcommands to the top-level subparsers ``sub``."""
    ev = sub.add_parser("eval", help="offline evaluation: generate, judge, report, ppl")
    esub = ev.add_subparsers(dest="eval_command", metavar="STAGE")
    esub.required = True

    g = esub.add_parser("generate", help="k samples per dataset item -> generations JSONL (resumable)")
    g.add_argument("--dataset", required=True, type=Path, help="JSONL dataset")
    g.add_argument("--out", required=True, type=Path, help="generations JSONL (appended to; a rerun resumes)")
    g.add_argument("--adapter", default="generic", choices=sorted(DEFAULT_SAMPLES), help="input shape")
    g.add_argument("--samples", "-k", type=int, default=None,
                   help="samples per item (default: aime 32, gpqa 8, otherwise 1)")
    g.add_argument("--seed", type=int, default=0, help="base seed of the per-sample seeds")
    g.add_argument("--chunk-items", type=int, default=16, help="items per engine batch (part of the resume key)")
    g.add_argument("--limit", type=int, default=None, help="only the first N items")
    g.add_argument("--skip-images", action="store_true", help="hle: leave out items with an image")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeat for several)")
    g.add_argument("--sampling-json", default=None, help="other SamplingParams fields as a JSON object")
    _engine_args(g)
    g.set_defaults(func=_clean_errors(_cmd_generate))

    j = esub.add_parser("judge", help="score a generations JSONL (never generates)")
    j.add_argument("--generations", required=True, type=Path)
    j.add_argument("--out", type=Path, default=None, help="scores JSONL (default: <generations>.<judge>.scores.jsonl)")
    j.add_argument("--judge", choices=("rule", "llm"), default="rule")
    j.add_argument("--judge-url", default=None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    j.add_argument("--judge-model", default=None, help="model name sent to the judge endpoint")
    j.add_argument("--judge-prompt", type=Path, default=None,
                   help="prompt file with {{question}}, {{reference}}, {{response}} (default: the bundled one)")
    j.add_argument("--judge-api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key")
    j.add_argument("--judge-concurrency", type=int, default=8)
    j.add_argument("--judge-max-tokens", type=int, default=512)
    j.add_argument("--quiet", action="store_true", help="print the summary only, not the per-item table")
    j.set_defaults(func=_clean_errors(_cmd_judge))

    r = esub.add_parser("report", help="summary table and PNG from one or more scores files")
    r.add_argument("scores", nargs="+", type=Path)
    r.add_argument("--png", type=Path, default=None, help="write the Pass@k / by-category PNG here")
    r.set_defaults(func=_clean_errors(_cmd_report))

    p = esub.add_parser("ppl", help="held-out perplexity and greedy continuations against the recorded baseline")
    from deepinfer_core.eval import ppl

    p.add_argument("--texts", type=Path, default=ppl.HELDOUT_DIR, help="directory of *.txt held-out texts")
    p.add_argument("--prompts", type=Path, default=ppl.PROMPTS, help="JSON list of greedy prompts")
    p.add_argument("--baseline", type=Path, default=ppl.BASELINE)
    p.add_argument("--window", type=int, default=ppl.DEFAULT_WINDOW)
    p.add_argument("--rtol", type=float, default=None,
                   help=f"perplexity tolerance (default: {ppl.CPU_PPL_RTOL} in float32, {ppl.BF16_PPL_RTOL} otherwise)")
    p.add_argument("--greedy-margin", type=float, default=None,
                   help="compare greedy tokens up to the first baseline step with a smaller margin "
                        f"(default: 0 in float32, {ppl.BF16_GREEDY_MARGIN} otherwise)")
    p.add_argument("--write-baseline", action="store_true", help="record the baseline instead of checking it")
    p.add_argument("--json", action="store_true", help="print the measurement as JSON")
    _engine_args(p)
    p.set_defaults(func=_clean_errors(_cmd_ppl))


def _clean_errors(fn):
    """Bad input (a dataset line, a settings mismatch, a judge endpoint) is one line naming it, exit 2."""
    from deepinfer_core.eval.llm_judge import JudgeError

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ValueError, TypeError, FileNotFoundError, JudgeError) as exc:
            print(f"deepinfer eval {args.eval_command}: error: {exc}", file=sys.stderr)
            return 2

    return run


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--accelerator", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--config", default=None, help="engine TOML config (features, dp/ep, ...)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any engine config key, VALUE in TOML syntax, e.g. -o dp=2 -o 'features=[\"dspark\"]' "
                        "(repeat)")


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for name in ("model", "accelerator", "dtype", "config"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    from deepinfer_core.cli import _parse_option  # one reader of -o KEY=VALUE, shared with `deepinfer serve`

    kw.update(_parse_option(item) for item in args.option)
    return kw


def _cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer_core.eval.generate import GenerateSettings, run_generate

    sampling: dict[str, Any] = json.loads(args.sampling_json) if args.sampling_json else {}
    if not isinstance(sampling, dict):
        raise SystemExit("--sampling-json must be a JSON object of SamplingParams fields")
    for flag in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop"):
        if getattr(args, flag) is not None:
            sampling[flag] = getattr(args, flag)
    k = args.samples if args.samples is not None else DEFAULT_SAMPLES[args.adapter]
    settings = GenerateSettings(k=k, seed=args.seed, chunk_items=args.chunk_items, sampling=sampling)
    stats = run_generate(args.dataset, args.out, settings, adapter=args.adapter, llm_kwargs=_llm_kwargs(args),
                         skip_images=args.skip_images, limit=args.limit)
    print(json.dumps(stats))
    return 0


def _cmd_judge(args: argparse.Namespace) -> int:
    from deepinfer_core.eval.jsonl import read_jsonl
    from deepinfer_core.eval.judge import default_scores_path, format_item_table, format_summary, run_judge

    if args.judge == "llm":
        from deepinfer_core.eval.llm_judge import DEFAULT_PROMPT, LLMJudge

        if not args.judge_url or not args.judge_model:
            raise SystemExit("--judge llm needs --judge-url and --judge-model")
        judge = LLMJudge.from_args(args.judge_url, args.judge_model, args.judge_prompt, args.judge_api_key_env,
                                   args.judge_concurrency, args.judge_max_tokens)
        info = {"name": "llm", "url": args.judge_url, "model": args.judge_model,
                "prompt_file": str(args.judge_prompt or DEFAULT_PROMPT)}
    else:
        from deepinfer_core.eval.rule_judge import RuleJudge

        given = [f for f in ("judge_url", "judge_model", "judge_prompt") if getattr(args, f) is not None]
        if given:
            raise SystemExit(f"{', '.join('--' + f.replace('_', '-') for f in given)} only apply to --judge llm")

        judge, info = RuleJudge(), {"name": "rule"}
    out = args.out or default_scores_path(args.generations, args.judge)
    summary = run_judge(args.generations, out, judge, info)
    if not args.quiet:
        print(format_item_table(read_jsonl(out)))
        print()
    print(format_summary(summary))
    print(f"\nscores: {out}", file=sys.stderr)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from deepinfer_core.eval.report import format_report, load_runs, plot_report

    runs = load_runs(args.scores)
    print(format_report(runs))
    if args.png is not None:
        print(f"\nwrote {plot_report(runs, args.png)}", file=sys.stderr)
    return 0


def _cmd_ppl(args: argparse.Namespace) -> int:
    from deepinfer_core import LLM
    from deepinfer_core.eval import ppl
    from deepinfer_core.eval.jsonl import write_json_atomic

    with LLM(**_llm_kwargs(args)) as llm:
        result = ppl.measure(llm, args.texts, args.prompts, args.window)
    print(json.dumps(result, indent=2) if args.json else
          f"perplexity {result['ppl']:.6f} over {result['tokens']} tokens ({result['dtype']}, {result['accelerator']})")
    if args.write_baseline:
        import torch

        result["recorded_with"] = {"command": "deepinfer " + " ".join(sys.argv[1:]), "torch": torch.__version__}
        write_json_atomic(args.baseline, result)
        print(f"wrote baseline {args.baseline}", file=sys.stderr)
        return 0
    baseline = json.loads(Path(args.baseline).read_text())
    fp32 = result["dtype"] == "float32"
    rtol = args.rtol if args.rtol is not None else (ppl.CPU_PPL_RTOL if fp32 else ppl.BF16_PPL_RTOL)
    margin = args.greedy_margin if args.greedy_margin is not None else (0.0 if fp32 else ppl.BF16_GREEDY_MARGIN)
    problems = ppl.compare(baseline, result, rtol, margin)
    rel = (result["ppl"] - baseline["ppl"]) / baseline["ppl"]
    print(f"baseline {baseline['ppl']:.6f} ({baseline.get('dtype')}, {baseline.get('accelerator')}): "
          f"relative change {rel:+.2e}, tolerance {rtol:.1e}; greedy tokens may depart only where the "
          f"baseline margin < {margin}")
    for prob in problems:
        print(f"FAIL: {prob}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1
