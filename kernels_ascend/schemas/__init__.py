"""torch_npu's op schemas, pinned: the contract every ``torch_npu`` call in this plugin is checked
against (``check.py``) and the signature the CPU emulation binds calls with (tests/npu_emulation).

``torch_npu-<version>.json`` is extracted from the pinned wheel by ``python -m
kernels_ascend.schemas.extract`` (see docs/ascend.md); nothing here imports torch_npu.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

#: The torch_npu release this plugin is written and checked against.
TORCH_NPU_VERSION = "2.14.0"
SCHEMA_FILE = Path(__file__).with_name(f"torch_npu-{TORCH_NPU_VERSION}.json")

_MISSING = object()


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # as written in the schema, e.g. "Tensor?", "int[]?", "Tensor(a!)"
    default: object = _MISSING  # the Python value of the default, or _MISSING when required
    kw_only: bool = False

    @property
    def required(self) -> bool:
        return self.default is _MISSING


@dataclass(frozen=True)
class OpSchema:
    name: str  # the Python name: "npu_rms_norm" (overload suffix dropped)
    overload: str
    params: tuple[Param, ...]
    returns: str
    text: str

    @property
    def positional(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if not p.kw_only)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


def _split_top(s: str, sep: str = ",") -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [p.strip() for p in out]


def _default_value(text: str) -> object:
    text = text.strip()
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    if text.startswith(("'", '"')):
        return text[1:-1]
    if text.startswith("["):
        inner = text[1:-1].strip()
        return [_default_value(x) for x in _split_top(inner)] if inner else []
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text  # an enum name such as contiguous_format or Mean, kept as written


_FUNC = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(?:\.(?P<overload>[A-Za-z0-9_]+))?\((?P<args>.*)\)\s*->\s*(?P<ret>.+)$")


def parse_schema(text: str) -> OpSchema:
    """``name.overload(Type arg, *, Type kw=default) -> ret`` as in native_functions.yaml."""
    m = _FUNC.match(text.strip())
    if not m:
        raise ValueError(f"not an op schema: {text!r}")
    params: list[Param] = []
    kw_only = False
    for arg in _split_top(m["args"]):
        if arg == "*":
            kw_only = True
            continue
        decl, eq, default = arg.partition("=")
        typ, _, name = decl.strip().rpartition(" ")
        params.append(Param(name, typ.strip(), _default_value(default) if eq else _MISSING, kw_only))
    return OpSchema(m["name"], m["overload"] or "", tuple(params), m["ret"].strip(), text.strip())


@dataclass(frozen=True)
class Schemas:
    version: str
    wheel: str
    sha256: str
    ops: dict[str, tuple[OpSchema, ...]]  # Python name -> overloads
    modules: dict[str, frozenset[str]]  # "torch_npu.npu" -> its public names (__all__)
    enums: dict[str, dict[str, list]]  # "op.param" -> {"values": [...], "doc": excerpt}
    signatures: dict[str, list[list[dict]]]  # "torch_npu.npu.graph" -> parameter lists (function, or __new__/__init__)


@cache
def load(path: str | Path = SCHEMA_FILE) -> Schemas:
    doc = json.loads(Path(path).read_text())
    ops: dict[str, list[OpSchema]] = {}
    for text in doc["ops"]:
        s = parse_schema(text)
        ops.setdefault(s.name, []).append(s)
    return Schemas(doc["version"], doc["wheel"], doc["sha256"], {k: tuple(v) for k, v in ops.items()},
                   {k: frozenset(v) for k, v in doc["modules"].items()}, doc["enums"], doc["signatures"])
