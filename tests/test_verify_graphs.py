"""Graphs for speculative verify steps without a GPU: which (batch size, rows per request) keys exist
and which one a step takes (``graph_buckets``), the request-major padding, and the padded static-buffer
path (``DecodeGraphs`` with capture=False) against the eager path on a tiny V3 checkpoint: equal
logits and hidden states, KV written at the batch's slots only, greedy generation with drafts equal
to plain decoding."""

from __future__ import annotations

import pytest
import torch
from test_speculative import PROMPTS, greedy, make, plain, proposer_package, reference, run, tokens  # noqa: F401

from deepinfer_core.config import ConfigError, compose
from deepinfer_core.engine.graph_buckets import padded_layout, pick_key, verify_buckets
from deepinfer_core.scheduler import SchedulerOutput
from hardware.cpu import CpuPlatform
from hardware.nvidia import NvidiaPlatform

SIZES = [1, 2, 4, 8]


def test_verify_buckets_follow_k_and_the_token_bound():
    assert verify_buckets([1, 2, 4, 8, 16], 4, 32) == {2: [1, 2, 4, 8, 16], 3: [1, 2, 4, 8], 4: [1, 2, 4, 8]}
    assert verify_buckets([1, 2, 4, 8, 16], 1, 256) == {}  # no speculation: no verify graphs
    assert verify_buckets([4, 8], 3, 10) == {2: [4]}  # 3 rows x 4 > 10: no 3-row graph at all
    assert verify_buckets([1, 2], 5, 0) == {}  # verify_graph_tokens = 0: verify steps run eagerly


def test_pick_key_takes_fewest_rows_then_smallest_size():
    sizes, buckets = [1, 2, 4, 8], {2: [1, 2, 4, 8], 3: [1, 2, 4], 4: [1, 2]}
    assert pick_key(sizes, buckets, 3, 1) == (4, 1)
    assert pick_key(sizes, buckets, 9, 1) is None
    assert pick_key(sizes, buckets, 5, 2) == (8, 2)
    assert pick_key(sizes, buckets, 3, 3) == (4, 3)
    assert pick_key(sizes, buckets, 5, 3) is None  # no size >= 5 with 3 or 4 rows
    assert pick_key(sizes, buckets, 2, 4) == (2, 4)
    assert pick_key(sizes, buckets, 3, 4) is None
    assert pick_key(sizes, buckets, 1, 5) is None  # more rows than k + 1
    assert pick_key(sizes, {2: [1, 2], 4: [1, 2]}, 1, 3) == (1, 4)  # a missing R takes the next one
    assert pick_key(sizes, buckets, 0, 1) is None


def test_padded_layout_request_major_real_rows_first():
    dst, lens = padded_layout([1, 3, 2], [10, 20, 30], 4, 3)
    assert dst == [0, 3, 4, 5, 6, 7]
    # real row j of a request sees seq_len - R + j + 1 keys: the same as eagerly (seq_len - q + j + 1)
    assert lens == [12, 20, 31, 3]
    with pytest.raises(ValueError, match="do not fit 2 x 3"):
        padded_layout([1, 4], [5, 6], 2, 3)
    with pytest.raises(ValueError, match="do not fit 1 x 3"):
        padded_layout([1, 1], [5, 6], 1, 3)


def test_verify_graph_tokens_config():
    assert compose(env={}).verify_graph_tokens == 256
    assert compose(env={"DEEPINFER_VERIFY_GRAPH_TOKENS": "0"}).verify_graph_tokens == 0
    with pytest.raises(ConfigError, match="verify_graph_tokens"):
        compose(env={}, verify_graph_tokens=-1)
    assert NvidiaPlatform().supports_verify_graphs() and not CpuPlatform().supports_verify_graphs()


def _padded_llm(path, spec_k: int, **kw):
    llm = make(path, graph_batch_sizes=SIZES, **kw)
    e = llm.engine
    e.runner.setup_graphs(e.platform, e.cfg, e.max_model_len, capture=False, spec_k=spec_k)
    return llm


def _decoding(llm, n: int):
    e = llm.engine
    seqs = [e.add_request({"prompt_token_ids": p}, greedy(40)) for p in PROMPTS[:n]]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        e.step()
    out = e.scheduler.schedule()
    assert not out.prefills and len(out.decodes) == n
    return out


def _with_drafts(llm, out: SchedulerOutput, counts: list[int]) -> dict[str, list[int]]:
    drafts = {}
    for i, (s, m) in enumerate(zip(out.decodes, counts)):
        if m:
            llm.engine.blocks.allocate(s.seq, s.seq.num_tokens + m)
            drafts[s.seq.request_id] = [(7 * i + j) % 50 + 4 for j in range(m)]
    return drafts


@pytest.mark.parametrize("counts", [[0, 3, 1, 2, 3], [1, 1, 1], [0, 0, 2]])
def test_padded_verify_step_matches_eager(tiny_v3_path, counts):
    """Requests with 0..3 drafts: logits, hidden states and the KV cache of the padded verify
    layout equal the eager step's; the padding rows write nothing."""
    llm = _padded_llm(tiny_v3_path, spec_k=3)
    e, runner = llm.engine, llm.engine.runner
    g = runner.graphs
    assert g.verify_sizes == {2: SIZES, 3: SIZES, 4: SIZES}
    out = _decoding(llm, len(counts))
    batch = runner.prepare(out, _with_drafts(llm, out, counts), keep_hidden=True)
    R = max(counts) + 1
    n = g.padded_size(len(counts))
    assert g.key(batch) == (n, R)
    g.slot_mapping.fill_(0)  # what an earlier, larger step may leave behind
    g.seq_lens.fill_(7)
    g.input_ids.fill_(3)
    before = {k: [c.clone() for c in v] for k, v in e.kv_caches.items()}
    logits_padded, hidden_padded = runner.forward(batch), batch.hidden
    after_padded = {k: [c.clone() for c in v] for k, v in e.kv_caches.items()}
    for k, v in e.kv_caches.items():
        for c, b in zip(v, before[k]):
            c.copy_(b)
    runner.graphs = None
    batch.hidden = None
    logits_eager = runner.forward(batch)
    runner.graphs = g
    T = len(counts) + sum(counts)
    assert logits_padded.shape == logits_eager.shape == (T, e.model_config.vocab_size)
    torch.testing.assert_close(logits_padded, logits_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden_padded, batch.hidden, rtol=1e-5, atol=1e-5)
    assert g.verify_runs == {(n, R): 1} and not g.runs
    slots = sorted(batch.meta.slot_mapping.tolist())
    for k in e.kv_caches:
        for layer, (p, q, b) in enumerate(zip(after_padded[k], e.kv_caches[k], before[k])):
            changed = ((p != b).reshape(p.shape[0] * p.shape[1], -1).any(-1).nonzero().flatten()).tolist()
            assert changed == slots, f"{k} layer {layer}: padded path wrote slots {changed}, the batch owns {slots}"
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    rows = {i * R + j for i, m in enumerate(counts) for j in range(m + 1)}  # request-major, real rows first
    assert {i for i, s in enumerate(g.slot_mapping[: n * R].tolist()) if s >= 0} == rows
    for s in out.decodes:
        e.abort(s.seq.request_id)
    while e.has_unfinished():
        e.step()
    e.blocks.check_no_leaks()


def test_padded_verify_step_bf16_bit_equal_and_a_layout_bug_is_named(tiny_v3_path, monkeypatch):
    """bfloat16: with the row-count-dependent ops pinned (``op_trace.pinned_tiling``, as the GPU test
    runs it) the padded verify step's real rows equal the eager step's bit for bit. A layout bug (each
    request's padded context one key too long) breaks that, and the op trace names the first op whose
    real rows differ: layer 0's decode attention (``mla_decode``: pinned, the fused ``mla_decode_uv`` runs as
    its meaning through it)."""
    from op_trace import OpRecorder, compare_calls, first_difference, pinned_tiling

    import deepinfer_core.engine.graph_runner as graph_runner

    llm = _padded_llm(tiny_v3_path, spec_k=3, dtype="bfloat16")
    e, runner = llm.engine, llm.engine.runner
    g, model = runner.graphs, llm.engine.model
    counts = [3, 0, 1]
    out = _decoding(llm, len(counts))
    batch = runner.prepare(out, _with_drafts(llm, out, counts), keep_hidden=True)
    n, R = g.key(batch)
    dst = torch.tensor([i * R + j for i, m in enumerate(counts) for j in range(m + 1)])
    before = [c.clone() for c in e.kv_caches["latent"]]

    def run(padded: bool):
        runner.graphs = g if padded else None
        with pinned_tiling(model, n * R, 4), OpRecorder(model) as rec:
            logits = runner.forward(batch)
        runner.graphs = g
        for c, b in zip(e.kv_caches["latent"], before):
            c.copy_(b)
        return logits, batch.hidden, rec

    lp, hp, rp = run(True)
    le, he, re_ = run(False)
    assert lp.dtype == torch.float32 and he.dtype == torch.bfloat16
    assert torch.equal(lp, le) and torch.equal(hp, he)
    assert first_difference(compare_calls(rp, re_, dst, rerun=False)) is None
    true_layout = graph_runner.padded_layout
    monkeypatch.setattr(graph_runner, "padded_layout",
                        lambda q, lens, n, R: true_layout(q, [s + 1 for s in lens], n, R))
    lb, _, rb = run(True)
    assert not torch.equal(lb, le)
    first = first_difference(compare_calls(rb, re_, dst, rerun=False))
    assert (first["layer"], first["op"]) == (0, "mla_decode"), first
    for s in out.decodes:
        e.abort(s.seq.request_id)
    while e.has_unfinished():
        e.step()
    e.blocks.check_no_leaks()


def test_which_verify_steps_replay(tiny_v3_path):
    llm = _padded_llm(tiny_v3_path, spec_k=2, verify_graph_tokens=8)
    runner = llm.engine.runner
    g = runner.graphs
    assert g.verify_sizes == {2: [1, 2, 4], 3: [1, 2]}
    out = _decoding(llm, 3)
    drafts = _with_drafts(llm, out, [1, 0, 2])
    assert g.key(runner.prepare(out, drafts)) is None  # 3 requests x 3 rows: no such graph (n * R <= 8)
    two = SchedulerOutput(decodes=out.decodes[:2])
    assert g.key(runner.prepare(two, drafts)) == (2, 2)
    llm.engine.blocks.allocate(two.decodes[0].seq, two.decodes[0].seq.num_tokens + 3)
    assert g.key(runner.prepare(two, {k: v + [9, 9] for k, v in drafts.items()})) is None  # 4 rows > k + 1
    assert g.key(runner.prepare(out)) == (4, 1)  # a plain step
    # request 1 (no draft) pads to 2 rows: its padding row reads key num_tokens + 1; without that
    # block-table column the step runs eagerly
    batch = runner.prepare(two, drafts)
    g.max_blocks = batch.meta.decode.block_tables.shape[1]
    g.block_size = two.decodes[1].seq.num_tokens // g.max_blocks
    assert g.max_blocks * g.block_size < two.decodes[1].seq.num_tokens + 1
    assert g.key(batch) is None
    for s in out.decodes:
        llm.engine.abort(s.seq.request_id)


def test_engine_greedy_with_verify_graphs_equals_plain(tiny_v3_path, proposer_package, reference):  # noqa: F811
    """An oracle proposer (its last draft wrong every other step, fewer drafts near the end): the
    speculative engine through the padded verify path emits plain decoding's tokens, leaks nothing."""
    import toy_proposers

    toy_proposers.Oracle.outputs = {tuple(p): t for p, t in zip(PROMPTS, tokens(reference))}
    llm = make(tiny_v3_path, speculative={"proposer": "oracle", "k": 4}, graph_batch_sizes=SIZES)
    e = llm.engine
    e.runner.setup_graphs(e.platform, e.cfg, e.max_model_len, capture=False, spec_k=e.spec.k)
    g = e.runner.graphs
    assert sorted(g.verify_sizes) == [2, 3, 4, 5]
    outs = run(llm, [greedy(logprobs=2) for _ in PROMPTS])
    assert tokens(outs) == tokens(reference)
    assert sum(g.verify_runs.values()) >= 3 and e.metrics()["spec_accepted"] > 0
    for o, r in zip(outs, reference):
        lo = [o.outputs[0].logprobs[j][t].logprob for j, t in enumerate(o.outputs[0].token_ids)]
        lr = [r.outputs[0].logprobs[j][t].logprob for j, t in enumerate(r.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(lo, lr)) < 1e-4


def test_v4_padded_verify_step_matches_eager():
    """DeepSeek-V4 (``tiny-v4``: window, compressed and compressor-state cache groups): the padded
    verify layout gives the eager step's logits; padding rows write no entry of any group."""
    from deepinfer_core import LLM

    llm = LLM(model="tiny-v4", dtype="float32", accelerator="cpu", max_num_seqs=8, max_num_batched_tokens=64,
              kv_cache_memory=16 << 20, graph_batch_sizes=SIZES, enable_prefix_caching=False)
    e, runner = llm.engine, llm.engine.runner
    runner.setup_graphs(e.platform, e.cfg, e.max_model_len, capture=False, spec_k=3)
    g = runner.graphs
    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n"]
    seqs = [e.add_request(p, greedy(60)) for p in prompts]
    for _ in range(30):  # past the first compressed entries
        e.step()
    out = e.scheduler.schedule()
    assert not out.prefills and len(out.decodes) == 3 and all(s.seq in seqs for s in out.decodes)
    batch = runner.prepare(out, _with_drafts(llm, out, [2, 0, 3]))
    assert g.key(batch) == (4, 4)
    g.input_ids.fill_(3)
    before = {k: [c.clone() for c in v] for k, v in e.kv_caches.items()}
    logits_padded = runner.forward(batch)
    after_padded = {k: [c.clone() for c in v] for k, v in e.kv_caches.items()}
    for k, v in e.kv_caches.items():
        for c, b in zip(v, before[k]):
            c.copy_(b)
    runner.graphs = None
    logits_eager = runner.forward(batch)
    runner.graphs = g
    torch.testing.assert_close(logits_padded, logits_eager, rtol=1e-5, atol=1e-5)
    for k in e.kv_caches:
        for p, q in zip(after_padded[k], e.kv_caches[k]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
