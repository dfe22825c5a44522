"""Extract the pinned torch_npu wheel's op schemas, module API names and documented enum values into
``torch_npu-<version>.json`` (reads the wheel as a zip: never installs or imports torch_npu).

    python -m pip download --no-deps torch-npu==2.14.0 -d .cache/torch_npu
    python -m kernels_ascend.schemas.extract .cache/torch_npu/torch_npu-2.14.0-*.whl

``--check`` compares with the committed file instead of writing it (``make check-npu-schemas``).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

from kernels_ascend.schemas import SCHEMA_FILE, TORCH_NPU_VERSION

YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
DOCS = "torch_npu/_op_plugin_docs.py"
#: Python modules whose public names (``__all__``) calls may use: module -> file in the wheel.
MODULES = {"torch_npu.npu": "torch_npu/npu/__init__.py"}

#: Allowed values of enum-like arguments, read from each op's docstring by a pattern, so that a
#: changed doc breaks the extraction instead of silently keeping stale values. op.param -> (pattern,
#: how to turn the match into values).
ENUM_PATTERNS: dict[str, tuple[str, str]] = {
    "npu_rotary_mul.rotary_mode": (r"支持'(half)'、'(interleave)'两种模式", "str"),
    "npu_moe_gating_top_k.group_select_mode": (r"`(0)`表示组内取最大值[^`]*`(1)`表示取组内Top2", "int"),
    "npu_moe_gating_top_k.norm_type": (r"`(1)`表示使用Sigmoid函数，`(0)`表示Softmax函数", "int"),
    "npu_moe_gating_top_k.renorm": (r"当前仅支持`(0)`", "int"),
    "npu_moe_init_routing_v2.drop_pad_mode": (r"drop_pad_mode：[^\n]*当前仅支持(0)", "int"),
    "npu_moe_init_routing_v2.expert_tokens_num_type": (r"expert_tokens_num_type：[^\n]*当前仅支持(1)和(2)", "int"),
    "npu_moe_init_routing_v2.expert_tokens_num_flag": (r"expert_tokens_num_flag：[^\n]*当前仅支持(True)", "bool"),
    "npu_moe_init_routing_v2.quant_mode": (r"quant_mode：[^\n]*当前仅支持(-1)和(1)", "int"),
    "npu_moe_init_routing_v2.row_idx_type": (r"row_idx_type：[^\n]*支持取值(0)和(1)", "int"),
    "npu_moe_finalize_routing.drop_pad_mode": (r"drop_pad_mode: [^\n]*取值范围为(0)", "int"),
    "npu_grouped_matmul.group_list_type": (r"可取值(0)或(1), 0代表group_list_type中数值为分组轴大小的cumsum", "int"),
    "npu_grouped_matmul.group_type": (r"Atlas A2 训练系列产品/Atlas 800I A2 推理产品: 当前支持取(-1)、(0)", "int"),
    "npu_grouped_matmul.split_item": (r"(0)/(1): 输出为多个张量[^\n]*\n(2)/(3): 输出为单个张量", "int"),
    "npu_fused_infer_attention_score_v2.input_layout": (
        r"input_layout形状支持(BSH)、(BSND)、(BNSD)、(BNSD_NBSD)、(BSND_NBSD)、(BSH_NBSD)、(TND)、(TND_NTD)", "str"),
    "npu_fused_infer_attention_score.sparse_mode": (r"当前仅支持取值(0)、(1)、(2)、(3)、(4)、(9)", "int"),
    "npu_fused_infer_attention_score_v2.sparse_mode": (
        r"sparse_mode为(0)时, 代表defaultMask[^\n]*\nsparse_mode为(1)时[^\n]*\nsparse_mode为(2)时[^\n]*\n"
        r"sparse_mode为(3)时[^\n]*\nsparse_mode为(4)时", "int"),
}


def _docstrings(src: str) -> dict[str, str]:
    out = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_add_torch_npu_docstr":
            out[node.args[0].value] = node.args[1].value
    return out


def _module_all(src: str) -> list[str]:
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return sorted(ast.literal_eval(node.value))
    raise ValueError("no __all__")


def _params(fn: ast.FunctionDef, drop_first: bool) -> list[dict]:
    a = fn.args
    out = []
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        if drop_first and i == 0:
            continue
        kind = "posonly" if i < len(a.posonlyargs) else "pos"
        out.append({"name": arg.arg, "kind": kind, "required": i < first_default})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "varargs", "required": False})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append({"name": arg.arg, "kind": "kwonly", "required": default is None})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "varkw", "required": False})
    return out


def _signatures(z: zipfile.ZipFile, module_file: str, names: list[str]) -> dict[str, list[list[dict]]]:
    """Python signatures of ``names`` (a package's public API) where the wheel defines them in Python:
    a function's parameters, or a class's ``__new__`` and ``__init__`` parameters (a call must fit
    each). Names defined in C extensions are left out (only their existence is checked)."""
    pkg_dir = module_file.rsplit("/", 1)[0]
    trees: dict[str, ast.Module] = {}

    def tree(path: str) -> ast.Module | None:
        if path not in trees:
            try:
                trees[path] = ast.parse(z.read(path).decode())
            except KeyError:
                return None
        return trees[path]

    init = tree(module_file)
    sources = [module_file]  # where to look for a name, in order: the package, its relative imports
    explicit: dict[str, str] = {}
    for node in init.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            path = f"{pkg_dir}/{node.module.replace('.', '/')}.py"
            for a in node.names:
                if a.name == "*":
                    sources.append(path)
                else:
                    explicit[a.asname or a.name] = path
    out = {}
    for name in names:
        for path in [explicit[name]] if name in explicit else sources:
            t = tree(path)
            node = next((n for n in (t.body if t else []) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                         and n.name == name), None)
            if node is None:
                continue
            if isinstance(node, ast.FunctionDef):
                out[name] = [_params(node, drop_first=False)]
            else:
                ctors = [_params(m, drop_first=True) for m in node.body
                         if isinstance(m, ast.FunctionDef) and m.name in ("__new__", "__init__")]
                if ctors:
                    out[name] = ctors
            break
    return out


def _enums(docs: dict[str, str]) -> dict[str, dict]:
    conv = {"int": int, "str": str, "bool": lambda s: s == "True"}
    out = {}
    for key, (pattern, kind) in ENUM_PATTERNS.items():
        op = key.split(".")[0]
        m = re.search(pattern, docs.get(op, ""))
        if m is None:
            raise SystemExit(f"extract: the docs of {op} no longer match the pattern for {key}: {pattern!r}")
        out[key] = {"values": sorted({conv[kind](v) for v in m.groups()}, key=str), "doc": m.group(0)}
    return out


def extract(wheel: Path) -> dict:
    data = wheel.read_bytes()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for needed in (YAML, DOCS, *MODULES.values()):
            if needed not in names:
                raise SystemExit(f"extract: {wheel.name} has no {needed}")
        funcs = set()
        for line in z.read(YAML).decode().splitlines():
            m = re.match(r"^\s*-?\s*func:\s*(.+\(.*\)\s*->.+)$", line)
            if m:  # entries without a signature are aten ops the NPU supports, not torch_npu ops
                funcs.add(m.group(1).strip())
        docs = _docstrings(z.read(DOCS).decode())
        modules = {mod: _module_all(z.read(path).decode()) for mod, path in MODULES.items()}
        signatures = {f"{mod}.{name}": sig for mod, path in MODULES.items()
                      for name, sig in _signatures(z, path, modules[mod]).items()}
    return {
        "version": TORCH_NPU_VERSION,
        "wheel": wheel.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "generated_by": "python -m kernels_ascend.schemas.extract <wheel>",
        "ops": sorted(funcs),
        "documented_ops": sorted(docs),
        "modules": modules,
        "signatures": signatures,
        "enums": _enums(docs),
    }


def render(doc: dict) -> str:
    return json.dumps(doc, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--out", type=Path, default=SCHEMA_FILE)
    ap.add_argument("--check", action="store_true", help="fail if --out differs from the extraction")
    args = ap.parse_args(argv)
    if f"torch_npu-{TORCH_NPU_VERSION}-" not in args.wheel.name:
        raise SystemExit(f"extract: {args.wheel.name} is not the pinned torch_npu {TORCH_NPU_VERSION}")
    text = render(extract(args.wheel))
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: regenerate with python -m kernels_ascend.schemas.extract {args.wheel}",
                  file=sys.stderr)
            return 1
        print(f"{args.out} matches {args.wheel.name}")
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(json.loads(text)['ops'])} op schemas)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
