# ruff: noqa: F811  (pytest fixtures imported from spec_helpers are redefined as arguments)
"""The ``dspark`` feature: speculative decoding with a draft model or an MTP layer.

Engine-level behaviour: greedy outputs equal plain decoding (fixed and variable length, under
preemption, with a draft model, at dp = ep = 2); sampled runs are reproducible; a stop token among
accepted drafts ends the request; KV blocks of rejected drafts are given back; the lean draft path
equals the draft's forward; bad configurations are config errors naming the problem.

Elsewhere: the MTP draft in ``test_dspark_mtp.py``, the draft-length policies in
``test_dspark_policy.py``, the rejection sampler in ``test_rejection_sampler.py``, the confidence
head and its calibration in ``test_dspark_confidence.py``; shared setup in ``spec_helpers.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from spec_helpers import (  # noqa: F401
    BS,
    PROMPTS,
    _cache_dir,
    cheap_drafts,
    greedy,
    make,
    reference,
    run,
    tiny_draft,
    write_one_layer_draft,
)
from tiny_models import kv_bytes_per_block, rand_ids, write_checkpoint

from deepinfer_core import SamplingParams
from deepinfer_core.config import ConfigError
from plugins.dspark import feature as dspark_feature

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


# ---- the draft model's lean path ----------------------------------------------------------------------

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
    write_one_layer_draft(ckpt, draft)  # layer 0 is dense
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
