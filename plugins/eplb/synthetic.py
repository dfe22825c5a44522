"""Synthetic routing traces for EPLB tests and benchmarks: Zipf-skewed expert popularity."""

from __future__ import annotations

import numpy as np


def zipf_popularity(num_experts: int, s: float = 1.0, seed: int = 0) -> np.ndarray:
    """Probabilities p_e proportional to 1 / rank^s, with the ranks shuffled over expert ids."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** s
    p = p[rng.permutation(num_experts)]
    return p / p.sum()


def sample_routing(popularity: np.ndarray, num_tokens: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """Expert ids [num_tokens, top_k] per token: k distinct experts drawn without replacement with
    probabilities ``popularity`` (Gumbel top-k)."""
    g = rng.gumbel(size=(num_tokens, popularity.shape[0]))
    keys = np.log(popularity)[None, :] + g
    return np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]


def routing_trace(num_steps: int, num_layers: int, num_experts: int, tokens_per_rank: int, num_ranks: int,
                  top_k: int, s: float = 1.0, seed: int = 0, drift: float = 0.0):
    """Yield, per step, a list over layers of a list over ranks of expert ids [tokens_per_rank, top_k].
    Every layer has its own popularity; ``drift`` > 0 re-draws a share of it slowly over steps."""
    rng = np.random.default_rng(seed)
    pops = [zipf_popularity(num_experts, s, seed * 1000 + i) for i in range(num_layers)]
    for step in range(num_steps):
        if drift and step:
            pops = [(1 - drift) * p + drift * zipf_popularity(num_experts, s, seed * 7919 + step * 31 + i)
                    for i, p in enumerate(pops)]
        yield [[sample_routing(p, tokens_per_rank, top_k, rng) for _ in range(num_ranks)] for p in pops]


def expected_loads(popularities, tokens: int, top_k: int) -> np.ndarray:
    """Approximate per-expert load of ``tokens`` tokens (top-k without replacement, first-order)."""
    p = np.asarray(popularities, dtype=np.float64)
    return np.minimum(1.0, p * top_k) * tokens
