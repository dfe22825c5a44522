"""``deepinfer eval generate -> judge -> report`` on the embedded model: each adapter's bundled toy
dataset end to end, determinism, settings checks, and resuming after a real kill."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer_core import LLM
from deepinfer_core.cli import main
from deepinfer_core.eval.chat import has_chat_template
from deepinfer_core.eval.generate import GenerateSettings, run_generate, sample_seed
from deepinfer_core.eval.jsonl import read_jsonl
from deepinfer_core.eval.judge import summary_path
from deepinfer_core.eval.rule_judge import RuleJudge

SAMPLES = Path(__file__).resolve().parents[1] / "deepinfer_core" / "eval" / "data" / "samples"
SAMPLING = {"max_tokens": 6, "temperature": 0.8}


@pytest.fixture(scope="module")
def llm():
    engine = LLM()
    yield engine
    engine.shutdown()


def _settings(**kw):
    base = {"k": 2, "seed": 7, "chunk_items": 2, "sampling": dict(SAMPLING)}
    base.update(kw)
    return GenerateSettings(**base)


def _without_timing(records):
    out = []
    for r in records:
        r = json.loads(json.dumps(r))
        r.pop("timing")
        for s in r["samples"]:
            s.pop("timing")
        out.append(r)
    return sorted(out, key=lambda r: r["id"])


@pytest.mark.parametrize("adapter", ["generic", "aime", "gpqa", "hle"])
def test_each_adapter_end_to_end(llm, tmp_path, adapter):
    gens, scores, png = tmp_path / "gens.jsonl", tmp_path / "scores.jsonl", tmp_path / "report.png"
    stats = run_generate(SAMPLES / f"{adapter}.jsonl", gens, _settings(), adapter, skip_images=True, llm=llm)
    records = read_jsonl(gens)
    want_ids = [json.loads(line).get("id", json.loads(line).get("Record ID"))
                for line in (SAMPLES / f"{adapter}.jsonl").read_text().splitlines()]
    if adapter == "hle":
        want_ids.remove("toy-hle-3")  # the item with an image
        assert stats["skipped"] == {"image": 1}
    assert [r["id"] for r in records] == want_ids and stats["written"] == len(want_ids)
    for r in records:
        assert [s["seed"] for s in r["samples"]] == [sample_seed(7, r["id"], j) for j in range(2)]
        assert r["run"]["sampling"]["max_tokens"] == 6 and r["run"]["sampling"]["temperature"] == 0.8
        assert r["run"]["k"] == 2 and r["run"]["accelerator"] == "cpu" and r["run"]["model_fingerprint"]
        assert r["prompt_tokens"] > 1
        for s in r["samples"]:
            assert s["error"] is None and s["finish_reason"] in ("stop", "length")
            assert 1 <= s["num_tokens"] <= 6
            assert s["timing"]["e2e_s"] >= s["timing"]["ttft_s"] >= 0
    if adapter == "generic" and not has_chat_template(llm.engine.model_dir):
        chat = next(r for r in records if r["id"] == "g-chat")
        assert chat["prompt_format"] == "plain"
        assert chat["prompt"] == "System: You write Python.\n\nUser: What does len([1, 2, 3]) return?\n\nAssistant:"

    assert main(["eval", "judge", "--generations", str(gens), "--out", str(scores)]) == 0
    scored = read_jsonl(scores)
    judge = RuleJudge()
    for s, r in zip(scored, records):
        verdicts = [judge.judge(r, x["text"]) for x in r["samples"]]
        assert [v["correct"] for v in s["samples"]] == [v.correct for v in verdicts]
        assert [v["extracted"] for v in s["samples"]] == [v.extracted for v in verdicts]
        assert s["correct"] == sum(v.correct for v in verdicts) and s["n"] == 2
    summary = json.loads(summary_path(scores).read_text())
    assert summary["items"] == len(records) and summary["samples"] == 2 * len(records)
    assert summary["pass@1"] == pytest.approx(sum(s["correct"] / 2 for s in scored) / len(scored), abs=1e-6)
    assert set(summary["pass_at_k"]) == {"1", "2"}

    assert main(["eval", "report", str(scores), "--png", str(png)]) == 0
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300


def test_judge_scores_a_known_right_answer(tmp_path):
    """Judging reads only the generations file: edit a sample's text and the score follows."""
    gens, scores = tmp_path / "g.jsonl", tmp_path / "s.jsonl"
    rec = {"id": "q1", "answer": "0.5", "answer_type": "math", "category": "c", "difficulty": "easy",
           "samples": [{"index": 0, "text": r"so \boxed{\frac{1}{2}}"}, {"index": 1, "text": r"\boxed{2}"},
                       {"index": 2, "text": "", "error": "prompt too long", "finish_reason": "error"}]}
    gens.write_text(json.dumps(rec) + "\n")
    assert main(["eval", "judge", "--generations", str(gens), "--out", str(scores), "--quiet"]) == 0
    (s,) = read_jsonl(scores)
    assert [x["correct"] for x in s["samples"]] == [True, False, False] and s["correct"] == 1
    assert s["pass_at_k"] == {"1": pytest.approx(1 / 3), "2": pytest.approx(2 / 3), "3": 1.0}
    summary = json.loads(summary_path(scores).read_text())
    assert summary["generation_errors"] == 1 and summary["by_difficulty"] == {"easy": {"items": 1, "pass@1": 0.333333}}


def test_messages_go_through_the_checkpoints_chat_template(tmp_path):
    """With a chat template, messages are encoded by the LLM's chat encoder (special tokens by id, text
    that spells one kept plain); a build without that encoder refuses before generating anything."""
    from deepinfer_core.models.loader import resolve_model_dir

    src = resolve_model_dir(None)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (ckpt / f.name).symlink_to(f)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|end_of_text|>{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    dataset = tmp_path / "d.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say <|end_of_text|> x"}]
    dataset.write_text(json.dumps({"id": "m", "messages": messages, "answer": "1"}) + "\n")
    out = tmp_path / "g.jsonl"
    with LLM(model=str(ckpt)) as llm:
        if getattr(llm, "chat_encoder", None) is None:
            with pytest.raises(ValueError, match=r"has a chat template.*LLM.chat_encoder"):
                run_generate(dataset, out, _settings(k=1), llm=llm)
            assert read_jsonl(out) == []
            return
        run_generate(dataset, out, _settings(k=1), llm=llm)
        (rec,) = read_jsonl(out)
        ids = llm.chat_encoder.encode(messages, add_generation_prompt=True)
        assert rec["prompt_format"] == "chat_template" and rec["prompt_tokens"] == len(ids)
        assert ids.count(llm.tokenizer.eos_token_ids[0]) == 2  # the template's two, not the user's spelling


def test_deterministic_with_fixed_seed(llm, tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    for out, seed in ((a, 7), (b, 7), (c, 8)):
        run_generate(SAMPLES / "generic.jsonl", out, _settings(seed=seed), llm=llm)
    ra, rb, rc = (_without_timing(read_jsonl(p)) for p in (a, b, c))
    assert ra == rb
    assert [s["text"] for r in ra for s in r["samples"]] != [s["text"] for r in rc for s in r["samples"]]


def test_resume_refuses_other_settings_and_skips_finished_items(llm, tmp_path):
    out = tmp_path / "g.jsonl"
    run_generate(SAMPLES / "aime.jsonl", out, _settings(), "aime", llm=llm, limit=2)
    with pytest.raises(ValueError, match=r"different settings \(k: file 2, now 3\)"):
        run_generate(SAMPLES / "aime.jsonl", out, _settings(k=3), "aime", llm=llm)
    stats = run_generate(SAMPLES / "aime.jsonl", out, _settings(), "aime", llm=llm)
    assert stats["already_done"] == 2 and stats["written"] == 1
    assert [r["id"] for r in read_jsonl(out)] == ["toy-aime-1", "toy-aime-2", "toy-aime-3"]
    with pytest.raises(ValueError, match=r"different settings \(sampling: file"):  # even with nothing left to do
        run_generate(SAMPLES / "aime.jsonl", out, _settings(sampling={"max_tokens": 5}), "aime", llm=llm)


def test_partly_written_chunk_is_rerun_whole(llm, tmp_path):
    """A kill between two items of one chunk: the rerun computes the chunk in its original batch and
    writes only the missing item, so the file equals an uninterrupted run's."""
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    run_generate(SAMPLES / "generic.jsonl", full, _settings(chunk_items=3), llm=llm)
    lines = full.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:2]) + lines[2][:40])  # chunk 0 = items 0-2: item 2 torn
    stats = run_generate(SAMPLES / "generic.jsonl", part, _settings(chunk_items=3), llm=llm)
    assert stats["already_done"] == 2 and stats["written"] == 2 and stats["torn_bytes_dropped"] == 40
    assert _without_timing(read_jsonl(part)) == _without_timing(read_jsonl(full))


@pytest.mark.slow
def test_kill_and_resume_loses_and_duplicates_nothing(tmp_path):
    dataset = tmp_path / "ds.jsonl"
    ids = [f"item-{i}" for i in range(8)]
    dataset.write_text("".join(json.dumps({"id": i, "prompt": f"def {i.replace('-', '_')}(x):\n", "answer": "0"})
                               + "\n" for i in ids))
    killed = tmp_path / "killed.jsonl"
    cmd = [sys.executable, "-m", "deepinfer_core.cli", "eval", "generate", "--dataset", str(dataset),
           "--out", str(killed), "-k", "2", "--chunk-items", "2", "--max-tokens", "6", "--temperature", "0.8",
           "--seed", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one intra-op thread, as in this process (conftest)
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            if killed.exists() and killed.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    written_before = killed.read_bytes().count(b"\n")
    assert 3 <= written_before < len(ids), (written_before, (tmp_path / "log.txt").read_text()[-2000:])
    with open(killed, "a") as f:
        f.write('{"id": "item-7", "samples": [{"te')  # as if the kill had hit mid-line

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["already_done"] == written_before and stats["written"] == len(ids) - written_before
    assert stats["torn_bytes_dropped"] > 0

    resumed = read_jsonl(killed)
    assert sorted(r["id"] for r in resumed) == sorted(ids)  # nothing lost, nothing twice
    # the uninterrupted run: the same command in a fresh process (same thread count, so bitwise equal)
    reference = tmp_path / "reference.jsonl"
    cmd[cmd.index(str(killed))] = str(reference)
    assert subprocess.run(cmd, capture_output=True, timeout=600, env=env).returncode == 0
    assert _without_timing(resumed) == _without_timing(read_jsonl(reference))


@pytest.mark.slow
def test_any_engine_config_dp_ep_through_the_cli(llm, tmp_path):
    """`-o dp=2 -o ep=2`: two rank processes (attention data-parallel, experts split); greedy texts equal
    the single-process engine's."""
    par, single = tmp_path / "dp.jsonl", tmp_path / "single.jsonl"
    args = ["eval", "generate", "--dataset", str(SAMPLES / "gpqa.jsonl"), "--adapter", "gpqa", "-k", "2",
            "--temperature", "0", "--max-tokens", "8"]
    assert main(args + ["--out", str(par), "-o", "dp=2", "-o", "ep=2"]) == 0
    greedy = GenerateSettings(k=2, seed=0, chunk_items=16, sampling={"temperature": 0.0, "max_tokens": 8})
    run_generate(SAMPLES / "gpqa.jsonl", single, greedy, "gpqa", llm=llm)
    a, b = read_jsonl(par), read_jsonl(single)
    assert [r["run"]["engine_config"]["dp"] for r in a] == [2, 2] and a[0]["run"]["engine_config"]["ep"] == 2
    assert [[s["text"] for s in r["samples"]] for r in a] == [[s["text"] for s in r["samples"]] for r in b]
