"""The LLM judge over HTTP: against a real OpenAI-shaped server on 127.0.0.1 (http.server, this file),
and against a live ``deepinfer serve`` when that command exists."""

import json
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deepinfer_core.cli import build_parser, main
from deepinfer_core.eval.jsonl import read_jsonl
from deepinfer_core.eval.judge import summary_path
from deepinfer_core.eval.llm_judge import ChatClient, JudgeError, load_prompt, parse_reply
from deepinfer_core.ports import free_port as _free_port


class FakeJudgeServer:
    """``POST /v1/chat/completions`` answering like a grader: "correct: yes" when the reference text
    appears in the response. It reads the prompt in the bundled layout or in the custom ``REF<<..>>``
    layout of the test's own prompt file, so a verdict proves which prompt reached it."""

    def __init__(self):
        self.requests, self.fail_next, self.lock = [], 0, threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                            "body": body})
                    fail = server.fail_next > 0
                    server.fail_next -= fail
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                if fail:
                    return self._send(503, {"error": {"message": "busy", "type": "overloaded"}})
                if body["model"] == "rejecting-model":
                    return self._send(400, {"error": {"message": "model 'rejecting-model' does not exist",
                                                      "type": "invalid_request_error", "param": "model"}})
                prompt = body["messages"][0]["content"]
                reply = server.grade(prompt) if body["model"] != "mute-model" else "I cannot decide."
                self._send(200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": reply}}]})

            def _send(self, code, doc):
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def grade(prompt: str) -> str:
        if "REF<<" in prompt:
            ref = prompt.split("REF<<")[1].split(">>")[0]
            resp = prompt.split("RESP<<")[1].split(">>")[0]
        else:
            resp = prompt.split("[response]\n")[1].split("\n\n[reference answer]")[0]
            ref = prompt.split("[reference answer]\n")[1].split("\n\n")[0]
        ok = ref.strip() in resp
        return (f"extracted_final_answer: {resp.split()[-1] if resp.split() else 'None'}\n"
                f"reasoning: compared with {ref.strip()}\n**correct:** {'yes' if ok else 'no'}")

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeJudgeServer()
    yield s
    s.close()


@pytest.fixture
def generations(tmp_path):
    path = tmp_path / "gens.jsonl"
    recs = [
        {"id": "q1", "question": "What is 6 x 7?", "answer": "42", "answer_type": "math", "category": "arith",
         "samples": [{"index": 0, "text": "It is 42"}, {"index": 1, "text": "It is 41"}]},
        {"id": "q2", "question": "Capital of France? Use {braces} and $dollars$.", "answer": "Paris",
         "answer_type": "exact", "category": "geo",
         "samples": [{"index": 0, "text": "Paris, of course"}, {"index": 1, "text": "$\\{Lyon\\}$"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_llm_judge_scores_through_the_http_api(server, generations, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    scores = tmp_path / "scores.jsonl"
    rc = main(["eval", "judge", "--generations", str(generations), "--out", str(scores), "--judge", "llm",
               "--judge-url", server.url, "--judge-model", "grader-1", "--judge-api-key-env", "JUDGE_KEY"])
    assert rc == 0
    by_id = {s["id"]: s for s in read_jsonl(scores)}
    assert [x["correct"] for x in by_id["q1"]["samples"]] == [True, False]
    assert [x["correct"] for x in by_id["q2"]["samples"]] == [True, False]
    assert by_id["q1"]["samples"][0]["extracted"] == "42" and by_id["q1"]["correct"] == 1
    assert len(server.requests) == 4
    for req in server.requests:
        assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
        assert req["body"]["model"] == "grader-1" and req["body"]["temperature"] == 0
    prompts = [r["body"]["messages"][0]["content"] for r in server.requests]
    assert any("Capital of France? Use {braces} and $dollars$." in p and "$\\{Lyon\\}$" in p for p in prompts)
    summary = json.loads(summary_path(scores).read_text())
    assert summary["judge"] == {"name": "llm", "url": server.url, "model": "grader-1",
                                "prompt_file": summary["judge"]["prompt_file"]}
    assert summary["pass@1"] == 0.5 and summary["judge_errors"] == 0
    assert "| q1 " in capsys.readouterr().out


def test_user_prompt_file_is_what_the_judge_receives(server, generations, tmp_path):
    prompt = tmp_path / "my_prompt.txt"
    prompt.write_text("Grade it. REF<<{{reference}}>> RESP<<{{ response }}>>\nSay correct: yes or no.")
    scores = tmp_path / "s.jsonl"
    assert main(["eval", "judge", "--generations", str(generations), "--out", str(scores), "--judge", "llm",
                 "--judge-url", server.url + "/", "--judge-model", "m", "--judge-prompt", str(prompt), "--quiet"]) == 0
    sent = server.requests[0]["body"]["messages"][0]["content"]
    assert sent.startswith("Grade it. REF<<") and "{{" not in sent
    assert [s["correct"] for s in read_jsonl(scores)] == [1, 1]


def test_prompt_file_placeholders_are_checked(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_text("{{question}} {{reference}}")
    with pytest.raises(ValueError, match=r"missing placeholder\(s\) \{\{response\}\}"):
        load_prompt(bad)
    bad.write_text("{{reference}} {{response}} {{answer}}")
    with pytest.raises(ValueError, match=r"unknown placeholder\(s\) \['answer'\]"):
        load_prompt(bad)


def test_reply_parsing():
    assert parse_reply("extracted_final_answer: 7\nreasoning: r\ncorrect: yes") == (True, "7")
    assert parse_reply("correct: yes\n...\nCorrect: NO") == (False, None)
    assert parse_reply("extracted_final_answer: None\ncorrect: no") == (False, None)
    assert parse_reply("The response is correct: yes") == (None, None)  # not on a line of its own


def test_unreadable_replies_are_counted_as_judge_errors(server, generations, tmp_path):
    scores = tmp_path / "s.jsonl"
    assert main(["eval", "judge", "--generations", str(generations), "--out", str(scores), "--judge", "llm",
                 "--judge-url", server.url, "--judge-model", "mute-model", "--quiet"]) == 0
    summary = json.loads(summary_path(scores).read_text())
    assert summary["judge_errors"] == 4 and summary["pass@1"] == 0.0
    assert all(x["error"].startswith("unreadable judge reply") for s in read_jsonl(scores) for x in s["samples"])


def test_busy_endpoint_is_retried_and_client_errors_are_reported(server, generations, tmp_path, capsys):
    server.fail_next = 2
    client = ChatClient(server.url, "grader", retries=2)
    assert "correct" in client.complete("[response]\nx\n\n[reference answer]\nx\n\n")
    assert len(server.requests) == 3
    server.fail_next = 5
    with pytest.raises(JudgeError, match=r"failed 3 times; last error: HTTP 503: busy"):
        ChatClient(server.url, "grader", retries=2).complete("p")
    rc = main(["eval", "judge", "--generations", str(generations), "--out", str(tmp_path / "s.jsonl"),
               "--judge", "llm", "--judge-url", server.url, "--judge-model", "rejecting-model"])
    assert rc == 2
    assert "HTTP 400: model 'rejecting-model' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "s.jsonl").exists()  # nothing half-written
    with pytest.raises(ValueError, match="--judge-url must be an http"):
        ChatClient("127.0.0.1:8000/v1", "m")


# ---- a live `deepinfer serve` ----------------------------------------------------------------
def _has_serve() -> bool:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return "serve" in sub.choices


@pytest.mark.skipif(not _has_serve(), reason="`deepinfer serve` missing: the OpenAI-compatible server is on branch "
                    "h15, not merged yet")
def test_llm_judge_against_live_deepinfer_serve(generations, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline, models = time.time() + 180, None
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(base + "/models", timeout=2) as resp:
                    models = json.loads(resp.read())
                break
            except OSError:
                time.sleep(0.5)
        assert models is not None, (tmp_path / "serve.log").read_text()[-2000:]
        model = models["data"][0]["id"]
        scores = tmp_path / "s.jsonl"
        # The embedded model is a code model: it will not follow the grading format, so the point here is
        # the round trip (every sample asked and answered in OpenAI's shape), not the verdicts.
        rc = main(["eval", "judge", "--generations", str(generations), "--out", str(scores), "--judge", "llm",
                   "--judge-url", base, "--judge-model", model, "--judge-max-tokens", "8", "--quiet"])
        assert rc == 0
        scored = read_jsonl(scores)
        assert sum(len(s["samples"]) for s in scored) == 4
        summary = json.loads(summary_path(scores).read_text())
        assert summary["judge"]["model"] == model and summary["samples"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
