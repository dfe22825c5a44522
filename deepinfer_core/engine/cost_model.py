"""Prefill cost model: seconds to compute q new tokens on top of c cached ones.

    cost(q, c) = a + b*q + d*q*c + e*q*q

The four terms are the fixed launch cost, the per-token GEMM work, attention against the cached
prefix and attention among the new tokens. ``deepinfer calibrate`` times real forward passes and
fits the coefficients by least squares; the result is stored per platform and model.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from deepinfer_core.config import check_number


@dataclass
class CostModel:
    a: float
    b: float
    d: float
    e: float
    platform: str = ""
    model_fingerprint: str = ""

    def cost(self, q: int, c: int) -> float:
        return self.a + self.b * q + self.d * q * c + self.e * q * q

    def max_tokens(self, c: int, budget_s: float, cap: int) -> int:
        """Largest q <= cap with cost(q, c) <= budget_s (0 if even one token does not fit)."""
        if cap <= 0 or self.cost(1, c) > budget_s:
            return 0
        if self.cost(cap, c) <= budget_s:
            return cap
        lo, hi = 1, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.cost(mid, c) <= budget_s else (lo, mid - 1)
        return lo

    @classmethod
    def fit(cls, samples: list[tuple[int, int, float]], **meta) -> CostModel:
        """Least-squares fit on (q, c, seconds) samples; coefficients clamped to be >= 0."""
        import torch

        X = torch.tensor([[1.0, q, q * c, q * q] for q, c, _ in samples], dtype=torch.float64)
        y = torch.tensor([[t] for _, _, t in samples], dtype=torch.float64)
        scale = X.abs().amax(0).clamp(min=1e-12)
        coef = torch.linalg.lstsq(X / scale, y).solution[:, 0] / scale
        a, b, d, e = (max(float(v), 0.0) for v in coef)
        return cls(a, b, d, e, **meta)

    def save(self, path: Path) -> None:
        save_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> CostModel:
        """The model saved at ``path``; FileNotFoundError, or ValueError naming a file that is not one."""
        try:
            model = cls(**load_json(path))
            for name in ("a", "b", "d", "e"):  # a NaN or negative coefficient would steer every prefill budget
                check_number(f"coefficient {name!r}", getattr(model, name), low=0.0)
            return model
        except (ValueError, TypeError) as exc:  # half-written, hand-edited, another format
            raise ValueError(f"cost model file {str(path)!r} is unreadable ({exc})") from exc


def cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE_DIR") or Path.home() / ".cache" / "deepinfer")


def load_json(path: Path, max_bytes: int = 1 << 20):
    """Read a JSON cache file: FileNotFoundError when there is none; ValueError naming it when it is not a
    regular file (a directory, a device a symlink leads to), is over ``max_bytes``, or is not JSON.
    Cache directories may be shared, so what is read is bounded and checked, never executed."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"cache file {str(path)!r} is not a regular file")
            raw = f.read(max_bytes + 1)
    except IsADirectoryError:
        raise ValueError(f"cache file {str(path)!r} is a directory") from None
    if len(raw) > max_bytes:
        raise ValueError(f"cache file {str(path)!r} is over {max_bytes} bytes")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"cache file {str(path)!r} is not JSON ({exc})") from None


def save_json(path: Path, doc) -> None:
    """Write a JSON cache file atomically (a temporary file, then ``os.replace``): a reader, or a
    later start after a crash, sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def default_path(platform: str, model_fingerprint: str) -> Path:
    return cache_dir() / "cost_models" / f"{platform}-{model_fingerprint}.json"
