"""Bad input fails only its own request: inside one ``generate`` call the bad request's output has
``finish_reason == "error"`` and ``.error`` (a ValueError/TypeError naming the field), while the
other requests complete exactly as they would alone."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB

from deepinfer_core import LLM, SamplingParams

GOOD = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
MAX_POS = 512  # max_position_embeddings of the tiny models


def ids(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(4, VOCAB, (n,), generator=g).tolist()}


# name -> (prompt, params dict, exception type, words the message must contain)
CASES = {
    "max_tokens=0": (ids(6), dict(GOOD, max_tokens=0), ValueError, ["max_tokens"]),
    "max_tokens<0": (ids(6), dict(GOOD, max_tokens=-3), ValueError, ["max_tokens"]),
    "negative temperature": (ids(6), dict(GOOD, temperature=-0.5), ValueError, ["temperature"]),
    "top_p=0": (ids(6), dict(GOOD, top_p=0.0), ValueError, ["top_p"]),
    "top_p>1": (ids(6), dict(GOOD, top_p=1.5), ValueError, ["top_p"]),
    "prompt too long": (ids(MAX_POS + 8), GOOD, ValueError, ["prompt", "maximum length"]),
    "empty token prompt": ({"prompt_token_ids": []}, GOOD, ValueError, ["prompt", "empty"]),
    "empty text prompt": ("", GOOD, ValueError, ["prompt", "empty"]),
    "token id >= vocab": ({"prompt_token_ids": [5, 6, VOCAB]}, GOOD, ValueError,
                          ["prompt_token_ids", str(VOCAB)]),
    "negative token id": ({"prompt_token_ids": [5, -1, 6]}, GOOD, ValueError, ["prompt_token_ids", "-1"]),
    "unknown SamplingParams field": (ids(6), dict(GOOD, temprature=0.5), TypeError, ["temprature"]),
    "so_args without a feature": (ids(6), dict(GOOD, so_args={"json": {"type": "object"}}), ValueError,
                                  ["so_args"]),
    "lone surrogate in the prompt": ("ab\ud800cd", GOOD, ValueError, ["prompt", "surrogate", "position 2"]),
}
# NaN and infinities in every float sampling field (issue 14): rejected naming the field
for _field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
    for _v in (float("nan"), float("inf"), float("-inf")):
        CASES[f"{_field}={_v}"] = (ids(6), dict(GOOD, **{_field: _v}), ValueError, [_field, "finite"])


@pytest.fixture(scope="module")
def llm(tiny_v3_path):
    return LLM(tiny_v3_path, dtype="float32", block_size=4, max_num_seqs=8, kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def good_prompts():
    return [ids(7, 1), "good text prompt", ids(30, 2)]


@pytest.fixture(scope="module")
def reference(llm, good_prompts):
    outs = llm.generate(good_prompts, [dict(GOOD)] * len(good_prompts), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_fails_alone(llm, good_prompts, reference, case):
    prompt, params, exc_type, words = CASES[case]
    prompts = [good_prompts[0], prompt, good_prompts[1], good_prompts[2]]
    params_list = [dict(GOOD), params, dict(GOOD), dict(GOOD)]
    outs = llm.generate(prompts, params_list, use_tqdm=False)
    assert len(outs) == 4
    bad = outs[1]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == []
    assert isinstance(bad.error, exc_type), repr(bad.error)
    for w in words:
        assert w in str(bad.error), (w, str(bad.error))
    for o, want in zip([outs[0], outs[2], outs[3]], reference):
        assert o.error is None
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == want
    llm.engine.blocks.check_no_leaks()
    assert not llm.engine.has_unfinished()


def test_several_bad_requests_in_one_call(llm, good_prompts, reference):
    bad = ["max_tokens=0", "top_p>1", "token id >= vocab", "unknown SamplingParams field"]
    prompts = [CASES[b][0] for b in bad] + good_prompts
    params = [CASES[b][1] for b in bad] + [dict(GOOD)] * len(good_prompts)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for b, o in zip(bad, outs):
        assert o.outputs[0].finish_reason == "error" and isinstance(o.error, CASES[b][2]), b
    assert [o.outputs[0].token_ids for o in outs[len(bad):]] == reference


def test_sampling_params_object_is_validated_too(llm, good_prompts, reference):
    """The same checks apply to SamplingParams objects (not only dicts)."""
    outs = llm.generate([good_prompts[0], ids(6)], [SamplingParams(**GOOD), SamplingParams(top_p=-1.0)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference[0]
    assert outs[1].outputs[0].finish_reason == "error" and "top_p" in str(outs[1].error)


def test_valid_edge_values_are_accepted(llm):
    """Boundaries that are legal: top_p = 1, temperature = 0, max_tokens = 1, a prompt one token
    shorter than the maximum length."""
    outs = llm.generate([ids(6), ids(MAX_POS - 1, 3)],
                        [dict(GOOD, top_p=1.0, max_tokens=1), dict(GOOD, max_tokens=1)], use_tqdm=False)
    for o in outs:
        assert o.error is None and o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 1
