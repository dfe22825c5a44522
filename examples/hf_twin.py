"""transformers' DeepseekV2/V3 model built on THE SAME weight tensors as a running engine (no copy).

The HF module is constructed on the meta device; each of its parameters and buffers is then replaced
by a view of the engine parameter it corresponds to (``loader._target`` maps HF tensor names to ours;
transformers >= 5 stores experts fused as ``experts.gate_up_proj`` [E, 2I, C] and ``experts.down_proj``
[E, C, I], which are our ``w13`` and ``w2`` as they are). Any tensor left unmapped is an error.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from deepinfer_core.models.loader import _target


def _our_view(model, params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # transformers >= 5: fused experts
        i = name.split(".")[2]
        return params[f"layers.{i}.mlp.{'w13' if name.endswith('gate_up_proj') else 'w2'}"]
    target, rows = _target(model, name)
    t = params[target]
    if rows is None:
        return t
    index, half = rows
    t = t[index] if index is not None else t
    if half is None:
        return t
    n = t.shape[0] // 2
    return t[half * n : (half + 1) * n]


def _set(module: torch.nn.Module, dotted: str, tensor: torch.Tensor, buffer: bool) -> None:
    *path, leaf = dotted.split(".")
    for p in path:
        module = getattr(module, p)
    if buffer:
        module._buffers[leaf] = tensor
    else:
        module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


def hf_twin(model, model_dir: Path, device: torch.device):
    """A transformers ``*ForCausalLM`` (sdpa attention) whose weights are the engine ``model``'s tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ours = dict(model.named_parameters(remove_duplicate=False))
    ours.update(dict(model.named_buffers()))
    non_persistent = set()
    for mod_name, mod in hf.named_modules():
        non_persistent |= {f"{mod_name}.{b}".lstrip(".") for b in getattr(mod, "_non_persistent_buffers_set", ())}
    mapped = set()
    for kind, items in (("param", hf.named_parameters(remove_duplicate=False)), ("buffer", hf.named_buffers())):
        for name, t in list(items):
            if name in non_persistent:
                continue
            view = _our_view(model, ours, name)
            if tuple(view.shape) != tuple(t.shape):
                raise ValueError(f"hf_twin: {name} has shape {tuple(t.shape)} in transformers, "
                                 f"{tuple(view.shape)} in the engine")
            _set(hf, name, view, kind == "buffer")
            mapped.add(name)
    for mod_name, mod in list(hf.named_modules()):  # rotary tables: rebuilt on the device
        if type(mod).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(mod)(config=config)
            parent, _, leaf = mod_name.rpartition(".")
            setattr(hf.get_submodule(parent) if parent else hf, leaf, fresh)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"hf_twin: transformers tensors with no engine counterpart: {left[:5]}")
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


class _StepClock:
    """A logits processor that records when each new token's logits are ready (synchronised)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def _compiled_kwargs(backend: str) -> dict:
    """``generate`` arguments for transformers' static KV cache with its decode forward under ``torch.compile``
    (``reduce-overhead``: CUDA graphs when the backend is inductor)."""
    from transformers import CompileConfig

    cc = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" else None)
    cc._compile_all_devices = True  # a CPU test compiles too (transformers compiles only on accelerators otherwise)
    return {"cache_implementation": "static", "compile_config": cc}


def hf_generate_timed(hf, prompts: torch.Tensor, new_tokens: int, skip: int = 1,
                      compile_backend: str | None = None) -> dict:
    """Greedy ``generate`` of ``new_tokens`` tokens for a [B, S] batch of prompts (no padding). Decode tok/s
    comes from the per-token timestamps after the first ``skip`` decode steps, so prefill is excluded.

    ``compile_backend`` (e.g. ``"inductor"``): the stronger baseline, transformers with a static cache and
    ``torch.compile``; one untimed ``generate`` of the same shapes first compiles (and records the graphs),
    and its seconds are returned as ``compile_s``."""
    from transformers import LogitsProcessorList

    if new_tokens < skip + 2:
        raise ValueError(f"new_tokens={new_tokens} must be at least skip + 2 = {skip + 2}")
    extra = _compiled_kwargs(compile_backend) if compile_backend else {}
    B = prompts.shape[0]

    def generate(clock: _StepClock) -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False,
                               logits_processor=LogitsProcessorList([clock]), **extra)

    compile_s = None
    if compile_backend:
        t0 = time.perf_counter()
        generate(_StepClock(prompts.device))
        compile_s = time.perf_counter() - t0
    clock = _StepClock(prompts.device)
    t0 = time.perf_counter()
    out = generate(clock)
    t = clock.times
    steps = len(t) - 1 - skip
    return {"batch": B, "prompt_len": prompts.shape[1], "new_tokens": new_tokens,
            "prefill_s": t[0] - t0, "decode_tok_s": B * steps / (t[-1] - t[skip]),
            "decode_step_ms": (t[-1] - t[skip]) / steps * 1e3, "compile_backend": compile_backend,
            "compile_s": compile_s, "experts_implementation": getattr(hf.config, "_experts_implementation", None),
            "tokens": out[:, prompts.shape[1]:].tolist()}
