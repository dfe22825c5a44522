"""Checkpoint loading: FP8 block-scaled weights, sharded checkpoints, error messages, the model
directory from the environment, and bfloat16/float16 weights."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB, write_checkpoint

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.loader import CheckpointError
from hardware.cpu import CpuPlatform

FP8 = torch.float8_e4m3fn
BLOCK = 128


def make_llm(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=4, max_num_seqs=4, kv_cache_memory=1 << 20)
    opts.update(kw)
    return LLM(str(path), **opts)


PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (9, 70)]


def run(llm: LLM, n: int = 6):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    for o in outs:
        assert o.error is None
    return outs


def prompt_lps(o) -> torch.Tensor:
    return torch.tensor([o.prompt_logprobs[i][t].logprob for i, t in enumerate(o.prompt_token_ids) if i])


def copy_ckpt(src, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- FP8 --------------------------------------------------------------------------------------------

def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 tile: scale = amax / 448, q = e4m3(w / scale); returns (q, scale_inv [tiles])."""
    n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    q = torch.empty(n, k, dtype=FP8)
    scale = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (tile / s).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] *= scale[i, j]
    return out


def _quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.startswith("model.layers.") and not name.endswith("mlp.gate.weight")


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """(fp8 checkpoint, the same weights dequantised in float32, {name: dequantised weight})."""
    root = tmp_path_factory.mktemp("fp8")
    # sizes above one 128-block and not multiples of 128: hidden 144, q_lora 136, intermediate 272
    src, _ = write_checkpoint(root / "src", "v3", seed=3, tokenizer=False, hidden_size=144, q_lora_rank=136,
                              intermediate_size=272, n_group=2, topk_group=1, norm_topk_prob=True)
    tensors = load_file(src / "model.safetensors")
    fp8, deq, dq = {}, {}, {}
    for name, t in tensors.items():
        if _quantized(name, t):
            q, s = quantize_fp8(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            dq[name] = deq[name] = dequantize_fp8(q, s)
        else:
            fp8[name] = deq[name] = t
    assert dq["model.layers.0.mlp.gate_proj.weight"].shape == (272, 144)  # a 3 x 2 grid of partial tiles
    cfg = json.loads((src / "config.json").read_text())
    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}
    for d, ts, extra in ((root / "fp8", fp8, {"quantization_config": qcfg}), (root / "deq", deq, {})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **extra}))
        save_file(ts, d / "model.safetensors", metadata={"format": "pt"})
    return root / "fp8", root / "deq", dq


def test_fp8_block_dequant_roundtrip(fp8_pair):
    fp8_dir, _, dq = fp8_pair
    with safe_open(fp8_dir / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.1.mlp.experts.3.up_proj.weight").get_dtype() == "F8_E4M3"
    model = make_llm(fp8_dir).engine.model
    L0, L1 = model.layers[0], model.layers[1]
    p0, p1 = "model.layers.0.", "model.layers.1."
    checks = {
        "q_a_proj": (L0.self_attn.q_a_proj, dq[p0 + "self_attn.q_a_proj.weight"]),
        "q_b_proj": (L1.self_attn.q_b_proj, dq[p1 + "self_attn.q_b_proj.weight"]),
        "kv_a_proj": (L0.self_attn.kv_a_proj_with_mqa, dq[p0 + "self_attn.kv_a_proj_with_mqa.weight"]),
        "kv_b_proj": (L1.self_attn.kv_b_proj, dq[p1 + "self_attn.kv_b_proj.weight"]),
        "o_proj": (L0.self_attn.o_proj, dq[p0 + "self_attn.o_proj.weight"]),
        "dense w13": (L0.mlp.w13, torch.cat([dq[p0 + "mlp.gate_proj.weight"],
                                             dq[p0 + "mlp.up_proj.weight"]])),
        "dense w2": (L0.mlp.w2, dq[p0 + "mlp.down_proj.weight"]),
        "expert 3 w13": (L1.mlp.w13[3], torch.cat([dq[p1 + "mlp.experts.3.gate_proj.weight"],
                                                   dq[p1 + "mlp.experts.3.up_proj.weight"]])),
        "expert 5 w2": (L1.mlp.w2[5], dq[p1 + "mlp.experts.5.down_proj.weight"]),
        "shared w2": (L1.mlp.shared.w2, dq[p1 + "mlp.shared_experts.down_proj.weight"]),
    }
    for what, (got, want) in checks.items():
        assert got.dtype == torch.float32
        assert torch.equal(got, want), what
    # and the dequantised weights really are a lossy copy (the test is not vacuous)
    orig = load_file(fp8_dir.parent / "src" / "model.safetensors")[p0 + "mlp.gate_proj.weight"]
    assert not torch.equal(orig, dq[p0 + "mlp.gate_proj.weight"])
    assert torch.allclose(orig, dq[p0 + "mlp.gate_proj.weight"], rtol=0.07, atol=1e-3)


def test_fp8_generation_equals_dequantised_checkpoint(fp8_pair):
    fp8_dir, deq_dir, _ = fp8_pair
    a, b = run(make_llm(fp8_dir)), run(make_llm(deq_dir))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert torch.allclose(prompt_lps(x), prompt_lps(y), atol=1e-6)


def test_fp8_weight_without_scale_is_an_error(fp8_pair, tmp_path):
    d = copy_ckpt(fp8_pair[0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv"):
        make_llm(d)


# ---- sharded checkpoints ----------------------------------------------------------------------------

def _shard(src: Path, dst: Path, n: int, index: bool) -> dict[str, str]:
    dst.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = names[i::n]
        save_file({k: tensors[k] for k in part}, dst / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    if index:
        index_json = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return weight_map


@pytest.mark.parametrize("index", [True, False])
def test_sharded_checkpoint(tiny_v3_path, tmp_path, index):
    _shard(Path(tiny_v3_path), tmp_path / "sharded", 3, index)
    a, b = run(make_llm(tiny_v3_path)), run(make_llm(tmp_path / "sharded"))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert torch.equal(prompt_lps(x), prompt_lps(y))


def test_missing_shard_named(tiny_v3_path, tmp_path):
    d = tmp_path / "sharded"
    _shard(Path(tiny_v3_path), d, 3, index=True)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        make_llm(d)


# ---- errors -----------------------------------------------------------------------------------------

def test_unsupported_architecture(tiny_v3_path, tmp_path):
    d = copy_ckpt(tiny_v3_path, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as exc:
        make_llm(d)
    msg = str(exc.value)
    assert "LlamaForCausalLM" in msg
    assert "DeepseekV2ForCausalLM" in msg and "DeepseekV3ForCausalLM" in msg


def test_no_safetensors_files(tiny_v3_path, tmp_path):
    d = copy_ckpt(tiny_v3_path, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors") as exc:
        make_llm(d)
    assert str(d) in str(exc.value)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        make_llm(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        make_llm(tmp_path / "empty")


def test_missing_tensor_named(tiny_v3_path, tmp_path):
    d = copy_ckpt(tiny_v3_path, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.6.down_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.6\.down_proj\.weight"):
        make_llm(d)


def test_wrong_shape_named(tiny_v3_path, tmp_path):
    d = copy_ckpt(tiny_v3_path, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    good = tuple(tensors[name].shape)
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError) as exc:
        make_llm(d)
    msg = str(exc.value)
    assert name in msg and str(good) in msg and str(good[::-1]) in msg


# ---- model directory from the environment -------------------------------------------------------

def test_model_dir_from_environment(tiny_v3_path, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", tiny_v3_path)
    llm = LLM(None, dtype="float32", block_size=4, kv_cache_memory=1 << 20)
    assert llm.engine.model_dir == Path(tiny_v3_path)
    want = [o.outputs[0].token_ids for o in run(make_llm(tiny_v3_path))]
    assert [o.outputs[0].token_ids for o in run(llm)] == want
    # an explicit model wins over the environment
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "nowhere"))
    assert make_llm(tiny_v3_path).engine.model_dir == Path(tiny_v3_path)
    with pytest.raises(CheckpointError, match="nowhere"):
        LLM(None, dtype="float32", kv_cache_memory=1 << 20)


# ---- reduced-precision weights ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_load_and_generate(tiny_v3_path, dtype):
    torch_dtype = getattr(torch, dtype)
    llm = make_llm(tiny_v3_path, dtype=dtype)
    eng = llm.engine
    assert eng.model.embed_tokens.dtype == torch_dtype
    assert eng.model.layers[1].mlp.w13.dtype == torch_dtype
    assert eng.model.layers[1].mlp.gate.dtype == torch.float32  # the router stays in float32
    assert eng.kv_caches["latent"][0].dtype == torch_dtype
    half, full = run(llm, 8), run(make_llm(tiny_v3_path))
    for h, f in zip(half, full):
        c = h.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert all(math.isfinite(d[t].logprob) for d, t in zip(c.logprobs, c.token_ids))
        # rounding noise only (transformers' own bfloat16 model deviates as much from float32)
        diff = (prompt_lps(h) - prompt_lps(f)).abs()
        mean_tol, max_tol = {"bfloat16": (0.3, 3.0), "float16": (0.03, 0.3)}[dtype]
        assert diff.mean() < mean_tol and diff.max() < max_tol, (dtype, diff.mean().item(), diff.max().item())
        if dtype == "float16":
            assert c.token_ids[:3] == f.outputs[0].token_ids[:3]
    eng.blocks.check_no_leaks()


def test_cpu_weight_layout_keeps_values_and_outputs(tiny_v3_path):
    """The CPU platform stores GEMM weights K-major (same values and shapes, transposed strides); the
    token embedding keeps its row-major layout. Greedy outputs equal those of row-major weights."""
    llm = make_llm(tiny_v3_path)
    model = llm.engine.runner.model
    lm_head, w13 = model.lm_head, model.layers[-1].mlp.w13
    assert lm_head.stride() == (1, lm_head.shape[0])
    assert w13.stride()[1:] == (1, w13.shape[1])
    assert model.embed_tokens.is_contiguous()
    laid_out = run(llm)
    for p in model.parameters():
        p.data = p.data.contiguous()
    assert lm_head.is_contiguous()
    plain = run(llm)
    assert [o.outputs[0].token_ids for o in laid_out] == [o.outputs[0].token_ids for o in plain]
    w = torch.randn(3, 5, 7)
    v = CpuPlatform().linear_weight_layout(w)
    assert torch.equal(v, w) and v.shape == w.shape and v.stride() == (35, 1, 5)
    b = torch.randn(7)
    assert CpuPlatform().linear_weight_layout(b) is b
