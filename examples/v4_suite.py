"""DeepSeek-V4 on the H200 (``benchmark.py --suite h200 --shape v4-flash-slice``): random bf16 weights at
V4-Flash widths, layers 1-4 of Flash (SWA, CSA, HCA, CSA; the first two hash-routed), driven at the model
level: its own paged caches per cache group, filled with random entries, so a decode point at 32k
context needs no 32k-token prefill of every request. Decode steps go through the engine's graph runner
(``DecodeGraphs``: static per-group slot mappings and block tables, one captured graph per batch).

    python examples/benchmark.py --suite h200 --shape v4-flash-slice --out DIR                # on the H200
    python examples/benchmark.py --suite h200 --shape v4-flash-slice --scale tiny --out DIR   # CPU, seconds

Reports, per decode batch (1, 64, 256) and context (8k, 32k), the step time and tok/s as a fraction of
the bandwidth roofline: bytes = weights touched (every dense weight once, the routed experts hit, the
embedding rows and the LM head) + the window keys + the compressed entries the step attends (CSA: the
indexer's top-k; HCA: all) (+ separately the indexer keys the CSA layers score, reported as
``fraction_with_indexer``); prefill of one 8k prompt as a fraction of the matmul peak (FLOPs counted
below); the graphs' speed-up over eager steps; and a comparison baseline: transformers' ``generate`` if
the installed transformers has DeepSeek-V4 (it does from 5.23), else the reference-op path (the same
model with ``kernels_cpu`` ops on the GPU), which is what is compared on a transformers < 5.23.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from deepinfer_core.engine.graph_runner import DecodeGraphs
from deepinfer_core.kernels import Kernels
from deepinfer_core.models.config_v4 import CSA, HCA, SWA, V4Config
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.models.loader import random_init
from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, GroupMeta, PrefillMeta
from kernels_cpu import ReferenceKernels

SHAPE = "v4-flash-slice"
#: V4-Flash widths (../shared/V4.md), its layers 1-4
FLASH = dict(
    architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, hidden_size=4096, num_hidden_layers=4,
    num_attention_heads=64, head_dim=512, partial_rotary_factor=0.125, q_lora_rank=1024, o_groups=8,
    o_lora_rank=1024, n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, index_n_heads=64,
    index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20,
    compress_rates={CSA: 4, HCA: 128}, layer_types=[SWA, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1 << 20, tie_word_embeddings=False, num_nextn_predict_layers=0,
)
#: --scale tiny: every width shrunk, the layer mix and routing kept (CPU CI)
TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=64, q_lora_rank=32, o_groups=2,
            o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, index_n_heads=4,
            index_head_dim=16, index_topk=4, sliding_window=8, compress_rates={CSA: 4, HCA: 16})
#: tests/test_v4_graphs.py's GPU model: small, but at shapes that run every V4 TileLang kernel (16 heads of 128,
#: indexer 16 x 64 with a top-16 choice, 16 experts, hidden 512); its kernels are warmed by engine_warm.py
GRAPH_TEST = dict(
    architectures=["DeepseekV4ForCausalLM"], vocab_size=4096, hidden_size=512, num_hidden_layers=4,
    num_attention_heads=16, head_dim=128, partial_rotary_factor=0.5, q_lora_rank=256, o_groups=2, o_lora_rank=128,
    n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=256, index_n_heads=16, index_head_dim=64,
    index_topk=16, sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20, compress_rates={CSA: 4, HCA: 128},
    layer_types=[SWA, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    scoring_func="sqrtsoftplus", swiglu_limit=10.0, max_position_embeddings=2048, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
)
FULL_OPTS = dict(batches="1,64,256", contexts="8192,32768", prefill_len=8192, block_size=256, warmup=3, window=10,
                 eager_batches="1,64", baseline_batches="1,64", dtype="bfloat16")
TINY_OPTS = dict(batches="1,4,8", contexts="64,160", prefill_len=128, block_size=16, warmup=1, window=3,
                 eager_batches="1,4", baseline_batches="1,4", dtype="float32")
DECODE_STEPS_MAX = 64  # decode positions past the context the caches are laid out for
#: PROFILE=1: steps per profiled decode point (graph replays, and eager steps at the smallest batch: the
#: eager table counts the decode path's launches), at these batches of the first context, and the prefill
PROFILE_STEPS = 5
PROFILE_BATCHES = (1, 64)


def suite_config(scale: str) -> dict:
    cfg = dict(FLASH)
    if scale == "tiny":
        cfg.update(TINY)
    return cfg


# ---- a model-level driver: caches, block tables and step metadata per cache group ---------------------
class Driver:
    """``num_seqs`` sequences whose positions stay in [lo, hi): full groups get blocks for [0, hi), window
    groups only for [lo - window - block, hi) (-1 before: freed, as the engine's window groups are)."""

    def __init__(self, model: DeepseekV4ForCausalLM, num_seqs: int, lo: int, hi: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.model, self.bs, self.device = model, block_size, device
        self.layout = model.cache_layout()
        self.layout.check_block_size(block_size)
        self.M = math.ceil(hi / block_size)
        g = torch.Generator(device=device).manual_seed(seed)
        self.caches: dict[str, list[torch.Tensor]] = {}
        self.tables: dict[str, torch.Tensor] = {}
        for spec in self.layout.groups:
            first = 0 if spec.window is None else max(0, (lo - spec.window - block_size) // block_size)
            per_seq = self.M - first
            nb = num_seqs * per_seq
            epb = spec.entries_per_block(block_size)
            tab = torch.full((num_seqs, self.M), -1, dtype=torch.int32)
            tab[:, first:] = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).view(num_seqs, per_seq)
            self.tables[spec.name] = tab.to(device)
            # random entries (normed K=V are ~N(0, 1)): a step reads what a prefill would have written
            self.caches[spec.name] = [torch.randn(nb, epb, spec.entry_dim, generator=g, device=device).to(
                spec.dtype or dtype) for _ in spec.layers]

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.caches.values() for t in ts)

    def meta(self, seqs: list[int], positions: list[list[int]],
             prefill: bool) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions [T] and the metadata of a step feeding ``positions[i]`` of sequence ``seqs[i]``."""
        dev = self.device
        q_lens = [len(p) for p in positions]
        pos = torch.tensor([p for ps in positions for p in ps], dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(q_lens))
        seq_of = torch.tensor(seqs)[row]
        groups = {}
        for spec in self.layout.groups:
            epb, tpe = spec.entries_per_block(self.bs), spec.tokens_per_entry
            tab = self.tables[spec.name].cpu()
            e = pos // tpe
            slot = tab[seq_of, e // epb].long() * epb + e % epb
            if tpe > 1:
                slot = torch.where((pos + 1) % tpe == 0, slot, torch.full_like(slot, -1))
            groups[spec.name] = GroupMeta(slot.to(dev), self.tables[spec.name][torch.tensor(seqs, device=dev)])
        cu = torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0).to(dev)
        seq_lens = torch.tensor([ps[-1] + 1 for ps in positions], dtype=torch.int64, device=dev)
        first = self.layout.groups[0].name
        tables = groups[first].block_tables
        pre = PrefillMeta(cu, cu.clone(), seq_lens, tables, has_prefix=False) if prefill else None
        dec = None if prefill else DecodeMeta(cu, seq_lens, tables, max(q_lens))
        meta = AttentionMetadata(int(cu[-1]) if prefill else 0, groups[first].slot_mapping, pre, dec, groups=groups,
                                 cu_q_lens=cu, seq_lens=seq_lens)
        return pos.to(dev), meta


# ---- the roofline terms ------------------------------------------------------------------------------
def _numel(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes(model: DeepseekV4ForCausalLM, batch: int, experts_hit: float) -> dict[str, float]:
    """Weights one decode step of ``batch`` tokens reads: everything once except the routed experts (those
    hit), the embedding (its rows) and the head (once, whole)."""
    cfg = model.cfg
    dense = routed = 0.0
    for layer in model.layers:
        for name, p in layer.named_parameters():
            if name.startswith("ffn.w13") or name.startswith("ffn.w2"):
                routed += _numel(p) / p.shape[0] * experts_hit
            else:
                dense += _numel(p)
    other = sum(_numel(p) for n, p in model.named_parameters() if not n.startswith(("layers.", "embed", "head")))
    emb = batch * cfg.hidden_size * model.embed.element_size()
    return {"dense": dense + other, "routed_experts": routed, "embedding": emb, "lm_head": _numel(model.head)}


def kv_bytes(cfg: V4Config, batch: int, context: float, itemsize: int) -> dict[str, float]:
    """Cache bytes one decode step reads per token, summed over layers (the kernels read a compressed row's
    first D channels)."""
    D, DI, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    window = comp = index = 0.0
    for kind in cfg.layer_types:
        window += min(W, context) * D * itemsize
        if kind == CSA:
            n = context // cfg.compress_csa
            comp += min(cfg.index_topk, n) * D * itemsize
            index += n * DI * itemsize
        elif kind == HCA:
            comp += (context // cfg.compress_hca) * D * itemsize
    return {"window_kv": batch * window, "compressed_kv": batch * comp, "indexer_keys": batch * index}


def prefill_flops(model: DeepseekV4ForCausalLM, n: int) -> dict[str, float]:
    """FLOPs of a prefill of one ``n``-token prompt (logits of its last token only): 2 per weight MAC per
    token (routed experts: top-k of them), plus attention scores and values over each token's keys, plus
    the CSA indexer's scores over every visible entry."""
    cfg = model.cfg
    per_tok = 0.0
    for layer in model.layers:
        for name, p in layer.named_parameters():
            if p.dim() < 2 or name.endswith("ape"):
                continue
            per_tok += p.numel() / p.shape[0] * cfg.num_experts_per_tok if name.startswith(("ffn.w13", "ffn.w2")) \
                else p.numel()
    H, D, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    attn = index = 0.0
    for kind in cfg.layer_types:
        keys = sum(min(W, p + 1) for p in range(n))
        if kind == CSA:
            keys += sum(min(cfg.index_topk, (p + 1) // cfg.compress_csa) for p in range(n))
            index += 2 * cfg.index_n_heads * cfg.index_head_dim * sum((p + 1) // cfg.compress_csa for p in range(n))
        elif kind == HCA:
            keys += sum((p + 1) // cfg.compress_hca for p in range(n))
        attn += 4 * H * D * keys  # scores + values
    weights = 2 * per_tok * n + 2 * _numel(model.head) / model.head.element_size()
    return {"weights": weights, "attention": attn, "indexer": index, "total": weights + attn + index}


def expected_distinct(E: int, k: int, tokens: int) -> float:
    return E * (1 - (1 - k / E) ** tokens)


# ---- measurements ------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of ``fn()`` (device-synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def set_kernels(model: torch.nn.Module, k: Kernels) -> None:
    for m in model.modules():
        if hasattr(m, "k"):
            m.k = k


def eager_step(model, ids, pos, meta, caches) -> torch.Tensor:
    return model.logits(model(ids, pos, meta, caches))


def decode_points(model, platform, opts: dict, ceil: dict, dtype, device, graphs_on: bool,
                  profile_dir: Path | None = None) -> list[dict]:
    """Per context (largest batch first, one cache layout per context), each batch's decode step time;
    with ``profile_dir``, kernel tables of ``PROFILE_BATCHES`` at the first context."""
    cfg = model.cfg
    batches = sorted({int(b) for b in opts["batches"].split(",")}, reverse=True)
    eager_b = {int(b) for b in opts["eager_batches"].split(",")}
    rows = []
    contexts = [int(c) for c in opts["contexts"].split(",")]
    profiled = {(b, contexts[0]) for b in PROFILE_BATCHES} if profile_dir is not None else set()
    for ctx in contexts:
        drv = Driver(model, batches[0], ctx, ctx + DECODE_STEPS_MAX, opts["block_size"], dtype, device)
        graphs = DecodeGraphs(model, drv.caches, batches, drv.M, device, platform, capture=graphs_on,
                              layout=drv.layout)
        t = time.perf_counter()
        graphs.capture()
        capture_s = time.perf_counter() - t
        for B in batches:
            pos, meta = drv.meta(list(range(B)), [[ctx] for _ in range(B)], prefill=False)
            ids = torch.randint(2, cfg.vocab_size, (B,), device=device)
            batch = SimpleNamespace(input_ids=ids, positions=pos, meta=meta, keep_hidden=False,
                                    logit_rows=list(range(B)))
            assert graphs.accepts(batch)
            step_s = _time(functools.partial(graphs.run, batch), device, opts["warmup"], opts["window"])
            hit = expected_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, B)
            wb = weight_bytes(model, B, hit)
            kb = kv_bytes(cfg, B, ctx, torch.tensor([], dtype=dtype).element_size())
            base = sum(wb.values()) + kb["window_kv"] + kb["compressed_kv"]
            bw = ceil["read_GBps"] * 1e9
            roof_s, roof_idx_s = base / bw, (base + kb["indexer_keys"]) / bw
            row = {"batch": B, "context": ctx, "step_ms": step_s * 1e3, "tok_s": B / step_s,
                   "graphs": bool(graphs.graphs), "capture_s": capture_s, "bytes": {**wb, **kb},
                   "bytes_per_step": base, "roofline_ms": roof_s * 1e3, "fraction": roof_s / step_s,
                   "fraction_with_indexer": roof_idx_s / step_s, "experts_hit": hit,
                   "experts_source": "uniform-routing expectation"}
            if B in eager_b:
                fwd = functools.partial(eager_step, model, ids, pos, meta, drv.caches)
                row["eager_step_ms"] = _time(fwd, device, 1, max(3, opts["window"] // 2)) * 1e3
                row["graphs_speedup"] = row["eager_step_ms"] / row["step_ms"]
            if (B, ctx) in profiled:
                replay = functools.partial(_repeat, functools.partial(graphs.run, batch), PROFILE_STEPS)
                row["profile"] = _profile(replay, PROFILE_STEPS, profile_dir, f"decode_b{B}_ctx{ctx}", device)
                if B == min(batches):
                    fwd = functools.partial(eager_step, model, ids, pos, meta, drv.caches)
                    row["profile_eager"] = _profile(functools.partial(_repeat, fwd, PROFILE_STEPS), PROFILE_STEPS,
                                                    profile_dir, f"decode_b{B}_ctx{ctx}_eager", device)
            rows.append(row)
            print(f"decode   batch={B:>4} ctx={ctx:>6}  {row['step_ms']:8.3f} ms/step  {row['tok_s']:9.0f} tok/s  "
                  f"roofline {row['roofline_ms']:7.3f} ms  {100 * row['fraction']:5.1f}% "
                  f"({100 * row['fraction_with_indexer']:5.1f}% with indexer keys)"
                  + (f"  eager {row['eager_step_ms']:.3f} ms (graphs x{row['graphs_speedup']:.2f})"
                     if "eager_step_ms" in row else ""), flush=True)
        del graphs, drv
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return sorted(rows, key=lambda r: (r["context"], r["batch"]))


def _repeat(fn, n: int) -> None:
    for _ in range(n):
        fn()


def _profile(fn, steps: int, out_dir: Path, name: str, device) -> dict:
    from profiling import profile_region

    return profile_region(fn, steps, out_dir, name, device)


def prefill_point(model, opts: dict, ceil: dict, dtype, device, profile_dir: Path | None = None) -> dict:
    n = opts["prefill_len"]
    drv = Driver(model, 1, 0, n, opts["block_size"], dtype, device)
    pos, meta = drv.meta([0], [list(range(n))], prefill=True)
    ids = torch.randint(2, model.cfg.vocab_size, (n,), device=device)

    def run():
        return model.logits(model(ids, pos, meta, drv.caches)[-1:])

    s = _time(run, device, 1, 2)
    fl = prefill_flops(model, n)
    row = {"prompt_len": n, "seconds": s, "tok_s": n / s, "flops": fl, "achieved_TFLOPs": fl["total"] / s / 1e12,
           "fraction": fl["total"] / s / 1e12 / ceil["matmul_TFLOPs"]}
    print(f"prefill  len={n:>6}  {s * 1e3:9.1f} ms  {row['tok_s']:9.0f} tok/s  {row['achieved_TFLOPs']:.1f} TFLOP/s  "
          f"{100 * row['fraction']:5.1f}% of the matmul peak", flush=True)
    if profile_dir is not None:
        row["profile"] = _profile(run, 1, profile_dir, f"prefill_{n}", device)
    return row


def baseline(model, opts: dict, dtype, device, fast_rows: list[dict]) -> dict:
    """transformers' DeepSeek-V4 if installed (>= 5.23), else the reference-op path on the same weights."""
    import transformers

    out: dict = {"transformers_version": transformers.__version__}
    if hasattr(transformers, "DeepseekV4ForCausalLM"):
        out["note"] = ("transformers has DeepSeek-V4, but no twin sharing the engine's weights is built for it "
                       "yet (hf_twin.py covers V2/V3): the reference-op path is compared instead")
    else:
        out["note"] = (f"transformers {transformers.__version__} has no DeepSeek-V4 (added in 5.23): compared "
                       "against the reference-op path (kernels_cpu ops on this device, eager)")
    ctx = int(opts["contexts"].split(",")[0])
    fast = {(r["batch"], r["context"]): r["step_ms"] for r in fast_rows}
    kernels = model.k
    set_kernels(model, Kernels(ReferenceKernels, ReferenceKernels))
    rows = []
    try:
        for B in (int(b) for b in opts["baseline_batches"].split(",")):
            drv = Driver(model, B, ctx, ctx + DECODE_STEPS_MAX, opts["block_size"], dtype, device)
            pos, meta = drv.meta(list(range(B)), [[ctx] for _ in range(B)], prefill=False)
            ids = torch.randint(2, model.cfg.vocab_size, (B,), device=device)
            ms = _time(functools.partial(eager_step, model, ids, pos, meta, drv.caches), device, 1, 3) * 1e3
            r = {"batch": B, "context": ctx, "reference_step_ms": ms}
            if (B, ctx) in fast:
                r["speedup"] = ms / fast[(B, ctx)]
            rows.append(r)
            print(f"reference ops batch={B:>4} ctx={ctx}: {ms:.2f} ms/step"
                  + (f"  (TileLang + graphs x{r['speedup']:.1f} faster)" if "speedup" in r else ""), flush=True)
            del drv
    finally:
        set_kernels(model, kernels)
    out["rows"] = rows
    return out


def build_model(cfg_dict: dict, dtype: torch.dtype, device: torch.device, max_positions: int, seed: int):
    from deepinfer_core.models.config_v4 import V4Config

    cfg = V4Config.from_dict(cfg_dict)
    if device.type == "cuda":
        from kernels_cuda import CudaKernels

        k = Kernels(CudaKernels, ReferenceKernels)
    else:
        k = Kernels(ReferenceKernels, ReferenceKernels)
    model = DeepseekV4ForCausalLM.create(k, cfg, dtype, device, max_positions)
    random_init(model, seed=seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    for layer in model.layers:  # hash layers: k distinct experts per token id (random_init leaves them 0)
        if layer.ffn.is_hash:
            E, k_ = cfg.n_routed_experts, cfg.num_experts_per_tok
            for lo in range(0, cfg.vocab_size, 8192):
                hi = min(cfg.vocab_size, lo + 8192)
                layer.ffn.tid2eid[lo:hi] = torch.rand(hi - lo, E, generator=g, device=device).argsort(-1)[:, :k_]
    return model.eval()


def run(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["h200"], default="h200")
    ap.add_argument("--shape", choices=[SHAPE], default=SHAPE)
    ap.add_argument("--scale", default="full", choices=["full", "tiny"])
    ap.add_argument("--accelerator", default=None, help="cpu | nvidia (default: nvidia when CUDA is there)")
    ap.add_argument("--out", default=None, help="results.json (+ with PROFILE=1: traces and kernel tables)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the baseline comparison")
    ap.add_argument("--seed", type=int, default=0)
    for key, val in FULL_OPTS.items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(val), default=None, help=f"full scale: {val}")
    args = ap.parse_args(argv)
    opts = {k: (getattr(args, k) if getattr(args, k) is not None else d)
            for k, d in (FULL_OPTS if args.scale == "full" else TINY_OPTS).items()}
    use_cuda = args.accelerator != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = getattr(torch, opts["dtype"])
    t_all = time.perf_counter()
    cfg_dict = suite_config(args.scale)
    max_pos = max(int(c) for c in opts["contexts"].split(",")) + DECODE_STEPS_MAX + opts["block_size"]
    max_pos = max(max_pos, opts["prefill_len"] + opts["block_size"])
    torch.manual_seed(args.seed)
    model = build_model(cfg_dict, dtype, device, max_pos, args.seed)
    sys_path_examples()
    from gpu_timing import measure_ceilings

    res: dict = {"shape": SHAPE, "scale": args.scale, "model_config": cfg_dict, "options": opts,
                 "device": str(device), "device_name": torch.cuda.get_device_name(device) if use_cuda else "cpu",
                 "torch": torch.__version__, "parameters": sum(p.numel() for p in model.parameters()),
                 "weights_GB": sum(_numel(p) for p in model.parameters()) / 1e9,
                 "kernels": "kernels_cuda (TileLang) + reference" if use_cuda else "reference (CPU)"}
    print(f"{SHAPE} ({args.scale}): {res['parameters'] / 1e9:.2f}B parameters ({res['weights_GB']:.1f} GB), "
          f"{opts['dtype']} on {res['device_name']}", flush=True)
    res["ceilings"] = ceil = measure_ceilings(str(device))
    print(f"ceilings: read {ceil['read_GBps']:.0f} GB/s, bf16 matmul {ceil['matmul_TFLOPs']:.1f} TFLOP/s", flush=True)
    out_dir = Path(args.out) if args.out else None
    if os.environ.get("PROFILE", "") not in ("", "0"):
        if out_dir is None:
            raise SystemExit("PROFILE=1 needs --out DIR for the traces")
        res["profile_dir"] = str(out_dir)

    def save():
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "results.json").write_text(json.dumps(res, indent=1, default=str))

    phases = res["phases_s"] = {}
    with torch.inference_mode():
        _measure(model, res, opts, ceil, dtype, device, use_cuda, args.no_transformers, save)
    phases["total"] = time.perf_counter() - t_all
    save()
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    return res


def _measure(model, res: dict, opts: dict, ceil: dict, dtype, device, use_cuda: bool, no_baseline: bool,
             save) -> None:
    phases = res["phases_s"]
    t = time.perf_counter()
    prof = Path(res["profile_dir"]) if "profile_dir" in res else None
    res["prefill"] = [prefill_point(model, opts, ceil, dtype, device, prof)]
    phases["prefill"] = time.perf_counter() - t
    save()
    platform = None
    if use_cuda:
        from hardware.nvidia import NvidiaPlatform

        platform = NvidiaPlatform()
    t = time.perf_counter()
    res["decode"] = decode_points(model, platform, opts, ceil, dtype, device, graphs_on=use_cuda, profile_dir=prof)
    phases["decode"] = time.perf_counter() - t
    save()
    if not no_baseline:
        t = time.perf_counter()
        res["baseline"] = baseline(model, opts, dtype, device, res["decode"])
        phases["baseline"] = time.perf_counter() - t


def sys_path_examples() -> None:
    import sys

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)


if __name__ == "__main__":
    run()
