"""Engine behaviour on a tiny random DeepSeek-V3 checkpoint: prefix cache, preemption, continuous
batching, logprobs format, stop conditions, metrics, seeded sampling, special-looking user text."""

from __future__ import annotations

import math

import pytest
from tiny_models import BOS, END_OF_TEXT, hf_logprobs, kv_bytes_per_block, preemption_workload, rand_ids

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.llm import to_output

BS = 4  # KV block size of every engine here


def make_llm(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=16, kv_cache_memory=2 << 20)
    opts.update(kw)
    return LLM(str(path), **opts)


def greedy(n: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def gen(llm: LLM, prompts, params):
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    ps = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(ps, params, use_tqdm=False)
    for o in outs:
        assert o.error is None, o.error
    return outs


def out_lps(o) -> list[float]:
    c = o.outputs[0]
    return [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]


def assert_same_output(a, b, tol: float = 1e-4) -> None:
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    if a.outputs[0].logprobs is not None:
        assert max(abs(x - y) for x, y in zip(out_lps(a), out_lps(b))) < tol


# ---- prefix cache --------------------------------------------------------------------------------

def test_prefix_cache_identical_request(tiny_v3_path):
    llm = make_llm(tiny_v3_path)
    prompt = rand_ids(22, 1)
    (a,) = gen(llm, prompt, greedy(logprobs=0))
    (b,) = gen(llm, prompt, greedy(logprobs=0))
    assert a.metrics.num_cached_tokens == 0
    assert a.metrics.num_computed_prompt_tokens == 22
    shared = (22 - 1) // BS * BS  # full blocks, never the block of the last prompt token
    assert b.metrics.num_cached_tokens == shared == 20
    assert b.metrics.num_cached_tokens_by_tier.get("device") == shared
    assert b.metrics.num_computed_prompt_tokens == 22 - shared
    assert_same_output(a, b)
    llm.engine.blocks.check_no_leaks()


def test_prefix_cache_block_aligned_prompt_keeps_last_block(tiny_v3_path):
    llm = make_llm(tiny_v3_path)
    prompt = rand_ids(24, 2)  # exactly 6 blocks: the 6th holds the last token and is recomputed
    (a,) = gen(llm, prompt, greedy(logprobs=0))
    (b,) = gen(llm, prompt, greedy(logprobs=0))
    assert b.metrics.num_cached_tokens == 20
    assert b.metrics.num_computed_prompt_tokens == 4
    assert_same_output(a, b)


def test_prefix_cache_shared_prefix_and_partial_blocks(tiny_v3_path):
    llm = make_llm(tiny_v3_path)
    nocache = make_llm(tiny_v3_path, enable_prefix_caching=False)
    base = rand_ids(22, 3)
    gen(llm, base, greedy())
    cases = {
        "shares 13 tokens": (base[:13] + rand_ids(9, 4), 12),  # 3 full blocks
        "shares 3 tokens (part of a block)": (base[:3] + rand_ids(19, 5), 0),
        # blocks 1.. equal, block 0 differs in one token: the hash chain makes nothing match
        "differs in block 0": ([base[0] ^ 1] + base[1:], 0),
    }
    for what, (prompt, cached) in cases.items():
        (o,) = gen(llm, prompt, greedy(logprobs=0))
        (ref,) = gen(nocache, prompt, greedy(logprobs=0))
        assert o.metrics.num_cached_tokens == cached, what
        assert o.metrics.num_computed_prompt_tokens == len(prompt) - cached, what
        assert ref.metrics.num_cached_tokens == 0
        assert_same_output(o, ref)
    llm.engine.blocks.check_no_leaks()


# ---- preemption ----------------------------------------------------------------------------------

def test_preemption_under_small_kv_budget(tiny_v3_path):
    prompts, params = preemption_workload()
    ref = gen(make_llm(tiny_v3_path), prompts, params)
    # 24 blocks (96 tokens): every request fits alone (<= 11 blocks), the batch needs ~70
    small = make_llm(tiny_v3_path, kv_cache_memory=24 * kv_bytes_per_block(tiny_v3_path, BS))
    assert small.metrics()["kv_blocks_total"] == 24
    outs = gen(small, prompts, params)
    assert small.metrics()["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == small.metrics()["preemptions"]
    # the victims include a seeded sampled request and one with prompt logprobs (kept over recompute)
    victims = [i for i, o in enumerate(outs) if o.metrics.num_preemptions]
    assert any(i % 2 for i in victims) and any(i % 2 == 0 for i in victims), victims
    for p, r, o in zip(prompts, ref, outs):
        assert o.outputs[0].finish_reason == "length"
        assert_same_output(r, o)
        if r.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == len(p)
            for i in range(1, len(p)):
                assert abs(o.prompt_logprobs[i][p[i]].logprob - r.prompt_logprobs[i][p[i]].logprob) < 1e-4
    small.engine.blocks.check_no_leaks()


# ---- continuous batching -------------------------------------------------------------------------

def test_continuous_batching_different_lengths(tiny_v3_path):
    prompts = [rand_ids(n, 20 + n) for n in (5, 41, 17)]
    params = [greedy(n, logprobs=0) for n in (20, 3, 9)]
    solo_llm = make_llm(tiny_v3_path, enable_prefix_caching=False)
    solo = [gen(solo_llm, p, sp)[0] for p, sp in zip(prompts, params)]
    solo_steps = solo_llm.metrics()["steps"]

    llm = make_llm(tiny_v3_path, enable_prefix_caching=False)
    outs = gen(llm, prompts, params)
    for s, o, sp in zip(solo, outs, params):
        assert len(o.outputs[0].token_ids) == sp.max_tokens
        assert o.outputs[0].finish_reason == "length"
        assert_same_output(s, o)
    assert llm.metrics()["steps"] < solo_steps  # the requests really shared steps
    assert outs[1].metrics.finished_time < outs[2].metrics.finished_time < outs[0].metrics.finished_time


def test_request_joins_while_others_decode(tiny_v3_path):
    a_prompt, b_prompt = rand_ids(9, 30), rand_ids(27, 31)
    solo_llm = make_llm(tiny_v3_path, enable_prefix_caching=False)
    (a_solo,) = gen(solo_llm, a_prompt, greedy(15, logprobs=0))
    (b_solo,) = gen(solo_llm, b_prompt, greedy(6, logprobs=0))

    llm = make_llm(tiny_v3_path, enable_prefix_caching=False)
    eng = llm.engine
    a = eng.add_request({"prompt_token_ids": a_prompt}, greedy(15, logprobs=0))
    for _ in range(4):
        eng.step()
    assert a.num_output_tokens == 4
    b = eng.add_request({"prompt_token_ids": b_prompt}, greedy(6, logprobs=0))
    eng.step()  # b's prefill and a's decode in one step
    assert a.num_output_tokens == 5 and b.num_output_tokens == 1
    while eng.has_unfinished():
        eng.step()
    assert_same_output(a_solo, to_output(a, eng.tokenizer))
    assert_same_output(b_solo, to_output(b, eng.tokenizer))
    eng.blocks.check_no_leaks()


# ---- logprobs --------------------------------------------------------------------------------------

def test_logprobs_format(tiny_v3):
    path, hf = tiny_v3
    llm = make_llm(path)
    prompt = rand_ids(12, 40)
    N = 3
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=N, prompt_logprobs=2),
              SamplingParams(temperature=1.5, seq_seed=7, max_tokens=12, ignore_eos=True, logprobs=N)]
    outs = gen(llm, [prompt, prompt], params)
    saw_outside_top = False
    for o, sp in zip(outs, params):
        c = o.outputs[0]
        ref = hf_logprobs(hf, prompt + c.token_ids)
        assert isinstance(c.logprobs, list) and len(c.logprobs) == len(c.token_ids)
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert isinstance(entry, dict) and tok in entry
            assert all(isinstance(k, int) for k in entry)
            top_ids = row.topk(N).indices.tolist()
            assert set(entry) == set(top_ids) | {tok}
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t].item()) < 1e-3
                if t in top_ids:
                    assert lp.rank == top_ids.index(t) + 1, (t, lp, top_ids)
            saw_outside_top |= tok not in top_ids
            if sp.temperature == 0:
                assert tok == top_ids[0] and len(entry) == N
    assert saw_outside_top  # the sampled run drew a token outside the top 3 at least once
    # prompt_logprobs=2: the prompt token plus the top 2, first position None
    pl = outs[0].prompt_logprobs
    assert pl[0] is None and len(pl) == len(prompt)
    ref = hf_logprobs(hf, prompt)
    for i in range(1, len(prompt)):
        top2 = ref[i - 1].topk(2).indices.tolist()
        assert set(pl[i]) == set(top2) | {prompt[i]}
        assert [pl[i][t].rank for t in top2] == [1, 2]
        assert abs(pl[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-3
    # not requested: None
    (plain,) = gen(llm, prompt, greedy(2))
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


# ---- stop conditions -------------------------------------------------------------------------------

def test_stop_strings_token_ids_max_tokens(tiny_v3_path):
    llm = make_llm(tiny_v3_path)
    prompt = "the cat sat on the mat"
    (ref,) = gen(llm, prompt, greedy(24))
    ref_ids, ref_text = ref.outputs[0].token_ids, ref.outputs[0].text
    assert ref.outputs[0].finish_reason == "length" and ref.outputs[0].stop_reason is None
    assert len(ref_ids) == 24 and ref_text == llm.tokenizer.decode(ref_ids)

    # a stop string: generation ends at the token that completes it; the text is cut before it
    stop = ref_text[8:10]
    k = next(k for k in range(1, 25) if stop in llm.tokenizer.decode(ref_ids[:k]))
    (o,) = gen(llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                           stop=["never-in-output\x00", stop]))
    c = o.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.token_ids == ref_ids[:k]
    assert c.text == ref_text[: ref_text.index(stop)] and stop not in c.text

    # a stop token id: ends right after that token
    t = ref_ids[10]
    k = ref_ids.index(t) + 1
    (o,) = gen(llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[t]))
    c = o.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", t)
    assert c.token_ids == ref_ids[:k]

    # max_tokens
    (o,) = gen(llm, prompt, greedy(5))
    assert (o.outputs[0].finish_reason, o.outputs[0].token_ids) == ("length", ref_ids[:5])

    # EOS (unless ignore_eos): the tokenizer's EOS ids end a request with stop_reason None
    t = ref_ids[6]
    llm.engine.tokenizer.eos_token_ids = [*llm.engine.tokenizer.eos_token_ids, t]
    (o,) = gen(llm, prompt, SamplingParams(temperature=0, max_tokens=24))
    c = o.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert c.token_ids == ref_ids[: ref_ids.index(t) + 1]
    (o,) = gen(llm, prompt, greedy(24))
    assert o.outputs[0].token_ids == ref_ids


# ---- metrics -------------------------------------------------------------------------------------

def test_decode_ppl_and_time_metrics(tiny_v3_path):
    llm = make_llm(tiny_v3_path)
    sp = SamplingParams(temperature=1.0, seq_seed=3, max_tokens=10, ignore_eos=True, logprobs=0)
    (o,) = gen(llm, rand_ids(15, 50), sp)
    m = o.metrics
    lps = out_lps(o)
    assert m.decode_ppl == pytest.approx(math.exp(-sum(lps) / len(lps)), rel=1e-6)
    assert m.decode_ppl > 1.0
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_to_first_token > 0 and m.decode_time >= 0
    assert m.num_computed_prompt_tokens == 15 and m.num_preemptions == 0
    em = llm.metrics()
    for key in ("steps", "prefill_tokens", "decode_tokens", "preemptions", "kv_blocks_free"):
        assert key in em
    assert em["prefill_tokens"] == 15 and em["decode_tokens"] == 10


# ---- seeded sampling -------------------------------------------------------------------------------

def test_seq_seed_reproducible(tiny_v3_path):
    llm = make_llm(tiny_v3_path)
    prompt = rand_ids(11, 60)

    def sampled(seed, n=16):
        return SamplingParams(temperature=1.0, seq_seed=seed, max_tokens=n, ignore_eos=True)

    (a,) = gen(llm, prompt, sampled(1234))
    # the same seed again, now batched with other requests (and a prefix-cache hit): same tokens
    outs = gen(llm, [rand_ids(30, 61), prompt, prompt, prompt, prompt],
               [sampled(5), sampled(1234), sampled(1235), sampled(1236), sampled(1237)])
    assert outs[1].outputs[0].token_ids == a.outputs[0].token_ids
    others = [o.outputs[0].token_ids for o in outs[2:]]
    assert all(t != a.outputs[0].token_ids for t in others)
    # a fresh engine reproduces it too
    (b,) = gen(make_llm(tiny_v3_path), prompt, sampled(1234))
    assert b.outputs[0].token_ids == a.outputs[0].token_ids


# ---- tokenizer ---------------------------------------------------------------------------------

def test_special_token_text_stays_plain_text(tiny_v3_path):
    from tokenizers import Tokenizer

    text = "hi <|end_of_text|> there<eos>"
    raw = Tokenizer.from_file(f"{tiny_v3_path}/tokenizer.json")
    assert END_OF_TEXT in raw.encode(text).ids  # a naive encode would produce the special token
    llm = make_llm(tiny_v3_path)
    (o,) = gen(llm, text, greedy(3))
    ids = o.prompt_token_ids
    assert ids[0] == BOS and ids.count(BOS) == 1
    assert END_OF_TEXT not in ids and 1 not in ids  # neither <|end_of_text|> nor <eos>
    assert llm.tokenizer.decode(ids) == text
    assert o.prompt == text and o.outputs[0].finish_reason == "length"
