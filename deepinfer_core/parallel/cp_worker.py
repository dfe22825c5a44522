"""One rank of a context-parallel prefill: ``python -m deepinfer_core.parallel.cp_worker SPEC.json RANK``.

SPEC: {"llm": LLM keyword arguments, "prompt_token_ids": [...], "params": SamplingParams dict,
"world_size": N, "port": P, "out": directory}. Every rank builds the engine, joins a gloo group
and runs :func:`~deepinfer_core.parallel.context_parallel.cp_prefill`; it writes its logits rows
(``rank{R}.pt``: a dict of tensors) and the prefill time. Rank 0 then continues the request alone:
its engine takes the gathered KV and decodes (``rank0.json``: tokens, text, prefill seconds).
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist


def main(spec_path: str, rank: int) -> None:
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.communicator import TorchDistCommunicator
    from deepinfer_core.engine.handoff import ROWS
    from deepinfer_core.parallel.context_parallel import cp_prefill, prefilled_state

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec.get("threads", 1))
    world = spec["world_size"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        llm = LLM(**spec["llm"])
        comm = TorchDistCommunicator() if world > 1 else None
        ids = spec["prompt_token_ids"]
        dist.barrier()
        t0 = time.perf_counter()
        logits, entries, mine = cp_prefill(llm.engine.model, ids, comm)
        dist.barrier()
        seconds = time.perf_counter() - t0
        index = torch.cat([torch.arange(s, e) for s, e in mine])
        torch.save({"logits": logits.cpu(), "index": index}, f"{spec['out']}/rank{rank}.pt")
        if rank == 0:
            params = SamplingParams.from_dict(spec["params"])
            seq = llm.engine.add_request({"prompt_token_ids": ids}, params)
            seq.feature_state[ROWS] = prefilled_state(llm.engine, ids, entries)
            while llm.engine.has_unfinished():
                llm.engine.step()
            with open(f"{spec['out']}/rank0.json", "w") as f:
                json.dump({"tokens": seq.output_token_ids, "prefill_s": seconds,
                           "loaded": seq.metrics.num_cached_tokens_by_tier.get("handoff", 0)}, f)
            llm.engine.blocks.check_no_leaks()
        llm.shutdown()
    finally:
        dist.destroy_process_group()


def run(llm_kwargs: dict, prompt_token_ids: list[int], params: dict, cp: int, out: str, timeout_s: float = 600,
        threads: int = 1) -> dict:
    """Launch ``cp`` ranks on this machine and wait; returns rank 0's result (tokens, prefill_s)."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"llm": llm_kwargs, "prompt_token_ids": prompt_token_ids, "params": params, "world_size": cp,
            "port": port, "out": out, "threads": threads}
    path = os.path.join(out, "cp_spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    procs = [subprocess.Popen([sys.executable, "-m", "deepinfer_core.parallel.cp_worker", path, str(r)],
                              stderr=subprocess.PIPE, text=True) for r in range(cp)]
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != 0:
            errors.append(f"rank {r} exited with {p.returncode}: {err[-2000:]}")
    if errors:
        raise RuntimeError("context-parallel prefill failed: " + "\n".join(errors))
    with open(os.path.join(out, "rank0.json")) as f:
        return json.load(f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
