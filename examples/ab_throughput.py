"""Engine throughput of two source trees, alternated in one run: fair on a loaded or shared machine.

Each tree runs in its own worker process (``PYTHONPATH=<tree>``) over the same random checkpoint
and the same workload as ``benchmark.py`` (its end-to-end part: 48 requests, prompts 16-256, outputs
16-128 tokens); a round runs it (or ``--per-round`` requests of it) on A, then on B, the next round
on B first, and so on, so background load falls on both alike. Reported: output tok/s per tree over
all rounds and B's change against A. ``--concurrent`` runs each round on A and B at the same time,
one thread each: on a machine whose load swings within seconds, both then see the same load.

    git archive main | tar -x -C /tmp/main_tree
    python examples/ab_throughput.py --a /tmp/main_tree --b . [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(model_dir: str, args) -> None:
    """Serve "run i" lines: generate round i of the workload, print {"seconds", "tokens"}."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from benchmark import workload

    from deepinfer_core import LLM, SamplingParams

    if args.concurrent:
        torch.set_num_threads(1)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    reqs = workload(args.num_requests, (16, 256), (16, 128), vocab, args.seed)
    per = args.per_round or len(reqs)
    llm.generate([{"prompt_token_ids": reqs[0][0]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        i = int(line.split()[1])
        start = (i * per) % len(reqs)
        part = (reqs + reqs)[start : start + per]
        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in part]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in part], params, use_tqdm=False)
        dt = time.perf_counter() - t
        print(json.dumps({"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                          "outputs": [o.outputs[0].token_ids for o in outs]}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="source tree A (e.g. an export of main)")
    ap.add_argument("--b", required=True, help="source tree B")
    ap.add_argument("--shape", default="v3-tiny")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=0, help="requests per round (0: the whole workload)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrent", action="store_true", help="run A and B at once, one thread each")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from random_checkpoint import make_random_checkpoint, shape_config

    tmp = tempfile.TemporaryDirectory()
    model_dir = make_random_checkpoint(Path(tmp.name) / args.shape, shape_config(args.shape), args.seed)
    procs = {}
    for name, tree in (("A", args.a), ("B", args.b)):
        tree = str(Path(tree).resolve())
        env = dict(os.environ, PYTHONPATH=tree)
        cmd = [sys.executable, str(Path(tree) / "examples" / "ab_throughput.py"), "--a", "-", "--b", "-",
               "--worker", str(model_dir)] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                                              ("num_requests", "rounds", "per_round", "max_num_seqs",
                                               "max_num_batched_tokens", "seed")]
        cmd += ["--concurrent"] if args.concurrent else []
        if not (Path(tree) / "examples" / "ab_throughput.py").is_file():
            cmd[1] = str(Path(__file__).resolve())  # a tree without this script: run ours on its code
        procs[name] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       cwd=tree)
        json.loads(procs[name].stdout.readline())  # ready
    total = {"A": [0.0, 0], "B": [0.0, 0]}
    agree = True
    for i in range(args.rounds):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        got = {}
        for name in order:
            procs[name].stdin.write(f"run {i}\n")
            procs[name].stdin.flush()
            if not args.concurrent:
                got[name] = json.loads(procs[name].stdout.readline())
        for name in order:
            if args.concurrent:
                got[name] = json.loads(procs[name].stdout.readline())
            total[name][0] += got[name]["seconds"]
            total[name][1] += got[name]["tokens"]
        agree = agree and got["A"]["outputs"] == got["B"]["outputs"]
        print(f"round {i}: A {got['A']['tokens'] / got['A']['seconds']:.1f} tok/s, "
              f"B {got['B']['tokens'] / got['B']['seconds']:.1f} tok/s", flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    a, b = (total[n][1] / total[n][0] for n in ("A", "B"))
    print(f"A {args.a}: {a:.1f} output tok/s\nB {args.b}: {b:.1f} output tok/s\nB vs A: {100 * (b / a - 1):+.1f}%  "
          f"(greedy outputs identical: {agree})")


if __name__ == "__main__":
    main()
