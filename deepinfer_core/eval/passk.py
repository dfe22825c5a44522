"""Pass@k from n samples per item, c of them correct: the unbiased estimator of Chen et al. (2021).

    pass@k = 1 - C(n - c, k) / C(n, k)

the probability that k samples drawn without replacement from the n contain a correct one. Pass@1
is c / n. A dataset's pass@k is the mean over its items.
"""

from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one item (``k <= n``)."""
    if not 0 <= c <= n:
        raise ValueError(f"correct count c={c} must be within [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be within [1, n={n}] (n = samples of the item)")
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k / i): the ratio of binomials without huge integers
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 1 else []


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean pass@k over items given as (n, c)."""
    counts = list(counts)
    if not counts:
        raise ValueError("no items to average")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
