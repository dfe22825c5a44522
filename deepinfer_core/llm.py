"""The public offline API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import threading
from collections.abc import Sequence as Seq
from typing import Any

from deepinfer_core.config import compose
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    """An offline engine over one DeepSeek checkpoint.

    ``model=None`` uses ``$DEEPINFER_HF_MODEL_DIR`` or the embedded default model. Other keyword
    arguments are engine config keys (see ``deepinfer_core.config.EngineConfig``) or feature sections.

    Thread safety: calls from several threads are serialised. A ``generate()`` (or ``metrics()``,
    ``shutdown()``) waits until the one running in another thread has returned, then runs its own
    batch; the engine never mixes two callers' steps. For requests arriving concurrently, batch them
    into one ``generate()`` call (an asynchronous serving front end is separate work).
    """

    def __init__(self, model: str | None = None, dtype: str | None = None, accelerator: str | None = None,
                 config: str | dict | None = None, **overrides: Any) -> None:
        kw = dict(overrides)
        for key, value in (("model", model), ("dtype", dtype), ("accelerator", accelerator)):
            if value is not None:
                kw[key] = value
        self._lock = threading.Lock()  # one caller at a time drives the engine (see the class docstring)
        self.config = compose(config, **kw)
        if self.config.dp > 1 or self.config.ep > 1:
            from deepinfer_core.parallel.launcher import ParallelEngine

            self.engine = ParallelEngine(self.config)
        else:
            self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt. A request with bad input fails alone: its output has
        ``finish_reason == "error"`` and ``.error`` holds the ValueError/TypeError naming the field.
        A call from another thread waits for this one to return (see the class docstring)."""
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        engine = self.engine
        slots: list[Sequence | RequestOutput] = []
        for prompt, p in zip(prompts, params):
            try:
                slots.append(engine.add_request(prompt, p))
            except (ValueError, TypeError) as exc:
                slots.append(_error_output(prompt, exc))
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(prompts), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while engine.has_unfinished():
                done = engine.step()
                if pbar is not None and done:
                    pbar.update(len(done))
        finally:
            if pbar is not None:
                pbar.close()
        return [s if isinstance(s, RequestOutput) else to_output(s, engine.tokenizer) for s in slots]

    def metrics(self) -> dict:
        with self._lock:
            return self.engine.metrics()

    def shutdown(self) -> None:
        with self._lock:
            self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def to_output(seq: Sequence, tokenizer) -> RequestOutput:
    out_ids = seq.output_token_ids
    text = tokenizer.decode(out_ids)
    if isinstance(seq.stop_reason, str) and seq.stop_reason in text:
        text = text[: text.index(seq.stop_reason)]
    completion = CompletionOutput(0, text, out_ids, seq.output_logprobs if seq.params.logprobs is not None else None,
                                  seq.finish_reason, seq.stop_reason)
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids,
                         seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                         [completion], True, seq.metrics, seq.error)


def _error_output(prompt, exc: BaseException) -> RequestOutput:
    from deepinfer_core.outputs import RequestMetrics

    text = prompt if isinstance(prompt, str) else None
    ids = prompt.get("prompt_token_ids", []) if isinstance(prompt, dict) else []
    return RequestOutput("", text, list(ids) if isinstance(ids, list) else [], None,
                         [CompletionOutput(0, "", [], None, "error")], True, RequestMetrics(), exc)
