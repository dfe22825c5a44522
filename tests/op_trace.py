"""Op-level tools to compare two runs of one model step that lay their rows out differently (the padded
verify layout of ``DecodeGraphs`` against the eager step), used by ``test_verify_graphs_gpu`` and
``examples/verify_graph_diag.py``.

* :func:`pinned_tiling`: the ops whose bfloat16 rounding may depend on the number of rows in the call
  (every row-wise op: cuBLAS picks its GEMM algorithm by M, GEMVs and fused decode ops take over for
  few rows, the MoE picks its path by tokens; ``mla_decode``: its split-KV count follows the rows) run
  with a fixed row count (zero rows appended) and a fixed split count. Every row's result then depends
  on that row's inputs only, so a real row must come out bit for bit the same in either layout: a
  difference is a layout bug, not rounding.
* :class:`OpRecorder`: every op call of a run (the model's layer, op name, inputs, output), to find the
  first op whose real rows differ between two runs, and to re-run one op of one layout with the other
  run's inputs (the op's own contribution, without what earlier ops passed on).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any

import torch

#: words of an op's signature (``deepinfer_core.kernels.OP_SPECS``) that mark per-sequence metadata or a KV
#: cache: such an op is not padded (its row -> sequence map would break; cache writers write per row anyway)
SEQUENCE_WORDS = ("cache", "slot", "block_tables", "seq_lens", "cu_q", "cu_k", "seq_idx", "tables")
#: ops that write the KV cache: not re-run on their own (they would overwrite it)
WRITE_OPS = ("mla_kv_write", "paged_kv_write")


def row_ops(names) -> list[str]:
    """The ops among ``names`` whose first argument holds one row per token and that take no per-sequence
    metadata (GEMMs, norms, rope, routing, MoE, fused combinations of those): padding their calls with
    zero rows changes no real row's inputs."""
    from deepinfer_core.kernels import OP_SPECS

    specs = {o.name: o.signature for o in OP_SPECS}
    out = []
    for name in names:
        sig = specs.get(name, "")
        args = sig.split("->")[0]
        first = args[args.find("[") + 1:].split(",")[0].split("]")[0].strip() if "[" in args else ""
        if first in ("T", "...") and not any(w in args for w in SEQUENCE_WORDS):
            out.append(name)
    return out


def _model_tensors(model: torch.nn.Module) -> set[int]:
    """data_ptr of every tensor a module of ``model`` holds (parameters, buffers, derived weights)."""
    ptrs = set()
    for m in model.modules():
        for v in (*vars(m).values(), *m._parameters.values(), *m._buffers.values()):
            if isinstance(v, torch.Tensor):
                ptrs.add(v.data_ptr())
    return ptrs


def _pad_rows(fn, rows: int, weights: set[int]):
    def pad(x, M):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == M and x.data_ptr() not in weights:
            xp = x.new_zeros(rows, *x.shape[1:])  # always a fresh contiguous operand: one memory layout too
            xp[:M] = x
            return xp
        return x

    def cut(y, M):
        if isinstance(y, torch.Tensor) and y.dim() and y.shape[0] == rows:
            return y[:M]
        if isinstance(y, tuple):
            return tuple(cut(v, M) for v in y)
        return y

    def padded(x, *args, **kw):
        M = x.shape[0]
        if M > rows:
            raise ValueError(f"pinned_tiling: a call with {M} rows > the pinned {rows}")
        out = fn(pad(x, M), *(pad(a, M) for a in args), **{k: pad(v, M) for k, v in kw.items()})
        return cut(out, M)
    return padded


@contextmanager
def pinned_tiling(model: torch.nn.Module, rows: int, n_split: int | None = None):
    """Within the block, every row-wise op of ``model.k`` (:func:`row_ops`: whatever kernel it picks by
    the number of rows, cuBLAS's GEMM algorithm, a GEMV for few rows, the MoE's path) runs ``rows`` rows
    per call, the real ones first and zero rows after, and ``mla_decode`` ``n_split`` key splits (where
    the op takes ``n_split``: the CUDA kernels; the reference does not split). ``mla_decode_uv`` runs as its
    meaning, ``head_linear(mla_decode(...), w_uv)`` through those pinned ops: the CUDA op picks its fused kernel
    and the key splits by the number of query rows."""
    k = model.k
    weights = _model_tensors(model)
    names = [*row_ops(k._fns), "mla_decode", "mla_decode_uv"]
    saved = {name: k._fns[name] for name in names}
    try:
        for name in names[:-2]:
            k.override(name, _pad_rows(saved[name], rows, weights))
        dec = saved["mla_decode"]
        if n_split is not None and "n_split" in inspect.signature(dec).parameters:
            k.override("mla_decode", lambda *a, **kw: dec(*a, **{**kw, "n_split": n_split}))
        k.override("mla_decode_uv", lambda q, cache, bt, cu, lens, scale, dv, w_uv:
                   k.head_linear(k.mla_decode(q, cache, bt, cu, lens, scale, dv), w_uv))
        yield
    finally:
        for name, fn in saved.items():
            k.override(name, fn)


def _snap(x: Any, limit: int) -> Any:
    """A copy of an op argument or output taken at call time (tensors up to ``limit`` elements; larger
    ones, weights and KV caches, are kept by reference)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone() if x.numel() <= limit else x
    if isinstance(x, (tuple, list)):
        return type(x)(_snap(v, limit) for v in x)
    return x


class OpRecorder:
    """Records every op call of ``model`` (through its ``model.k`` kernels) while active:
    ``calls[i] = (layer, name, args, kwargs, output)``; layer is the decoder layer index, "embed"
    before the first and "final" after the last (final norm, LM head)."""

    def __init__(self, model: torch.nn.Module, limit: int = 1 << 23) -> None:
        self.model, self.k, self.limit = model, model.k, limit
        self.calls: list[tuple[Any, str, tuple, dict, Any]] = []
        self.layer: Any = "embed"
        self.fns = dict(self.k._fns)
        self._hooks: list = []

    def _wrap(self, name: str, fn):
        def recorded(*args, **kw):
            snap = (_snap(args, self.limit), _snap(kw, self.limit))
            out = fn(*args, **kw)
            self.calls.append((self.layer, name, *snap, _snap(out, self.limit)))
            return out
        return recorded

    def __enter__(self) -> OpRecorder:
        layers = list(self.model.layers)
        for i, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "layer", i)))
        self._hooks.append(layers[-1].register_forward_hook(lambda m, a, o: setattr(self, "layer", "final")))
        self.layer = "embed"
        self.fns = dict(self.k._fns)
        for name, fn in self.fns.items():
            self.k.override(name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.fns.items():
            self.k.override(name, fn)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def compare_calls(padded: OpRecorder, eager: OpRecorder, dst: torch.Tensor, rerun: bool = True) -> list[dict]:
    """Per op call (the two runs call the same ops in the same order): the largest |difference| of the
    real rows of its output (padded row ``dst[j]`` against eager row ``j``), the largest |eager output|,
    and with ``rerun`` the difference when the padded call is re-run with the eager call's inputs in its
    real rows (``local``: this op's own share; cache writers are not re-run). Run ``rerun`` while the
    KV cache still holds the eager run's writes."""
    if len(padded.calls) != len(eager.calls):
        raise ValueError(f"the runs made {len(padded.calls)} and {len(eager.calls)} op calls")
    T = dst.numel()
    rows = []
    for (lp, name, ap, kp, op), (le, name_e, ae, ke, oe) in zip(padded.calls, eager.calls):
        if (lp, name) != (le, name_e):
            raise ValueError(f"op order differs: {lp}/{name} vs {le}/{name_e}")
        outs_p, outs_e = _tensors(op), _tensors(oe)
        row = {"layer": lp, "op": name, "acc": None, "local": None, "ref": None}
        if outs_e and outs_p and outs_p[0].dim() and outs_e[0].dim() and outs_p[0].shape[1:] == outs_e[0].shape[1:]:
            N = outs_p[0].shape[0]
            if outs_e[0].shape[0] == T:
                row["acc"] = max(_max_diff(p[dst], e) for p, e in zip(outs_p, outs_e))
                row["ref"] = max(e.float().abs().max().item() for e in outs_e if e.numel())
                if rerun and name not in WRITE_OPS:
                    row["local"] = _local(padded.fns[name], ap, kp, ae, ke, outs_e, dst, N, T)
        rows.append(row)
    return rows


def _row_arg(p: Any, e: Any, dst: torch.Tensor, N: int, T: int) -> Any:
    """The padded call's argument with the eager call's rows in its real rows (row-indexed tensors only:
    [N, ...] in the padded run and [T, ...] in the eager one)."""
    if isinstance(p, torch.Tensor) and isinstance(e, torch.Tensor):
        if N != T and p.dim() and e.dim() and p.shape[0] == N and e.shape[0] == T and p.shape[1:] == e.shape[1:]:
            p = p.clone()
            p[dst] = e.to(p.dtype)
        return p
    if isinstance(p, (tuple, list)) and isinstance(e, (tuple, list)) and len(p) == len(e):
        return type(p)(_row_arg(a, b, dst, N, T) for a, b in zip(p, e))
    return p


def _local(fn, ap, kp, ae, ke, outs_e, dst, N, T) -> float:
    args = _row_arg(ap, ae, dst, N, T)
    kw = {key: _row_arg(v, ke.get(key), dst, N, T) for key, v in kp.items()}
    out = _tensors(fn(*args, **kw))
    return max(_max_diff(p[dst], e) for p, e in zip(out, outs_e))


def summarize(rows: list[dict]) -> list[dict]:
    """Per (layer, op): the largest acc/local/ref over its calls, in first-call order."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r["acc"] is None:
            continue
        s = out.setdefault((r["layer"], r["op"]), {"layer": r["layer"], "op": r["op"], "calls": 0,
                                                   "acc": 0.0, "local": None, "ref": 0.0})
        s["calls"] += 1
        s["acc"] = max(s["acc"], r["acc"])
        s["ref"] = max(s["ref"], r["ref"])
        if r["local"] is not None:
            s["local"] = max(s["local"] or 0.0, r["local"])
    return list(out.values())


def first_difference(rows: list[dict]) -> dict | None:
    """The first op call whose real rows differ at all (None: every call bit-equal)."""
    return next((r for r in rows if r["acc"]), None)
