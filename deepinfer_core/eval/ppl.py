"""``deepinfer eval ppl``: perplexity of held-out text and greedy continuations, against a baseline.

Perplexity goes through the engine's prompt logprobs (the path a user of ``prompt_logprobs`` gets):
each text is tokenized without BOS, cut into windows of ``window - 1`` tokens, and each window is
scored as ``[BOS] + window`` in one batch, so every text token is predicted exactly once.

The greedy continuations of a fixed prompt set are recorded with each step's margin (logprob of the
chosen token minus that of the runner-up). A continuation may depart from the baseline only at a step
whose recorded margin is below ``greedy_margin`` (a near-tie that rounding may flip); after that the
rest is not compared. ``greedy_margin = 0`` (the CPU float32 check) demands the whole continuation.

Tolerances (the reasoning):
* CPU float32, ``CPU_PPL_RTOL = 1e-4``. The reference ops are deterministic for a torch build; what
  may move the figure is summation order (another torch/BLAS build, thread count, kernel tiling),
  float32 rounding of ~6e-8 relative per operation. Measured on the embedded model: 1 vs 2 threads and
  the batch-invariant kernels (a different reduction order for every GEMM, norm and attention) give
  the same nll per token to 7 digits (3.3334901), i.e. < 3e-8 relative. 1e-4 is over 1000x that. A
  genuine kernel error is far larger: RMSNorm output off by 2^-7 (one bfloat16 step) moves it by
  2.6e-3 (26x the tolerance, tests/test_eval_ppl.py proves the check then fails). Greedy tokens
  must match exactly (``greedy_margin = 0``).
* bfloat16 on an accelerator, ``BF16_PPL_RTOL = 1e-2``. bf16 keeps 8 mantissa bits (2^-9 ~ 0.2%
  relative rounding per stored value and activation). Measured: the reference ops in bfloat16 on the
  CPU move the perplexity by +5.4e-4 against the float32 baseline. Accelerator kernels round and
  accumulate in other orders (fp32 accumulators, bf16 intermediates in other places), so allow about
  20x that; 1% still catches a kernel that is wrong rather than rounded. A greedy continuation may
  depart only where the baseline margin is below ``BF16_GREEDY_MARGIN`` (0.5 nats): a smaller gap
  can flip under bf16 rounding without anything being wrong.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
HELDOUT_DIR = DATA / "heldout" / "default_model"
BASELINE = HELDOUT_DIR / "baseline.json"
PROMPTS = HELDOUT_DIR / "greedy_prompts.json"
DEFAULT_WINDOW = 512
CONTINUATION_TOKENS = 24
CPU_PPL_RTOL = 1e-4
BF16_PPL_RTOL = 1e-2
BF16_GREEDY_MARGIN = 0.5


def load_texts(directory: Path = HELDOUT_DIR) -> list[tuple[str, str]]:
    """(name, text) of every ``*.txt`` file in ``directory``, sorted by name."""
    files = sorted(Path(directory).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt files in {directory}")
    return [(p.name, p.read_text(encoding="utf-8")) for p in files]


def perplexity(llm, texts: list[tuple[str, str]], window: int = DEFAULT_WINDOW) -> dict[str, Any]:
    """Total and per-text negative log-likelihood and perplexity through prompt logprobs."""
    from deepinfer_core import SamplingParams

    tok = llm.tokenizer
    if tok.bos_token_id is None:
        raise ValueError("perplexity windows start with BOS, but the tokenizer has none")
    max_len = getattr(llm.engine, "max_model_len", None)
    if window < 2 or (max_len is not None and window >= max_len):
        raise ValueError(f"window must be within [2, max_model_len={max_len}) tokens, got {window}")
    prompts, owner = [], []
    per_text: dict[str, dict[str, Any]] = {}
    for name, text in texts:
        ids = tok.tk.encode(text, add_special_tokens=False).ids
        if not ids:
            raise ValueError(f"held-out text {name!r} is empty")
        for s in range(0, len(ids), window - 1):
            prompts.append({"prompt_token_ids": [tok.bos_token_id, *ids[s:s + window - 1]]})
            owner.append(name)
        per_text[name] = {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "tokens": len(ids),
                          "nll": 0.0}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for name, prompt, out in zip(owner, prompts, outs):
        if out.error is not None:
            raise RuntimeError(f"scoring {name!r} failed: {out.error}")
        ids = prompt["prompt_token_ids"]
        lps = out.prompt_logprobs
        per_text[name]["nll"] -= sum(lps[i][ids[i]].logprob for i in range(1, len(ids)))
    total_nll = sum(v["nll"] for v in per_text.values())
    total_tokens = sum(v["tokens"] for v in per_text.values())
    for v in per_text.values():
        v["ppl"] = round(math.exp(v["nll"] / v["tokens"]), 6)
        v["nll"] = round(v["nll"], 4)
    return {"window": window, "tokens": total_tokens, "nll_per_token": round(total_nll / total_tokens, 7),
            "ppl": round(math.exp(total_nll / total_tokens), 6), "texts": per_text}


def greedy_continuations(llm, prompts: list[str], max_tokens: int = CONTINUATION_TOKENS) -> list[dict[str, Any]]:
    """Greedy token ids of each prompt, with each step's margin over the runner-up (nats)."""
    from deepinfer_core import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    results = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        comp = out.outputs[0]
        margins = []
        for tok, entry in zip(comp.token_ids, comp.logprobs or []):
            others = [lp.logprob for t, lp in entry.items() if t != tok]
            margins.append(round(entry[tok].logprob - max(others), 4) if others else None)
        results.append({"prompt": prompt, "token_ids": list(comp.token_ids), "text": comp.text, "margins": margins})
    return results


def measure(llm, texts_dir: Path = HELDOUT_DIR, prompts_file: Path = PROMPTS, window: int = DEFAULT_WINDOW,
            max_tokens: int = CONTINUATION_TOKENS) -> dict[str, Any]:
    import json

    import torch

    from deepinfer_core.engine.fingerprint import model_fingerprint

    prompts = json.loads(Path(prompts_file).read_text())
    engine = llm.engine
    result = perplexity(llm, load_texts(texts_dir), window)
    result["continuations"] = greedy_continuations(llm, prompts, max_tokens)
    # the weights' identity whatever dtype runs them (the engine's own fingerprint includes the dtype)
    result["model"] = model_fingerprint(engine.model_dir, torch.float32)
    result["dtype"] = str(getattr(engine, "dtype", "")).removeprefix("torch.")
    result["accelerator"] = engine.platform.name
    return result


def compare(baseline: dict[str, Any], result: dict[str, Any], rtol: float = CPU_PPL_RTOL,
            greedy_margin: float = 0.0) -> list[str]:
    """Every way ``result`` departs from ``baseline`` beyond the tolerances (empty: it passes)."""
    problems = []
    if baseline.get("model") != result.get("model"):
        problems.append(f"the baseline was recorded for model {baseline.get('model')}, this is {result.get('model')}")
    if baseline["window"] != result["window"]:
        problems.append(f"window {result['window']} != baseline {baseline['window']}")
    base_texts, texts = baseline["texts"], result["texts"]
    if set(base_texts) != set(texts):
        problems.append(f"texts {sorted(texts)} are not the baseline's {sorted(base_texts)}")
    else:
        changed = [n for n in texts if texts[n]["sha256"] != base_texts[n]["sha256"]]
        if changed:
            problems.append(f"texts changed since the baseline was recorded: {changed}")
    rel = abs(result["ppl"] - baseline["ppl"]) / baseline["ppl"]
    if rel > rtol:
        problems.append(f"perplexity {result['ppl']:.6f} vs baseline {baseline['ppl']:.6f}: relative change "
                        f"{rel:.2e} > tolerance {rtol:.1e}")
    base_cont = {c["prompt"]: c for c in baseline["continuations"]}
    for c in result["continuations"]:
        ref = base_cont.get(c["prompt"])
        if ref is None:
            problems.append(f"prompt {c['prompt']!r} has no baseline continuation")
            continue
        got, want = c["token_ids"], ref["token_ids"]
        if got == want:
            continue
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        margin = ref["margins"][at] if at < len(ref["margins"]) else None
        if margin is None or margin >= greedy_margin:
            problems.append(f"greedy continuation of {c['prompt']!r} departs from the baseline at token {at} "
                            f"(baseline margin {margin} nats, allowed below {greedy_margin}): got {c['text']!r}, "
                            f"baseline {ref['text']!r}")
    return problems
