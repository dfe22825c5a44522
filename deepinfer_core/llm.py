"""The public offline API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import threading
from collections.abc import Sequence as Seq
from typing import Any

from deepinfer_core.config import compose
from deepinfer_core.engine.detokenizer import TokenTexts
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.sample_group import (
    SampleGroup,
    as_params,
    completion_output,
    error_output,
    request_output,
)
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.generation_config import sampling_defaults
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    """An offline engine over one DeepSeek checkpoint.

    ``model`` is a checkpoint directory, a Hugging Face id, or an embedded model name (``tiny-v3``,
    ``tiny-v4``: ``models.loader.EMBEDDED_MODELS``); ``model=None`` uses ``$DEEPINFER_HF_MODEL_DIR``
    or the embedded default model (``tiny-v3``). Other keyword
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
        self.engine = make_engine(self.config)
        self.sampling_defaults = sampling_defaults(self.engine.model_dir)
        self._chat_encoder = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (what ``None`` means)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt. A request with bad input fails alone: its output has
        ``finish_reason == "error"`` and ``.error`` holds the ValueError/TypeError naming the field.
        ``SamplingParams(n=k)`` gives k completions per prompt, which share the prompt's KV blocks.
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
        slots: list[SampleGroup | RequestOutput] = []
        for prompt, p in zip(prompts, params):
            try:
                slots.append(SampleGroup(engine, prompt, as_params(p, self.sampling_defaults)))
            except (ValueError, TypeError) as exc:
                slots.append(error_output(prompt, exc))
        groups = [g for g in slots if isinstance(g, SampleGroup)]
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(prompts), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while engine.has_unfinished():
                done = engine.step()
                for g in groups:
                    if g.pending:
                        g.release(engine)
                if pbar is not None and done:
                    pbar.n = sum(g.finished for g in groups) + len(slots) - len(groups)
                    pbar.refresh()
        finally:
            if pbar is not None:
                pbar.close()
        texts = TokenTexts(engine.tokenizer)
        return [s if isinstance(s, RequestOutput) else s.output(engine.tokenizer, texts) for s in slots]

    def chat(self, messages: list[dict] | Seq[list[dict]], sampling_params: SamplingParams | Seq[SamplingParams]
             | None = None, use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of ``{"role", "content"}`` messages) or to each
        of several. The conversation is encoded by :class:`~deepinfer_core.serving.chat.ChatEncoder`:
        the checkpoint's chat template (or ``chat_template``), with special tokens placed by id and
        message text that spells a special token kept as plain text."""
        from deepinfer_core.serving.chat import ChatEncoder

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoder = self.chat_encoder if chat_template is None else ChatEncoder(self.engine.model_dir, self.tokenizer,
                                                                              chat_template)
        prompts = [{"prompt_token_ids": encoder.encode(c, add_generation_prompt=add_generation_prompt, tools=tools,
                                                       **(chat_template_kwargs or {}))} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @property
    def chat_encoder(self):
        if self._chat_encoder is None:
            from deepinfer_core.serving.chat import ChatEncoder

            self._chat_encoder = ChatEncoder(self.engine.model_dir, self.tokenizer)
        return self._chat_encoder

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


def make_engine(config):
    """The engine for a config: one LLMEngine, or the driver of a dp/ep job (same interface)."""
    if config.dp > 1 or config.ep > 1:
        from deepinfer_core.parallel.launcher import ParallelEngine

        return ParallelEngine(config)
    return LLMEngine(config)


def to_output(seq: Sequence, tokenizer) -> RequestOutput:
    """The output of one finished engine request."""
    return request_output(seq, [completion_output(seq, tokenizer)], True)
