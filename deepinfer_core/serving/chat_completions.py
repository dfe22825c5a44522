"""``/v1/chat/completions``: a conversation through the chat encoder, the reply parsed into
content, reasoning and tool calls, streamed over SSE or whole."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator

from deepinfer_core.outputs import Logprob
from deepinfer_core.serving.common import (
    APIError,
    ServerState,
    choice_extras,
    chunk_writer,
    failed,
    handed_off,
    live_updates,
    merged,
    request_id,
    sse,
    usage,
)
from deepinfer_core.serving.protocol import ChatCompletionRequest, NamedToolChoice, UnsupportedField
from deepinfer_core.serving.tool_parser import MessageParser, ReasoningParser, tool_call_grammar, tool_format_for


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int) -> list[dict]:
    out = []
    for tid, entry in zip(token_ids, entries):
        own = entry[tid]
        tops = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n),
                      key=lambda lp: lp.rank)
        out.append({"token": own.decoded_token, "logprob": own.logprob,
                    "bytes": list((own.decoded_token or "").encode()),
                    "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                      "bytes": list((lp.decoded_token or "").encode())} for lp in tops]})
    return out


def _prepare(state: ServerState, req: ChatCompletionRequest):
    """Prompt ids, SamplingParams, and a factory of per-choice message parsers."""
    from deepinfer_core.serving.chat import ChatTemplateError

    req.check()
    state.check_model(req.model)
    if state.chat_encoder is None:
        raise APIError(400, f"this model cannot chat: {state.chat_error}", "messages")
    enc = state.chat_encoder
    tools = req.tool_dicts()
    try:
        ids = enc.encode(req.message_dicts(), add_generation_prompt=req.add_generation_prompt, tools=tools,
                         **(req.chat_template_kwargs or {}))
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), "messages") from exc
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(state.llm.sampling_defaults, req.max_completion_tokens or req.max_tokens, top)
    end_ids = [t for t in enc.turn_end_ids if t not in state.llm.tokenizer.eos_token_ids]
    if end_ids and not params.ignore_eos:  # the assistant turn ends at the template's end-of-turn id
        params.stop_token_ids = params.stop_token_ids + [t for t in end_ids if t not in params.stop_token_ids]
    tool_format = tool_format_for(enc.special_ids)
    if tools and tool_format == "deepseek":  # its markers are special tokens: keep them in the text to parse
        params.skip_special_tokens = False
    if tools and req.tool_choice is not None and req.tool_choice not in ("auto", "none"):
        if tool_format != "hermes":
            raise UnsupportedField("tool_choice", f"tool_choice 'required' or a named function is not supported "
                                                  f"for this model's tool-call format ({tool_format}); use 'auto'")
        if params.so_args is not None:
            raise UnsupportedField("tool_choice", "tool_choice 'required' or a named function cannot be combined "
                                                  "with response_format / guided_*")
        only = req.tool_choice.function.get("name") if isinstance(req.tool_choice, NamedToolChoice) else None
        params = dataclasses.replace(params, so_args={"schema_type": "ebnf", "schema": tool_call_grammar(tools, only)})
    in_reasoning = bool(re.search(r"<think>\s*$", enc.tk.decode(ids[-8:], skip_special_tokens=False)))

    def parser() -> MessageParser:
        return MessageParser(ReasoningParser(in_reasoning=in_reasoning) if state.reasoning else None,
                             tools=bool(tools), tool_format=tool_format)

    return ids, params, parser


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, arrival: float):
    """A dict (whole response) or an async iterator of SSE frames."""
    ids, params, parser = _prepare(state, req)
    rid = request_id("chatcmpl")
    streams = await state.start([{"prompt_token_ids": ids}], params, rid, arrival)
    if req.stream:
        return _stream(state, req, streams, rid, parser, req.top_logprobs or 0)
    return await _whole(state, streams, rid, parser, req.top_logprobs or 0, req.pd_accounting)


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


async def _whole(state: ServerState, streams, rid: str, parser, top_n: int, accounting: bool = False) -> dict:
    update = None
    async for _, u in merged(streams):
        update = u
    err = failed(update)
    if err is not None:
        raise err
    out = update.output
    choices, completion_tokens = [], 0
    for c in out.outputs:
        completion_tokens += len(c.token_ids)
        p = parser()
        parsed = p.feed(c.text, final=True)
        msg: dict = {"role": "assistant", "content": parsed.content or (None if p.tool_calls else "")}
        if parsed.reasoning:
            msg["reasoning_content"] = parsed.reasoning
        if p.tool_calls:
            msg["tool_calls"] = [{"id": t["id"], "type": "function",
                                  "function": {"name": t["name"], "arguments": t["arguments"]}} for t in p.tool_calls]
        choices.append({"index": c.index, "message": msg, "finish_reason": _finish_reason(c.finish_reason,
                                                                                          bool(p.tool_calls)),
                        "stop_reason": c.stop_reason,
                        "logprobs": {"content": chat_logprobs(c.token_ids, c.logprobs, top_n)}
                        if c.logprobs is not None else None,
                        **choice_extras(c.kv_transfer_params, accounting, len(c.token_ids), c.cumulative_logprob)})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(len(out.prompt_token_ids), completion_tokens, update.num_cached_tokens),
            "kv_transfer_params": out.kv_transfer_params}


async def _stream(state: ServerState, req: ChatCompletionRequest, streams, rid: str, parser,
                  top_n: int) -> AsyncIterator[str]:
    chunk = chunk_writer(rid, "chat.completion.chunk", state.model_name)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    parsers: dict[int, MessageParser] = {}
    completion_tokens, tokens = 0, {}  # in all, per choice
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(req.n)])
    try:
        async for _, update in live_updates(streams):
            choices = []
            for d in update.deltas:
                completion_tokens += len(d.token_ids)
                tokens[d.index] = tokens.get(d.index, 0) + len(d.token_ids)
                p = parsers.setdefault(d.index, parser())
                parsed = p.feed(d.text, final=d.finish_reason is not None)
                delta: dict = {}
                if parsed.content:
                    delta["content"] = parsed.content
                if parsed.reasoning:
                    delta["reasoning_content"] = parsed.reasoning
                if parsed.tool_calls:
                    delta["tool_calls"] = [_call_delta(t) for t in parsed.tool_calls]
                lp = {"content": chat_logprobs(d.token_ids, d.logprobs, top_n)} if d.logprobs else None
                if delta or lp or d.finish_reason is not None:
                    choices.append({"index": d.index, "delta": delta, "logprobs": lp,
                                    "finish_reason": _finish_reason(d.finish_reason, bool(p.tool_calls)),
                                    "stop_reason": d.stop_reason})
                    if d.finish_reason is not None:
                        choices[-1].update(choice_extras(d.kv_transfer_params, req.pd_accounting, tokens[d.index]))
            if choices:
                yield chunk(choices, **handed_off(update))
            if update.finished and include_usage:
                yield chunk([], usage(update.num_prompt_tokens, completion_tokens, update.num_cached_tokens))
    except APIError as exc:
        yield sse(exc.body())
    yield sse("[DONE]")


def _call_delta(t) -> dict:
    d: dict = {"index": t.index, "function": {"arguments": t.arguments}}
    if t.id is not None:
        d["id"], d["type"] = t.id, "function"
    if t.name is not None:
        d["function"]["name"] = t.name
    return d
