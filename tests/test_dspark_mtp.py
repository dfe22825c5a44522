# ruff: noqa: F811  (pytest fixtures imported from spec_helpers are redefined as arguments)
"""DSpark with an MTP draft: the checkpoint's own MTP layer (``draft = "auto"``) and one shipped apart
from its target (``mtp.safetensors``) keep greedy outputs exact; the MTP layer's KV equals the
teacher-forced entries, also over steps without drafts (the catch-up); its lean step equals the
generic forward; the embedded model picks its shipped MTP layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_helpers import (  # noqa: F401
    BS,
    PROMPTS,
    _cache_dir,
    cheap_drafts,
    greedy,
    make,
    mtp_kv_and_teacher_forced,
    reference,
    run,
    tiny_mtp,
    tiny_mtp_dir,
)

from deepinfer_core import LLM
from deepinfer_core.config import ConfigError
from plugins.dspark import drafter as dspark_drafter
from plugins.dspark import feature as dspark_feature


def test_mtp_draft_auto(tiny_mtp, reference):
    llm = make(tiny_mtp)  # draft = "auto": the checkpoint's MTP layer
    cheap_drafts(llm)
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    m = llm.metrics()
    assert m["dspark_draft"] == "mtp" and m["dspark_verified"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    llm.engine.blocks.check_no_leaks()


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
    got, ref = mtp_kv_and_teacher_forced(eng, feat.source, seq, st.done, BS)
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


def test_auto_picks_shipped_mtp():
    """``draft = "auto"`` on the embedded model: the shipped MTP layer when present, else the draft model."""
    llm = LLM(features=["dspark"], dspark={"budget_policy": "fixed"}, max_num_seqs=4)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    want = "mtp" if (dspark_feature.DEFAULT_MTP / "mtp.safetensors").is_file() else "model"
    assert feat.source.kind == want and feat.head.trained
