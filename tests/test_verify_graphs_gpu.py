"""CUDA graphs for speculative verify steps on a GPU (a random-weight bfloat16 model of V2-Lite's
shapes, 2 layers, vocabulary 4096, LM head scaled so that logits are confident; no embedded weights
needed). For verify steps (requests with 0..3 drafts, padded to R = 4 rows each) and plain steps:

* the replay equals the same padded step run eagerly, bit for bit (logits, hidden states, KV writes),
  and padding rows write no KV;
* the padded step equals the unpadded eager step bit for bit once both run the same tiling
  (``op_trace.pinned_tiling``: GEMMs at one row count, MLA decode at one split count). As they run, the
  two differ by bfloat16 rounding only (cuBLAS picks kernels by the row count, the MLA split count
  follows it), which the LM head's scale magnifies; a layout bug (keys, positions, slots, rows) would
  break the bit equality and the message names the first op whose real rows differ;
* greedy tokens of the replay and of the eager step agree up to near-ties (``TIE``);
* a speculative engine replaying verify graphs generates plain eager decoding's tokens, up to near-ties.

With ``DEEPINFER_TL_DRYRUN=1`` and no GPU, :func:`test_verify_graph_kernels_compile` only compiles the
TileLang kernels of the verify graphs (ragged MLA decode with and without split-KV, MoE at n * R rows).
``examples/verify_graph_diag.py`` prints the per-layer, per-op differences behind these checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gpu_marks import GPU_OR_DRY, HAS_CUDA
from test_speculative import proposer_package  # noqa: F401

pytestmark = GPU_OR_DRY
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (DEEPINFER_TL_DRYRUN only compiles)")

SIZES = [1, 4, 16, 48]
K = 3  # drafts per request at most: verify graphs of 2..4 rows
SPLIT = 4  # MLA decode key splits when the padded and the eager step are compared at the same tiling
#: nats: a top-2 gap this small may flip under bfloat16 rounding differences. The LM head is scaled x40
#: (confident tokens), which puts the top logits at 130-185 on the H200, where bfloat16 steps by 1.0: there
#: the padded and the eager step moved a row's top-2 gap by up to 1.5 (examples/verify_graph_diag.py).
TIE = 4.0


def v2_config() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from random_checkpoint import shape_config

    raw = shape_config("v2-lite")
    raw.update(num_hidden_layers=2, vocab_size=4096)  # one dense, one MoE layer: every kernel shape
    return raw


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from random_checkpoint import write_config

    return str(write_config(tmp_path_factory.mktemp("v2_verify"), v2_config()))


def make_llm(path: str, eager: bool, **kw):
    from deepinfer_core import LLM

    opts = dict(accelerator="nvidia", dtype="bfloat16", load_format="random", seed=3, block_size=16,
                max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=1024, kv_cache_memory=1 << 30,
                graph_batch_sizes=SIZES, enforce_eager=eager, enable_prefix_caching=False)
    opts.update(kw)
    llm = LLM(path, **opts)
    with torch.no_grad():  # confident logits, so that a broken replay shows as a changed token
        llm.engine.model.lm_head.mul_(40.0)
    return llm


def greedy(n: int):
    from deepinfer_core import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


def compare(graph_outs, eager_outs) -> tuple[int, int]:
    """Tokens equal, or parting only at a near-tie of the eager run. Returns (identical, near-ties)."""
    same = ties = 0
    parts = []
    for i, (g, e) in enumerate(zip(graph_outs, eager_outs)):
        assert g.error is None and e.error is None
        tg, te = g.outputs[0].token_ids, e.outputs[0].token_ids
        assert len(tg) == len(te)
        j = next((k for k in range(len(te)) if tg[k] != te[k]), len(te))
        if j == len(te):
            same += 1
            continue
        top = sorted((lp.logprob for lp in e.outputs[0].logprobs[j].values()), reverse=True)
        parts.append((i, j, tg[j], te[j], top[0] - top[1]))
    print("requests parting (request, token, graph token, eager token, eager top-2 gap):", parts)
    for i, j, a, b, gap in parts:
        assert gap < TIE, (f"request {i}: graphs and eager part at token {j} ({a} vs {b}) "
                           f"where the eager run was confident (top-2 gap {gap:.3f} nats)")
        ties += 1
    return same, ties


@pytest.fixture(scope="module")
def graph_llm(model_path):
    llm = make_llm(model_path, False, async_scheduling=False)
    e = llm.engine
    e.runner.setup_graphs(e.platform, e.cfg, e.max_model_len, spec_k=K)  # what an engine with k = 3 captures
    g = e.runner.graphs
    assert g is not None and g.verify_sizes == {2: SIZES, 3: SIZES, 4: SIZES}, e.runner.graphs_off_reason
    print(f"captured {len(g.graphs)} graphs in {g.capture_seconds:.2f} s")
    assert g.capture_seconds < 30
    return llm


def _same_rows(padded_run, eager_run, model, N: int, what: str) -> None:
    """With the row-count-dependent ops pinned (``op_trace.pinned_tiling``: GEMMs at N rows, MLA decode
    at SPLIT key splits) the padded step's real rows equal the eager step's bit for bit; else the
    message names the first op (layer, op) whose real rows differ."""
    from op_trace import OpRecorder, compare_calls, first_difference, pinned_tiling

    with pinned_tiling(model, N, SPLIT):
        (lp, hp, dst) = padded_run()
        (le, he) = eager_run()
    if torch.equal(lp, le) and torch.equal(hp, he):
        return
    with pinned_tiling(model, N, SPLIT), OpRecorder(model) as rp:
        padded_run()
    with pinned_tiling(model, N, SPLIT), OpRecorder(model) as re_:
        eager_run()
    first = first_difference(compare_calls(rp, re_, dst, rerun=False))
    raise AssertionError(f"{what}: with the same tiling the padded step's real rows differ from the eager step's "
                         f"(logits max |diff| {(lp - le).abs().max().item():.3e}); first differing op: {first}")


def _greedy_agrees(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Greedy tokens equal, or the eager step had a near-tie there."""
    top = want.topk(2, dim=-1).values
    for r in range(want.shape[0]):
        gap = (top[r, 0] - top[r, 1]).item()
        assert got[r].argmax() == want[r].argmax() or gap < TIE, f"{what}: row {r} changed at a top-2 gap {gap:.3f}"


@needs_gpu
@pytest.mark.parametrize("n", [1, 3, 37])
def test_verify_replay_equals_padded_eager_and_eager(graph_llm, n):
    """Replay == the padded step run eagerly (bit for bit: logits, hidden states, KV); the padded step ==
    the eager step bit for bit once both use the same tiling (a layout bug cannot hide in rounding);
    padding rows write no KV; greedy tokens of the replay and the eager step agree up to near-ties."""
    from deepinfer_core.engine.graph_runner import DecodeGraphs

    e, runner = graph_llm.engine, graph_llm.engine.runner
    gen = torch.Generator().manual_seed(n)
    seqs = [e.add_request({"prompt_token_ids": torch.randint(4, 4096, (600 + 5 * i,), generator=gen).tolist()},
                          greedy(50)) for i in range(n)]
    try:
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
            e.step()
        out = e.scheduler.schedule()
        assert not out.prefills and len(out.decodes) == n
        counts = [(i + 3) % (K + 1) for i in range(n)]  # 3, 0, 1, 2, 3, ...
        drafts = {}
        for s, m in zip(out.decodes, counts):
            if m:
                e.blocks.allocate(s.seq, s.seq.num_tokens + m)
                drafts[s.seq.request_id] = torch.randint(4, 4096, (m,), generator=gen).tolist()
        for kind, batch in (("verify", runner.prepare(out, drafts, keep_hidden=True)),
                            ("plain", runner.prepare(out, keep_hidden=True))):
            _check_step(e, runner, batch, f"n={n} {kind} step", DecodeGraphs)
    finally:
        for s in seqs:
            e.abort(s.request_id)
        while e.has_unfinished():
            e.step()
    e.blocks.check_no_leaks()


def _check_step(e, runner, batch, what: str, DecodeGraphs) -> None:
    graphs, caches = runner.graphs, e.kv_caches["latent"]
    key = graphs.key(batch)
    assert key is not None and key in graphs.graphs, (what, key)
    n, R = key
    T = batch.input_ids.shape[0]
    q = graphs._q_lens(batch)
    dst = torch.tensor([i * R + j for i, m in enumerate(q) for j in range(m)], device=e.device)
    before = [c.clone() for c in caches]

    def restore():
        for c, b in zip(caches, before):
            c.copy_(b)

    padded = DecodeGraphs(e.model, e.kv_caches, graphs.sizes, graphs.max_blocks, e.device, capture=False,
                          block_size=e.block_size, verify_rows=K + 1)

    def padded_run():
        logits = padded.run(batch)
        hidden = batch.hidden
        restore()
        return logits, hidden, dst

    def eager_run():
        runner.graphs = None
        try:
            logits = runner.forward(batch)
        finally:
            runner.graphs = graphs
        restore()
        return logits, batch.hidden

    runs = (graphs.verify_runs if R > 1 else graphs.runs).copy()
    replayed, hidden_replayed = runner.forward(batch), batch.hidden
    assert (graphs.verify_runs if R > 1 else graphs.runs) != runs, f"{what}: no replay of {key}"
    kv_replayed = [c.clone() for c in caches]
    restore()
    logits_padded = padded.run(batch)
    kv_padded = [c.clone() for c in caches]
    restore()
    torch.cuda.synchronize()
    assert replayed.shape == (T, e.model_config.vocab_size)
    diff = (replayed - logits_padded).abs().max().item()
    print(f"{what} key={key}: replay vs padded eager max |diff| {diff:.3e}")
    assert torch.equal(replayed, logits_padded) and torch.equal(hidden_replayed, batch.hidden), what
    assert all(torch.equal(a, b) for a, b in zip(kv_replayed, kv_padded)), f"{what}: replay wrote other KV"
    slots = sorted(batch.meta.slot_mapping.tolist())
    for after, old in zip(kv_replayed, before):  # padding rows wrote nothing
        assert sorted((after != old).any(-1).flatten().nonzero().flatten().tolist()) == slots, what
    _same_rows(padded_run, eager_run, e.model, n * R, what)
    plain, _ = eager_run()
    print(f"{what}: free tiling, replay vs eager max |diff| {(replayed - plain).abs().max().item():.3e} "
          f"(max |logit| {plain.abs().max().item():.1f}); greedy tokens differ in "
          f"{(replayed.argmax(-1) != plain.argmax(-1)).sum().item()} of {T} rows")
    _greedy_agrees(replayed, plain, what)


@needs_gpu
def test_speculative_engine_with_verify_graphs_generates_plain_tokens(model_path, proposer_package):  # noqa: F811
    """An oracle proposer (k = 3, its last draft wrong every other step) on an engine that captures
    verify graphs from its speculative config: greedy tokens of plain eager decoding."""
    import toy_proposers

    gen = torch.Generator().manual_seed(8)
    prompts = [{"prompt_token_ids": torch.randint(4, 4096, (300 + 7 * i,), generator=gen).tolist()} for i in range(8)]
    want = make_llm(model_path, True).generate(prompts, greedy(48), use_tqdm=False)
    toy_proposers.Oracle.outputs = {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids
                                    for p, o in zip(prompts, want)}
    llm = make_llm(model_path, False, speculative={"proposer": "oracle", "k": K})
    g = llm.engine.runner.graphs
    assert g is not None and sorted(g.verify_sizes) == [2, 3, 4], llm.engine.runner.graphs_off_reason
    got = llm.generate(prompts, greedy(48), use_tqdm=False)
    same, ties = compare(got, want)
    m = llm.engine.metrics()
    print(f"speculative + verify graphs vs plain eager: {same}/8 identical, {ties} near-ties; verify replays "
          f"{dict(g.verify_runs)}, accepted {m['spec_accepted']}/{m['spec_verified']}")
    assert sum(g.verify_runs.values()) >= 10 and m["spec_accepted"] > 0
    llm.engine.blocks.check_no_leaks()


@pytest.mark.skipif(HAS_CUDA, reason="compile-only check for DEEPINFER_TL_DRYRUN=1 without a GPU")
@pytest.mark.parametrize("shape", ["default", "v2-lite"])
def test_verify_graph_kernels_compile(shape):
    """Every TileLang kernel a captured verify or plain step launches compiles for sm_90a: ragged MLA
    decode with split-KV (few rows) and without (n * R >= one wave of CTAs), MoE at n * R rows, the
    one-row GEMV."""
    import json

    from deepinfer_core.engine.graph_runner import DecodeGraphs
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.loader import EMBEDDED_MODEL, build_model
    from kernels_cpu import ReferenceKernels
    from kernels_cuda import CudaKernels

    raw = json.loads((EMBEDDED_MODEL / "config.json").read_text()) if shape == "default" else v2_config()
    cfg = ModelConfig.from_dict(raw)
    model = build_model(Kernels(CudaKernels, ReferenceKernels), cfg, torch.bfloat16, torch.device("cpu"), 1024)
    model.post_load()
    bs = 16
    kv = [torch.zeros(8, bs, cfg.kv_entry_dim, dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
    graphs = DecodeGraphs(model, {"latent": kv}, [1, 64], 1024 // bs + 1, torch.device("cpu"), capture=False,
                          block_size=bs, verify_rows=K + 1)
    with torch.inference_mode():
        for n, R in graphs.keys:  # plain keys too: the GEMV of one row at this vocabulary
            graphs._pad_from(0, R)
            graphs._forward(n, R)
