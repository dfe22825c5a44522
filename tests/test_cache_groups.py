"""Cache groups derived from the model's declared layout (``kv_cache_spec``, ``KVCacheManager``).

The block-level rules are checked on the manager directly; the end-to-end behaviour on a
third-party model (``examples/third_party_model``: sliding-window and full attention layers, a
WINDOW and a FULL cache group) that is pip-installed for real and found through the
``deepinfer.models`` entry-point group, against its own cache-free reference forward.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import rand_ids, write_tokenizer

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.kv_cache_manager import KVCacheManager, allocate_caches, pool_specs, split_budget
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.kv_cache_spec import CacheLayout, HitRule, KVCacheSpec
from deepinfer_core.models.loader import SafetensorsReader

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "third_party_model"
BS, W = 4, 8  # block size; the toy model's sliding window


# ---- the manager on a synthetic layout ---------------------------------------------------------

def _manager(num_full=16, num_win=8, bs=2, window=4, prefix=True):
    layout = CacheLayout((KVCacheSpec("full", (0,), 2), KVCacheSpec("swa", (1,), 2, window=window)))
    num = {"full": num_full, "swa": num_win}
    return KVCacheManager(layout, bs, num, allocate_caches(layout, num, bs, torch.float32, torch.device("cpu")),
                          prefix)


def test_planes_hold_the_same_records_as_one_tensor():
    """A platform that splits an entry into planes (Platform.kv_cache_planes) stores and serves the same
    block records as one tensor per layer; planes that cut a declared part are refused."""
    spec = KVCacheSpec("latent", (0, 1), 12, parts=(8, 4))
    layout = CacheLayout((spec,))
    num = {pool_specs(layout)[0].name: 4}
    split = allocate_caches(layout, num, 2, torch.float32, torch.device("cpu"), planes=lambda g: g.parts)
    assert [[tuple(p.shape) for p in layer] for layer in split["latent"]] == [[(4, 2, 8), (4, 2, 4)]] * 2
    for layer in split["latent"]:
        for p in layer:
            p.copy_(torch.randn(p.shape))
    joined = {"latent": [torch.cat(layer, dim=-1) for layer in split["latent"]]}
    a, b = KVCacheManager(layout, 2, num, split), KVCacheManager(layout, 2, num, joined)
    assert torch.equal(a.read_block(1), b.read_block(1)) and a.read_block(1).shape == (2, 2, 12)
    a.write_block(3, b.read_block(2))
    assert torch.equal(a.read_block(3), b.read_block(2))
    assert torch.equal(split["latent"][1][1][3], joined["latent"][1][2, :, 8:])
    with pytest.raises(ValueError, match=r"cache group 'latent': planes \(6, 6\) do not group its parts \(8, 4\)"):
        allocate_caches(layout, num, 2, torch.float32, torch.device("cpu"), planes=lambda g: (6, 6))
    with pytest.raises(ValueError, match=r"parts \(8, 5\) must be positive and sum to entry_dim 12"):
        KVCacheSpec("latent", (0,), 12, parts=(8, 5))


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(), 0, [])


def _run(m: KVCacheManager, seq: Sequence, upto: int, step: int = 1) -> None:
    """Compute ``seq`` to ``upto`` tokens, ``step`` at a time, as the scheduler would."""
    while seq.num_computed_tokens < upto:
        n = min(step, upto - seq.num_computed_tokens)
        m.allocate(seq, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        m.register_full_blocks(seq)


def test_split_budget_caps_window_pool_by_full_pool_and_requests():
    layout = CacheLayout((KVCacheSpec("full", (0, 1), 4), KVCacheSpec("swa", (2,), 8, window=8)))
    pools = pool_specs(layout)
    # per block of 4 tokens, float32: full 2*4*4*4 = 128 B, swa 4*8*4 = 128 B; a window needs at most
    # ceil((8 - 1 + 4) / 4) + 1 = 4 blocks per request
    kw = dict(block_size=4, dtype=torch.float32, max_num_seqs=2, max_model_len=64, max_step_tokens=4)
    assert split_budget(pools, 128 * 30, **kw) == {"full": 22, "swa": 8}  # 22 + min(22, 2 * 4) = 30 blocks
    assert split_budget(pools, 128 * 6, **kw) == {"full": 3, "swa": 3}  # never more window than full blocks
    assert split_budget(pools, 128 * 30, **kw, max_full_blocks=10) == {"full": 10, "swa": 8}
    # 8 requests sharing a 64-token step hold at most 8 * (2 + 2) + 16 = 48 window blocks, not 8 * 17
    kw.update(max_num_seqs=8, max_step_tokens=64)
    assert split_budget(pools, 128 * 1000, **kw) == {"full": 952, "swa": 48}


def test_window_blocks_leave_to_the_head_of_the_free_list():
    m = _manager()
    a = _seq(list(range(16)), "a")
    _run(m, a, 11)
    swa, table = m.pools["swa"], m.tables(a)["swa"]
    # window 4, block 2: position 10 reads 7..10, so blocks 0..2 are gone, block 3 still read
    assert table[:3] == [-1, -1, -1] and -1 not in table[3:] and -1 not in m.tables(a)["full"]
    b3 = table[3]
    _run(m, a, 12)  # position 11 reads 8..11: block 3 leaves the window
    assert table[3] == -1 and next(iter(swa.free)) == b3  # at the head of the free list
    m.allocate(a, 14)
    assert table[6] == b3  # the next block taken is the one just freed
    m.release(a)
    m.check_no_leaks()


def test_freed_window_blocks_do_not_evict_cached_prefix():
    m = _manager(num_full=32, num_win=6)
    a = _seq(list(range(9)), "a")
    _run(m, a, 9)
    m.release(a)  # its last window's blocks stay cached, at the LRU tail
    cached = dict(m.pools["swa"].block_of)
    assert cached
    b = _seq(list(range(100, 140)), "b")
    _run(m, b, 40)  # a long request cycles window blocks through the head of the free list
    assert dict(m.pools["swa"].block_of).items() >= cached.items()
    m.release(b)
    again = _seq(list(range(9)), "a2")
    assert m.acquire_cached(again, m.prefix_hashes(again)) == 4  # (9 - 1) // 2 blocks, the window held
    m.release(again)
    m.check_no_leaks()


def test_prefix_hit_is_the_minimum_over_required_groups():
    m = _manager(num_full=32, num_win=32)
    a = _seq(list(range(17)), "a")
    _run(m, a, 17, step=17)  # one chunk: every window block was held until now
    m.release(a)
    b = _seq(list(range(17)), "b")
    _run(m, b, 17)  # token by token: early window blocks of b are freed (and reused)
    m.release(b)
    hashes = m.prefix_hashes(_seq(list(range(17))))
    assert m.pools["full"].longest_hit(hashes, len(hashes)) == 8
    # shorter prompts: the full pool has every block, the window pool only a's (window of position 8)
    c = _seq(list(range(9)) + [999], "c")
    h = m.prefix_hashes(c)
    assert m.pools["full"].longest_hit(h, len(h)) == 4
    assert m.acquire_cached(c, h) == m.longest_hit(h) <= m.pools["swa"].longest_hit(h, 4)
    m.release(c)
    m.check_no_leaks()


def test_allocation_is_all_or_nothing_across_pools():
    m = _manager(num_full=16, num_win=2, window=100)  # a window pool that runs out first
    s = _seq(list(range(8)), "s")
    assert not m.can_allocate(s, 6)
    with pytest.raises(RuntimeError, match="do not fit"):
        m.allocate(s, 6)
    assert m.usage() == {"full": 0, "swa": 0}


def test_not_needed_window_group_does_not_limit_hits():
    layout = CacheLayout((KVCacheSpec("full", (0,), 2),
                          KVCacheSpec("swa", (1,), 2, window=4, hit_rule=HitRule.NOT_NEEDED)))
    num = {"full": 16, "swa": 16}
    m = KVCacheManager(layout, 2, num, allocate_caches(layout, num, 2, torch.float32, torch.device("cpu")))
    a = _seq(list(range(12)), "a")
    _run(m, a, 12)
    m.release(a)
    m.pools["swa"].block_of.clear()  # no window block cached at all
    b = _seq(list(range(12)), "b")
    assert m.acquire_cached(b, m.prefix_hashes(b)) == 5
    assert m.tables(b)["swa"] == [-1] * 5
    m.release(b)
    m.check_no_leaks()


def test_state_group_that_is_not_prefix_cacheable_does_not_limit_hits():
    layout = CacheLayout((KVCacheSpec("full", (0,), 2), KVCacheSpec("swa", (1,), 2, window=4),
                          KVCacheSpec("state", (1,), 3, window=2, prefix_cacheable=False)))
    num = {"full": 16, "swa": 16, "state": 16}
    m = KVCacheManager(layout, 2, num, allocate_caches(layout, num, 2, torch.float32, torch.device("cpu")))
    assert set(m.pools) == {"full", "swa", "state"} and m.pool_of == {"full": "full", "swa": "swa", "state": "state"}
    a = _seq(list(range(12)), "a")
    _run(m, a, 12, step=12)
    m.release(a)
    assert not m.pools["state"].block_of  # never hashed
    b = _seq(list(range(12)), "b")
    assert m.acquire_cached(b, m.prefix_hashes(b)) == 5  # limited by nothing but full and swa
    assert m.tables(b)["state"] == [-1] * 5 and m.tables(b)["swa"][:3] == [-1] * 3
    m.allocate(b, 12)
    m.release(b)
    m.check_no_leaks()


def test_records_carry_every_group_of_the_record_pool():
    from deepinfer_core.engine.kv_tiers import _copies_by_layer

    layout = CacheLayout((KVCacheSpec("a", (0, 1), 3), KVCacheSpec("b", (0,), 5, tokens_per_entry=2),
                          KVCacheSpec("swa", (1,), 2, window=4)))
    num = {"a": 6, "swa": 6}
    m = KVCacheManager(layout, 4, num, allocate_caches(layout, num, 4, torch.float32, torch.device("cpu")))
    assert [g.name for g in m.record_groups] == ["a", "b"] and m.record_pool is m.pools["a"]
    for name in ("a", "b", "swa"):
        for t in m.kv_caches[name]:
            t.copy_(torch.randn(t.shape))
    rec = m.read_block(2)
    assert rec.shape == (2 * 4 * 3 + 2 * 5,)  # two layers of a (4 entries x 3), one of b (2 entries x 5)
    m.write_block(5, rec)
    for name in ("a", "b"):
        for t in m.kv_caches[name]:
            assert torch.equal(t[5], t[2])
    assert not torch.equal(m.kv_caches["swa"][0][5], m.kv_caches["swa"][0][2])  # window groups are not recorded
    assert [layer for layer, _ in _copies_by_layer(m)] == [0, 1]
    assert m.put(1234, rec) and torch.equal(m.get(1234), rec) and m.contains(1234)


# ---- a third-party model through deepinfer.models -----------------------------------------------

@pytest.fixture(scope="module")
def toy_pkg(tmp_path_factory):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed in this environment (needed by --no-build-isolation)")
    root = tmp_path_factory.mktemp("toymodel")
    site = root / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--no-input", "--target", str(site), str(EXAMPLE)],
        capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    for build in (EXAMPLE / "build", *EXAMPLE.glob("*.egg-info")):
        subprocess.run(["rm", "-rf", str(build)], check=False)
    from stevedore import ExtensionManager

    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    # stevedore keeps each group's entry points for the life of the process (its class-level cache):
    # an installed-at-start-up package needs nothing; one installed by this test must be seen
    ExtensionManager.ENTRY_POINT_CACHE.pop("deepinfer.models", None)
    yield site
    sys.path.remove(str(site))
    ExtensionManager.ENTRY_POINT_CACHE.pop("deepinfer.models", None)
    for name in [n for n in sys.modules if n.startswith("deepinfer_toymodel")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def toy(toy_pkg, tmp_path_factory):
    """(checkpoint dir, the reference model)."""
    from deepinfer_toymodel.model import ToySlidingForCausalLM, write_checkpoint

    assert "site" in ToySlidingForCausalLM.__module__ or "deepinfer_toymodel" in sys.modules
    path = write_checkpoint(tmp_path_factory.mktemp("toy_ckpt"), seed=3, sliding_window=W)
    write_tokenizer(path)
    cfg = ToySlidingForCausalLM.parse_config(__import__("json").loads((path / "config.json").read_text()))
    ref = ToySlidingForCausalLM(cfg)
    ref.load_weights(SafetensorsReader(path))
    return path, ref


def _llm(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=4, max_num_batched_tokens=16,
                kv_cache_memory=1 << 20, enable_prefix_caching=True)
    opts.update(kw)
    return LLM(str(path), **opts)


def _ref_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref.reference_logits(ids)[-1].argmax()))
    return ids[len(prompt):]


def _check(ref, prompt: list[int], out, n: int, tol: float = 1e-4) -> None:
    toks = out.outputs[0].token_ids
    assert toks == _ref_greedy(ref, prompt, n)
    lp = torch.log_softmax(ref.reference_logits(prompt + toks), -1)
    if out.prompt_logprobs is not None:
        mine = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
        theirs = lp[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert (mine - theirs).abs().max().item() < tol
    mine = torch.tensor([out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(toks)])
    theirs = lp[len(prompt) - 1 : -1].gather(1, torch.tensor(toks)[:, None])[:, 0]
    assert (mine - theirs).abs().max().item() < tol


PROMPTS = [rand_ids(n, 40 + n) for n in (5, 23, 41)]  # up to five windows long


@pytest.mark.parametrize("async_on", [False, True])
def test_third_party_model_loads_and_matches_its_reference(toy, async_on):
    path, ref = toy
    llm = _llm(path, async_scheduling=async_on)
    e = llm.engine
    assert type(e.model).__name__ == "ToySlidingForCausalLM" and set(e.kv_caches) == {"swa", "full"}
    assert set(e.blocks.pools) == {"swa", "full"} and e.blocks.pools["swa"].window == W
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)  # chunks of <= 16
    for p, o in zip(PROMPTS, outs):
        _check(ref, p, o, 12)
    e.blocks.check_no_leaks()


def test_window_usage_stays_bounded_during_a_long_decode(toy):
    path, ref = toy
    llm = _llm(path)
    e = llm.engine
    prompt = rand_ids(6, 7)
    e.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True,
                                                               logprobs=0), "long")
    peak = {"swa": 0, "full": 0}
    done = []
    while e.has_unfinished():
        done += e.step()
        use = e.blocks.usage()
        peak = {k: max(peak[k], use[k]) for k in peak}
        seq = e._seqs.get("long")
        if seq is not None and not seq.is_finished:
            assert use["full"] == -(-seq.num_tokens // BS) or use["full"] == -(-seq.num_computed_tokens // BS)
            assert use["swa"] <= -(-(W - 1) // BS) + 2  # the window plus the block being written
    assert peak["full"] >= 86 // BS and peak["swa"] <= -(-(W - 1) // BS) + 2
    (out,) = [s for s in done if s.request_id == "long"]
    assert out.output_token_ids == _ref_greedy(ref, prompt, 80)
    e.blocks.check_no_leaks()


@pytest.mark.parametrize("async_on", [False, True])
def test_preemption_and_abort_free_every_group(toy, async_on):
    path, ref = toy
    # room for about one long request: the others are preempted and recomputed
    llm = _llm(path, kv_cache_memory=16 * 3 * BS * 32 * 4, max_num_batched_tokens=64, async_scheduling=async_on)
    e = llm.engine
    prompts = [rand_ids(20 + 3 * i, 70 + i) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert e.stats.preemptions > 0
    for p, o in zip(prompts, outs):
        _check(ref, p, o, 16)
    e.blocks.check_no_leaks()
    e.add_request({"prompt_token_ids": prompts[0]}, sp, "gone")
    e.step()
    assert any(e.blocks.usage().values())
    e.abort("gone")
    while e.has_unfinished():
        e.step()
    e.blocks.check_no_leaks()


def test_prefix_hits_take_the_minimum_over_groups(toy):
    path, ref = toy
    llm = _llm(path)
    e = llm.engine
    base = rand_ids(30, 99)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    (first,) = llm.generate([{"prompt_token_ids": base}], sp, use_tqdm=False)  # chunks of 16
    # the next turn: its prefix ends where the first request stopped, whose window it still holds
    turn = base + first.outputs[0].token_ids + rand_ids(3, 4)
    hashes = e.blocks.prefix_hashes(e.new_sequence({"prompt_token_ids": turn}, None, "probe"))
    # every full computed block, capped at L - (W + spec_lookback) (engine/window_prefix.py), then the
    # longest hit whose window blocks are still cached ("retain")
    cap = min((len(base) + 3) // BS, (len(turn) - W - 1) // BS)
    assert e.window_cache.spec_lookback == 1 and e.blocks.full_hit(hashes) >= cap
    expect = max(n for n in range(cap + 1) if n == 0 or e.blocks.window_held(hashes, n))
    assert expect >= cap - 2
    (again,) = llm.generate([{"prompt_token_ids": turn}], sp, use_tqdm=False)
    assert again.metrics.num_cached_tokens == expect * BS
    _check(ref, turn, again, 4)
    # a prompt sharing only the first 17 tokens: the full group holds 4 blocks, the window group not
    # the blocks the window of position 16 reads (they left the window and were reused)
    short = base[:17] + rand_ids(6, 5)
    hashes = e.blocks.prefix_hashes(e.new_sequence({"prompt_token_ids": short}, None, "probe"))
    full_hit = e.blocks.pools["full"].longest_hit(hashes, len(hashes))
    expect = e.blocks.longest_hit(hashes, (len(short) - W - 1) // BS)
    assert full_hit == 4 and expect < full_hit
    (out,) = llm.generate([{"prompt_token_ids": short}], sp, use_tqdm=False)
    assert out.metrics.num_cached_tokens == expect * BS
    _check(ref, short, out, 4)
    e.blocks.check_no_leaks()


def test_kv_store_records_the_full_group_and_serves_window_models_from_device(toy, tmp_path):
    path, ref = toy
    section = {"backend": "3fs", "path": str(tmp_path / "kv"), "offload_on_finish": True}
    llm = _llm(path, kv_store=section)
    e = llm.engine
    tiers = e.pm.get_plugin("kv_tiers")
    assert tiers.layout.block_shape == (1, BS, 2 * 2 * 8)  # the "full" group only: one layer, [k | v]
    prompt = rand_ids(30, 11)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    for _ in range(2):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        _check(ref, prompt, out, 4)
    assert tiers.flush(30) and tiers.counters.offload_written > 0
    assert set(out.metrics.num_cached_tokens_by_tier) <= {"device"}  # lower tiers never serve a window model
    e.blocks.check_no_leaks()
    llm.shutdown()


def test_unknown_architecture_lists_registered_ones(toy, tmp_path):
    path, _ = toy
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(path, d)
    raw = json.loads((d / "config.json").read_text())
    raw["architectures"] = ["NoSuchForCausalLM"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as exc:
        _llm(d)
    msg = str(exc.value)
    assert "NoSuchForCausalLM" in msg and "ToySlidingForCausalLM" in msg and "DeepseekV3ForCausalLM" in msg
