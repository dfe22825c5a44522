"""TTFT of a DeepSeek-V4 prefix hit whose window KV is gone, per ``swa_prefix_policy``, and the host bytes
of window KV snapshots (MXFP8 against bf16).

For each context length L: a first request computes L tokens of Python source (the compressed blocks
enter the prefix cache), the window pools' cached blocks are then evicted (what concurrent traffic
does), and a second request (the same L tokens plus ``--suffix`` new ones) is timed to its first token
under ``retain`` with the window KV left cached (the hit without any replay: the baseline),
``bounded_replay`` (recompute one window: constant cost), ``recompute`` (layers x (window - 1) tokens:
exact) and with no prefix cache. Median of ``--repeats`` second requests, each with its own suffix (the
window KV evicted again before each). The replay's own cost is the difference to ``retain``: the
suffix's tokens read every compressed entry of the context (the CSA indexer), so all rows grow with L.

The embedded tiny V4 was trained at 1024 positions; longer contexts run its weights with
``max_position_embeddings`` raised (a copy of its config; rope needs no new weights), which is fine
for timing. Run: ``python examples/v4_prefix_bench.py`` (``--contexts 1000 4000 16000``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.tokenizer import HFTokenizer
from deepinfer_core.engine.window_cache import snapshot_parts
from deepinfer_core.models.loader import resolve_model_dir

SOURCES = ("argparse", "difflib", "configparser", "ipaddress", "fractions", "textwrap", "shlex", "json.decoder",
           "inspect", "typing", "dataclasses", "enum", "functools", "pathlib", "tarfile", "zipfile")


def long_model(max_positions: int) -> Path:
    """A copy of the tiny V4's directory (weights linked) with more positions."""
    src = resolve_model_dir("tiny-v4")
    dst = Path(tempfile.mkdtemp(prefix="tiny_v4_long_"))
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = max_positions
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def code_tokens(model_dir: Path, n: int) -> list[int]:
    tok = HFTokenizer.load(model_dir, 0, [1])
    ids: list[int] = []
    for name in SOURCES:
        ids += tok.encode(inspect.getsource(__import__(name, fromlist=["_"])))
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError(f"only {len(ids)} tokens of source")


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, float, dict]:
    """(TTFT seconds, this process's CPU seconds for the request, the hit's window_prefix metrics)."""
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cpu = time.process_time()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return out.metrics.time_to_first_token, time.process_time() - cpu, out.metrics.extra.get("window_prefix", {})


def forget_window_kv(llm: LLM) -> None:
    for pool in llm.engine.blocks.window_pools:
        for h in list(pool.block_of):
            pool.forget(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--suffix", type=int, default=200, help="new tokens after the cached context")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=["retain", "bounded_replay", "recompute", "no cache"],
                    help="'retain' keeps the window KV cached: the hit's cost without any replay")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    need = max(args.contexts) + args.suffix + 8
    model = long_model(max(1024, need))
    tokens = code_tokens(model, need + args.suffix * args.repeats)
    opts = dict(model=str(model), dtype="float32", max_num_seqs=2, kv_cache_memory=256 << 20)
    print(f"tiny V4 (4 layers, window 64, block 32), float32, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}; "
          f"second request = context + {args.suffix} new tokens; TTFT median of {args.repeats}")
    print(f"{'context':>8} {'policy':>15} {'TTFT ms':>9} {'CPU s':>7} {'computed':>9} {'replay':>7} {'hit':>6}")
    for L in args.contexts:
        first = tokens[:L]
        # a new suffix per repeat: no repeat hits an earlier repeat's blocks
        seconds = [tokens[:L] + tokens[need + r * args.suffix: need + (r + 1) * args.suffix]
                   for r in range(args.repeats)]
        for policy in args.policies:
            llm = LLM(**opts, **({"enable_prefix_caching": False} if policy == "no cache" else
                                 {"swa_prefix_policy": policy}))
            ttft(llm, first)
            times, cpus, info = [], [], {}
            for second in seconds:
                if policy != "retain":
                    forget_window_kv(llm)
                t, cpu, info = ttft(llm, second)
                times.append(t)
                cpus.append(cpu)
            hit = info.get("compressed_hit_tokens", 0)
            computed = L + args.suffix - hit + info.get("replay_tokens", 0)
            print(f"{L:>8} {policy:>15} {statistics.median(times) * 1e3:>9.1f} {statistics.median(cpus):>7.2f} "
                  f"{computed:>9} "
                  f"{info.get('replay_tokens', 0):>7} {hit:>6}", flush=True)
            llm.engine.blocks.check_no_leaks()
            llm.shutdown()

    print("\nhost bytes of one window snapshot (the window state a hit at a unit boundary needs):")
    llm = LLM(model="tiny-v4", dtype="float32", window_snapshots=True, kv_cache_memory=64 << 20)
    wc = llm.engine.window_cache
    for name, layout, bs, dtype in (("tiny V4", llm.engine.cache_layout, llm.engine.block_size, torch.bfloat16),
                                    ("V4-Flash", flash_layout(), 128, torch.bfloat16)):
        parts = snapshot_parts(layout, bs, dtype)
        mx = sum(len(g.layers) * rows * width for g, rows, width, _ in parts)
        bf = sum(len(g.layers) * rows * g.entry_dim * 2 for g, rows, _, _ in parts)
        swa = next((len(g.layers), rows, width) for g, rows, width, _ in parts if g.name == "swa")
        print(f"  {name:>8}: MXFP8 {mx:>9} B, bf16 {bf:>9} B ({bf / mx:.2f}x); window KV {swa[0]} layers x "
              f"{swa[1]} tokens x {swa[2]} B/token")
    prompt = tokens[:900]
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    print(f"  a cached tiny V4 request (900 prompt + 100 generated tokens) left {wc.counters.snapshots} snapshots, "
          f"{wc.counters.snapshot_bytes} B in host memory (one per 64-token unit boundary from the prompt's end)")
    llm.shutdown()


def flash_layout():
    from deepinfer_core.models.config_v4 import V4Config
    from deepinfer_core.models.deepseek_v4 import cache_layout

    raw = json.loads((resolve_model_dir("tiny-v4") / "config.json").read_text())
    swa, csa, hca = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    raw.update(hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512, index_head_dim=128,
               index_n_heads=64, index_topk=512, sliding_window=128, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
               compress_rates={csa: 4, hca: 128}, layer_types=[swa, swa] + [csa if i % 2 == 0 else hca
                                                                             for i in range(41)],
               mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40)
    return cache_layout(V4Config.from_dict(raw))


if __name__ == "__main__":
    main()
