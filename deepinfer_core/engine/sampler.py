"""Turn logits rows into tokens: penalties, the fused ``sample`` op, and logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.kernels import Kernels


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]  # of each sampled token under the raw model distribution
    top: list[list[tuple[int, float]] | None]  # top-N (token, logprob) where requested


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    def __init__(self, k: Kernels, vocab_size: int, device: torch.device) -> None:
        self.k, self.V, self.device = k, vocab_size, device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> SampleResult:
        """logits[R, V] float32 for R requests; ``positions[i]`` is the index of the token to draw."""
        params = [s.params for s in seqs]
        raw = logits
        if any(_has_penalty(s) for s in seqs):
            logits = self._penalise(logits.clone(), seqs)
        dev = self.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        if bool((temperature == 0).all()):
            tokens = logits.argmax(-1)
        else:
            tokens = self.k.sample(
                logits,
                temperature,
                torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=dev),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev),
                torch.tensor([s.seed for s in seqs], dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
            )
        lse = self.k.logsumexp(raw)
        chosen = raw.gather(1, tokens[:, None])[:, 0] - lse
        top: list[list[tuple[int, float]] | None] = [None] * len(seqs)
        want = [i for i, p in enumerate(params) if p.logprobs]
        if want:
            n = max(params[i].logprobs for i in want)
            vals, idx = raw[want].topk(min(n, self.V), dim=-1)
            vals = vals - lse[want, None]
            for j, i in enumerate(want):
                m = params[i].logprobs
                top[i] = list(zip(idx[j, :m].tolist(), vals[j, :m].tolist()))
        return SampleResult(tokens.tolist(), chosen.tolist(), top)

    def _penalise(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if _has_penalty(s)]
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
