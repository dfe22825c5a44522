"""``deepinfer bench serve``: closed-loop streaming load against an OpenAI-compatible server, with
the real ``openai`` client, side by side with ``LLM.generate``-style offline runs on the same prompts.

    deepinfer bench serve --concurrency 1,16,64 --compare-offline            # starts its own server
    deepinfer bench serve --base-url http://127.0.0.1:8000/v1 --concurrency 16

Each level keeps ``c`` requests in flight (a client starts the next as soon as one finishes) for
``--requests`` requests (default ``max(4c, 16)``) of ``--input-len`` random prompt tokens and
exactly ``--output-len`` output tokens (greedy, ``ignore_eos``). Reported per level: output tok/s,
requests/s, TTFT and inter-token latency p50/p99 (ITL: the gap between stream chunks), errors, and
requests *lost* (no error, yet not finished with the expected token count; must be 0). With
``--repeats R`` each level runs R times and the median run is reported. When the command starts
the server itself it also reports CPU time per output token of the server's processes (API and
engine) against the offline engine's: a figure that other work on the machine barely moves, unlike
tok/s.

``--compare-offline`` builds an in-process engine with the same options and runs the same prompts at
the same closed-loop concurrency directly on it (no HTTP, no asyncio, no detokenization): the
server's overhead share is ``1 - server tok/s / offline tok/s``. Each level runs served, then offline,
back to back, after a warm-up request each. The offline engine is stepped from a worker thread, as
the server's engine process steps its engine: on a small, loaded CPU machine torch ops issued from
the main thread ran 5-25x slower than from a worker thread (intra-op thread pool contention), which
would otherwise dwarf the difference being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request

from deepinfer_core.ports import free_port as _free_port


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(input_len)] for _ in range(n)]


async def run_level(client, model: str, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    """Closed-loop streaming requests through the openai client (or, given a plain HTTP client, raw
    SSE frames split but not parsed into objects: a lighter client)."""
    ttfts, itls, ok, errors, error_texts = [], [], 0, 0, []
    out_tokens = 0
    queue = list(range(len(prompts)))

    async def openai_chunks(i: int):
        """(carries a choice, finish reason, completion tokens from usage) per stream chunk."""
        stream = await client.completions.create(
            model=model, prompt=prompts[i], max_tokens=output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            yield (bool(chunk.choices), chunk.choices[0].finish_reason if chunk.choices else None,
                   chunk.usage.completion_tokens if chunk.usage is not None else None)

    async def raw_chunks(i: int):
        body = {"model": model, "prompt": prompts[i], "max_tokens": output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        async with client.stream("POST", "/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if '"choices":[]' in line:
                    yield False, None, json.loads(line[6:])["usage"]["completion_tokens"]
                elif '"finish_reason":"' in line:
                    yield True, json.loads(line[6:])["choices"][0]["finish_reason"], None
                else:
                    yield True, None, None

    chunks = openai_chunks if hasattr(client, "completions") else raw_chunks

    async def one(i: int) -> None:
        nonlocal ok, errors, out_tokens
        t0 = time.perf_counter()
        last, finish, tokens = None, None, None
        try:
            async for has_choice, reason, used in chunks(i):
                now = time.perf_counter()
                if has_choice:
                    (ttfts if last is None else itls).append(now - (t0 if last is None else last))
                    last = now
                    finish = reason or finish
                if used is not None:
                    tokens = used
        except Exception as exc:
            errors += 1
            error_texts.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        if finish is not None and tokens == output_len:
            ok += 1
            out_tokens += tokens

    async def worker() -> None:
        while queue:
            await one(queue.pop(0))

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    dt = time.perf_counter() - t
    return {"concurrency": concurrency, "requests": len(prompts), "seconds": dt, "output_tok_s": out_tokens / dt,
            "req_s": ok / dt, "ttft_p50_ms": _ms(_pct(ttfts, 50)), "ttft_p99_ms": _ms(_pct(ttfts, 99)),
            "itl_p50_ms": _ms(_pct(itls, 50)), "itl_p99_ms": _ms(_pct(itls, 99)), "errors": errors,
            "lost": len(prompts) - ok - errors, "error_samples": error_texts[:3]}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def run_offline(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    """The same closed loop directly on an engine: ``concurrency`` requests in flight."""
    from deepinfer_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    todo = list(range(len(prompts)))
    in_flight, out_tokens = 0, 0
    t = time.perf_counter()
    while todo or engine.has_unfinished():
        while todo and in_flight < concurrency:
            engine.add_request({"prompt_token_ids": prompts[todo.pop(0)]}, params)
            in_flight += 1
        for seq in engine.step():
            in_flight -= 1
            out_tokens += seq.num_output_tokens
    dt = time.perf_counter() - t
    return {"concurrency": concurrency, "seconds": dt, "output_tok_s": out_tokens / dt}


def _process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of a process and its live descendants (the server and its engine
    process), from Linux /proc; 0.0 where unknown."""
    if pid is None:
        return 0.0
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                    for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    except OSError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(_process_cpu(c) for c in children)


def _wait_healthy(base: str, proc: subprocess.Popen | None, timeout: float = 600.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {base} was not healthy within {timeout:.0f} s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="deepinfer bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["serve"])
    ap.add_argument("--base-url", default=None, help="a running server's /v1 URL (default: start one)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine config key for the started server and the offline engine (repeat)")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: max(4c, 16))")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", choices=["openai", "raw"], default="openai",
                    help="openai: the openai package's AsyncOpenAI; raw: plain HTTP frames (less client CPU, to "
                         "tell the server's cost from the client's on a small machine)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per level (served and offline alternate); "
                    "the median is reported, errors and lost requests are summed")
    ap.add_argument("--compare-offline", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    vocab = _vocab(args)

    def prompts_for(c: int) -> list[list[int]]:
        n = args.requests or max(4 * c, 16)
        return make_prompts(n, args.input_len, vocab, args.seed + c)

    engine = None
    if args.compare_offline:  # built first, while the machine is otherwise idle
        from deepinfer_core.cli import _parse_option
        from deepinfer_core.config import compose
        from deepinfer_core.llm import make_engine

        opts = dict(_parse_option(o) for o in args.option)
        if args.model:
            opts["model"] = args.model
        engine = make_engine(compose(None, **opts))
        warm = threading.Thread(target=run_offline, args=(engine, prompts_for(1)[:1], 1, 4))  # warm-up
        warm.start()
        warm.join()
    proc, base = None, args.base_url
    if base is None:
        port = _free_port()
        cmd = [sys.executable, "-m", "deepinfer_core.cli", "serve", "--port", str(port),
               "--max-queue-len", "4096"] + [x for o in args.option for x in ("-o", o)]
        if args.model:
            cmd.insert(4, args.model)
        proc = subprocess.Popen(cmd, env=dict(os.environ))
        base = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_healthy(base, proc)
        with urllib.request.urlopen(base + "/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        served = asyncio.run(_levels(base, model, levels, prompts_for, args.output_len, engine, args.repeats,
                                     args.client, proc.pid if proc is not None else None))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
        if engine is not None:
            engine.shutdown()
    print(format_table(served))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "levels": served}, f, indent=2)
    return 1 if any(r["lost"] for r in served) else 0


async def _levels(base: str, model: str, levels, prompts_for, output_len: int, engine,
                  repeats: int, client_kind: str = "openai", server_pid: int | None = None) -> list[dict]:
    """Each level served, then (with an engine) offline, back to back: both see the same machine load."""
    if client_kind == "openai":
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    else:
        try:
            import httpx
        except ImportError:  # newer openai releases ship it as httpx2
            import httpx2 as httpx
        client = httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=None))
    await run_level(client, model, prompts_for(1)[:1], 1, 4)  # warm-up
    out = []
    for c in levels:
        runs, offline = [], []
        cpu_served, cpu_offline = [], []
        for _ in range(repeats):  # served and offline alternate, so slow phases of a shared machine hit both
            cpu0 = _process_cpu(server_pid)
            runs.append(await run_level(client, model, prompts_for(c), c, output_len))
            if server_pid is not None and runs[-1]["output_tok_s"]:
                tokens = runs[-1]["output_tok_s"] * runs[-1]["seconds"]
                cpu_served.append((_process_cpu(server_pid) - cpu0) / tokens)
            if engine is not None:  # stepped from a worker thread, as the server's engine process does
                cpu0 = time.process_time()  # this process: only the offline engine works meanwhile
                off = await asyncio.to_thread(run_offline, engine, prompts_for(c), c, output_len)
                offline.append(off["output_tok_s"])
                cpu_offline.append((time.process_time() - cpu0) / (off["output_tok_s"] * off["seconds"]))
        row = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]  # the median run
        row = {**row, "errors": sum(r["errors"] for r in runs), "lost": sum(r["lost"] for r in runs),
               "runs_tok_s": [round(r["output_tok_s"], 1) for r in runs]}
        if offline:
            row["offline_tok_s"] = sorted(offline)[len(offline) // 2]
            row["offline_runs_tok_s"] = [round(x, 1) for x in offline]
            row["server_overhead_share"] = 1.0 - row["output_tok_s"] / row["offline_tok_s"]
        if cpu_served:  # CPU time per output token: insensitive to what else runs on the machine
            row["server_cpu_ms_per_token"] = round(1000 * sorted(cpu_served)[len(cpu_served) // 2], 3)
        if cpu_offline:
            row["offline_cpu_ms_per_token"] = round(1000 * sorted(cpu_offline)[len(cpu_offline) // 2], 3)
        if cpu_served and cpu_offline:
            row["server_cpu_overhead_share"] = 1.0 - row["offline_cpu_ms_per_token"] / row["server_cpu_ms_per_token"]
        print(json.dumps({k: v for k, v in row.items() if k != "error_samples"}), flush=True)
        out.append(row)
    await (client.close() if client_kind == "openai" else client.aclose())
    return out


def _vocab(args) -> int:
    from deepinfer_core.models.loader import load_model_config, resolve_model_dir

    return load_model_config(resolve_model_dir(args.model)).vocab_size


def format_table(rows: list[dict]) -> str:
    head = ["conc", "reqs", "tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "err", "lost",
            "offline tok/s", "overhead (tok/s)", "CPU ms/tok served / offline", "overhead (CPU)"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        off = r.get("offline_tok_s")
        share = r.get("server_overhead_share")
        lines.append(" | ".join(str(x) for x in (
            r["concurrency"], r["requests"], f"{r['output_tok_s']:.0f}", f"{r['req_s']:.2f}", r["ttft_p50_ms"],
            r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"], r["errors"], r["lost"],
            f"{off:.0f}" if off else "-", f"{share:.1%}" if share is not None else "-",
            f"{r.get('server_cpu_ms_per_token', '-')} / {r.get('offline_cpu_ms_per_token', '-')}",
            f"{r['server_cpu_overhead_share']:.1%}" if "server_cpu_overhead_share" in r else "-")))
    return "\n".join(lines)
