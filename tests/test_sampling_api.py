"""The parameters a vLLM user reaches for: incremental detokenization and stop strings, logprob details,
``n``/``best_of`` with prefix sharing, ``seed``, ``skip_special_tokens``, generation_config defaults; and
AsyncLLM aborting a request within a step."""

from __future__ import annotations

import asyncio
import json
import math
import shutil

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.tokenizer import HFTokenizer
from deepinfer_core.models.loader import EMBEDDED_MODEL

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm():
    with LLM(max_num_seqs=16) as llm:
        yield llm


def test_decode_stream_matches_full_decode_and_holds_partial_utf8():
    tok = HFTokenizer.load(EMBEDDED_MODEL, 0, [1])
    text = "def naïve(x):\n    return '中文 ✓ 🙂' * x  # ok"
    ids = tok.tk.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok)
    pieces = [d.feed([t]) for t in ids]
    assert "".join(pieces) == d.text == tok.decode(ids) == text
    assert "" in pieces and "\ufffd" not in "".join(pieces)  # a multi-byte character waited for its last byte
    d2 = IncrementalDetokenizer(tok, skip_special_tokens=False)
    d2.feed([0, *ids[:3], 1])
    assert d2.text == tok.decode([0, *ids[:3], 1], skip_special_tokens=False)


def test_stop_strings_are_checked_incrementally(llm, monkeypatch):
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    stop = ref.text[30:34]
    calls = []
    real = HFTokenizer.decode
    monkeypatch.setattr(HFTokenizer, "decode", lambda self, ids, **kw: calls.append(len(ids)) or real(self, ids, **kw))
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=60, stop=["never seen", stop]),
                       use_tqdm=False)[0].outputs[0]
    assert calls == [len(out.token_ids)]  # decoded once, for the output text; never per step
    assert out.text == ref.text[: ref.text.index(stop)] and out.stop_reason == stop and out.finish_reason == "stop"
    keep = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=60, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert keep.text == out.text + stop


def test_logprob_rank_decoded_token_and_cumulative(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=2.0, top_k=0, max_tokens=40, seed=5, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    tok = llm.tokenizer
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                        rel_tol=1e-5)
    outside = 0
    for t, entry in zip(out.token_ids, out.logprobs):
        own = entry[t]
        assert own.decoded_token == tok.tk.decode([t], skip_special_tokens=False)
        best = min(entry.values(), key=lambda lp: lp.rank)
        assert best.rank == 1 and best.logprob >= own.logprob
        if len(entry) == 2:  # sampled outside the top 1: its true rank in the distribution
            outside += 1
            assert own.rank > 1
    assert outside > 0  # temperature 2 samples many non-argmax tokens


def test_sampled_token_rank_is_its_rank_in_the_distribution():
    from deepinfer_core.engine.sampler import Sampler
    from deepinfer_core.engine.sequence import Sequence
    from deepinfer_core.kernels import Kernels
    from kernels_cpu import ReferenceKernels

    k = Kernels(ReferenceKernels, ReferenceKernels)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 0.5
    seqs = [Sequence(str(i), None, [1], SamplingParams(temperature=1.0, logprobs=0 if i % 2 else 2), i, [])
            for i in range(6)]
    res = Sampler(k, 50, torch.device("cpu"))(logits.clone(), seqs, [1] * 6)
    for i, tok in enumerate(res.tokens):
        assert res.ranks[i] == int((logits[i] > logits[i, tok]).sum()) + 1
        assert len(res.top[i]) == (0 if i % 2 else 2)
    assert max(res.ranks) > 2  # some sampled token lies outside the top 2


def test_n_and_best_of_share_the_prompt_and_seeds_reproduce(llm):
    prompt = "x = 1\n" * 40
    sp = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=11)
    a = llm.generate(prompt, sp, use_tqdm=False)[0]
    b = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, n=4, seq_seed=11), use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    single = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=13), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == a.outputs[2].token_ids  # sample i uses seed + i
    llm.engine.blocks.check_no_leaks()
    best = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, n=2, best_of=5, seed=3),
                        use_tqdm=False)[0]
    all5 = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, n=5, seed=3), use_tqdm=False)[0]
    top2 = sorted(all5.outputs, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in top2]
    assert [o.index for o in best.outputs] == [0, 1]


def test_siblings_hit_the_prefix_cache():
    from deepinfer_core.engine.sample_group import SampleGroup

    with LLM(max_num_seqs=8) as llm:
        eng = llm.engine
        group = SampleGroup(eng, "z = 3\n" * 40, SamplingParams(temperature=1.0, max_tokens=3, n=3, seed=0))
        assert len(group.seqs) == 1 and group.pending == 2
        while eng.has_unfinished():
            eng.step()
            group.release(eng)
        prompt_len = len(group.seqs[0].prompt_token_ids)
        full = prompt_len // eng.block_size * eng.block_size
        assert group.seqs[0].metrics.num_cached_tokens == 0
        assert [s.metrics.num_cached_tokens for s in group.seqs[1:]] == [min(full, prompt_len - 1) // 16 * 16] * 2
        assert all(s.metrics.num_cached_tokens > 0 for s in group.seqs[1:])
        eng.blocks.check_no_leaks()


def test_bad_values_name_the_field(llm):
    for kw, field in (({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"), ({"seed": "x"}, "seed"),
                      ({"seed": 1, "seq_seed": 2}, "seed"), ({"skip_special_tokens": 1}, "skip_special_tokens")):
        out = llm.generate("x", SamplingParams(**kw), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "error" and f"SamplingParams.{field}" in str(out.error)


def test_skip_special_tokens(llm):
    ids = llm.tokenizer.encode("a = 1")
    keep = SamplingParams(temperature=0, max_tokens=3, skip_special_tokens=False, stop_token_ids=[])
    sp = llm.generate({"prompt_token_ids": ids}, keep, use_tqdm=False)[0].outputs[0]
    assert sp.text == llm.tokenizer.decode(sp.token_ids, skip_special_tokens=False)
    # force the special token out: BOS is id 0; check the decode path with an explicit id list
    from deepinfer_core.engine.sample_group import completion_output
    from deepinfer_core.engine.sequence import Sequence

    seq = Sequence("s", None, ids, SamplingParams(skip_special_tokens=False), 0, [])
    seq.token_ids += [0, 300, 1]
    assert completion_output(seq, llm.tokenizer).text.startswith("<|begin_of_text|>")
    seq.params = SamplingParams()
    assert "<|" not in completion_output(seq, llm.tokenizer).text


def test_generation_config_defaults(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED_MODEL, model)
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1,
                                                              "temperature": 0.0, "max_new_tokens": 5,
                                                              "top_k": 7}))
    with LLM(str(model)) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.max_tokens, d.top_k) == (0.0, 5, 7)
        out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 5 or out.finish_reason == "stop"
        ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref.token_ids


# ---- AsyncLLM ------------------------------------------------------------------------------------------
def test_async_llm_abort_frees_kv_within_a_step():
    pytest.importorskip("prometheus_client")
    from deepinfer_core.config import compose
    from deepinfer_core.engine.engine import LLMEngine
    from deepinfer_core.serving.async_llm import AsyncLLM

    engine = LLMEngine(compose(None))
    llm = AsyncLLM(engine)

    async def main():
        ref = await llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))
        stream = await llm.add(PROMPT, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        text, n = "", 0
        async for update in stream:
            text += update.deltas[0].text if update.deltas else ""
            n += 1
            if n == 4:
                break  # leaving the loop aborts the request
        steps_at_abort = engine.stats.steps
        while engine.blocks.num_free != engine.blocks.num_blocks:
            await asyncio.sleep(0.005)
        return ref, steps_at_abort, engine.stats.steps

    try:
        ref, at_abort, freed_at = asyncio.run(main())
        assert freed_at - at_abort <= 2  # the step in progress when the abort arrived, and the next
        assert ref.outputs[0].finish_reason == "length" and len(ref.outputs[0].token_ids) == 10
        engine.blocks.check_no_leaks()
        assert llm.num_unfinished == 0
    finally:
        llm.shutdown()


def test_async_llm_rejects_bad_input_before_any_output():
    from deepinfer_core.config import compose
    from deepinfer_core.engine.engine import LLMEngine
    from deepinfer_core.serving.async_llm import AsyncLLM

    llm = AsyncLLM(LLMEngine(compose(None)))

    async def main():
        with pytest.raises(ValueError, match="top_p"):
            await llm.add(PROMPT, SamplingParams(top_p=5.0))
        return await llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))

    try:
        out = asyncio.run(main())
        assert len(out.outputs[0].token_ids) == 3 and llm.num_unfinished == 0
    finally:
        llm.shutdown()


def test_async_llm_engine_failure_fails_every_request_and_refuses_new_ones():
    from deepinfer_core.config import compose
    from deepinfer_core.engine.engine import LLMEngine
    from deepinfer_core.serving.async_llm import AsyncLLM, EngineDeadError

    engine = LLMEngine(compose(None))
    real_step, calls = engine.step, []

    def failing_step():
        # no real step until both requests are in the engine (on a loaded machine the core could
        # otherwise run three steps of the first before the second arrives: CI saw the second add fail)
        if not calls:
            load = engine.load_stats()
            if load["running"] + load["waiting"] < 2:
                return []
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = failing_step
    llm = AsyncLLM(engine)

    async def main():
        # both queued before the third step fails (``failing_step`` holds the steps until both are in)
        streams = await asyncio.gather(*(llm.add(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
                                         for _ in range(2)))
        last = []
        for s in streams:
            async for u in s:
                last.append(u)
        with pytest.raises(EngineDeadError, match="device lost"):
            await llm.add(PROMPT, SamplingParams())
        return [u for u in last if u.finished]

    try:
        finals = asyncio.run(main())
        assert len(finals) == 2 and all(isinstance(u.error, RuntimeError) and u.output is None for u in finals)
        assert isinstance(llm.error, RuntimeError) and llm.num_unfinished == 0
    finally:
        llm.shutdown()
