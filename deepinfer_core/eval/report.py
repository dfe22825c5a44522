"""``deepinfer eval report``: a summary table and a PNG for one or more scores files.

The PNG has Pass@k against k (one line per scores file) and Pass@1 by category and by difficulty
(grouped bars); panels without data are left out. matplotlib is needed for the PNG only (the ``eval``
extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer_core.eval.jsonl import read_jsonl
from deepinfer_core.eval.judge import _clip, format_table, summarize, summary_path


def load_runs(paths: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    """(label, summary) per scores file; the summary is recomputed from the per-item scores."""
    runs = []
    for p in paths:
        p = Path(p)
        summary = summarize(read_jsonl(p, "score record"))
        side = summary_path(p)
        if side.is_file():
            saved = json.loads(side.read_text())
            for key in ("judge", "generations", "judge_errors", "generation_errors", "no_answer"):
                if key in saved:
                    summary[key] = saved[key]
        runs.append((p.name.removesuffix(".jsonl").removesuffix(".scores"), summary))
    return runs


def format_report(runs: list[tuple[str, dict[str, Any]]]) -> str:
    ks = sorted({int(k) for _, s in runs for k in s["pass_at_k"]})
    head = ("run", "judge", "items", "samples") + tuple(f"pass@{k}" for k in ks) + ("judge errors", "gen errors")
    rows = [head]
    for label, s in runs:
        rows.append((label, str((s.get("judge") or {}).get("name", "-")), str(s["items"]), str(s["samples"]))
                    + tuple(f"{s['pass_at_k'][str(k)]:.4f}" if str(k) in s["pass_at_k"] else "-" for k in ks)
                    + (str(s.get("judge_errors", "-")), str(s.get("generation_errors", "-"))))
    parts = [format_table(rows)]
    for field in ("category", "difficulty"):
        groups = sorted({g for _, s in runs for g in s.get(f"by_{field}", {})})
        if groups:
            rows = [(field,) + tuple(label for label, _ in runs)]
            for g in groups:
                rows.append((g,) + tuple(_cell(s.get(f"by_{field}", {}).get(g)) for _, s in runs))
            parts.append(f"Pass@1 by {field}:\n" + format_table(rows))
    return "\n\n".join(parts)


def _cell(group: dict | None) -> str:
    return "-" if group is None else f"{group['pass@1']:.4f} (n={group['items']})"


def plot_report(runs: list[tuple[str, dict[str, Any]]], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ["passk"] + [f for f in ("category", "difficulty") if any(s.get(f"by_{f}") for _, s in runs)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "passk":
            for label, s in runs:
                ks = sorted(int(k) for k in s["pass_at_k"])
                ax.plot(ks, [s["pass_at_k"][str(k)] for k in ks], marker="o", label=label)
            ks_all = sorted({int(k) for _, s in runs for k in s["pass_at_k"]})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks_all, [str(k) for k in ks_all])
            ax.minorticks_off()
            ax.set_xlabel("k (samples)")
            ax.set_ylabel("Pass@k (unbiased)")
            ax.set_title("Pass@k against k")
        else:
            groups = sorted({g for _, s in runs for g in s.get(f"by_{panel}", {})})
            width = 0.8 / len(runs)
            for i, (label, s) in enumerate(runs):
                by = s.get(f"by_{panel}", {})
                xs = [j + i * width for j in range(len(groups))]
                ax.bar(xs, [by.get(g, {}).get("pass@1", 0.0) for g in groups], width, label=label)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], [_clip(g, 28) for g in groups],
                          rotation=30, ha="right")
            ax.set_ylabel("Pass@1")
            ax.set_title(f"Pass@1 by {panel}")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
