"""CUDA graphs for speculative verify steps on a GPU (a random-weight bfloat16 model of V2-Lite's
shapes, 2 layers, vocabulary 4096, LM head scaled so that logits are confident; no embedded weights
needed): a replayed verify step (requests with 0..3 drafts, padded to R = 4 rows each) equals the same
padded step run eagerly, matches the unpadded eager step's logits and greedy tokens (up to bfloat16
near-ties, as in ``test_cuda_graphs_gpu``), and writes KV at the batch's slots only; a speculative
engine replaying verify graphs generates plain eager decoding's tokens.

With ``DEEPINFER_TL_DRYRUN=1`` and no GPU, :func:`test_verify_graph_kernels_compile` only compiles the
TileLang kernels of the verify graphs (ragged MLA decode with and without split-KV, MoE at n * R rows).
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
TIE = 0.1  # nats: a top-2 gap this small may flip under bfloat16 rounding differences


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
    for i, (g, e) in enumerate(zip(graph_outs, eager_outs)):
        assert g.error is None and e.error is None
        tg, te = g.outputs[0].token_ids, e.outputs[0].token_ids
        assert len(tg) == len(te)
        j = next((k for k in range(len(te)) if tg[k] != te[k]), len(te))
        if j == len(te):
            same += 1
            continue
        top = sorted((lp.logprob for lp in e.outputs[0].logprobs[j].values()), reverse=True)
        assert top[0] - top[1] < TIE, (f"request {i}: graphs and eager part at token {j} ({tg[j]} vs {te[j]}) "
                                       f"where the eager run was confident (top-2 gap {top[0] - top[1]:.3f} nats)")
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


@needs_gpu
@pytest.mark.parametrize("n", [1, 3, 37])
def test_verify_replay_equals_padded_eager_and_eager(graph_llm, n):
    from deepinfer_core.engine.graph_runner import DecodeGraphs

    e, runner = graph_llm.engine, graph_llm.engine.runner
    gen = torch.Generator().manual_seed(n)
    seqs = [e.add_request({"prompt_token_ids": torch.randint(4, 4096, (600 + 5 * i,), generator=gen).tolist()},
                          greedy(50)) for i in range(n)]
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
    batch = runner.prepare(out, drafts)
    graphs = runner.graphs
    key = graphs.key(batch)
    assert key is not None and key[1] == max(counts) + 1 and key in graphs.graphs
    before = [c.clone() for c in e.kv_caches["latent"]]

    def restore():
        for c, b in zip(e.kv_caches["latent"], before):
            c.copy_(b)

    runs = graphs.verify_runs[key]
    replayed = runner.forward(batch)
    assert graphs.verify_runs[key] == runs + 1
    kv_replayed = [c.clone() for c in e.kv_caches["latent"]]
    restore()
    padded = DecodeGraphs(e.model, e.kv_caches, graphs.sizes, graphs.max_blocks, e.device, capture=False,
                          block_size=e.block_size, verify_rows=K + 1)
    padded_logits = padded.run(batch)
    restore()
    runner.graphs = None
    plain = runner.forward(batch)
    runner.graphs = graphs
    torch.cuda.synchronize()
    T = n + sum(counts)
    assert replayed.shape == plain.shape == (T, e.model_config.vocab_size)
    diff = (replayed - padded_logits).abs().max().item()
    print(f"n={n} key={key}: replay vs padded eager max |diff| {diff:.3e} (bitwise equal: {diff == 0})")
    torch.testing.assert_close(replayed, padded_logits, rtol=1e-2, atol=1e-2)
    # The unpadded eager step has T rows, the replay n * R: MLA's split-KV count differs, so bf16
    # rounding differs and a near-tie in MoE routing may move a row (see test_cuda_graphs_gpu)
    bad = [r for r in range(T) if not torch.allclose(replayed[r], plain[r], rtol=5e-2, atol=5e-2)]
    print(f"n={n}: rows differing from the unpadded eager step: {bad} of {T}; max |diff| "
          f"{(replayed - plain).abs().max().item():.3e}, max |logit| {plain.abs().max().item():.3e}")
    assert len(bad) <= T // 10, bad
    top = plain.float().log_softmax(-1).topk(2, dim=-1).values
    for r in range(T):  # greedy tokens: equal, or the eager step had a near-tie there
        if replayed[r].argmax() != plain[r].argmax():
            assert (top[r, 0] - top[r, 1]).item() < TIE, f"row {r}: greedy token differs at a confident row"
    slots = sorted(batch.meta.slot_mapping.tolist())
    for after, old in zip(kv_replayed, before):  # padding rows wrote nothing
        assert sorted((after != old).any(-1).flatten().nonzero().flatten().tolist()) == slots
    restore()
    one = runner.prepare(out)  # the same requests without drafts: a plain step, (n, 1) graphs
    assert graphs.key(one) == (graphs.padded_size(n), 1)
    got = runner.forward(one)
    restore()
    runner.graphs = None
    ref = runner.forward(one)
    runner.graphs = graphs
    bad = [r for r in range(n) if not torch.allclose(got[r], ref[r], rtol=5e-2, atol=5e-2)]
    print(f"n={n}: plain step, rows differing from eager: {bad} of {n}")
    assert len(bad) <= n // 10, bad
    for s in seqs:
        e.abort(s.request_id)
    while e.has_unfinished():
        e.step()
    e.blocks.check_no_leaks()


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
    """Every TileLang kernel a captured verify step launches compiles for sm_90a: ragged MLA decode
    with split-KV (few rows) and without (n * R >= one wave of CTAs), MoE at n * R rows."""
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
        for n, R in graphs.keys:
            if R > 1:
                graphs._pad_from(0, R)
                graphs._forward(n, R)
