"""Static check of every ``torch_npu`` use against the pinned wheel's schemas (no torch_npu needed).

Finds, by AST, every call of a torch_npu op (``torch_npu.npu_x(...)``, through ``import torch_npu as
t``, ``from torch_npu import npu_x [as y]`` or ``torch.ops.npu.npu_x(...)``) and every use of
``torch_npu.npu.*`` / ``torch.npu.*``, and checks that:

* the op exists in torch_npu's schema file (``npu_native_functions_by_codegen.yaml``);
* every keyword is a parameter of the op, no parameter is given twice, the positional arguments fit
  the positional parameters, and every required parameter is given;
* literal values of enum-like parameters are among the values the op's docs allow;
* ``torch_npu.npu.<name>`` is in that module's ``__all__`` and, where the wheel defines it in Python,
  the call fits its signature (keywords, positional count, required parameters).

    python -m kernels_ascend.schemas.check [paths...]    # default: kernels_ascend/ hardware/ascend.py
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernels_ascend.schemas import OpSchema, Schemas, load

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATHS = (ROOT / "kernels_ascend", ROOT / "hardware" / "ascend.py")
#: Submodules of torch_npu whose attributes are Python API, not ops.
SUBMODULES = {"npu": "torch_npu.npu"}


@dataclass
class Call:
    path: str
    line: int
    op: str  # "npu_rms_norm" or "torch_npu.npu.Stream"


@dataclass
class Report:
    calls: list[Call] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ops(self) -> set[str]:
        return {c.op for c in self.calls}


def _literal(node: ast.AST) -> tuple[bool, object]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _bind_errors(schema: OpSchema, call: ast.Call) -> list[str]:
    errs = []
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return ["*args/**kwargs cannot be checked statically; spell the arguments out"]
    positional = schema.positional
    if len(call.args) > len(positional):
        errs.append(f"takes at most {len(positional)} positional argument(s) "
                    f"({', '.join(p.name for p in positional)}), got {len(call.args)}")
    given = {p.name for p in positional[: len(call.args)]}
    names = [p.name for p in schema.params]
    for kw in call.keywords:
        if kw.arg not in names:
            errs.append(f"unknown keyword {kw.arg!r} (parameters: {', '.join(names)})")
        elif kw.arg in given:
            errs.append(f"argument {kw.arg!r} given both by position and by keyword")
        given.add(kw.arg)
    for p in schema.params:
        if p.required and p.name not in given:
            errs.append(f"missing required argument {p.name!r}")
    return errs


def _enum_errors(schemas: Schemas, schema: OpSchema, call: ast.Call) -> list[str]:
    errs = []
    values = dict(zip((p.name for p in schema.positional), call.args))
    values.update({k.arg: k.value for k in call.keywords if k.arg})
    for name, node in values.items():
        enum = schemas.enums.get(f"{schema.name}.{name}")
        if enum is None:
            continue
        ok, value = _literal(node)
        if ok and value not in enum["values"]:
            errs.append(f"argument {name!r}={value!r} is not an allowed value {enum['values']} "
                        f"(docs: {enum['doc']!r})")
    return errs


def check_call(schemas: Schemas, op: str, call: ast.Call) -> list[str]:
    """Why ``call`` of torch_npu op ``op`` does not fit its schema (empty when it fits)."""
    overloads = schemas.ops.get(op)
    if not overloads:
        return [f"torch_npu {schemas.version} has no op {op!r}"]
    best: list[str] | None = None
    for schema in overloads:
        errs = _bind_errors(schema, call) or _enum_errors(schemas, schema, call)
        if not errs:
            return []
        best = errs if best is None else best
    return best or []


def check_api_call(schemas: Schemas, name: str, call: ast.Call) -> list[str]:
    """Why ``call`` of Python API ``name`` (e.g. "torch_npu.npu.graph") does not fit its signature in the
    wheel; empty when it fits or when the wheel defines ``name`` outside Python (then unknown)."""
    errs: list[str] = []
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return ["*args/**kwargs cannot be checked statically; spell the arguments out"]
    for params in schemas.signatures.get(name, []):
        positional = [p for p in params if p["kind"] in ("posonly", "pos")]
        names = {p["name"] for p in params if p["kind"] in ("pos", "kwonly")}
        varargs = any(p["kind"] == "varargs" for p in params)
        varkw = any(p["kind"] == "varkw" for p in params)
        if len(call.args) > len(positional) and not varargs:
            errs.append(f"takes at most {len(positional)} positional argument(s), got {len(call.args)}")
        given = {p["name"] for p in positional[: len(call.args)]}
        for kw in call.keywords:
            if kw.arg not in names and not varkw:
                errs.append(f"unknown keyword {kw.arg!r} (parameters: {', '.join(p['name'] for p in params)})")
            given.add(kw.arg)
        errs += [f"missing required argument {p['name']!r}" for p in params if p["required"] and p["name"] not in given]
    return list(dict.fromkeys(errs))


class _Visitor(ast.NodeVisitor):
    def __init__(self, schemas: Schemas, path: str, report: Report) -> None:
        self.schemas, self.path, self.report = schemas, path, report
        self.pkg: set[str] = set()  # names bound to the torch_npu package
        self.mods: dict[str, str] = {}  # names bound to a torch_npu submodule -> its dotted name
        self.funcs: dict[str, str] = {}  # names bound to a torch_npu op -> op name
        self.torch: set[str] = {"torch"}
        self.seen_imports: set[int] = set()

    # -- imports (bound in a first pass over the whole file, so later passes skip them) ----------
    def visit_Import(self, node: ast.Import) -> None:
        if not self._first_sight(node):
            return
        for a in node.names:
            if a.name == "torch_npu":
                self.pkg.add(a.asname or "torch_npu")
            elif a.name.startswith("torch_npu."):
                if a.asname:
                    self.mods[a.asname] = a.name
                else:
                    self.pkg.add("torch_npu")
            elif a.name == "torch":
                self.torch.add(a.asname or "torch")

    def _first_sight(self, node: ast.AST) -> bool:
        if id(node) in self.seen_imports:
            return False
        self.seen_imports.add(id(node))
        return True

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not self._first_sight(node):
            return
        if node.module == "torch_npu":
            for a in node.names:
                local = a.asname or a.name
                if a.name in SUBMODULES:
                    self.mods[local] = SUBMODULES[a.name]
                else:
                    self.funcs[local] = a.name
                    self._op_ref(a.name, node.lineno)
        elif node.module and node.module.startswith("torch_npu."):
            for a in node.names:
                self._api_ref(node.module, a.name, node.lineno)

    # -- references -------------------------------------------------------------------------
    def _error(self, line: int, msg: str) -> None:
        self.report.errors.append(f"{self.path}:{line}: {msg}")

    def _op_ref(self, op: str, line: int) -> None:
        if op not in self.schemas.ops:
            self._error(line, f"torch_npu.{op}: torch_npu {self.schemas.version} has no op {op!r}")

    def _api_ref(self, module: str, name: str, line: int) -> None:
        names = self.schemas.modules.get(module)
        if names is None:
            self._error(line, f"{module}: not a torch_npu module this check knows ({sorted(self.schemas.modules)})")
        elif name not in names:
            self._error(line, f"{module}.{name}: not in {module}.__all__ of torch_npu {self.schemas.version}")
        else:
            self.report.calls.append(Call(self.path, line, f"{module}.{name}"))

    def _resolve(self, node: ast.AST) -> tuple[str, str] | None:
        """("op", name) or ("api", "module.name") for an expression naming a torch_npu thing."""
        if isinstance(node, ast.Name) and node.id in self.funcs:
            return "op", self.funcs[node.id]
        if not isinstance(node, ast.Attribute):
            return None
        base = node.value
        if isinstance(base, ast.Name):
            if base.id in self.pkg:
                if node.attr in SUBMODULES:
                    return None
                return "op", node.attr
            if base.id in self.mods:
                return "api", f"{self.mods[base.id]}.{node.attr}"
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
            outer, mid = base.value.id, base.attr
            if outer in self.pkg and mid in SUBMODULES:
                return "api", f"{SUBMODULES[mid]}.{node.attr}"
            if outer in self.torch and mid == "npu":  # torch.npu is torch_npu.npu once imported
                return "api", f"torch_npu.npu.{node.attr}"
        # torch.ops.npu.<op>
        if (isinstance(base, ast.Attribute) and base.attr == "npu" and isinstance(base.value, ast.Attribute)
                and base.value.attr == "ops" and isinstance(base.value.value, ast.Name)
                and base.value.value.id in self.torch):
            return "op", node.attr
        return None

    def visit_Call(self, node: ast.Call) -> None:
        target = self._resolve(node.func)
        if target is not None and target[0] == "op":
            op = target[1]
            self.report.calls.append(Call(self.path, node.lineno, op))
            for err in check_call(self.schemas, op, node):
                self._error(node.lineno, f"torch_npu.{op}: {err}")
            for a in [*node.args, *(k.value for k in node.keywords)]:
                self.visit(a)
            if isinstance(node.func, ast.Attribute):
                self.visit(node.func.value)
            return
        if target is not None:  # a torch_npu.npu.* call: the name (visit_Attribute), then its signature
            for err in check_api_call(self.schemas, target[1], node):
                self._error(node.lineno, f"{target[1]}: {err}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        target = self._resolve(node)
        if target is None:
            self.generic_visit(node)
        elif target[0] == "op":
            self.report.calls.append(Call(self.path, node.lineno, target[1]))
            self._op_ref(target[1], node.lineno)
        else:
            module, _, name = target[1].rpartition(".")
            self._api_ref(module, name, node.lineno)


def check_source(source: str, path: str = "<string>", schemas: Schemas | None = None) -> Report:
    report = Report()
    tree = ast.parse(source, filename=path)
    visitor = _Visitor(schemas or load(), path, report)
    for node in ast.walk(tree):  # imports anywhere in the file (lazy imports sit inside functions)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            visitor.visit(node)
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            visitor.visit(node)
    return report


def check_paths(paths=DEFAULT_PATHS, schemas: Schemas | None = None) -> Report:
    total = Report()
    for p in paths:
        p = Path(p)
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            rel = str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f)
            r = check_source(f.read_text(), rel, schemas)
            total.calls += r.calls
            total.errors += r.errors
    return total


def main(argv: list[str] | None = None) -> int:
    paths = [Path(a) for a in (argv if argv is not None else sys.argv[1:])] or list(DEFAULT_PATHS)
    report = check_paths(paths)
    for e in report.errors:
        print(e, file=sys.stderr)
    print(f"{len(report.calls)} torch_npu use(s) of {len(report.ops)} name(s) checked, {len(report.errors)} error(s)")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
