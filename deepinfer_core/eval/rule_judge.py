"""The rule judge: extract the final answer from a response and compare it with the reference.

* ``math``: the last ``\\boxed{...}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` is whole), else the
  last "answer is X" / "Answer: X". Both sides are normalised (LaTeX spacing and wrappers, ``\\dfrac``,
  thousands separators, units and a trailing full stop dropped) and compared as exact rationals when
  both parse as numbers (``\\frac{1}{2}`` = ``0.5`` = ``1/2``), else as strings.
* ``choice``: the letter after "answer is" / "Answer:" (``(C)``, ``**C**``, ``C)`` ...), else in
  ``\\boxed{}``, else a response that is only a letter. Letters outside the item's options do not count.
* ``exact``: the "Answer:" line (else ``\\boxed{}``, else the last line), compared case- and
  space-insensitively, or as math when both sides are numbers.

No answer found is a wrong answer with ``extracted = None``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from deepinfer_core.eval.datasets import LETTERS


@dataclass
class Verdict:
    correct: bool
    extracted: str | None
    reason: str = ""  # how the answer was found (or why not)
    error: str | None = None  # the judge itself failed on this sample (e.g. an unreadable LLM reply)


# ---- extraction --------------------------------------------------------------------------------
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with nested braces, or ``\\boxed 5``."""
    found = None
    for m in _BOX.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        found = text[i + 1:j]
                        break
        elif m.group(0) != m.group(0).rstrip():  # "\boxed 5": one token after a space
            tail = re.match(r"[^\s$]+", text[i:])
            if tail:
                found = tail.group(0)
    return found


_ANSWER_IS = re.compile(r"(?i:final\s+answer|answer)\s*(?:is\s*:?|:)\s*(.+)")


def answer_phrase(text: str) -> str | None:
    """The text after the last "answer is" / "Answer:", up to the end of its line."""
    matches = _ANSWER_IS.findall(text)
    return matches[-1].strip() if matches else None


def extract_math(text: str) -> tuple[str | None, str]:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    phrase = answer_phrase(text)
    if phrase is not None:
        return phrase, "answer phrase"
    return None, "no \\boxed{} or 'answer is'"


def extract_choice(text: str, num_options: int | None = None) -> tuple[str | None, str]:
    letters = LETTERS[: num_options or 26]
    pat = rf"[\(\[\*\s]*([{letters}])(?![A-Za-z0-9])"
    found = re.findall(r"(?i:answer)\s*(?:is\s*:?|:|-)?\s*(?:option|choice)?" + pat, text)
    if found:
        return found[-1], "answer phrase"
    boxed = last_boxed(text)
    if boxed is not None:
        m = re.fullmatch(rf"\s*(?:\\text\{{)?\(?([{letters}])\)?\}}?\s*", boxed)
        if m:
            return m.group(1), "boxed"
    m = re.fullmatch(rf"[\s\*\(\[]*([{letters}])[\s\*\)\]\.:]*", text)
    if m:
        return m.group(1), "bare letter"
    return None, "no option letter found"


def extract_exact(text: str) -> tuple[str | None, str]:
    found = re.findall(r"(?im)^\s*\**\s*answer\s*\**\s*:\s*(.+)$", text)
    if found:
        return found[-1].strip(), "answer line"
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1], "last line") if lines else (None, "empty response")


# ---- normalisation -----------------------------------------------------------------------------
_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\(?:left|right|displaystyle|,|;|:|!|quad|qquad)|~")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}|\\frac\s*(\d)\s*(\d)")
_NUMBER_WITH_UNITS = re.compile(r"(-?\d+(?:\.\d+)?(?:/\d+)?)\s*(?:[A-Za-z]+\.?\s*)+")


def normalize_math(s: str) -> str:
    """A canonical string for a math answer (see the module docstring)."""
    s = s.strip()
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\u2212", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACING.sub("", s)
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)  # "\sqrt 2" -> "\sqrt{2}"
    for _ in range(3):  # nested wrappers, innermost first
        s = _WRAPPERS.sub(r"\1", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|\u00b0|\\%|%", "", s)
    s = re.sub(r"^[A-Za-z]\w*\s*=\s*", "", s)  # "x = 5" -> "5"
    s = s.strip().rstrip(".,;").strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = _FRAC.sub(lambda m: f"({m.group(1) or m.group(3)})/({m.group(2) or m.group(4)})", s)
    s = re.sub(r"\s+", " ", s).strip()
    m = _NUMBER_WITH_UNITS.fullmatch(s)
    if m:
        s = m.group(1)
    return s


def to_number(s: str) -> Fraction | None:
    """The normalised answer as an exact rational, or None."""
    t = s.replace(" ", "")
    t = re.sub(r"\((-?[\d.]+)\)", r"\1", t)  # "(1)/(2)" -> "1/2"
    m = re.fullmatch(r"(-?)([\d.]+(?:e-?\d+)?)(?:/([\d.]+))?", t)
    if not m:
        return None
    try:
        num = Fraction(m.group(2))
        den = Fraction(m.group(3)) if m.group(3) else Fraction(1)
    except (ValueError, ZeroDivisionError):
        return None
    if den == 0:
        return None
    value = num / den
    return -value if m.group(1) else value


def math_equal(pred: str, ref: str) -> bool:
    a, b = normalize_math(pred), normalize_math(ref)
    na, nb = to_number(a), to_number(b)
    if na is not None and nb is not None:
        return na == nb
    return a.replace(" ", "").casefold() == b.replace(" ", "").casefold()


def _plain(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip().strip(".").strip().casefold()


# ---- the judge ---------------------------------------------------------------------------------
class RuleJudge:
    name = "rule"

    def judge(self, record: dict, text: str) -> Verdict:
        kind, ref = record["answer_type"], str(record["answer"])
        if kind == "choice":
            choices = record.get("choices")
            got, how = extract_choice(text, len(choices) if choices else None)
            return Verdict(got is not None and got == ref.strip().upper(), got, how)
        if kind == "math":
            got, how = extract_math(text)
            return Verdict(got is not None and math_equal(got, ref), got, how)
        if kind == "exact":
            got, how = extract_exact(text)
            ok = got is not None and (_plain(got) == _plain(ref) or
                                      (to_number(normalize_math(ref)) is not None and math_equal(got, ref)))
            return Verdict(ok, got, how)
        raise ValueError(f"item {record.get('id')!r}: unknown answer_type {kind!r}")
