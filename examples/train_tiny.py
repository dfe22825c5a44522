#!/usr/bin/env python
"""Train the tiny embedded default model shipped in ``deepinfer_core/assets/default_model``.

This is a dev tool, not part of the engine: it uses ``transformers`` (a test/dev
dependency) to train a ~8.5M-parameter DeepSeek-V3-architecture model (MLA attention,
one dense layer, then sigmoid/noaux_tc-routed MoE layers with a shared expert) on the
Python standard library's own sources, on CPU, in about 25 minutes.

The output directory uses the standard DeepSeek HF checkpoint layout (the one of the
real DeepSeek-V3 checkpoints on the Hub, with per-expert ``mlp.experts.{j}.*`` tensors),
not transformers-v5's internal fused expert layout:

    config.json  generation_config.json  model.safetensors
    tokenizer.json  tokenizer_config.json  training_report.json

Usage::

    python examples/train_tiny.py --out deepinfer_core/assets/default_model --minutes 25
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
VOCAB_SIZE = 4096
SEQ_LEN = 384
MAX_POSITIONS = 1024
MAX_FILE_BYTES = 200_000
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
HELDOUT_MODULUS = 20
MAX_PARAMS = 10_000_000
MAX_DIR_BYTES = 20 * 1024 * 1024
SAMPLE_PROMPT = "def fibonacci(n):\n"

# Architecture of the default model (DeepSeek-V3 field names).
MODEL_FIELDS: dict[str, object] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "intermediate_size": 768,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 256,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "attention_bias": False,
    "initializer_range": 0.02,
}
ROPE_THETA = 10000.0

# Fields of the real DeepSeek-V3 config.json that transformers' DeepseekV3Config does not
# model (its router is hard-wired to sigmoid + noaux_tc); recorded for other readers.
V3_EXTRA_FIELDS: dict[str, object] = {
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "moe_layer_freq": 1,
    "ep_size": 1,
    "aux_loss_alpha": 0.0,
    "seq_aux": True,
    "rope_theta": ROPE_THETA,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
}
# Derived attributes transformers writes but real V3 configs do not have (recomputed on load).
# ``head_dim`` there means qk_rope_head_dim and would mislead other readers.
DROP_CONFIG_FIELDS = ("head_dim", "qk_head_dim", "output_router_logits")


@dataclass
class Corpus:
    """Stdlib source files split into train and held-out sets (relative path, text)."""

    root: Path
    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]


def is_heldout(rel_path: str) -> bool:
    """Deterministic 5% hold-out rule on the POSIX relative path."""
    return zlib.crc32(rel_path.encode("utf-8")) % HELDOUT_MODULUS == 0


def load_corpus(root: Path | None = None) -> Corpus:
    """Collect the stdlib ``.py`` sources, skipping tests, site-packages and big files."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    train: list[tuple[str, str]] = []
    heldout: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if not text:
            continue
        rel_s = rel.as_posix()
        (heldout if is_heldout(rel_s) else train).append((rel_s, text))
    return Corpus(root=root, train=train, heldout=heldout)


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Train a byte-level BPE tokenizer (ids 0/1 = BOS/EOS, no BOS post-processor)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def encode_docs(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Encode documents and assert they round-trip exactly through the decoder."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    ids = [e.ids for e in encs]
    decoded = tok.decode_batch(ids, skip_special_tokens=False)
    bad = sum(d != t for d, t in zip(decoded, texts, strict=True))
    if bad:
        raise RuntimeError(f"tokenizer does not round-trip {bad} documents")
    return ids


def pack(docs: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate ``BOS + doc + EOS`` for every document and cut into ``seq_len`` rows."""
    flat: list[int] = []
    for ids in docs:
        flat.append(0)
        flat.extend(ids)
        flat.append(1)
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


def build_config() -> DeepseekV3Config:
    """The transformers config for the default model (rope_interleave left at True)."""
    return DeepseekV3Config(
        **MODEL_FIELDS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )


def lr_at(step: int, progress: float, base_lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay driven by ``progress`` in [0, 1]."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return base_lr * (min_ratio + (1.0 - min_ratio) * cos)


class ExpertLoadTracker:
    """Counts routed tokens per expert and applies DeepSeek-V3's aux-loss-free bias update."""

    def __init__(self, model: torch.nn.Module, num_experts: int) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = [torch.zeros(num_experts, device=next(model.parameters()).device) for _ in self.routers]
        self.num_experts = num_experts
        self.enabled = True
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._make_hook(i))

    def _make_hook(self, i: int):
        def hook(_module: torch.nn.Module, _inp: object, out: tuple[torch.Tensor, ...]) -> None:
            if self.enabled:
                idx = out[2].detach().reshape(-1)
                self.counts[i] += torch.bincount(idx, minlength=self.num_experts).float()

        return hook

    @torch.no_grad()
    def update_bias(self, gamma: float) -> float:
        """``bias += gamma * sign(mean_load - load)``; returns the worst max/mean load ratio."""
        worst = 0.0
        for router, counts in zip(self.routers, self.counts, strict=True):
            if counts.sum() == 0:
                continue
            router.e_score_correction_bias += gamma * torch.sign(counts.mean() - counts)
            worst = max(worst, float(counts.max() / counts.mean()))
            counts.zero_()
        return worst


@torch.no_grad()
def heldout_loss(model: DeepseekV3ForCausalLM, chunks: torch.Tensor, batch_size: int) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats per token) over all held-out rows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(chunks), batch_size):
        x = chunks[i : i + batch_size].to(next(model.parameters()).device)
        logits = model(input_ids=x).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    return total / count, count


def to_deepseek_state_dict(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """Convert transformers' state dict to the standard DeepSeek HF layout, in bfloat16.

    transformers v5 fuses routed experts into ``experts.gate_up_proj`` [E, 2I, H]
    (gate rows first, then up rows) and ``experts.down_proj`` [E, H, I]; these are split
    into per-expert ``experts.{j}.{gate,up,down}_proj.weight``. ``e_score_correction_bias``
    stays float32, as in the real DeepSeek-V3 checkpoints; everything else is bfloat16.
    """
    out: dict[str, torch.Tensor] = {}
    inter = model.config.moe_intermediate_size
    for name, t in model.state_dict().items():
        t = t.detach()
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for j in range(t.shape[0]):
                out[f"{prefix}{j}.gate_proj.weight"] = t[j, :inter]
                out[f"{prefix}{j}.up_proj.weight"] = t[j, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for j in range(t.shape[0]):
                out[f"{prefix}{j}.down_proj.weight"] = t[j]
        elif "rotary_emb" in name:
            continue
        else:
            out[name] = t
    return {
        k: (v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).contiguous().clone()
        for k, v in out.items()
    }


def expected_tensor_names(cfg: DeepseekV3Config) -> set[str]:
    """Every tensor name a DeepSeek-V3 HF checkpoint of this shape must contain."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    attn = [
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
        "o_proj",
    ]
    mlp3 = ["gate_proj", "up_proj", "down_proj"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {f"{p}self_attn.{a}.weight" for a in attn}
        names |= {f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"}
        if i < cfg.first_k_dense_replace:
            names |= {f"{p}mlp.{m}.weight" for m in mlp3}
        else:
            names |= {f"{p}mlp.gate.weight", f"{p}mlp.gate.e_score_correction_bias"}
            names |= {f"{p}mlp.shared_experts.{m}.weight" for m in mlp3}
            names |= {f"{p}mlp.experts.{j}.{m}.weight" for j in range(cfg.n_routed_experts) for m in mlp3}
    return names


def write_safetensors(state: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """One ``model.safetensors``, or ``shards`` files plus ``model.safetensors.index.json`` (the device
    tool returns files of at most 16 MiB, so the GPU run writes 2 shards)."""
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    if shards <= 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = names[i * len(names) // shards : (i + 1) * len(names) // shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: state[n] for n in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def write_config(cfg: DeepseekV3Config, out: Path) -> None:
    """Write config.json: transformers' own fields plus the real-V3-only fields."""
    cfg.save_pretrained(out)
    path = out / "config.json"
    data = json.loads(path.read_text())
    for key in DROP_CONFIG_FIELDS:
        data.pop(key, None)
    data.update(V3_EXTRA_FIELDS)
    data["architectures"] = ["DeepseekV3ForCausalLM"]
    data["model_type"] = "deepseek_v3"
    path.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")


def write_tokenizer(tok: Tokenizer, out: Path) -> None:
    """Write tokenizer.json and a minimal tokenizer_config.json (engine prepends BOS)."""
    tok.save(str(out / "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")


def write_generation_config(out: Path) -> None:
    """Write a minimal generation_config.json."""
    conf = {"bos_token_id": 0, "eos_token_id": 1}
    (out / "generation_config.json").write_text(json.dumps(conf, indent=2) + "\n")


def bf16_roundtrip_copy(model: DeepseekV3ForCausalLM) -> DeepseekV3ForCausalLM:
    """A float32 copy of ``model`` whose weights went through the saved dtypes."""
    ref = DeepseekV3ForCausalLM._from_config(model.config, experts_implementation="eager", attn_implementation="sdpa")
    sd = {
        k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).float()
        for k, v in model.state_dict().items()
    }
    ref.load_state_dict(sd, strict=True)
    return ref.eval()


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("deepinfer_core/assets/default_model"))
    p.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget of the training loop")
    p.add_argument("--max-steps", type=int, default=5000, help="hard cap on optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-gamma", type=float, default=1e-3, help="aux-loss-free bias update speed (0 = off)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shards", type=int, default=1, help="number of safetensors shards to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="a copy of a stdlib tree to train on (default: this Python's stdlib)")
    p.add_argument("--sample-tokens", type=int, default=96)
    return p.parse_args()


def main() -> None:
    """Build corpus and tokenizer, train, write and verify the checkpoint, write the report."""
    args = parse_args()
    t_start = time.time()
    cpu_start = time.process_time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    # --- corpus and tokenizer -------------------------------------------------------
    corpus = load_corpus(args.corpus_root)
    device = torch.device(args.device)
    print(f"corpus: {corpus.root}: {len(corpus.train)} train / {len(corpus.heldout)} held-out files", flush=True)
    tok = train_tokenizer([t for _, t in corpus.train])
    train_docs = encode_docs(tok, [t for _, t in corpus.train])
    heldout_docs = encode_docs(tok, [t for _, t in corpus.heldout])
    train_chunks = pack(train_docs, SEQ_LEN)
    heldout_chunks = pack(heldout_docs, SEQ_LEN)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, round-trip ok; train {train_chunks.numel():,} tokens "
        f"({len(train_chunks)} rows), held-out {heldout_chunks.numel():,} tokens "
        f"({len(heldout_chunks)} rows) [{time.time() - t_start:.0f}s]",
        flush=True,
    )
    write_tokenizer(tok, out)

    # --- model ------------------------------------------------------------------------
    cfg = build_config()
    model = DeepseekV3ForCausalLM._from_config(cfg, experts_implementation="eager", attn_implementation="sdpa")
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    if n_params > MAX_PARAMS:
        raise RuntimeError(f"{n_params} parameters > {MAX_PARAMS}")
    tracker = ExpertLoadTracker(model, cfg.n_routed_experts)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    # --- training ---------------------------------------------------------------------
    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60.0
    t_train = time.time()
    step, tokens_seen, epoch = 0, 0, 0
    order = torch.randperm(len(train_chunks), generator=gen)
    cursor = 0
    recent: list[float] = []
    load_ratio = 0.0
    model.train()
    while step < args.max_steps:
        elapsed = time.time() - t_train
        if elapsed >= budget_s:
            break
        if cursor + args.batch_size > len(order):
            epoch += 1
            order = torch.randperm(len(train_chunks), generator=gen)
            cursor = 0
        x = train_chunks[order[cursor : cursor + args.batch_size]].to(device)
        cursor += args.batch_size
        progress = max(step / args.max_steps, elapsed / budget_s)
        lr = lr_at(step, progress, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if args.bias_gamma > 0:
            load_ratio = tracker.update_bias(args.bias_gamma)
        step += 1
        tokens_seen += x.numel()
        recent = (recent + [loss.item()])[-20:]
        if step % 10 == 0 or step == 1:
            el = time.time() - t_train
            print(
                f"step {step:5d} ep {epoch} loss {loss.item():.4f} (avg20 {sum(recent) / len(recent):.4f}) "
                f"lr {lr:.2e} max/mean expert load {load_ratio:.2f} "
                f"{tokens_seen / el:,.0f} tok/s {el:.0f}s",
                flush=True,
            )
    train_s = time.time() - t_train
    tracker.enabled = False
    final_train_loss = sum(recent) / len(recent)
    print(f"trained {step} steps, {tokens_seen:,} tokens in {train_s:.0f}s; final loss {final_train_loss:.4f}")

    # --- write the checkpoint -------------------------------------------------------
    model.cpu().eval()
    state = to_deepseek_state_dict(model)
    expected = expected_tensor_names(cfg)
    if set(state) != expected:
        raise RuntimeError(f"tensor names: missing {expected - set(state)}, unexpected {set(state) - expected}")
    write_safetensors(state, out, args.shards)
    write_config(cfg, out)
    write_generation_config(out)

    # --- verify by reloading through from_pretrained --------------------------------
    reloaded = DeepseekV3ForCausalLM.from_pretrained(
        out, dtype=torch.float32, experts_implementation="eager", attn_implementation="sdpa"
    ).eval()
    ref = bf16_roundtrip_copy(model)
    sample = heldout_chunks[:2]
    with torch.no_grad():
        max_diff = float((reloaded(input_ids=sample).logits - ref(input_ids=sample).logits).abs().max())
    print(f"reload check: max |logit diff| vs bf16-rounded in-memory model = {max_diff:.2e}")
    if max_diff > 1e-2:
        raise RuntimeError(f"reloaded logits differ by {max_diff}")
    subset = heldout_chunks[: 2 * args.batch_size]
    sub_fp32, _ = heldout_loss(model, subset, args.batch_size)
    sub_saved, _ = heldout_loss(reloaded, subset, args.batch_size)
    print(f"held-out subset loss: in-memory fp32 {sub_fp32:.4f}, saved bf16 {sub_saved:.4f}")
    if abs(sub_saved - sub_fp32) > 0.02:
        raise RuntimeError(f"held-out loss of the saved weights {sub_saved} != in-memory {sub_fp32}")
    ho_loss, ho_tokens = heldout_loss(reloaded.to(device), heldout_chunks, args.batch_size)
    reloaded.cpu()
    print(
        f"held-out (saved bf16 weights): loss {ho_loss:.4f} ppl {math.exp(ho_loss):.2f} over {ho_tokens:,} tokens",
        flush=True,
    )

    # --- sample continuation (greedy, saved weights) -------------------------------
    prompt_ids = [0] + tok.encode(SAMPLE_PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        gen_ids = reloaded.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=args.sample_tokens,
            do_sample=False,
            eos_token_id=1,
            pad_token_id=1,
        )
    continuation = tok.decode(gen_ids[0, len(prompt_ids) :].tolist(), skip_special_tokens=False)
    print("sample:\n" + SAMPLE_PROMPT + continuation + "\n---", flush=True)

    # --- report ---------------------------------------------------------------------
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "training_report.json")
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "corpus": {
            "root": str(corpus.root),
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout),
            "heldout_rule": f"zlib.crc32(relative_path) % {HELDOUT_MODULUS} == 0",
            "train_tokens": int(train_chunks.numel()),
            "heldout_tokens": int(heldout_chunks.numel()),
        },
        "seq_len": SEQ_LEN,
        "parameters": n_params,
        "steps": step,
        "epochs_completed": epoch,
        "tokens_seen": tokens_seen,
        "final_train_loss": round(final_train_loss, 4),
        "final_train_loss_note": "mean of the last 20 training steps",
        "heldout_subset_loss_fp32_vs_saved": [round(sub_fp32, 4), round(sub_saved, 4)],
        "heldout_loss": round(ho_loss, 4),
        "heldout_perplexity": round(math.exp(ho_loss), 3),
        "heldout_predicted_tokens": ho_tokens,
        "heldout_note": "nats per token (4096-token byte-level BPE), computed with the saved bf16 weights",
        "reload_max_logit_diff": max_diff,
        "train_seconds": round(train_s, 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "cpu_seconds": round(time.process_time() - cpu_start, 1),
        "sample_prompt": SAMPLE_PROMPT,
        "sample_continuation": continuation,
        "files": {p.name: p.stat().st_size for p in files},
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB) in {time.time() - t_start:.0f}s", flush=True)
    if total > MAX_DIR_BYTES:
        raise RuntimeError(f"output dir is {total} bytes > {MAX_DIR_BYTES}")


if __name__ == "__main__":
    main()
