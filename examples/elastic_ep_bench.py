"""Elastic EP: the time from a rank's death to serving again, on this machine (CPU, gloo).

    python examples/elastic_ep_bench.py [--ep 4] [--redundant 2] [--requests 16] [--max-tokens 32]

A random ``v3-tiny`` checkpoint (16 routed experts, 3 MoE layers; real safetensors, so the lost
experts can be re-read) runs with ``dp = ep = N``, ``features = ["eplb"]`` and ``elastic_ep``. After a
few decode steps one rank holding requests is SIGKILLed. Reported:
* kill -> detected: the driver sees the rank's pipe close (its exit status names SIGKILL);
* re-form: survivors leave the broken group, form a new one on a new port, EPLB re-places the
  experts (moves over the new group, lost ones read from the checkpoint), requests re-routed;
* kill -> first token: the first step after the re-form that emits tokens again (the survivors'
  requests continue from their KV; the dead rank's, re-routed, recompute prompt + emitted tokens);
* kill -> all re-routed requests caught up: every request of the dead rank emits again;
* the greedy outputs compared with one undisturbed rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import make_random_checkpoint, shape_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=2, help="[eplb] redundant_experts_per_rank")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kill-after-steps", type=int, default=6)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_random_checkpoint(Path(tmp) / "v3-tiny", shape_config("v3-tiny")))
        kw = dict(model=model, dtype="float32", block_size=16, max_model_len=512)
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 4000 + 2 for j in range(24 + 4 * i)]}
                   for i in range(args.requests)]
        ref_llm = LLM(**kw)
        ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, sp, use_tqdm=False)]
        ref_llm.shutdown()

        llm = LLM(dp=args.ep, ep=args.ep, features=["eplb"], elastic_ep=True, worker_timeout_s=60.0,
                  eplb={"redundant_experts_per_rank": args.redundant, "rebalance_every": 0}, **kw)
        eng = llm.engine
        seqs = [eng.add_request(p, sp) for p in prompts]
        step_s = []
        for _ in range(args.kill_after_steps):
            t = time.perf_counter()
            eng.step()
            step_s.append(time.perf_counter() - t)
        victim = eng._owner[seqs[1].request_id]  # a rank that holds requests
        emitted = sum(len(s.output_token_ids) for s in seqs)
        os.kill(eng.worker_pids()[victim], signal.SIGKILL)
        t_kill = time.perf_counter()
        on_victim = {s.request_id: len(s.output_token_ids) for s in seqs if eng._owner[s.request_id] == victim}
        first_token_s = caught_up_s = None
        while eng.has_unfinished():
            eng.step()
            now = time.perf_counter() - t_kill
            if first_token_s is None and eng.reforms and sum(len(s.output_token_ids) for s in seqs) > emitted:
                first_token_s = now
            if caught_up_s is None and all(len(s.output_token_ids) > on_victim[s.request_id] or s.is_finished
                                           for s in seqs if s.request_id in on_victim):
                caught_up_s = now
        m = llm.metrics()
        llm.shutdown()

    rf = m["elastic_reforms"][0]
    same = [s.output_token_ids for s in seqs] == ref
    lost = sum(s.finish_reason != "length" for s in seqs)
    print(f"ep {args.ep} -> {rf['world_size']} (killed rank {victim}), {args.requests} requests, "
          f"{args.redundant} redundant slots per rank, {len(os.sched_getaffinity(0))} cores")
    print(f"  median step before the kill      {statistics.median(step_s) * 1e3:8.1f} ms")
    print(f"  kill -> detected                 {(rf['detected_at'] - t_kill) * 1e3:8.1f} ms")
    print(f"  detected -> re-formed            {rf['detect_to_serving_s'] * 1e3:8.1f} ms "
          f"(re-form {rf['reform_s'] * 1e3:.1f} ms: new group + EPLB placement on the ranks "
          f"{rf['group_and_placement_s'] * 1e3:.1f} ms)")
    print(f"  kill -> first token again        {first_token_s * 1e3:8.1f} ms "
          f"(survivors kept {sum(rf['requests_kept'])} requests with their KV)")
    reformed_s = rf["detected_at"] - t_kill + rf["detect_to_serving_s"]
    print(f"  re-formed -> first token again   {(first_token_s - reformed_s) * 1e3:8.1f} ms "
          "(the first step: survivors decode, re-routed requests recompute)")
    print(f"  kill -> re-routed ones emit again {caught_up_s * 1e3:8.1f} ms "
          f"(re-routed {rf['requests_rerouted']} requests, recomputed from prompt + emitted tokens)")
    recomputed = sum(r["prefill_tokens"] - b for r, b in zip(m["ranks"], rf["prefill_tokens_at_reform"]))
    print(f"  prefill tokens after the re-form  {recomputed} (the re-routed requests' prompt + emitted tokens)")
    print(f"  experts read from the checkpoint  {rf['experts_loaded']}")
    print(f"  requests lost {lost}; greedy outputs identical to one undisturbed rank: {same}")


if __name__ == "__main__":
    main()
