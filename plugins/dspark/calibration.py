"""Calibrated per-position acceptance probabilities: a monotone (isotonic) map per draft depth from
the confidence head's output to the acceptance rate observed on held-out verifications.

The head's ``c_j`` estimates P(d_j accepted | d_1..d_{j-1} accepted). A single logistic layer with
one temperature is calibrated on average over depths, not at each depth: the product
``P_j = c_1 ... c_j`` that the length policies rank (the ``draft_lengths`` op, ``choose_lengths``)
inherits every depth's error. The map for depth j is fitted by pool-adjacent-violators on the
positions the target decided at that depth (every earlier draft accepted) and is applied by linear
interpolation between its knots (clamped at the ends); depths past the last map use the last one.

Stored beside the confidence head as plain JSON (``confidence_calibration.json``, never a pickle):

    {"format": 1, "kind": "isotonic", "depths": [{"x": [...], "y": [...]}, ...], ...metadata}

``x`` strictly increasing in [0, 1], ``y`` non-decreasing in [0, 1], of the same length.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

FILENAME = "confidence_calibration.json"
FORMAT = 1


def isotonic_fit(x: torch.Tensor, y: torch.Tensor, max_knots: int = 64, prior: float = 10.0
                 ) -> tuple[list[float], list[float]]:
    """Knots of the non-decreasing least-squares fit of ``y`` (0/1 outcomes) on ``x``
    (pool-adjacent-violators over ``x`` sorted), thinned to at most ``max_knots`` pooled blocks. Each
    block's rate is shrunk towards its mean ``x`` by ``prior`` pseudo-outcomes, so that a sparse
    block at an end (a handful of drafts, none accepted) does not map to exactly 0 or 1: a confidence
    of 0 would keep a request from ever being verified again at that depth."""
    if len(x) == 0:
        raise ValueError("isotonic_fit: no samples")
    order = torch.argsort(x.double(), stable=True)
    xs, ys = x.double()[order].tolist(), y.double()[order].tolist()
    blocks: list[list[float]] = []  # [sum y, count, sum x]
    for xi, yi in zip(xs, ys):
        blocks.append([yi, 1.0, xi])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
            s, n, sx = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
            blocks[-1][2] += sx
    if len(blocks) > max_knots:  # pool neighbouring blocks (sums: the pooled fit stays monotone)
        cuts = torch.linspace(0, len(blocks), max_knots + 1).round().long().tolist()
        blocks = [[sum(b[k] for b in blocks[a:e]) for k in range(3)] for a, e in zip(cuts, cuts[1:]) if e > a]
    out_x, out_y = [], []
    for s, n, sx in blocks:
        a = sx / n
        b = (s + prior * a) / (n + prior)
        if out_x and a <= out_x[-1]:  # equal centres merge
            out_y[-1] = max(out_y[-1], b)
            continue
        out_x.append(min(max(a, 0.0), 1.0))
        out_y.append(min(max(b, out_y[-1] if out_y else 0.0), 1.0))  # shrinkage may not break monotonicity
    return out_x, out_y


class Calibration:
    """Per-depth monotone maps of the confidence head's output (see the module docstring)."""

    def __init__(self, depths: list[tuple[list[float], list[float]]], meta: dict | None = None) -> None:
        if not depths:
            raise ValueError("a calibration needs at least one depth")
        self.depths = [(list(map(float, x)), list(map(float, y))) for x, y in depths]
        self.meta = dict(meta or {})
        self._t: dict = {}  # device -> [(x, y)] tensors

    @classmethod
    def fit(cls, conf: torch.Tensor, accepted: torch.Tensor, depth: torch.Tensor, max_depth: int,
            min_samples: int = 200, **meta) -> Calibration:
        """Fit depth 1..``max_depth`` from decided positions: head output ``conf``, outcome
        ``accepted`` (1.0 accepted), 0-based ``depth``. A depth with fewer than ``min_samples``
        positions reuses the previous depth's map."""
        maps: list[tuple[list[float], list[float]]] = []
        for j in range(max_depth):
            m = depth == j
            if int(m.sum()) >= min_samples or not maps:
                if not bool(m.any()):
                    raise ValueError(f"no decided positions at depth {j + 1} to calibrate")
                maps.append(isotonic_fit(conf[m], accepted[m]))
            else:
                maps.append(maps[-1])
        return cls(maps, {"fitted_positions": int(len(conf)), **meta})

    def apply(self, conf: torch.Tensor, depth: int) -> torch.Tensor:
        """Calibrated confidences of the drafts at ``depth`` (1-based) ([R] float32)."""
        key = conf.device
        if key not in self._t:
            self._t[key] = [(torch.tensor(x, dtype=torch.float32, device=key),
                             torch.tensor(y, dtype=torch.float32, device=key)) for x, y in self.depths]
        x, y = self._t[key][min(max(depth, 1), len(self.depths)) - 1]
        c = conf.float()
        if len(x) == 1:
            return y.expand_as(c).clone()
        i = torch.searchsorted(x, c.clamp(x[0], x[-1]).contiguous()).clamp(1, len(x) - 1)
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        f = ((c - x0) / (x1 - x0)).clamp(0.0, 1.0)
        return y0 + (y1 - y0) * f

    def save(self, path: Path) -> None:
        data = {**self.meta, "format": FORMAT, "kind": "isotonic",
                "depths": [{"x": [round(v, 6) for v in x], "y": [round(v, 6) for v in y]} for x, y in self.depths]}
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """Read and check a calibration file; a bad field raises ``ValueError`` naming it."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON calibration file ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a calibration file holds a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: field 'format' must be {FORMAT}, got {data.get('format')!r}")
        if data.get("kind") != "isotonic":
            raise ValueError(f"{path}: field 'kind' must be 'isotonic', got {data.get('kind')!r}")
        depths = data.get("depths")
        if not isinstance(depths, list) or not depths:
            raise ValueError(f"{path}: field 'depths' must be a non-empty list of {{'x': [...], 'y': [...]}}, "
                             f"got {depths!r:.80}")
        maps = []
        for j, d in enumerate(depths):
            where = f"{path}: depths[{j}]"
            if not isinstance(d, dict):
                raise ValueError(f"{where} must be an object with 'x' and 'y', got {d!r:.80}")
            x, y = d.get("x"), d.get("y")
            for name, v in (("x", x), ("y", y)):
                if (not isinstance(v, list) or not v
                        or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                                   and 0.0 <= t <= 1.0 for t in v)):
                    raise ValueError(f"{where}.{name} must be a non-empty list of numbers in [0, 1], got {v!r:.80}")
            if len(x) != len(y):
                raise ValueError(f"{where}: 'x' has {len(x)} knots and 'y' {len(y)}; they must match")
            if any(b <= a for a, b in zip(x, x[1:])):
                raise ValueError(f"{where}.x must be strictly increasing")
            if any(b < a for a, b in zip(y, y[1:])):
                raise ValueError(f"{where}.y must be non-decreasing (a calibration map is monotone)")
            maps.append((x, y))
        meta = {k: v for k, v in data.items() if k not in ("format", "kind", "depths")}
        return cls(maps, meta)
