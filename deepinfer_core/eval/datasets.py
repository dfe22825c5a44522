"""Evaluation datasets: JSONL files read into :class:`EvalItem` through a schema adapter.

Adapters (``--adapter``), one per input shape; each documents the fields it reads:

``generic`` (default)
    ``{"id", "prompt" | "messages", "answer", "answer_type"?, "choices"?, "category"?, "difficulty"?}``.
    ``answer_type`` is ``math`` (default), ``choice`` (``answer`` is a letter A, B, ...) or ``exact``.
``aime``
    ``{"id"|"ID", "problem"|"Problem"|"question", "answer"|"Answer", "year"?}``: a math problem with an integer
    answer; the prompt asks for the final answer in ``\\boxed{}``.
``gpqa``
    GPQA's CSV columns as JSON keys: ``"Record ID", "Question", "Correct Answer", "Incorrect Answer 1..3",
    "High-level domain"?, "Subdomain"?, "Writer's Difficulty Estimate"?``. The four options are shuffled
    into A-D by a seed derived from the record id (so every run and every sample sees the same order),
    and the answer becomes the correct option's letter.
``hle``
    ``{"id", "question", "answer", "answer_type": "exactMatch"|"multipleChoice", "category"?,
    "raw_subject"?, "image"?}``. Multiple-choice questions already list their options in the text; the
    answer is the letter. Items with a non-empty ``image`` cannot run on a text model: they are an
    error naming the item unless ``skip_images`` is set, then they are skipped and counted.

Every adapter keeps the raw fields it does not use in ``EvalItem.meta``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ANSWER_TYPES = ("math", "choice", "exact")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = "Answer with the letter of the correct option, in the form 'Answer: X'."
EXACT_INSTRUCTION = "Give your final answer on the last line, in the form 'Answer: ...'."


@dataclass
class EvalItem:
    id: str
    answer: str
    answer_type: str  # math | choice | exact
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    question: str = ""  # the question as a judge should see it
    choices: list[str] | None = None  # option texts, in letter order (choice items)
    category: str | None = None
    difficulty: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class DatasetError(ValueError):
    """A dataset line does not fit its adapter's shape."""


def _pick(raw: dict, names: tuple[str, ...], where: str, required: bool = True) -> Any:
    for name in names:
        if raw.get(name) not in (None, ""):
            return raw[name]
    if required:
        raise DatasetError(f"{where}: missing field {' or '.join(repr(n) for n in names)}")
    return None


def _text(value: Any, name: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field {name!r} must be a string or number, got {type(value).__name__}")
    return str(value)


def _rest(raw: dict, used: set[str]) -> dict:
    return {k: v for k, v in raw.items() if k not in used}


def generic(raw: dict, where: str) -> EvalItem:
    item_id = _text(_pick(raw, ("id",), where), "id", where)
    prompt, messages = raw.get("prompt"), raw.get("messages")
    if (prompt is None) == (messages is None):
        raise DatasetError(f"{where}: give exactly one of 'prompt' or 'messages' (for AIME, GPQA or HLE "
                           "shaped files pass --adapter aime|gpqa|hle)")
    if prompt is not None and not isinstance(prompt, str):
        raise DatasetError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    if messages is not None:
        _check_messages(messages, where)
    answer_type = raw.get("answer_type", "math")
    if answer_type not in ANSWER_TYPES:
        raise DatasetError(f"{where}: 'answer_type' must be one of {list(ANSWER_TYPES)}, got {answer_type!r}")
    answer = _text(_pick(raw, ("answer",), where), "answer", where).strip()
    choices = raw.get("choices")
    if answer_type == "choice":
        letters = LETTERS[: len(choices)] if isinstance(choices, list) else LETTERS
        if answer.upper() not in letters:
            raise DatasetError(f"{where}: a 'choice' answer must be one option letter ({letters[0]}-{letters[-1]}), "
                               f"got {answer!r}")
        answer = answer.upper()
    question = prompt if prompt is not None else next(
        (m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    used = {"id", "prompt", "messages", "answer", "answer_type", "choices", "category", "difficulty"}
    return EvalItem(item_id, answer, answer_type, prompt=prompt, messages=messages, question=question,
                    choices=choices, category=_opt(raw.get("category")), difficulty=_opt(raw.get("difficulty")),
                    meta=_rest(raw, used))


def aime(raw: dict, where: str) -> EvalItem:
    item_id = _text(_pick(raw, ("id", "ID"), where), "id", where)
    problem = _text(_pick(raw, ("problem", "Problem", "question"), where), "problem", where)
    answer = _text(_pick(raw, ("answer", "Answer"), where), "answer", where).strip()
    year = raw.get("year", raw.get("Year"))
    used = {"id", "ID", "problem", "Problem", "question", "answer", "Answer"}
    return EvalItem(item_id, answer, "math", prompt=f"{problem}\n\n{MATH_INSTRUCTION}", question=problem,
                    category=_opt(year), meta=_rest(raw, used))


GPQA_WRONG = ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


def gpqa(raw: dict, where: str) -> EvalItem:
    item_id = _text(_pick(raw, ("Record ID", "id"), where), "Record ID", where)
    question = _text(_pick(raw, ("Question",), where), "Question", where).strip()
    correct = _text(_pick(raw, ("Correct Answer",), where), "Correct Answer", where).strip()
    options = [correct] + [_text(_pick(raw, (k,), where), k, where).strip() for k in GPQA_WRONG]
    order = list(range(4))
    random.Random(_stable_int(item_id)).shuffle(order)
    choices = [options[i] for i in order]
    letter = LETTERS[order.index(0)]
    listing = "\n".join(f"{LETTERS[i]}) {text}" for i, text in enumerate(choices))
    prompt = f"{question}\n\n{listing}\n\n{CHOICE_INSTRUCTION}"
    used = {"Record ID", "id", "Question", "Correct Answer", *GPQA_WRONG}
    return EvalItem(item_id, letter, "choice", prompt=prompt, question=f"{question}\n\n{listing}", choices=choices,
                    category=_opt(raw.get("High-level domain")),
                    difficulty=_opt(raw.get("Writer's Difficulty Estimate")), meta=_rest(raw, used))


HLE_TYPES = {"exactMatch": "exact", "multipleChoice": "choice"}


def hle(raw: dict, where: str) -> EvalItem:
    item_id = _text(_pick(raw, ("id",), where), "id", where)
    question = _text(_pick(raw, ("question",), where), "question", where)
    answer = _text(_pick(raw, ("answer",), where), "answer", where).strip()
    kind = raw.get("answer_type")
    if kind not in HLE_TYPES:
        raise DatasetError(f"{where}: 'answer_type' must be one of {list(HLE_TYPES)}, got {kind!r}")
    answer_type = HLE_TYPES[kind]
    if answer_type == "choice":
        if answer.upper() not in LETTERS:
            raise DatasetError(f"{where}: a multipleChoice answer must be an option letter, got {answer!r}")
        answer = answer.upper()
    instruction = CHOICE_INSTRUCTION if answer_type == "choice" else EXACT_INSTRUCTION
    used = {"id", "question", "answer", "answer_type", "category"}
    return EvalItem(item_id, answer, answer_type, prompt=f"{question}\n\n{instruction}", question=question,
                    category=_opt(raw.get("category")), meta=_rest(raw, used))


ADAPTERS: dict[str, Callable[[dict, str], EvalItem]] = {"generic": generic, "aime": aime, "gpqa": gpqa, "hle": hle}


def load_dataset(path: Path, adapter: str = "generic", skip_images: bool = False,
                 limit: int | None = None) -> tuple[list[EvalItem], dict[str, int]]:
    """Read ``path`` through ``adapter``. Returns (items, counts of skipped items by reason).

    Item ids must be unique (resuming a run relies on them)."""
    if adapter not in ADAPTERS:
        raise DatasetError(f"unknown adapter {adapter!r}; known: {sorted(ADAPTERS)}")
    convert = ADAPTERS[adapter]
    path = Path(path)
    items: list[EvalItem] = []
    seen: dict[str, int] = {}
    skipped: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: not JSON: {exc.msg}") from None
            if not isinstance(raw, dict):
                raise DatasetError(f"{where}: each line must be a JSON object, got {type(raw).__name__}")
            if adapter == "hle" and raw.get("image"):
                if not skip_images:
                    raise DatasetError(f"{where}: item {raw.get('id')!r} has an image, which a text model cannot "
                                       "see; pass --skip-images to leave such items out")
                skipped["image"] = skipped.get("image", 0) + 1
                continue
            item = convert(raw, where)
            if item.id in seen:
                raise DatasetError(f"{where}: duplicate id {item.id!r} (first on line {seen[item.id]})")
            seen[item.id] = lineno
            items.append(item)
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise DatasetError(f"{path}: no items")
    return items, skipped


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DatasetError(f"{where}: messages[{i}] must be {{'role': str, 'content': str}}, got {m!r}")
        if m["role"] not in ("system", "user", "assistant"):
            raise DatasetError(f"{where}: messages[{i}].role must be system, user or assistant, got {m['role']!r}")


def _opt(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
