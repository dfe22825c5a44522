"""P/D disaggregation figures on this machine (CPU): hand-off latency per transport, the time a
draining decode engine takes to forward its requests with their KV, and the context-parallel
prefill speed-up.

    python examples/pd_bench.py [--prompt-len 2048] [--drain-requests 16]
    python examples/pd_bench.py --only-cp --cp-len 8192 --cp 1 2     # CP prefill time, cp=1 vs 2 ranks

The model is the random ``v3-tiny`` shape of ``examples/random_checkpoint.py`` (4 layers, latent
128 + rope 16 per token per layer, float32: 2,304 B of KV per token). For each transport a prefill
engine computes the prompt and hands it off, a decode engine takes it over:
* send: capture the KV rows from the cache, pack and hash the payload, publish it (prefill side);
* recv: fetch the payload, verify both hashes, the fingerprints and the prompt, decode (decode side);
* load: the decode engine's first step, which writes the rows into its blocks and computes one token.
The p2p transport runs both ends in this process over a gloo group on 127.0.0.1 (loopback TCP).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import shape_config, write_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.ports import free_port


def sections(kind: str, work: Path) -> tuple[dict, dict]:
    if kind == "shm":
        s = {"backend": "shm", "namespace": f"pd-bench-{uuid.uuid4().hex[:8]}"}
        return s, s
    if kind == "3fs":
        s = {"backend": "3fs", "path": str(work / "store")}
        return s, s
    port = free_port()
    return ({"backend": "p2p", "rank": 0, "world_size": 2, "master_port": port},
            {"backend": "p2p", "rank": 1, "world_size": 2, "master_port": port})


def handoff(kind: str, model: str, prompt_len: int, work: Path, reps: int) -> dict:
    kw = dict(model=model, load_format="random", dtype="float32", block_size=16, max_model_len=prompt_len + 64,
              enable_prefix_caching=False)
    sp, sd = sections(kind, work)
    built = {}
    t = threading.Thread(target=lambda: built.setdefault("d", LLM(kv_role="decode", kv_transfer=sd, **kw)))
    t.start()  # a p2p group forms only when both ends join
    p = LLM(kv_role="prefill", kv_transfer=sp, **kw)
    t.join()
    d = built["d"]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    rows = []
    for r in range(reps):
        prompt = {"prompt_token_ids": torch.randint(4, 4000, (prompt_len,), generator=torch.Generator().manual_seed(r))
                  .tolist()}
        p0, d0 = p.metrics(), d.metrics()
        out = p.generate(prompt, params, use_tqdm=False)[0]
        p1 = p.metrics()
        t0 = time.perf_counter()
        seq = d.engine.add_request(prompt, dataclasses.replace(params, kv_transfer_params=out.kv_transfer_params))
        t1 = time.perf_counter()
        d.engine.step()  # loads the rows and computes the first token
        t2 = time.perf_counter()
        while d.engine.has_unfinished():
            d.engine.step()
        d1 = d.metrics()
        assert seq.metrics.num_cached_tokens_by_tier.get("handoff") == prompt_len, "hand-off not used"
        rows.append({"send_s": p1["handoff_send_s"] - p0.get("handoff_send_s", 0.0),
                     "recv_s": d1["handoff_recv_s"] - d0.get("handoff_recv_s", 0.0), "add_s": t1 - t0,
                     "load_step_s": t2 - t1, "bytes": p1["handoff_sent_bytes"] - p0.get("handoff_sent_bytes", 0)})
    p.shutdown()
    d.shutdown()
    med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
    return {"transport": kind, **med}


def drain(model: str, n: int, prompt_len: int, work: Path) -> dict:
    kw = dict(model=model, load_format="random", dtype="float32", block_size=16, max_model_len=prompt_len + 128)
    s = {"backend": "shm", "namespace": f"pd-bench-{uuid.uuid4().hex[:8]}"}
    d1, d2 = LLM(kv_transfer=s, **kw), LLM(kv_transfer=s, **kw)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [{"prompt_token_ids": torch.randint(4, 4000, (prompt_len,), generator=torch.Generator().manual_seed(
        100 + i)).tolist()} for i in range(n)]
    seqs = [d1.engine.add_request(q, params) for q in prompts]
    while min(s.num_output_tokens for s in seqs) < 8:
        d1.engine.step()
    d1.engine.start_drain(0)
    d1.engine.step()
    forward_s = d1.metrics()["drain_forward_s"]
    t0 = time.perf_counter()
    outs = d2.generate(prompts, [dataclasses.replace(params, kv_transfer_params=s.kv_transfer_out) for s in seqs],
                       use_tqdm=False)
    resume_s = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    return {"requests": n, "prompt_len": prompt_len, "forward_s": forward_s,
            "bytes": d1.metrics()["handoff_sent_bytes"], "receiver_finish_s": resume_s}


def context_parallel(model: str, T: int, sizes: list[int], work: Path) -> list[tuple[int, float]]:
    """Prefill seconds of a T-token prompt over each cp size (one gloo process per rank, 1 thread each)."""
    from deepinfer_core.parallel import cp_worker

    ids = torch.randint(4, 4000, (T,), generator=torch.Generator().manual_seed(7)).tolist()
    kw = dict(model=model, load_format="random", dtype="float32", block_size=16, max_model_len=T + 16)
    out = []
    for cp in sizes:
        d = work / f"cp{cp}"
        d.mkdir()
        res = cp_worker.run(kw, ids, {"temperature": 0, "max_tokens": 1}, cp, str(d))
        out.append((cp, res["prefill_s"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", nargs="+", default=["shm", "3fs", "p2p"])
    ap.add_argument("--drain-requests", type=int, default=16)
    ap.add_argument("--drain-prompt-len", type=int, default=512)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="context-parallel sizes to time")
    ap.add_argument("--cp-len", type=int, default=8192)
    ap.add_argument("--only-cp", action="store_true", help="only the context-parallel prefill timing")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = str(write_config(work / "model", {**shape_config("v3-tiny"), "max_position_embeddings": 16384}))
        if args.cp:
            times = context_parallel(model, args.cp_len, args.cp, work)
            base = times[0][1]
            for cp, sec in times:
                print(f"context-parallel prefill of {args.cp_len} tokens: cp={cp} {sec:.2f} s "
                      f"(speed-up {base / sec:.2f}x against cp={times[0][0]})", flush=True)
        if args.only_cp:
            return 0
        print(f"hand-off of a {args.prompt_len}-token prompt (median of {args.reps}):")
        print(f"{'transport':>9} {'MiB':>7} {'send ms':>8} {'recv ms':>8} {'load step ms':>12}")
        for kind in args.transports:
            r = handoff(kind, model, args.prompt_len, work, args.reps)
            print(f"{kind:>9} {r['bytes'] / 2**20:7.2f} {r['send_s'] * 1e3:8.2f} {r['recv_s'] * 1e3:8.2f} "
                  f"{r['load_step_s'] * 1e3:12.2f}", flush=True)
        r = drain(model, args.drain_requests, args.drain_prompt_len, work)
        print(f"drain: forwarding {r['requests']} running requests ({r['prompt_len']}-token prompts, "
              f"{r['bytes'] / 2**20:.1f} MiB of KV) took {r['forward_s'] * 1e3:.1f} ms; the receiver finished them "
              f"in {r['receiver_finish_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
