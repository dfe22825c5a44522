"""``deepinfer eval judge``: score a generations JSONL; never generates.

Writes a scores JSONL (one line per item: every sample's extracted answer and verdict, the item's
correct count and pass@k) and a summary JSON beside it (``<scores>.summary.json``: pass@k over the
dataset, accuracy by category and difficulty, counts of generation and judge errors), replacing both
atomically. A sample whose generation failed is wrong without asking the judge.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deepinfer_core.eval.jsonl import read_jsonl, write_json_atomic, write_jsonl_atomic
from deepinfer_core.eval.passk import default_ks, mean_pass_at_k, pass_at_k
from deepinfer_core.eval.rule_judge import RuleJudge, Verdict


def summary_path(scores: Path) -> Path:
    scores = Path(scores)
    return scores.with_name(scores.name.removesuffix(".jsonl") + ".summary.json")


def default_scores_path(generations: Path, judge_name: str) -> Path:
    generations = Path(generations)
    return generations.with_name(f"{generations.name.removesuffix('.jsonl')}.{judge_name}.scores.jsonl")


def run_judge(generations: Path, out: Path, judge=None, judge_info: dict | None = None) -> dict[str, Any]:
    """Judge every sample of ``generations``; write ``out`` and its summary; return the summary."""
    judge = judge or RuleJudge()
    records = read_jsonl(generations, "generation record")
    if not records:
        raise ValueError(f"{generations}: no generation records")
    seen: set[str] = set()
    for rec in records:
        for key in ("id", "answer", "answer_type", "samples"):
            if key not in rec:
                raise ValueError(f"{generations}: record {rec.get('id')!r} has no {key!r}; is this a file written by "
                                 "`deepinfer eval generate`?")
        if rec["id"] in seen:
            raise ValueError(f"{generations}: item {rec['id']!r} appears twice")
        seen.add(rec["id"])

    jobs = [(rec, s) for rec in records for s in rec["samples"]]

    def one(job) -> Verdict:
        rec, sample = job
        if sample.get("error") or sample.get("finish_reason") == "error":
            return Verdict(False, None, f"generation error: {sample.get('error')}")
        return judge.judge(rec, sample["text"])

    workers = max(1, int(getattr(judge, "concurrency", 1)))
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            verdicts = list(pool.map(one, jobs))
    else:
        verdicts = [one(job) for job in jobs]

    scores, pos = [], 0
    for rec in records:
        n = len(rec["samples"])
        vs = verdicts[pos:pos + n]
        pos += n
        c = sum(v.correct for v in vs)
        scores.append({
            "id": rec["id"], "category": rec.get("category"), "difficulty": rec.get("difficulty"),
            "answer": rec["answer"], "answer_type": rec["answer_type"], "n": n, "correct": c,
            "pass_at_k": {str(k): round(pass_at_k(n, c, k), 6) for k in default_ks(n)} if n else {},
            "samples": [{"index": s.get("index", j), "extracted": v.extracted, "correct": v.correct,
                         "reason": v.reason, "error": v.error} for j, (s, v) in enumerate(zip(rec["samples"], vs))],
        })
    summary = summarize(scores)
    summary["judge"] = judge_info or {"name": getattr(judge, "name", type(judge).__name__)}
    summary["generations"] = str(generations)
    summary["generation_errors"] = sum(1 for _, s in jobs if s.get("error") or s.get("finish_reason") == "error")
    summary["judge_errors"] = sum(1 for v in verdicts if v.error)
    summary["no_answer"] = sum(1 for v in verdicts if v.extracted is None)
    write_jsonl_atomic(out, scores)
    write_json_atomic(summary_path(out), summary)
    return summary


def summarize(scores: list[dict]) -> dict[str, Any]:
    """Dataset-level pass@k (for k up to the smallest n) and pass@1 by category and difficulty."""
    counts = [(s["n"], s["correct"]) for s in scores if s["n"] > 0]
    if not counts:
        raise ValueError("no judged samples")
    n_min = min(n for n, _ in counts)
    out: dict[str, Any] = {
        "items": len(scores), "samples": sum(n for n, _ in counts),
        "samples_per_item": sorted({n for n, _ in counts}),
        "pass_at_k": {str(k): round(mean_pass_at_k(counts, k), 6) for k in default_ks(n_min)},
    }
    out["pass@1"] = out["pass_at_k"]["1"]
    for field in ("category", "difficulty"):
        groups: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for s in scores:
            if s["n"] > 0 and s.get(field) is not None:
                groups[str(s[field])].append((s["n"], s["correct"]))
        out[f"by_{field}"] = {g: {"items": len(c), "pass@1": round(mean_pass_at_k(c, 1), 6)}
                              for g, c in sorted(groups.items())}
    return out


def format_item_table(scores: list[dict]) -> str:
    rows = [("id", "category", "difficulty", "n", "correct", "pass@1", "answer", "extracted (first sample)")]
    for s in scores:
        first = s["samples"][0]["extracted"] if s["samples"] else None
        rows.append((str(s["id"]), str(s.get("category") or "-"), str(s.get("difficulty") or "-"), str(s["n"]),
                     str(s["correct"]), f"{s['correct'] / s['n']:.3f}" if s["n"] else "-", _clip(s["answer"]),
                     _clip(first)))
    return format_table(rows)


def format_summary(summary: dict) -> str:
    lines = [f"judge: {summary.get('judge', {}).get('name')}   items: {summary['items']}   "
             f"samples: {summary['samples']}   judge errors: {summary.get('judge_errors', 0)}   "
             f"generation errors: {summary.get('generation_errors', 0)}   no answer: {summary.get('no_answer', 0)}"]
    lines.append(format_table([("k", "pass@k")] + [(k, f"{v:.4f}") for k, v in summary["pass_at_k"].items()]))
    for field in ("category", "difficulty"):
        groups = summary.get(f"by_{field}") or {}
        if groups:
            lines.append(format_table([(field, "items", "pass@1")] +
                                [(g, str(v["items"]), f"{v['pass@1']:.4f}") for g, v in groups.items()]))
    return "\n\n".join(lines)


def _clip(x: Any, width: int = 24) -> str:
    s = "-" if x is None else str(x).replace("\n", " ")
    return s if len(s) <= width else s[: width - 1] + "…"


def format_table(rows: list[tuple[str, ...]]) -> str:
    """A Markdown table; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows[1:]])
