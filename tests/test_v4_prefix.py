"""Prefix hits on DeepSeek-V4 (window cache groups): the decision flow of ``engine/window_prefix.py``,
``swa_prefix_policy`` end to end on the trained tiny V4 and on a random V4 config, window KV snapshots
(MXFP8, host memory), and the persistent tier (3fs) serving a fresh process.

Exactness: ``retain`` on device-resident window KV and ``recompute`` give the no-cache output (greedy
tokens, logprobs within 1e-4); ``bounded_replay`` and snapshot-fed hits are approximate: their greedy
agreement, largest logprob drift and replay tokens per hit are printed (``-s``) and bounded loosely."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_speculative import proposer_package  # noqa: F401  (fixture: a third-party proposer)

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.window_cache import snapshot_parts
from deepinfer_core.engine.window_prefix import NO_HIT, PrefixPlan, hit_cap_blocks, plan_prefix, window_unit

pytest.importorskip("deepinfer_core.models.deepseek_v4")

N_NEW = 10
TOL = 1e-4


# ---- the decision flow (pure) ---------------------------------------------------------------------
def _plan(policy, full_hit, L, present=lambda n: True, bs=128, window=128, lookback=6, layers=43):
    return plan_prefix(policy, full_hit, L, bs, window, lookback, layers, present)


@pytest.mark.parametrize("policy", ["retain", "bounded_replay", "recompute"])
def test_hit_at_l1_when_its_window_kv_is_cached(policy):
    assert _plan(policy, 10, 5000) == PrefixPlan(10, 1280, 1280, True)


def test_without_window_kv_each_policy_falls_back_its_way():
    absent = lambda n: False  # noqa: E731
    assert _plan("retain", 10, 5000, absent) == NO_HIT
    assert _plan("retain", 10, 5000, lambda n: n <= 7) == PrefixPlan(7, 896, 896, True)
    replay = _plan("bounded_replay", 10, 5000, absent)
    assert replay == PrefixPlan(10, 1152, 1280, False) and replay.replay_tokens == 128  # L1 - 128
    # recompute: layers * (window - 1) = 5461 tokens back, floored to a block (here: from 0)
    assert _plan("recompute", 10, 5000, absent) == PrefixPlan(10, 0, 1280, False)
    deep = _plan("recompute", 100, 20000, absent)
    assert deep.start == (12800 - 43 * 127) // 128 * 128 and deep.replay_until == 12800


def test_replay_cost_is_one_window_whatever_the_context():
    for L in (1000, 4000, 16000, 1 << 20):
        p = _plan("bounded_replay", L // 128, L, lambda n: False)
        assert p.replay_tokens == 128 and p.blocks == (L - 134) // 128


def test_the_cap_is_l_minus_window_plus_lookback():
    assert hit_cap_blocks(902, 128, 6, 128) == 6  # 902 - 134 = 768: exactly 6 blocks
    assert hit_cap_blocks(901, 128, 6, 128) == 5
    assert _plan("retain", 100, 902).blocks == 6 and _plan("retain", 100, 901).blocks == 5
    assert _plan("bounded_replay", 100, 902, lambda n: False) == PrefixPlan(6, 640, 768, False)


def test_prompts_shorter_than_one_window_never_hit():
    for L in (1, 100, 128, 133, 134, 261):
        assert _plan("bounded_replay", 5, L, lambda n: False) == NO_HIT
    # one block past the cap: the first hit, and its replay starts at token 0
    assert _plan("bounded_replay", 5, 262, lambda n: False) == PrefixPlan(1, 0, 128, False)


def test_hits_on_exact_block_boundaries():
    # the compressed hit ends exactly where the cap ends: both are whole blocks
    assert _plan("retain", 4, 4 * 128 + 134) == PrefixPlan(4, 512, 512, True)
    # window not block aligned (tiny V4: window 64, block 32): the unit is 2 blocks
    assert window_unit(64, 32) == 64 and window_unit(128, 128) == 128 and window_unit(8, 16) == 16
    p = _plan("bounded_replay", 9, 1000, lambda n: False, bs=32, window=64, lookback=1, layers=4)
    assert p == PrefixPlan(9, 224, 288, False)


def test_bad_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="swa_prefix_policy.*bounded_replay"):
        LLM(model="tiny-v4", swa_prefix_policy="replay")
    with pytest.raises(ValueError, match="swa_prefix_policy"):
        plan_prefix("nope", 1, 1000, 128, 128, 6, 43, lambda n: True)


def test_flash_snapshot_is_528_bytes_per_token_of_window_kv():
    from deepinfer_core.models.config_v4 import V4Config
    from deepinfer_core.models.deepseek_v4 import cache_layout

    raw = json.loads((Path(__file__).parents[1] / "deepinfer_core/assets/tiny_v4/config.json").read_text())
    swa, csa, hca = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    raw.update(hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512, index_head_dim=128,
               index_n_heads=64, index_topk=512, sliding_window=128, q_lora_rank=1024, o_groups=8,
               o_lora_rank=1024, compress_rates={csa: 4, hca: 128},
               layer_types=[swa, swa] + [csa if i % 2 == 0 else hca for i in range(41)],
               mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40)
    layout = cache_layout(V4Config.from_dict(raw))
    parts = {g.name: (len(g.layers), rows, width) for g, rows, width, _ in snapshot_parts(layout, 128, torch.bfloat16)}
    assert parts["swa"] == (43, 128, 528)  # 512 e4m3 bytes + 16 ue8m0 scales per token
    assert parts["csa_state"] == (21, 8, 2560 + 80)  # the CSA overlap inputs a resume needs, MXFP8 too
    assert set(parts) == {"swa", "csa_state"}
    mxfp8 = 43 * 128 * 528
    bf16 = 43 * 128 * 512 * 2
    print(f"\nV4-Flash window snapshot: window KV {mxfp8} B MXFP8 vs {bf16} B bf16 ({bf16 / mxfp8:.2f}x), "
          f"plus CSA overlap state {21 * 8 * 2640} B")


# ---- the engine on the trained tiny V4 ----------------------------------------------------------------
def _code_prompt(module: str, n: int) -> list[int]:
    """``n`` tokens of a Python stdlib module's source (the tiny V4 was trained on such code)."""
    from deepinfer_core.engine.tokenizer import HFTokenizer
    from deepinfer_core.models.loader import resolve_model_dir

    tok = getattr(_code_prompt, "tok", None) or HFTokenizer.load(resolve_model_dir("tiny-v4"), 0, [1])
    _code_prompt.tok = tok
    ids = tok.encode(inspect.getsource(__import__(module, fromlist=["_"])))
    assert len(ids) >= n, module
    return ids[:n]


MODULES = ("json.decoder", "textwrap", "shlex", "argparse", "difflib", "fractions", "configparser", "ipaddress")


def _llm(**kw) -> LLM:
    opts = dict(model="tiny-v4", dtype="float32", max_num_seqs=4, kv_cache_memory=64 << 20)
    opts.update(kw)
    return LLM(**opts)


def _gen(llm, prompt, n=N_NEW):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    assert out.error is None, out.error
    toks = out.outputs[0].token_ids
    return out, toks, [d[t].logprob for d, t in zip(out.outputs[0].logprobs, toks)]


@pytest.fixture(scope="module")
def reference():
    """No prefix cache: greedy tokens and logprobs per prompt."""
    llm = _llm(enable_prefix_caching=False)
    cache = {}

    def get(prompt):
        key = tuple(prompt)
        if key not in cache:
            _, toks, lps = _gen(llm, prompt)
            cache[key] = (toks, lps)
        return cache[key]

    yield get
    llm.shutdown()


def _forget_window_kv(engine) -> None:
    """Evict the window pools' cached blocks (what concurrent traffic does to them)."""
    for pool in engine.blocks.window_pools:
        for h in list(pool.block_of):
            pool.forget(h)


def _turn(module, first, second):
    """A first request and a second sharing ``first`` tokens with it, then diverging."""
    base = _code_prompt(module, second + 40)
    return base[:first], base[:second] + list(reversed(base[second: second + 40]))


def _hit(second: int, bs: int = 32, window: int = 64) -> int:
    """Tokens of the compressed hit of the second request: min(shared blocks, the cap)."""
    return min(second // bs, hit_cap_blocks(second + 40, window, 1, bs)) * bs


def test_retain_on_device_window_kv_is_exact(reference):
    llm = _llm(swa_prefix_policy="retain")
    e = llm.engine
    for module in MODULES[:3]:
        first, second = _turn(module, 300, 270)
        _gen(llm, first, 1)
        out, toks, lps = _gen(llm, second)
        ref_toks, ref_lps = reference(second)
        assert out.metrics.extra["window_prefix"]["window"] == "device"
        assert out.metrics.num_cached_tokens == _hit(270) == 224  # the cap: (310 - 65) // 32 = 7 blocks
        assert toks == ref_toks and max(abs(a - b) for a, b in zip(lps, ref_lps)) < TOL
    e.blocks.check_no_leaks()
    llm.shutdown()


def test_recompute_is_exact_and_bounded_replay_is_cheap(reference):
    """Both with the window KV evicted: recompute matches no cache; bounded replay recomputes one window
    (64 tokens for the tiny V4) whatever the prompt length, and mostly agrees."""
    agree, drift, replays = 0, 0.0, set()
    cases = [(m, 300, 270) for m in MODULES[:4]] + [(m, 900, 870) for m in MODULES[4:]]
    for policy in ("recompute", "bounded_replay"):
        llm = _llm(swa_prefix_policy=policy)
        e = llm.engine
        for module, first, second in cases:
            a, b = _turn(module, first, second)
            _gen(llm, a, 1)
            _forget_window_kv(e)
            out, toks, lps = _gen(llm, b)
            ref_toks, ref_lps = reference(b)
            info = out.metrics.extra["window_prefix"]
            assert info["window"] == policy and info["compressed_hit_tokens"] == _hit(second)
            if policy == "recompute":
                assert toks == ref_toks and max(abs(x - y) for x, y in zip(lps, ref_lps)) < TOL
                assert info["replay_tokens"] == min(info["compressed_hit_tokens"], (4 * 63 + 31) // 32 * 32)
            else:
                replays.add(info["replay_tokens"])
                same = toks == ref_toks
                agree += same
                k = next((i for i, (x, y) in enumerate(zip(toks, ref_toks)) if x != y), len(toks))
                drift = max(drift, max(abs(x - y) for x, y in zip(lps[:k + 1], ref_lps[:k + 1])))
        e.blocks.check_no_leaks()
        llm.shutdown()
    print(f"\nbounded_replay on the trained tiny V4: greedy agreement {agree}/{len(cases)}, max logprob drift "
          f"{drift:.2e} (up to the first differing token), replay tokens per hit {sorted(replays)}")
    assert replays == {64}  # one window (64 tokens, 2 blocks), at 300 and 900 tokens of context
    assert agree >= len(cases) * 3 // 4 and drift < 0.05


@pytest.mark.parametrize("async_on", [False, True])
def test_snapshots_follow_the_unit_rules_and_feed_retain_hits(reference, async_on):
    llm = _llm(swa_prefix_policy="retain", window_snapshots=True, async_scheduling=async_on)
    e = llm.engine
    wc = e.window_cache
    assert wc.unit == 64
    short = _code_prompt(MODULES[0], 60)
    _gen(llm, short, 2)
    assert wc.counters.snapshots == 0  # under one unit: nothing
    first, second = _turn(MODULES[1], 300, 290)  # a hit at 256: a unit boundary, where snapshots are
    _gen(llm, first, 100)  # prefill -> 256; decode 300..398 crosses 320 and 384
    assert wc.counters.snapshots == 3 and wc.counters.snapshot_bytes == 3 * wc.snapshot_bytes()
    swa = e.cache_layout.group("swa")
    assert wc.snapshot_bytes() == 4 * 64 * (64 + 2) + 2 * 8 * ((4 * 64 + 4 * 32) * 33 // 32)
    assert swa.entry_dim == 64 and wc.rows["swa"] == 64
    _forget_window_kv(e)
    out, toks, lps = _gen(llm, second)
    ref_toks, ref_lps = reference(second)
    assert out.metrics.extra["window_prefix"]["window"] == "snapshot" and out.metrics.num_cached_tokens == 256
    drift = max(abs(a - b) for a, b in zip(lps, ref_lps))
    print(f"\nsnapshot-fed retain hit (MXFP8 window KV): greedy equal {toks == ref_toks}, "
          f"max logprob drift {drift:.2e}")
    # MXFP8 keeps 3 mantissa bits (2% median relative error on these rows): the drift is the format's
    assert toks == ref_toks and drift < 0.15
    e.blocks.check_no_leaks()
    llm.shutdown()


def test_snapshots_share_the_host_tier_and_its_lru(tmp_path):
    """With [kv_store], snapshots live in the host tier's store: its capacity bounds them, LRU first."""
    llm = _llm(window_snapshots=True, kv_store={"backend": "3fs", "path": str(tmp_path / "kv"),
                                                "host_capacity_bytes": 30000})
    e = llm.engine
    wc, tiers = e.window_cache, e.pm.get_plugin("kv_tiers")
    assert wc.store is tiers.host and wc.snapshot_bytes() == 23232  # one fits in 30000 bytes, two do not
    # the persistent tier stores the compressed groups only; its fingerprint covers their layout
    assert [g.name for g in e.blocks.record_groups] == ["csa", "hca"] and e.blocks.external_hits is False
    other = _llm(kv_store={"backend": "3fs", "path": str(tmp_path / "kv2")}, swa_prefix_policy="bounded_replay",
                 block_size=64)
    assert other.engine.blocks.external_hits is True
    assert other.engine.pm.get_plugin("kv_tiers").layout.model_fingerprint != tiers.layout.model_fingerprint
    other.shutdown()
    prompts = [_code_prompt(m, 300) for m in MODULES[2:4]]
    _gen(llm, prompts[0], 1)
    first = e.blocks.prefix_hashes(e.new_sequence({"prompt_token_ids": prompts[0]}, None, "p"))[7]
    assert wc.counters.snapshots == 1 and wc._get(first) is not None
    _gen(llm, prompts[1], 1)
    assert wc.counters.snapshots == 2 and wc._get(first) is None  # evicted for the newer one
    assert tiers.host.used_bytes <= 30000 and tiers.host.stats().evictions >= 1
    llm.shutdown()


def test_spec_lookback_defaults_to_the_draft_length_plus_one(proposer_package):  # noqa: F811
    llm = _llm()
    assert llm.engine.window_cache.spec_lookback == 1  # no speculation
    llm.shutdown()
    llm = _llm(speculative={"proposer": "previous_token", "k": 5})
    assert llm.engine.window_cache.spec_lookback == 6  # the seed's 128 + 6 = 134 cap
    llm.shutdown()
    assert _llm(spec_lookback=0).engine.window_cache.spec_lookback == 0


# ---- a random V4 config ------------------------------------------------------------------------------
def test_random_v4_config_retain_and_recompute_are_exact(tmp_path):
    tiny_v4 = pytest.importorskip("tiny_v4")
    from tiny_models import rand_ids

    first = rand_ids(120, 5)
    second = first[:100] + rand_ids(30, 6)
    hf, _ = tiny_v4.build_separated("mixed", [first, second], seed=0)
    path = tiny_v4.save_checkpoint(hf, tmp_path / "v4")
    kw = dict(model=str(path), dtype="float32", block_size=16, max_num_seqs=2, kv_cache_memory=8 << 20)
    ref = LLM(enable_prefix_caching=False, **kw)
    _, ref_toks, ref_lps = _gen(ref, second, 8)
    for policy, evict, async_on in (("retain", False, True), ("recompute", True, True), ("bounded_replay", True, False),
                                    ("recompute", True, False)):
        llm = LLM(swa_prefix_policy=policy, async_scheduling=async_on, **kw)
        _gen(llm, first, 1)
        if evict:
            _forget_window_kv(llm.engine)
        out, toks, lps = _gen(llm, second, 8)
        assert out.metrics.extra["window_prefix"]["compressed_hit_tokens"] == 96  # min(6 blocks, cap 121 // 16)
        drift = max(abs(a - b) for a, b in zip(lps, ref_lps))
        if policy == "bounded_replay":
            print(f"\nbounded_replay, random V4 (window 8, 4 layers): tokens equal {toks == ref_toks}, "
                  f"drift {drift:.2e}, replay {out.metrics.extra['window_prefix']['replay_tokens']} tokens")
            assert out.metrics.extra["window_prefix"]["replay_tokens"] == 16
        else:
            assert toks == ref_toks and drift < TOL, (policy, drift)
        llm.engine.blocks.check_no_leaks()


# ---- the persistent tier ------------------------------------------------------------------------------
FRESH = """
import json, sys
from deepinfer_core import LLM, SamplingParams
prompt, store, policy = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
llm = LLM(model="tiny-v4", dtype="float32", max_num_seqs=4, kv_cache_memory=64 << 20, swa_prefix_policy=policy,
          kv_store={"backend": "3fs", "path": store, "offload_on_finish": True})
sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
(out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
toks = out.outputs[0].token_ids
print(json.dumps({"tokens": toks, "lps": [d[t].logprob for d, t in zip(out.outputs[0].logprobs, toks)],
                  "cached": out.metrics.num_cached_tokens, "tiers": out.metrics.num_cached_tokens_by_tier,
                  "info": out.metrics.extra.get("window_prefix"),
                  "loaded": llm.engine.metrics()["kv_tiers"]["loaded_blocks"]}))
llm.engine.blocks.check_no_leaks()
llm.shutdown()
"""


def _fresh_process(prompt, store, policy) -> dict:
    repo = Path(__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", FRESH, json.dumps(prompt), str(store), policy], cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fresh_process_hits_a_warm_store_then_recomputes_the_window(reference, tmp_path):
    store = tmp_path / "kv"
    prompt = _code_prompt(MODULES[3], 600)
    cold = _fresh_process(prompt, store, "recompute")  # writes the compressed blocks on finish
    assert cold["cached"] == 0 and cold["loaded"] == 0
    records = list(store.rglob("*.kvb"))
    assert len(records) == (600 + N_NEW - 1) // 32  # the full blocks of the computed tokens
    ref_toks, ref_lps = reference(prompt)
    warm = _fresh_process(prompt, store, "recompute")
    hit = hit_cap_blocks(600, 64, 1, 32) * 32  # 512: the compressed hit, from the persistent tier
    assert warm["info"] == {"compressed_hit_tokens": hit, "replay_tokens": 256, "window": "recompute"}
    assert warm["loaded"] == hit // 32 and warm["cached"] == hit - 256
    assert warm["tokens"] == ref_toks == cold["tokens"]
    assert max(abs(a - b) for a, b in zip(warm["lps"], ref_lps)) < TOL
    replay = _fresh_process(prompt, store, "bounded_replay")
    assert replay["info"]["replay_tokens"] == 64 and replay["cached"] == hit - 64
    print(f"\nfresh process, warm store, bounded_replay: tokens equal {replay['tokens'] == ref_toks}, drift "
          f"{max(abs(a - b) for a, b in zip(replay['lps'], ref_lps)):.2e}")
    # corrupt records are a miss: the request recomputes and still answers right
    for r in records:
        r.write_bytes(r.read_bytes()[:-7] + b"garbage")
    broken = _fresh_process(prompt, store, "recompute")
    assert broken["cached"] == 0 and broken["loaded"] == 0 and broken["tokens"] == ref_toks
