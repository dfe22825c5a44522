"""The ``deepinfer`` command.

    deepinfer plugins [--json]        every installed plugin, whether it loads and can run here
    deepinfer generate --model DIR --prompt TEXT [...]
    deepinfer serve [MODEL] [--host --port ...]   OpenAI-compatible HTTP server (deepinfer_core/serving)
    deepinfer router --prefill URL.. --decode URL..  P/D router in front of serve processes (deepinfer_core/router)
    deepinfer bench serve --base-url URL [...]    load generator against a server (examples/serve_bench.py)
    deepinfer calibrate ...           fit the scheduler's cost model (deepinfer_core.engine.calibrate)
    deepinfer eval generate|judge|report|ppl ...   offline evaluation (deepinfer_core/eval/)

A configuration, checkpoint or accelerator error is one line on stderr (exit status 2); ``--debug``
shows the traceback. ``--log-level`` sets the level of the ``deepinfer`` loggers, in worker
processes too.

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

    llm_kwargs: dict[str, Any] = {"model": args.model, **_engine_overrides(args)}
    if args.config is not None:
        llm_kwargs["config"] = args.config
    sp_kwargs: dict[str, Any] = {}
    if args.max_tokens is not None:
        sp_kwargs["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        sp_kwargs["temperature"] = args.temperature
    if args.seed is not None:
        sp_kwargs["seed"] = args.seed
    llm = LLM(**llm_kwargs)
    outputs = llm.generate(list(args.prompt), SamplingParams(**sp_kwargs))
    for i, out in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- [{i}] {args.prompt[i]!r}")
        print(out.outputs[0].text)
    return 0


# ---- serve --------------------------------------------------------------------------------
def _parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as a TOML value (``8``, ``true``, ``[1, 2]``, ``"x"``), else a string."""
    import tomllib

    from deepinfer_core.config import ConfigError

    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--option expects KEY=VALUE, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(_parse_option(o) for o in getattr(args, "option", None) or [])
    for key in ("accelerator", "dp", "ep", "max_num_seqs", "max_model_len", "dtype"):
        value = getattr(args, key, None)
        if value is not None:
            kw[key] = value
    if args.log_level:
        kw["log_level"] = args.log_level.upper()
    return kw


def _cmd_serve(args: argparse.Namespace) -> int:
    from deepinfer_core.serving.api_server import serve

    kw = _engine_overrides(args)
    if args.model is not None:
        kw["model"] = args.model
    serve(args.config, kw, args.host, args.port, model_name=args.served_model_name or args.model,
          max_queue_len=args.max_queue_len, chat_template=args.chat_template,
          reasoning=args.reasoning_parser == "think", log_level=args.log_level or "warning")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from deepinfer_core.serving import bench

    return bench.main(list(args.extra))


# ---- calibrate ----------------------------------------------------------------------------
def _cmd_calibrate(args: argparse.Namespace) -> int:
    from deepinfer_core.engine import calibrate

    rc = calibrate.main(list(args.extra))
    return 0 if rc is None else int(rc)


# ---- entry point --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: inference for DeepSeek models")
    parser.add_argument("--log-level", default=None, type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="level of the deepinfer loggers (default: WARNING)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common = argparse.ArgumentParser(add_help=False)  # the global flags, accepted after the command too
    common.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help=argparse.SUPPRESS)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("plugins", help="list installed plugins and whether they can run here", parents=[common])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_plugins)

    g = sub.add_parser("generate", help="generate text for one or more prompts", parents=[common])
    g.add_argument("--model", default=None, help="checkpoint directory, Hugging Face id or embedded model "
                   "name (tiny-v3, tiny-v4; default: $DEEPINFER_HF_MODEL_DIR or tiny-v3)")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="per-sequence sampling seed")
    g.add_argument("--accelerator", default=None, help="accelerator name (default: auto)")
    g.add_argument("--config", default=None, help="TOML config file")
    g.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help="any engine config key (repeat)")
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", parents=[common])
    s.add_argument("model", nargs="?", default=None, help="checkpoint directory, Hugging Face id or embedded model "
                   "name (tiny-v3, tiny-v4; default: $DEEPINFER_HF_MODEL_DIR or tiny-v3)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--config", default=None, help="TOML config file (every engine key and feature section)")
    s.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                   help="an engine config key, value in TOML syntax, e.g. -o max_num_seqs=64 -o "
                        "'features=[\"structured_output\"]' (repeat)")
    s.add_argument("--accelerator", default=None)
    s.add_argument("--dtype", default=None)
    s.add_argument("--dp", type=int, default=None, help="data-parallel attention ranks")
    s.add_argument("--ep", type=int, default=None, help="expert-parallel ranks")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    s.add_argument("--max-queue-len", type=int, default=1024,
                   help="requests admitted beyond the running batch; past it, 429 (default: 1024)")
    s.add_argument("--chat-template", default=None, help="a Jinja chat template (file or text) instead of the "
                   "checkpoint's")
    s.add_argument("--reasoning-parser", choices=["none", "think"], default="none",
                   help="'think': <think>...</think> becomes reasoning_content")
    s.set_defaults(func=_cmd_serve)

    from deepinfer_core.router.main import add_parser as add_router_parser

    add_router_parser(sub, common)

    b = sub.add_parser("bench", help="benchmarks: `deepinfer bench serve --help`", add_help=False)
    b.set_defaults(func=_cmd_bench, pass_through=True)

    # Everything after `calibrate` (including --help) is passed on to the calibration tool.
    c = sub.add_parser("calibrate", help="fit the scheduler's cost model on this machine", add_help=False)
    c.set_defaults(func=_cmd_calibrate, pass_through=True)

    from deepinfer_core.eval.cli import add_eval_parser

    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if extra and not getattr(args, "pass_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.log_level:
        logging.getLogger("deepinfer").setLevel(args.log_level)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"deepinfer {args.command}: error: {_error_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _error_line(exc: BaseException) -> str:
    """One line for an error: its message, with the class name where the message alone is unclear."""
    text = " ".join(str(exc).split())
    if isinstance(exc, (ValueError, FileNotFoundError)) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
