"""Shared pieces of the data-/expert-parallel tests (test_parallel.py, test_eplb.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tiny_models import rand_ids, write_checkpoint

from deepinfer_core import LLM, SamplingParams

#: A V3-shaped checkpoint with enough experts and MoE layers for 2 and 4 expert-parallel ranks:
#: 16 routed experts (top-4 of 4 groups, 2 groups kept), a shared expert, 1 dense + 2 MoE layers.
EP_MODEL = dict(num_hidden_layers=3, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=2.5)
BS = 4  # KV block size


def ep_checkpoint(base: Path) -> str:
    """The EP test checkpoint under ``base`` (built once per session: both test files share it)."""
    path = Path(base) / "tiny_v3_ep16"
    if not (path / "model.safetensors").is_file():
        write_checkpoint(path, "v3", seed=5, **EP_MODEL)
    return str(path)


def workload(n: int = 8) -> list[dict]:
    """Prompts sharing a 16-token prefix (prefix-cache hits) with different tails."""
    prefix = rand_ids(16, 99)
    return [{"prompt_token_ids": prefix + rand_ids(3 + 3 * i, 1000 + i)} for i in range(n)]


def params(n: int = 8, max_tokens: int = 20) -> list[SamplingParams]:
    """Greedy requests with logprobs, plus two seeded sampled ones (the driver's seed must reach the rank)."""
    out = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
           for _ in range(n)]
    out[1] = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, seq_seed=11,
                            logprobs=0)
    out[-1] = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seq_seed=12, logprobs=0)
    return out


def make_llm(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=16, kv_cache_memory=2 << 20,
                worker_timeout_s=60.0)
    opts.update(kw)
    return LLM(str(path), **opts)


def tokens(outs) -> list[list[int]]:
    for o in outs:
        assert o.error is None, o.error
    return [o.outputs[0].token_ids for o in outs]


def assert_same(outs, ref, tol: float = 1e-4) -> None:
    assert tokens(outs) == tokens(ref)
    for a, b in zip(outs, ref):
        la = [a.outputs[0].logprobs[j][t].logprob for j, t in enumerate(a.outputs[0].token_ids)]
        lb = [b.outputs[0].logprobs[j][t].logprob for j, t in enumerate(b.outputs[0].token_ids)]
        assert max((abs(x - y) for x, y in zip(la, lb)), default=0.0) < tol


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (read from /proc, no psutil)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
