#!/usr/bin/env python
"""DSpark on the embedded model, side by side in one run: plain decoding, DSpark with fixed k and
DSpark with confidence-scheduled variable length.

Every engine runs with async scheduling on (the baseline: plain decoding with async scheduling).
DSpark's speculative steps overlap too (drafted on the device: ``async_speculation``, the default);
``--async-spec off`` runs them synchronously while plain steps still overlap.

1. Greedy outputs of all three are compared token by token on ``--num-prompts`` Python-source
   prompts (snippets of the standard library's held-out files).
2. Verified and accepted draft tokens per decode step, fixed k against variable length, at each
   concurrency (DeepSeek's reference: 5.00 -> 3.3 verified, 3.29 -> 3.20 accepted).
3. Decode tokens/s at each concurrency, steady state after every request's prefill. The three
   engines run the same wave side by side and take one step each in turn, every step timed alone, so
   that the noise of a shared machine hits all engines alike (``--timing waves``: whole waves
   alternate instead, as before). One untimed warm-up round (``--warmup-rounds``), then ``--rounds``
   timed rounds (default 5); each round's dspark / plain ratios are reported, and their median per
   concurrency (``decode_tok_s.c*.round_ratios`` and ``median_ratio`` in the JSON). At concurrency
   c > 1 a round is one closed wave of c requests, which lasts as long as its slowest request;
   ``--arrival stream`` runs ``--stream-factor`` x c requests through c slots instead (finished requests
   replaced at once, as in serving), timed whole, and reports the throughput between the c-th and the
   (n - c)-th completion too (``stream_decode_rates``; ``plugins/dspark/README.md``, tenth session).

    python examples/dspark_bench.py                      # 64 prompts, concurrency 1 and 32
    python examples/dspark_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams


def heldout_prompts(tokenizer, n: int, seed: int, lengths=(48, 96)) -> list[list[int]]:
    """Snippets of the stdlib files ``train_tiny.py`` held out (crc32(path) % 20 == 0)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py"))
             if zlib.crc32(p.relative_to(root).as_posix().encode()) % 20 == 0
             and not {"test", "tests", "site-packages", "idlelib", "lib2to3"} & set(p.relative_to(root).parts[:-1])
             and p.stat().st_size < 200_000]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 10:
            continue
        s = rng.randrange(len(lines) - 8)
        ids = tokenizer.encode("".join(lines[s : s + 40]))
        want = rng.randint(*lengths)
        if len(ids) >= want:
            out.append(ids[:want])
    return out


def feature(llm: LLM):
    return next((f for f in llm.engine.features if f.name == "dspark"), None)


def generate(llm: LLM, prompts, params, concurrency: int):
    llm.engine.scheduler.budget.max_num_seqs = concurrency
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o in outs:
        if o.error is not None:
            raise o.error
    return outs


def decode_rate(llm: LLM, prompts, params: SamplingParams, concurrency: int) -> tuple[int, float]:
    """(decode tokens, seconds) with ``concurrency`` requests at a time, counted from the step after
    the last prefill of each wave to its end."""
    engine = llm.engine
    engine.scheduler.budget.max_num_seqs = concurrency
    tokens, seconds = 0, 0.0
    for w in range(0, len(prompts), concurrency):
        seqs = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts[w : w + concurrency]]
        while any(s.num_output_tokens == 0 for s in seqs):
            engine.step()
        start = sum(s.num_output_tokens for s in seqs)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds += time.perf_counter() - t
        tokens += sum(s.num_output_tokens for s in seqs) - start
    engine.blocks.check_no_leaks()
    return tokens, seconds


def steps_in_turn(llms: dict[str, LLM]):
    """Step the engines in turn until none has work left, yielding (name, seconds of that step): the
    order rotated, and reversed every other round, so that each engine follows every other one
    equally often (a step after another engine's larger step runs on colder caches)."""
    names, r = list(llms), 0
    while names:
        order = names[(r // 2) % len(names):] + names[: (r // 2) % len(names)]
        for n in (order if r % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            llms[n].engine.step()
            yield n, time.perf_counter() - t
        names = [n for n in names if llms[n].engine.has_unfinished()]
        r += 1


def interleaved_decode_rates(llms: dict[str, LLM], prompts, params: SamplingParams, concurrency: int
                             ) -> dict[str, tuple[int, float]]:
    """Per engine (decode tokens, seconds), the engines stepping in turn: every engine runs the same
    wave of ``concurrency`` requests, and after every request's prefill the engines take one step each,
    round-robin (the order rotating, and reversed every other round), each step timed alone. On a
    shared machine a burst of other load then lands on every engine's steps alike (a step is
    milliseconds; alternating whole waves left each engine seconds of its own noise). On a CPU a step
    runs its forward inline, so the engines never overlap."""
    for llm in llms.values():
        llm.engine.scheduler.budget.max_num_seqs = concurrency
    totals = {n: [0, 0.0] for n in llms}
    for w in range(0, len(prompts), concurrency):
        seqs = {n: [llm.engine.add_request({"prompt_token_ids": p}, params) for p in prompts[w : w + concurrency]]
                for n, llm in llms.items()}
        for n, llm in llms.items():
            while any(s.num_output_tokens == 0 for s in seqs[n]):
                llm.engine.step()
        start = {n: sum(s.num_output_tokens for s in ss) for n, ss in seqs.items()}
        for n, seconds in steps_in_turn(llms):
            totals[n][1] += seconds
        for n, ss in seqs.items():
            totals[n][0] += sum(s.num_output_tokens for s in ss) - start[n]
    for llm in llms.values():
        llm.engine.blocks.check_no_leaks()
    return {n: (t[0], t[1]) for n, t in totals.items()}


def stream_decode_rates(llms: dict[str, LLM], prompts, params: SamplingParams, concurrency: int,
                        outputs: dict | None = None, steady: dict | None = None) -> dict[str, tuple[int, float]]:
    """Per engine (output tokens, seconds) of a whole stream: every engine gets all of ``prompts`` at
    once and runs ``concurrency`` of them at a time, the next one admitted as soon as a slot frees
    (vLLM's ``--max-concurrency``, or its offline throughput run with ``max_num_seqs``), every request to
    its end: the same work for every engine. The engines step in turn as in
    :func:`interleaved_decode_rates`, each step timed alone.

    ``steady``, when given, receives per engine (tokens, seconds) between the ``concurrency``-th and the
    (n - ``concurrency``)-th completion (each engine's own step time as its clock; tokens: the requests
    completed in between). In a stream that lasts, that is the throughput of serving, without the
    first wave and the drain. Counting the tokens emitted in the steps that start with requests waiting
    is biased instead: when nothing waits any more, an engine whose requests finish at different times
    has half-done requests in flight, while one whose requests run in lockstep has just admitted a wave.
    ``outputs``, when given, receives each engine's output token ids per request."""
    for llm in llms.values():
        llm.engine.scheduler.budget.max_num_seqs = concurrency
    seqs = {n: [llm.engine.add_request({"prompt_token_ids": p}, params) for p in prompts] for n, llm in llms.items()}
    clock = {n: 0.0 for n in llms}
    done_at = {n: [] for n in llms}  # (clock, tokens) of each engine's 1st, 2nd, ... completion
    running = {n: list(ss) for n, ss in seqs.items()}
    for n, seconds in steps_in_turn(llms):
        clock[n] += seconds
        done_at[n] += [(clock[n], s.num_output_tokens) for s in running[n] if s.is_finished]
        running[n] = [s for s in running[n] if not s.is_finished]
    for llm in llms.values():
        llm.engine.blocks.check_no_leaks()
    if outputs is not None:
        outputs.update({n: [list(s.output_token_ids) for s in ss] for n, ss in seqs.items()})
    lo, hi = concurrency, len(prompts) - concurrency
    if steady is not None and hi > lo:
        for n, d in done_at.items():
            steady[n] = (sum(tok for _, tok in d[lo:hi]), d[hi - 1][0] - d[lo - 1][0])
    return {n: (sum(s.num_output_tokens for s in seqs[n]), clock[n]) for n in llms}


def spec_metrics(llm: LLM) -> dict:
    m = llm.metrics()
    keys = ("dspark_verified_per_step", "dspark_mean_accepted_len", "dspark_accept_rate", "dspark_tokens_per_step",
            "dspark_mean_draft_depth", "dspark_decode_steps", "dspark_draft_time", "dspark_verify_time",
            "dspark_schedule_time", "dspark_cost_verify_scale", "dspark_cost_draft_scale", "dspark_cost_extra_overhead")
    return {k.removeprefix("dspark_"): (round(m[k], 4) if isinstance(m[k], float) else m[k]) for k in keys}


def llm_metric(llm: LLM, key: str):
    return llm.metrics().get(key)


def confidence_cuts(log: list) -> list[dict]:
    """What cutting the fixed-k drafts at a cumulative-confidence threshold would have given, from the
    logged verifications (greedy verification of a kept prefix accepts exactly as before): for each
    threshold, the change of verified and of accepted draft tokens against verifying all k."""
    steps = [(rec[7], rec[8]) for rec in log]  # (P_1..P_m, accepted count)
    full_v = sum(len(cum) for cum, _ in steps)
    full_a = sum(a for _, a in steps)
    out = []
    for theta in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3):
        kept = [sum(1 for p in cum if p >= theta) for cum, _ in steps]
        v = sum(kept)
        acc = sum(min(a, k) for (_, a), k in zip(steps, kept))
        out.append({"threshold": theta, "verified_reduction": round(1 - v / max(full_v, 1), 4),
                    "accepted_len_drop": round(1 - acc / max(full_a, 1), 4),
                    "tokens_per_step_drop": round(1 - (acc + len(steps)) / max(full_a + len(steps), 1), 4)})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--rate-prompts", type=int, default=8, help="requests per decode-rate round at concurrency 1")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (the engines interleaved within each)")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds before the timed ones")
    ap.add_argument("--arrival", choices=("wave", "stream"), default="wave",
                    help="concurrency > 1: one closed wave of c requests (the --timing modes), or a stream of "
                         "--stream-factor x c requests through c slots, timed whole (stream_decode_rates)")
    ap.add_argument("--stream-factor", type=int, default=4, help="requests per slot of a stream")
    ap.add_argument("--timing", choices=("interleaved", "waves"), default="interleaved",
                    help="decode-rate timing: the engines step in turn (each step timed), or whole waves alternate")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--policy", default="throughput", help="[dspark] budget_policy of the varlen engine")
    ap.add_argument("--min-confidence", type=float, default=0.2, help="[dspark] min_confidence (threshold policy)")
    ap.add_argument("--draft", default="auto", help="[dspark] draft: 'auto' (the shipped default), 'mtp' or a dir")
    ap.add_argument("--async-spec", choices=("on", "off"), default="on",
                    help="async_speculation of the DSpark engines")
    args = ap.parse_args(argv)
    if args.stream_factor < 1:
        ap.error(f"--stream-factor must be >= 1 (requests per slot of a stream), got {args.stream_factor}")
    torch.set_num_threads(args.threads)
    concs = [int(c) for c in args.concurrency.split(",")]
    # async scheduling on for all three (on a CPU it is off by default): DSpark's speculative steps
    # then draft on the device and overlap like plain decoding's steps
    common = dict(max_num_seqs=max(concs), enable_prefix_caching=False, async_scheduling=True)
    spec = dict(common, async_speculation=args.async_spec == "on")
    engines = {
        "plain": LLM(**common),
        "fixed": LLM(features=["dspark"], dspark={"k": args.k, "budget_policy": "fixed", "draft": args.draft},
                     **spec),
        "varlen": LLM(features=["dspark"], dspark={"k": args.k, "draft": args.draft, "budget_policy": args.policy,
                                                   "min_confidence": args.min_confidence}, **spec),
    }
    for name, llm in engines.items():  # the baseline and both DSpark engines step asynchronously
        assert llm.engine.async_scheduling, name
    on_device = engines["varlen"].engine.spec.on_device is not None
    below = 0 if engines["plain"].engine.platform.supports_async_overlap() else feature(engines["varlen"]).opts[
        "host_steps_below"]
    print(f"speculative steps: {'on the device (overlapped)' if on_device else 'synchronous'}"
          f"{f', on the host below {below} running requests' if on_device and below else ''}; plain steps overlapped")
    prompts = heldout_prompts(engines["plain"].tokenizer, args.num_prompts, args.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict = {"prompts": len(prompts), "max_tokens": args.max_tokens, "k": args.k,
                     "threads": torch.get_num_threads(), "async_scheduling": True, "async_speculation": on_device,
                     "host_steps_below": below,
                     "equivalence": {}, "speculation": {},
                     "decode_tok_s": {}}

    # 1 + 2: greedy equivalence and the speculation statistics, at each concurrency
    for c in concs:
        ps = prompts if c > 1 else prompts[: args.rate_prompts]
        outs = {}
        for name, llm in engines.items():
            if feature(llm):
                feature(llm).reset_metrics()
                feature(llm).outcome_log = [] if name == "fixed" else None
            outs[name] = [o.outputs[0].token_ids for o in generate(llm, ps, greedy, c)]
            if feature(llm):
                results["speculation"].setdefault(f"c{c}", {})[name] = spec_metrics(llm)
        results["speculation"][f"c{c}"]["confidence_cut"] = confidence_cuts(feature(engines["fixed"]).outcome_log)
        feature(engines["fixed"]).outcome_log = None
        same = {n: sum(a == b for a, b in zip(outs["plain"], outs[n])) for n in ("fixed", "varlen")}
        results["equivalence"][f"c{c}"] = {n: f"{v}/{len(ps)}" for n, v in same.items()}
        spec = results["speculation"][f"c{c}"]
        f, v = spec["fixed"], spec["varlen"]
        spec["verified_reduction"] = round(1 - v["verified_per_step"] / f["verified_per_step"], 4)
        spec["accepted_len_drop"] = round(1 - v["mean_accepted_len"] / max(f["mean_accepted_len"], 1e-9), 4)
        spec["tokens_per_step_drop"] = round(1 - v["tokens_per_step"] / max(f["tokens_per_step"], 1e-9), 4)

    # 3: decode tokens/s, the engines stepping in turn (--timing interleaved, the default) or alternating
    #    wave by wave (--timing waves); one request at a time at concurrency 1
    for c in concs:
        ps = prompts[: args.rate_prompts] if c == 1 else prompts[:c]
        stream = c > 1 and args.arrival == "stream"
        if stream:  # prompts of their own (the equivalence set stays as it was)
            ps = heldout_prompts(engines["plain"].tokenizer, args.stream_factor * c, args.seed + 7919 * c)
        totals = {n: [0, 0.0] for n in engines}
        per_round = {n: [] for n in engines}
        steady_rounds: dict[str, list[float]] = {}  # streams: the steady completion rate per round
        for r in range(-args.warmup_rounds, args.rounds):
            if r == 0:  # the warm-up rounds are over: count from here
                for llm in engines.values():
                    if feature(llm):
                        feature(llm).reset_metrics()
            round_tot = {n: [0, 0.0] for n in engines}
            if stream:
                outs, steady = {}, {}
                round_tot = {n: list(v) for n, v in stream_decode_rates(engines, ps, greedy, c, outs, steady).items()}
                if r >= 0:
                    for n, (tk, sec) in steady.items():
                        steady_rounds.setdefault(n, []).append(tk / sec)
                same = {n: sum(a == b for a, b in zip(outs["plain"], outs[n])) for n in ("fixed", "varlen")}
                results["equivalence"].setdefault(f"c{c}_stream", []).append(
                    {n: f"{v}/{len(ps)}" for n, v in same.items()})
            for w in range(0, len(ps) if not stream else 0, c):
                if args.timing == "interleaved":
                    for name, (n, s) in interleaved_decode_rates(engines, ps[w : w + c], greedy, c).items():
                        round_tot[name][0] += n
                        round_tot[name][1] += s
                    continue
                order = list(engines) if (r + w // c) % 2 == 0 else list(reversed(engines))
                for name in order:
                    n, s = decode_rate(engines[name], ps[w : w + c], greedy, c)
                    round_tot[name][0] += n
                    round_tot[name][1] += s
            if r < 0:
                continue
            for name, (n, s) in round_tot.items():
                totals[name][0] += n
                totals[name][1] += s
                per_round[name].append(n / s)
        rates = {n: t[0] / t[1] for n, t in totals.items()}
        ratios = {n: [round(a / b, 3) for a, b in zip(per_round[n], per_round["plain"])] for n in ("fixed", "varlen")}
        results["decode_tok_s"][f"c{c}"] = {
            **{n: round(v, 1) for n, v in rates.items()},
            "speedup_fixed": round(rates["fixed"] / rates["plain"], 3),
            "speedup_varlen": round(rates["varlen"] / rates["plain"], 3),
            "rounds": {n: [round(x, 1) for x in v] for n, v in per_round.items()},
            "speedup_varlen_median_round": round(statistics.median(
                a / b for a, b in zip(per_round["varlen"], per_round["plain"])), 3),
            "round_ratios": ratios,  # per timed round: dspark / plain decode tok/s
            "median_ratio": {n: round(statistics.median(v), 3) for n, v in ratios.items()},
            "warmup_rounds": args.warmup_rounds,
            "arrival": "stream" if stream else "wave", "requests": len(ps),
            **({"steady_round_ratios": {n: [round(a / b, 3) for a, b in zip(steady_rounds[n], steady_rounds["plain"])]
                                        for n in ("fixed", "varlen")}} if steady_rounds else {}),
            # what the varlen engine did in the timed steps (drafting or dormant)
            "varlen_spec": {k: v for k, v in spec_metrics(engines["varlen"]).items()
                            if k in ("decode_steps", "verified_per_step", "tokens_per_step")}
                           | {"steps_without_drafts": llm_metric(engines["varlen"], "dspark_steps_without_drafts"),
                              "blocked_explorations": llm_metric(engines["varlen"], "dspark_blocked_explorations")},
        }

    results["draft"] = feature(engines["fixed"]).source.kind
    idle = {n: llm.metrics().get("device_idle_share") for n, llm in engines.items()}
    if any(v is not None for v in idle.values()):  # DEEPINFER_MEASURE_DEVICE_IDLE=1 (a GPU)
        results["device_idle_share"] = {n: round(v, 4) for n, v in idle.items() if v is not None}
        print(f"device idle share between steps: {results['device_idle_share']}")
    print(f"DSpark on the embedded model: {len(prompts)} held-out prompts, {args.max_tokens} greedy tokens, "
          f"k={args.k}, {results['threads']} thread(s), draft {args.draft} ({results['draft']})")
    for c in concs:
        print(f"\n-- concurrency {c}")
        print(f"greedy outputs identical to plain: fixed {results['equivalence'][f'c{c}']['fixed']}, "
              f"varlen {results['equivalence'][f'c{c}']['varlen']}")
        for r, eq in enumerate(results["equivalence"].get(f"c{c}_stream", [])):
            print(f"stream round {r - args.warmup_rounds}: greedy outputs identical to plain: fixed {eq['fixed']}, "
                  f"varlen {eq['varlen']}")
        s = results["speculation"][f"c{c}"]
        for name in ("fixed", "varlen"):
            m = s[name]
            print(f"{name:>6}: verified/step {m['verified_per_step']:.2f}  accepted/step {m['mean_accepted_len']:.2f}"
                  f"  accept rate {m['accept_rate']:.3f}  tokens/step {m['tokens_per_step']:.2f}  "
                  f"draft depth {m['mean_draft_depth']:.2f}")
        print(f"varlen vs fixed: verified tokens per step -{s['verified_reduction'] * 100:.1f}%, accepted drafts per "
              f"step -{s['accepted_len_drop'] * 100:.1f}%, tokens per step (accepted + 1) "
              f"-{s['tokens_per_step_drop'] * 100:.1f}% (DeepSeek: 5.00 -> 3.3 = -34%, 3.29 -> 3.20 = -2.7%)")
        print("fixed-k drafts cut at a cumulative confidence P_j >= t (offline, from the logged verifications): " +
              ", ".join(f"t={x['threshold']}: verified -{x['verified_reduction'] * 100:.0f}% accepted "
                        f"-{x['accepted_len_drop'] * 100:.1f}% tokens/step -{x['tokens_per_step_drop'] * 100:.1f}%"
                        for x in s["confidence_cut"]))
        d = results["decode_tok_s"][f"c{c}"]
        print(f"decode tok/s: plain {d['plain']:.1f}  fixed {d['fixed']:.1f} ({d['speedup_fixed']:.2f}x)  "
              f"varlen {d['varlen']:.1f} ({d['speedup_varlen']:.2f}x); varlen in the timed steps: {d['varlen_spec']}")
        for name in ("fixed", "varlen"):
            print(f"{name} / plain per round: {d['round_ratios'][name]}  median {d['median_ratio'][name]:.3f}")
            if "steady_round_ratios" in d:
                print(f"{name} / plain per round, steady completions: {d['steady_round_ratios'][name]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    for llm in engines.values():
        llm.shutdown()
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
