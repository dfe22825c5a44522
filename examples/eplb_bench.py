#!/usr/bin/env python
"""EPLB benchmark: expert-parallel load imbalance (``moe_lb``) with and without EPLB, and CPU throughput.

``moe_lb`` = the busiest rank's routed (token, expert) pairs over the mean, per MoE layer; overall it
is the sum over layers of the busiest rank over the sum of the means (a step's MoE time follows the
slowest rank of every layer). 1.0 is perfect balance.

    python examples/eplb_bench.py replay       # per-token routing-trace replay: 64 experts, ep 8, Zipf s=1
    python examples/eplb_bench.py placement    # placement-only simulation: 256 experts, ep 64 and 128
    python examples/eplb_bench.py throughput --dp 2 --ep 2 [--eplb]   # the engine on CPU: tokens/s, moe_lb

``replay`` routes every token of every rank through the same code as the ``eplb`` feature's route
hook (replica ``(token index + rank) % replicas``) and rebalances from a sliding window, as the
feature does; the first ``rebalance_every`` steps run on the start-up placement and are reported
apart. ``placement`` splits each expert's expected load evenly over its replicas.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.eplb.algorithm import (  # noqa: E402
    contiguous_placement,
    gpu_loads,
    initial_placement,
    maps_from_phys_to_log,
    moe_lb,
    moe_lb_overall,
    rebalance_experts,
    stabilize_placement,
)
from plugins.eplb.synthetic import expected_loads, routing_trace, zipf_popularity  # noqa: E402


# ---- routing-trace replay ------------------------------------------------------------------------
def replay(args) -> dict:
    E, W, K, L = args.experts, args.ep, args.top_k, args.layers
    spr = E // W + args.redundant
    contiguous = contiguous_placement(E, W, L).phys_to_log
    p2l = initial_placement(E, W, args.redundant, L).phys_to_log  # the feature's start-up placement
    maps = [maps_from_phys_to_log(p2l[i], E) for i in range(L)]
    window: list[np.ndarray] = []
    sums = {k: np.zeros((L, W)) for k in ("none", "eplb_warmup", "eplb")}
    step_lb = {k: [] for k in sums}
    rebalances = 0
    t0 = time.perf_counter()
    for step, layers in enumerate(routing_trace(args.steps, L, E, args.tokens, W, K, args.zipf_s, args.seed,
                                                args.drift)):
        counts = np.zeros((L, E))
        per_rank = {"none": np.zeros((L, W)), "eplb": np.zeros((L, W))}
        for i, ranks in enumerate(layers):
            l2p, cnt = maps[i]
            for r, ids in enumerate(ranks):
                counts[i] += np.bincount(ids.reshape(-1), minlength=E)
                per_rank["none"][i] += np.bincount(ids.reshape(-1) // (E // W), minlength=W)
                phys = l2p[ids, (np.arange(ids.shape[0])[:, None] + r) % cnt[ids]]  # the route hook's choice
                per_rank["eplb"][i] += np.bincount(phys.reshape(-1) // spr, minlength=W)
        eplb_key = "eplb" if rebalances else "eplb_warmup"
        for key, src in (("none", "none"), (eplb_key, "eplb")):
            sums[key] += per_rank[src]
            step_lb[key].append(moe_lb_overall(per_rank[src]))
        window.append(counts)
        window = window[-args.window_steps :]
        if (step + 1) % args.rebalance_every == 0:
            new = rebalance_experts(sum(window), W * spr, args.groups, args.nodes, W)
            p2l = np.stack([stabilize_placement(p2l[i], new.phys_to_log[i], W) for i in range(L)])
            maps = [maps_from_phys_to_log(p2l[i], E) for i in range(L)]
            rebalances += 1
    out = {"mode": "replay", "experts": E, "ep": W, "top_k": K, "layers": L, "redundant_per_rank": args.redundant,
           "zipf_s": args.zipf_s, "steps": args.steps, "tokens_per_rank_per_step": args.tokens,
           "window_steps": args.window_steps, "rebalance_every": args.rebalance_every, "rebalances": rebalances,
           "seconds": round(time.perf_counter() - t0, 2)}
    for key in sums:
        if step_lb[key]:
            out[f"moe_lb_{key}"] = round(moe_lb_overall(sums[key]), 4)
            out[f"moe_lb_{key}_per_layer"] = [round(moe_lb(row), 4) for row in sums[key]]
            out[f"moe_lb_{key}_per_step_mean"] = round(float(np.mean(step_lb[key])), 4)
    contiguous_check = moe_lb_overall(gpu_loads(sum(window), contiguous, W))
    out["moe_lb_none_expected"] = round(contiguous_check, 4)
    return out


# ---- placement-only simulation -------------------------------------------------------------------
def placement(args) -> dict:
    results = []
    E, K = args.experts, args.top_k
    for W in args.ep_list:
        pops = np.stack([zipf_popularity(E, args.zipf_s, args.seed * 1000 + i) for i in range(args.layers)])
        loads = expected_loads(pops, args.tokens * W, K)
        slots = W * (E // W + args.redundant)
        nodes = max(1, W // args.gpus_per_node)
        row = {"experts": E, "ep": W, "slots_per_rank": slots // W, "nodes": nodes, "groups": args.groups}
        row["moe_lb_none"] = round(moe_lb_overall(gpu_loads(loads, contiguous_placement(E, W, args.layers)
                                                            .phys_to_log, W)), 4)
        for name, n in (("eplb", nodes), ("eplb_global", 1)):
            t0 = time.perf_counter()
            p = rebalance_experts(loads, slots, args.groups, n, W)
            row[f"moe_lb_{name}"] = round(moe_lb_overall(gpu_loads(loads, p.phys_to_log, W)), 4)
            row[f"{name}_policy"] = p.policy
            row[f"{name}_ms_per_layer"] = round((time.perf_counter() - t0) * 1000 / args.layers, 2)
        results.append(row)
    return {"mode": "placement", "zipf_s": args.zipf_s, "top_k": K, "layers": args.layers,
            "redundant_per_rank": args.redundant, "results": results}


# ---- CPU throughput ------------------------------------------------------------------------------
def throughput(args) -> dict:
    from random_checkpoint import make_random_checkpoint, shape_config

    from deepinfer_core import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    model = args.model
    tmp = None
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        model = str(make_random_checkpoint(Path(tmp.name) / "ckpt", shape_config(args.shape), seed=args.seed))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    kw = dict(dtype="float32", kv_cache_memory=args.kv_cache_mb << 20, max_num_seqs=args.requests)
    if args.dp > 1 or args.ep > 1:
        kw.update(dp=args.dp, ep=args.ep)
    if args.eplb:
        kw.update(features=["eplb"], eplb={"window_steps": args.window_steps,
                                           "rebalance_every": args.rebalance_every,
                                           "redundant_experts_per_rank": args.redundant})
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": rng.integers(2, vocab, args.prompt_len).tolist()} for _ in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    m = llm.metrics()
    llm.shutdown()
    if tmp is not None:
        tmp.cleanup()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"mode": "throughput", "model": args.model or f"random {args.shape}", "dp": args.dp, "ep": args.ep,
            "eplb": args.eplb, "requests": args.requests, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "startup_s": round(startup, 2), "seconds": round(elapsed, 3),
            "output_tok_s": round(gen / elapsed, 1),
            "total_tok_s": round((gen + args.requests * args.prompt_len) / elapsed, 1),
            "moe_lb": round(m.get("moe_lb", 1.0), 4), "moe_lb_per_layer": m.get("moe_lb_per_layer"),
            "eplb_rebalances": m.get("eplb_rebalances")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("replay", help="per-token routing-trace replay (default: 64 experts, ep 8)")
    r.add_argument("--experts", type=int, default=64)
    r.add_argument("--ep", type=int, default=8)
    r.add_argument("--top-k", type=int, default=8)
    r.add_argument("--layers", type=int, default=4)
    r.add_argument("--groups", type=int, default=8)
    r.add_argument("--nodes", type=int, default=1)
    r.add_argument("--redundant", type=int, default=1, help="redundant experts per rank")
    r.add_argument("--zipf-s", type=float, default=1.0)
    r.add_argument("--steps", type=int, default=300)
    r.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    r.add_argument("--window-steps", type=int, default=100)
    r.add_argument("--rebalance-every", type=int, default=50)
    r.add_argument("--drift", type=float, default=0.0, help="per-step popularity drift (0: stationary)")
    r.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("placement", help="placement-only simulation (default: 256 experts, ep 64 and 128)")
    s.add_argument("--experts", type=int, default=256)
    s.add_argument("--ep-list", type=lambda v: [int(x) for x in v.split(",")], default=[64, 128])
    s.add_argument("--top-k", type=int, default=8)
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--groups", type=int, default=8)
    s.add_argument("--gpus-per-node", type=int, default=8)
    s.add_argument("--redundant", type=int, default=1)
    s.add_argument("--zipf-s", type=float, default=1.0)
    s.add_argument("--tokens", type=int, default=4096, help="tokens per rank in the window")
    s.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("throughput", help="the engine on CPU with --dp/--ep: tokens/s and moe_lb")
    t.add_argument("--model", default=None, help="checkpoint dir (default: a random --shape checkpoint)")
    t.add_argument("--shape", default="v3-tiny")
    t.add_argument("--dp", type=int, default=1)
    t.add_argument("--ep", type=int, default=1)
    t.add_argument("--eplb", action="store_true")
    t.add_argument("--redundant", type=int, default=1)
    t.add_argument("--window-steps", type=int, default=32)
    t.add_argument("--rebalance-every", type=int, default=16)
    t.add_argument("--requests", type=int, default=32)
    t.add_argument("--prompt-len", type=int, default=64)
    t.add_argument("--max-tokens", type=int, default=64)
    t.add_argument("--kv-cache-mb", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = {"replay": replay, "placement": placement, "throughput": throughput}[args.mode](args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
