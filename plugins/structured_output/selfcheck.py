"""An end-to-end check of structured output on a running LLM (``examples/offline_inference.py
--check_structured_output``): regex, JSON Schema (validated with ``jsonschema``), EBNF and EOS
termination, in one batch on one engine, next to an unconstrained request.

Every grammar here can always terminate within ``max_tokens`` whatever the model prefers (bounded
repetitions, ``maxLength``, ``maxItems``, integer ranges), so the outputs are valid regardless of
model quality.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from deepinfer_core.sampling_params import SamplingParams

REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "version": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["cpu", "gpu", "npu"]}, "maxItems": 3},
        "stable": {"type": "boolean"},
    },
    "required": ["name", "version", "tags", "stable"],
}
EBNF = r'''
root ::= "def " name "(" params "):" body
params ::= "" | name | name ", " name
body ::= "\n    return " expr
expr ::= name | number | name " + " number
name ::= [a-z] [a-z_0-9]? [a-z_0-9]? [a-z_0-9]? [a-z_0-9]? [a-z_0-9]?
number ::= [0-9] [0-9]? [0-9]?
'''
EBNF_EQUIVALENT = re.compile(r"def N\((|N|N, N)\):\n    return (N|[0-9]{1,3}|N \+ [0-9]{1,3})"
                             .replace("N", "[a-z][a-z_0-9]{0,5}"))
YES_NO = "(yes|no)"


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str


def _validate_json(text: str) -> tuple[bool, str]:
    import jsonschema

    try:
        value = json.loads(text)
        jsonschema.validate(value, JSON_SCHEMA)
    except (ValueError, jsonschema.ValidationError) as exc:
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return True, "parses and validates"


def run_check(llm, seed: int = 0, temperature: float = 0.8, max_tokens: int = 160) -> list[CheckResult]:
    """Run the five requests in one ``generate`` call; returns a result per check."""
    eos = set(llm.tokenizer.eos_token_ids)

    def params(so_args=None, limit=max_tokens):
        return SamplingParams(temperature=temperature, seq_seed=seed, max_tokens=limit, so_args=so_args)

    requests = [
        ("regex", "# release date: ", params({"schema_type": "regex", "schema": REGEX})),
        ("json", "config = ", params({"schema_type": "json", "schema": JSON_SCHEMA})),
        ("ebnf", "# a helper\n", params({"schema_type": "ebnf", "schema": EBNF})),
        ("eos", "ok = input('yes or no? ')  # ", params({"schema_type": "regex", "schema": YES_NO})),
        ("unconstrained", "def main():\n", params(limit=24)),
    ]
    outputs = llm.generate([p for _, p, _ in requests], [sp for _, _, sp in requests], use_tqdm=False)
    results = []
    for (name, _, _), out in zip(requests, outputs):
        comp = out.outputs[0]
        text, reason = comp.text, comp.finish_reason
        if out.error is not None:
            results.append(CheckResult(name, False, f"error: {out.error}"))
            continue
        ended = reason == "stop" and bool(comp.token_ids) and comp.token_ids[-1] in eos
        if name == "regex":
            ok, detail = re.fullmatch(REGEX, text) is not None, "matches"
        elif name == "json":
            ok, detail = _validate_json(text)
        elif name == "ebnf":
            ok, detail = EBNF_EQUIVALENT.fullmatch(text) is not None, "matches the grammar"
        elif name == "eos":
            ok, detail = re.fullmatch(YES_NO, text) is not None and ended, "ends with EOS right after the grammar"
        else:
            ok, detail = reason in ("stop", "length"), "completes beside the constrained requests"
        if name != "unconstrained" and not ended:
            ok, detail = False, f"did not end with EOS (finish_reason={reason})"
        results.append(CheckResult(name, ok, f"{detail}: {text!r}"))
    return results
