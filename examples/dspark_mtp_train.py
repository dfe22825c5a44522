"""MTP-module training for ``train_dspark_draft.py --kind mtp`` (a dev tool; uses ``transformers``).

The module is DeepSeek-V3's multi-token-prediction layer as ``plugins.dspark.draft.MTPDraft`` runs it:

    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)]);  h' = decoder_layer(x)  (dense, at position p)
    logits = lm_head(shared_head.norm(h'))                                   (predicts t_{p+2})

with the target's (frozen) embedding and LM head. ``h_p`` at depth 1 is the target's final normalised
hidden state (what ``ModelRunner.prepare(keep_hidden=True)`` keeps); at depth d > 1 it is the module's
own ``h'`` (before ``shared_head.norm``) of depth d - 1 at the previous position, as ``_ar_step``
feeds it. Training is teacher-forced on the target's tokens and distributions, depth 1 and depth 2
(recursive, run over the whole sequence in parallel), the latter at half weight; optionally depth 3
(``depth3``: the weight of the next recursion, for drafts verified deeper than two under a budget),
and optionally starting from a trained layer (``load_mtp``: fine-tuning the shipped one).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from plugins.dspark.draft import MTP_FILENAME


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * w


class MTPModule(nn.Module):
    """enorm/hnorm/eh_proj plus a 1-layer HF DeepSeek-V3 model whose final norm is ``shared_head.norm``."""

    def __init__(self, student, eps: float) -> None:
        super().__init__()
        C = student.config.hidden_size
        self.student, self.eps = student, eps
        self.enorm = nn.Parameter(torch.ones(C))
        self.hnorm = nn.Parameter(torch.ones(C))
        s = float(student.model.embed_tokens.weight.detach().pow(2).mean().sqrt())
        eye = torch.eye(C) * s
        self.eh_proj = nn.Parameter(torch.cat((eye, eye), dim=1))  # x starts near s * (e + h), normalised parts
        for p in (student.model.embed_tokens.weight, student.lm_head.weight):
            p.requires_grad_(False)  # the target's: shared at run time
        self._carry: torch.Tensor | None = None
        student.model.norm.register_forward_hook(lambda m, inp, out: setattr(self, "_carry", inp[0]))

    def step(self, tok: torch.Tensor, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, carry) for tokens ``tok`` [B, L] and hidden states ``h`` [B, L, C] at ``pos``."""
        e = _rms(self.student.model.embed_tokens(tok), self.enorm, self.eps)
        x = torch.cat((e, _rms(h, self.hnorm, self.eps)), dim=-1) @ self.eh_proj.t()
        logits = self.student(inputs_embeds=x, position_ids=pos).logits
        return logits, self._carry


@torch.no_grad()
def target_hidden(target_dir: Path, ids: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """The target's final normalised hidden state at every position [N, L, C] (float32)."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = [model.model(input_ids=ids[i : i + batch]).last_hidden_state for i in range(0, ids.shape[0], batch)]
    return torch.cat(out)


def load_mtp(mod: MTPModule, path: Path, layer_index: int) -> None:
    """Start from a trained layer: ``path/mtp.safetensors`` as ``save_mtp`` writes it (a dense layer)."""
    from safetensors.torch import load_file

    pre = f"model.layers.{layer_index}."
    t = {k[len(pre):]: v.float() for k, v in load_file(str(Path(path) / MTP_FILENAME)).items() if k.startswith(pre)}
    with torch.no_grad():
        for name in ("enorm", "hnorm", "eh_proj"):
            getattr(mod, name).copy_(t.pop(name + ".weight"))
        mod.student.model.norm.weight.copy_(t.pop("shared_head.norm.weight"))
    missing, unexpected = mod.student.load_state_dict({"model.layers.0." + k: v for k, v in t.items()}, strict=False)
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    layer = [k for k in missing if k.startswith("model.layers.0.") and "rotary_emb" not in k]
    if unexpected or layer:
        raise RuntimeError(f"{path}: MTP tensors do not match the module (missing {layer}, unexpected {unexpected})")


def mtp_loss(mod: MTPModule, ids, H, tidx, tp, mask, depth2: float = 0.5, depth3: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, depth-1 top-1 agreement counts [hit, total]). Position p predicts token p + 2; depth
    d > 1 at position q reads depth d - 1's carry at q - 1 (the same targets)."""
    L = ids.shape[1]
    pos = torch.arange(L - 1)[None].expand(ids.shape[0], -1)
    tok, ti, p, m = ids[:, 1:], tidx[:, 1:], tp[:, 1:], mask[:, 1:]
    logits, carry = mod.step(tok, H[:, : L - 1], pos)

    def ce(lg, ti, p, m):
        logp = torch.log_softmax(lg.float(), dim=-1)
        return -((logp.gather(-1, ti) * p).sum(-1) * m).sum() / m.sum().clamp(min=1)

    loss = ce(logits, ti, p, m)
    hit = ((logits.argmax(-1) == ti[..., 0]).float() * m).sum().detach()
    if depth2 > 0 and L > 3:  # position q: token q + 1 and the depth-1 carry of position q - 1
        h2 = torch.cat((H[:, :1], carry[:, :-1]), dim=1)
        lg2, carry2 = mod.step(tok, h2, pos)
        m2 = m.clone()
        m2[:, 0] = 0
        loss = loss + depth2 * ce(lg2, ti, p, m2)
        if depth3 > 0 and L > 4:
            lg3, _ = mod.step(tok, torch.cat((H[:, :1], carry2[:, :-1]), dim=1), pos)
            m3 = m2.clone()
            m3[:, 1] = 0
            loss = loss + depth3 * ce(lg3, ti, p, m3)
    return loss, torch.stack((hit, m.sum()))


def train_loop(groups: list[dict], batch_loss, N: int, args, deadline: float, log, name: str) -> dict:
    """AdamW over ``groups`` (betas 0.9/0.95, gradient clip 1.0) on shuffled batches of
    ``args.batch_size`` of ``N`` rows until ``deadline`` or ``args.max_steps``; linear warm-up over 20
    steps, then a cosine decay to 10% over the time budget. ``batch_loss(rows)`` returns the loss of
    those rows. Shared by the draft model's distillation and the MTP's training."""
    params = [p for group in groups for p in group["params"]]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    start = time.time()
    budget = max(deadline - start, 1.0)
    step, recent, cur = 0, [], 0
    order = torch.randperm(N, generator=g)
    while time.time() < deadline and step < args.max_steps:
        if cur + args.batch_size > N:
            order, cur = torch.randperm(N, generator=g), 0
        b = order[cur : cur + args.batch_size]
        cur += args.batch_size
        progress = (time.time() - start) / budget
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = batch_loss(b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        recent = (recent + [loss.item()])[-20:]
        if step % 20 == 0 or step == 1:
            log(f"{name} step {step} loss {sum(recent) / len(recent):.4f} lr {lr:.2e}")
    return {"steps": step, "final_loss": round(sum(recent) / max(len(recent), 1), 4)}


def used_length(m: torch.Tensor, minimum: int) -> int:
    """Columns worth computing for a batch with mask ``m``: the last masked column + 2."""
    return int(m.sum(0).nonzero().max()) + 2 if m.sum() > 0 else minimum


def train_mtp(mod: MTPModule, ids, H, tidx, tp, mask, args, deadline: float, log) -> dict:
    params = [p for p in mod.parameters() if p.requires_grad]

    def batch_loss(b):
        m = mask[b]
        L = used_length(m, 3)
        return mtp_loss(mod, ids[b, :L], H[b, :L], tidx[b, :L], tp[b, :L], m[:, :L],
                        depth3=getattr(args, "depth3", 0.0))[0]

    mod.train()
    stats = train_loop([{"params": params, "weight_decay": 0.0}], batch_loss, ids.shape[0], args, deadline, log,
                       "mtp")
    mod.eval()
    return stats


@torch.no_grad()
def mtp_agreement(mod: MTPModule, ids, H, tidx, mask) -> float:
    """Depth-1 share of positions where the module's argmax is the target's top token."""
    tot = torch.zeros(2)
    for i in range(0, ids.shape[0], 16):
        tot += mtp_loss(mod, ids[i : i + 16], H[i : i + 16], tidx[i : i + 16], torch.zeros_like(tidx[i : i + 16],
                        dtype=torch.float32), mask[i : i + 16], depth2=0.0)[1]
    return float(tot[0] / tot[1].clamp(min=1))


def save_mtp(mod: MTPModule, layer_index: int, out: Path, to_state_dict) -> None:
    """``mtp.safetensors`` with ``model.layers.{layer_index}.*`` in the DeepSeek layout (bf16)."""
    out.mkdir(parents=True, exist_ok=True)
    pre = f"model.layers.{layer_index}."
    state = {}
    for name, t in to_state_dict(mod.student).items():
        if name.startswith("model.layers.0."):
            state[pre + name[len("model.layers.0."):]] = t
    state[pre + "shared_head.norm.weight"] = mod.student.model.norm.weight.detach().to(torch.bfloat16)
    for name in ("enorm", "hnorm", "eh_proj"):
        state[pre + name + ".weight"] = getattr(mod, name).detach().to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / MTP_FILENAME), metadata={"format": "pt"})
