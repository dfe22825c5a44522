"""Why a padded verify step (``DecodeGraphs``: request-major rows, R per request) differs from the eager
step of the same requests, op by op, on a random-weight bf16 model (V2-Lite's shapes by default).

    python examples/verify_graph_diag.py --out diag.json [--shape v2-lite --layers 2 --n 3 8 --head-scale 40]

For each batch of n requests with 0..3 drafts (the GPU test's batches):

* replay: the captured graph against the same padded step run eagerly (bit-equal: capture is right);
* pinned: the padded and the eager step with the row-count-dependent ops pinned (``tests/op_trace.py``:
  GEMMs at one row count, MLA decode at one split count). Real rows must be bit-equal; else the first
  op whose real rows differ is printed: a layout bug, with its layer and op;
* free: the two steps as they run (GEMMs at n*R vs T rows, the split count of each), per layer and op
  the largest |difference| of the real rows (``acc``: carried from earlier ops too; ``local``: the op
  re-run on the padded layout with the eager inputs, its own share), and both against a float32 copy of
  the model (reference ops) on the same cache: rounding shows as two errors of one size;
* the plain step of the same requests ((n, 1) graph): the same three checks;
* with ``--engine``: a speculative engine (oracle proposer, k = 3) replaying verify graphs against plain
  eager decoding, the first token where each request parts and the eager top-2 gap there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))

from op_trace import OpRecorder, compare_calls, first_difference, pinned_tiling, summarize  # noqa: E402
from random_checkpoint import shape_config, write_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine.graph_runner import DecodeGraphs  # noqa: E402
from deepinfer_core.kernels import Kernels  # noqa: E402
from deepinfer_core.models.loader import build_model  # noqa: E402
from kernels_cpu import ReferenceKernels  # noqa: E402

K = 3
SIZES = [1, 4, 16, 48]


def make_llm(path: str, head_scale: float, eager: bool, **kw) -> LLM:
    opts = dict(dtype="bfloat16", load_format="random", seed=3, block_size=16, max_num_seqs=64,
                max_num_batched_tokens=4096, max_model_len=1024, kv_cache_memory=1 << 30,
                graph_batch_sizes=SIZES, enforce_eager=eager, enable_prefix_caching=False)
    opts.update(kw)
    llm = LLM(path, **opts)
    with torch.no_grad():
        llm.engine.model.lm_head.mul_(head_scale)
    return llm


def greedy(n: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def float32_copy(model):
    """The model in float32 with the same weights, on the reference ops (plain torch on the device)."""
    m = build_model(Kernels(ReferenceKernels, ReferenceKernels), model.cfg, torch.float32, model.lm_head.device,
                    model.cos_sin.shape[0])
    m.load_state_dict(model.state_dict(), strict=True)
    m.post_load()
    return m


def top2_shift(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest change, over rows, of b's top-2 logit gap when measured in a (what can flip a greedy token)."""
    t = b.topk(2, dim=-1).indices
    gb = b.gather(1, t[:, :1]) - b.gather(1, t[:, 1:])
    ga = a.gather(1, t[:, :1]) - a.gather(1, t[:, 1:])
    return (ga - gb).abs().max().item()


def step_report(llm, batch, dst: torch.Tensor, m32, n_split: int | None) -> dict:
    e, runner = llm.engine, llm.engine.runner
    g, model, caches = runner.graphs, e.model, e.kv_caches["latent"]
    before = [c.clone() for c in caches]

    def restore():
        for c, b in zip(caches, before):
            c.copy_(b)

    def eager():
        runner.graphs = None
        try:
            out = runner.forward(batch)
        finally:
            runner.graphs = g
        return out, batch.hidden

    batch.keep_hidden = True
    key = g.key(batch)
    N, T = key[0] * key[1], dst.numel()
    rep: dict = {"key": list(key), "T": T, "N": N}
    padded = DecodeGraphs(model, e.kv_caches, g.sizes, g.max_blocks, e.device, capture=False,
                          block_size=e.block_size, verify_rows=K + 1)
    if key in g.graphs:
        lr = runner.forward(batch)
        restore()
        lpe = padded.run(batch)
        restore()
        rep["replay_vs_padded_eager"] = (lr - lpe).abs().max().item()
    with OpRecorder(model) as rp:
        lp = padded.run(batch)
    hp = batch.hidden
    restore()
    with OpRecorder(model) as re_:
        le, he = eager()
    rows = compare_calls(rp, re_, dst)  # re-runs read the eager run's KV writes
    restore()
    rep["free"] = {"logits": (lp - le).abs().max().item(), "hidden": (hp.float() - he.float()).abs().max().item(),
                   "max_logit": le.abs().max().item(), "top2_shift": top2_shift(lp, le),
                   "argmax_differs": (lp.argmax(-1) != le.argmax(-1)).sum().item(), "ops": summarize(rows)}
    with pinned_tiling(model, N, n_split), OpRecorder(model) as pp:
        lp2 = padded.run(batch)
    hp2 = batch.hidden
    restore()
    with pinned_tiling(model, N, n_split), OpRecorder(model) as pe:
        le2, he2 = eager()
    restore()
    prow = compare_calls(pp, pe, dst, rerun=False)
    rep["pinned"] = {"logits_equal": torch.equal(lp2, le2), "hidden_equal": torch.equal(hp2, he2),
                     "logits": (lp2 - le2).abs().max().item(), "first_difference": first_difference(prow),
                     "ops_differing": sum(1 for r in prow if r["acc"])}
    if m32 is not None:
        c32 = {"latent": [b.float() for b in before]}
        with torch.inference_mode():
            h32 = m32(batch.input_ids, batch.positions, batch.meta, c32)
            l32 = m32.logits(h32)
        del c32
        t32 = l32.argmax(-1)
        top = l32.topk(2, dim=-1).values
        rep["float32"] = {"padded": (lp - l32).abs().max().item(), "eager": (le - l32).abs().max().item(),
                          "hidden_padded": (hp.float() - h32).abs().max().item(),
                          "hidden_eager": (he.float() - h32).abs().max().item(),
                          "argmax_padded_differs": (lp.argmax(-1) != t32).sum().item(),
                          "argmax_eager_differs": (le.argmax(-1) != t32).sum().item(),
                          "min_gap32": (top[:, 0] - top[:, 1]).min().item()}
    batch.keep_hidden = False
    return rep


def injected_bug_report(llm, batch, dst: torch.Tensor, n_split: int | None) -> dict:
    """The pinned comparison with a planted layout bug (each request's padded context one key too long):
    it must fail, naming layer 0's mla_decode."""
    import deepinfer_core.engine.graph_runner as graph_runner

    e, runner = llm.engine, llm.engine.runner
    g, model, caches = runner.graphs, e.model, e.kv_caches["latent"]
    before = [c.clone() for c in caches]
    key = g.key(batch)
    N = key[0] * key[1]
    padded = DecodeGraphs(model, e.kv_caches, g.sizes, g.max_blocks, e.device, capture=False,
                          block_size=e.block_size, verify_rows=K + 1)
    true_layout = graph_runner.padded_layout
    graph_runner.padded_layout = lambda q, lens, n, R: true_layout(q, [s + 1 for s in lens], n, R)
    try:
        with pinned_tiling(model, N, n_split), OpRecorder(model) as pp:
            lp = padded.run(batch)
    finally:
        graph_runner.padded_layout = true_layout
    for c, b in zip(caches, before):
        c.copy_(b)
    runner.graphs = None
    try:
        with pinned_tiling(model, N, n_split), OpRecorder(model) as pe:
            le = runner.forward(batch)
    finally:
        runner.graphs = g
    for c, b in zip(caches, before):
        c.copy_(b)
    return {"logits_equal": torch.equal(lp, le),
            "first_difference": first_difference(compare_calls(pp, pe, dst, rerun=False))}


def verify_batch(e, n: int, gen: torch.Generator, prompt_len: int):
    seqs = [e.add_request({"prompt_token_ids": torch.randint(4, 4096, (prompt_len + 5 * i,), generator=gen).tolist()},
                          greedy(50)) for i in range(n)]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        e.step()
    out = e.scheduler.schedule()
    assert not out.prefills and len(out.decodes) == n, (len(out.prefills), len(out.decodes))
    counts = [(i + 3) % (K + 1) for i in range(n)]
    drafts = {}
    for s, m in zip(out.decodes, counts):
        if m:
            e.blocks.allocate(s.seq, s.seq.num_tokens + m)
            drafts[s.seq.request_id] = torch.randint(4, 4096, (m,), generator=gen).tolist()
    return seqs, out, drafts, counts


def engine_report(path: str, scale: float, prompt_len: int) -> dict:
    """Speculative engine (oracle drafts, verify graphs) vs plain eager decoding: where each request parts."""
    import textwrap

    from test_speculative import PROPOSERS  # the toy proposers' module source

    root = Path(tempfile.mkdtemp())
    (root / "toy_proposers.py").write_text(PROPOSERS)
    info = root / "toy_proposers-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-proposers\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [deepinfer.proposers]
        oracle = toy_proposers:Oracle
        """))
    sys.path.insert(0, str(root))
    from stevedore import ExtensionManager

    ExtensionManager.ENTRY_POINT_CACHE.pop("deepinfer.proposers", None)  # stevedore lists a group once
    import toy_proposers

    gen = torch.Generator().manual_seed(8)
    prompts = [{"prompt_token_ids": torch.randint(4, 4096, (prompt_len // 2 + 7 * i,), generator=gen).tolist()}
               for i in range(8)]
    want = make_llm(path, scale, True).generate(prompts, greedy(48, 2), use_tqdm=False)
    toy_proposers.Oracle.outputs = {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids
                                    for p, o in zip(prompts, want)}
    llm = make_llm(path, scale, False, speculative={"proposer": "oracle", "k": K})
    got = llm.generate(prompts, greedy(48, 2), use_tqdm=False)
    parts = []
    for g, w in zip(got, want):
        tg, tw = g.outputs[0].token_ids, w.outputs[0].token_ids
        j = next((i for i in range(len(tw)) if tg[i] != tw[i]), None)
        gap = None
        if j is not None:
            top = sorted((lp.logprob for lp in w.outputs[0].logprobs[j].values()), reverse=True)
            gap = top[0] - top[1]
        parts.append({"parts_at": j, "eager_gap": gap})
    return {"requests": parts, "verify_runs": {str(k): v for k, v in llm.engine.runner.graphs.verify_runs.items()}
            if llm.engine.runner.graphs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--n", type=int, nargs="+", default=[3, 8])
    ap.add_argument("--head-scale", type=float, default=40.0)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--split", type=int, default=4, help="pinned MLA split count (CUDA kernels)")
    ap.add_argument("--no-f32", action="store_true")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    t0 = time.perf_counter()
    raw = shape_config(a.shape)
    raw.update(num_hidden_layers=a.layers, vocab_size=a.vocab)
    path = str(write_config(Path(tempfile.mkdtemp()) / "model", raw))
    llm = make_llm(path, a.head_scale, False, async_scheduling=False)
    e = llm.engine
    capture = e.runner.graphs is not None
    e.runner.setup_graphs(e.platform, e.cfg, e.max_model_len, capture=capture, spec_k=K)
    print(f"{e.platform.name}: graphs captured {capture} ({len(e.runner.graphs.graphs)}), built in "
          f"{time.perf_counter() - t0:.1f} s")
    m32 = None if a.no_f32 else float32_copy(e.model)
    report: dict = {"args": {k: str(v) for k, v in vars(a).items()}, "steps": {}}
    gen = torch.Generator().manual_seed(1)
    for n in a.n:
        seqs, out, drafts, counts = verify_batch(e, n, gen, a.prompt_len)
        for kind, dr in (("verify", drafts), ("plain", None)):
            batch = e.runner.prepare(out, dr)
            starts = batch.row_starts
            if kind == "verify":
                key = e.runner.graphs.key(batch)
                R = key[1]
                dst = torch.tensor([i * R + j for i, q in enumerate(c + 1 for c in counts) for j in range(q)])
            else:
                dst = torch.arange(len(starts))
            dst = dst.to(e.device)
            rep = step_report(llm, batch, dst, m32, a.split)
            rep["counts"] = counts if kind == "verify" else [0] * n
            report["steps"][f"{kind} n={n}"] = rep
            print_step(f"{kind} n={n}", rep)
            if kind == "verify" and n == a.n[0]:
                rep["injected_bug"] = bug = injected_bug_report(llm, batch, dst, a.split)
                fd = bug["first_difference"]
                print(f"  planted bug (padded context +1 key), pinned: logits bit-equal {bug['logits_equal']}, first "
                      f"differing op: " + (f"layer {fd['layer']} {fd['op']} {fd['acc']:.3e}" if fd else "none"))
        for s in seqs:
            e.abort(s.request_id)
        while e.has_unfinished():
            e.step()
        e.blocks.check_no_leaks()
    del m32
    if a.engine:
        rep = engine_report(path, a.head_scale, a.prompt_len)
        report["engine"] = rep
        print("engine (speculative + verify graphs vs plain eager), first differing token and eager top-2 gap: "
              + ", ".join(f"{r['parts_at']}:{r['eager_gap']:.3f}" if r["parts_at"] is not None else "same"
                          for r in rep["requests"]) + f"; verify replays {rep['verify_runs']}")
    a.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"done in {time.perf_counter() - t0:.1f} s -> {a.out}")


def print_step(name: str, rep: dict) -> None:
    f, p = rep["free"], rep["pinned"]
    line = f"== {name} key={tuple(rep['key'])} T={rep['T']} N={rep['N']} counts={rep['counts']}"
    if "replay_vs_padded_eager" in rep:
        line += f" | replay vs padded eager {rep['replay_vs_padded_eager']:.3e}"
    print(line)
    fd = p["first_difference"]
    print(f"  pinned (same GEMM rows, same MLA split): logits bit-equal {p['logits_equal']}, hidden bit-equal "
          f"{p['hidden_equal']}, max|diff| {p['logits']:.3e}, ops differing {p['ops_differing']}"
          + (f", first: layer {fd['layer']} {fd['op']} {fd['acc']:.3e} (|ref| {fd['ref']:.3e})" if fd else ""))
    print(f"  free: logits max|diff| {f['logits']:.3e} (max|logit| {f['max_logit']:.3e}), hidden {f['hidden']:.3e}, "
          f"top-2 gap shift {f['top2_shift']:.3f}, argmax differs in {f['argmax_differs']} of {rep['T']} rows")
    if "float32" in rep:
        r = rep["float32"]
        print(f"  vs float32: logits padded {r['padded']:.3e} eager {r['eager']:.3e}; hidden padded "
              f"{r['hidden_padded']:.3e} eager {r['hidden_eager']:.3e}; argmax != f32: padded "
              f"{r['argmax_padded_differs']} eager {r['argmax_eager_differs']} "
              f"(min f32 top-2 gap {r['min_gap32']:.3f})")
    ops = " ".join(f"{o['layer']}/{o['op']}:{o['acc']:.1e}" + (f"({o['local']:.1e})" if o["local"] is not None else "")
                   for o in f["ops"])
    print(f"  free per layer/op acc(local): {ops}")


if __name__ == "__main__":
    main()
