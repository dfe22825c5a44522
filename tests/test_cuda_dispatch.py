"""The CUDA backend's composed decode ops fall back to the backend's own ops, never to the reference's
element-wise chains (CPU, dry run: nothing compiles or runs; ``_tl.dry_launch_hook`` names each launch).

``mla_q_absorb`` is one launch for at most 4 rows (8 on a small W_UK); above, it is the backend's
``head_linear`` (cuBLAS) and ``rope`` (one TileLang launch), not ``kernels_cpu``'s rope (about ten torch
launches, once per layer per decode step: seen on the H200 as ~189 reference-rope launches per V2-Lite step).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tilelang")


@pytest.fixture
def dry(monkeypatch):
    """Dry-run kernels that are traced but not compiled; yields the builder names launched."""
    from kernels_cuda import _tl

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")
    monkeypatch.setattr(_tl, "compile_kernel", lambda *a, **k: None)
    launched: list[str] = []
    monkeypatch.setattr(_tl, "dry_launch_hook", launched.append)

    def no_reference(*a, **k):
        raise AssertionError("kernels_cpu's rope ran inside a CUDA op")

    import kernels_cpu.fused
    import kernels_cpu.ops

    monkeypatch.setattr(kernels_cpu.ops, "rope", no_reference)
    monkeypatch.setattr(kernels_cpu.fused, "rope", no_reference)
    yield launched


@pytest.mark.parametrize("T", [1, 4, 5, 16, 64])
def test_mla_q_absorb_rows_rule(dry, T):
    """V2-Lite's decode query (16 heads, latent 512, nope 128, rope 64): fused up to 4 rows, else the
    backend's head_linear + rope."""
    from kernels_cuda.gemv_rows import mla_q_absorb

    H, L, N, R = 16, 512, 128, 64
    q = torch.randn(T, H, N + R, dtype=torch.bfloat16)
    w_uk = torch.randn(H, L, N, dtype=torch.bfloat16)
    cos_sin = torch.randn(128, R, dtype=torch.float32)
    out = mla_q_absorb(q, w_uk, torch.arange(T), cos_sin)
    assert out.shape == (T, H, L + R)
    if T <= 4:
        assert dry == ["build_gemv_rows"], dry
    else:
        assert dry == ["build_rope"], dry
