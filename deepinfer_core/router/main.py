"""``deepinfer router``: build the router from the engines' config and serve it."""

from __future__ import annotations

import argparse

from deepinfer_core.router.app import Router, build_app
from deepinfer_core.router.prefix import PrefixMatcher, open_store


def make_router(prefill: list[str], decode: list[str], cfg, chat_template: str | None = None) -> Router:
    """A router for engines that run ``cfg`` (an EngineConfig: the model for the tokenizer, the
    ``[kv_store]`` for the prefix match). The block size and store record layout are asked from
    the first prefill engine (``GET /v1/kv_layout``) on the first request."""
    from deepinfer_core.engine.tokenizer import HFTokenizer
    from deepinfer_core.models.loader import read_config, resolve_model_dir
    from deepinfer_core.models.registry import parse_config

    model_dir = resolve_model_dir(cfg.model)
    _, mc = parse_config(read_config(model_dir))
    from deepinfer_core.serving.chat import ChatEncoder, ChatTemplateError

    tokenizer = HFTokenizer.load(model_dir, mc.bos_token_id, mc.eos_token_id)
    try:
        chat_encoder = ChatEncoder(model_dir, tokenizer, chat_template)
    except ChatTemplateError:
        chat_encoder = None  # chat requests are refused with this reason's 400 (the engines would refuse them too)
    return Router(prefill, decode, tokenizer, lambda info: PrefixMatcher(
        open_store(cfg.kv_store, info["kv_store_layout"]), info["block_size"]), chat_encoder, mc.vocab_size)


def add_parser(sub, common) -> None:
    r = sub.add_parser("router", help="route requests through prefill then decode engines (P/D disaggregation)",
                       parents=[common])
    r.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill engines (deepinfer serve "
                   "-o kv_role='\"prefill\"' ...)")
    r.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode engines")
    r.add_argument("--model", default=None, help="the engines' model (for the tokenizer)")
    r.add_argument("--config", default=None, help="the engines' TOML config: block_size and [kv_store] are read "
                   "for the prefix match")
    r.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help="engine config keys (repeat)")
    r.add_argument("--chat-template", default=None, help="the engines' --chat-template (to weigh chat prompts)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8080)
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from deepinfer_core.cli import _parse_option
    from deepinfer_core.config import compose

    kw = dict(_parse_option(o) for o in args.option or [])
    if args.model is not None:
        kw["model"] = args.model
    router = make_router([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode],
                         compose(args.config, **kw), args.chat_template)
    print(f"deepinfer router on http://{args.host}:{args.port}/v1: prefill {args.prefill}, decode {args.decode}",
          flush=True)
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
