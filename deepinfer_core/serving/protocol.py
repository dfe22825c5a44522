"""OpenAI-compatible request bodies (pydantic) and their mapping to :class:`SamplingParams`.

Unknown fields are rejected (400 naming the field) rather than silently ignored: a typo such as
``max_token`` must not quietly fall back to a default. Fields the OpenAI API defines but this server
cannot honour (``logit_bias``, ``suffix``, ``echo`` with chat...) are 400s naming them as well.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepinfer_core.sampling_params import SamplingParams

_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"


class UnsupportedField(ValueError):
    """A request field this server does not support; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Strict):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    best_of: int | None = Field(default=None, ge=1, le=128)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # P/D disaggregation: a prefill engine's kv_transfer_params (deepinfer_core/engine/handoff.py)
    kv_transfer_params: dict[str, Any] | None = None
    # a router's leg: each finished choice carries "pd": {completion_tokens, cumulative_logprob}, what the
    # router needs to count usage and rank best_of across engines (deepinfer_core/router/)
    pd_accounting: bool = False

    def sampling_params(self, defaults: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request as SamplingParams; ``defaults`` are the model's generation_config values."""
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "logit_bias is not supported by this server")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise UnsupportedField("best_of", "best_of > n cannot be streamed (the best completions are known "
                                              "only at the end)")
        values: dict[str, Any] = dict(defaults)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        values["max_tokens"] = max_tokens if max_tokens is not None else values.get("max_tokens")
        so_args = self.structured_output()
        return SamplingParams(
            **values, n=self.n, best_of=self.best_of, stop=self.stop, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            so_args=so_args, kv_transfer_params=self.kv_transfer_params,
        )

    def structured_output(self) -> dict | None:
        """``so_args`` for the structured-output feature, from response_format / guided_*."""
        given = [(name, v) for name, v in (("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                                           ("guided_grammar", self.guided_grammar)) if v is not None]
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given.append(("response_format", rf))
        if len(given) > 1:
            raise UnsupportedField(given[1][0], f"give one of response_format / guided_json / guided_regex / "
                                                f"guided_grammar, got {[g[0] for g in given]}")
        if not given:
            return None
        name, v = given[0]
        if name == "guided_regex":
            return {"schema_type": "regex", "schema": v}
        if name == "guided_grammar":
            return {"schema_type": "ebnf", "schema": v}
        if name == "guided_json":
            return {"schema_type": "json", "schema": v}
        if v.type == "json_object":
            return {"schema_type": "json", "schema": {"type": "object"}}
        if v.json_schema is None or v.json_schema.schema_ is None:
            raise UnsupportedField("response_format.json_schema.schema", "response_format type 'json_schema' "
                                                                         "needs json_schema.schema")
        return {"schema_type": "json", "schema": v.json_schema.schema_}


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | dict]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedField("prompt", "prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        return [{"prompt_token_ids": list(x)} for x in p]

    def check(self) -> None:
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported by this server")
        if self.echo:
            raise UnsupportedField("echo", "echo is not supported by this server")


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, pattern=_NAME_PATTERN)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Strict):
    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs=true")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.get("name")
            if not self.tools or name not in {t.function.name for t in self.tools}:
                raise UnsupportedField("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise UnsupportedField("tool_choice", "tool_choice 'required' needs tools")

    def message_dicts(self) -> list[dict]:
        out = []
        for m in self.messages:
            d = m.model_dump(exclude_none=True)
            for call in d.get("tool_calls", []):
                if not isinstance(call["function"]["arguments"], str):
                    call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
            out.append(d)
        return out

    def tool_dicts(self) -> list[dict] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
