"""KV hand-off between engines: the prefill / decode roles (``kv_role``) over a transport.

* ``kv_role = "prefill"``: every request runs to its first token (``max_tokens`` is capped at 1);
  just before its blocks are released its state (prompt + first token, the KV of every declared
  cache group for the prompt's positions) is packed (``handoff_format``) and sent through the
  ``[kv_transfer]`` transport. The request's output carries ``kv_transfer_params`` ({key, locator}).
* Any role given ``SamplingParams.kv_transfer_params`` receives that state when the request is
  added: the tokens are appended as its outputs (stop conditions checked), and when it is admitted
  its blocks are allocated and filled from the payload instead of computed (the
  ``load_request_state`` hook), so the next step decodes. A payload that is missing, corrupt, for
  another model, cache layout or prompt is logged and counted, and the request is computed from
  its prompt like any other: slower, never a different token.
* :meth:`KVHandoff.export` packs and sends a running request's state (drain with forwarding).

This module is core machinery; a transport is a plugin (``deepinfer_core.kv_transfer``) and the
engine never asks which one.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections import Counter

import torch

from deepinfer_core.engine.handoff_format import HandoffError, RequestState, layout_signature, pack, unpack
from deepinfer_core.engine.hashing import ROOT_HASH, block_hash
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.kv_cache_spec import cache_planes
from deepinfer_core.kv_transfer import KVTransport, check_key

logger = logging.getLogger("deepinfer.handoff")
ROLES = ("both", "prefill", "decode")
SEND, ROWS = "kv_handoff_send", "kv_handoff_rows"
MAX_PAYLOAD = 16 << 30


def prompt_key(prompt_token_ids: list[int]) -> str:
    """Hex hash of the prompt (the chain hash of the prompt as one block), a hand-off key's prefix:
    a receiver checks it against its own prompt before it reads anything."""
    return f"{block_hash(ROOT_HASH, prompt_token_ids):016x}"


def check_params(params: object) -> tuple[str, str]:
    """(key, locator) of ``SamplingParams.kv_transfer_params``; ValueError naming the bad field."""
    if not isinstance(params, dict) or not isinstance(params.get("locator", ""), str):
        raise ValueError("SamplingParams.kv_transfer_params must be a dict {'key': str, 'locator': str} as a "
                         f"prefill engine's RequestOutput.kv_transfer_params, got {params!r}")
    return check_key(params.get("key")), params.get("locator", "")


class KVHandoff:
    """Registered with the engine's plugin manager when ``[kv_transfer]`` is configured."""

    def __init__(self, engine, role: str, transport: KVTransport) -> None:
        self.role, self.transport = role, transport
        self.fingerprint = engine.fingerprint
        self.signature = layout_signature(engine.cache_layout, engine.block_size, engine.dtype)
        self.counts: Counter = Counter()
        self.seconds: Counter = Counter()

    # ---- sending ------------------------------------------------------------------------
    def capture(self, engine, seq) -> RequestState:
        """``seq``'s tokens and the KV rows of its computed positions, copied to the host."""
        bs = engine.block_size
        n = min(seq.num_computed_tokens, seq.num_known_tokens - 1)
        nblocks = -(-n // bs)
        tables = engine.blocks.tables(seq)
        blocks = {pool: [i for i in range(min(nblocks, len(t))) if t[i] != -1] for pool, t in tables.items()}
        rows = {}
        for g in engine.cache_layout.groups:
            pool = engine.blocks.pool_of[g.name]
            idx = torch.tensor([tables[pool][i] for i in blocks[pool]], dtype=torch.long, device=engine.device)
            # whole entries, whatever planes this platform splits them into: the payload is platform-neutral
            rows[g.name] = [torch.cat([p.index_select(0, idx) for p in cache_planes(t)], -1).cpu()
                            for t in engine.kv_caches[g.name]]
        k = seq.num_output_tokens
        if seq.output_logprobs:
            top_n = seq.params.logprobs or 0
            lps = [e[tok].logprob for e, tok in zip(seq.output_logprobs, seq.output_token_ids)]
            tops = [[(t, lp.logprob) for t, lp in sorted(e.items(), key=lambda x: x[1].rank or 1 << 30)
                     if lp.rank is not None and lp.rank <= top_n] for e in seq.output_logprobs]
        else:  # only the sum is kept: it rides on the first token, so the cumulative logprob is exact
            lps, tops = ([seq.sum_logprob] + [0.0] * (k - 1)) if k else [], [[] for _ in range(k)]
        return RequestState(seq.token_ids[: seq.num_known_tokens], seq.num_prompt_tokens, n, lps, tops,
                            blocks, rows)

    def export(self, engine, seq) -> dict:
        """Pack and send ``seq``'s state; returns the ``kv_transfer_params`` a receiver needs."""
        t0 = time.perf_counter()
        payload = pack(self.capture(engine, seq), self.fingerprint, self.signature)
        key = f"{prompt_key(seq.prompt_token_ids)}-{secrets.token_hex(8)}"
        locator = self.transport.send(key, payload)
        self.counts["sent"] += 1
        self.counts["sent_bytes"] += len(payload)
        self.seconds["send"] += time.perf_counter() - t0
        return {"key": key, "locator": locator}

    @hookimpl
    def request_added(self, engine, request):
        if request.params.kv_transfer_params is not None:
            self._receive(engine, request)
        if self.role == "prefill" and not request.is_finished:
            p = request.params
            request.feature_state[SEND] = p.max_tokens is None or p.max_tokens > request.num_output_tokens + 1
            request.params = dataclasses.replace(p, max_tokens=request.num_output_tokens + 1)

    @hookimpl
    def request_finishing(self, engine, request):
        if not request.feature_state.pop(SEND, False) or request.finish_reason != "length" or request.error:
            return
        try:
            request.kv_transfer_out = self.export(engine, request)
        except Exception as exc:  # the decode engine will recompute: slower, still correct
            self.counts["send_failed"] += 1
            logger.warning("request %s: KV hand-off not sent (%s: %s); the receiver recomputes",
                           request.request_id, type(exc).__name__, exc)

    # ---- receiving ----------------------------------------------------------------------
    def _receive(self, engine, request) -> None:
        key, locator = check_params(request.params.kv_transfer_params)
        if request.params.prompt_logprobs is not None:  # every prompt position must be scored here
            self.counts["recomputed"] += 1
            return
        t0 = time.perf_counter()
        try:
            if not key.startswith(prompt_key(request.prompt_token_ids)):
                raise HandoffError("the key was made for another prompt")
            data = self.transport.recv(key, locator, MAX_PAYLOAD)
            if data is None:
                raise HandoffError("no payload under this key")
            state = unpack(data, self.fingerprint, self.signature, engine.blocks.pool_of)
            if state.token_ids[: state.num_prompt] != request.prompt_token_ids:
                raise HandoffError("the payload's prompt differs from the request's")
        except Exception as exc:
            self.counts["recomputed"] += 1
            logger.warning("request %s: KV hand-off %s unusable (%s: %s); recomputing from the prompt",
                           request.request_id, key, type(exc).__name__, exc)
            return
        self.counts["received"] += 1
        self.seconds["recv"] += time.perf_counter() - t0
        outputs = state.token_ids[state.num_prompt :]
        if outputs:
            engine.append_tokens([request], [outputs], [state.output_logprobs], [state.output_tops])
        if not request.is_finished and state.num_computed:
            request.feature_state[ROWS] = state

    @hookimpl
    def request_finished(self, engine, request):
        request.feature_state.pop(SEND, None)

    @hookimpl
    def collect_metrics(self, engine):
        out = {f"handoff_{k}": v for k, v in self.counts.items()}
        out.update({f"handoff_{k}_s": v for k, v in self.seconds.items()})
        return out

    @hookimpl
    def engine_shutdown(self, engine):
        self.transport.close()


class StateLoader:
    """Fills an admitted request's blocks from a ``RequestState`` put in its ``feature_state[ROWS]``
    (a hand-off, or a context-parallel prefill) instead of computing them. Registered by every engine."""

    @hookimpl
    def request_ready(self, engine, request):
        state = request.feature_state.get(ROWS)
        if state is not None and request.num_computed_tokens == 0:
            if not engine.blocks.can_allocate(request, state.num_computed + 1):
                return False  # wait for room rather than start computing what was handed over
        return None

    @hookimpl
    def load_request_state(self, engine, request):
        state = request.feature_state.pop(ROWS, None)
        if state is None:
            return None
        n = state.num_computed
        engine.blocks.allocate(request, n)
        tables = engine.blocks.tables(request)
        for group, tensors in state.rows.items():
            pool = engine.blocks.pool_of[group]
            idx = torch.tensor([tables[pool][i] for i in state.blocks[pool]], dtype=torch.long, device=engine.device)
            for dst, src in zip(engine.kv_caches[group], tensors):
                src = src.to(engine.device, non_blocking=True)
                at = 0
                for plane in cache_planes(dst):
                    w = plane.shape[-1]
                    plane.index_copy_(0, idx, src[..., at : at + w].contiguous())
                    at += w
        request.num_computed_tokens = n
        engine.blocks.register_full_blocks(request)
        request.metrics.num_cached_tokens_by_tier["handoff"] = n
        request.metrics.num_cached_tokens = n
        return n

    @hookimpl
    def request_finished(self, engine, request):
        request.feature_state.pop(ROWS, None)
