"""The full-model GPU benchmark (``benchmark.py --suite h200``): one run measures the device's ceilings,
prefill and steady-state decode of a random-weight DeepSeek shape, each as a fraction of its roofline
(``roofline.py``), decode with and without CUDA graphs, and transformers' ``generate`` on the same GPU
with the same weight tensors (``hf_twin.py``).

    python examples/benchmark.py --suite h200 --shape v2-lite --out DIR          # on the H200
    python examples/benchmark.py --suite h200 --shape v3-slice --out DIR
    python examples/benchmark.py --suite h200 --shape v2-lite --scale tiny --out DIR   # CPU, seconds
    python examples/benchmark.py --suite h200 --shape v4-flash-slice --out DIR   # DeepSeek-V4 (v4_suite.py)
    PROFILE=1 python examples/benchmark.py --suite h200 ...   # + torch.profiler traces and kernel tables

Shapes (``random_checkpoint.SHAPES``): ``v2-lite`` is DeepSeek-V2-Lite (27 layers, 15.7B parameters,
31.4 GB in bf16). ``v3-slice`` is DeepSeek-V3's widths (hidden 7168, 128 heads, 256 experts top-8,
vocab 129280) with 4 layers: 1 dense + 3 MoE, 75 GB in bf16. A 4th MoE layer (98 GB) would leave too
little of the H200's 139 GiB for transformers' KV cache and prefill activations next to the engine's
KV cache for 256 x 2k tokens. ``--scale tiny`` keeps the architecture and shrinks every width (CPU CI).

Only config.json (and a tokenizer) is written; the engine builds its weights with ``load_format="random"``.
Decode at batch B: all B requests are prefilled first (batches are measured largest first: surplus
requests are aborted between points), then ``--warmup`` steps, then ``--window`` timed steps with no
prefill in them. Distinct routed experts per step come from the router (a route hook, active on eager
steps after the window); under CUDA-graph replay the hook does not run and the uniform-routing
expectation is used instead; the JSON says which (``experts_source``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import measure_ceilings  # noqa: E402
from random_checkpoint import SHAPES, shape_config, write_config  # noqa: E402
from roofline import decode_roofline, expected_distinct_experts, prefill_roofline  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.config import EngineConfig  # noqa: E402
from deepinfer_core.models.config import ModelConfig  # noqa: E402

#: --scale tiny: every width shrunk, the architecture (q_lora or not, gate kind, groups) kept.
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512,
            max_position_embeddings=1024)
FULL = dict(decode_batches="1,8,32,64,128,256", context=2048, prefill_lens="1024,8192", hf_batches="1,8,64",
            warmup=5, window=20, block_size=64, max_batched=8192, hf_new_tokens=10, dtype="bfloat16",
            hf_compiled_batches="64", hf_compile_backend="inductor")
SMALL = dict(decode_batches="1,4,8", context=48, prefill_lens="32,128", hf_batches="1,4", warmup=1, window=3,
             block_size=16, max_batched=256, hf_new_tokens=5, dtype="float32",
             hf_compiled_batches="4", hf_compile_backend="eager")
TARGETS = {"decode_b1": 0.60, "decode_b64_256": 0.50, "prefill_8k": 0.40, "speedup_b64": 20.0}
PROFILE_STEPS = 5


def suite_config(shape: str, scale: str, layers: int | None) -> dict:
    cfg = shape_config(shape)
    if scale == "tiny":
        cfg.update(TINY)
        cfg["q_lora_rank"] = None if cfg["q_lora_rank"] is None else 48
        if cfg["n_group"] > 1:
            cfg.update(n_group=4, topk_group=2)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


class ExpertCounter:
    """Distinct routed experts per MoE layer per step, from the router (a route hook that is a no-op
    unless counting; installed before any step so CUDA graphs, if any, are captured without it)."""

    def __init__(self, runner) -> None:
        self.moes = list(runner.model.moe_layers().values())
        self.pos = {m.layer_idx: i for i, m in enumerate(self.moes)}
        self.seen: torch.Tensor | None = None
        self.step = -1
        if runner.route_hook is not None:
            raise RuntimeError("the MoE layers already have a route hook (a feature is enabled): "
                               "the benchmark runs without features")
        if self.moes:
            runner.set_route_hook(self._hook)

    def _hook(self, layer_idx: int, weights: torch.Tensor, ids: torch.Tensor):
        if self.seen is not None:
            self.seen[self.pos[layer_idx], self.step].index_fill_(0, ids.flatten(), True)
        return weights, ids

    def count(self, engine, steps: int) -> list[float] | None:
        """Run ``steps`` engine steps counting; per-layer mean distinct experts, or None if the hook never ran."""
        if not self.moes:
            return None
        E = self.moes[0].cfg.n_routed_experts
        seen = torch.zeros(len(self.moes), steps, E, dtype=torch.bool, device=self.moes[0].w13.device)
        self.seen = seen
        try:
            for s in range(steps):
                self.step = s
                engine.step()
        finally:
            self.seen = None
        per = seen.sum(-1).float()  # [layers, steps]
        ran = per.sum(0) > 0  # steps whose forward ran the hook (not a graph replay, not still in flight)
        return per[:, ran].mean(1).tolist() if bool(ran.any()) else None


def graphs_in_use(llm: LLM) -> bool:
    """Decode steps replay CUDA graphs in this engine (feature-detected: ``runner.graphs``)."""
    return getattr(llm.engine.runner, "graphs", None) is not None


def kv_bytes_per_token(engine) -> float:
    """Cached bytes per token over all layers, from the model's declared cache groups (FP8 rows included)."""
    return sum(g.bytes_per_token(engine.dtype) for g in engine.cache_layout.groups)


def fp8_weights(engine) -> bool:
    """Whether the engine holds e4m3 GEMM weights (the FP8 roofline applies)."""
    return any(t.dtype == torch.float8_e4m3fn for t in engine.model.parameters())


def _prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def _sync(llm: LLM) -> None:
    llm.engine.platform.synchronize()


def measure_prefill(llm: LLM, mc: ModelConfig, n: int, budget: int, ceil: dict, rng: random.Random,
                    reps: int = 2) -> dict:
    """Prefill tok/s of ``budget // n`` prompts of ``n`` tokens (one token sampled each), best of ``reps``."""
    num = max(1, budget // n)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(1, n, mc.vocab_size, rng)], sp, use_tqdm=False)
    best = math.inf
    for _ in range(reps):
        prompts = [{"prompt_token_ids": p} for p in _prompts(num, n, mc.vocab_size, rng)]
        _sync(llm)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        _sync(llm)
        best = min(best, time.perf_counter() - t)
    tok_s = num * n / best
    roof = prefill_roofline(mc, n, num, tok_s, ceil["matmul_TFLOPs"])
    return {"prompt_len": n, "requests": num, "seconds": best, "tok_s": tok_s, **roof}


def _idle(engine) -> dict:
    """The engine's cumulative device idle/busy metrics, where this build measures them."""
    m = engine.metrics()
    return m if "device_idle_ms" in m and "device_busy_ms" in m else {}


def decode_sweep(llm: LLM, mc: ModelConfig, batches: list[int], context: int, warmup: int, window: int,
                 ceil: dict, counter: ExpertCounter, rng: random.Random, count_steps: int = 2,
                 profile_batches: tuple[int, ...] = (), out_dir: Path | None = None) -> list[dict]:
    """Steady-state decode at each batch (largest first): prefill them all, then per point abort the
    surplus, ``warmup`` steps, ``window`` timed steps, and ``count_steps`` expert-counting steps."""
    engine = llm.engine
    batches = sorted(set(batches), reverse=True)
    per_point = warmup + window + count_steps + (PROFILE_STEPS if profile_batches else 0)
    prefill_steps = math.ceil(batches[0] * context / engine.cfg.max_num_batched_tokens) + 1
    sp = SamplingParams(temperature=0, max_tokens=prefill_steps + len(batches) * per_point + 4, ignore_eos=True)
    seqs = [engine.add_request({"prompt_token_ids": p}, sp) for p in _prompts(batches[0], context, mc.vocab_size, rng)]
    t = time.perf_counter()
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    setup_s = time.perf_counter() - t
    rows = []
    for B in batches:
        for s in seqs[B:]:
            engine.abort(s.request_id)
        seqs = seqs[:B]
        for _ in range(warmup):
            engine.step()
        ctx0 = sum(s.num_tokens for s in seqs) / B
        idle0 = _idle(engine)
        s0 = (engine.stats.step_time, engine.stats.forward_time)
        _sync(llm)
        t = time.perf_counter()
        for _ in range(window):
            engine.step()
        _sync(llm)
        dt = time.perf_counter() - t
        idle1 = _idle(engine)
        step_t, fwd_t = engine.stats.step_time - s0[0], engine.stats.forward_time - s0[1]
        if any(s.is_finished for s in seqs):
            raise RuntimeError(f"decode batch {B}: a request finished inside the window (max_tokens too small)")
        mean_ctx = ctx0 + (window - 1) / 2  # cached tokens each step reads, averaged over the window
        hits = counter.count(engine, count_steps)
        source = "router"
        if hits is None:
            E, k = mc.n_routed_experts or 0, mc.num_experts_per_tok
            hits, source = (expected_distinct_experts(E, k, B) if E else 0.0), "uniform-routing expectation"
        tok_s = B * window / dt
        row = {"batch": B, "context": mean_ctx, "steps_s": window / dt, "step_ms": dt / window * 1e3,
               "tok_s": tok_s, "per_user_tok_s": window / dt,
               "overhead_share": 0.0 if step_t == 0 else 1 - fwd_t / step_t,
               "experts_hit": hits if isinstance(hits, float) else sum(hits) / max(1, len(hits)),
               "experts_source": source,
               **decode_roofline(mc, B, mean_ctx, tok_s, ceil["read_GBps"], hits, wbytes=engine.dtype.itemsize,
                                 kv_bytes_per_token=kv_bytes_per_token(engine), fp8_matrices=fp8_weights(engine))}
        if idle0 and idle1:  # the window's own device idle time between steps (measure_device_idle)
            d_idle = idle1["device_idle_ms"] - idle0["device_idle_ms"]
            d_busy = idle1["device_busy_ms"] - idle0["device_busy_ms"]
            gaps = idle1["device_idle_gaps"] - idle0["device_idle_gaps"]
            row["idle"] = {"device_idle_share": d_idle / (d_idle + d_busy) if d_idle + d_busy else 0.0,
                           "device_idle_us_mean": 1e3 * d_idle / gaps if gaps else 0.0, "gaps": gaps}
        if B in profile_batches and out_dir is not None:
            from profiling import profile_region

            row["profile"] = profile_region(lambda: [engine.step() for _ in range(PROFILE_STEPS)], PROFILE_STEPS,
                                            out_dir, f"decode_b{B}", engine.device, layers=mc.num_hidden_layers)
        rows.append(row)
        print(f"decode   batch={B:>4} ctx={mean_ctx:>7.0f}  {row['step_ms']:>8.2f} ms/step  {tok_s:>10.0f} tok/s  "
              f"roofline {row['roofline_tok_s']:>10.0f}  {row['fraction'] * 100:5.1f}%  "
              f"experts {row['experts_hit']:.1f} ({source})", flush=True)
    for s in seqs:
        engine.abort(s.request_id)
    while engine.has_unfinished():
        engine.step()
    engine.step()  # drops the aborted requests
    rows[0]["setup_prefill_s"] = setup_s
    return sorted(rows, key=lambda r: r["batch"])


def build_llm(model_dir: Path, opts: dict, batches: list[int], prefill_lens: list[int], accelerator: str | None,
              seed: int, **extra) -> LLM:
    """An engine with random weights and a KV cache sized for the largest decode batch and prefill."""
    mc = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    bs, ctx, Bmax = opts["block_size"], opts["context"], max(batches)
    per_point = opts["warmup"] + opts["window"] + 2 + PROFILE_STEPS
    max_new = math.ceil(Bmax * ctx / opts["max_batched"]) + 1 + len(batches) * per_point + 4
    max_len = max(max(prefill_lens) + 8, ctx + max_new + 8)
    blocks = max(Bmax * math.ceil((ctx + max_new) / bs), 2 * math.ceil(max_len / bs)) + 8
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[opts["dtype"]]
    per_block = mc.num_hidden_layers * bs * mc.kv_entry_dim * itemsize
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if "measure_device_idle" in fields:
        extra.setdefault("measure_device_idle", True)  # the device-idle metric, where this build has it
    if "graph_batch_sizes" in fields and not extra.get("enforce_eager"):
        extra.setdefault("graph_batch_sizes", sorted(set(batches)))  # capture only the measured batches
    return LLM(str(model_dir), dtype=opts["dtype"], accelerator=accelerator, load_format="random", seed=seed,
               max_num_seqs=max(Bmax, 16), max_num_batched_tokens=max(opts["max_batched"], max(prefill_lens)),
               max_model_len=max_len, block_size=bs, kv_cache_memory=blocks * per_block,
               enable_prefix_caching=False, **extra)


def compare_transformers(llm: LLM, model_dir: Path, mc: ModelConfig, batches: list[int], context: int,
                         new_tokens: int, decode: list[dict], rng: random.Random,
                         compiled_batches: tuple[int, ...] = (), compile_backend: str = "inductor") -> list[dict]:
    """transformers' ``generate`` on the engine's own weight tensors, at each batch of ``context``-token prompts:
    eager (dynamic cache), and at ``compiled_batches`` also the stronger baseline (static cache, decode forward
    under ``torch.compile``; rows with ``compiled: true``). The engine's greedy tokens for two prompts are
    compared with transformers' (printed, not asserted)."""
    from hf_twin import hf_generate_timed, hf_twin

    device = llm.engine.device
    hf = hf_twin(llm.engine.model, model_dir, device)
    ours = {r["batch"]: r["tok_s"] for r in decode}
    rows = []
    for B in batches:
        prompts = _prompts(B, context, mc.vocab_size, rng)
        for backend in (None, compile_backend) if B in compiled_batches else (None,):
            kind = f"compiled ({backend})" if backend else "eager"
            try:
                res = hf_generate_timed(hf, torch.tensor(prompts, device=device), new_tokens,
                                        compile_backend=backend)
            except torch.OutOfMemoryError as exc:  # a large batch may not fit next to the engine: say so, go on
                rows.append({"batch": B, "compiled": backend is not None,
                             "error": f"out of memory: {str(exc).splitlines()[0]}"})
                print(f"transformers {kind} batch={B:>3}: {rows[-1]['error']}", flush=True)
                torch.cuda.empty_cache()
                continue
            except Exception as exc:  # torch.compile of transformers' forward failed: the eager rows still stand
                if backend is None:
                    raise
                rows.append({"batch": B, "compiled": True, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
                print(f"transformers {kind} batch={B:>3}: {rows[-1]['error']}", flush=True)
                continue
            res["compiled"] = backend is not None
            hf_tokens = res.pop("tokens")
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                                SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
            agree = []
            for o, h in zip(outs, hf_tokens):
                e = o.outputs[0].token_ids
                agree.append(next((i for i, (a, b) in enumerate(zip(e, h)) if a != b), min(len(e), len(h))))
            res["greedy_agree_prefix"] = agree
            if B in ours:
                res["engine_tok_s"] = ours[B]
                res["speedup"] = ours[B] / res["decode_tok_s"]
            rows.append(res)
            sp = f"  engine x{res['speedup']:.1f}" if "speedup" in res else ""
            comp = f", compiled in {res['compile_s']:.1f} s" if backend else ""
            print(f"transformers {kind} batch={B:>3} (experts: {res['experts_implementation']}): prefill "
                  f"{res['prefill_s']:.2f} s{comp}, decode {res['decode_tok_s']:.1f} tok/s "
                  f"({res['decode_step_ms']:.1f} ms/step){sp}; greedy tokens equal for the first {agree} of "
                  f"{new_tokens} (engine vs transformers, 2 prompts)", flush=True)
            del hf_tokens
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    del hf
    if compiled_batches:
        torch._dynamo.reset()  # drop the compiled graphs (and their CUDA graph pools) with the twin
    return rows


def speedups_at(res: dict, batch: int) -> dict:
    """The engine's decode speedup over transformers at ``batch``: eager, compiled, and the one that counts
    (over the stronger, i.e. faster, baseline: the smaller ratio)."""
    out = {}
    for r in res.get("transformers", []):
        if r["batch"] == batch and "speedup" in r:
            out["compiled" if r.get("compiled") else "eager"] = r["speedup"]
    out["counted"] = min(out.values()) if out else None
    return out


def check_targets(res: dict) -> dict:
    """Each target of the issue: the measured value and whether it is met (None: not measured)."""
    dec = {r["batch"]: r["fraction"] for r in res.get("decode", [])}
    pre = {r["prompt_len"]: r["fraction"] for r in res.get("prefill", [])}
    big = [dec[b] for b in (64, 128, 256) if b in dec]
    out = {
        "decode_b1_fraction": (dec.get(1), TARGETS["decode_b1"]),
        "decode_b64_256_min_fraction": (min(big) if big else None, TARGETS["decode_b64_256"]),
        "prefill_8k_fraction": (pre.get(8192), TARGETS["prefill_8k"]),
        "speedup_vs_transformers_b64": (speedups_at(res, 64)["counted"], TARGETS["speedup_b64"]),
    }
    return {k: {"value": v, "target": t, "met": None if v is None else v >= t} for k, (v, t) in out.items()}


def save(res: dict, out_dir: Path | None) -> None:
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(res, indent=1))


def run(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("v4-flash-slice", "--shape=v4-flash-slice") for a in argv):  # DeepSeek-V4: its own driver
        from v4_suite import run as run_v4

        return run_v4(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["h200"], default="h200")
    ap.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES))
    ap.add_argument("--scale", default="full", choices=["full", "tiny"])
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--accelerator", default=None)
    ap.add_argument("--out", default=None, help="output dir: results.json (+ PROFILE=1 traces)")
    for key, val in FULL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(val), default=None, help=f"full scale: {val}")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="skip the enforce_eager decode points")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-decode-fusion", action="store_true",
                    help="the engine's unfused decode ops (config decode_fusion = false), for a before/after")
    ap.add_argument("--weight-dtype", default=None, choices=["bf16", "fp8"],
                    help="fp8: the random weights quantised per 128x128 tile, run by the fp8_* ops (the decode "
                         "roofline counts their e4m3 bytes and tile scales)")
    args = ap.parse_args(argv)
    opts = {k: (getattr(args, k) if getattr(args, k) is not None else d)
            for k, d in (FULL if args.scale == "full" else SMALL).items()}
    batches = [int(b) for b in opts["decode_batches"].split(",")]
    prefill_lens = [int(n) for n in opts["prefill_lens"].split(",")]
    out_dir = Path(args.out) if args.out else None
    profile = os.environ.get("PROFILE", "") not in ("", "0")
    if profile and out_dir is None:
        raise SystemExit("PROFILE=1 needs --out DIR for the traces")
    rng = random.Random(args.seed)
    t_all = time.perf_counter()
    phases: dict[str, float] = {}
    cfg = suite_config(args.shape, args.scale, args.layers)
    mc = ModelConfig.from_dict(cfg)
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_config(Path(tmp.name) / args.shape, cfg)

    t = time.perf_counter()
    wd = {"weight_dtype": args.weight_dtype} if args.weight_dtype else {}
    if args.no_decode_fusion:
        wd["decode_fusion"] = False
    llm = build_llm(model_dir, opts, batches, prefill_lens, args.accelerator, args.seed, **wd)
    phases["build"] = time.perf_counter() - t
    device = llm.engine.device
    res: dict = {"shape": args.shape, "scale": args.scale, "model_config": cfg, "device": str(device),
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "options": opts, "parameters": sum(
                     p.numel() for p in llm.engine.model.parameters()), "profile": profile,
                 "weight_dtype": args.weight_dtype or "bf16", "decode_fusion": not args.no_decode_fusion,
                 "weight_bytes": sum(
                     t.numel() * t.element_size() for t in (*llm.engine.model.parameters(),
                                                            *llm.engine.model.buffers()))}
    print(f"{args.shape} ({args.scale}): {res['parameters'] / 1e9:.2f}B parameters, {opts['dtype']} on "
          f"{res['device_name']}, engine built in {phases['build']:.1f} s", flush=True)
    t = time.perf_counter()
    res["ceilings"] = ceil = measure_ceilings(str(device))
    phases["ceilings"] = time.perf_counter() - t
    print(f"ceilings: read {ceil['read_GBps']:.0f} GB/s, copy {ceil['copy_GBps']:.0f} GB/s (r+w), "
          f"bf16 matmul {ceil['matmul_TFLOPs']:.1f} TFLOP/s", flush=True)
    counter = ExpertCounter(llm.engine.runner)
    graphs = graphs_in_use(llm)
    res["cuda_graphs"] = graphs or getattr(llm.engine.runner, "graphs_off_reason", "no graph runner in this build")

    t = time.perf_counter()
    res["prefill"] = []
    for n in prefill_lens:
        row = measure_prefill(llm, mc, n, max(opts["max_batched"], n) * 2, ceil, rng)
        res["prefill"].append(row)
        print(f"prefill  len={n:>5} x{row['requests']:>3}  {row['tok_s']:>10.0f} tok/s  "
              f"{row['achieved_TFLOPs']:.1f} TFLOP/s  {row['fraction'] * 100:5.1f}% of the matmul peak", flush=True)
    if profile:
        from profiling import profile_region

        n = max(prefill_lens)
        p = [{"prompt_token_ids": x} for x in _prompts(1, n, mc.vocab_size, rng)]
        res["prefill_profile"] = profile_region(
            lambda: llm.generate(p, SamplingParams(max_tokens=1), use_tqdm=False), 1, out_dir, f"prefill_{n}",
            device)
    phases["prefill"] = time.perf_counter() - t

    t = time.perf_counter()
    prof_b = tuple(b for b in (1, 64) if b in batches) or (batches[len(batches) // 2],) if profile else ()
    res["decode"] = decode_sweep(llm, mc, batches, opts["context"], opts["warmup"], opts["window"], ceil, counter,
                                 rng, profile_batches=prof_b, out_dir=out_dir)
    phases["decode"] = time.perf_counter() - t
    save(res, out_dir)

    eager_points = [b for b in (1, 64) if b in batches] or batches[:1]
    if graphs and not args.no_eager:
        t = time.perf_counter()
        model_ref = weakref.ref(llm.engine.model)
        llm.shutdown()
        del llm, counter
        gc.collect()
        if model_ref() is not None:  # a second engine next to the first would double the weights in memory
            raise RuntimeError("the graph engine's model is still referenced after shutdown; not building another")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            res["gpu_memory_allocated_after_free_GB"] = torch.cuda.memory_allocated() / 1e9
        llm = build_llm(model_dir, opts, eager_points, prefill_lens, args.accelerator, args.seed,
                        enforce_eager=True)
        counter = ExpertCounter(llm.engine.runner)
        res["decode_eager"] = decode_sweep(llm, mc, eager_points, opts["context"], opts["warmup"], opts["window"],
                                           ceil, counter, rng)
        graph_rows = {r["batch"]: r["tok_s"] for r in res["decode"]}
        for r in res["decode_eager"]:
            r["graphs_speedup"] = graph_rows[r["batch"]] / r["tok_s"]
            print(f"eager    batch={r['batch']:>4}: CUDA graphs are x{r['graphs_speedup']:.2f} faster", flush=True)
        phases["decode_eager"] = time.perf_counter() - t
        save(res, out_dir)
    else:
        res["decode_eager"] = ("the decode rows above are eager" if not graphs
                               else "skipped (--no-eager)")

    failure = None
    if not args.no_transformers:
        t = time.perf_counter()
        hf_b = [int(b) for b in opts["hf_batches"].split(",")]
        import transformers

        res["transformers_version"] = transformers.__version__
        save(res, out_dir)  # the engine's figures survive a failure of the comparison
        try:
            hf_c = tuple(int(b) for b in opts["hf_compiled_batches"].split(",") if b)
            res["transformers"] = compare_transformers(llm, model_dir, mc, hf_b, opts["context"],
                                                       opts["hf_new_tokens"], res["decode"], rng, hf_c,
                                                       opts["hf_compile_backend"])
            res["speedups_vs_transformers"] = {b: speedups_at(res, b) for b in hf_b}
        except Exception as exc:  # recorded in the JSON and re-raised after it is written
            res["transformers_error"] = f"{type(exc).__name__}: {exc}"
            failure = exc
        phases["transformers"] = time.perf_counter() - t
    llm.shutdown()
    res["targets"] = check_targets(res)
    phases["total"] = time.perf_counter() - t_all
    res["phases_s"] = phases
    for k, v in res["targets"].items():
        val = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        print(f"target {k}: {val} (>= {v['target']}) {'' if v['met'] is None else ('MET' if v['met'] else 'MISSED')}")
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    save(res, out_dir)
    if failure is not None:
        raise failure
    tmp.cleanup()
    return res


if __name__ == "__main__":
    run()
