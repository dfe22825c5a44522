"""Request validation, tokenizer info for xgrammar, and the asynchronous, cached grammar compiler."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr

logger = logging.getLogger("deepinfer.structured_output")

SCHEMA_TYPES = ("json", "regex", "ebnf")
SO_KEYS = ("schema_type", "schema", "trigger_token_ids", "bound_token_id")
_ROOT_RULE = re.compile(r"^\s*root\s*::=", re.MULTILINE)


class GrammarError(ValueError):
    """A request's grammar is malformed or failed to compile."""


@dataclass(frozen=True)
class GrammarSpec:
    """A validated ``so_args``: what to compile (``key``) and how to apply it."""

    schema_type: str
    schema: str  # canonical text: compact sorted JSON for "json", the pattern or grammar otherwise
    trigger_token_ids: tuple[int, ...] = ()
    bound_token_id: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.schema_type, self.schema


def _is_token_id(t, vocab_size: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size


def parse_so_args(so_args, vocab_size: int) -> GrammarSpec:
    """Validate ``SamplingParams.so_args``; raise GrammarError naming the problem."""
    if not isinstance(so_args, dict):
        raise GrammarError(f"SamplingParams.so_args must be a dict, got {type(so_args).__name__}")
    unknown = sorted(set(so_args) - set(SO_KEYS))
    if unknown:
        raise GrammarError(f"so_args has unknown key(s) {unknown}; known keys: {list(SO_KEYS)}")
    kind = so_args.get("schema_type")
    if kind not in SCHEMA_TYPES:
        raise GrammarError(f"so_args.schema_type must be one of {', '.join(map(repr, SCHEMA_TYPES))}, "
                           f"got {kind!r}")
    if "schema" not in so_args:
        raise GrammarError("so_args.schema is missing")
    schema = so_args["schema"]
    if kind == "json":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"so_args.schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"so_args.schema must be a JSON Schema object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"so_args.schema cannot be serialised as JSON: {exc}") from None
    else:
        if not isinstance(schema, str) or not schema:
            what = "regular expression" if kind == "regex" else "EBNF grammar"
            raise GrammarError(f"so_args.schema must be a non-empty string (the {what}), got {schema!r:.80}")
        if kind == "ebnf" and not _ROOT_RULE.search(schema):
            raise GrammarError("so_args.schema: the EBNF grammar has no root rule (define `root ::= ...`)")
        text = schema

    trigger = so_args.get("trigger_token_ids")
    if trigger is not None:
        if not isinstance(trigger, (list, tuple)) or not trigger:
            raise GrammarError(f"so_args.trigger_token_ids must be a non-empty list of token ids, got {trigger!r}")
        bad = [t for t in trigger if not _is_token_id(t, vocab_size)]
        if bad:
            bad = bad[0]
            raise GrammarError(f"so_args.trigger_token_ids has {bad!r}, which is not a token id "
                               f"(an int in [0, {vocab_size}))")
    bound = so_args.get("bound_token_id")
    if bound is not None and not _is_token_id(bound, vocab_size):
        raise GrammarError(f"so_args.bound_token_id must be a token id (an int in [0, {vocab_size})), "
                           f"got {bound!r}")
    return GrammarSpec(kind, text, tuple(trigger or ()), bound)


# ---- tokenizer ------------------------------------------------------------------------------------
def vocab_type_of(tokenizer_json: dict) -> xgr.VocabType:
    """How token strings encode bytes: byte-level BPE (GPT-2 style), byte fallback, or raw text."""
    pieces = [tokenizer_json.get("pre_tokenizer"), tokenizer_json.get("decoder")]
    kinds: set[str] = set()
    while pieces:
        p = pieces.pop()
        if isinstance(p, dict):
            kinds.add(p.get("type", ""))
            pieces.extend(p.get("pretokenizers") or p.get("decoders") or [])
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def tokenizer_info(tk, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a ``tokenizers.Tokenizer``, padded to the model's ``vocab_size``.

    Special added tokens (BOS, EOS, ...) are given empty text, so a grammar never produces them as
    text; stop tokens are matched by id."""
    vocab = tk.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for text, i in vocab.items():
        if i < vocab_size:
            encoded[i] = text
    for i, added in tk.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = ""
    kind = vocab_type_of(json.loads(tk.to_str()))
    return xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


# ---- the compiler service -------------------------------------------------------------------------
class GrammarCompiler:
    """Compiles grammars on ``threads`` builder threads; keeps compiled grammars in an LRU cache
    limited by count and bytes; concurrent requests for one grammar share one compilation."""

    def __init__(self, info: xgr.TokenizerInfo, threads: int, cache_size: int, cache_limit_bytes: int,
                 any_whitespace: bool = False) -> None:
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="so-builder")
        self.cache_size, self.cache_limit_bytes = cache_size, cache_limit_bytes
        self.any_whitespace = any_whitespace
        self._cache: OrderedDict[tuple[str, str], tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._bytes = 0
        self._pending: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = self.errors = 0  # hits: requests that started no compilation
        self.compile_time = 0.0

    def submit(self, key: tuple[str, str]) -> Future:
        """A future of the compiled grammar for ``key`` (done at once on a cache hit)."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                fut: Future = Future()
                fut.set_result(entry[0])
                return fut
            fut = self._pending.get(key)
            if fut is None:
                self.misses += 1
                fut = self.pool.submit(self._build, key)
                self._pending[key] = fut
            else:  # shares the compilation already under way
                self.hits += 1
            return fut

    def compile_now(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        """Compile (or fetch) synchronously; used by benchmarks and tests."""
        return self.submit(key).result()

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        if kind == "json":
            return self.compiler.compile_json_schema(text, any_whitespace=self.any_whitespace,
                                                     separators=None if self.any_whitespace else (",", ":"))
        if kind == "regex":
            return self.compiler.compile_regex(text)
        return self.compiler.compile_grammar(text, root_rule_name="root")

    def _build(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        kind, text = key
        t0 = time.perf_counter()
        try:
            compiled = self._compile(kind, text)
        except Exception as exc:
            with self._lock:
                self._pending.pop(key, None)
                self.errors += 1
            what = {"json": "JSON Schema", "regex": "regular expression", "ebnf": "EBNF grammar"}[kind]
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            detail = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", detail)  # drop xgrammar's source location
            raise GrammarError(f"so_args.schema: the {what} does not compile: {detail}") from exc
        size = compiled.memory_size_bytes
        with self._lock:
            self.compile_time += time.perf_counter() - t0
            self._pending.pop(key, None)
            self._cache[key] = (compiled, size)
            self._bytes += size
            while self._cache and (len(self._cache) > self.cache_size or self._bytes > self.cache_limit_bytes):
                old, (_, old_size) = self._cache.popitem(last=False)
                self._bytes -= old_size
                if old == key:
                    break
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
