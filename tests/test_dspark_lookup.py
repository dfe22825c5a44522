# ruff: noqa: F811  (pytest fixtures imported from spec_helpers are redefined as arguments)
"""The confidence head's lookup features (``plugins/dspark/lookup.py``): the device's continuations
equal the host's (windows, tokens past the end), the features by hand, a head that reads them
survives save/load and refuses bad ones, the engine's confidences equal the head applied offline to
the logged features, and on the device path the lookup reads the tokens of the step in flight."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from spec_helpers import (  # noqa: F401
    _cache_dir,
    cheap_drafts,
    greedy,
    make,
    run,
    tiny_mtp_dir,
)

from plugins.dspark import confidence as conf_mod
from plugins.dspark import lookup
from plugins.dspark.confidence import EXTRA_FEATURES, ConfidenceHead
from plugins.dspark.head_fit import outcomes, predict

# prompts that repeat, so that the lookups find continuations
PROMPTS = [[5 + i, 9, 13 + i, 21] * (3 + i % 3) + [5 + i, 9] for i in range(6)]


def _lookup_head(C: int, seed: int) -> ConfidenceHead:
    g = torch.Generator().manual_seed(seed)
    return ConfidenceHead(torch.randn(C, generator=g) * 0.1, torch.randn(len(EXTRA_FEATURES), generator=g) * 0.5,
                          -0.3, 1.0, w_lookup=torch.randn(len(lookup.FEATURES), generator=g))


@pytest.fixture()
def mtp_with_lookup_head(tiny_mtp_dir, tiny_v3_path, tmp_path) -> str:
    out = tmp_path / "mtp_lookup"
    shutil.copytree(tiny_mtp_dir, out)
    C = json.loads((Path(tiny_v3_path) / "config.json").read_text())["hidden_size"]
    _lookup_head(C, 4).save(out / conf_mod.FILENAME)
    return str(out)


def test_device_continuations_equal_host():
    rng = random.Random(0)
    for _ in range(150):
        k = rng.randrange(1, 9)
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, lookup.WINDOW + 80))] for _ in range(4)]
        # the device's rows may start before the window and carry junk past the real tokens
        starts = [rng.randrange(0, max(1, len(s) - lookup.WINDOW + 1)) for s in seqs]
        rows = [s[a:] for a, s in zip(starts, seqs)]
        L = max(len(r) for r in rows) + rng.randrange(0, 5)
        hist = torch.tensor([r + [rng.randrange(3) for _ in range(L - len(r))] for r in rows])
        got = lookup.continuations(hist, torch.tensor([len(r) for r in rows]), k)
        assert got.tolist() == [lookup.continuations_host(s, k) for s in seqs]


def test_lookup_features_by_hand():
    toks = [5, 6, 7, 5, 6, 8, 5, 6]
    cont = lookup.continuations_host(toks, 3)
    # n=1: the last 6 before the end is at 4 -> 8, 5, 6; n=2: 5, 6 at 3..4 -> the same; n=3, 4: none
    assert cont == [[8, 5, 6], [8, 5, 6], [-1, -1, -1], [-1, -1, -1]]
    assert lookup.continuations_host([1, 2, 1], 3) == [[2, 1, -1], [-1] * 3, [-1] * 3, [-1] * 3]  # not past the end
    for short in ([], [7], [7, 7]):  # nothing or too little to look back on: no run, and the device agrees
        want = lookup.continuations_host(short, 2)
        assert all(c == [-1, -1] for c in want[1:]) and (len(short) < 2 or want[0] == [7, -1])
        if short:
            got = lookup.continuations(torch.tensor([short + [0, 0]]), torch.tensor([len(short)]), 2)
            assert got[0].tolist() == want
    N = len(lookup.NGRAMS)
    assert len(lookup.FEATURES) == 3 * N + 1
    f = lookup.features(torch.tensor([cont]), torch.tensor([[8, 5, 7]]))[0, :, : 3 * N].view(3, N, 3)
    assert f[:, 0].tolist() == [[1, 1, 1], [1, 1, 1], [1, 0, 0]]  # n=1: has, agree, run per depth
    assert f[:, 2].sum() == 0 and f[:, 3].sum() == 0
    f2 = lookup.features(torch.tensor([cont]), torch.tensor([[9, 5, 6]]))[0]
    assert f2[:, : 3 * N].view(3, N, 3)[:, 0].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 0]]  # a miss ends the run
    assert f2[:, -1].sum() == 0  # no override given
    w = torch.randn(len(lookup.FEATURES))
    rows = lookup.LookupRows([toks], 3, w, "cpu", log=True)
    per_depth = [rows.step(d + 1, torch.tensor([t])) for d, t in enumerate([9, 5, 6])] + \
        [rows.step(4, torch.tensor([6]))]  # past the continuation's length: no continuation there
    feats = torch.stack([f for _, f in per_depth[:3]], 1)  # [1, 3, len(FEATURES)]
    assert torch.equal(feats[0], f2)
    torch.testing.assert_close(torch.cat([t for t, _ in per_depth[:3]]), f2 @ w)  # the logit term
    assert per_depth[3][1].sum() == 0 and float(per_depth[3][0]) == 0.0


def test_drafts_follow_the_four_gram_run():
    """``lookup_drafts``: while the 4-gram run goes on, each draft is its token (an override where the
    draft's argmax differs), then the argmax again; rows that do not follow keep their argmax."""
    toks = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]  # the last 4 tokens occurred at 0..3: the run is 5, 6, 1, 2, 3, 4
    w = torch.randn(len(lookup.FEATURES))
    rows = lookup.LookupRows([toks, toks], 8, w, "cpu", log=True, follow=[True, False])
    got, overs, feats = [], [], []
    for depth, argmax in enumerate([9, 6, 7, 2, 3, 4, 8, 8], start=1):
        tok = rows.follow(depth, torch.tensor([argmax, argmax]))
        got.append(tok.tolist())
        overs.append(list(rows.overridden))
        feats.append(rows.step(depth, tok)[1])
    assert [g[0] for g in got] == [5, 6, 1, 2, 3, 4, 8, 8]  # the run ends after 6 tokens
    assert [g[1] for g in got] == [9, 6, 7, 2, 3, 4, 8, 8]
    assert [o[0] for o in overs] == [True, False, True, False, False, False, False, False]
    assert not any(o[1] for o in overs)
    f = torch.stack(feats, 1)  # [2, 8, len(FEATURES)]
    assert f[0, :, -1].tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    dev = lookup.features(torch.tensor([lookup.continuations_host(toks, 8)]), torch.tensor([[g[0] for g in got]]),
                          torch.tensor([[o[0] for o in overs]]))
    assert torch.equal(dev[0], f[0])  # the device's features of the same drafts


def test_lookup_head_round_trip_and_bad_names(tmp_path):
    from safetensors.torch import save_file

    head = _lookup_head(8, 1)
    head.save(tmp_path / "h.safetensors")
    got = ConfidenceHead.load(tmp_path / "h.safetensors", 8, 1.0)
    assert got.uses_lookup and not got.uses_target
    torch.testing.assert_close(got.w_lookup, head.w_lookup)
    g = torch.Generator().manual_seed(0)
    h, lq = torch.randn(5, 8, generator=g), -torch.rand(5, generator=g) * 4
    lq2, ent = lq - torch.rand(5, generator=g), torch.rand(5, generator=g)
    rows = torch.tensor([True, False, True, True, False])
    term = got.lookup_term((torch.rand(5, len(lookup.FEATURES), generator=g) > 0.5).float())
    torch.testing.assert_close(got.fast(h, lq, ent, rows, got.per_row(rows), lq2, term), got(h, lq, ent, rows, lq2,
                                                                                                None, term))
    assert not torch.allclose(got(h, lq, ent, rows, lq2, None, term), got(h, lq, ent, rows, lq2))
    base = {"w_hidden": torch.ones(8), "w_extra": torch.ones(len(EXTRA_FEATURES)), "bias": torch.zeros(1)}
    meta = {"extra_features": ",".join(EXTRA_FEATURES)}
    save_file({**base, "w_lookup": torch.ones(2)}, str(tmp_path / "names.safetensors"),
              metadata={**meta, "lookup_features": "lookup1_has,lookup9_run"})
    with pytest.raises(ValueError, match="lookup features"):
        ConfidenceHead.load(tmp_path / "names.safetensors", 8, 1.0)
    save_file({**base, "w_lookup": torch.ones(3)}, str(tmp_path / "shape.safetensors"),
              metadata={**meta, "lookup_features": ",".join(lookup.FEATURES)})
    with pytest.raises(ValueError, match=r"w_lookup has shape \(3,\), expected \(13,\)"):
        ConfidenceHead.load(tmp_path / "shape.safetensors", 8, 1.0)
    save_file(base, str(tmp_path / "missing.safetensors"),
              metadata={**meta, "lookup_features": ",".join(lookup.FEATURES)})
    with pytest.raises(ValueError, match="lists lookup_features, the file has no w_lookup"):
        ConfidenceHead.load(tmp_path / "missing.safetensors", 8, 1.0)


def test_engine_confidences_with_lookup_equal_offline_head(tiny_v3_path, mtp_with_lookup_head):
    """Host path: the confidences the engine used equal the head applied offline to the logged features,
    and the lookup features were there to read (repeating prompts)."""
    ref = [o.outputs[0].token_ids for o in run(make(tiny_v3_path, features=False), PROMPTS, greedy(16))]
    llm = make(tiny_v3_path, dspark={"draft": mtp_with_lookup_head, "k": 4, "budget_policy": "fixed"})
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    assert feat.head.uses_lookup and feat.lookup_drafts
    feat.outcome_log = []
    assert [o.outputs[0].token_ids for o in run(llm, PROMPTS, greedy(16))] == ref  # drafts follow runs: exact
    o = outcomes(feat.outcome_log)
    assert o.lookup is not None and o.lookup.shape[1] == len(lookup.FEATURES)
    assert float(o.lookup[:, 0].sum()) > 0 and float(o.lookup[:, 0].sum()) < len(o.lookup)  # some continuations
    logged = torch.tensor([c for r in feat.outcome_log for c in r[4]])
    decided = torch.cat([torch.arange(len(r[7])) < len(r[4]) for r in feat.outcome_log])
    torch.testing.assert_close(predict(feat.head, o)[decided], logged, atol=1e-5, rtol=1e-4)
    llm.engine.blocks.check_no_leaks()


def test_lookup_drafts_only_with_a_head_fitted_on_them(tiny_v3_path, mtp_with_lookup_head, tiny_mtp_dir):
    from deepinfer_core.config import ConfigError

    def follows(**opts) -> bool:
        llm = make(tiny_v3_path, dspark={"k": 3, **opts})
        return next(f for f in llm.engine.features if f.name == "dspark").lookup_drafts

    assert follows(draft=mtp_with_lookup_head)
    assert not follows(draft=mtp_with_lookup_head, lookup_drafts=False)
    assert not follows(draft=tiny_mtp_dir)  # no trained head: q(d) would read an overridden draft as unlikely
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="lookup_drafts expects bool"):
            make(tiny_v3_path, dspark={"draft": mtp_with_lookup_head, "lookup_drafts": bad})


def test_device_lookup_reads_the_tokens_in_flight(tiny_v3_path, mtp_with_lookup_head):
    """Async scheduling: each device draft's continuations equal the host's on the request's true
    tokens at that step (host-known plus in flight), and greedy output is unchanged."""
    prompts = PROMPTS + [([7, 11, 13] * 100)[:290]]  # past the lookup window: the device's window starts later
    plain = make(tiny_v3_path, features=False)
    ref = [o.outputs[0].token_ids for o in run(plain, prompts, greedy(24))]
    llm = make(tiny_v3_path, dspark={"draft": mtp_with_lookup_head, "k": 4, "budget_policy": "fixed"},
               async_scheduling=True)
    assert llm.engine.spec.on_device is not None
    cheap_drafts(llm)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    seen = []
    loop = feat._device_loop

    def spy(rows, carry, normed, prev_last, frac, cont=None):
        seen.append(([s.prompt_token_ids for s in rows.seqs], rows.base.tolist(), cont.clone()))
        toks, conf = loop(rows, carry, normed, prev_last, frac, cont)
        run = cont[:, lookup.FOLLOW, : toks.shape[1]]
        going = (run >= 0).long().cumprod(1).bool()
        assert torch.equal(toks[going], run[going])  # the drafts follow the 4-gram run while it goes on
        return toks, conf

    feat._device_loop = spy
    outs = run(llm, prompts, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == ref
    full = {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, outs)}
    assert len(seen) > 5
    for prompts, lengths, cont in seen:
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            assert cont[i].tolist() == lookup.continuations_host(full[tuple(p)][:n], cont.shape[2])
    assert any(bool((c >= 0).any()) for _, _, c in seen)
    assert any(n > lookup.WINDOW for _, lengths, _ in seen for n in lengths)  # the long prompt drafted
    llm.engine.blocks.check_no_leaks()
