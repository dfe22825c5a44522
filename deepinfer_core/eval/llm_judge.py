"""The LLM judge: asks a model behind any OpenAI-compatible ``/v1/chat/completions`` endpoint.

The prompt comes from a text file the user can edit (default ``data/judge_prompt.txt``). It must
contain ``{{response}}`` and ``{{reference}}`` and may contain ``{{question}}``; nothing else in it is
interpreted, so braces and dollar signs in the file or in the answers are safe. The reply must contain
a line ``correct: yes`` or ``correct: no`` (the last such line counts) and may give
``extracted_final_answer: ...``. A reply without a verdict is counted wrong and reported as a judge
error on that sample; an endpoint that keeps failing stops the run with its error message.

Requests use the standard library's HTTP client (no extra dependency); ``--judge-url`` is the base URL
as in OpenAI clients, e.g. ``http://127.0.0.1:8000/v1``.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from deepinfer_core.eval.rule_judge import Verdict

DEFAULT_PROMPT = Path(__file__).parent / "data" / "judge_prompt.txt"
PLACEHOLDERS = ("question", "reference", "response")
RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class JudgeError(RuntimeError):
    """The judge endpoint failed (after retries) or answered in a shape that is not OpenAI's."""


def load_prompt(path: Path | None) -> str:
    path = Path(path) if path is not None else DEFAULT_PROMPT
    text = path.read_text(encoding="utf-8")
    found = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", text))
    unknown = sorted(found - set(PLACEHOLDERS))
    if unknown:
        raise ValueError(f"judge prompt {path}: unknown placeholder(s) {unknown}; use {{{{question}}}}, "
                         "{{reference}} and {{response}}")
    missing = [p for p in ("response", "reference") if p not in found]
    if missing:
        raise ValueError(f"judge prompt {path}: missing placeholder(s) {', '.join('{{' + m + '}}' for m in missing)}")
    return text


def fill_prompt(template: str, question: str, reference: str, response: str) -> str:
    values = {"question": question, "reference": reference, "response": response}
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values[m.group(1)], template)


def parse_reply(reply: str) -> tuple[bool | None, str | None]:
    """(verdict or None when the reply has none, extracted answer or None)."""
    verdicts = re.findall(r"(?im)^[\s\*]*correct[\s\*]*:[\s\*]*(yes|no)\b", reply)
    answers = re.findall(r"(?im)^[\s\*]*extracted_final_answer[\s\*]*:[\s\*]*(.*?)\s*$", reply)
    extracted = answers[-1] if answers and answers[-1].lower() != "none" else None
    return (verdicts[-1].lower() == "yes" if verdicts else None), extracted


class ChatClient:
    """A minimal client of ``POST {base_url}/chat/completions``."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0,
                 retries: int = 3, max_tokens: int = 512) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--judge-url must be an http(s) base URL such as http://127.0.0.1:8000/v1, "
                             f"got {base_url!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        self.retries, self.max_tokens = retries, max_tokens

    def complete(self, prompt: str) -> str:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                           "temperature": 0, "max_tokens": self.max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    doc = json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {_error_message(exc)}"
                if exc.code in RETRY_STATUS:
                    continue
                raise JudgeError(f"judge endpoint {self.url}: {last}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
                continue
            except json.JSONDecodeError:
                raise JudgeError(f"judge endpoint {self.url}: the reply is not JSON") from None
            try:
                content = doc["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                raise JudgeError(f"judge endpoint {self.url}: reply has no choices[0].message.content: "
                                 f"{json.dumps(doc)[:300]}") from None
            if not isinstance(content, str):
                raise JudgeError(f"judge endpoint {self.url}: choices[0].message.content is not a string")
            return content
        raise JudgeError(f"judge endpoint {self.url} failed {self.retries + 1} times; last error: {last}")


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        doc = json.loads(exc.read())
        return str(doc["error"]["message"])
    except Exception:
        return exc.reason or "no message"


class LLMJudge:
    name = "llm"

    def __init__(self, client: ChatClient, prompt_template: str, concurrency: int = 8) -> None:
        self.client, self.template, self.concurrency = client, prompt_template, concurrency

    @classmethod
    def from_args(cls, url: str, model: str, prompt_file: Path | None = None, api_key_env: str = "OPENAI_API_KEY",
                  concurrency: int = 8, max_tokens: int = 512) -> LLMJudge:
        client = ChatClient(url, model, api_key=os.environ.get(api_key_env), max_tokens=max_tokens)
        return cls(client, load_prompt(prompt_file), concurrency)

    def judge(self, record: dict, text: str) -> Verdict:
        prompt = fill_prompt(self.template, record.get("question") or record.get("prompt") or "",
                             str(record["answer"]), text)
        reply = self.client.complete(prompt)
        verdict, extracted = parse_reply(reply)
        if verdict is None:
            return Verdict(False, extracted, "judge reply has no 'correct: yes|no' line",
                           error=f"unreadable judge reply: {reply[:200]!r}")
        return Verdict(verdict, extracted, "llm judge")
