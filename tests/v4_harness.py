"""A minimal driver for a ``CausalLM`` over its declared cache groups, standing in for the engine in
model tests: it allocates each group's cache tensors from ``cache_layout()``, gives every request a
shuffled block table per group, and builds ``AttentionMetadata`` with per-group slot mappings and
block tables for a step of (request, new tokens) pieces.

Cache tensors start as NaN, so a model that reads an entry it never wrote produces NaN. Block-table
entries of window groups that fell wholly before the window of a step's first token are -1 (the engine
frees them): a model that needed them would lose keys and miss the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, GroupMeta, PrefillMeta


@dataclass
class Request:
    rid: int
    tokens: list[int] = field(default_factory=list)  # every token fed so far
    tables: dict[str, torch.Tensor] = field(default_factory=dict)  # group -> [M] int32 block ids


class Harness:
    def __init__(self, model, block_size: int, max_len: int, max_requests: int, dtype=torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.model, self.block_size, self.device = model, block_size, torch.device(device)
        self.layout = model.cache_layout()
        self.layout.check_block_size(block_size)
        self.blocks_per_req = -(-max_len // block_size)
        self.num_blocks = self.blocks_per_req * max_requests
        self.caches = {
            g.name: [torch.full((self.num_blocks, g.entries_per_block(block_size), g.entry_dim), float("nan"),
                                dtype=g.dtype or dtype, device=self.device) for _ in g.layers]
            for g in self.layout.groups
        }
        self._free = {g.name: torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(i)).tolist()
                      for i, g in enumerate(self.layout.groups)}
        self.requests: dict[int, Request] = {}

    def add(self, rid: int) -> Request:
        r = Request(rid)
        for g in self.layout.groups:
            r.tables[g.name] = torch.tensor([self._free[g.name].pop() for _ in range(self.blocks_per_req)],
                                            dtype=torch.int32)
        self.requests[rid] = r
        return r

    def fork(self, src: int, rid: int, n: int) -> Request:
        """A new request whose first ``n`` tokens (a block multiple) are a prefix hit on request ``src``:
        it shares ``src``'s blocks below ``n`` in every prefix-cacheable group and gets fresh ones
        (NaN) everywhere else."""
        assert n % self.block_size == 0
        r = self.add(rid)
        s = self.requests[src]
        r.tokens = list(s.tokens[:n])
        for g in self.layout.groups:
            if g.prefix_cacheable:
                r.tables[g.name][: n // self.block_size] = s.tables[g.name][: n // self.block_size]
        return r

    def truncate(self, rid: int, n: int) -> None:
        """Keep the first ``n`` tokens of a request (rejected speculative tokens): its blocks stay, and
        whatever the dropped tokens wrote is overwritten when those positions are fed again."""
        del self.requests[rid].tokens[n:]

    def _slot(self, g, table: torch.Tensor, p: int) -> int:
        epb = g.entries_per_block(self.block_size)
        if g.tokens_per_entry > 1:
            if (p + 1) % g.tokens_per_entry:
                return -1
            e = p // g.tokens_per_entry
        else:
            e = p
        return int(table[e // epb]) * epb + e % epb

    def _view_table(self, g, table: torch.Tensor, first_pos: int) -> torch.Tensor:
        """The table the model sees: window blocks wholly before the window of ``first_pos`` freed (-1)."""
        t = table.clone()
        if g.window is not None:
            lo = first_pos - g.window + 1
            for j in range(t.shape[0]):
                if (j + 1) * self.block_size <= lo:
                    t[j] = -1
        return t

    def step(self, pieces: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one step over ``pieces`` [(request id, new tokens)] (in batch order) and return the final
        hidden states of every new token [T, C]."""
        ids, positions, q_lens, seq_lens = [], [], [], []
        slots = {g.name: [] for g in self.layout.groups}
        tables = {g.name: [] for g in self.layout.groups}
        for rid, new in pieces:
            r = self.requests.get(rid) or self.add(rid)
            start = len(r.tokens)
            r.tokens.extend(new)
            ids.extend(new)
            positions.extend(range(start, start + len(new)))
            q_lens.append(len(new))
            seq_lens.append(len(r.tokens))
            for g in self.layout.groups:
                slots[g.name].extend(self._slot(g, r.tables[g.name], p) for p in range(start, start + len(new)))
                tables[g.name].append(self._view_table(g, r.tables[g.name], start))
        dev = self.device
        groups = {n: GroupMeta(torch.tensor(slots[n], dtype=torch.int64, device=dev), torch.stack(tables[n]).to(dev))
                  for n in slots}
        cu = torch.tensor([0, *q_lens], dtype=torch.int64, device=dev).cumsum(0)
        seq = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        first = self.layout.groups[0].name
        n_prefill = sum(1 for q in q_lens if q > 1)  # harness convention: multi-token pieces first
        P = int(cu[n_prefill])
        prefill = decode = None
        if n_prefill:
            cu_k = torch.tensor([0, *seq_lens[:n_prefill]], dtype=torch.int64, device=dev).cumsum(0)
            prefill = PrefillMeta(cu[: n_prefill + 1], cu_k, seq[:n_prefill],
                                  groups[first].block_tables[:n_prefill], has_prefix=True)
        if n_prefill < len(q_lens):
            decode = DecodeMeta(cu[n_prefill:] - cu[n_prefill], seq[n_prefill:],
                                groups[first].block_tables[n_prefill:])
        meta = AttentionMetadata(num_prefill_tokens=P, slot_mapping=groups[first].slot_mapping, prefill=prefill,
                                 decode=decode, groups=groups, cu_q_lens=cu, seq_lens=seq)
        with torch.no_grad():
            return self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                              torch.tensor(positions, dtype=torch.int64, device=dev), meta, self.caches)
