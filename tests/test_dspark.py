"""The ``dspark`` feature: speculative decoding with a draft model or an MTP layer.

Greedy outputs must equal plain decoding (fixed and variable length, under preemption, with a draft
model and with an MTP layer); the rejection sampler must reproduce the target's distribution; KV
blocks of rejected drafts are given back; the shipped draft's confidence head is calibrated; bad
configurations are config errors naming the problem.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sysconfig
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import kv_bytes_per_block, rand_ids, write_checkpoint

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.rejection import STREAM_DRAFT, SamplingRows, draw, filtered_probs, stream, verify
from plugins.dspark import drafter as dspark_drafter
from plugins.dspark import feature as dspark_feature
from plugins.dspark.policy import LiveCost, StepCost, choose_lengths, fixed_lengths, worth_drafting

BS = 4


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """Step-time curves of these tiny models go to a temporary cache."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "dspark_cache"))


def _copy_files(src: Path, dst: Path, skip=("model.safetensors",)) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            shutil.copy(f, dst / f.name)


@pytest.fixture(scope="session")
def tiny_draft(tiny_v3_path, tmp_path_factory) -> str:
    """A 1-layer draft: the target's embedding, first layer, final norm and LM head."""
    src, out = Path(tiny_v3_path), tmp_path_factory.mktemp("tiny_draft")
    _copy_files(src, out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in t.items() if k.startswith("model.layers.0.") or not k.startswith("model.layers.")},
              str(out / "model.safetensors"))
    return str(out)


@pytest.fixture(scope="session")
def tiny_mtp(tiny_v3_path, tmp_path_factory) -> str:
    """The tiny target plus an MTP layer ``model.layers.{N}`` (a copy of its last layer, random eh_proj)."""
    src, out = Path(tiny_v3_path), tmp_path_factory.mktemp("tiny_mtp")
    _copy_files(src, out)
    cfg = json.loads((src / "config.json").read_text())
    N = cfg["num_hidden_layers"]
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    C = cfg["hidden_size"]
    g = torch.Generator().manual_seed(7)
    last = f"model.layers.{N - 1}."
    for k, v in list(t.items()):
        if k.startswith(last):
            t[f"model.layers.{N}." + k[len(last):]] = v.clone()
    for name in ("enorm", "hnorm", "shared_head.norm"):
        t[f"model.layers.{N}.{name}.weight"] = torch.ones(C)
    t[f"model.layers.{N}.eh_proj.weight"] = torch.randn(C, 2 * C, generator=g) * 0.3
    save_file(t, str(out / "model.safetensors"))
    return str(out)


def make(path, features=True, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=16, kv_cache_memory=2 << 20)
    opts.update(kw)
    if features:
        opts.setdefault("features", ["dspark"])
    return LLM(str(path), **opts)


def cheap_drafts(llm: LLM) -> None:
    """A step-time curve on which drafting always pays (these random models' drafts are rarely
    confident), so that the variable-length path drafts, verifies and cuts."""
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1e-6, 1e-5]), adapt=False)


def run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o in outs:
        assert o.error is None, o.error
    return outs


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


PROMPTS = [rand_ids(6 + 5 * i, 50 + i) for i in range(8)]


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    plain = make(tiny_v3_path, features=False)
    return [o.outputs[0].token_ids for o in run(plain, PROMPTS, greedy(20, logprobs=0))]


# ---- greedy equivalence ------------------------------------------------------------------------------

@pytest.mark.parametrize("varlen", ["1", "0"])
@pytest.mark.parametrize("draft", ["tiny_draft", "self"])
def test_greedy_identical_to_plain(tiny_v3_path, tiny_draft, reference, monkeypatch, varlen, draft):
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", varlen)
    path = tiny_draft if draft == "tiny_draft" else tiny_v3_path  # "self": the target drafts for itself
    llm = make(tiny_v3_path, dspark={"draft": path, "k": 4})
    cheap_drafts(llm)
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["dspark_varlen"] is (varlen == "1")
    assert m["dspark_verified"] > 0
    if draft == "self":
        assert m["dspark_accept_rate"] > 0.95
        if varlen == "0":
            assert m["dspark_mean_accepted_len"] > 3
    for o in outs:
        assert 0.0 <= o.metrics.extra["accept_rate"] <= 1.0
        # the logprobs of accepted drafts come from the verify rows
        assert all(o.outputs[0].logprobs[j][t].logprob <= 0 for j, t in enumerate(o.outputs[0].token_ids))
    llm.engine.blocks.check_no_leaks()


def test_no_drafting_when_it_does_not_pay(tiny_v3_path, tiny_draft, reference, monkeypatch):
    """With drafts whose confidence is too low to pay for their steps, the throughput policy decodes
    plainly (drafts accepted 9 times in 10 would pay on this curve, so it explores now and then)."""
    llm = make(tiny_v3_path, dspark={"draft": tiny_draft})
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 1.0], [1, 1024], [0.003, 0.2]), adapt=False)
    feat.explore_every = 3  # exploratory drafts every few skipped steps, each for a few requests only
    monkeypatch.setattr(dspark_drafter, "LARGE_EXPLORE_EVERY", 3)  # (also at 8 requests and more)
    rows = []
    loop = feat._draft_loop
    feat._draft_loop = lambda r, states, *a: (rows.append(len(states)), loop(r, states, *a))
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["dspark_steps_without_drafts"] > 0 and m["dspark_verified_per_step"] < 0.5
    assert rows and max(rows) <= dspark_drafter.EXPLORE_ROWS < len(PROMPTS)
    llm.engine.blocks.check_no_leaks()


def test_greedy_identical_under_preemption(tiny_v3_path, reference):
    # 24 blocks of 4 tokens: each request fits alone, the batch does not -> preemption and recompute.
    # The draft (the same shape) keeps its KV inside the budget: twice the bytes per block.
    llm = make(tiny_v3_path, dspark={"draft": tiny_v3_path, "k": 5, "budget_policy": "fixed"},
               kv_cache_memory=24 * 2 * kv_bytes_per_block(tiny_v3_path, BS))
    assert llm.engine.blocks.num_blocks == 24 and set(llm.engine.kv_caches) == {"latent", "dspark"}
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert llm.metrics()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.metrics()["dspark_accepted"] > 0
    llm.engine.blocks.check_no_leaks()


def test_mtp_draft_auto(tiny_mtp, reference):
    llm = make(tiny_mtp)  # draft = "auto": the checkpoint's MTP layer
    cheap_drafts(llm)
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    m = llm.metrics()
    assert m["dspark_draft"] == "mtp" and m["dspark_verified"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    llm.engine.blocks.check_no_leaks()


@pytest.fixture(scope="session")
def tiny_mtp_dir(tiny_v3_path, tmp_path_factory) -> str:
    """An MTP layer shipped apart from its target (``mtp.safetensors``): a dense layer (the target's
    first), random eh_proj, as ``train_dspark_draft.py --kind mtp`` writes it."""
    src, out = Path(tiny_v3_path), tmp_path_factory.mktemp("tiny_mtp_dir")
    cfg = json.loads((src / "config.json").read_text())
    N, C = cfg["num_hidden_layers"], cfg["hidden_size"]
    t = load_file(str(src / "model.safetensors"))
    mtp = {f"model.layers.{N}." + k[len("model.layers.0."):]: v.clone() for k, v in t.items()
           if k.startswith("model.layers.0.")}
    assert f"model.layers.{N}.mlp.gate_proj.weight" in mtp  # layer 0 is dense
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{N}.{name}.weight"] = torch.ones(C)
    mtp[f"model.layers.{N}.eh_proj.weight"] = torch.randn(C, 2 * C, generator=torch.Generator().manual_seed(3)) * 0.3
    save_file(mtp, str(out / "mtp.safetensors"))
    return str(out)


@pytest.mark.parametrize("max_kept", [dspark_drafter.MAX_KEPT, 0])
def test_mtp_catches_up_on_steps_without_drafts(tiny_mtp, monkeypatch, max_kept):
    """Steps where a request does not draft still compute the target's hidden states; the MTP keeps
    them and its catch-up writes the draft KV of those positions when the request drafts again, equal
    to the KV of a run that drafted every step. (MAX_KEPT = 0 keeps nothing: the draft KV of the
    skipped positions is never written, as before this was fixed.)"""
    monkeypatch.setattr(dspark_drafter, "MAX_KEPT", max_kept)

    def draft_kv(skip: bool):
        llm = make(tiny_mtp, max_num_seqs=1, dspark={"k": 2})
        feat = next(f for f in llm.engine.features if f.name == "dspark")
        calls = [0]

        def worth(*_):  # drafting on one step in three
            calls[0] += 1
            return not skip or calls[0] % 3 == 0
        feat._worth_speculating = worth
        seq = llm.engine.add_request({"prompt_token_ids": PROMPTS[3]}, greedy(24))
        while seq.num_output_tokens < 14 or (skip and calls[0] % 3):
            llm.engine.step()
        done = seq.feature_state["dspark"].done
        cache = feat.source.caches[0]
        slots = [seq.block_table[p // BS] * BS + p % BS for p in range(done)]
        kv = cache.view(-1, cache.shape[-1])[slots].clone()
        tokens = list(seq.token_ids)
        llm.shutdown()
        return kv, tokens

    every, tokens = draft_kv(False)
    some, tokens_skip = draft_kv(True)
    n = min(len(every), len(some))
    assert n >= len(PROMPTS[3]) + 10 and tokens_skip[:n] == tokens[:n]
    same = torch.isclose(some[:n], every[:n], atol=1e-5).all(-1)
    if max_kept:
        assert same.all()
    else:
        assert not same.all()


@pytest.mark.parametrize("varlen", ["1", "0"])
def test_mtp_dir_draft(tiny_v3_path, tiny_mtp_dir, reference, monkeypatch, varlen):
    """A separately shipped (dense) MTP layer, named as the draft, keeps greedy outputs exact."""
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", varlen)
    llm = make(tiny_v3_path, dspark={"draft": tiny_mtp_dir, "k": 3})
    cheap_drafts(llm)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    assert type(feat.source.layer.mlp).__name__ == "MLP"  # dense, as the file holds mlp.gate_proj
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    m = llm.metrics()
    assert m["dspark_draft"] == "mtp" and m["dspark_verified"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    llm.engine.blocks.check_no_leaks()


def test_mtp_dir_missing_tensor(tiny_v3_path, tiny_mtp_dir, tmp_path):
    t = load_file(str(Path(tiny_mtp_dir) / "mtp.safetensors"))
    save_file({k: v for k, v in t.items() if not k.endswith("eh_proj.weight")}, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ConfigError, match="no MTP layer"):
        make(tiny_v3_path, dspark={"draft": str(tmp_path)})


def test_mtp_cache_matches_teacher_forced(tiny_mtp):
    """The MTP layer's KV for every position it has caught up on equals the entry computed from the
    target's teacher-forced hidden states; blocks beyond the drafts are never held."""
    llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed"})
    eng = llm.engine
    feat = next(f for f in eng.features if f.name == "dspark")
    seq = eng.add_request({"prompt_token_ids": PROMPTS[3]}, greedy(40))
    while seq.num_output_tokens < 20:
        eng.step()
        assert len(seq.block_table) <= -(-(seq.num_tokens + 3) // BS)
    st = seq.feature_state["dspark"]
    assert st.done >= seq.num_computed_tokens - 1 > 20
    ids = torch.tensor(seq.token_ids)
    L = len(ids)
    from deepinfer_core.models.metadata import AttentionMetadata, PrefillMeta

    cache = [torch.zeros(-(-L // BS), BS, c.shape[-1]) for c in eng.kv_caches["latent"]]
    cu = torch.tensor([0, L])
    meta = AttentionMetadata(L, torch.arange(L), PrefillMeta(cu, cu, torch.tensor([L]),
                                                             torch.arange(-(-L // BS))[None].int(), False), None)
    pos = torch.arange(L)
    with torch.inference_mode():
        hidden = eng.model(ids, pos, meta, {"latent": cache})
        src, k = feat.source, eng.kernels
        n = st.done
        e = k.rms_norm(eng.model.embed_tokens[ids[1 : n + 1]], src.enorm, src.eps)
        x = k.linear(torch.cat((e, k.rms_norm(hidden[:n], src.hnorm, src.eps)), -1), src.eh_proj)
        x = k.rms_norm(x, src.layer.input_layernorm, src.eps)
        attn = src.layer.self_attn
        latent, k_pe = k.linear(x, attn.kv_a_proj_with_mqa).split([attn.L, attn.R], dim=-1)
        ref = torch.cat((attn.kv_a_layernorm(latent), k.rope(k_pe[:, None], pos[:n], eng.model.cos_sin)[:, 0]), -1)
        slots = torch.tensor([seq.block_table[p // BS] * BS + p % BS for p in range(n)])
        got = src.caches[0].view(-1, ref.shape[-1])[slots]
    assert (got - ref).abs().max().item() < 1e-4
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_no_leaks()


@pytest.mark.parametrize("n_rows", [1, 2])
def test_mtp_lean_step_matches_forward(tiny_mtp, monkeypatch, n_rows):
    """An MTP draft step on the lean path equals the generic forward (carry and normalised state)."""
    from plugins.dspark.draft import MTPDraft

    llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed"})
    eng = llm.engine
    feat = next(f for f in eng.features if f.name == "dspark")
    seqs = [eng.add_request({"prompt_token_ids": PROMPTS[i]}, greedy(30)) for i in range(n_rows)]
    while min(s.num_output_tokens for s in seqs) < 8:
        eng.step()
    rows = dspark_feature._Rows(seqs, [3] * n_rows, BS, eng.device)
    tok = torch.tensor([s.token_ids[-1] for s in seqs])
    carry = torch.randn(n_rows, feat.source.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        lean = feat._ar_step(rows, tok, carry, 2)
        monkeypatch.delattr(MTPDraft, "decode")
        ref = feat._ar_step(rows, tok, carry, 2)
    for a, b in zip(lean, ref):
        assert (a - b).abs().max().item() < 1e-4
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_no_leaks()


def test_sampled_reproducible_and_no_leaks(tiny_v3_path, tiny_draft):
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seq_seed=10 + i, ignore_eos=True,
                             logprobs=1) for i in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        llm = make(tiny_v3_path, dspark={"draft": tiny_draft, "budget_policy": "fixed", "k": 3})
        runs.append([o.outputs[0].token_ids for o in run(llm, PROMPTS, params)])
        assert llm.metrics()["dspark_verified"] > 0
        llm.engine.blocks.check_no_leaks()
    assert runs[0] == runs[1]
    assert all(len(t) == 16 for t in runs[0])


def test_stop_inside_accepted_drafts(tiny_v3_path, reference):
    """A stop token among accepted drafts ends the request there; nothing after it is emitted."""
    llm = make(tiny_v3_path, dspark={"draft": tiny_v3_path, "k": 6, "budget_policy": "fixed"})
    stops = [ref[7] for ref in reference]
    outs = run(llm, PROMPTS, [greedy(20, stop_token_ids=[s]) for s in stops])
    for o, ref, s in zip(outs, reference, stops):
        cut = ref.index(s) + 1
        assert o.outputs[0].token_ids == ref[:cut]
        assert o.outputs[0].finish_reason == "stop"
    llm.engine.blocks.check_no_leaks()


# ---- the rejection sampler reproduces the target distribution ---------------------------------------

def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with target probability 0 was emitted"
    exp = probs[keep] * n
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("filtering", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.95)])
def test_rejection_sampler_matches_target_distribution(filtering):
    V, m, N = 8, 3, 20000
    g = torch.Generator().manual_seed(3)
    # a tiny random "model" and "draft": logits of the target for rows p_0..p_m, of the draft for q_1..q_m
    t_logits = torch.randn(m + 1, V, generator=g) * 1.5
    d_logits = t_logits[:m] + torch.randn(m, V, generator=g) * 1.0
    params = SamplingParams(**filtering)
    p = filtered_probs(t_logits, SamplingRows.from_params([params] * (m + 1), "cpu"))
    q = filtered_probs(d_logits, SamplingRows.from_params([params] * m, "cpu"))
    seeds = torch.arange(N, dtype=torch.long) * 7919 + 11
    first = 100
    # draft tokens drawn from q with the draft stream, exactly as the feature does
    drafts = torch.stack([draw(q[j].expand(N, V), stream(seeds, STREAM_DRAFT), torch.full((N,), first + j))
                          for j in range(m)], dim=1).tolist()
    tokens, accepted = verify(p.repeat(N, 1), q.repeat(N, 1), drafts, seeds, [first] * N, [False] * N)
    first_tok = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).float()
    assert _chi2_pvalue(first_tok, p[0]) > 1e-3
    # the second token, given that the first was d_1 = x, follows p_1 (rows built for that prefix)
    x = max(range(V), key=lambda t: sum(1 for d in drafts if d[0] == t))
    second = [t[1] for t, d in zip(tokens, drafts) if d[0] == x and t[0] == x and len(t) > 1]
    assert len(second) > 1000
    assert _chi2_pvalue(torch.bincount(torch.tensor(second), minlength=V).float(), p[1]) > 1e-3
    acc = sum(accepted) / (N * m)
    assert 0.05 < acc < 1.0
    # deterministic: the same seeds give the same tokens
    again, _ = verify(p.repeat(N, 1), q.repeat(N, 1), drafts, seeds, [first] * N, [False] * N)
    assert again == tokens


def test_rejection_sampler_greedy():
    out, acc = verify(None, None, [[1, 0], [1, 2], [2, 2]], torch.zeros(3, dtype=torch.long), [5, 5, 5],
                      [True] * 3, target_argmax=[1, 0, 2] + [1, 0, 2] + [1, 0, 2])
    assert out == [[1, 0, 2], [1, 0], [1]] and acc == [2, 1, 0]


# ---- policy --------------------------------------------------------------------------------------------

def test_policy_cuts_unlikely_drafts_and_respects_budget():
    cost = StepCost([1, 8, 64, 256], [0.010, 0.011, 0.020, 0.060], [1, 64], [0.001, 0.004])
    cum = [[0.95, 0.9, 0.85, 0.8], [0.3, 0.05, 0.01, 0.001]] + [[0.5, 0.2]] * 30
    lengths = choose_lengths(cum, base_tokens=32, budget=1000, cost=cost, fixed_s=0.005)
    assert lengths[0] == 4 and lengths[1] <= 1
    assert choose_lengths(cum, 32, 3, cost, 0.005)[0] <= 3 and sum(choose_lengths(cum, 32, 3, cost, 0.005)) <= 3
    assert fixed_lengths([5, 5, 2], 8) == [3, 3, 2]
    # drafting deeper: worth it for a confident request, not for an unlikely one
    assert worth_drafting([0.9], [0.95], 1, 2, 1.9, cost, 0.003, 3)
    assert not worth_drafting([0.05], [0.2], 1, 2, 1.05, cost, 0.003, 3)


def test_live_cost_follows_measured_times():
    """The policy's costs follow the real step times: scales converge to measured/predicted, one
    stall moves them little, idle gaps (cycle None) are not counted as overhead."""
    base = StepCost([1, 8], [0.010, 0.017], [1, 8], [0.002, 0.004])
    live = LiveCost(base)
    for _ in range(200):  # the machine runs 1.5x slower than at start-up; 3 ms per step outside forwards
        live.observe(tokens=4, verify_s=1.5 * base.verify(4), rows=1, steps=2, steps_s=1.5 * 2 * 0.002,
                     catchup_s=0.004, requests=1, cycle_s=1.5 * base.verify(4) + 0.006 + 0.004 + 0.003)
    assert live.verify_scale == pytest.approx(1.5, rel=0.02) and live.draft_scale == pytest.approx(1.5, rel=0.02)
    assert live.verify(8) == pytest.approx(1.5 * 0.017, rel=0.02)  # not seen: the scaled curve
    assert live.verify(4) == pytest.approx(1.5 * base.verify(4), rel=0.02)  # seen: its own running time
    for _ in range(100):  # verifying 2 tokens costs as much as 4 here, unlike the start-up curve's shape
        live.observe(2, 1.5 * base.verify(4), 1, 0, 0.0, 0.0, 1, None)
    assert live.verify(2) == pytest.approx(live.verify(4), rel=0.02) and live.verify(1) < live.verify(2)
    guess = live.verify(3)
    live.observe(3, 0.8 * guess, 1, 0, 0.0, 0.0, 1, None)  # a size's first sample replaces the curve's guess
    assert live.verify(3) == pytest.approx(0.8 * guess)
    assert live.catchup(1) == pytest.approx(0.004, rel=0.02)
    assert live.overhead(1) == pytest.approx(0.003, rel=0.05)
    assert live.drafting(1, 3) == pytest.approx(0.004 + 2 * 0.003, rel=0.02)
    before = (live.verify_scale, live.extra_overhead_s)
    live.observe(4, 50 * base.verify(4), 1, 2, 0.006, 0.004, 1, cycle_s=None)  # a stall, then an idle gap
    assert live.verify_scale < 1.1 * before[0] and live.extra_overhead_s == before[1]
    frozen = LiveCost(base, adapt=False)
    frozen.observe(4, 1.0, 1, 2, 1.0, 1.0, 1, 1.0)
    assert frozen.verify(4) == base.verify(4) and frozen.overhead(1) == base.overhead(1)



def test_live_cost_batch32_converges_to_linear_step_times():
    """Concurrency 32: the start-up curve (few requests per point) is concave, 32 -> 64 verified rows
    costing 1.3x, while the real forward grows linearly with rows. The live cost follows the real times
    at the sizes seen, a stale slow sample of the undrafted batch (32 rows, no longer seen once
    drafting runs) is capped by the cheaper larger sizes, and a plain step is not charged the draft's
    catch-up: drafting at confidence 0.85 then does not pay, as in reality."""
    ms = 1e-3
    base = StepCost([1, 6, 24, 48, 96, 192], [x * ms for x in (3.9, 4.8, 6.9, 8.7, 12.8, 20.7)], [1, 8, 32, 64],
                    [x * ms for x in (1.1, 1.9, 4.6, 9.3)])

    def real(tokens: int) -> float:
        return (1.0 + 0.3 * tokens) * ms

    live = LiveCost(base)
    live.observe(32, 2 * real(32), 0, 0, 0.0, 0.0, 32, None)  # a slow undrafted step, then drafting only
    for i in range(400):  # depth 2: catch-up 8 ms, one draft step 4.6 ms
        t = 33 + i % 40
        live.observe(t, real(t), 32, 1, 4.6 * ms, 8 * ms, 32, real(t) + 4.6 * ms + 8 * ms + 1 * ms)
    for t in (33, 50, 72):
        assert live.verify(t) == pytest.approx(real(t), rel=0.02)
    assert live.verify_seen[32] > 1.3 * real(32) and live.verify(32) <= live.verify(33)
    assert live.catchup(32) == pytest.approx(8 * ms, rel=0.02) and live.draft(32) == pytest.approx(4.6 * ms, rel=0.02)
    assert live.overhead(32) == pytest.approx(1 * ms, rel=0.05)
    conf = [0.85] * 32
    start = live.catchup(32) - live.draft(32)
    assert not worth_drafting([1.0] * 32, conf, 32, 32, 32, live, live.overhead(32), 5, start_s=start)
    # charging the plain step the catch-up too (the old baseline) makes drafting look worth it
    assert worth_drafting([1.0] * 32, conf, 32, 32, 32, live, live.overhead(32) + start, 5)
    # at batch 1 a confident draft still pays with the same costs
    assert worth_drafting([1.0], [0.85], 1, 1, 1, live, live.overhead(1), 5, start_s=live.catchup(1) - live.draft(1))

def test_live_catchup_scales_with_the_rows_it_covers():
    """The catch-up forward covers one row per accepted token: its cost learnt at batch 1 (3 rows per
    request) carries over to batch 32 as a draft step over 96 rows, not over 32."""
    ms = 1e-3
    base = StepCost([1, 6], [4 * ms, 5 * ms], [1, 8, 32, 64, 128], [x * ms for x in (1.0, 1.5, 3.0, 5.0, 9.0)])
    live = LiveCost(base)
    for _ in range(300):  # batch 1: the catch-up over 3 rows costs what the curve says for 3 rows
        live.observe(4, 5 * ms, 1, 1, 1 * ms, base.draft(3), 1, None, catchup_rows=3)
    assert live.catch_rows == pytest.approx(3, rel=0.02) and live.catchup_scale == pytest.approx(1, rel=0.02)
    assert live.catchup(32) == pytest.approx(base.draft(96), rel=0.03) and live.catchup(32) > 1.5 * base.draft(32)


@pytest.mark.parametrize("arch", ["v3", "v2_without_q_lora"])
def test_lean_draft_decode_matches_forward(tiny_v3_path, tmp_path, arch):
    """The lean draft path (folded weights, one GEMM per projection) equals the draft's generic
    forward: a 3-token catch-up span and single tokens of two requests of different lengths."""
    from plugins.dspark.draft import DraftModel
    from plugins.dspark.lean import context_slot_table

    path = tiny_v3_path if arch == "v3" else str(write_checkpoint(tmp_path, "v2", seed=3, q_lora_rank=None)[0])
    llm = make(path, features=False)
    eng = llm.engine
    # the 2-layer model drafting for itself (a dense and an MoE layer), into caches shaped like the target's
    src = DraftModel(eng, Path(path), caches=[torch.zeros_like(c) for c in eng.kv_caches["latent"]])
    dev = eng.device
    from deepinfer_core.engine.sequence import Sequence

    seqs = []
    for i, n in enumerate((23, 15)):
        s = Sequence(f"r{i}", None, rand_ids(n, 90 + i), greedy(1), 0, [])
        eng.blocks.allocate(s, n)
        seqs.append(s)
    bs = eng.block_size

    def run_both(items):
        ids = [s.token_ids[p] for s, _, lo, hi, _ in items for p in range(lo, hi)]
        pos = [p for _, _, lo, hi, _ in items for p in range(lo, hi)]
        slots = [s.block_table[p // bs] * bs + p % bs for s, _, lo, hi, _ in items for p in range(lo, hi)]
        ids_t, pos_t = torch.tensor(ids), torch.tensor(pos)
        pre = [it for it in items if it[2] == 0]
        dec = [it for it in items if it[2] > 0]
        ref = src.forward(ids_t, pos_t, dspark_feature.DSpark._meta(pre, dec, slots, dev))[1]
        if pre:
            return None
        table = context_slot_table(dspark_feature.DSpark._meta_tables(dec, dev), bs)
        which = torch.tensor([i for i, (_, _, lo, hi, _) in enumerate(dec) for _ in range(hi - lo)])
        lean = src.decode(ids_t, pos_t, torch.tensor(slots), table[which, : max(it[3] for it in dec)],
                          masked=len(ids) > 1)
        torch.testing.assert_close(lean, ref, rtol=1e-4, atol=1e-4)
        return lean

    with torch.inference_mode():
        run_both([(seqs[0], None, 0, 20, 0), (seqs[1], None, 0, 12, 0)])  # prefill the draft cache
        run_both([(seqs[0], None, 20, 23, 0), (seqs[1], None, 12, 13, 0)])  # catch-up spans of 3 and 1
        run_both([(seqs[1], None, 13, 14, 0)])  # one token, no mask
        run_both([(seqs[0], None, 22, 23, 0), (seqs[1], None, 14, 15, 0)])


def test_fast_confidence_matches_head():
    from plugins.dspark.confidence import EXTRA_FEATURES, ConfidenceHead

    g = torch.Generator().manual_seed(0)
    head = ConfidenceHead(torch.randn(16, generator=g), torch.randn(len(EXTRA_FEATURES), generator=g), 0.3, 1.3)
    h, logq, ent = torch.randn(6, 16, generator=g), -torch.rand(6, generator=g) * 40, torch.rand(6, generator=g)
    logq2 = logq - torch.rand(6, generator=g)
    greedy_rows = torch.tensor([True, False, True, True, False, False])
    torch.testing.assert_close(head.fast(h, logq, ent, greedy_rows, head.per_row(greedy_rows), logq2),
                               head(h, logq, ent, greedy_rows, logq2))


# ---- calibration of the shipped draft's confidence head --------------------------------------------------

def _heldout_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if zlib.crc32(rel.encode()) % 20 == 0 and "test" not in rel.split("/")[:-1] and path.stat().st_size < 200_000:
            files.append(path)
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 10:
            continue
        s = rng.randrange(len(lines) - 8)
        ids = tokenizer.encode("".join(lines[s : s + 40]))
        if len(ids) >= 48:
            out.append(ids[: rng.randint(40, 96)])
    return out


def test_auto_picks_shipped_mtp():
    """``draft = "auto"`` on the embedded model: the shipped MTP layer when present, else the draft model."""
    llm = LLM(features=["dspark"], dspark={"budget_policy": "fixed"}, max_num_seqs=4)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    want = "mtp" if (dspark_feature.DEFAULT_MTP / "mtp.safetensors").is_file() else "model"
    assert feat.source.kind == want and feat.head.trained


@pytest.mark.parametrize("asset,kind", [(dspark_feature.DEFAULT_MTP, "mtp"), (dspark_feature.DEFAULT_DRAFT, "model")])
def test_shipped_draft_confidence_calibrated(asset, kind):
    if not (asset / "confidence_head.safetensors").is_file():
        pytest.skip(f"no shipped draft in {asset}")
    llm = LLM(features=["dspark"], dspark={"budget_policy": "fixed", "draft": str(asset)}, max_num_seqs=64)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    assert feat.source.kind == kind and feat.head.trained
    feat.outcome_log = []
    prompts = _heldout_prompts(llm.tokenizer, 96)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=64, seq_seed=i)
              for i in range(len(prompts))]
    run(llm, prompts, params)
    pred = torch.tensor([c for r in feat.outcome_log for c in r[4]])
    obs = torch.tensor([a for r in feat.outcome_log for a in r[5]])
    assert len(pred) >= 3000  # ~0.03 standard error per decile
    order = pred.argsort()
    gaps = [abs(float(pred[c].mean()) - float(obs[c].mean())) for c in order.chunk(10)]
    assert max(gaps) <= 0.1, [round(g, 3) for g in gaps]
    llm.engine.blocks.check_no_leaks()


# ---- configuration errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 17, -1])
def test_k_out_of_range(tiny_v3_path, k):
    with pytest.raises(ConfigError, match=r"\bk\b"):
        make(tiny_v3_path, dspark={"k": k})


@pytest.mark.parametrize("section, word", [({"budget_policy": "greedy"}, "budget_policy"),
                                           ({"confidence_temperature": 0.0}, "confidence_temperature"),
                                           ({"verify_budget": -1}, "verify_budget"),
                                           ({"draft_model": "x"}, "draft_model")])
def test_bad_settings(tiny_v3_path, section, word):
    with pytest.raises(ConfigError, match=word):
        make(tiny_v3_path, dspark=section)


def test_no_mtp_and_no_draft(tiny_v3_path):
    with pytest.raises(ConfigError, match="MTP"):
        make(tiny_v3_path)
    with pytest.raises(ConfigError, match="MTP"):
        make(tiny_v3_path, dspark={"draft": "mtp"})


def test_draft_vocab_mismatch(tiny_v3_path, tmp_path):
    other, _ = write_checkpoint(tmp_path / "v96", "v3", seed=5, vocab_size=96, num_hidden_layers=1, tokenizer=False)
    with pytest.raises(ConfigError, match=r"96.*128|128.*96"):
        make(tiny_v3_path, dspark={"draft": str(other)})


def test_draft_tokenizer_mismatch(tiny_v3_path, tiny_draft, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft, draft)
    tk = json.loads((draft / "tokenizer.json").read_text())
    vocab = tk["model"]["vocab"]
    a, b = list(vocab)[10], list(vocab)[11]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, different token ids
    (draft / "tokenizer.json").write_text(json.dumps(tk))
    with pytest.raises(ConfigError, match="tokenizer"):
        make(tiny_v3_path, dspark={"draft": str(draft)})


# ---- dp = ep = 2 ----------------------------------------------------------------------------------

def test_dp_ep_2_with_dspark_equals_one_rank_without(tmp_path_factory, tmp_path):
    """Every rank drafts (a rank-local 1-layer draft), proposes and verifies its own requests; the
    target's verify forwards meet in the MoE all-to-alls (real gloo processes). Greedy outputs and
    logprobs equal dp = ep = 1 without DSpark; both ranks verified drafts."""
    from parallel_helpers import assert_same, ep_checkpoint, make_llm, workload

    ckpt = Path(ep_checkpoint(tmp_path_factory.getbasetemp()))
    draft = tmp_path / "ep_draft"
    _copy_files(ckpt, draft)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 1  # layer 0 is dense
    (draft / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v for k, v in t.items() if k.startswith("model.layers.0.") or not k.startswith("model.layers.")},
              str(draft / "model.safetensors"))
    ps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0) for _ in range(6)]
    prompts = workload(6)
    ref_llm = make_llm(ckpt)
    ref = ref_llm.generate(prompts, ps, use_tqdm=False)
    ref_llm.shutdown()
    llm = make_llm(ckpt, dp=2, ep=2, features=["dspark"],
                   dspark={"draft": str(draft), "k": 3, "budget_policy": "fixed"})
    try:
        outs = llm.generate(prompts, ps, use_tqdm=False)
        assert_same(outs, ref)
        m = llm.metrics()
        assert all(r["spec_verified"] > 0 for r in m["ranks"]), [r.get("spec_verified") for r in m["ranks"]]
    finally:
        llm.shutdown()


# ---- the threshold policy (the draft_lengths kernel op) -------------------------------------------

def test_threshold_policy_is_greedy_exact_and_cuts_by_cumulative_confidence(tiny_v3_path, reference):
    """``budget_policy = "threshold"``: the drafts offered are exactly those the ``draft_lengths``
    op keeps (cumulative confidence >= min_confidence, budget respected); greedy output unchanged."""
    llm = make(tiny_v3_path, dspark={"draft": tiny_v3_path, "k": 4, "budget_policy": "threshold",
                                     "min_confidence": 0.5, "verify_budget": 6})
    cheap_drafts(llm)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    seen = []
    orig = feat._threshold_lengths

    def spy(engine, conf, budget):
        out = orig(engine, conf, budget)
        seen.append((conf, budget, out))
        return out

    feat._threshold_lengths = spy
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert seen and llm.metrics()["dspark_verified"] > 0
    for conf, budget, lengths in seen:
        assert sum(lengths) <= budget
        for c, m in zip(conf, lengths):
            assert all(math.prod(c[: j + 1]) >= 0.5 - 1e-6 for j in range(m))
    assert any(m < len(c) for conf, _, lengths in seen for c, m in zip(conf, lengths))  # something was cut
    llm.engine.blocks.check_no_leaks()


def test_min_confidence_out_of_range(tiny_v3_path):
    with pytest.raises(ConfigError, match="min_confidence"):
        make(tiny_v3_path, dspark={"budget_policy": "threshold", "min_confidence": 1.5})
