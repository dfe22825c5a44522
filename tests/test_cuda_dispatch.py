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


@pytest.mark.parametrize("arch, single_row", [("sm_90a", True), ("sm_100a", True), ("sm_80", False),
                                               ("sm_89", False)])
def test_pdl_switch(monkeypatch, arch, single_row):
    """``DEEPINFER_PDL`` unset: programmatic dependent launch for one-row launches of the kernels that take it by
    default, on sm_90 and later only (``griddepcontrol`` does not exist before); 1: every launch that supports it
    (before sm_90 an error naming the variable and the arch); 0: none; any other word names the variable."""
    from deepinfer_core.config import ConfigError
    from kernels_cuda import _tl

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")
    monkeypatch.setenv(_tl.ARCH_ENV, arch)
    _tl.device_arch.cache_clear()
    monkeypatch.delenv(_tl.PDL_ENV, raising=False)
    try:
        assert _tl.pdl(1) is single_row and _tl.pdl_arg(1) == ((True,) if single_row else ())
        assert not _tl.pdl(2) and not _tl.pdl(1, by_default=False) and _tl.pdl_arg(8) == ()
        monkeypatch.setenv(_tl.PDL_ENV, "1")
        if single_row:
            assert _tl.pdl(1) and _tl.pdl(64) and _tl.pdl(1, by_default=False)
        else:  # asked for where the target has no griddepcontrol: said, not ignored
            with pytest.raises(ConfigError, match=f"DEEPINFER_PDL=1.*sm_90.*{arch}"):
                _tl.pdl(1)
        monkeypatch.setenv(_tl.PDL_ENV, "off")
        assert not _tl.pdl(1) and _tl.pdl_arg(1) == ()
        monkeypatch.setenv(_tl.PDL_ENV, "sometimes")
        with pytest.raises(ConfigError, match="DEEPINFER_PDL"):
            _tl.pdl(1)
    finally:
        _tl.device_arch.cache_clear()


def test_one_token_decode_launches_with_pdl_and_more_tokens_without(dry, monkeypatch):
    """Unset ``DEEPINFER_PDL`` on an sm_90a target: the V2-Lite MoE at one token builds its up and down kernels
    with programmatic dependent launch, at two tokens without (unmeasured there)."""
    from kernels_cuda import _tl, moe_gemv

    asked = []
    monkeypatch.delenv(_tl.PDL_ENV, raising=False)
    for attr in ("_up", "_down_slots"):
        monkeypatch.setattr(moe_gemv, attr, lambda *args, attr=attr: asked.append((attr, args)) or (lambda *a: None))
    E, C, I = 66, 2048, 1408
    w13, w2 = torch.empty(E, 2 * I, C, dtype=torch.bfloat16), torch.empty(E, C, I, dtype=torch.bfloat16)
    for T in (1, 2):
        moe_gemv.fused_moe_small(torch.empty(T, C, dtype=torch.bfloat16), w13, w2, torch.empty(T, 8),
                                 torch.zeros(T, 8, dtype=torch.long))
    flags = [(attr, args[-1] is True) for attr, args in asked]
    assert flags == [("_up", True), ("_down_slots", True), ("_down_slots", False)], flags


def test_batched_head_gemm_writes_strided_slices_in_place():
    """``gemv_rows._bmm_heads`` (``head_linear`` past the GEMV's rows, and the wide decode query): x may be the
    query's nope columns and out the latent columns of [T, H, L + R] rows; the result equals the reference's
    ``head_linear`` and nothing past the slice is written."""
    from kernels_cpu import ops as ref
    from kernels_cuda.gemv_rows import _bmm_heads

    g = torch.Generator().manual_seed(0)
    T, H, N, L, R = 37, 16, 128, 512, 64
    q = torch.randn(T, H, N + R, generator=g)
    w = torch.randn(H, L, N, generator=g)
    out = torch.full((T, H, L + R), 7.0)
    got = _bmm_heads(q[..., :N], w, out[..., :L])
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out[..., :L], ref.head_linear(q[..., :N].contiguous(), w), rtol=1e-5, atol=1e-4)
    assert (out[..., L:] == 7.0).all()


@pytest.mark.parametrize("T", [0, 1, 300])
def test_head_linear_into_a_slice_hostile(T):
    """``head_linear(..., out=)`` past the GEMV's rows (CPU tensors take the batched GEMM): an empty batch writes
    nothing and returns [0, H, N]; a NaN or inf in one token's row poisons that token's outputs only; the
    columns beside the slice keep their values."""
    from kernels_cpu import ops as ref
    from kernels_cuda.gemv_rows import head_linear

    g = torch.Generator().manual_seed(1)
    H, N, L, R = 4, 32, 64, 16
    q = torch.randn(T, H, N + R, generator=g)
    if T:
        q[T // 2, 1, 3] = float("nan")
        q[T - 1, 2, 0] = float("inf")
    w = torch.randn(H, L, N, generator=g)
    out = torch.full((T, H, L + R), 7.0)
    got = head_linear(q[..., :N], w, out=out[..., :L])
    assert got.shape == (T, H, L) and (out[..., L:] == 7.0).all()
    bad = torch.zeros(T, H, dtype=torch.bool)
    if T:
        bad[T // 2, 1] = bad[T - 1, 2] = True
    assert not torch.isfinite(got[bad]).any() and torch.isfinite(got[~bad]).all()
    want = ref.head_linear(q[..., :N].contiguous(), w)
    torch.testing.assert_close(got[~bad], want[~bad], rtol=1e-5, atol=1e-4)
    assert head_linear(q[..., :N].contiguous(), w).shape == (T, H, L)  # (and without out: a new tensor)


class _Ops:
    """A dispatch mode recording the aten ops run inside it (``names``)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Ops(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.names: list[str] = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.append(func.__name__)
                return func(*args, **(kwargs or {}))

        return Ops()


def _copies(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(("copy", "_to_copy"))]


@pytest.mark.parametrize("no_cast", [True, False], ids=["no_cast_launches", "copies"])
def test_wide_query_is_written_without_a_copy(dry, monkeypatch, no_cast):
    """Past the fused rows, by default (``DEEPINFER_NO_CAST_LAUNCHES`` unset or 1), the rotated q_pe goes straight
    into the query's rope columns (``rope(..., out=)``): no ``copy_`` launch follows it (one a layer at V2-Lite
    b256 on the H200: ``direct_copy`` in docs/h200/s15). With the switch at 0 the copy comes back."""
    from kernels_cuda import gemv_rows
    from kernels_cuda.gemv_rows import mla_q_absorb

    monkeypatch.setenv(gemv_rows.NO_CAST_ENV, "1" if no_cast else "0")

    T, H, L, N, R = 64, 16, 512, 128, 64
    q = torch.randn(T, H, N + R, dtype=torch.bfloat16)
    w_uk = torch.randn(H, L, N, dtype=torch.bfloat16)
    with _Ops() as ops:
        out = mla_q_absorb(q, w_uk, torch.arange(T), torch.randn(128, R))
    assert out.shape == (T, H, L + R) and dry == ["build_rope"], dry
    assert bool(_copies(ops.names)) != no_cast, ops.names


def test_rope_out_must_match_its_input():
    """``rope(..., out=)`` names what it expected; the reference path (float32) writes into ``out`` too, leaving the
    columns beside it."""
    from kernels_cpu import ops as ref
    from kernels_cuda.elementwise import rope

    T, H, D = 5, 2, 8
    x, pos, cs = torch.randn(T, H, D), torch.arange(T), torch.randn(16, D)
    wide = torch.full((T, H, 3 * D), 7.0)
    got = rope(x, pos, cs, out=wide[..., D:2 * D])
    assert got.data_ptr() == wide[..., D:].data_ptr()
    torch.testing.assert_close(wide[..., D:2 * D], ref.rope(x, pos, cs))
    assert (wide[..., :D] == 7.0).all() and (wide[..., 2 * D:] == 7.0).all()
    with pytest.raises(ValueError, match=r"rope: out must be \(5, 2, 8\) torch.float32"):
        rope(x, pos, cs, out=wide[..., :D + 2])
    with pytest.raises(ValueError, match="unit last stride"):
        rope(x, pos, cs, out=wide[..., ::3])
    with pytest.raises(ValueError, match="torch.bfloat16"):
        rope(x, pos, cs, out=wide[..., :D].to(torch.bfloat16))


@pytest.mark.parametrize("no_cast", [True, False], ids=["no_cast_launches", "copies"])
@pytest.mark.parametrize("T", [8, 9, 256])
def test_router_past_the_fused_rows_reads_the_norms_float32_copy(dry, monkeypatch, T, no_cast):
    """``add_rms_norm_moe_gate`` past 8 tokens, by default (``DEEPINFER_NO_CAST_LAUNCHES`` unset or 1): the norm
    launch also writes its rows as float32, and the router's float32 GEMM reads them, so no cast (``copy_``) runs
    between the two (one a MoE layer at V2-Lite b256 on the H200); with the switch at 0 the cast comes back; up to
    8 tokens the one fused launch."""
    from kernels_cuda import gemv_rows
    from kernels_cuda.moe_gate import add_rms_norm_moe_gate

    monkeypatch.setenv(gemv_rows.NO_CAST_ENV, "1" if no_cast else "0")
    E, C = 64, 2048
    x, res = torch.randn(T, C).to(torch.bfloat16), torch.randn(T, C).to(torch.bfloat16)
    with _Ops() as ops:
        normed, new_res, weights, ids = add_rms_norm_moe_gate(
            x, res, torch.ones(C, dtype=torch.bfloat16), 1e-6, torch.randn(E, C), None, 6, "softmax", 1, 1, "max",
            False, 1.0, 2, torch.bfloat16)
    assert normed.shape == (T, C) and weights.shape == ids.shape == (T, 8)
    if T <= 8:
        assert dry == ["build_gate_route"], dry
    else:
        assert dry == ["build_rms_norm", "build_route"], dry
        assert bool(_copies(ops.names)) != no_cast, ops.names
