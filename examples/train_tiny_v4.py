#!/usr/bin/env python
"""Train a tiny DeepSeek-V4 (``tiny-v4``) with the embedded V3's corpus, tokenizer and recipe.

A dev tool like ``train_tiny.py`` (whose corpus, tokenizer, packing, learning-rate schedule,
aux-loss-free bias update and shard writer it reuses): transformers' ``DeepseekV4ForCausalLM``,
~9M parameters, every V4 mechanism active within a 384-token row (sliding window 64, CSA every
4 tokens with a lightning indexer, HCA every 32 tokens, mHC with 4 streams, a hash-routed first
layer, sqrt(softplus) routing, the SwiGLU clamp). Writes a sharded HF-format checkpoint (official
tensor names under ``model.``, as ``save_pretrained`` writes them) plus ``training_report.json`` with
the held-out perplexity, then checks that DeepInfer's own V4 model reproduces the saved weights'
logits.

Usage (the embedded V3's recipe: batch 32, at most 800 steps, a wall-clock cap; STDLIB_COPY = the
``.py`` files of a Python 3.11 stdlib, as for ``train_tiny.py`` on the device)::

    python examples/train_tiny_v4.py --out OUT --minutes 6 --batch-size 32 --max-steps 800 \
        --corpus-root STDLIB_COPY --threads 8 --shards 2                                  # one H200
    python examples/train_tiny_v4.py --out /tmp/tiny_v4 --minutes 1 --device cpu \
        --batch-size 4 --heldout-rows 8 --sample-tokens 8                                 # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import (  # noqa: E402
    BOS,
    MAX_POSITIONS,
    SAMPLE_PROMPT,
    SEQ_LEN,
    VOCAB_SIZE,
    ExpertLoadTracker,
    encode_docs,
    heldout_loss,
    load_corpus,
    lr_at,
    pack,
    train_tokenizer,
    write_generation_config,
    write_safetensors,
    write_tokenizer,
)
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter  # noqa: E402

MAX_PARAMS = 10_000_000
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

MODEL_FIELDS: dict[str, object] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": [SWA, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "sliding_window": 64,
    "compress_rates": {CSA: 4, HCA: 32},
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 192,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
    "initializer_range": 0.02,
}


class V4LoadTracker(ExpertLoadTracker):
    """train_tiny's aux-loss-free bias update on V4's learned routers (hash layers have none)."""

    def __init__(self, model: torch.nn.Module, num_experts: int) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV4TopKRouter)]
        self.counts = [torch.zeros(num_experts, device=next(model.parameters()).device) for _ in self.routers]
        self.num_experts = num_experts
        self.enabled = True
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._make_hook(i))


def build_model(seed: int) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config(**MODEL_FIELDS)
    # eager experts, as train_tiny.py: grouped_mm wants bf16 on CUDA
    model = DeepseekV4ForCausalLM._from_config(cfg, experts_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a fixed token -> experts hash (transformers initialises it to zeros)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(b.shape[0])]))
    return model


def keep_fp32(name: str, t: torch.Tensor) -> bool:
    """Tensors the reference keeps in float32: norms, mHC, sinks, compressor inputs, biases."""
    return (t.dim() < 2 or "hc_" in name or "hc_head" in name or ".compressor." in name
            or "weights_proj" in name)


def save(model: DeepseekV4ForCausalLM, out: Path, shards: int) -> dict[str, torch.Tensor]:
    """save_pretrained's names, bf16 matrices (float32 where the reference keeps them), ``shards`` files."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        state = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(f))
        config = json.loads((Path(tmp) / "config.json").read_text())
    state = {n: (t if not t.is_floating_point() or keep_fp32(n, t) else t.to(torch.bfloat16)).contiguous()
             for n, t in state.items()}
    write_safetensors(state, out, shards)
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    return state


@torch.no_grad()
def deepinfer_logits(out: Path, ids: list[int]) -> torch.Tensor:
    """Logits of DeepInfer's V4 model (reference kernels, float32) over ``ids`` in one prefill step."""
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM as Ours
    from deepinfer_core.models.loader import SafetensorsReader
    from deepinfer_core.models.metadata import AttentionMetadata, GroupMeta
    from kernels_cpu import ReferenceKernels

    cfg = Ours.parse_config(json.loads((out / "config.json").read_text()))
    model = Ours.create(Kernels(ReferenceKernels, ReferenceKernels), cfg, torch.float32, torch.device("cpu"),
                        MAX_POSITIONS)
    model.load_weights(SafetensorsReader(out))
    layout = model.cache_layout()
    bs = layout.block_size_multiple
    n_blocks = -(-len(ids) // bs)
    caches, groups = {}, {}
    pos = torch.arange(len(ids))
    for g in layout.groups:
        epb = g.entries_per_block(bs)
        caches[g.name] = [torch.zeros(n_blocks, epb, g.entry_dim, dtype=g.dtype or torch.float32) for _ in g.layers]
        closes = (pos + 1) % g.tokens_per_entry == 0
        slots = torch.where(closes, pos // g.tokens_per_entry, torch.full_like(pos, -1))
        groups[g.name] = GroupMeta(slots, torch.arange(n_blocks, dtype=torch.int32)[None])
    cu = torch.tensor([0, len(ids)])
    meta = AttentionMetadata(len(ids), groups["swa"].slot_mapping, None, None, groups=groups, cu_q_lens=cu,
                             seq_lens=cu[1:])
    return model.logits(model(torch.tensor(ids), pos, meta, caches))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("deepinfer_core/assets/tiny_v4"))
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget of the training loop")
    p.add_argument("--max-steps", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-gamma", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--corpus-root", type=Path, default=None)
    p.add_argument("--heldout-rows", type=int, default=0, help="evaluate on the first N held-out rows (0 = all)")
    p.add_argument("--sample-tokens", type=int, default=64)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    corpus = load_corpus(args.corpus_root)
    tok = train_tokenizer([t for _, t in corpus.train])
    train_chunks = pack(encode_docs(tok, [t for _, t in corpus.train]), SEQ_LEN)
    heldout_chunks = pack(encode_docs(tok, [t for _, t in corpus.heldout]), SEQ_LEN)
    if args.heldout_rows:
        heldout_chunks = heldout_chunks[: args.heldout_rows]
    print(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files; train "
          f"{train_chunks.numel():,} tokens, held-out {heldout_chunks.numel():,} [{time.time() - t_start:.0f}s]",
          flush=True)
    write_tokenizer(tok, out)

    model = build_model(args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    if n_params > MAX_PARAMS:
        raise RuntimeError(f"{n_params} parameters > {MAX_PARAMS}")
    tracker = V4LoadTracker(model, model.config.n_routed_experts)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60.0
    t_train = time.time()
    step, tokens_seen, epoch, cursor = 0, 0, 0, 0
    order = torch.randperm(len(train_chunks), generator=gen)
    recent: list[float] = []
    load_ratio = 0.0
    model.train()
    while step < args.max_steps and time.time() - t_train < budget_s:
        elapsed = time.time() - t_train
        if cursor + args.batch_size > len(order):
            epoch, cursor = epoch + 1, 0
            order = torch.randperm(len(train_chunks), generator=gen)
        x = train_chunks[order[cursor: cursor + args.batch_size]].to(device)
        cursor += args.batch_size
        lr = lr_at(step, max(step / args.max_steps, elapsed / budget_s), args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(input_ids=x, labels=x, use_cache=False).loss
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
            print(f"step {step:5d} loss {loss.item():.4f} (avg20 {sum(recent) / len(recent):.4f}) lr {lr:.2e} "
                  f"max/mean expert load {load_ratio:.2f} {tokens_seen / el:,.0f} tok/s {el:.0f}s", flush=True)
    train_s = time.time() - t_train
    tracker.enabled = False
    final_train_loss = sum(recent) / len(recent)

    model.cpu().eval()
    save(model, out, args.shards)
    write_generation_config(out)
    reloaded = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, experts_implementation="eager").eval()
    ho_loss, ho_tokens = heldout_loss(reloaded.to(device), heldout_chunks, args.batch_size)
    reloaded.cpu()
    print(f"held-out (saved weights): loss {ho_loss:.4f} ppl {math.exp(ho_loss):.2f} over {ho_tokens:,} tokens",
          flush=True)

    sample = heldout_chunks[0, :160].tolist()
    with torch.no_grad():
        theirs = reloaded(torch.tensor([sample]), use_cache=False).logits[0].float()
    ours = deepinfer_logits(out, sample)
    engine_diff = float((ours - theirs).abs().max())
    print(f"DeepInfer V4 vs transformers on the saved weights: max |logit diff| {engine_diff:.2e}", flush=True)
    if engine_diff > 1e-2:
        raise RuntimeError(f"DeepInfer's V4 model differs from transformers by {engine_diff}")

    prompt_ids = [tok.token_to_id(BOS)] + tok.encode(SAMPLE_PROMPT, add_special_tokens=False).ids
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(args.sample_tokens):
            ids.append(int(reloaded(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    continuation = tok.decode(ids[len(prompt_ids):], skip_special_tokens=False)
    print("sample:\n" + SAMPLE_PROMPT + continuation + "\n---", flush=True)

    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "training_report.json")
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "architecture": "DeepseekV4ForCausalLM",
        "model_fields": MODEL_FIELDS,
        "parameters": n_params,
        "steps": step,
        "epochs_completed": epoch,
        "tokens_seen": tokens_seen,
        "seq_len": SEQ_LEN,
        "final_train_loss": round(final_train_loss, 4),
        "heldout_loss": round(ho_loss, 4),
        "heldout_perplexity": round(math.exp(ho_loss), 3),
        "heldout_predicted_tokens": ho_tokens,
        "heldout_note": "nats per token, same corpus split and tokenizer recipe as the embedded V3 "
                        "(train_tiny.py), computed with the saved weights",
        "deepinfer_vs_transformers_max_logit_diff": engine_diff,
        "train_seconds": round(train_s, 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "sample_prompt": SAMPLE_PROMPT,
        "sample_continuation": continuation,
        "files": {p.name: p.stat().st_size for p in files},
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} in {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
