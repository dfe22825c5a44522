"""Rule judge, pass@k, the JSONL record files and the dataset adapters (no engine)."""

import itertools
import json
import math

import pytest

from deepinfer_core.eval import datasets, jsonl
from deepinfer_core.eval.passk import default_ks, mean_pass_at_k, pass_at_k
from deepinfer_core.eval.rule_judge import (
    RuleJudge,
    extract_choice,
    extract_math,
    last_boxed,
    math_equal,
    normalize_math,
)

SAMPLES = datasets.Path(datasets.__file__).parent / "data" / "samples"


# ---- math answers ----------------------------------------------------------------------------
@pytest.mark.parametrize("pred, ref", [
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac{1}{2}", "1/2"),
    (r"\tfrac{3}{4}", "0.75"),
    (r"\frac12", "0.5"),
    (r"-\frac{1}{2}", "-0.5"),
    (r"\frac{-1}{3}", r"-\frac{1}{3}"),
    ("1,000", "1000"),
    ("1,000,000", "1000000"),
    ("-7", "-7"),
    ("\u22127", "-7"),  # unicode minus
    ("042", "42"),
    ("42 cm", "42"),
    (r"\text{42 cm}", "42"),
    (r"42\text{ cm}", "42"),
    ("12 meters.", "12"),
    (r"90^\circ", "90"),
    (r"50\%", "50"),
    (r"\$5", "5"),
    (r"x = 5", "5"),
    (r"\left(1, 2\right)", "(1,2)"),
    (r"\sqrt 2", r"\sqrt{2}"),
    ("3.", "3"),
    ("2.50", "5/2"),
])
def test_math_equal_tricky_pairs(pred, ref):
    assert math_equal(pred, ref), (normalize_math(pred), normalize_math(ref))


@pytest.mark.parametrize("pred, ref", [
    ("1,2", "12"),  # a pair, not a thousands separator
    (r"\frac{1}{3}", "0.333"),
    ("-5", "5"),
    ("0.5", "5"),
    (r"\sqrt{2}", "2"),
    ("", "0"),
])
def test_math_unequal_pairs(pred, ref):
    assert not math_equal(pred, ref)


def test_boxed_extraction_nested_and_last():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\left\{ x \mid x^{2} > 1 \right\}}") == r"\left\{ x \mid x^{2} > 1 \right\}"
    assert last_boxed(r"so \boxed 7.") == "7."
    assert last_boxed(r"\fbox{3}") == "3"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed("no box") is None


def test_math_extraction_order():
    assert extract_math(r"The answer is 3, i.e. \boxed{4}") == ("4", "boxed")
    assert extract_math("Thus the final answer is: -12.")[0] == "-12."
    assert extract_math("no answer here")[0] is None


def test_rule_judge_math_records():
    judge = RuleJudge()
    rec = {"id": "x", "answer": "0.5", "answer_type": "math"}
    assert judge.judge(rec, r"... so we get \boxed{\dfrac{1}{2}}").correct
    assert not judge.judge(rec, r"\boxed{\frac{1}{3}}").correct
    v = judge.judge(rec, "I do not know")
    assert not v.correct and v.extracted is None
    rec = {"id": "y", "answer": "1000", "answer_type": "math"}
    assert judge.judge(rec, r"The answer is \boxed{1,000}").correct


# ---- multiple choice -------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("The answer is (C)", "C"),
    ("The answer is (C).", "C"),
    ("Answer: **B**", "B"),
    ("answer: d", None),  # lower-case letters are words, not options
    ("I first thought A. The answer is D.", "D"),
    ("Answer: C\nWait, no. Answer: B", "B"),
    (r"\boxed{C}", "C"),
    (r"\boxed{\text{(A)}}", "A"),
    ("(B)", "B"),
    ("  B.  ", "B"),
    ("answer is a bit unclear", None),
    ("Answer: E", None),  # only four options
    ("The answer is Apple", None),
])
def test_choice_extraction(text, want):
    assert extract_choice(text, 4)[0] == want


def test_rule_judge_choice_and_exact():
    judge = RuleJudge()
    rec = {"id": "c", "answer": "C", "answer_type": "choice", "choices": ["w", "x", "y", "z"]}
    assert judge.judge(rec, "Therefore, the answer is (C)").correct
    assert not judge.judge(rec, "Therefore, the answer is (B)").correct
    rec = {"id": "e", "answer": "Paris", "answer_type": "exact"}
    assert judge.judge(rec, "Let me think.\nAnswer: paris.").correct
    assert not judge.judge(rec, "Answer: Lyon").correct
    rec = {"id": "n", "answer": "3", "answer_type": "exact"}
    assert judge.judge(rec, "Answer: 3.0").correct
    with pytest.raises(ValueError, match="unknown answer_type 'essay'"):
        judge.judge({"id": "z", "answer": "1", "answer_type": "essay"}, "1")


# ---- pass@k ----------------------------------------------------------------------------------
def _brute_pass_at_k(n, c, k):
    hits = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(hits[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_subset_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_large_n_and_errors():
    assert pass_at_k(32, 1, 32) == 1.0
    assert pass_at_k(32, 0, 8) == 0.0
    assert pass_at_k(1000, 10, 100) == pytest.approx(1 - math.comb(990, 100) / math.comb(1000, 100))
    assert default_ks(32) == [1, 2, 4, 8, 16, 32]
    assert default_ks(6) == [1, 2, 4, 6]
    assert mean_pass_at_k([(4, 1), (4, 3)], 1) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k=5 must be within"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct count"):
        pass_at_k(4, 5, 1)


# ---- JSONL records ---------------------------------------------------------------------------
def test_jsonl_torn_last_line_is_cut_and_appending_continues(tmp_path):
    path = tmp_path / "g.jsonl"
    f, old, torn = jsonl.open_for_append(path)
    assert old == [] and torn == 0
    jsonl.append_record(f, {"id": "a"})
    jsonl.append_record(f, {"id": "b"})
    f.close()
    with open(path, "a") as f:
        f.write('{"id": "c", "samp')  # a writer killed mid-line
    assert [r["id"] for r in jsonl.read_jsonl(path)] == ["a", "b"]
    f, old, torn = jsonl.open_for_append(path)
    assert [r["id"] for r in old] == ["a", "b"] and torn == len('{"id": "c", "samp')
    jsonl.append_record(f, {"id": "c"})
    f.close()
    assert [r["id"] for r in jsonl.read_jsonl(path)] == ["a", "b", "c"]


def test_jsonl_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text('{"id": "a"}\n{oops\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"g.jsonl:2: not a JSON"):
        jsonl.read_jsonl(path)


# ---- dataset adapters ------------------------------------------------------------------------
def test_bundled_samples_load_in_each_shape():
    items, _ = datasets.load_dataset(SAMPLES / "generic.jsonl")
    assert [i.answer_type for i in items] == ["math", "math", "choice", "exact"]
    assert items[1].messages and items[1].question == "What does len([1, 2, 3]) return?"
    aime, _ = datasets.load_dataset(SAMPLES / "aime.jsonl", "aime")
    assert aime[0].answer_type == "math" and "\\boxed{}" in aime[0].prompt and aime[0].category == "toy-1"
    hle, skipped = datasets.load_dataset(SAMPLES / "hle.jsonl", "hle", skip_images=True)
    assert [i.answer_type for i in hle] == ["exact", "choice"] and skipped == {"image": 1}
    with pytest.raises(datasets.DatasetError, match=r"hle.jsonl:3: item 'toy-hle-3' has an image.*--skip-images"):
        datasets.load_dataset(SAMPLES / "hle.jsonl", "hle")


def test_gpqa_options_shuffled_deterministically_and_answer_follows():
    items, _ = datasets.load_dataset(SAMPLES / "gpqa.jsonl", "gpqa")
    again, _ = datasets.load_dataset(SAMPLES / "gpqa.jsonl", "gpqa")
    for item, same in zip(items, again):
        assert item.choices == same.choices and item.prompt == same.prompt
        correct = json.loads((SAMPLES / "gpqa.jsonl").read_text().splitlines()[items.index(item)])["Correct Answer"]
        assert item.choices["ABCD".index(item.answer)] == correct
        assert f"{item.answer}) {correct}" in item.prompt
        assert item.category == "Computer Science" and item.difficulty


def test_dataset_errors_name_the_line_and_field(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"id": "1", "prompt": "p", "answer": "1"}\n{"id": "1", "prompt": "q", "answer": "2"}\n')
    with pytest.raises(datasets.DatasetError, match=r"d.jsonl:2: duplicate id '1' \(first on line 1\)"):
        datasets.load_dataset(bad)
    bad.write_text('{"id": "1", "problem": "p", "answer": "1"}\n')
    with pytest.raises(datasets.DatasetError, match=r"d.jsonl:1: give exactly one of 'prompt' or 'messages'.*aime"):
        datasets.load_dataset(bad)
    bad.write_text('{"id": "1", "prompt": "p", "answer": "Z", "answer_type": "choice", "choices": ["a", "b"]}\n')
    with pytest.raises(datasets.DatasetError, match=r"option letter \(A-B\), got 'Z'"):
        datasets.load_dataset(bad)
    bad.write_text('{"Record ID": "r", "Question": "q", "Correct Answer": "a"}\n')
    with pytest.raises(datasets.DatasetError, match=r"missing field 'Incorrect Answer 1'"):
        datasets.load_dataset(bad, "gpqa")
    with pytest.raises(datasets.DatasetError, match=r"unknown adapter 'mmlu'"):
        datasets.load_dataset(bad, "mmlu")


# ---- messages -> prompt text -----------------------------------------------------------------
def test_plain_chat_layout_and_template_detection(tmp_path):
    from deepinfer_core.eval.chat import has_chat_template, render_plain

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1? <|end_of_text|>"}]
    assert render_plain(messages) == "System: Be brief.\n\nUser: 1+1? <|end_of_text|>\n\nAssistant:"
    assert not has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(tmp_path)
