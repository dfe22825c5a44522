"""The kernel interface: a registry of named ops.

``kernels_cpu`` defines what every op means, in plain torch that runs on any device. A kernel
backend (``deepinfer.kernels`` entry point) may override any subset; a missing op falls back to
the reference, and the fallback is logged and listed by ``deepinfer plugins``.

Backends name their ops lazily as ``"module:function"`` strings so that listing a backend never
imports its heavy dependencies (TileLang, torch_npu, ...).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("deepinfer.kernels")


@dataclass(frozen=True)
class OpSpec:
    name: str
    signature: str
    doc: str


#: Every op the engine calls. Shapes: T tokens, B sequences, H heads, D head dim, E experts. A latent
#: ``cache[NB, BS, D]`` (paged_kv_write, paged_kv_gather, mla_decode) is a layer's ``LayerCache``: on a
#: platform that stores the entry in planes (``Platform.kv_cache_planes``) it arrives as the tuple of
#: planes, which that platform's kernels read (``kv_cache_spec``, "Planes").
OP_SPECS: tuple[OpSpec, ...] = (
    OpSpec("linear", "(x[..., K], w[N, K], bias[N] | None) -> [..., N]", "y = x @ w.T + bias"),
    OpSpec("head_linear", "(x[T, H, K], w[H, N, K]) -> [T, H, N]",
           "one linear per head: y[t, h] = w[h] @ x[t, h] (MLA's absorbed W_UK / W_UV projections)"),
    OpSpec("rms_norm", "(x[T, C], w[C], eps) -> [T, C]", "RMSNorm computed in float32, cast back"),
    OpSpec(
        "add_rms_norm",
        "(x[T, C], residual[T, C], w[C], eps) -> (normed[T, C], new_residual[T, C])",
        "new_residual = x + residual; normed = rms_norm(new_residual)",
    ),
    OpSpec("silu_and_mul", "(x[T, 2I]) -> [T, I]", "silu(x[:, :I]) * x[:, I:]"),
    OpSpec(
        "rope",
        "(x[T, N, D], positions[T], cos_sin[P, D]) -> [T, N, D]",
        "rotate interleaved pairs (x[2i], x[2i+1]) by angle pos*freq_i; cos_sin = [cos | sin]",
    ),
    OpSpec(
        "paged_kv_write",
        "(cache[NB, BS, D], slot_mapping[T], kv[T, D]) -> None",
        "cache.view(-1, D)[slot] = kv for every slot >= 0 (in place); a uint8 cache[NB, BS, W] of float kv "
        "stores each row as an FP8 latent row of W bytes (kernels_cpu/kv_fp8.py: e4m3 latent with a "
        "power-of-two float32 scale per 128 values, bf16 rope)",
    ),
    OpSpec(
        "paged_kv_gather",
        "(cache[NB, BS, D], block_tables[B, M], seq_lens[B]) -> [sum(seq_lens), D]",
        "the first seq_lens[b] cached tokens of each sequence, concatenated",
    ),
    OpSpec(
        "mla_decode",
        "(q[T, H, D], cache[NB, BS, D], block_tables[B, M], cu_q_lens[B+1], seq_lens[B], scale, dv)"
        " -> [T, H, dv]",
        "absorbed MLA over the paged latent cache (h_kv = 1, K = cache, V = cache[..., :dv]); query j "
        "of sequence b sits at position seq_lens[b] - q_len_b + j and sees keys 0..position; a uint8 cache "
        "holds FP8 latent rows, read as latent_kv_dequant(rows, D, float32)",
    ),
    OpSpec(
        "latent_kv_dequant",
        "(rows[S, W] u8, values: int, dtype) -> [S, values]",
        "FP8 latent rows (kernels_cpu/kv_fp8.py) back to values: e4m3 * its tile's scale, then the bf16 rope",
    ),
    OpSpec(
        "mla_prefill",
        "(q[T, H, Dqk], k[S, H, Dqk], v[S, H, Dv], cu_q_lens[B+1], cu_k_lens[B+1], scale) -> [T, H, Dv]",
        "expanded causal attention; each sequence's queries are the last q_len of its k_len keys",
    ),
    OpSpec(
        "moe_route",
        "(logits[T, E], bias[E] | None, top_k, scoring, n_group, topk_group, group_score, renormalize,"
        " scale) -> (weights[T, k] f32, ids[T, k] i64)",
        "DeepSeek gate: softmax|sigmoid scores, group-limited selection (group_score max|top2sum) on "
        "scores+bias, weights from unbiased scores, optional renormalisation, times scale",
    ),
    OpSpec(
        "fused_moe",
        "(x[T, C], w13[E, 2I, C], w2[E, C, I], weights[T, k], ids[T, k]) -> [T, C]",
        "sum_j weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]) for e = ids[t, j]; ids outside "
        "[0, E) are skipped (experts owned by another rank)",
    ),
    # ---- decode fusion (reference: kernels_cpu/fused.py) ----
    OpSpec("linear_f32", "(x[..., K], w[N, K]) -> [..., N] f32",
           "x.float() @ w.float().T (the router's logits, without a float32 copy of the weight)"),
    OpSpec(
        "add_rms_norm_linear",
        "(x[T, C], residual[T, C] | None, norm_w[C], eps, w[N, C]) -> (y[T, N], new_residual[T, C])",
        "new_residual = x + residual (x when residual is None); y = linear(rms_norm(new_residual, norm_w, eps), "
        "w): a layer's input norm in the prologue of the projection after it",
    ),
    OpSpec(
        "mla_kv_write",
        "(kv_a[T, L+R], norm_w[L], eps, positions[T], cos_sin[P, R], cache[NB, BS, L+R], slot_mapping[T])"
        " -> entry[T, L+R]",
        "entry = [rms_norm(kv_a[:, :L]) | rope(kv_a[:, L:])]; paged_kv_write(cache, slot_mapping, entry); "
        "returns entry (one launch for MLA's latent norm, key rope and cache write)",
    ),
    OpSpec(
        "mla_q_absorb",
        "(q[T, H, N+R], w_uk[H, L, N], positions[T], cos_sin[P, R]) -> [T, H, L+R]",
        "[head_linear(q[..., :N], w_uk) | rope(q[..., N:], positions, cos_sin)]: MLA's absorbed decode "
        "query (W_UK folded into the no-rope part, rope on the rest) in one launch",
    ),
    OpSpec(
        "mla_q_absorb_kv_write",
        "(q[T, H, N+R], w_uk[H, L, N], positions[T], cos_sin[P, R], kv_a[T, L'+R], norm_w[L'], eps, "
        "cache[NB, BS, L'+R], slot_mapping[T]) -> [T, H, L+R]",
        "mla_kv_write(kv_a, norm_w, eps, positions, cos_sin, cache, slot_mapping); returns mla_q_absorb(q, w_uk, "
        "positions, cos_sin): a decode step's query and its cache write in one launch",
    ),
    OpSpec(
        "mla_decode_uv",
        "(q[T, H, L+R], cache[NB, BS, L+R], block_tables[B, M], cu_q_lens[B+1], seq_lens[B], scale, L, "
        "w_uv[H, V, L]) -> [T, H, V]",
        "head_linear(mla_decode(q, cache, block_tables, cu_q_lens, seq_lens, scale, L), w_uv): MLA's decode "
        "attention and W_UV (the latent output rounded to q's dtype in between, as mla_decode returns it)",
    ),
    OpSpec(
        "moe_gate",
        "(x[T, C], gate[E, C], bias[E] | None, top_k, scoring, n_group, topk_group, group_score, renormalize, "
        "scale, n_shared, dtype) -> (weights[T, k + n_shared] dtype, ids[T, k + n_shared] i64)",
        "moe_route(linear_f32(x, gate), ...) with n_shared always-selected experts E..E+n_shared-1 of weight 1 "
        "appended, weights cast to dtype: the router and the shared experts' slots of fused_moe",
    ),
    OpSpec(
        "add_rms_norm_moe_gate",
        "(x[T, C], residual[T, C], norm_w[C], eps, gate[E, C], bias[E] | None, top_k, scoring, n_group, topk_group, "
        "group_score, renormalize, scale, n_shared, dtype) -> (normed[T, C], new_residual[T, C], weights, ids)",
        "normed, new_residual = add_rms_norm(x, residual, norm_w, eps); weights, ids = moe_gate(normed, gate, ...): "
        "the post-attention norm in the prologue of the router",
    ),
    # ---- block-scaled FP8 weights (reference and exact rules: kernels_cpu/fp8_ops.py) ----
    OpSpec(
        "fp8_linear",
        "(x[..., K], w[N, K] e4m3, w_scale[ceil(N/128), ceil(K/128)] f32) -> [..., N]",
        "x quantised to e4m3 per token and 128 channels (scale = max(amax, 1e-4) / 448), then "
        "sum over 128-wide k blocks of (q_x . w) * x_scale * w_scale, float32 accumulation",
    ),
    OpSpec(
        "fused_moe_fp8",
        "(x[T, C], w13[E, 2I, C] e4m3, w13_scale[E, 2I/128, C/128] f32, w2[E, C, I] e4m3, "
        "w2_scale[E, C/128, I/128] f32, weights[T, k], ids[T, k]) -> [T, C]",
        "fused_moe with every expert GEMM an fp8_linear (the hidden is cast to x.dtype, then quantised)",
    ),
    # ---- DeepSeek-V4 (reference: kernels_cpu/v4_ops.py) ----
    OpSpec("rope_inverse", "(x[T, N, D], positions[T], cos_sin[P, D]) -> [T, N, D]",
           "rope by the negative angle (V4 un-rotates the attention output, which carried the keys' rope)"),
    OpSpec(
        "v4_compress",
        "(state[NB, BS, E] f32, block_tables[B, M], seq_idx[N], close_pos[N], ape[m, w] f32, norm_w[Dc], eps, "
        "cos_sin[P, R], col) -> [N, Dc] f32",
        "one compressed entry per token closing a window ((p+1) % m == 0) from the raw [kv | gate] compressor "
        "inputs (w wide each, from column col) of a window of the paged per-token state; w = Dc pools tokens "
        "p-m+1..p, w = 2Dc (overlapped CSA) pools Ca of p-2m+1..p-m and Cb of p-m+1..p; gate += ape[pos % m], "
        "softmax over slots per channel, rms_norm, rope of the last R channels at position p-m+1",
    ),
    OpSpec(
        "v4_indexer_topk",
        "(q[T, HI, DI], weights[T, HI], keys[NB, EPB, DI], block_tables[B, M], seq_idx[T], positions[T], ratio, "
        "top_k, scale) -> [T, top_k] i64",
        "lightning indexer: entries w < (p+1) // ratio visible; score = sum_h weights[t, h] * relu(q[t, h] . "
        "keys[w]) * scale; ids of the top_k visible entries (any order), -1 padded",
    ),
    OpSpec(
        "v4_sparse_attention",
        "(q[T, H, D], swa_cache[NB, BS, >=D], swa_tables[B, M], comp_cache[NB2, EPB, >=D] | None, "
        "comp_tables[B, M2] | None, comp_ids[T, K] | None, seq_idx[T], positions[T], window, sinks[H] f32, scale)"
        " -> [T, H, D]",
        "one shared K=V head: keys = the window positions p-window+1..p of the token's sequence (positions "
        "whose swa_tables entry is -1 are absent) plus the "
        "compressed entries comp_ids >= 0; softmax(q.k * scale) with a per-head sink logit whose probability "
        "is dropped; out = sum p * key",
    ),
    OpSpec(
        "mhc_pre",
        "(h[T, n, C], fn[(2+n)n, nC] f32, base[(2+n)n] f32, scale[3] f32, iters, norm_eps, hc_eps) -> "
        "(x[T, C], post[T, n] f32, comb[T, n, n] f32)",
        "mHC: mix = rms(h.flatten) @ fn.T; pre = sigmoid(.)+eps collapses h to x; post = 2 sigmoid(.); comb = "
        "softmax(.)+eps then Sinkhorn (column, then iters-1 row/column normalisations)",
    ),
    OpSpec("mhc_post", "(y[T, C], h[T, n, C], post[T, n], comb[T, n, n]) -> [T, n, C]",
           "new h[k] = post[k] * y + sum_j comb[j, k] * h[j]"),
    OpSpec("mhc_head", "(h[T, n, C], fn[n, nC] f32, base[n] f32, scale[1] f32, norm_eps, hc_eps) -> [T, C]",
           "final collapse: sum_j (sigmoid(rms(h.flatten) @ fn.T * scale + base) + eps)[j] * h[j]"),
    OpSpec(
        "moe_route_v4",
        "(logits[T, E] f32, bias[E] | None, hash_ids[T, k] | None, top_k, scoring, scale) -> (weights[T, k] f32, "
        "ids[T, k] i64)",
        "scores = sqrt(softplus) | sigmoid of logits; ids = hash_ids (hash layers) or top_k of scores + bias; "
        "weights = scores[ids] renormalised, times scale",
    ),
    OpSpec("silu_and_mul_clamped", "(x[T, 2I], limit | None) -> [T, I]",
           "silu(min(gate, limit)) * clamp(up, -limit, limit) (no clamp when limit is None)"),
    OpSpec(
        "fused_moe_clamped",
        "(x[T, C], w13[E, 2I, C], w2[E, C, I], weights[T, k], ids[T, k], limit | None) -> [T, C]",
        "fused_moe with the SwiGLU clamp of silu_and_mul_clamped",
    ),
    OpSpec(
        "apply_penalties",
        "(logits[B, V], prompt_mask[B, V], output_counts[B, V], repetition[B], presence[B], frequency[B])"
        " -> [B, V]",
        "vLLM-style repetition (on prompt and output tokens), presence and frequency penalties",
    ),
    OpSpec("ue8m0_scale", "(amax[...] f32) -> [...] u8",
           "the power-of-two scale of a block of largest magnitude amax, as a biased exponent byte: "
           "e = ceil(log2(max(amax, 1e-4) / 448)) clamped to [-127, 127], byte e + 127 (kernels_cpu/mxfp8.py)"),
    OpSpec("mxfp8_quant", "(x[N, D]) -> [N, D + D/32] u8",
           "MXFP8: per 32 values one ue8m0_scale of the finite amax; x / scale to e4m3fn round-to-nearest-even, "
           "inf saturates to +-448, NaN -> 0x7F; row = D e4m3 bytes then D/32 scale bytes"),
    OpSpec("mxfp8_dequant", "(packed[N, D + D/32] u8, dtype) -> [N, D]",
           "e4m3 * 2**(scale byte - 127) per 32 values, in dtype"),
    OpSpec(
        "draft_lengths",
        "(conf[B, K] f32, max_drafts[B] int, budget: int, min_conf: float) -> [B] int64",
        "speculative draft lengths: the budget largest cumulative products of per-position confidences "
        "(positions < max_drafts, >= min_conf; ties to lower position, then lower request) counted per request",
    ),
    OpSpec("logsumexp", "(x[R, V] f32) -> [R]", "log(sum(exp(x[r]))) per row (the logprob normaliser)"),
    OpSpec("greedy_sample", "(x[R, V] f32) -> (tokens[R] i64, logprobs[R] f32, lse[R] f32)",
           "greedy decoding's draw and its logprob in one pass: tokens = argmax(x[r]) (torch's: the first "
           "maximal index, a NaN counting as the maximum), lse = logsumexp(x[r]), logprobs = x[r, token] - lse"),
    OpSpec(
        "sample",
        "(logits[B, V] f32, temperature[B], top_k[B], top_p[B], min_p[B], seeds[B], offsets[B]) -> [B]",
        "greedy where temperature == 0; else temperature, top-k, top-p, min-p, then a draw from a "
        "counter-based RNG keyed by (seed, offset) so results do not depend on the batch",
    ),
)

OP_NAMES: tuple[str, ...] = tuple(s.name for s in OP_SPECS)


class KernelBackend:
    """A set of op implementations. Subclass, set ``name``, ``core_api_version`` and ``ops``.

    ``ops`` maps op names from :data:`OP_SPECS` to ``"module:function"`` import paths, imported
    only when the op is first resolved.
    """

    name: str = ""
    core_api_version: str = ""
    ops: dict[str, str] = {}

    @classmethod
    def check_environment(cls) -> None:
        """Raise :class:`~deepinfer_core.config.ConfigError` naming any of this backend's environment switches
        whose value is invalid. Called once when the engine resolves its ops (:class:`Kernels`), so that a typo
        fails the engine's start, not a step. Default: the backend reads none."""

    @classmethod
    def overrides(cls) -> list[str]:
        """Names of the ops this backend implements itself."""
        unknown = sorted(set(cls.ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"kernel backend {cls.name!r} names unknown ops {unknown}; known: {OP_NAMES}")
        return [n for n in OP_NAMES if n in cls.ops]


def import_path(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class Kernels:
    """Resolved ops for one platform: the backend's own where it has them, the reference elsewhere."""

    def __init__(self, backend: type[KernelBackend], reference: type[KernelBackend]) -> None:
        backend.check_environment()
        self.backend_name = backend.name
        self.fallbacks: list[str] = []
        self._fns: dict[str, Callable] = {}
        for name in OP_NAMES:
            if name in backend.ops:
                self._fns[name] = import_path(backend.ops[name])
            else:
                self._fns[name] = import_path(reference.ops[name])
                if backend is not reference:
                    self.fallbacks.append(name)
        if self.fallbacks:
            logger.info(
                "kernel backend %r has no %s; using the reference ops", backend.name, ", ".join(self.fallbacks)
            )

    def implements(self, name: str) -> bool:
        """Whether the platform's backend runs ``name`` itself (the reference backend implements every op). A
        model calls a fused op (``mla_q_absorb``, ``moe_gate``) only where it does: elsewhere the reference's
        composition would replace the backend's own unfused kernels (its ``rope``, ``moe_route``)."""
        return name not in self.fallbacks

    def override(self, name: str, fn: Callable) -> None:
        """Replace one op (used by features such as batch-invariant mode)."""
        if name not in self._fns:
            raise KeyError(f"unknown op {name!r}; known: {OP_NAMES}")
        self._fns[name] = fn

    def __getattr__(self, name: str) -> Callable:
        try:
            return self.__dict__["_fns"][name]
        except KeyError:
            raise AttributeError(f"no kernel op named {name!r}; known: {OP_NAMES}") from None
