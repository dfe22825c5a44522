"""Context parallelism: a prompt's MLA prefill split over cp = 2 and 4 gloo ranks (real processes)
gives the logits of cp = 1 (float32, within 1e-4) and of the engine's own prefill, and rank 0
decodes on from the gathered latent KV with the engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from tiny_models import rand_ids

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.parallel import cp_worker
from deepinfer_core.parallel.context_parallel import cp_prefill, zigzag

PROMPT = rand_ids(45, 77)
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_zigzag_balances_causal_work():
    for T, world in ((45, 2), (64, 4), (9, 4)):
        segs = zigzag(T, world)
        covered = sorted(i for r in segs for s, e in r for i in range(s, e))
        assert covered == list(range(T))
        work = [sum((s + e) * (e - s) // 2 for s, e in r) for r in segs]  # ~ causal attention pairs
        assert max(work) <= 1.2 * min(work) + T
        assert segs[0][1][1] == T  # rank 0 holds the last token


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    llm = LLM(model=tiny_v3_path, dtype="float32", block_size=4)
    logits, _, mine = cp_prefill(llm.engine.model, PROMPT, None)  # cp = 1
    assert mine == [(0, 22), (22, 45)]
    vocab = llm.engine.model_config.vocab_size
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                     prompt_logprobs=vocab), use_tqdm=False)[0]
    engine_lp = torch.tensor([[e[t].logprob for t in range(vocab)] for e in out.prompt_logprobs[1:]])
    return logits, engine_lp, out.outputs[0].token_ids


def test_cp1_matches_the_engine_prefill(reference):
    logits, engine_lp, _ = reference
    torch.testing.assert_close(torch.log_softmax(logits[:-1], -1), engine_lp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_prefill_logits_equal_cp1_and_decode_continues(tiny_v3_path, reference, cp, tmp_path):
    ref_logits, _, ref_tokens = reference
    res = cp_worker.run({"model": tiny_v3_path, "dtype": "float32", "block_size": 4}, PROMPT,
                        {"temperature": 0, "max_tokens": 6, "ignore_eos": True}, cp, str(tmp_path))
    got = torch.full_like(ref_logits, float("nan"))
    for r in range(cp):
        part = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        got[part["index"]] = part["logits"]
    torch.testing.assert_close(got, ref_logits, atol=1e-4, rtol=0)
    assert res["tokens"] == ref_tokens  # rank 0 decoded alone from the gathered KV
    assert res["loaded"] == len(PROMPT) - 1
