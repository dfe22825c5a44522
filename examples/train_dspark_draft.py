#!/usr/bin/env python
"""Train the DSpark draft shipped for the embedded model (``deepinfer_core/assets/default_draft``).

A dev tool, like ``train_tiny.py`` (it uses ``transformers`` for training). Four phases, all on CPU
within ``--minutes`` (default 18):

1. **Target outputs.** The embedded target generates continuations of Python-source prompts
   (snippets of the standard library's training files, the split of ``train_tiny.py``), half greedy
   and half sampled at temperature 1, through DeepInfer itself, keeping the target's top-k
   distribution at every prompt and output position (``prompt_logprobs`` / ``logprobs``).
2. **Distillation.** A 1-layer DeepSeek-V3-architecture draft (hidden 256, the target's dense layer
   shape, vocabulary and tokenizer shared), initialised from the target's embedding, first layer,
   final norm and LM head, is trained on those sequences to match the target's distributions
   (cross-entropy against the renormalised top-k probabilities).
3. **Outcomes.** DeepInfer runs with ``features=["dspark"]`` and the new draft at fixed k=5 over
   other training prompts (greedy and sampled) and logs, for every verified draft position, the
   confidence head's features and whether the target accepted the draft token.
4. **Confidence head.** A logistic regression on those outcomes (``plugins.dspark.confidence``),
   checked for calibration on prompts from the held-out files.

Output (safetensors only, no pickle): ``config.json``, ``model.safetensors`` (bf16),
``confidence_head.safetensors``, the target's tokenizer files and ``training_report.json``.

    python examples/train_dspark_draft.py --out deepinfer_core/assets/default_draft --minutes 18

``--kind mtp`` trains an MTP module for the target instead (``dspark_mtp_train.py``: phase 2 is
teacher-forced on the target's hidden states, depths 1 and 2); output ``mtp.safetensors``, the
confidence head (on the MTP's normalised hidden state) and the report:

    python examples/train_dspark_draft.py --kind mtp --out deepinfer_core/assets/default_mtp --minutes 13
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import load_corpus, to_deepseek_state_dict, write_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine.fingerprint import model_fingerprint  # noqa: E402
from deepinfer_core.models.loader import EMBEDDED_MODEL, SafetensorsReader  # noqa: E402
from plugins.dspark.confidence import EXTRA_FEATURES, FILENAME, LEGACY_FEATURES, TARGET_FEATURES  # noqa: E402
from plugins.dspark.head_fit import (  # noqa: E402
    calibration,
    cut_trade,
    fit_head,
    fit_temperature,
    fold_temperature,
    log_loss,
    outcomes,
    predict,
)
from plugins.dspark.lookup import FEATURES as LOOKUP_FEATURES  # noqa: E402

TOPK = 16
MAX_DIR_BYTES = 10 * 1024 * 1024


def log(msg: str, t0: float) -> None:
    print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)


# ---- prompts ----------------------------------------------------------------------------------
def snippet_prompts(files: list[tuple[str, str]], n: int, tokenizer, rng: random.Random,
                    lengths: tuple[int, int]) -> list[list[int]]:
    """``n`` prompts: a random line of a random file onwards, cut to a random token length."""
    out = []
    while len(out) < n:
        _, text = files[rng.randrange(len(files))]
        lines = text.splitlines(keepends=True)
        if len(lines) < 8:
            continue
        start = rng.randrange(max(1, len(lines) - 8))
        ids = tokenizer.encode("".join(lines[start : start + 60]))
        want = rng.randint(*lengths)
        if len(ids) < want:
            continue
        out.append(ids[:want])
    return out


def params_for(i: int, gen_tokens: int, **kw) -> SamplingParams:
    """Even requests greedy, odd ones sampled at temperature 1; seeded."""
    return SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=gen_tokens, seq_seed=1000 + i, **kw)


# ---- phase 1: target outputs with soft labels ----------------------------------------------------
def soft_labels(entry: dict | None) -> tuple[list[int], list[float]]:
    if not entry:
        return [], []
    items = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))[: TOPK + 1]
    return [t for t, _ in items], [math.exp(lp.logprob) for _, lp in items]


def collect_targets(llm: LLM, prompts: list[list[int]], gen_tokens: int, chunk: int, t0: float,
                    deadline: float) -> list[tuple[list[int], list[list[int]], list[list[float]]]]:
    data = []
    for c in range(0, len(prompts), chunk):
        if time.time() > deadline:
            log(f"generation budget reached after {len(data)} sequences", t0)
            break
        part = prompts[c : c + chunk]
        params = [params_for(c + i, gen_tokens, logprobs=TOPK, prompt_logprobs=TOPK) for i in range(len(part))]
        outs = llm.generate([{"prompt_token_ids": p} for p in part], params, use_tqdm=False)
        for o in outs:
            ids = o.prompt_token_ids + o.outputs[0].token_ids
            entries = list(o.prompt_logprobs or [None]) + list(o.outputs[0].logprobs or [])
            # entries[i] is the target's distribution over token i given tokens < i
            idx, prob = [], []
            for i in range(1, len(ids)):
                t, p = soft_labels(entries[i] if i < len(entries) else None)
                idx.append(t)
                prob.append(p)
            data.append((ids, idx, prob))
        log(f"target outputs: {len(data)}/{len(prompts)} sequences", t0)
    return data


def to_tensors(data, max_len: int):
    N = len(data)
    ids = torch.zeros(N, max_len, dtype=torch.long)
    tidx = torch.zeros(N, max_len, TOPK + 1, dtype=torch.long)
    tp = torch.zeros(N, max_len, TOPK + 1)
    mask = torch.zeros(N, max_len)
    for n, (seq, idx, prob) in enumerate(data):
        L = min(len(seq), max_len)
        ids[n, :L] = torch.tensor(seq[:L])
        for i in range(L - 1):
            k = len(idx[i])
            if k == 0:
                continue
            p = torch.tensor(prob[i])
            tidx[n, i, :k] = torch.tensor(idx[i])
            tp[n, i, :k] = p / p.sum()
            mask[n, i] = 1.0
    return ids, tidx, tp, mask


# ---- phase 2: distillation ------------------------------------------------------------------------
def build_student(target_dir: Path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config.from_pretrained(target_dir)
    cfg.num_hidden_layers = 1
    cfg.num_nextn_predict_layers = 0
    if getattr(cfg, "mlp_layer_types", None) is not None:
        cfg.mlp_layer_types = cfg.mlp_layer_types[:1]
    student = DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="sdpa").float()
    reader = SafetensorsReader(target_dir)  # single file or sharded
    sd = student.state_dict()
    init = {}
    for k in sd:
        if k in reader.names():
            t = reader.get(k)
            if t.shape == sd[k].shape:
                init[k] = t.float()
    missing = sorted(set(sd) - set(init) - {k for k in sd if "rotary_emb" in k})
    if missing:
        raise RuntimeError(f"student tensors without a target counterpart: {missing}")
    student.load_state_dict(init, strict=False)
    return cfg, student


def distill(student, ids, tidx, tp, mask, args, t0: float, deadline: float) -> dict:
    from dspark_mtp_train import train_loop, used_length

    decay = [p for n, p in student.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    other = [p for n, p in student.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]

    def batch_loss(b):
        m = mask[b]
        L = used_length(m, 2)
        m, ti, p = m[:, :L], tidx[b, :L], tp[b, :L]
        logp = torch.log_softmax(student(input_ids=ids[b, :L]).logits.float(), dim=-1)
        return -((logp.gather(-1, ti) * p).sum(-1) * m).sum() / m.sum().clamp(min=1)

    student.train()
    stats = train_loop([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                       batch_loss, ids.shape[0], args, deadline, lambda msg: log(msg, t0), "distill")
    student.eval()
    return stats


@torch.no_grad()
def agreement(student, ids, tidx, mask) -> float:
    """Share of positions where the student's argmax is the target's top token."""
    hit = tot = 0.0
    for i in range(0, ids.shape[0], 16):
        x, m = ids[i : i + 16], mask[i : i + 16]
        pred = student(input_ids=x).logits.argmax(-1)
        hit += ((pred == tidx[i : i + 16, :, 0]).float() * m).sum().item()
        tot += m.sum().item()
    return hit / max(tot, 1)


def save_draft(cfg, student, target_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = to_deepseek_state_dict(student)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_config(cfg, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_dir / name, out / name)


def train_mtp_kind(args, cfg, student, target_dir: Path, ids, tidx, tp, mask, n_eval: int, t0: float):
    """Phase 2 for ``--kind mtp``: (temporary dir holding ``mtp.safetensors``, report entries)."""
    from dspark_mtp_train import MTPModule, load_mtp, mtp_agreement, save_mtp, target_hidden, train_mtp

    H = target_hidden(target_dir, ids)
    log(f"target hidden states {tuple(H.shape)}", t0)
    mod = MTPModule(student, cfg.rms_norm_eps)
    n_layers = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]  # the target's
    if args.init_mtp is not None:
        load_mtp(mod, args.init_mtp, n_layers)
        log(f"MTP initialised from {args.init_mtp}", t0)
    agree0 = mtp_agreement(mod, ids[:n_eval], H[:n_eval], tidx[:n_eval], mask[:n_eval])
    stats = train_mtp(mod, ids[n_eval:], H[n_eval:], tidx[n_eval:], tp[n_eval:], mask[n_eval:], args,
                      t0 + args.minutes * 60 * 0.72, lambda m: log(m, t0))
    agree1 = mtp_agreement(mod, ids[:n_eval], H[:n_eval], tidx[:n_eval], mask[:n_eval])
    log(f"MTP depth-1 top-1 agreement on {n_eval} unseen sequences: {agree0:.3f} (init) -> {agree1:.3f}", t0)
    tmp = Path(tempfile.mkdtemp(prefix="dspark_mtp_"))
    save_mtp(mod, n_layers, tmp, to_deepseek_state_dict)
    trainable = sum(p.numel() for p in mod.parameters() if p.requires_grad)
    return tmp, {"kind": "mtp", "draft_parameters": trainable, "distillation": stats,
                 "top1_agreement_init": round(agree0, 4), "top1_agreement": round(agree1, 4),
                 "top1_agreement_note": "depth 1: the MTP predicts token p + 2 from h_p and token p + 1"}


# ---- phases 3 and 4: outcomes and the confidence head ----------------------------------------------
def log_outcomes(draft_dir: Path, prompts: list[list[int]], gen_tokens: int, max_num_seqs: int) -> list:
    llm = LLM(features=["dspark"], dspark={"draft": str(draft_dir), "k": 5, "budget_policy": "fixed"},
              max_num_seqs=max_num_seqs)
    feature = next(f for f in llm.engine.features if f.name == "dspark")
    feature.outcome_log = []
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [params_for(i, gen_tokens) for i in range(len(prompts))], use_tqdm=False)
    records = feature.outcome_log
    llm.engine.blocks.check_no_leaks()
    return records


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="default deepinfer_core/assets/default_draft (--kind model) or default_mtp (--kind mtp)")
    p.add_argument("--kind", choices=("model", "mtp"), default="model",
                   help="a separate draft model, or an MTP module fed the target's hidden states")
    p.add_argument("--minutes", type=float, default=18.0, help="wall-clock budget of the whole run")
    p.add_argument("--num-prompts", type=int, default=1536, help="prompts for the distillation data")
    p.add_argument("--gen-tokens", type=int, default=96)
    p.add_argument("--outcome-prompts", type=int, default=384, help="prompts for the confidence head")
    p.add_argument("--heldout-prompts", type=int, default=128, help="held-out prompts for calibration")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads while training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-mtp", type=Path, default=None,
                   help="--kind mtp: start from this MTP dir's mtp.safetensors (fine-tune) instead of layer 0")
    p.add_argument("--depth3", type=float, default=0.0, help="--kind mtp: weight of the depth-3 loss term")
    p.add_argument("--target-features", action="store_true",
                   help="--kind mtp: the head also reads the target's features (costs its LM head over a row per step)")
    p.add_argument("--no-lookup-features", action="store_true",
                   help="the head does not read the lookup features (plugins.dspark.lookup)")
    p.add_argument("--six-draft-scalars", action="store_true",
                   help="the head reads the six basic scalars of the draft's distribution (LEGACY_FEATURES), not "
                        "the 19 of EXTRA_FEATURES: about 50 us less per draft step on a CPU, for 0.005 of log-loss")
    p.add_argument("--head-only", action="store_true",
                   help="keep the draft already in --out and fit its confidence head again (phases 3-4)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.out is None:
        args.out = Path("deepinfer_core/assets") / ("default_mtp" if args.kind == "mtp" else "default_draft")
    t0 = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target_dir = EMBEDDED_MODEL
    corpus = load_corpus()
    log(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files", t0)

    torch.set_num_threads(1)  # the engine's small ops: one thread is fastest on a shared machine
    llm = LLM(max_num_seqs=args.max_num_seqs)
    tok = llm.tokenizer
    prompts = snippet_prompts(corpus.train, args.num_prompts, tok, rng, (48, 128))
    outcome_prompts = snippet_prompts(corpus.train, args.outcome_prompts, tok, rng, (48, 128))
    heldout_prompts = snippet_prompts(corpus.heldout, args.heldout_prompts, tok, rng, (48, 128))
    target_fingerprint = model_fingerprint(target_dir, torch.float32)
    out = args.out
    report: dict = {}
    if args.head_only:
        # keep the draft in --out, refit its confidence head only
        llm.shutdown()
        del llm
        report = json.loads((out / "training_report.json").read_text()) if (out / "training_report.json").is_file() \
            else {}
        if report.get("target_fingerprint") not in (None, target_fingerprint):
            raise RuntimeError(f"the draft in {out} was trained for another target; train it again")
        tmp = Path(tempfile.mkdtemp(prefix="dspark_draft_"))
        for f in out.iterdir():
            if f.is_file():
                shutil.copy(f, tmp / f.name)
    else:
        gen_deadline = t0 + args.minutes * 60 * 0.3
        data = collect_targets(llm, prompts, args.gen_tokens, args.max_num_seqs, t0, gen_deadline)
        llm.shutdown()
        del llm
        ids, tidx, tp, mask = to_tensors(data, max_len=128 + args.gen_tokens + 1)
        n_eval = max(len(data) // 10, 8)
        log(f"distillation data: {len(data)} sequences, {int(mask.sum())} labelled positions", t0)

        torch.set_num_threads(args.threads)
        cfg, student = build_student(target_dir)
        if args.kind == "mtp":
            tmp, stats = train_mtp_kind(args, cfg, student, target_dir, ids, tidx, tp, mask, n_eval, t0)
            report.update(stats, distillation_sequences=len(data), distillation_positions=int(mask.sum()),
                          draft_command=shlex.join(["python", *sys.argv]), draft_seconds=round(time.time() - t0, 1))
        else:
            tmp = None
    if tmp is None:
        agree0 = agreement(student, ids[:n_eval], tidx[:n_eval], mask[:n_eval])
        train_deadline = t0 + args.minutes * 60 * 0.72
        stats = distill(student, ids[n_eval:], tidx[n_eval:], tp[n_eval:], mask[n_eval:], args, t0, train_deadline)
        agree1 = agreement(student, ids[:n_eval], tidx[:n_eval], mask[:n_eval])
        log(f"top-1 agreement with the target on {n_eval} unseen sequences: {agree0:.3f} (init) -> {agree1:.3f}", t0)
        tmp = Path(tempfile.mkdtemp(prefix="dspark_draft_"))
        save_draft(cfg, student, target_dir, tmp)
        report.update({
            "draft_command": shlex.join(["python", *sys.argv]),
            "draft_parameters": sum(p.numel() for p in student.parameters()),
            "distillation_sequences": len(data),
            "distillation_positions": int(mask.sum()),
            "distillation": stats,
            "top1_agreement_init": round(agree0, 4),
            "top1_agreement": round(agree1, 4),
            "draft_seconds": round(time.time() - t0, 1),
        })

    # the confidence head: fitted on 3/4 of the outcome prompts, its temperature on the other 1/4
    t_head = time.time()
    torch.set_num_threads(1)
    n_fit = len(outcome_prompts) * 3 // 4
    fit_o = outcomes(log_outcomes(tmp, outcome_prompts[:n_fit], 96, args.max_num_seqs))
    use_target = args.target_features and fit_o.target is not None  # an MTP draft logs the target's features
    use_lookup = not args.no_lookup_features
    names = LEGACY_FEATURES if args.six_draft_scalars else EXTRA_FEATURES
    log(f"outcomes: {int(fit_o.decided.sum())} decided draft positions, accept rate "
        f"{float(fit_o.y[fit_o.decided].mean()):.3f}, target features {use_target}, lookup features {use_lookup}", t0)
    g = torch.Generator().manual_seed(args.seed)
    steps = int(fit_o.step.max()) + 1
    val = torch.isin(fit_o.step, torch.randperm(steps, generator=g)[: steps // 5])  # by verification step
    scores = {}
    for l2 in (1e-4, 1e-3, 1e-2, 1e-1):
        scores[l2] = log_loss(fit_head(fit_o.subset(~val), l2, use_target, use_lookup, names), fit_o.subset(val))
    l2 = min(scores, key=scores.get)
    log(f"confidence head L2 {l2} (validation log-loss {scores})", t0)
    head = fit_head(fit_o, l2, use_target, use_lookup, names)
    temp_o = outcomes(log_outcomes(tmp, outcome_prompts[n_fit:], 96, args.max_num_seqs))
    temp = fit_temperature(head, temp_o)
    head = fold_temperature(head, temp)
    log(f"calibration temperature {temp:.2f} (fitted on {int(temp_o.decided.sum())} positions of other prompts)", t0)
    head.save(tmp / FILENAME, hidden_size=str(fit_o.hidden.shape[1]), fitted_temperature=str(temp))
    train_cal = calibration(head, fit_o)
    held_o = outcomes(log_outcomes(tmp, heldout_prompts, 64, args.max_num_seqs))
    held_cal = calibration(head, held_o)
    greedy = held_o.raw[:, 2] > 0.5
    replay = {"greedy": cut_trade(predict(head, held_o.subset(greedy)), held_o.subset(greedy)),
              "all": cut_trade(predict(head, held_o), held_o)}
    log(f"held-out calibration: max decile gap {held_cal['max_decile_gap']}, ECE {held_cal['ece']}; cut at -25% "
        f"verified drafts: accepted -{replay['greedy']['accepted_drop'] * 100:.2f}% (greedy), "
        f"-{replay['all']['accepted_drop'] * 100:.2f}% (all)", t0)

    out.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        shutil.copy(f, out / f.name)
    shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "training_report.json")
    report.update({
        "command": shlex.join(["python", *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "target": str(target_dir),
        "target_fingerprint": target_fingerprint,
        "confidence_head_features": ["hidden", *names, *(TARGET_FEATURES if use_target else ()),
                                     *(LOOKUP_FEATURES if use_lookup else ())],
        "confidence_head_l2": l2,
        "confidence_head_validation_logloss": scores,
        "confidence_head_temperature": temp,
        "calibration_train": train_cal,
        "calibration_heldout": held_cal,
        "cut_replay_heldout": replay,
        "head_seconds": round(time.time() - t_head, 1),
        "wall_seconds": round(time.time() - t0, 1),
        "files": {p.name: p.stat().st_size for p in files},
    })
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(f"wrote {out} ({total / 1e6:.2f} MB)", t0)
    if total > MAX_DIR_BYTES:
        raise RuntimeError(f"draft dir is {total} bytes > {MAX_DIR_BYTES}")


if __name__ == "__main__":
    main()
