#!/usr/bin/env python
"""Speculative decoding with async scheduling, step by step: for plain decoding (async on), speculative
steps run synchronously, and speculative steps overlapped (drafts proposed on the device), the
decode tokens/s, the wall and host milliseconds per step, the device idle share between steps
(``measure_device_idle``) and the ``draft_lengths`` op's device time per speculative step.

    python examples/spec_async_figures.py                                    # embedded model, ngram
    python examples/spec_async_figures.py --proposer dspark                  # DSpark (its MTP draft)
    python examples/spec_async_figures.py --shape v2-lite --proposer dspark  # random V2-Lite + a random MTP

Host ms/step is the step's wall time less the time the host waited for the device (the copy of a
step's results, ``HostCopy.wait``); on a CPU the model's forward runs inline, so it is left out too
(``runner.forward``), and what remains is the engine's own work: scheduling, preparing inputs, the
speculative bookkeeping, post-processing. ``--shape v2-lite`` builds DeepSeek-V2-Lite's shape with
random weights (``examples/random_checkpoint.py``) and, for DSpark, a random MTP layer beside it
(acceptance is then near zero, so it runs the fixed policy: every step drafts and verifies k per
request; the figures are about the step's overheads, not its speed-up).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_bench import heldout_prompts  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine import transfer  # noqa: E402

SOURCES = ("/deepinfer_core/", "/plugins/", "/kernels_")  # this repository's frames, for the sync sites


class Timers:
    """Wraps an engine's forward, the host copy's wait and the ``draft_lengths`` op with timers."""

    def __init__(self, llm: LLM, cpu: bool) -> None:
        eng = self.eng = llm.engine
        self.cpu, self.forward_s, self.wait_s, self.events = cpu, 0.0, 0.0, []
        self.forward_cpu_s = 0.0  # the forward's thread CPU time (a CPU device computes it inline)
        self.on = False
        forward, wait = eng.runner.forward, transfer.HostCopy.wait

        def timed_forward(batch):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return forward(batch)
            finally:
                if self.on and self.cpu:
                    self.forward_s += time.perf_counter() - t
                    self.forward_cpu_s += time.thread_time() - c

        def timed_wait(copy):
            t = time.perf_counter()
            try:
                return wait(copy)
            finally:
                if self.on:
                    self.wait_s += time.perf_counter() - t

        eng.runner.forward = timed_forward
        self._wait, self._forward = wait, forward
        transfer.HostCopy.wait = timed_wait
        op = self._op = eng.kernels.draft_lengths

        def timed_draft_lengths(*args, **kw):
            a = eng.platform.event(enable_timing=True)
            a.record()
            out = op(*args, **kw)
            b = eng.platform.event(enable_timing=True)
            b.record()
            if self.on:
                self.events.append((a, b))
            return out

        eng.kernels.override("draft_lengths", timed_draft_lengths)

    def restore(self) -> None:
        transfer.HostCopy.wait = self._wait
        self.eng.runner.forward = self._forward
        self.eng.kernels.override("draft_lengths", self._op)

    def draft_lengths_ms(self) -> float:
        self.eng.platform.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.events)


def build(args, mode: str, model: str | None, draft: str | None) -> LLM:
    seqs = max(int(c) for c in str(args.concurrency).split(","))
    common = dict(max_num_seqs=seqs, enable_prefix_caching=False, measure_device_idle=True,
                  async_scheduling=mode != "spec_sync")
    if model is not None:  # a 16B random model: a bounded KV cache and context, so engines come and go
        common.update(model=model, load_format="random", dtype=args.dtype, max_model_len=1024,
                      kv_cache_memory=args.kv_memory)
    if mode == "plain":
        return LLM(**common)
    if args.proposer == "dspark":
        section = {"k": args.k}
        if draft is not None:  # a random draft: drafts rarely pay, so every step drafts k (the machinery's cost)
            section.update(draft=draft, budget_policy="fixed")
        if args.policy:
            section["budget_policy"] = args.policy
        return LLM(features=["dspark"], dspark=section, **common)
    return LLM(speculative={"proposer": args.proposer, "k": args.k}, **common)


def random_v2lite(tmp: Path, with_mtp: bool, dtype: str, scale: str) -> tuple[str, str | None]:
    """A DeepSeek-V2-Lite config (random weights at load; ``scale`` "tiny": the suite's CPU-sized
    variant) and, for DSpark, a random MTP layer dir."""
    from h200_suite import suite_config
    from random_checkpoint import write_config

    cfg = suite_config("v2-lite", scale, None)
    model = write_config(tmp / "v2-lite", cfg)
    if not with_mtp:
        return str(model), None
    from safetensors.torch import save_file

    N, C = cfg["num_hidden_layers"], cfg["hidden_size"]
    H, nope, rope, v, kv = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                            cfg["v_head_dim"], cfg["kv_lora_rank"])
    g = torch.Generator().manual_seed(0)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dt)

    p = f"model.layers.{N}."
    inter = cfg["intermediate_size"]
    t = {p + "enorm.weight": torch.ones(C, dtype=dt), p + "hnorm.weight": torch.ones(C, dtype=dt),
         p + "eh_proj.weight": w(C, 2 * C), p + "shared_head.norm.weight": torch.ones(C, dtype=dt),
         p + "input_layernorm.weight": torch.ones(C, dtype=dt),
         p + "post_attention_layernorm.weight": torch.ones(C, dtype=dt),
         p + "self_attn.q_proj.weight": w(H * (nope + rope), C),
         p + "self_attn.kv_a_proj_with_mqa.weight": w(kv + rope, C),
         p + "self_attn.kv_a_layernorm.weight": torch.ones(kv, dtype=dt),
         p + "self_attn.kv_b_proj.weight": w(H * (nope + v), kv),
         p + "self_attn.o_proj.weight": w(C, H * v),
         p + "mlp.gate_proj.weight": w(inter, C), p + "mlp.up_proj.weight": w(inter, C),
         p + "mlp.down_proj.weight": w(C, inter)}
    mtp = tmp / "v2-lite-mtp"
    mtp.mkdir(parents=True, exist_ok=True)
    save_file(t, str(mtp / "mtp.safetensors"))
    return str(model), str(mtp)


def measure(llm: LLM, prompts, params: SamplingParams, cpu: bool, count_syncs: bool = False) -> dict:
    eng = llm.engine
    timers = Timers(llm, cpu)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (kernels compiled, graphs captured, curves measured)
    over0 = eng.stats.overlapped_steps
    eng.platform.synchronize()
    eng._idle.reset()  # idle share of the measured run only
    for key in eng.spec.n if eng.spec is not None else ():
        eng.spec.n[key] = 0
    steps0, step_s0 = eng.stats.steps, eng.stats.step_time
    timers.on = True
    syncs, where = None, collections.Counter()

    def note(message, category, filename, lineno, file=None, line=None):  # where each sync was made
        frames = [f for f in traceback.extract_stack()[:-1] if any(d in f.filename for d in SOURCES)]
        where[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:][::-1])] += 1

    with warnings.catch_warnings():
        if count_syncs:  # every call that makes the host wait for the GPU warns (CUDA only)
            warnings.simplefilter("always")
            warnings.showwarning = note
            torch.cuda.set_sync_debug_mode("warn")
        t, c0 = time.perf_counter(), time.thread_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        host_cpu = time.thread_time() - c0
        if count_syncs:
            torch.cuda.set_sync_debug_mode(0)
            syncs = sum(where.values())
    eng.platform.synchronize()
    wall = time.perf_counter() - t
    timers.on = False
    timers.restore()
    steps = eng.stats.steps - steps0
    step_s = eng.stats.step_time - step_s0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    m = llm.metrics()
    spec_steps = m.get("spec_steps", 0)
    dl_ms = timers.draft_lengths_ms()
    return {
        "steps": steps, "tokens": tokens, "host_syncs": syncs, "sync_sites": dict(where.most_common(4)),
        "tok_s": round(tokens / wall, 1),
        "wall_ms_per_step": round(1000 * step_s / max(steps, 1), 3),
        "host_ms_per_step": round(1000 * (step_s - timers.wait_s - timers.forward_s) / max(steps, 1), 3),
        # the same in this thread's CPU time (steadier on a shared machine; torch's own threads excluded)
        "host_cpu_ms_per_step": round(1000 * (host_cpu - timers.forward_cpu_s) / max(steps, 1), 3),
        "device_idle_share": round(m.get("device_idle_share", 0.0), 4),
        "device_idle_us_mean": round(m.get("device_idle_us_mean", 0.0), 1),
        "overlapped_steps": m["overlapped_steps"] - over0, "spec_steps": spec_steps,
        "accepted_per_spec_step": round(m.get("spec_accepted", 0) / max(spec_steps, 1), 3),
        "verified_per_spec_step": round(m.get("spec_verified", 0) / max(spec_steps, 1), 3),
        "draft_lengths_calls": len(timers.events),
        "draft_lengths_us_per_call": round(1000 * dl_ms / max(len(timers.events), 1), 2),
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def profile(llm: LLM, prompts, params: SamplingParams) -> None:
    """Host seconds by function over one more run (cProfile; the functions of this repository)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    llm.engine.platform.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(r"(deepinfer_core|plugins|kernels_)", 30)
    print(out.getvalue(), flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proposer", default="ngram", help="a deepinfer.proposers name, or 'dspark' (the feature)")
    ap.add_argument("--policy", default=None, help="DSpark's budget_policy (default: its own; 'fixed' for v2-lite)")
    ap.add_argument("--shape", default="embedded", choices=("embedded", "v2-lite"))
    ap.add_argument("--scale", default="full", choices=("full", "tiny"), help="--shape v2-lite: tiny on a CPU")
    ap.add_argument("--dtype", default="bfloat16", help="--shape v2-lite: the random weights' dtype")
    ap.add_argument("--kv-memory", type=float, default=0.2, help="--shape v2-lite: KV cache share of free memory")
    ap.add_argument("--modes", default="plain,spec_sync,spec_async")
    ap.add_argument("--concurrency", default="4", help="requests at a time; a list (1,16,64) reuses each engine")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="measured runs per mode (the least host time is kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    ap.add_argument("--count-syncs", action="store_true", help="count the calls that wait for the GPU (CUDA)")
    ap.add_argument("--cprofile", default=None, help="a mode: print its host time by function (one more run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    model = draft = None
    if args.shape == "v2-lite":
        model, draft = random_v2lite(Path(tmp.name), args.proposer == "dspark", args.dtype, args.scale)
    results: dict = {"shape": args.shape, "proposer": args.proposer, "k": args.k, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "modes": {}}
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    concs = [int(c) for c in str(args.concurrency).split(",")]
    refs: dict[int, list] = {}
    for mode in args.modes.split(","):
        llm = build(args, mode, model, draft)
        cpu = llm.engine.device.type == "cpu"
        if mode.startswith("spec") and llm.engine.spec is None:
            raise SystemExit(f"{mode}: the engine has no proposer")
        for c in concs:  # one engine per mode, every concurrency
            if args.shape == "embedded":
                prompts = [{"prompt_token_ids": p} for p in heldout_prompts(llm.tokenizer, c, 0)]
            else:
                g = torch.Generator().manual_seed(0)
                V = llm.engine.model_config.vocab_size
                prompts = [{"prompt_token_ids": torch.randint(2, V, (64,), generator=g).tolist()} for _ in range(c)]
            runs = [measure(llm, prompts, greedy, cpu, args.count_syncs and not cpu) for _ in range(args.repeats)]
            if mode == args.cprofile:
                profile(llm, prompts, greedy)
            row = min(runs, key=lambda r: r["host_ms_per_step"])  # the least disturbed run (a shared machine)
            if args.repeats > 1:
                row["host_ms_per_step_runs"] = [r["host_ms_per_step"] for r in runs]
                row["host_cpu_ms_per_step_runs"] = [r["host_cpu_ms_per_step"] for r in runs]
            outs = row.pop("outputs")
            ref = refs.setdefault(c, outs)
            row["greedy_equal_to_first_mode"] = f"{sum(a == b for a, b in zip(ref, outs))}/{len(outs)}"
            row["overlaps_on_device"] = llm.engine.spec is not None and llm.engine.spec.on_device is not None
            name = mode if len(concs) == 1 else f"{mode}@c{c}"
            results["modes"][name] = row
            print(name, json.dumps(row), flush=True)
        llm.engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
