"""Decode graphs without a GPU: the padded static-buffer path (``DecodeGraphs`` with capture=False)
against the plain eager path on the embedded default model, which steps qualify, padding rows and the
KV cache, why graphs are off, and the config keys."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError, compose
from deepinfer_core.engine.graph_runner import DEFAULT_BATCH_SIZES, default_batch_sizes
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput
from hardware.cpu import CpuPlatform
from hardware.nvidia import NvidiaPlatform

SIZES = [1, 2, 4, 8]
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n", "for i in range(",
           "x = [", "def main():\n    args = ", "# read a file\nwith open(", "import sys\nimport json\n",
           "def add(a, b):\n    return", "while True:\n", "if __name__ == ", "try:\n    import numpy as np\n"]


def make_llm(padded: bool, **kw) -> LLM:
    opts = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=48, kv_cache_memory=4 << 20,
                graph_batch_sizes=SIZES, accelerator="cpu")
    opts.update(kw)
    llm = LLM(**opts)
    if padded:
        e = llm.engine
        e.runner.setup_graphs(e.platform, e.cfg, e.max_model_len, capture=False)
    return llm


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def eager_llm() -> LLM:
    return make_llm(False)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async_scheduling"])
def test_padded_static_path_generates_like_eager(overlap, eager_llm):
    """12 requests finishing one by one: decode batches of 12..9 (beyond the largest size: eager), 8..5
    (padded to 8), 4, 3 (padded to 4), 2 and 1, plus prefill chunks mixed with decodes (eager). With
    async scheduling the step's token ids are filled in on the device from the step before."""
    padded_llm = make_llm(True, async_scheduling=overlap)
    params = [greedy(3 + i) for i in range(len(PROMPTS))]
    graphs = padded_llm.engine.runner.graphs
    graphs.runs.clear()
    steps0 = padded_llm.engine.stats.steps
    a = padded_llm.generate(PROMPTS, params, use_tqdm=False)
    b = eager_llm.generate(PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.error is None and y.error is None
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lx = [x.outputs[0].logprobs[j][t].logprob for j, t in enumerate(x.outputs[0].token_ids)]
        ly = [y.outputs[0].logprobs[j][t].logprob for j, t in enumerate(y.outputs[0].token_ids)]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4
    assert set(graphs.runs) == {1, 2, 4, 8}
    assert graphs.runs[8] >= 4 and graphs.runs[4] >= 2  # 5..8 and 3..4 sequences were padded
    steps = padded_llm.engine.stats.steps - steps0
    assert sum(graphs.runs.values()) < steps  # prefill, mixed and 9..12-sequence steps ran eagerly


def _decoding(llm: LLM, n: int, tokens: int = 40) -> SchedulerOutput:
    """Admit ``n`` requests, step until every prompt is done, return the next (pure-decode) schedule."""
    e = llm.engine
    seqs = [e.add_request(p, greedy(tokens)) for p in PROMPTS[:n]]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        e.step()
    out = e.scheduler.schedule()
    assert not out.prefills and len(out.decodes) == n
    return out


@pytest.mark.parametrize("n", [3, 5])
def test_padded_rows_do_not_touch_kv_cache_and_logits_match(n):
    llm = make_llm(True)
    e, runner = llm.engine, llm.engine.runner
    batch = runner.prepare(_decoding(llm, n))
    assert runner.graphs.accepts(batch) and runner.graphs.padded_size(n) == (4 if n == 3 else 8)
    graphs = runner.graphs
    graphs.slot_mapping.fill_(0)  # what an earlier, larger step may leave in the padding rows
    graphs.seq_lens.fill_(7)
    before = [c.clone() for c in e.kv_caches["latent"]]
    logits_padded = runner.forward(batch)
    after_padded = [c.clone() for c in e.kv_caches["latent"]]
    for c, b in zip(e.kv_caches["latent"], before):
        c.copy_(b)
    runner.graphs = None
    logits_eager = runner.forward(batch)
    runner.graphs = graphs
    assert logits_padded.shape == logits_eager.shape == (n, e.model_config.vocab_size)
    torch.testing.assert_close(logits_padded, logits_eager, rtol=1e-5, atol=1e-5)
    slots = sorted(batch.meta.slot_mapping.tolist())
    for layer, (p, q, b) in enumerate(zip(after_padded, e.kv_caches["latent"], before)):
        changed = ((p != b).any(-1).flatten().nonzero().flatten()).tolist()
        assert changed == slots, f"layer {layer}: padded path wrote slots {changed}, the batch owns {slots}"
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert (graphs.slot_mapping[n:] == -1).all() and (graphs.seq_lens[n:] == 1).all()


def test_which_steps_replay():
    llm = make_llm(True)
    e, runner = llm.engine, llm.engine.runner
    g = runner.graphs
    out = _decoding(llm, 5)
    assert g.accepts(runner.prepare(out))
    kept = runner.prepare(out, keep_hidden=True)  # MTP drafts read the hidden states: the graph keeps them
    assert g.accepts(kept)
    logits = runner.forward(kept)
    runner.graphs, hidden = None, kept.hidden
    torch.testing.assert_close(runner.forward(kept), logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept.hidden, hidden, rtol=1e-5, atol=1e-5)
    runner.graphs = g
    s0 = out.decodes[0].seq
    e.blocks.allocate(s0, s0.num_tokens + 2)
    ragged = runner.prepare(out, draft_tokens={s0.request_id: [5, 6]})  # speculative verification
    assert ragged.meta.decode.max_q_len == 3 and not g.accepts(ragged)  # no speculation configured: no verify graphs
    logits = runner.forward(ragged)  # still correct through the eager path
    assert logits.shape == (len(ragged.logit_rows), e.model_config.vocab_size)
    prefill = SchedulerOutput(prefills=[ScheduledSeq(out.decodes[1].seq, 1)], decodes=out.decodes[2:])
    assert not g.accepts(runner.prepare(prefill))
    big = make_llm(True, graph_batch_sizes=[1, 2, 4])
    assert not big.engine.runner.graphs.accepts(big.engine.runner.prepare(_decoding(big, 5)))  # 5 > 4


def test_why_graphs_are_off():
    llm = make_llm(False)
    runner = llm.engine.runner
    assert runner.graphs is None
    assert "does not support graph capture" in runner.graphs_off_reason
    cfg = compose(env={}, enforce_eager=True)
    assert runner.graphs_unavailable(NvidiaPlatform(), cfg) == "enforce_eager is set"
    assert "float32" in runner.graphs_unavailable(NvidiaPlatform(), compose(env={}))
    assert "does not support" in runner.graphs_unavailable(CpuPlatform(), compose(env={}))
    bf16 = make_llm(False, dtype="bfloat16").engine.runner
    assert bf16.graphs_unavailable(NvidiaPlatform(), compose(env={})) is None
    bf16.set_route_hook(lambda layer, w, i: (w, i))
    assert all(m.route_hook is not None for m in bf16.model.moe_layers().values())
    assert "moe_route_hook" in bf16.graphs_unavailable(NvidiaPlatform(), compose(env={}))


def test_default_batch_sizes():
    assert default_batch_sizes(256) == list(DEFAULT_BATCH_SIZES)
    assert default_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(1024)[-1] == 256  # larger decode batches run eagerly


@pytest.mark.parametrize("value, match", [
    ([], "empty list"),
    ([0, 4], "integers >= 1"),
    ([1, "8"], "integers >= 1"),
    ([1, True], "integers >= 1"),
    ([4, 4], "more than once"),
    ([1, 512], "above max_num_seqs=256"),
    ("1,2", "expects list or None"),
])
def test_bad_graph_batch_sizes(value, match):
    with pytest.raises(ConfigError, match="graph_batch_sizes") as info:
        compose(env={}, graph_batch_sizes=value)
    assert match in str(info.value)


def test_graph_config_from_toml_and_env(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("graph_batch_sizes = [1, 2, 3]\nenforce_eager = true\n")
    cfg = compose(config=str(path), env={})
    assert (cfg.graph_batch_sizes, cfg.enforce_eager) == ([1, 2, 3], True)
    assert compose(env={"DEEPINFER_GRAPH_BATCH_SIZES": "1, 8,16"}).graph_batch_sizes == [1, 8, 16]
    assert compose(env={"DEEPINFER_GRAPH_BATCH_SIZES": "none"}).graph_batch_sizes is None
    with pytest.raises(ConfigError, match="DEEPINFER_GRAPH_BATCH_SIZES.*list of integers"):
        compose(env={"DEEPINFER_GRAPH_BATCH_SIZES": "1,x"})
