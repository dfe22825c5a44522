"""Load a DeepSeek checkpoint in HF format: config.json, safetensors (single or sharded with an
index), FP8 block-scaled weights, and the tokenizer.

Every expected tensor is named up front from the config, so a missing or wrongly shaped tensor is
an error that names it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer_core.models.config import ModelConfig
from deepinfer_core.models.deepseek import DeepseekForCausalLM, MoE

logger = logging.getLogger("deepinfer.loader")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
#: Checkpoints shipped inside the package, by the name ``LLM(model=NAME)`` accepts. Both are trained
#: on the Python 3.11 stdlib; each directory has a ``training_report.json`` saying how.
EMBEDDED_MODELS: dict[str, Path] = {
    "tiny-v3": ASSETS / "default_model",  # DeepSeek-V3 architecture (MLA + MoE), examples/train_tiny.py
    "tiny-v4": ASSETS / "tiny_v4",  # DeepSeek-V4 architecture (SWA/CSA/HCA, mHC), examples/train_tiny_v4.py
}
#: what ``model=None`` (and no $DEEPINFER_HF_MODEL_DIR) loads
EMBEDDED_MODEL = EMBEDDED_MODELS["tiny-v3"]
FP8_BLOCK = 128


class CheckpointError(ValueError):
    """The checkpoint is missing files or tensors, or has a tensor of the wrong shape."""


#: what ``quantization_config`` may say, where it says it (DeepSeek's FP8 checkpoints); other keys are not read
FP8_QUANT_KEYS = {"quant_method": ("fp8",), "fmt": ("e4m3",), "weight_block_size": ([FP8_BLOCK, FP8_BLOCK],)}
#: dtypes a block scale may be stored in (ue8m0: V3.1+/V4 power-of-two scales)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def check_quantization_config(model_dir: Path, config: dict) -> None:
    """config.json's ``quantization_config``, where present, must describe DeepSeek's FP8 weights: e4m3
    with a scale per 128x128 tile. Anything else would load as the wrong numbers, so it is refused
    naming the key."""
    quant = config.get("quantization_config")
    if quant is None:
        return
    where = f"{str(model_dir / 'config.json')!r} quantization_config"
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where} must be a table, got {type(quant).__name__}")
    for key, allowed in FP8_QUANT_KEYS.items():
        if key in quant and quant[key] not in allowed:
            raise CheckpointError(f"{where}.{key} is {quant[key]!r}; supported: {' or '.join(map(repr, allowed))} "
                                  "(DeepSeek's block-scaled FP8)")


def checked_scale(name: str, scale: torch.Tensor, tiles: tuple[int, ...], what: str) -> torch.Tensor:
    """A quantised tensor's scales as float32, checked: ``tiles`` of them (``what``: one per which
    block), stored as a float or ue8m0, every one finite and >= 0 (a NaN, infinite or negative scale
    would load as wrong weights without a sign)."""
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"tensor {name!r} is {scale.dtype}; block scales must be one of "
                              f"{', '.join(str(d).removeprefix('torch.') for d in SCALE_DTYPES)}")
    if tuple(scale.shape) != tuple(tiles):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(scale.shape)}, expected {tuple(tiles)} ({what})")
    scale = scale.float()
    bad = ~torch.isfinite(scale) | (scale < 0)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckpointError(f"tensor {name!r} holds {scale[at].item()} at {at}; block scales must be finite "
                              "and >= 0")
    return scale


def check_weight_dtype(name: str, t: torch.Tensor) -> None:
    """A weight without scales must be a float of 16 or 32 bits: other FP8 formats (e5m2, fnuz) and
    integer weights (another quantisation) would be cast as if they were values."""
    if not t.is_floating_point() or t.element_size() < 2:
        raise CheckpointError(f"tensor {name!r} is {t.dtype}; expected float32, bfloat16 or float16, or "
                              "float8_e4m3fn with block scales")


def resolve_model_dir(model: str | None) -> Path:
    """``model`` if given, else $DEEPINFER_HF_MODEL_DIR, else the embedded default model. A name
    that is not a directory is, in order: an embedded model (``EMBEDDED_MODELS``, e.g. ``tiny-v4``),
    or a Hugging Face id (``org/name``) resolved through ``huggingface_hub`` (its cache first;
    ``HF_HUB_OFFLINE=1`` never goes online). An existing directory always wins over a name."""
    path = model or os.environ.get("DEEPINFER_HF_MODEL_DIR") or str(EMBEDDED_MODEL)
    p = Path(path).expanduser()
    if not p.is_dir():
        from deepinfer_core.models.hub import looks_like_repo_id, resolve_repo_id

        if path in EMBEDDED_MODELS:
            p = EMBEDDED_MODELS[path]
            if not p.is_dir():
                raise CheckpointError(f"embedded model {path!r} is missing its files ({str(p)!r}); "
                                      "reinstall deepinfer")
        elif looks_like_repo_id(path):
            p = resolve_repo_id(path)
        else:
            raise CheckpointError(f"model directory {str(p)!r} does not exist, and {path!r} is neither a Hugging "
                                  f"Face id (org/name) nor an embedded model (known: {', '.join(EMBEDDED_MODELS)})")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"model directory {str(p)!r} has no config.json")
    return p


def read_config(model_dir: Path) -> dict:
    """The checkpoint's config.json as a dict."""
    with open(model_dir / "config.json") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{model_dir / 'config.json'} is not valid JSON: {exc}") from exc


def load_model_config(model_dir: Path):
    """The checkpoint's config, parsed by the architecture registered for it (``models.registry``)."""
    from deepinfer_core.models.registry import parse_config

    return parse_config(read_config(model_dir))[1]


class SafetensorsReader:
    """Tensor lookup by name across a (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
            if missing:
                raise CheckpointError(f"checkpoint {str(model_dir)!r} index names missing shard(s): {missing}")
            self.files = {name: model_dir / f for name, f in weight_map.items()}
        else:
            shards = sorted(model_dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"model directory {str(model_dir)!r} has no *.safetensors files")
            self.files = {}
            for shard in shards:
                with safe_open(shard, "pt") as f:
                    self.files.update({name: shard for name in f.keys()})
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path].get_tensor(name)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """DeepSeek FP8: e4m3 weight [N, K] times a float32 scale per block x block tile."""
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return w.float() * s


def quantize_fp8(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`dequantize_fp8` as DeepSeek's checkpoints are made: per block x block tile,
    ``weight_scale_inv = amax / 448`` (1 for an all-zero tile) and ``w = e4m3(w / weight_scale_inv)``."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    tiles = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def keeps_fp8(name: str, t: torch.Tensor) -> bool:
    """Whether tensor ``name`` of an FP8 checkpoint can stay FP8 in memory (``weight_dtype``): every GEMM
    weight but ``kv_b_proj`` (MLA derives its absorbed per-head weights from it); an MLP's gate/up/down
    only when its width fills whole 128-wide tiles (the gate/up scales then concatenate into the fused w13's,
    and w13 and w2 are FP8 together, as the fused MoE op takes them)."""
    if t.dtype != torch.float8_e4m3fn or name.endswith("kv_b_proj.weight"):
        return False
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return t.shape[0] % FP8_BLOCK == 0
    return not name.endswith("down_proj.weight") or t.shape[1] % FP8_BLOCK == 0


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold for the main model, with its shape."""
    C, H = cfg.hidden_size, cfg.num_attention_heads
    qk, L, R = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, C), "model.norm.weight": (C,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, C)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (C,)
        out[p + "post_attention_layernorm.weight"] = (C,)
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            out[a + "q_proj.weight"] = (H * qk, C)
        else:
            out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, C)
            out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            out[a + "q_b_proj.weight"] = (H * qk, cfg.q_lora_rank)
        out[a + "kv_a_proj_with_mqa.weight"] = (L + R, C)
        out[a + "kv_a_layernorm.weight"] = (L,)
        out[a + "kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), L)
        out[a + "o_proj.weight"] = (C, H * cfg.v_head_dim)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            I = cfg.moe_intermediate_size
            out[m + "gate.weight"] = (cfg.n_routed_experts, C)
            if cfg.topk_method == "noaux_tc":
                out[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                out.update(_mlp_names(f"{m}experts.{e}.", C, I))
            if cfg.n_shared_experts:
                out.update(_mlp_names(m + "shared_experts.", C, I * cfg.n_shared_experts))
        else:
            out.update(_mlp_names(m, C, cfg.intermediate_size))
    return out


def _mlp_names(prefix: str, C: int, I: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (I, C), prefix + "up_proj.weight": (I, C), prefix + "down_proj.weight": (C, I)}


def _rope_rows_to_interleaved(w: torch.Tensor, heads: int, head_dim: int, rope_dim: int) -> torch.Tensor:
    """Reorder the rope rows of a projection from half-split (x_i, x_{i+R/2}) pairs to interleaved
    (x_2i, x_2i+1) pairs. Applied to q and k alike, attention scores are unchanged."""
    w = w.view(heads, head_dim, -1).clone()
    rope = w[:, head_dim - rope_dim :]
    order = torch.arange(rope_dim).view(2, rope_dim // 2).t().reshape(-1)
    w[:, head_dim - rope_dim :] = rope[:, order]
    return w.view(heads * head_dim, -1)


def iter_checkpoint(reader: SafetensorsReader, cfg: ModelConfig, dtype: torch.dtype,
                    expert_range: tuple[int, int] | None = None,
                    prefix: str | None = None, keep_fp8: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every expected tensor: shape-checked, dequantised, cast to dtype.
    ``prefix``: only the tensors whose name starts with it (e.g. one extra layer such as MTP's).
    ``keep_fp8``: FP8 tensors that can stay FP8 (:func:`keeps_fp8`) are yielded as e4m3, each followed by
    ``(name + "_scale_inv", float32 scale per 128x128 tile)``."""
    expected = expected_tensors(cfg)
    if prefix is not None:
        expected = {n: shape for n, shape in expected.items() if n.startswith(prefix)}
    available = reader.names()
    missing = [n for n in expected if n not in available]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")
    lo, hi = expert_range or (0, cfg.n_routed_experts or 0)
    for name, shape in expected.items():
        if ".experts." in name and not lo <= int(name.split(".experts.")[1].split(".")[0]) < hi:
            continue
        t = reader.get(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        scale = None
        if t.dtype == torch.float8_e4m3fn:
            scale_name = name + "_scale_inv"
            if scale_name not in available:
                raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name!r}")
            tiles = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
            scale = checked_scale(scale_name, reader.get(scale_name), tiles,
                                  f"one scale per {FP8_BLOCK}x{FP8_BLOCK} tile of {name!r}")
            if not (keep_fp8 and keeps_fp8(name, t)):
                t, scale = dequantize_fp8(t, scale), None
        else:
            check_weight_dtype(name, t)
        if scale is not None:  # rope rows move inside 64-row groups, so within their 128-row tiles
            t = t.view(torch.uint8)
        if not cfg.rope_interleave and name.endswith(("q_proj.weight", "q_b_proj.weight")):
            t = _rope_rows_to_interleaved(t, cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_rope_head_dim)
        elif not cfg.rope_interleave and name.endswith("kv_a_proj_with_mqa.weight"):
            t = _rope_rows_to_interleaved(t, 1, t.shape[0], cfg.qk_rope_head_dim)
        if scale is not None:
            yield name, t.view(torch.float8_e4m3fn)
            yield name + "_scale_inv", scale
            continue
        keep_fp32 = name.endswith(("gate.weight", "e_score_correction_bias")) and ".experts." not in name
        yield name, t.to(torch.float32 if keep_fp32 else dtype)


def assign_weights(model: DeepseekForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model's fused parameters. An e4m3 tensor turns its parameter into
    e4m3 and fills the owning module's ``<param>_scale_inv`` buffer from the ``_scale_inv`` that follows."""
    params = dict(model.named_parameters(remove_duplicate=False))
    plain: set[str] = set()  # parameters that received a non-FP8 tensor
    fp8: set[str] = set()  # parameters that received an e4m3 tensor
    for name, t in tensors:
        is_scale = name.endswith("_scale_inv")
        target, rows = _target(model, name.removesuffix("_scale_inv"))
        with torch.no_grad():
            if is_scale:
                p = _fp8_scale(model, target, params[target])
            else:
                p = params[target]
                is_fp8 = t.dtype == torch.float8_e4m3fn
                if target in (plain if is_fp8 else fp8):
                    raise CheckpointError(f"tensor {name!r} is {t.dtype} but other tensors of the fused weight "
                                          f"{target!r} are not: FP8 checkpoints must quantise all of them alike")
                (fp8 if is_fp8 else plain).add(target)
                if is_fp8 and p.dtype != t.dtype:
                    p.data = torch.empty(p.shape, dtype=t.dtype, device=p.device)
            if rows is None:
                p.data.copy_(t)
            else:
                index, half = rows
                dst = p.data[index] if index is not None else p.data
                if half is None:
                    dst.copy_(t)
                else:
                    n = dst.shape[0] // 2
                    dst[half * n : (half + 1) * n].copy_(t)
    for module_name, buf_name, buf in _fp8_scales(model):
        if bool(buf.isnan().any()):
            raise CheckpointError(f"FP8 weight {module_name}.{buf_name.removesuffix('_scale_inv')} got only part of "
                                  "its scales from the checkpoint")
    model.post_load()


def _fp8_scale(model: torch.nn.Module, target: str, p: torch.Tensor) -> torch.Tensor:
    """The ``<param>_scale_inv`` buffer of parameter ``target`` (created, NaN-filled, on first use): one
    float32 per 128x128 tile of each [N, K] matrix of ``p``."""
    owner, _, attr = target.rpartition(".")
    module = model.get_submodule(owner)
    buf = getattr(module, attr + "_scale_inv", None)
    if buf is None:
        *lead, n, k = p.shape
        buf = torch.full((*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), float("nan"), device=p.device)
        module.register_buffer(attr + "_scale_inv", buf, persistent=False)
    return buf


def quantize_model_fp8(model: torch.nn.Module, round_trip: bool = False) -> int:
    """Turn the model's GEMM weights that declare a ``<name>_scale_inv`` buffer into e4m3 with 128x128 tile
    scales (:func:`quantize_fp8`, matrix by matrix), as an FP8 checkpoint would load them (``load_format =
    "random"`` with ``weight_dtype = "fp8"``: benchmarks of FP8 shapes without a checkpoint). A fused w13
    whose halves do not fill whole tiles stays as it is. Returns the number of weights quantised.

    ``round_trip``: write each weight back, in place and in its own dtype, as the dequantised FP8 weight
    (what ``weight_dtype = "bf16"`` loads from the FP8 checkpoint of these weights), declaring no scales.
    In place, so a built engine's CUDA graphs stay valid and the weights derived at load as views of these
    (nvidia's fused input projection and stacked experts) follow; derived copies (where a platform's weight
    layout copied them, as the CPU's does) keep the old values."""
    done = 0
    for module in list(model.modules()):
        for buf_name in [n for n, b in module._buffers.items() if n.endswith("_scale_inv") and b is None]:
            attr = buf_name.removesuffix("_scale_inv")
            p = getattr(module, attr, None)
            width = {"w13": p.shape[-2] // 2, "w2": p.shape[-1]}.get(attr, 0) if p is not None else 0
            if p is None or p.dim() < 2 or width % FP8_BLOCK:  # keeps_fp8's rule
                continue
            if round_trip:
                with torch.no_grad():
                    for m in p.data.view(-1, *p.shape[-2:]):
                        m.copy_(dequantize_fp8(*quantize_fp8(m)))
                done += 1
                continue
            pairs = [quantize_fp8(m) for m in p.data.reshape(-1, *p.shape[-2:])]  # one matrix at a time
            p.data = torch.stack([q for q, _ in pairs]).view(p.shape)
            scales = [s for _, s in pairs]
            module.register_buffer(buf_name, torch.stack(scales).view(*p.shape[:-2], *scales[0].shape),
                                   persistent=False)
            done += 1
    return done


def _fp8_scales(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name.endswith("_scale_inv"):
                yield module_name, buf_name, buf


def _target(model: DeepseekForCausalLM, name: str):
    """HF tensor name -> (our parameter name, (expert index | None, half | None) | None)."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens", None
    if name == "model.norm.weight":
        return "norm", None
    if name == "lm_head.weight":
        return "lm_head", None
    _, _, i, rest = name.split(".", 3)
    p = f"layers.{i}."
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return p + rest.removesuffix(".weight"), None
    if rest.startswith("self_attn."):
        attn = rest.removeprefix("self_attn.")
        if attn in ("q_a_layernorm.weight", "kv_a_layernorm.weight"):
            return p + "self_attn." + attn, None
        return p + "self_attn." + attn.removesuffix(".weight"), None
    mlp = rest.removeprefix("mlp.")
    if mlp == "gate.weight":
        return p + "mlp.gate", None
    if mlp == "gate.e_score_correction_bias":
        return p + "mlp.e_score_correction_bias", None
    proj = mlp.rsplit(".", 2)[-2]  # gate_proj | up_proj | down_proj
    half = {"gate_proj": 0, "up_proj": 1, "down_proj": None}[proj]
    param = "w2" if proj == "down_proj" else "w13"
    if mlp.startswith("experts."):
        moe = model.layers[int(i)].mlp
        return f"{p}mlp.{param}", (int(mlp.split(".")[1]) - moe.expert_start, half)
    if mlp.startswith("shared_experts."):
        return f"{p}mlp.shared.{param}", (None, half)
    return f"{p}mlp.{param}", (None, half)


def random_init(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every weight with seeded random values, on the weights' device (benchmarks of shapes
    without a checkpoint)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.data.fill_(0.0 if name.endswith("e_score_correction_bias") else 1.0)
            continue
        if p.device not in generators:
            generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.normal_(0, std, generator=generators[p.device])
    post_load = getattr(model, "post_load", None)
    if post_load is not None:
        post_load()


def apply_weight_layout(module: torch.nn.Module, layout) -> None:
    """Re-lay every GEMM weight of ``module`` (parameters of two or more dims other than the token
    embedding) with ``layout``, a ``Platform.linear_weight_layout``. Values and shapes stay."""
    skip = {id(m.embed_tokens) for m in module.modules() if isinstance(getattr(m, "embed_tokens", None), torch.Tensor)}
    for m in module.modules():  # stacked routed + shared experts: laid out as a whole, the parameters are views
        if isinstance(m, MoE):
            skip |= {id(p) for p in m.apply_weight_layout(layout)}
    for p in module.parameters():
        if p.dim() >= 2 and id(p) not in skip:
            p.data = layout(p.data)


def construct(make, dtype: torch.dtype, device: torch.device):
    """``make()`` with its weights created in ``dtype`` on ``device``, router weights kept in float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = make()
    finally:
        torch.set_default_dtype(previous)
    for m in module.modules():
        if isinstance(m, MoE):
            m.gate.data = m.gate.data.float()
            if m.e_score_correction_bias is not None:
                m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
    return module


def build_model(k, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                **moe_kw) -> DeepseekForCausalLM:
    """An uninitialised model with weights in ``dtype`` on ``device`` (router weights in float32)."""
    return construct(lambda: DeepseekForCausalLM(k, cfg, max_positions=max_positions, **moe_kw), dtype, device)


def load_model(k, model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, expert_range: tuple[int, int] | None = None) -> DeepseekForCausalLM:
    moe_kw = {}
    if expert_range is not None:
        moe_kw = {"expert_start": expert_range[0], "num_local": expert_range[1] - expert_range[0]}
    model = build_model(k, cfg, dtype, device, max_positions, **moe_kw)
    tensors = iter_checkpoint(SafetensorsReader(model_dir), cfg, dtype, expert_range)
    assign_weights(model, _progress(tensors, len(expected_tensors(cfg)), f"loading {model_dir.name}"))
    return model


def _progress(items: Iterator, total: int, desc: str) -> Iterator:
    """A progress bar over weight loading, on a terminal only (tqdm's ``disable=None``)."""
    from tqdm.auto import tqdm

    return iter(tqdm(items, total=total, desc=desc, unit="tensor", disable=None, leave=False, dynamic_ncols=True))
