"""SamplingParams, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seq_seed: int | None = None  # per-request RNG seed, any int (taken modulo 2**64); random when None
    seed: int | None = None  # vLLM's name for seq_seed (either may be given; they must agree)
    n: int = 1  # completions returned per prompt
    best_of: int | None = None  # completions drawn per prompt (>= n); the n with the highest cumulative logprob
    skip_special_tokens: bool = True  # drop special tokens from the output text
    include_stop_str_in_output: bool = False  # keep a matched stop string at the end of the text
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one), clamped to the vocab
    prompt_logprobs: int | None = None  # 0: each prompt token's own logprob; N: also the top N (clamped to the vocab)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Options owned by feature plugins (validated by them): structured output, request class, ...
    so_args: dict | None = None
    traffic_class: str | None = None
    # A prefill engine's RequestOutput.kv_transfer_params: continue that request from its handed-off KV
    kv_transfer_params: dict | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.seed is not None and self.seq_seed is None:
            self.seq_seed = self.seed
        elif self.seq_seed is not None and self.seed is None:
            self.seed = self.seq_seed

    @property
    def num_samples(self) -> int:
        """Completions drawn per prompt: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"unknown SamplingParams field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError/TypeError naming the offending field."""
        def num(name: str, kinds=(int, float)) -> Any:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise TypeError(f"SamplingParams.{name} must be a number, got {type(v).__name__} {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {v!r}")
            return v

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise TypeError(f"SamplingParams.max_tokens must be an int, got {self.max_tokens!r}")
            if self.max_tokens <= 0:
                raise ValueError(f"SamplingParams.max_tokens must be > 0, got {self.max_tokens}")
        if num("temperature") < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < num("top_p") <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if num("top_k", (int,)) < -1:
            raise ValueError(f"SamplingParams.top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= num("min_p") <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if num("repetition_penalty") <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        num("presence_penalty")
        num("frequency_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"SamplingParams.{name} must be a non-negative int or None, got {v!r}")
        for name in ("seed", "seq_seed"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"SamplingParams.{name} must be an int, got {v!r}")
        if self.seed is not None and self.seq_seed is not None and self.seed != self.seq_seed:
            raise ValueError(f"SamplingParams.seed={self.seed} and seq_seed={self.seq_seed} disagree; give one")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None:
            if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < self.n:
                raise ValueError(f"SamplingParams.best_of must be an int >= n={self.n}, got {self.best_of!r}")
        for name in ("skip_special_tokens", "include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"SamplingParams.stop_token_ids has {t!r}, outside the vocabulary [0, {vocab_size})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")


def rng_seed(seq_seed: int) -> int:
    """The signed 64-bit seed the counter RNG takes for ``seq_seed``: its value modulo 2**64 (so any
    int is accepted, and ``s`` and ``s + 2**64`` draw alike)."""
    seed = seq_seed & ((1 << 64) - 1)
    return seed - (1 << 64) if seed >= 1 << 63 else seed
