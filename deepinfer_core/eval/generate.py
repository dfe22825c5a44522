"""``deepinfer eval generate``: k samples per dataset item, written to a generations JSONL.

Each output line is one item with all of its samples, written atomically (one write, flush, fsync),
so a killed run leaves whole items plus at most one torn last line, which a rerun cuts off.

Determinism and resuming. Sample j of item ``id`` draws with ``seq_seed = sample_seed(seed, id, j)``:
the seed depends on the item and sample only, not on the order or batch. Items run in chunks of
``chunk_items`` consecutive dataset items, every sample of a chunk in one engine batch. A rerun skips
chunks whose items are all written and re-runs a partly written chunk whole (writing only its
missing items), so every item is computed in exactly the batch it would have had without the kill
and the file equals an uninterrupted run's, timing fields aside. The run's settings are stored in
every record; resuming with different ones is an error naming them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer_core.eval.chat import Prompter
from deepinfer_core.eval.datasets import EvalItem, load_dataset
from deepinfer_core.eval.jsonl import append_record, open_for_append

logger = logging.getLogger("deepinfer.eval")

#: ``run`` fields that must match to resume a generations file (they decide the outputs); the static
#: ones are known without starting the engine
STATIC_KEYS = ("adapter", "k", "seed", "chunk_items", "sampling")
RESUME_KEYS = ("adapter", "k", "seed", "chunk_items", "sampling", "model_fingerprint", "dtype", "accelerator",
               "batch_invariant", "features")


@dataclass
class GenerateSettings:
    k: int = 1
    seed: int = 0
    chunk_items: int = 16
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields (seq_seed is per sample)

    def validate(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k (samples per item) must be a positive int, got {self.k!r}")
        if not isinstance(self.chunk_items, int) or self.chunk_items < 1:
            raise ValueError(f"chunk_items must be a positive int, got {self.chunk_items!r}")
        if "seq_seed" in self.sampling:
            raise ValueError("sampling must not set seq_seed: each sample's seed derives from --seed, the item id "
                             "and the sample index")


def sample_seed(seed: int, item_id: str, index: int) -> int:
    """The 63-bit sampling seed of sample ``index`` of item ``item_id``."""
    digest = hashlib.sha256(f"{seed}\x00{item_id}\x00{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def run_generate(dataset: Path, out: Path, settings: GenerateSettings, adapter: str = "generic",
                 llm_kwargs: dict[str, Any] | None = None, skip_images: bool = False, limit: int | None = None,
                 llm=None) -> dict[str, Any]:
    """Generate for every item of ``dataset`` not yet in ``out``. Returns counts and timing."""
    from deepinfer_core import LLM, SamplingParams

    settings.validate()
    items, skipped = load_dataset(dataset, adapter, skip_images=skip_images, limit=limit)
    base = SamplingParams.from_dict(dict(settings.sampling))  # bad fields fail before the engine starts
    f, existing, torn = open_for_append(out, "generation record")
    try:
        if torn:
            logger.warning("%s: cut off a torn last line (%d bytes) left by an interrupted run", out, torn)
        if existing:  # the settings that need no engine: checked before deciding there is nothing to do
            _check_resume(out, existing[0].get("run", {}), _static_run(adapter, settings, base), STATIC_KEYS)
        done = _check_existing(out, existing, items)
        todo_chunks = [chunk for chunk in _chunks(items, settings.chunk_items)
                       if any(it.id not in done for it in chunk)]
        stats = {"items": len(items), "already_done": len(done), "written": 0, "samples": 0, "output_tokens": 0,
                 "skipped": skipped, "torn_bytes_dropped": torn, "wall_s": 0.0}
        if not todo_chunks:
            return stats
        own_llm = llm is None
        if own_llm:
            llm = LLM(**(llm_kwargs or {}))
        try:
            engine = llm.engine
            base.validate(engine.model_config.vocab_size)
            run = _run_info(llm, adapter, settings, base)
            if existing:
                _check_resume(out, existing[0].get("run", {}), run, RESUME_KEYS)
            prompter = Prompter(llm)
            if prompter.error and any(it.messages is not None for it in items):
                raise ValueError(prompter.error)
            t_start = time.perf_counter()
            for n, chunk in enumerate(todo_chunks, start=1):
                t0 = time.perf_counter()
                texts, formats, params, outs = _run_chunk(llm, prompter, chunk, base, settings)
                wall = time.perf_counter() - t0
                for i, it in enumerate(chunk):
                    if it.id in done:  # written before an interruption; the chunk ran whole for its batch
                        continue
                    group = slice(i * settings.k, (i + 1) * settings.k)
                    append_record(f, _record(it, texts[i], formats[i], outs[group], params[group], run, wall,
                                             dataset))
                    done.add(it.id)
                    stats["written"] += 1
                    stats["samples"] += settings.k
                ntok = sum(len(o.outputs[0].token_ids) for o in outs)
                stats["output_tokens"] += ntok
                print(f"chunk {n}/{len(todo_chunks)}: {len(chunk)} items x {settings.k} samples, {ntok} tokens "
                      f"in {wall:.1f} s", file=sys.stderr, flush=True)
            stats["wall_s"] = round(time.perf_counter() - t_start, 3)
        finally:
            if own_llm:
                llm.shutdown()
        return stats
    finally:
        f.close()


def _run_chunk(llm, prompter: Prompter, chunk: list[EvalItem], base, settings: GenerateSettings):
    """Every sample of ``chunk`` in one ``generate`` call: (prompt texts, prompt formats, params, outputs)."""
    prompts, params, texts, formats = [], [], [], []
    for it in chunk:
        prompt, text, fmt = prompter(it.prompt, it.messages)
        texts.append(text)
        formats.append(fmt)
        for j in range(settings.k):
            prompts.append(prompt)
            params.append(dataclasses.replace(base, seq_seed=sample_seed(settings.seed, it.id, j)))
    return texts, formats, params, llm.generate(prompts, params, use_tqdm=False)


def _chunks(items: list[EvalItem], size: int) -> list[list[EvalItem]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _check_existing(out: Path, existing: list[dict], items: list[EvalItem]) -> set[str]:
    done: set[str] = set()
    for i, rec in enumerate(existing, start=1):
        item_id = rec.get("id")
        if item_id in done:
            raise ValueError(f"{out}: item {item_id!r} appears twice (record {i}); the file was not written by "
                             "one resumable run")
        done.add(item_id)
    unknown = done - {it.id for it in items}
    if unknown:
        logger.warning("%s has %d item(s) not in the dataset (kept as they are): %s", out, len(unknown),
                       sorted(unknown)[:5])
    return done


def _check_resume(out: Path, old: dict, new: dict, keys: tuple[str, ...]) -> None:
    diff = [k for k in keys if old.get(k) != new.get(k)]
    if diff:
        detail = "; ".join(f"{k}: file {old.get(k)!r}, now {new.get(k)!r}" for k in diff)
        raise ValueError(f"{out} was written with different settings ({detail}); resume with the same settings "
                         "or write to a new --out file")


def _static_run(adapter: str, settings: GenerateSettings, base) -> dict[str, Any]:
    sampling = dataclasses.asdict(base)
    sampling.pop("seq_seed")
    return {"adapter": adapter, "k": settings.k, "seed": settings.seed, "chunk_items": settings.chunk_items,
            "sampling": sampling}


def _run_info(llm, adapter: str, settings: GenerateSettings, base) -> dict[str, Any]:
    import torch

    engine, cfg = llm.engine, llm.config
    return {
        **_static_run(adapter, settings, base),
        "model": str(engine.model_dir),
        "model_fingerprint": getattr(engine, "fingerprint", None),
        "dtype": str(getattr(engine, "dtype", cfg.dtype)).removeprefix("torch."),
        "accelerator": engine.platform.name,
        "batch_invariant": cfg.batch_invariant,
        "features": list(cfg.features),
        "torch_threads": torch.get_num_threads(),  # summation order on the CPU: bitwise results depend on it
        "engine_config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "feature_config"},
        "feature_config": cfg.feature_config,
    }


def _record(it: EvalItem, prompt: str, fmt: str, group, params, run: dict, wall: float,
            dataset: Path) -> dict[str, Any]:
    """One item's line: the item, its prompt, every sample (text, seed, tokens, timing) and the run."""
    samples = []
    for j, (out, p) in enumerate(zip(group, params)):
        comp, m = out.outputs[0], out.metrics
        e2e = None if m.finished_time is None else m.finished_time - m.arrival_time
        samples.append({
            "index": j, "seed": p.seq_seed, "text": comp.text,
            "num_tokens": len(comp.token_ids), "finish_reason": comp.finish_reason,
            "stop_reason": comp.stop_reason, "error": None if out.error is None else str(out.error),
            "cached_prompt_tokens": m.num_cached_tokens, "decode_ppl": m.decode_ppl,
            "timing": {"ttft_s": _r(m.time_to_first_token), "decode_s": _r(m.decode_time), "e2e_s": _r(e2e)},
        })
    return {
        "id": it.id, "dataset": Path(dataset).name, "answer": it.answer, "answer_type": it.answer_type,
        "question": it.question, "choices": it.choices, "category": it.category, "difficulty": it.difficulty,
        "meta": it.meta, "prompt": prompt, "prompt_format": fmt,
        "prompt_tokens": len(group[0].prompt_token_ids), "samples": samples, "run": run,
        "timing": {"chunk_wall_s": round(wall, 4), "written_unix": round(time.time(), 3)},
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
