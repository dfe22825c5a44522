"""The structured_output feature on the embedded default model: each schema type, triggers, bound
tokens, EOS termination, per-request failures, the compile timeout, caching and matcher rollback."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from plugins.structured_output.bitmask import apply_bitmask
from plugins.structured_output.feature import NAME, StructuredOutput
from plugins.structured_output.grammar import GrammarCompiler, parse_so_args, tokenizer_info
from plugins.structured_output.matcher import GrammarState
from plugins.structured_output.selfcheck import EBNF, EBNF_EQUIVALENT, JSON_SCHEMA, run_check

DIGITS = "[0-9]{2,3}"


@pytest.fixture(scope="module")
def llm():
    engine = LLM(features=["structured_output"], kv_cache_memory=64 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def feature(llm) -> StructuredOutput:
    return next(f for f in llm.engine.features if f.name == NAME)


def P(so_args=None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    kw.setdefault("temperature", 0.9)
    kw.setdefault("seq_seed", 7)
    return SamplingParams(so_args=so_args, **kw)


def ended_by_eos(llm, out) -> bool:
    comp = out.outputs[0]
    return comp.finish_reason == "stop" and comp.token_ids[-1] in llm.tokenizer.eos_token_ids


def single_token(llm, text: str) -> int:
    ids = llm.tokenizer.tk.encode(text, add_special_tokens=False).ids
    assert len(ids) == 1, (text, ids)
    return ids[0]


# ---- each schema type, EOS termination ---------------------------------------------------------------
def test_json_regex_ebnf_in_one_batch_end_with_eos(llm):
    schemas = [
        JSON_SCHEMA,
        {"type": "object", "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 500},
                                          "ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb", "ccc"]}},
         "required": ["id", "ok", "kind"]},
        {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    ]
    reqs = [("x = ", P({"schema_type": "json", "schema": s}, seq_seed=i)) for i, s in enumerate(schemas)]
    reqs.append(("x = ", P({"schema_type": "json", "schema": json.dumps(schemas[1])}, seq_seed=11)))  # JSON text
    reqs += [("n = ", P({"schema_type": "regex", "schema": DIGITS}, seq_seed=s)) for s in (1, 2)]
    reqs += [("# util\n", P({"schema_type": "ebnf", "schema": EBNF}, seq_seed=s)) for s in (1, 2)]
    reqs.append(("print(", P(max_tokens=8)))  # unconstrained, in the same batch
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=False)
    for (schema, out) in zip(schemas + [schemas[1]], outs[:4]):
        assert out.error is None
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert ended_by_eos(llm, out), out.outputs[0]
    for out in outs[4:6]:
        assert re.fullmatch(DIGITS, out.outputs[0].text) and ended_by_eos(llm, out)
    for out in outs[6:8]:
        assert EBNF_EQUIVALENT.fullmatch(out.outputs[0].text) and ended_by_eos(llm, out)
    assert outs[8].error is None and outs[8].outputs[0].finish_reason in ("stop", "length")


def test_selfcheck_passes(llm):
    results = run_check(llm, seed=3)
    assert all(r.ok for r in results), [r for r in results if not r.ok]


def test_output_ends_as_soon_as_grammar_and_eos_allow(llm):
    out = llm.generate("answer: ", P({"schema_type": "regex", "schema": "(yes|no|maybe)"}, max_tokens=50),
                       use_tqdm=False)[0]
    assert out.outputs[0].text in ("yes", "no", "maybe")
    assert ended_by_eos(llm, out)


@pytest.mark.parametrize("so_args,check", [
    ({"schema_type": "regex", "schema": "a{1,5}"}, lambda text: re.fullmatch("a{1,5}", text)),
    ({"schema_type": "json", "schema": {"type": "object", "required": ["n"], "additionalProperties": False,
                                        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}},
     lambda text: isinstance(json.loads(text)["n"], int)),
])
def test_ignore_eos_still_ends_at_the_end_of_the_grammar(llm, so_args, check):
    """ignore_eos does not let output run on past a completed grammar (issue 14): it ends there."""
    outs = llm.generate(["x = "] * 3, [P(so_args, max_tokens=60, ignore_eos=True, seq_seed=s) for s in (1, 2, 3)],
                        use_tqdm=False)
    for out in outs:
        assert out.error is None, out.error
        assert check(out.outputs[0].text), out.outputs[0].text
        assert ended_by_eos(llm, out), out.outputs[0]


# ---- trigger and bound ----------------------------------------------------------------------------
def test_trigger_token_ids_start_the_constraint(llm):
    prompt, greedy = "def area(r):\n    return", dict(temperature=0.0, max_tokens=12)
    free = llm.generate(prompt, P(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    trigger = free[2:4]  # two tokens the model emits anyway
    first = next(i for i in range(len(free) - 1) if free[i : i + 2] == trigger)
    out = llm.generate(prompt, P({"schema_type": "regex", "schema": DIGITS, "trigger_token_ids": trigger},
                                 **dict(greedy, max_tokens=40)), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert ids[: first + 2] == free[: first + 2]  # free output up to and including the trigger
    assert re.fullmatch(DIGITS, llm.tokenizer.decode(ids[first + 2 : -1]))  # then the grammar, then EOS
    assert ended_by_eos(llm, out)


def test_bound_token_id_ends_the_constraint(llm):
    bound = single_token(llm, ";")
    out = llm.generate("values = ", P({"schema_type": "regex", "schema": DIGITS, "bound_token_id": bound},
                                      max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    k = ids.index(bound)
    assert re.fullmatch(DIGITS, llm.tokenizer.decode(ids[:k]))
    assert out.outputs[0].finish_reason == "length" and len(ids) == 12  # free output after the bound


def test_trigger_then_bound_rearms(llm, feature):
    trig, bound = single_token(llm, "="), single_token(llm, ";")
    spec = parse_so_args({"schema_type": "regex", "schema": DIGITS, "trigger_token_ids": [trig],
                          "bound_token_id": bound}, feature.vocab_size)
    st = GrammarState(feature.compiler.compile_now(spec.key), spec, [1], feature.vocab_size)
    digits = llm.tokenizer.tk.encode("42", add_special_tokens=False).ids
    assert not st.active and st.accept_token(single_token(llm, "x")) and not st.active
    assert st.accept_token(trig) and st.active
    assert st.accept_tokens(digits) == len(digits)
    assert not st.accept_token(1)  # EOS is not a way out when a bound token is set
    assert st.accept_token(bound) and not st.active and st.is_terminated
    assert st.accept_token(single_token(llm, "x")) and not st.active  # free again
    assert st.accept_token(trig) and st.active  # a new span


# ---- failures stay with their request -----------------------------------------------------------------
@pytest.mark.parametrize("so_args,message", [
    ({"schema_type": "xml", "schema": "<a/>"}, "schema_type must be one of"),
    ({"schema_type": "json", "schema": "{not json"}, "not valid JSON"),
    ({"schema_type": "regex", "schema": "(ab"}, "regular expression does not compile"),
    ({"schema_type": "ebnf", "schema": 'start ::= "a"'}, "no root rule"),
    ({"schema_type": "regex", "schema": "a", "trigger_token_ids": [5, -1]}, "trigger_token_ids has -1"),
    ({"schema_type": "regex", "schema": "a", "trigger_token_ids": [10**9]}, "not a token id"),
    ({"schema_type": "regex", "schema": "a", "trigger_token_ids": ["="]}, "not a token id"),
    ({"schema_type": "regex", "schema": "a", "bound_token_id": 4096}, "bound_token_id must be a token id"),
    ({"schema_type": "json", "schema": {"type": "strng"}}, "JSON Schema does not compile"),
    ({"schema_type": "regex", "schema": "a", "colour": 1}, "unknown key"),
    ({"schema": "a"}, "schema_type must be one of"),
])
def test_bad_input_fails_only_its_request(llm, so_args, message):
    good = P({"schema_type": "regex", "schema": DIGITS})
    outs = llm.generate(["a = ", "b = ", "c = "], [good, P(so_args), P(max_tokens=4)], use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and message in str(outs[1].error), outs[1].error
    assert re.fullmatch(DIGITS, outs[0].outputs[0].text) and outs[0].error is None
    assert outs[2].error is None and outs[2].outputs[0].finish_reason in ("stop", "length")


def test_compile_timeout_is_a_clear_error(llm, feature, monkeypatch):
    real = feature.compiler._compile

    def slow(kind, text):
        if "9{7}" in text:
            time.sleep(0.6)
        return real(kind, text)

    monkeypatch.setattr(feature.compiler, "_compile", slow)
    monkeypatch.setitem(feature.cfg, "compile_timeout_s", 0.2)
    outs = llm.generate(["a = ", "b = "], [P({"schema_type": "regex", "schema": "9{7}"}),
                                           P({"schema_type": "regex", "schema": DIGITS})], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert isinstance(outs[0].error, TimeoutError) and "compile_timeout_s=0.2" in str(outs[0].error)
    assert re.fullmatch(DIGITS, outs[1].outputs[0].text)


def test_grammars_are_cached(llm, feature):
    before = feature.compiler.hits
    llm.generate(["a", "b"], [P({"schema_type": "regex", "schema": "[ab]{3}"})] * 2, use_tqdm=False)
    llm.generate("c", P({"schema_type": "regex", "schema": "[ab]{3}"}), use_tqdm=False)
    assert feature.compiler.hits >= before + 2  # the second request of the batch and the later one
    assert llm.metrics()["so_cache_entries"] >= 1


def test_cache_is_lru_limited(feature):
    info = feature.compiler.compile_now(("regex", "a")).tokenizer_info
    comp = GrammarCompiler(info, 1, cache_size=2, cache_limit_bytes=1 << 30)
    for r in ("a+", "b+", "c+"):
        comp.compile_now(("regex", r))
    assert comp.num_cached == 2 and ("regex", "a+") not in comp._cache
    comp.compile_now(("regex", "b+"))
    assert comp.hits == 1
    comp.shutdown()


# ---- matcher helpers for speculative decoding ----------------------------------------------------------
def test_rollback_and_draft_helpers(llm, feature):
    spec = parse_so_args({"schema_type": "json", "schema": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a"]}}, feature.vocab_size)
    st = GrammarState(feature.compiler.compile_now(spec.key), spec, llm.tokenizer.eos_token_ids, feature.vocab_size)
    enc = llm.tokenizer.tk.encode('{"a":12}', add_special_tokens=False).ids
    eos = llm.tokenizer.eos_token_ids[0]
    start_mask = st.next_mask().clone()
    masks = torch.zeros(len(enc) + 2, start_mask.shape[1], dtype=torch.int32)
    assert st.fill_draft_bitmasks(enc + [eos], masks) == len(enc) + 2
    assert torch.equal(masks[0], start_mask[0])  # state unchanged, masks per draft position
    assert st.validate_draft(enc + [eos]) == len(enc) + 1
    bad = llm.tokenizer.tk.encode("x", add_special_tokens=False).ids
    assert st.validate_draft(enc[:2] + bad) == 2
    assert st.accept_tokens(enc[:3]) == 3
    step_masks = []
    for i, t in enumerate(enc[3:] + [eos]):
        step_masks.append(st.next_mask().clone())
        assert torch.equal(step_masks[-1][0], masks[3 + i])
        assert st.accept_token(t)
    assert st.is_terminated
    st.rollback(len(enc) + 1 - 3)  # undo the termination, too
    assert st.active and not st.is_terminated and torch.equal(st.next_mask(), step_masks[0])
    st.rollback(3)
    assert torch.equal(st.next_mask(), start_mask)
    with pytest.raises(ValueError):
        st.rollback(1)


def test_rollback_across_a_trigger(llm, feature):
    trig = llm.tokenizer.tk.encode("==", add_special_tokens=False).ids + [single_token(llm, "=")]
    spec = parse_so_args({"schema_type": "regex", "schema": "ab", "trigger_token_ids": trig}, feature.vocab_size)
    st = GrammarState(feature.compiler.compile_now(spec.key), spec, [1], feature.vocab_size)
    a, b = single_token(llm, "a"), single_token(llm, "b")
    assert st.accept_tokens(trig[:-1] + [a] + trig) == len(trig) * 2
    assert st.active
    assert st.accept_token(a) and not st.accept_token(a) and st.accept_token(b)
    st.rollback(2)
    assert st.active and st.validate_draft([a, b, 1]) == 3
    st.rollback(1)  # the last trigger token: watching again, one token short of the trigger
    assert not st.active and st.accept_token(trig[-1]) and st.active


# ---- pieces -----------------------------------------------------------------------------------------
def test_tokenizer_info_pads_the_vocabulary(llm):
    tk = llm.tokenizer.tk
    info = tokenizer_info(tk, tk.get_vocab_size() + 60, [1])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.vocab_size == tk.get_vocab_size() + 60
    comp = GrammarCompiler(info, 1, 4, 1 << 30)
    matcher = xgr.GrammarMatcher(comp.compile_now(("regex", "[a-z ]+")))
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    logits = torch.zeros(1, info.vocab_size)
    apply_bitmask(logits, mask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and max(allowed) < tk.get_vocab_size()  # padding ids are never allowed
    assert 0 not in allowed and 1 not in allowed  # special tokens are not text
    comp.shutdown()


def test_apply_bitmask_matches_xgrammar():
    g = torch.Generator().manual_seed(0)
    for V, rows in ((4100, None), (32000, [0, 2]), (77, [1])):
        n = 3 if rows is None else len(rows)
        mask = torch.randint(-2**31, 2**31 - 1, (n, (V + 31) // 32), generator=g, dtype=torch.int64).int()
        logits = torch.randn(3, V, generator=g)
        want = logits.clone()
        full = mask if rows is None else torch.full((3, mask.shape[1]), -1, dtype=torch.int32).index_copy_(
            0, torch.tensor(rows), mask)
        xgr.apply_token_bitmask_inplace(want, full, indices=rows)
        apply_bitmask(logits, mask, rows)
        assert torch.equal(logits, want)


def test_config_section_is_validated():
    assert StructuredOutput({"builder_threads": 1, "compile_timeout_s": 5}).cfg["compile_timeout_s"] == 5
    with pytest.raises(ConfigError, match="unknown key"):
        StructuredOutput({"threads": 2})
    with pytest.raises(ConfigError, match="must be >= 1"):
        StructuredOutput({"cache_size": 0})
    with pytest.raises(ConfigError, match="expects int"):
        StructuredOutput({"builder_threads": "2"})
    env = {"DEEPINFER_SO_BUILDER_CPUS": "3", "DEEPINFER_XGRAMMAR_CACHE_SIZE": "9", "DEEPINFER_SO_OVERLAP": "0"}
    cfg = StructuredOutput({}, env=env).cfg
    assert (cfg["builder_threads"], cfg["cache_size"], cfg["overlap"]) == (3, 9, False)
    assert StructuredOutput({"cache_size": 4}, env=env).cfg["cache_size"] == 4  # the table wins
    with pytest.raises(ConfigError, match="DEEPINFER_SO_COMPILE_TIMEOUT_S"):
        StructuredOutput({}, env={"DEEPINFER_SO_COMPILE_TIMEOUT_S": "soon"})


def test_env_vars_are_known_to_the_config():
    from deepinfer_core.config import OTHER_ENV
    from plugins.structured_output.feature import ENV_VARS

    assert set(ENV_VARS) <= OTHER_ENV


def test_enabled_from_a_config_file(tmp_path):
    from deepinfer_core.config import compose
    from deepinfer_core.features import load_features, make_plugin_manager

    path = tmp_path / "deepinfer.toml"
    path.write_text('features = ["structured_output"]\n\n[structured_output]\nbuilder_threads = 3\n'
                    'compile_timeout_s = 4.5\n')
    pm = make_plugin_manager()
    (feature,) = load_features(compose(str(path), env={}), pm)
    assert isinstance(feature, StructuredOutput) and feature.cfg["builder_threads"] == 3
    assert feature.cfg["compile_timeout_s"] == 4.5
    assert pm.hook.request_options() == [["so_args"]]
