"""DeepSeek-V4 decode through the engine's graph runner (``DecodeGraphs``): static per-cache-group slot
mappings and block tables (swa, csa, hca and their compressor-state groups), padding rows, replay.

* CPU: the padded static-buffer path (``capture=False``) against plain eager steps on the trained
  embedded ``tiny-v4``: identical greedy tokens, logprobs within 1e-4, over decode batches that shrink
  through every captured size and past the largest.
* GPU: captured graphs against ``enforce_eager=True`` in bfloat16 on a random V4 whose shapes run the
  TileLang kernels (16 heads of 128, indexer 16 x 64, 16 experts); prompts of 150-700 tokens so HCA
  windows (128) close and the indexer's top-16 is a real choice. Where tokens part, the eager run must
  have had a near-tie (bfloat16 rounds differently at padded batch sizes), as in ``test_cuda_graphs_gpu``.
  Random weights, no embedded checkpoint.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

SIZES = [1, 2, 4, 8]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


def test_v4_padded_static_path_generates_like_eager():
    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n", "for i in range(",
               "x = [", "def main():\n    args = ", "# read a file\nwith open(", "import sys\nimport json\n",
               "def add(a, b):\n    return", "while True:\n"]
    opts = dict(model="tiny-v4", dtype="float32", accelerator="cpu", max_num_seqs=16, max_num_batched_tokens=64,
                kv_cache_memory=16 << 20, graph_batch_sizes=SIZES, enable_prefix_caching=False)
    eager = LLM(**opts)
    padded = LLM(**opts)
    e = padded.engine
    e.runner.setup_graphs(e.platform, e.cfg, e.max_model_len, capture=False)
    graphs = e.runner.graphs
    assert set(graphs.group_slots) == {g.name for g in e.model.cache_layout().groups}
    params = [greedy(40 + 3 * i) for i in range(len(prompts))]  # batches 10 (eager) .. 8 .. 1, past entries
    a = padded.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.error is None and y.error is None
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lx = [x.outputs[0].logprobs[j][t].logprob for j, t in enumerate(x.outputs[0].token_ids)]
        ly = [y.outputs[0].logprobs[j][t].logprob for j, t in enumerate(y.outputs[0].token_ids)]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4
    assert set(graphs.runs) == set(SIZES), f"padded sizes run: {sorted(graphs.runs)}"


# ---- GPU -------------------------------------------------------------------------------------------
TIE = 0.1  # nats


def _gpu_llm(path: Path, eager: bool) -> LLM:
    llm = LLM(str(path), accelerator="nvidia", dtype="bfloat16", load_format="random", seed=3, block_size=256,
              max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=1024, kv_cache_memory=2 << 30,
              graph_batch_sizes=SIZES, enforce_eager=eager, enable_prefix_caching=False)
    with torch.no_grad():  # confident logits, so that a broken replay shows as a changed token
        llm.engine.model.head.mul_(40.0)
    return llm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_v4_graphs_match_eager_on_gpu(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from random_checkpoint import write_config
    from v4_suite import GRAPH_TEST

    path = write_config(tmp_path / "v4", GRAPH_TEST)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 4096) for _ in range(n)]}
               for n in (150, 700, 255, 256, 300, 511, 129, 400, 620, 200)]
    params = [greedy(20 + 4 * i) for i in range(len(prompts))]
    want = _gpu_llm(path, True).generate(prompts, params, use_tqdm=False)  # first: compiles the kernels
    llm = _gpu_llm(path, False)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.graphs, llm.engine.runner.graphs_off_reason
    got = llm.generate(prompts, params, use_tqdm=False)
    assert set(graphs.runs) == set(SIZES), f"replayed sizes {sorted(graphs.runs)}"
    same = ties = 0
    for i, (g, e) in enumerate(zip(got, want)):
        assert g.error is None and e.error is None
        tg, te = g.outputs[0].token_ids, e.outputs[0].token_ids
        j = next((k for k in range(len(te)) if tg[k] != te[k]), len(te))
        for k in range(j):
            lg, le = g.outputs[0].logprobs[k][tg[k]].logprob, e.outputs[0].logprobs[k][te[k]].logprob
            assert abs(lg - le) < 0.1, f"request {i} token {k}: logprob {lg:.4f} (graphs) vs {le:.4f} (eager)"
        if j == len(te):
            same += 1
            continue
        top = sorted((lp.logprob for lp in e.outputs[0].logprobs[j].values()), reverse=True)
        assert top[0] - top[1] < TIE, (f"request {i}: graphs and eager part at token {j} where the eager run "
                                       f"was confident (top-2 gap {top[0] - top[1]:.3f} nats)")
        ties += 1
    assert same >= len(prompts) // 2, f"only {same} of {len(prompts)} requests identical ({ties} near-ties)"
