"""Throughput against per-user speed from decode sweeps (``sweep.py`` JSON, or a ``benchmark.py --suite
h200`` results.json): each batch a point (x: tokens/s per user, y: total tokens/s), the Pareto frontier
marked, and the bandwidth roofline of the same batches for reference. Needs matplotlib
(``pip install -e '.[bench]'``).

    python examples/sweep/plot.py sweep.json [other.json ...] --out pareto.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both coordinates (higher is better in both), by ascending x."""
    front, best_y = [], float("-inf")
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if y > best_y:
            front.append((x, y))
            best_y = y
    return sorted(front)


def plot(files: list[Path], out: Path, title: str | None = None) -> list[dict]:
    """Write the PNG; return, per file, its label, points and frontier."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("plot.py needs matplotlib: pip install -e '.[bench]'") from exc
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    summary = []
    for i, f in enumerate(files):
        res = json.loads(Path(f).read_text())
        rows = sorted(res["decode"], key=lambda r: r["batch"])
        if not rows:
            raise ValueError(f"{f}: no decode rows")
        label = f"{res.get('shape', Path(f).stem)}" + (" eager" if res.get("enforce_eager") else "")
        color = f"C{i}"
        pts = [(r["per_user_tok_s"], r["tok_s"]) for r in rows]
        front = pareto_front(pts)
        ax.scatter(*zip(*pts), color=color, s=18, alpha=0.6)
        ax.plot(*zip(*front), color=color, marker="o", lw=2, label=f"{label}: Pareto frontier")
        for r in rows:
            ax.annotate(str(r["batch"]), (r["per_user_tok_s"], r["tok_s"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        if all("roofline_tok_s" in r for r in rows):
            roof = [(r["roofline_tok_s"] / r["batch"], r["roofline_tok_s"]) for r in rows]
            ax.plot(*zip(*roof), color=color, ls="--", lw=1, label=f"{label}: bandwidth roofline")
        summary.append({"file": str(f), "label": label, "points": pts, "front": front})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user decode speed (tokens/s per request)")
    ax.set_ylabel("total decode throughput (tokens/s)")
    ax.set_title(title or "Decode throughput vs per-user speed (labels: batch size)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("pareto.png"))
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    for s in plot(args.files, args.out, args.title):
        print(f"{s['label']}: {len(s['points'])} points, frontier batches at per-user tok/s "
              + ", ".join(f"{x:.0f}" for x, _ in s["front"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
