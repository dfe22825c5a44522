"""Turn logits rows into tokens: penalties, the fused ``sample`` op, and logprobs.

:meth:`Sampler.sample` leaves everything on the device (no host synchronisation, so async
scheduling can queue the next step behind it); :meth:`Sampler.to_result` turns the copied-back
tensors into lists. ``Sampler(...)`` does both at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.transfer import to_device
from deepinfer_core.kernels import Kernels


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]  # of each sampled token under the raw model distribution
    top: list[list[tuple[int, float]] | None]  # top-N (token, logprob) where requested
    ranks: list[int | None]  # where logprobs were requested: the sampled token's rank (1 = most likely)


@dataclass
class DeviceSample:
    """A step's draws, still on the device."""

    tokens: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32
    top_ids: torch.Tensor | None  # [len(want), n] int64: top-n of the rows that asked for logprobs
    top_lps: torch.Tensor | None  # [len(want), n] float32
    want: list[tuple[int, int]]  # (row, how many top entries it asked for)
    ranks: torch.Tensor | None = None  # [len(want)] int64: rank of each such row's sampled token

    NUM_TENSORS = 5  # len(tensors())

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.tokens, self.logprobs, self.top_ids, self.top_lps, self.ranks]


def has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    def __init__(self, k: Kernels, vocab_size: int, device: torch.device, pin_memory: bool = False) -> None:
        self.k, self.V, self.device, self.pin = k, vocab_size, device, pin_memory

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> SampleResult:
        """logits[R, V] float32 for R requests; ``positions[i]`` is the index of the token to draw."""
        d = self.sample(logits, seqs, positions)
        return self.to_result(d.want, d.tensors())

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int] | torch.Tensor) -> DeviceSample:
        """Draw on the device without waiting for it. Penalties read the requests' output tokens on
        the host, so those must be known (the engine runs such requests synchronously)."""
        params = [s.params for s in seqs]
        raw = logits
        if any(has_penalty(s) for s in seqs):
            logits = self.penalise(logits.clone(), seqs)

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, self.device, self.pin)

        lse = None
        if all(p.temperature == 0 for p in params):
            if logits is raw:  # the draw, its logprob and the normaliser in one pass over the rows
                tokens, chosen, lse = self.k.greedy_sample(raw)
            else:
                tokens = logits.argmax(-1)
        else:
            tokens = self.k.sample(
                logits,
                dev([p.temperature for p in params], torch.float32),
                dev([max(p.top_k, 0) for p in params], torch.long),
                dev([p.top_p for p in params], torch.float32),
                dev([p.min_p for p in params], torch.float32),
                dev([s.seed for s in seqs], torch.long),
                positions if isinstance(positions, torch.Tensor) else dev(positions, torch.long),
            )
        if lse is None:
            lse = self.k.logsumexp(raw)
            chosen = raw.gather(1, tokens[:, None])[:, 0] - lse
        want = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        top_ids = top_lps = ranks = None
        if want:
            n = min(max(m for _, m in want), self.V)
            if len(want) == len(params):
                rows_raw, rows_lse = raw, lse
            else:
                idx = dev([i for i, _ in want], torch.long)
                rows_raw, rows_lse = raw[idx], lse[idx]
            rows_tok = tokens if len(want) == len(params) else tokens[idx]
            ranks = (rows_raw > rows_raw.gather(1, rows_tok[:, None])).sum(-1) + 1
            if n:
                top_lps, top_ids = rows_raw.topk(n, dim=-1)
                top_lps = top_lps - rows_lse[:, None]
        return DeviceSample(tokens, chosen, top_ids, top_lps, want, ranks)

    @staticmethod
    def to_result(want: list[tuple[int, int]], host: list[torch.Tensor | None]) -> SampleResult:
        """Lists from the host copies of :meth:`DeviceSample.tensors`."""
        tokens, chosen, top_ids, top_lps, ranks = host
        top: list[list[tuple[int, float]] | None] = [None] * tokens.shape[0]
        rank: list[int | None] = [None] * tokens.shape[0]
        if want:
            ids, lps = (top_ids.tolist(), top_lps.tolist()) if top_ids is not None else (None, None)
            rk = ranks.tolist()
            for j, (i, m) in enumerate(want):
                top[i] = list(zip(ids[j][:m], lps[j][:m])) if ids is not None else []
                rank[i] = rk[j]
        return SampleResult(tokens.tolist(), chosen.tolist(), top, rank)

    def penalise(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        """Apply each row's repetition/presence/frequency penalties in place, from its request's
        ``prompt_token_ids``, ``output_token_ids`` and ``params`` (any object with those three)."""
        rows = [i for i, s in enumerate(seqs) if has_penalty(s)]
        R, dev = len(rows), logits.device
        prompt_mask = torch.zeros(R, self.V, dtype=torch.bool, device=dev)
        counts = torch.zeros(R, self.V, dtype=torch.float32, device=dev)
        for j, i in enumerate(rows):
            s = seqs[i]
            prompt_mask[j, torch.tensor(s.prompt_token_ids, device=dev)] = True
            out = s.output_token_ids
            if out:
                counts[j].index_add_(0, torch.tensor(out, device=dev), torch.ones(len(out), device=dev))
        ps = [seqs[i].params for i in rows]
        logits[rows] = self.k.apply_penalties(
            logits[rows], prompt_mask, counts,
            torch.tensor([p.repetition_penalty for p in ps], device=dev),
            torch.tensor([p.presence_penalty for p in ps], device=dev),
            torch.tensor([p.frequency_penalty for p in ps], device=dev),
        )
        return logits
