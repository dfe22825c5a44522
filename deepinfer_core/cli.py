"""The ``deepinfer`` command.

    deepinfer plugins [--json]        every installed plugin, whether it loads and can run here
    deepinfer generate --model DIR --prompt TEXT [...]
    deepinfer calibrate ...           fit the scheduler's cost model (deepinfer_core.engine.calibrate)

``plugins`` only imports the plugin classes themselves: backends name their ops as
``"module:function"`` strings and import TileLang / torch_npu inside them, so listing stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from deepinfer_core import plugins
from deepinfer_core.kernels import OP_NAMES
from deepinfer_core.version import CORE_API_VERSION

HARDWARE = "deepinfer.hardware"
KERNELS = "deepinfer.kernels"
REFERENCE = "reference"


# ---- plugins ------------------------------------------------------------------------------
def _error_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _kernel_overrides(cls: Any) -> tuple[list[str] | None, str | None]:
    try:
        return list(cls.overrides()), None
    except Exception as exc:
        return None, _error_text(exc)


def collect_plugins() -> dict[str, Any]:
    """Everything ``deepinfer plugins`` shows, as plain data (the ``--json`` document)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for group in plugins.GROUPS:
        rows = []
        for info in plugins.discover(group):
            row: dict[str, Any] = {
                "name": info.name,
                "target": info.target,
                "distribution": info.distribution,
                "version": info.version,
                "loads": info.error is None,
                "error": None if info.error is None else _error_text(info.error),
                "core_api_version": None if info.obj is None else getattr(info.obj, "core_api_version", None),
            }
            rows.append((row, info))
        groups[group] = rows

    kernel_rows = {row["name"]: (row, info) for row, info in groups.get(KERNELS, [])}
    for row, info in kernel_rows.values():
        row["overrides"], row["fallbacks"] = None, None
        if info.obj is None:
            continue
        overrides, err = _kernel_overrides(info.obj)
        if err is not None:
            row["loads"], row["error"] = False, err
            continue
        row["overrides"] = overrides
        row["fallbacks"] = [] if row["name"] == REFERENCE else [n for n in OP_NAMES if n not in overrides]

    for row, info in groups.get(HARDWARE, []):
        row.update(available=None, reason=None, probe_priority=None, kernel_backend=None,
                   kernel_fallbacks=None)
        cls = info.obj
        if cls is None:
            continue
        row["probe_priority"] = getattr(cls, "probe_priority", None)
        row["device_type"] = getattr(cls, "device_type", None)
        row["dist_backend"] = getattr(cls, "dist_backend", None)
        row["kernel_backend"] = kb = getattr(cls, "kernel_backend", None)
        if kb in kernel_rows:
            krow = kernel_rows[kb][0]
            row["kernel_fallbacks"] = krow["fallbacks"]
            if not krow["loads"]:
                row["kernel_error"] = f"kernel backend {kb!r} does not load: {krow['error']}"
        else:
            row["kernel_error"] = f"kernel backend {kb!r} is not installed in {KERNELS}"
        if info.error is not None:  # loaded but unusable (e.g. core API mismatch): not probed
            continue
        row["features"] = _platform_features(cls)
        try:
            verdict = cls.probe()
            row["available"], row["reason"] = bool(verdict.ok), verdict.reason or ""
        except Exception as exc:
            row["available"], row["reason"] = False, f"probe raised {_error_text(exc)}"

    selected: str | None = None
    selection_error: str | None = None
    try:
        from deepinfer_core.selection import select_platform

        selected = select_platform().name
    except Exception as exc:
        selection_error = str(exc)
    return {
        "core_api_version": CORE_API_VERSION,
        "accelerator_setting": os.environ.get("DEEPINFER_ACCELERATOR") or "auto",
        "selected_accelerator": selected,
        "selection_error": selection_error,
        "groups": {group: [row for row, _ in rows] for group, rows in groups.items()},
    }


def _platform_features(cls: type) -> dict[str, Any] | str:
    """What the platform says it supports (its ``describe()`` less the fields shown elsewhere), or why
    it could not say."""
    try:
        facts = cls().describe()
    except Exception as exc:
        return f"describe() raised {_error_text(exc)}"
    return {k: v for k, v in facts.items() if k not in ("device_type", "dist_backend", "kernel_backend")}


def _features_text(features: dict[str, Any] | str) -> str:
    if isinstance(features, str):
        return features
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, (list, tuple)):
            return "+".join(map(str, v)) or "none"
        return str(v)
    return ", ".join(f"{k}={value(v)}" for k, v in features.items())


def _ops_text(names: list[str]) -> str:
    if len(names) == len(OP_NAMES):
        return "all ops"
    return ", ".join(names) if names else "none"


def format_plugins(doc: dict[str, Any]) -> str:
    lines = [f"deepinfer core API {doc['core_api_version']}"]
    if doc["selected_accelerator"] is not None:
        lines.append(f"accelerator ({doc['accelerator_setting']}): {doc['selected_accelerator']}")
    else:
        lines.append(f"accelerator ({doc['accelerator_setting']}): none: {doc['selection_error']}")
    for group, rows in doc["groups"].items():
        lines.append("")
        lines.append(f"{group}:" if rows else f"{group}: (none installed)")
        for row in rows:
            head = f"  {row['name']:<12} {row['distribution']} {row['version']}  ({row['target']})"
            if group == HARDWARE and row["name"] == doc["selected_accelerator"]:
                head += "  [selected]"
            lines.append(head)
            if not row["loads"]:
                lines.append(f"      loads: no: {row['error']}")
                continue
            lines.append("      loads: yes")
            if group == HARDWARE:
                if row["available"]:
                    lines.append("      available: yes")
                elif row["available"] is False:
                    lines.append(f"      available: no: {row['reason']}")
                kb = row["kernel_backend"]
                if row.get("kernel_error"):
                    lines.append(f"      kernels: {row['kernel_error']}")
                elif kb == REFERENCE:
                    lines.append(f"      kernels: {kb} (all ops are the reference)")
                else:
                    fallbacks = _ops_text(row["kernel_fallbacks"])
                    lines.append(f"      kernels: {kb}; reference fallback for: {fallbacks}")
                if row.get("features") is not None:
                    lines.append(f"      features: {_features_text(row['features'])}")
            elif group == KERNELS:
                lines.append(f"      overrides: {_ops_text(row['overrides'])}")
                if row["name"] != REFERENCE:
                    lines.append(f"      reference fallback for: {_ops_text(row['fallbacks'])}")
    return "\n".join(lines)


def _cmd_plugins(args: argparse.Namespace) -> int:
    doc = collect_plugins()
    print(json.dumps(doc, indent=2) if args.json else format_plugins(doc))
    return 0


# ---- generate -----------------------------------------------------------------------------
def _cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer_core import LLM, SamplingParams  # lazy: the engine is heavy

    llm_kwargs: dict[str, Any] = {"model": args.model}
    if args.accelerator is not None:
        llm_kwargs["accelerator"] = args.accelerator
    if args.config is not None:
        llm_kwargs["config"] = args.config
    sp_kwargs: dict[str, Any] = {}
    if args.max_tokens is not None:
        sp_kwargs["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        sp_kwargs["temperature"] = args.temperature
    if args.seed is not None:
        sp_kwargs["seq_seed"] = args.seed
    llm = LLM(**llm_kwargs)
    outputs = llm.generate(list(args.prompt), SamplingParams(**sp_kwargs))
    for i, out in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- [{i}] {args.prompt[i]!r}")
        print(out.outputs[0].text)
    return 0


# ---- calibrate ----------------------------------------------------------------------------
def _cmd_calibrate(args: argparse.Namespace) -> int:
    from deepinfer_core.engine import calibrate

    rc = calibrate.main(list(args.extra))
    return 0 if rc is None else int(rc)


# ---- entry point --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: inference for DeepSeek models")
    parser.add_argument("--log-level", default=None, help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("plugins", help="list installed plugins and whether they can run here")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_plugins)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--model", default=None, help="checkpoint directory (default: $DEEPINFER_HF_MODEL_DIR "
                   "or the embedded model)")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="per-sequence sampling seed")
    g.add_argument("--accelerator", default=None, help="accelerator name (default: auto)")
    g.add_argument("--config", default=None, help="TOML config file")
    g.set_defaults(func=_cmd_generate)

    # Everything after `calibrate` (including --help) is passed on to the calibration tool.
    c = sub.add_parser("calibrate", help="fit the scheduler's cost model on this machine", add_help=False)
    c.set_defaults(func=_cmd_calibrate, pass_through=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if extra and not getattr(args, "pass_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if args.log_level:
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
