"""The weight-streaming MoE's down kernel choice on the CPU (``kernels_cuda.moe_gemv``): ``CONFIG["down"]``,
``DEEPINFER_MOE_DOWN`` and ``small_steps``' overrides pick "loop" (``build_down``) or "slots"
(``moe_down_slots.build_down_slots``) with their tile arguments; nothing is compiled (the kernel caches are
replaced by recorders)."""

import logging

import pytest
import torch

from kernels_cuda import _tl, moe_gemv
from kernels_cuda.moe_down_slots import MIN_REGS


@pytest.fixture
def built(monkeypatch):
    """The kernels ``small_steps`` asks for, by name and arguments (CPU tensors, dry run, no compile)."""
    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")
    monkeypatch.delenv(moe_gemv.DOWN_ENV, raising=False)
    calls = []
    for name in ("_up", "_up_mma", "_down", "_down_slots"):
        monkeypatch.setattr(moe_gemv, name, lambda *a, _n=name: calls.append((_n, a)) or (lambda *b: None))
    return calls


def _steps(T=1, k=8, C=2048, I=1408, E=66, **kw):
    bf, e = torch.bfloat16, torch.empty
    x, w13, w2 = e(T, C, dtype=bf), e(E, 2 * I, C, dtype=bf), e(E, C, I, dtype=bf)
    ids, wt = torch.zeros(T, k, dtype=torch.long), e(T, k, dtype=bf)
    assert moe_gemv.applies(x, w13, w2, wt, ids)
    steps, _ = moe_gemv.small_steps(x, w13, w2, wt, ids, **kw)
    for _, step in steps:
        step()


def _down_call(calls):
    (name, args), = [c for c in calls if c[0].startswith("_down")]
    return name, args


def test_default_is_slots_with_the_size_rule_tiles(built):
    """One token: a column a CTA, 3 CTAs an SM, a token a CTA; from two tokens: 2 columns, 2 CTAs, the row bucket."""
    assert moe_gemv.CONFIG["down"] == "slots" and moe_gemv.down_choice() == "slots"
    _steps()
    name, args = _down_call(built)
    # (and, at one token on an sm_90a target, programmatic dependent launch: ``_tl.pdl``)
    assert name == "_down_slots" and args == (66, 2048, 1408, 8, 1, 1, "bfloat16", "int64", "bfloat16", 3, True)
    built.clear()
    _steps(T=3)  # the row bucket (4 tokens) a CTA
    assert _down_call(built) == ("_down_slots", (66, 2048, 1408, 8, 4, 2, "bfloat16", "int64", "bfloat16", 2))


def test_overrides(built):
    _steps(down="loop")
    name, args = _down_call(built)
    assert name == "_down" and args == (66, 2048, 1408, 8, 1, 32, 4, "bfloat16", "int64", "bfloat16", 4)
    built.clear()
    _steps(T=3, down_tokens=1, down_slot_blocks=1)  # an override replaces the size rule's tile
    assert _down_call(built)[1] == (66, 2048, 1408, 8, 1, 2, "bfloat16", "int64", "bfloat16", 1)
    built.clear()
    _steps(C=2056, down="slots", down_cols=16)  # 16 columns do not divide 2056: 8 do
    assert _down_call(built)[1][5] == 8


@pytest.mark.parametrize("value,want", [("slots", "slots"), (" Slots ", "slots"), ("loop", "loop"), ("", "slots")])
def test_env(built, monkeypatch, value, want):
    monkeypatch.setenv(moe_gemv.DOWN_ENV, value)
    assert moe_gemv.down_choice() == want
    _steps()
    assert _down_call(built)[0] == {"loop": "_down", "slots": "_down_slots"}[want]
    built.clear()
    _steps(down="loop")  # an override wins over the variable
    assert _down_call(built)[0] == "_down"


def test_bad_choice(built, monkeypatch):
    with pytest.raises(ValueError, match="expected one of loop, slots"):
        _steps(down="warp")
    monkeypatch.setenv(moe_gemv.DOWN_ENV, "slot")
    with pytest.raises(ValueError, match="DEEPINFER_MOE_DOWN"):
        _steps()


def test_env_is_a_known_setting(caplog):
    from deepinfer_core.config import warn_unknown_env

    with caplog.at_level(logging.WARNING):
        warn_unknown_env({moe_gemv.DOWN_ENV: "slots"})
    assert not caplog.records


def test_register_floor():
    """The CTAs-per-SM bound leaves each thread at least ``MIN_REGS`` registers (K = 16: 512 threads, one CTA)."""
    pytest.importorskip("tilelang")  # building the prim_func needs TileLang (nothing is compiled)
    from kernels_cuda.moe_down_slots import build_down_slots

    for K, blocks, want in ((8, 2, 2), (8, 4, 3), (9, 2, 2), (16, 2, 1)):
        f = build_down_slots(66, 2048, 1408, K, 1, 2, "bfloat16", "int64", "bfloat16", blocks)
        assert f'"tl.min_blocks_per_sm", {want})' in f.script(), (K, blocks)
        assert 65536 // (32 * K * want) >= MIN_REGS


@pytest.mark.parametrize("env,kw,want", [("", {}, "_up_mma"), ("fma", {}, "_up"), ("fma", {"up": "mma"}, "_up_mma"),
                                         ("", {"up": "fma"}, "_up")])
def test_fp8_up_choice(monkeypatch, env, kw, want):
    """The FP8 path (``moe_gemv_fp8``): the tensor-core up kernel by default, ``DEEPINFER_FP8_MOE_UP`` or ``up=``
    for the CUDA-core one; its down kernel is the loop kernel whatever ``DEEPINFER_MOE_DOWN`` says."""
    from kernels_cuda import moe_gemv_fp8 as m

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")
    monkeypatch.setenv(m.UP_ENV, env)
    monkeypatch.setenv(moe_gemv.DOWN_ENV, "slots")
    calls = []
    for name in ("_up", "_up_mma", "_down"):
        monkeypatch.setattr(m, name, lambda *a, _n=name: calls.append((_n, a)) or (lambda *b: None))
    E, C, I, T, k = 66, 2048, 1408, 1, 8
    f8, e = torch.float8_e4m3fn, torch.empty
    x, w13, w2 = e(T, C, dtype=torch.bfloat16), e(E, 2 * I, C, dtype=f8), e(E, C, I, dtype=f8)
    s13, s2 = e(E, 2 * I // 128, C // 128), e(E, C // 128, I // 128)
    ids, wt = torch.zeros(T, k, dtype=torch.long), e(T, k)
    assert m.applies(x, w13, s13, w2, s2, wt, ids)
    m.moe_fp8_small_steps(x, w13, s13, w2, s2, wt, ids, **kw)
    assert [c[0] for c in calls] == [want, "_down"]


@pytest.mark.parametrize("name,value", [("DEEPINFER_UV_FUSION", "maybe"), ("DEEPINFER_NORM_GEMV", "2"),
                                        ("DEEPINFER_MOE_DOWN", "warp"), ("DEEPINFER_FP8_MOE_UP", "tensor")])
def test_a_bad_kernel_switch_fails_when_the_ops_resolve(monkeypatch, name, value):
    """The CUDA backend's switches are checked once where the engine resolves its ops (``Kernels``), naming the
    variable, instead of failing a step; valid values pass."""
    from deepinfer_core.config import ConfigError
    from deepinfer_core.kernels import Kernels
    from kernels_cpu import ReferenceKernels
    from kernels_cuda import CudaKernels

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        Kernels(CudaKernels, ReferenceKernels)
    monkeypatch.setenv(name, {"DEEPINFER_MOE_DOWN": "loop", "DEEPINFER_FP8_MOE_UP": "fma"}.get(name, "off"))
    assert Kernels(CudaKernels, ReferenceKernels).implements("mla_decode_uv")
