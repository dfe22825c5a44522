"""The Ascend backend without an NPU: every torch_npu use checked against the pinned wheel's
schemas, and kernels_ascend run through the emulated torch_npu against the reference ops.

None of this is evidence of NPU behaviour beyond what the vendor docs state (docs/ascend.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import npu_emulation
import pytest
import torch
from npu_emulation import bind

from deepinfer_core.testing import check_op, kernel_conformance_cases
from hardware.ascend import AscendPlatform
from kernels_ascend import AscendKernels
from kernels_ascend import attention as npu_attention
from kernels_ascend.schemas import SCHEMA_FILE, TORCH_NPU_VERSION, load
from kernels_ascend.schemas.check import check_paths, check_source
from kernels_cpu import ops as ref

ROOT = Path(__file__).resolve().parents[1]
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def emu():
    with npu_emulation.install() as e:
        yield e


# ---- the static schema check ----------------------------------------------------------------
def test_every_torch_npu_use_fits_the_pinned_schemas():
    report = check_paths()
    assert report.errors == []
    assert report.ops == {
        "npu_rms_norm", "npu_swiglu", "npu_clipped_swiglu", "npu_rotary_mul", "npu_scatter_nd_update_",
        "npu_fused_infer_attention_score_v2", "npu_moe_gating_top_k", "npu_moe_init_routing_v2",
        "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_top_k_top_p",
        "torch_npu.npu.is_current_stream_capturing", "torch_npu.npu.device_count", "torch_npu.npu.set_device",
        "torch_npu.npu.mem_get_info", "torch_npu.npu.synchronize", "torch_npu.npu.Stream", "torch_npu.npu.stream",
        "torch_npu.npu.Event", "torch_npu.npu.NPUGraph", "torch_npu.npu.graph",
    }
    # every fused op used is one the wheel documents (the emulation cites those docs)
    documented = set(json.loads(SCHEMA_FILE.read_text())["documented_ops"])
    assert {op for op in report.ops if not op.startswith("torch_npu.")} <= documented


def test_schema_check_rejects_the_wrong_calls_of_the_fixture():
    path = "tests/fixtures/torch_npu_bad_calls.py"
    report = check_source((ROOT / path).read_text(), path)
    assert report.errors == [
        f"{path}:10: torch_npu.npu_rms_norm: unknown keyword 'epsilonn' (parameters: self, gamma, epsilon)",
        f"{path}:11: torch_npu.npu_rms_normm: torch_npu 2.14.0 has no op 'npu_rms_normm'",
        f"{path}:12: torch_npu.npu_rms_norm: missing required argument 'gamma'",
        f"{path}:13: torch_npu.npu_swiglu: takes at most 2 positional argument(s) (self, dim), got 3",
        f"{path}:14: torch_npu.npu_rotary_mul: argument 'rotary_mode'='interleaved' is not an allowed value "
        "['half', 'interleave'] (docs: \"支持'half'、'interleave'两种模式\")",
        f"{path}:15: torch_npu.npu_moe_gating_top_k: argument 'norm_type'=2 is not an allowed value [0, 1] "
        "(docs: '`1`表示使用Sigmoid函数，`0`表示Softmax函数')",
        f"{path}:16: torch_npu.npu.NotAStream: not in torch_npu.npu.__all__ of torch_npu 2.14.0",
        f"{path}:17: torch_npu.npu_rms_norm: argument 'epsilon' given both by position and by keyword",
        f"{path}:18: torch_npu.npu.graph: unknown keyword 'pools' (parameters: npu_graph, pool, stream, "
        "auto_dispatch_capture, capture_error_mode)",
    ]
    assert [c.op for c in report.calls if c.line >= 21] == ["npu_rms_norm", "torch_npu.npu.Stream"]


def test_schema_check_cli_fails_on_the_fixture():
    proc = subprocess.run([sys.executable, "-m", "kernels_ascend.schemas.check",
                           "tests/fixtures/torch_npu_bad_calls.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "unknown keyword 'epsilonn'" in proc.stderr
    assert proc.stdout.strip() == "10 torch_npu use(s) of 7 name(s) checked, 9 error(s)"


def test_schema_check_sees_through_aliases_and_star_args():
    src = ("import torch\nfrom torch_npu import npu\nimport torch_npu.npu as tn\n"
           "def f(x, a, kw):\n    torch.ops.npu.npu_rms_norm(x)\n    npu.Bogus()\n    tn.Event()\n"
           "    import torch_npu\n    torch_npu.npu_swiglu(*a)\n    torch_npu.npu_swiglu(x, **kw)\n")
    r = check_source(src + "def g():\n    from torch_npu import npu_bogus\n    tn.Event(True, False, False, 1)\n"
                     "    tn.graph()\n", "m.py")
    assert r.errors == [
        "m.py:12: torch_npu.npu_bogus: torch_npu 2.14.0 has no op 'npu_bogus'",  # imports are checked first
        "m.py:5: torch_npu.npu_rms_norm: missing required argument 'gamma'",
        "m.py:6: torch_npu.npu.Bogus: not in torch_npu.npu.__all__ of torch_npu 2.14.0",
        "m.py:9: torch_npu.npu_swiglu: *args/**kwargs cannot be checked statically; spell the arguments out",
        "m.py:10: torch_npu.npu_swiglu: *args/**kwargs cannot be checked statically; spell the arguments out",
        "m.py:13: torch_npu.npu.Event: takes at most 3 positional argument(s), got 4",
        "m.py:14: torch_npu.npu.graph: missing required argument 'npu_graph'",
    ]


def test_schema_file_names_the_pinned_wheel():
    doc = json.loads(SCHEMA_FILE.read_text())
    assert doc["version"] == TORCH_NPU_VERSION == "2.14.0"
    assert doc["wheel"] == "torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert doc["sha256"] == "7736f7d82cf9f16c7dfc4537f7e7c638153da760273a193455e70857f912189e"
    s = load()
    fia = s.ops["npu_fused_infer_attention_score_v2"][0]
    assert fia.param("block_table").kw_only and fia.param("query_rope").type == "Tensor?"
    assert [p.name for p in s.ops["npu_moe_gating_top_k"][0].positional] == ["x", "k"]


# ---- the emulation itself ---------------------------------------------------------------------
def test_emulation_binds_calls_like_the_schema(emu):
    import torch_npu

    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(TypeError, match=r"^torch_npu.npu_rms_norm\(\) got an unexpected keyword argument 'eps'$"):
        torch_npu.npu_rms_norm(x, w, eps=1e-6)
    with pytest.raises(TypeError, match=r"^torch_npu.npu_moe_gating_top_k\(\) missing required argument 'k'$"):
        torch_npu.npu_moe_gating_top_k(x)
    with pytest.raises(TypeError, match=r"takes at most 2 positional argument\(s\), got 3"):
        torch_npu.npu_moe_gating_top_k(x, 2, None)  # bias is keyword-only
    with pytest.raises(TypeError, match=r"argument 'actual_seq_kvlen': Tensor, expected a list of Python ints"):
        torch_npu.npu_fused_infer_attention_score_v2(x, x, x, actual_seq_kvlen=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"argument 'rotary_mode'='half2' is not one of \['half', 'interleave'\]"):
        torch_npu.npu_rotary_mul(x, x, x, rotary_mode="half2")
    with pytest.raises(ValueError, match=r"gamma dtype torch.bfloat16 must equal self's torch.float32"):
        torch_npu.npu_rms_norm(x, w.bfloat16())
    with pytest.raises(NotImplementedError, match=r"torch_npu.npu_prompt_flash_attention is not emulated"):
        torch_npu.npu_prompt_flash_attention(x, x, x)
    with pytest.raises(AttributeError, match=r"has no attribute 'npu_flash_magic'"):
        torch_npu.npu_flash_magic  # noqa: B018
    with pytest.raises(NotImplementedError, match=r"torch_npu.npu.make_graphed_callables is not emulated"):
        torch_npu.npu.make_graphed_callables()
    assert emu.calls == {}  # rejected calls never ran


def test_bind_fills_defaults():
    schema = load().ops["npu_rms_norm"][0]
    x = torch.zeros(1)
    assert bind(schema, (x, x), {}) == {"self": x, "gamma": x, "epsilon": 1e-06}


def test_emulated_ops_match_their_schemas():
    emu = npu_emulation.EmulatedTorchNpu()  # raises if an implementation's parameters differ from its schema
    assert set(emu._impls) == {op for op in check_paths().ops if not op.startswith("torch_npu.")}


# ---- conformance through the emulation ----------------------------------------------------------
#: The torch_npu ops each override must have called at the conformance kit's (small) shapes.
FUSED_AT_KIT_SHAPES = {
    "rms_norm": {"npu_rms_norm"}, "add_rms_norm": {"npu_rms_norm"}, "silu_and_mul": {"npu_swiglu"},
    "rope": {"npu_rotary_mul"}, "paged_kv_write": {"npu_scatter_nd_update_"}, "paged_kv_gather": set(),
    "moe_route": {"npu_moe_gating_top_k"},
    "fused_moe": {"npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_moe_finalize_routing"},
    "sample": {"npu_top_k_top_p"},
    # the kit's head dims are not FIA's (latent 512 + rope 64; prefill 192/128): the torch path runs;
    # the FIA paths are checked at those sizes below
    "mla_decode": set(), "mla_prefill": set(),
    # DeepSeek-V4
    "rope_inverse": {"npu_rotary_mul"}, "v4_compress": {"npu_rms_norm", "npu_rotary_mul"},
    "silu_and_mul_clamped": {"npu_clipped_swiglu", "npu_swiglu"},  # with a limit, and without
    "fused_moe_clamped": {"npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_clipped_swiglu",
                          "npu_moe_finalize_routing"},
    "moe_route_v4": {"npu_moe_gating_top_k"},  # the kit's sigmoid case (sqrt-softplus and hash: plain torch)
}


def test_every_registry_op_is_overridden_or_a_listed_plain_torch_fallback():
    from deepinfer_core.kernels import OP_NAMES

    plain = {"linear", "head_linear", "apply_penalties", "logsumexp", "greedy_sample"}
    # DeepSeek-V4 ops no documented fused op computes (docs/ascend.md says why for each)
    plain |= {"v4_indexer_topk", "v4_sparse_attention", "mhc_pre", "mhc_post", "mhc_head"}
    plain |= {"ue8m0_scale", "mxfp8_quant", "mxfp8_dequant"}  # window KV snapshots (docs/ascend.md)
    plain |= {"draft_lengths"}  # speculative draft lengths, a few hundred values per step
    plain |= {"fp8_linear", "fused_moe_fp8"}  # block-scaled FP8 weights (docs/ascend.md)
    # decode-fusion compositions: the model writes planes unfused, and calls mla_q_absorb / moe_gate only where
    # the backend implements them (Kernels.implements), so this platform keeps its rope and moe_route
    plain |= {"linear_f32", "add_rms_norm_linear", "mla_kv_write", "mla_q_absorb", "mla_q_absorb_kv_write",
             "mla_decode_uv", "moe_gate", "add_rms_norm_moe_gate"}
    plain |= {"latent_kv_dequant"}  # FP8 latent KV rows: the platform does not list kv_cache_dtype "fp8"
    assert set(AscendKernels.overrides()) | plain == set(OP_NAMES)
    assert set(AscendKernels.overrides()) == set(FUSED_AT_KIT_SHAPES)


#: the platform's cache layout: latent caches as (latent, rope) planes
PLANES = AscendPlatform().kv_cache_planes
KV_DTYPES = AscendPlatform().kv_cache_dtypes()  # no FP8 latent rows: the kit skips those cases


@pytest.mark.parametrize("op,dtype", kernel_conformance_cases(AscendKernels, ALL_DTYPES))
def test_ascend_kernels_conform_under_emulation(emu, op, dtype):
    check_op(AscendKernels, op, dtype, "cpu", planes=PLANES, kv_cache_dtypes=KV_DTYPES)
    assert set(emu.calls) == FUSED_AT_KIT_SHAPES[op]


def test_ascend_cache_ops_also_take_a_single_plane(emu):
    """Groups without declared parts (V4's) stay one tensor per layer: the cache ops take that too."""
    for op in ("paged_kv_write", "paged_kv_gather", "mla_decode"):
        check_op(AscendKernels, op, torch.bfloat16, "cpu", seed=4, kv_cache_dtypes=KV_DTYPES)


@pytest.mark.parametrize("block_size", [1, 64])
def test_ascend_cache_ops_conform_at_other_block_sizes(emu, block_size):
    for op in ("paged_kv_write", "paged_kv_gather", "mla_decode"):
        check_op(AscendKernels, op, torch.bfloat16, "cpu", block_size=block_size, seed=3, planes=PLANES,
                 kv_cache_dtypes=KV_DTYPES)


def _close(out: torch.Tensor, truth: torch.Tensor, rtol: float = 2e-2) -> None:
    out, truth = out.double(), truth.double()
    bound = rtol * (truth.abs() + truth.pow(2).mean().sqrt())
    assert out.shape == truth.shape and bool(((out - truth).abs() <= bound).all()), (out - truth).abs().max()


def _paged(g, seq_lens, bs, D, dtype):
    per_seq = [math.ceil(n / bs) for n in seq_lens]
    nb = sum(per_seq) + 2
    order = torch.randperm(nb, generator=g)
    tables = torch.randint(0, nb, (len(seq_lens), max(per_seq) + 1), generator=g)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used : used + n]
        used += n
    return (torch.randn(nb, bs, D, generator=g) * 0.5).to(dtype), tables.to(torch.int32)


def _planes(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [blocks, bs, 576] cache in the platform's layout: latent and rope planes."""
    return cache[..., :512].contiguous(), cache[..., 512:].contiguous()


@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 3, 16]])
def test_mla_decode_through_fia_at_deepseek_sizes(emu, bs, q_lens):
    """Latent 512 + rope 64 (V2/V3) in two planes, 4 heads: FIA v2's MLA mode reads the planes in place
    through the engine's block table (the emulated FIA rejects a copy-free slice of a joined cache)."""
    g = torch.Generator().manual_seed(1)
    seq_lens = [5, 17, 40]
    cache, tables = _paged(g, seq_lens, bs, 576, torch.bfloat16)
    q = torch.randn(sum(q_lens), 4, 576, generator=g).bfloat16()
    cu = torch.tensor([0, *q_lens]).cumsum(0)
    args = (q, _planes(cache), tables, cu, torch.tensor(seq_lens), 576**-0.5, 512)
    out = npu_attention.mla_decode(*args)
    assert emu.calls == {"npu_fused_infer_attention_score_v2": 1} and out.dtype == torch.bfloat16
    truth = ref.mla_decode(q.float(), cache.float(), *args[2:])
    _close(out, truth)
    # a capture whose FIA lengths nobody updates (not through AscendPlatform.graph_capture) takes the
    # capturable torch path, with the same result
    emu.npu.capturing = True
    captured = npu_attention.mla_decode(*args)
    assert emu.calls == {"npu_fused_infer_attention_score_v2": 1}
    _close(captured, truth)
    # one joined tensor (a group the platform does not split) runs the torch path as well
    emu.npu.capturing = False
    _close(npu_attention.mla_decode(q, cache, *args[2:]), truth)
    assert emu.calls == {"npu_fused_infer_attention_score_v2": 1}


@pytest.mark.parametrize("dqk,dv", [(192, 128), (128, 128)])
def test_mla_prefill_through_fia_tnd(emu, dqk, dv):
    g = torch.Generator().manual_seed(2)
    q_lens, k_lens = [5, 1, 9], [5, 17, 9]  # the second sequence has a cached prefix
    H = 2
    q = torch.randn(sum(q_lens), H, dqk, generator=g).bfloat16()
    k = torch.randn(sum(k_lens), H, dqk, generator=g).bfloat16()
    v = torch.randn(sum(k_lens), H, dv, generator=g).bfloat16()
    cq, ck = torch.tensor([0, *q_lens]).cumsum(0), torch.tensor([0, *k_lens]).cumsum(0)
    out = npu_attention.mla_prefill(q, k, v, cq, ck, dqk**-0.5)
    assert emu.calls == {"npu_fused_infer_attention_score_v2": 1}
    _close(out, ref.mla_prefill(q.float(), k.float(), v.float(), cq, ck, dqk**-0.5))


def test_fia_rejects_the_fused_cache_slice(emu):
    """Why the platform stores the latent cache as two planes: FIA does not take a non-contiguous slice."""
    import torch_npu

    cache = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 4, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="key is not contiguous"):
        torch_npu.npu_fused_infer_attention_score_v2(
            q, cache[..., :512], cache[..., :512], query_rope=torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16),
            key_rope=cache[..., 512:], actual_seq_kvlen=[3], block_table=torch.zeros(1, 1, dtype=torch.int32),
            num_query_heads=4, num_key_value_heads=1, input_layout="BSND", block_size=16)


def test_fused_moe_drops_remote_experts_and_reads_no_undefined_rows(emu):
    """All experts remote: every grouped_matmul row is undefined (NaN in the emulation); the result
    must still be exactly zero."""
    from kernels_ascend.moe import fused_moe

    x = torch.randn(3, 8)
    out = fused_moe(x, torch.randn(2, 6, 8), torch.randn(2, 8, 3), torch.rand(3, 2),
                    torch.tensor([[-1, 2], [5, -3], [2, 2]]))
    assert torch.equal(out, torch.zeros(3, 8))


# ---- the platform -----------------------------------------------------------------------------
def test_ascend_platform_reports_what_it_supports():
    p = AscendPlatform()
    assert p.describe() == {
        "device_type": "npu", "dist_backend": "hccl", "kernel_backend": "ascend", "graph_capture": True,
        "graph_capture_dtypes": ["bfloat16", "float16"], "pinned_memory": True, "async_overlap": True,
        "fp8_gemm": False, "kv_cache_dtypes": ["auto", "bf16"],
        "mla_cache_planes": True, "fia_in_graphs": True, "verified_on_hardware": False,
    }
    w = torch.randn(4, 6, 8)
    laid = p.linear_weight_layout(w)
    assert torch.equal(laid, w) and laid.transpose(1, 2).is_contiguous()
    w2 = torch.randn(6, 8)
    assert p.linear_weight_layout(w2) is w2
    # the MLA latent cache as FIA's two planes; groups without declared parts (V4's) stay one tensor
    from deepinfer_core.kv_cache_spec import KVCacheSpec
    from hardware.cpu import CpuPlatform

    latent = KVCacheSpec("latent", (0,), 576, parts=(512, 64))
    assert p.kv_cache_planes(latent) == (512, 64) and CpuPlatform().kv_cache_planes(latent) == (576,)
    assert p.kv_cache_planes(KVCacheSpec("swa", (0,), 512, window=128)) == (512,)


def test_torch_npu_is_never_imported_here():
    """CI never installs torch_npu (it breaks ``import torch`` without CANN); importing and listing the
    Ascend plugin must not import it either."""
    assert importlib.util.find_spec("torch_npu") is None
    code = ("import sys, torch, hardware.ascend, kernels_ascend, kernels_ascend.dense, kernels_ascend.attention, "
            "kernels_ascend.moe, kernels_ascend.sampling, kernels_ascend.schemas.check\n"
            "from deepinfer_core.kernels import Kernels\nfrom kernels_ascend import AscendKernels\n"
            "from kernels_cpu import ReferenceKernels\nKernels(AscendKernels, ReferenceKernels)\n"
            "print('torch_npu' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_ascend_accelerator_says_torch_npu_is_missing():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "ASCEND_"))}
    env["DEEPINFER_ACCELERATOR"] = "ascend"
    code = "from deepinfer_core.selection import select_platform\nselect_platform()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 1
    assert ("accelerator 'ascend' is not available: torch_npu is not installed (pip install torch-npu, "
            "with Ascend CANN)") in proc.stderr


# ---- the engine on the Ascend kernels (emulated, on the CPU) -------------------------------------
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n", "for i in range(",
           "x = [", "# read a file\nwith open("]


@pytest.fixture
def ascend_emulated(tmp_path, monkeypatch):
    """``DEEPINFER_ACCELERATOR=ascend_emulated``: AscendPlatform on the CPU (npu_emulation.platform),
    registered as a distribution's entry point like any accelerator; it runs inside
    ``npu_emulation.install()`` (entered by the test, after anything that imports transformers, which
    probes for torch_npu)."""
    from test_plugins import forget_entry_points, make_distribution

    forget_entry_points(monkeypatch, tmp_path)  # whatever earlier tests loaded, this distribution is seen
    entry = "[deepinfer.hardware]\nascend_emulated = npu_emulation.platform:EmulatedAscendPlatform\n"
    make_distribution(tmp_path, entry, {}, dist="dit-ascend-emulated")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend_emulated")


def _generate(padded: bool, accelerator: str | None):
    from deepinfer_core import LLM, SamplingParams

    llm = LLM(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory=4 << 20,
              graph_batch_sizes=[1, 2, 4, 8], accelerator=accelerator)
    if padded:  # the decode-graph runner's static, padded buffers (run eagerly: no capture on the CPU)
        e = llm.engine
        e.runner.setup_graphs(e.platform, e.cfg, e.max_model_len, capture=False)
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True, logprobs=1) for i in range(6)]
    params[1] = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seq_seed=7, max_tokens=6,
                               ignore_eos=True, logprobs=1, repetition_penalty=1.1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.blocks.check_no_leaks()
    return llm, outs


def test_engine_on_ascend_kernels_generates_like_the_reference(ascend_emulated):
    """The embedded DeepSeek-style model on the (emulated) Ascend platform against the cpu platform:
    same tokens, logprobs within 1e-4, eager and through the padded decode-graph path; its latent
    cache is stored as the platform's two planes."""
    _, want = _generate(padded=False, accelerator="cpu")
    for padded in (False, True):
        with npu_emulation.install() as emu:
            llm, got = _generate(padded, accelerator=None)
        e = llm.engine
        assert e.platform.name == "ascend_emulated" and e.kernels.backend_name == "ascend"
        mc = e.model_config
        assert [t.shape[-1] for t in e.kv_caches["latent"][0]] == [mc.kv_lora_rank, mc.qk_rope_head_dim]
        assert set(emu.calls) == {
            "npu_rms_norm", "npu_rotary_mul", "npu_scatter_nd_update_", "npu_swiglu", "npu_moe_gating_top_k",
            "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_top_k_top_p"}
        for x, y in zip(got, want):
            assert x.error is None and x.outputs[0].token_ids == y.outputs[0].token_ids
            lx = [x.outputs[0].logprobs[j][t].logprob for j, t in enumerate(x.outputs[0].token_ids)]
            ly = [y.outputs[0].logprobs[j][t].logprob for j, t in enumerate(y.outputs[0].token_ids)]
            assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4
        if padded:
            assert sum(llm.engine.runner.graphs.runs.values()) > 0


def _mla_checkpoint(tmp_path):
    """A tiny V3 with the real MLA head sizes (latent 512, rope 64, nope 128, v 128)."""
    from tiny_models import write_checkpoint

    path, _ = write_checkpoint(tmp_path / "mla", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                               v_head_dim=128, q_lora_rank=None, num_hidden_layers=2)
    return path


def _mla_llm(path, accelerator: str | None):
    from deepinfer_core import LLM

    return LLM(model=str(path), dtype="bfloat16", accelerator=accelerator, block_size=16, kv_cache_memory=8 << 20,
               max_num_batched_tokens=64, enforce_eager=True)


def test_engine_at_deepseek_attention_sizes_takes_the_fia_paths(tmp_path, ascend_emulated):
    """Greedy generation at the real MLA sizes in bfloat16 on the emulated Ascend platform equals the
    cpu platform's: the latent cache lives in two planes, FIA reads them in place for decode (and takes
    the prefill in TND), and a prefix hit's chunk gathers the planes back."""
    from deepinfer_core import SamplingParams

    path = _mla_checkpoint(tmp_path)
    prompts = [[5, 9, 40, 41, 17, 88, 23], [7, 7, 60, 3 + 8, 99, 101, 4, 5, 6, 12, 30], [50]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0, logprobs=0)

    def run(accelerator):
        llm = _mla_llm(path, accelerator)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params] * len(prompts), use_tqdm=False)
        llm.engine.blocks.check_no_leaks()
        return llm, outs

    _, want = run("cpu")
    with npu_emulation.install() as emu:
        llm, got = run(None)
    assert [tuple(t.shape) for t in llm.engine.kv_caches["latent"][1]] == [
        (llm.engine.blocks.num_blocks, 16, 512), (llm.engine.blocks.num_blocks, 16, 64)]
    # 2 layers x (1 prefill step (TND) + 2 decode steps (paged MLA over the planes))
    assert emu.calls["npu_fused_infer_attention_score_v2"] == 2 * 3
    for x, y in zip(got, want):
        assert x.error is None and x.outputs[0].token_ids == y.outputs[0].token_ids
        px = [d[t].logprob for d, t in zip(x.prompt_logprobs[1:], x.prompt_token_ids[1:])]
        py = [d[t].logprob for d, t in zip(y.prompt_logprobs[1:], y.prompt_token_ids[1:])]
        assert len(px) == len(py) == len(x.prompt_token_ids) - 1
        assert max((abs(a - b) for a, b in zip(px, py)), default=0.0) < 0.05  # bf16 (0.016 seen)


# ---- FIA inside captured decode graphs (emulated NPUGraph) --------------------------------------
def test_captured_decode_graph_gives_fia_the_eager_arguments(tmp_path, ascend_emulated):
    """The decode-graph runner on the Ascend platform captures the FIA path (torch_npu.npu.graph with
    auto_dispatch_capture) and, before every replay, AscendPlatform.graph_replay updates each recorded
    FIA launch's host lengths (NPUGraph.update): after the update every launch has exactly the
    arguments the eager step passes FIA (host lengths equal, the same static cache planes and block
    table). The emulated NPUGraph re-runs only the recorded FIA launches, so the logits are taken from
    an eager run of the same static buffers; greedy tokens then equal the cpu platform's."""
    from deepinfer_core import SamplingParams
    from deepinfer_core.engine.graph_runner import DecodeGraphs

    path = _mla_checkpoint(tmp_path)
    prompts = [[5, 9, 40, 41, 17, 88, 23], [7, 7, 60, 11, 99], [50]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = _mla_llm(path, "cpu").generate([{"prompt_token_ids": p} for p in prompts], [params] * 3, use_tqdm=False)
    with npu_emulation.install() as emu:
        llm = _mla_llm(path, None)
        e = llm.engine
        graphs = DecodeGraphs(e.model, e.kv_caches, [4], 8, e.device, e.platform, capture=True,
                              layout=e.cache_layout, pool_of=e.blocks.pool_of)
        graphs.capture()
        graph = graphs.graphs[(4, 1)]  # 4 sequences of one query row
        layers = e.model_config.num_hidden_layers
        assert [r[1]["actual_seq_kvlen"] for r in graph.records] == [[8 * 16] * 4] * layers  # capture: longest
        e.runner.graphs = graphs
        platform_replay, checked = e.platform.graph_replay, []

        def replay_and_compare(g, seq_lens):
            platform_replay(g, seq_lens)  # AscendPlatform's: NPUGraph.update, then replay
            emu.launches.clear()
            eager = graphs._forward(4)  # the same step, eagerly, from the same static buffers
            assert len(emu.launches) == len(g.records) == layers
            for (_, rec, _), (_, run) in zip(g.records, emu.launches):
                assert rec["actual_seq_kvlen"] == run["actual_seq_kvlen"] == seq_lens
                assert rec["actual_seq_qlen"] == run["actual_seq_qlen"] is None  # one query each: sparse_mode 0
                for name in ("key", "value", "key_rope", "block_table"):  # static buffers: the same storage
                    assert rec[name].data_ptr() == run[name].data_ptr() and rec[name].shape == run[name].shape
                for name, value in run.items():
                    if not isinstance(value, torch.Tensor):
                        assert rec[name] == value, name
            for out, value in zip(graphs.outputs[(4, 1)], eager):  # (hidden, logits): what a real replay
                out.copy_(value)  # recomputes (not emulated)
            checked.append(seq_lens)

        e.platform.graph_replay = replay_and_compare
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], [params] * 3, use_tqdm=False)
        e.blocks.check_no_leaks()
    assert len(checked) == 3 and checked[0] == [8, 6, 2, 1]  # 3 decode steps; padding row: seq_len 1
    assert graph.replays == 3
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_v4_engine_on_ascend_generates_like_the_cpu_platform(ascend_emulated):
    """The embedded tiny DeepSeek-V4 on the (emulated) Ascend platform: its fused V4 ops (and the
    reference ones the table lists) give the cpu platform's greedy tokens and logprobs."""
    from deepinfer_core import LLM, SamplingParams

    prompts = ["def fibonacci(n):\n", "import os\n", "x = ["]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(accelerator):
        llm = LLM(model="tiny-v4", dtype="float32", accelerator=accelerator, kv_cache_memory=16 << 20,
                  enforce_eager=True)
        outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        llm.engine.blocks.check_no_leaks()
        return outs

    want = run("cpu")
    with npu_emulation.install() as emu:
        got = run(None)
    # tiny-v4 routes by sqrt-softplus and hash (plain torch); its experts clamp (npu_clipped_swiglu)
    assert set(emu.calls) == {"npu_rms_norm", "npu_rotary_mul", "npu_scatter_nd_update_", "npu_moe_init_routing_v2",
                              "npu_grouped_matmul", "npu_clipped_swiglu", "npu_moe_finalize_routing"}
    for x, y in zip(got, want):
        assert x.error is None and x.outputs[0].token_ids == y.outputs[0].token_ids
        lx = [x.outputs[0].logprobs[j][t].logprob for j, t in enumerate(x.outputs[0].token_ids)]
        ly = [y.outputs[0].logprobs[j][t].logprob for j, t in enumerate(y.outputs[0].token_ids)]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4


def test_kv_handoff_from_planes_to_one_tensor(ascend_emulated):
    """A prefill engine on the (emulated) Ascend platform, whose latent cache is two planes, hands
    its KV off to a cpu decode engine (one tensor per layer): the payload carries whole entries, so
    the decode engine continues with the cpu engine's greedy tokens."""
    import dataclasses
    import uuid

    from deepinfer_core import LLM, SamplingParams

    section = {"backend": "shm", "namespace": f"pd-ascend-{uuid.uuid4().hex[:8]}"}
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, kv_transfer=section)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = LLM(dtype="float32", accelerator="cpu").generate(PROMPTS, sp, use_tqdm=False)
    d = LLM(kv_role="decode", accelerator="cpu", **kw)
    with npu_emulation.install():
        p = LLM(kv_role="prefill", **kw)
        assert isinstance(p.engine.kv_caches["latent"][0], tuple)  # the platform's planes
        first = p.generate(PROMPTS, sp, use_tqdm=False)
    outs = d.generate(PROMPTS, [dataclasses.replace(sp, kv_transfer_params=o.kv_transfer_params) for o in first],
                      use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert d.metrics()["handoff_received"] == len(PROMPTS)
