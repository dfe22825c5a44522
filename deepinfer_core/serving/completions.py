"""``/v1/completions``: prompts (text or token ids) to text, streamed over SSE or whole."""

from __future__ import annotations

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
from deepinfer_core.serving.protocol import CompletionRequest


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], offset: int) -> dict:
    """The legacy completions ``logprobs`` object for a run of tokens."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        own = entry[tid]
        tokens.append(own.decoded_token)
        lps.append(own.logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in entry.values()})  # the top N and the sampled token
        offsets.append(offset)
        offset += len(own.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def create_completion(state: ServerState, req: CompletionRequest, arrival: float):
    """A dict (whole response) or an async iterator of SSE frames."""
    req.check()
    state.check_model(req.model)
    params = req.sampling_params(state.llm.sampling_defaults, req.max_tokens, req.logprobs)
    prompts = req.prompts()
    rid = request_id("cmpl")
    streams = await state.start(prompts, params, rid, arrival)
    if req.stream:
        return _stream(state, req, streams, rid, params.n)
    return await _whole(state, streams, rid, params.n, req.pd_accounting)


async def _whole(state: ServerState, streams, rid: str, n: int, accounting: bool = False) -> dict:
    choices, prompt_tokens, completion_tokens, cached, transfer = [], 0, 0, 0, None
    async for i, update in merged(streams):
        if not update.finished:
            continue
        err = failed(update)
        if err is not None:
            raise err
        out = update.output
        prompt_tokens += len(out.prompt_token_ids)
        cached += update.num_cached_tokens
        transfer = transfer or out.kv_transfer_params
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choices.append({"index": i * n + c.index, "text": c.text, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                            "logprobs": completion_logprobs(c.token_ids, c.logprobs, 0) if c.logprobs is not None
                            else None,
                            **choice_extras(c.kv_transfer_params, accounting, len(c.token_ids), c.cumulative_logprob)})
    choices.sort(key=lambda c: c["index"])
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached),
            "kv_transfer_params": transfer}


async def _stream(state: ServerState, req: CompletionRequest, streams, rid: str, n: int) -> AsyncIterator[str]:
    chunk = chunk_writer(rid, "text_completion", state.model_name)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    prompt_tokens, completion_tokens, cached = 0, 0, 0
    offsets: dict[int, int] = {}
    tokens: dict[int, int] = {}  # per choice
    try:
        async for i, update in live_updates(streams):
            if update.finished:
                prompt_tokens += update.num_prompt_tokens
                cached += update.num_cached_tokens
            choices = []
            for d in update.deltas:
                index = i * n + d.index
                completion_tokens += len(d.token_ids)
                tokens[index] = tokens.get(index, 0) + len(d.token_ids)
                lp = None
                if d.logprobs is not None:
                    lp = completion_logprobs(d.token_ids, d.logprobs, offsets.get(index, 0))
                    if lp["tokens"]:  # offsets by the tokens' own text, as whole: not by how text was chunked
                        offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1] or "")
                if d.text or d.finish_reason is not None or lp:
                    choices.append({"index": index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason,
                                    "stop_reason": d.stop_reason})
                    if d.finish_reason is not None:
                        choices[-1].update(choice_extras(d.kv_transfer_params, req.pd_accounting, tokens[index]))
            if choices:
                yield chunk(choices, **handed_off(update))
        else:
            if include_usage:
                yield chunk([], usage(prompt_tokens, completion_tokens, cached))
    except APIError as exc:
        yield sse(exc.body())
    yield sse("[DONE]")
