"""Lookup features of the confidence head: does a draft agree with what the request's own text
predicts?

For each n in ``NGRAMS`` the *continuation* of a request is the run of tokens that followed the
latest earlier occurrence of its last n tokens, searched in its last ``WINDOW`` tokens (prompt
lookup). Per draft position j the head reads, for each n: whether the continuation reaches j
(``has``), whether d_j equals its j-th token (``agree``) and whether d_1..d_j all do (``run``).

Why: on text that repeats (code, quoting the prompt, a loop in greedy output) the target copies,
and whether a draft copies too is something the draft's own distribution does not show. On the
embedded model's held-out fixed-k verifications these features took the head's cross-validated
log-loss from 0.357 to 0.327 (``plugins/dspark/README.md``). A draft that agrees with a 3-gram
continuation is accepted 96% of the time, one that disagrees 34%.

With ``lookup_drafts`` the drafts also follow the 4-gram run while it goes on (``LookupRows.follow``
on the host, ``DeviceDrafter._device_loop`` on the device), and the head reads where a run token
replaced the draft's argmax (``lookup_override``).

The host path (``continuations_host``, lists) and the device path (``continuations``, tensors) give
the same continuations; ``features`` turns either into the head's inputs.
"""

from __future__ import annotations

import torch

NGRAMS = (1, 2, 3, 4)
WINDOW = 256  # tokens searched back from a request's end (bounds the device work on long contexts)
# ``lookup_drafts``: drafts follow the longest run. Where the 4-gram run and the MTP's argmax disagree
# at d_1 on the embedded model's held-out text, the run's token is the target's 66% of the time, the
# argmax 23% (3-gram: 57% / 28%)
FOLLOW = len(NGRAMS) - 1
# per n: the run reaches the position, agrees there, agrees all the way; then whether the draft there is
# a run token that replaced the draft's own argmax (``lookup_drafts``: accepted far more often than
# its low q(d) says)
FEATURES = (*(f"lookup{n}_{what}" for n in NGRAMS for what in ("has", "agree", "run")), "lookup_override")


def continuations_host(tokens: list[int], k: int) -> list[list[int]]:
    """Per n in ``NGRAMS``: the ``k`` tokens after the latest earlier occurrence of the last n of
    ``tokens`` within the last ``WINDOW`` (-1 where there is none or it runs past the end)."""
    win = tokens[-WINDOW:]
    L = len(win)
    out = [[-1] * k for _ in NGRAMS]
    if L < 2:
        return out
    rev, todo = win[::-1], [i for i, n in enumerate(NGRAMS) if L > n]
    r = 0  # rev[r] is win[L - 1 - r]
    while todo:  # one backward pass over the earlier occurrences of the last token
        try:
            r = rev.index(rev[0], r + 1)
        except ValueError:
            break
        e = L - 1 - r
        for i in list(todo):
            n = NGRAMS[i]
            if e >= n - 1 and win[e - n + 1 : e + 1] == win[L - n :]:
                got = win[e + 1 : e + 1 + k]
                out[i][: len(got)] = got
                todo.remove(i)
    return out


def continuations(hist: torch.Tensor, length: torch.Tensor, k: int) -> torch.Tensor:
    """``continuations_host`` for a batch on the device: ``hist`` [R, L] each request's tokens from
    some start (columns ``length`` on: anything), ``length`` [R] how many are real. Returns [R, N, k]."""
    R, L = hist.shape
    dev = hist.device
    cols = torch.arange(L, device=dev)
    first = (length - WINDOW).clamp(min=0)  # the window's first column
    out = []
    for n in NGRAMS:
        # ends[r, e]: hist[r, e - n + 1 .. e] equals the last n real tokens (e < length - 1)
        ends = (cols[None, :] >= first[:, None] + n - 1) & (cols[None, :] < length[:, None] - 1)
        for i in range(n):
            key = hist.gather(1, (length - 1 - i).clamp(min=0)[:, None])  # [R, 1]
            shifted = torch.roll(hist, i, 1)  # shifted[:, e] = hist[:, e - i]
            ends &= shifted == key
        ends &= (length > n)[:, None]
        e = torch.where(ends, cols[None, :], torch.full_like(ends, -1, dtype=torch.long)).amax(1)  # [R]
        at = e[:, None] + 1 + torch.arange(k, device=dev)[None, :]
        tok = hist.gather(1, at.clamp(max=L - 1))
        out.append(torch.where((e[:, None] >= 0) & (at < length[:, None]), tok, torch.full_like(tok, -1)))
    return torch.stack(out, 1)


def features(cont: torch.Tensor, drafts: torch.Tensor, override: torch.Tensor | None = None) -> torch.Tensor:
    """[R, K, len(FEATURES)] from continuations [R, N, >= K], the drafts [R, K] (d_1 in column 0) and
    where they follow a run against the draft's own argmax (``override`` [R, K] bool, None: nowhere)."""
    K = drafts.shape[1]
    c = cont[:, :, :K]
    has = c >= 0
    agree = has & (c == drafts[:, None, :])
    run = agree.long().cumprod(-1).bool()
    f = torch.stack((has, agree, run), -1).permute(0, 2, 1, 3).flatten(2).float()
    over = torch.zeros_like(drafts, dtype=torch.bool) if override is None else override
    return torch.cat((f, over[:, :, None].float()), -1)


class LookupRows:
    """The host draft loop's lookup state, one depth at a time (the drafts are chosen as it goes).
    Plain lists: the host path drafts for a few requests, where a handful of tensor ops per depth
    cost more than the arithmetic."""

    def __init__(self, token_lists: list[list[int]], k: int, weights: torch.Tensor | None, device,
                 log: bool = False, follow: list[bool] | None = None) -> None:
        """``weights``: the head's ``w_lookup`` (None: features only); ``log``: also return the features;
        ``follow``: the rows whose drafts follow the ``FOLLOW`` run (``follow``)."""
        self.cont = [continuations_host(t, k) for t in token_lists]  # [R][N][k]
        self.run = [[True] * len(NGRAMS) for _ in token_lists]
        self.w = None if weights is None else weights[: 3 * len(NGRAMS)].view(len(NGRAMS), 3).tolist()
        self.w_over = None if weights is None else float(weights[-1])
        self.device, self.log = device, log
        self.following = list(follow) if follow is not None else [False] * len(token_lists)
        self.overridden = [False] * len(token_lists)  # at the last depth: a run token replaced the argmax

    def follow(self, depth: int, tok: torch.Tensor) -> torch.Tensor:
        """The drafts at ``depth``: each following row's run token while its run goes on, else ``tok``
        (the draft's argmax)."""
        self.overridden = [False] * len(self.cont)
        if not any(self.following):
            return tok
        j, out = depth - 1, tok.tolist()
        for r, cont in enumerate(self.cont):
            if self.following[r]:
                got = cont[FOLLOW][j] if j < len(cont[FOLLOW]) else -1
                if got >= 0:
                    self.overridden[r] = got != out[r]
                    out[r] = got
                else:
                    self.following[r] = False
        return torch.tensor(out, dtype=tok.dtype, device=tok.device)

    def step(self, depth: int, tok: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The head's logit term [R] (None without weights) and, when logging, the features
        [R, len(FEATURES)] of the drafts ``tok`` [R] at ``depth`` (1-based; after ``follow``)."""
        j = depth - 1
        terms, feats = [], []
        for cont, run, t, over in zip(self.cont, self.run, tok.tolist(), self.overridden):
            z, row = 0.0, []
            for i, c in enumerate(cont):
                got = c[j] if j < len(c) else -1
                agree = got >= 0 and got == t
                run[i] = run[i] and agree
                if self.w is not None:
                    w = self.w[i]
                    z += (got >= 0) * w[0] + agree * w[1] + run[i] * w[2]
                row += [float(got >= 0), float(agree), float(run[i])]
            if self.w is not None:
                z += over * self.w_over
            terms.append(z)
            feats.append(row + [float(over)])
        term = None if self.w is None else torch.tensor(terms, dtype=torch.float32, device=self.device)
        return term, torch.tensor(feats, dtype=torch.float32, device=self.device) if self.log else None
