"""``[speculative] proposer = "ngram"``: prompt-lookup drafts, the tokens that followed the latest
earlier occurrence of the request's last token in its own prompt and output.

No model and no state: a cheap proposer that pays where text repeats (code, quoting the prompt,
greedy loops). It proposes on the host (synchronous speculative steps) and on the device (async
scheduling: ``Proposer.propose_on_device``), where the tokens the step in flight emits are placed
after the host-known ones on the device, so both search the same history.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.transfer import Upload
from deepinfer_core.proposer import DeviceDraft, Draft, Proposer


class NgramProposer(Proposer):
    name = "ngram"
    core_api_version = "1.0"
    proposes_on_device = True

    def propose(self, engine, requests, max_drafts, batch) -> list[Draft | None]:
        out: list[Draft | None] = []
        for r, m in zip(requests, max_drafts):
            toks = r.token_ids
            key = toks[-1]
            p = next((p for p in range(len(toks) - 2, -1, -1) if toks[p] == key), -1)
            draft = toks[p + 1 : p + 1 + m] if p >= 0 else []
            out.append(Draft(draft) if draft else None)
        return out

    def propose_on_device(self, engine, requests, max_drafts, last_tokens, num_tokens, pending) -> DeviceDraft:
        dev = last_tokens.device
        K, P = max(max_drafts), pending.shape[1]
        known = [r.token_ids[: r.num_known_tokens] for r in requests]
        L = max(len(h) for h in known) + P + K
        up = Upload(dev, engine.platform.supports_pinned_memory())  # one copy
        h_hist, h_known = up.add([h + [-1] * (L - len(h)) for h in known]), up.add([len(h) for h in known])
        hist, n_known = (up.send()[i] for i in (h_hist, h_known))
        hist.scatter_(1, n_known[:, None] + torch.arange(P, device=dev)[None, :], pending)  # the tokens in flight
        pos = torch.arange(L, device=dev)
        hit = (hist == last_tokens[:, None]) & (pos[None, :] < num_tokens[:, None] - 1)
        p = torch.where(hit, pos[None, :], torch.full_like(hist, -1)).amax(1)  # latest occurrence, -1: none
        cols = (p[:, None] + 1 + torch.arange(K, device=dev)[None, :]).clamp(max=L - 1)
        drafts = hist.gather(1, cols)
        # never past the true end (the drafts would copy the tokens being verified)
        past = cols >= num_tokens[:, None]
        return DeviceDraft(torch.where((p[:, None] >= 0) & ~past, drafts, torch.full_like(drafts, -1)))
