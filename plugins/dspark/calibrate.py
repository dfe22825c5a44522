"""DSpark's step-time curve: measured once per platform, model, draft and pool shape, then cached."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from deepinfer_core.engine.cost_model import cache_dir
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput
from plugins.dspark.policy import StepCost
from plugins.dspark.state import _Rows

logger = logging.getLogger("deepinfer.dspark")


def cost_path(engine, feature) -> Path:
    # the batch sizes a curve covers depend on max_num_seqs and the KV pool: one curve per pool shape
    name = (f"{engine.platform.name}-{engine.fingerprint}-{feature.source.fingerprint}-bs{engine.block_size}"
            f"-th{torch.get_num_threads()}-k{feature.k}-seqs{engine.cfg.max_num_seqs}-blocks{engine.blocks.num_free}"
            ".json")
    return cache_dir() / "dspark" / name


def load_or_measure_cost(engine, feature) -> StepCost:
    """The cached curve, else a measured one. With dp/ep > 1 every rank drafts and verifies its own
    requests with a rank-local draft, but the measuring forwards of the target meet in the MoE
    all-to-alls: the ranks agree to measure when any one of them lacks the curve."""
    path = cost_path(engine, feature)
    cost = None
    try:
        cost = StepCost.load(path)
    except FileNotFoundError:
        pass
    except (ValueError, TypeError, KeyError, OSError) as exc:
        logger.warning("dspark: the step-time curve %s is unreadable (%s); measuring it again", path, exc)
    if engine.comm is not None:
        have = torch.tensor([float(cost is not None)], dtype=torch.float64)
        have = engine.comm.all_reduce(have, "min")
        if have.item() < 1.0:
            cost = None
    if cost is not None:
        return cost
    cost = measure_step_cost(engine, feature)
    try:
        cost.save(path)
    except OSError as exc:
        logger.warning("dspark: could not save the step-time curve to %s: %s", path, exc)
    return cost


def _time_once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure_step_cost(engine, feature, ctx: int = 128, sweeps: int = 3) -> StepCost:
    """Time target forwards over decode batches with drafts, and draft steps, on synthetic requests
    whose blocks are taken from the pool and given back. Their tokens are seeded random ids, so that
    MoE layers route them to as many experts as real text does. Every point is timed in ``sweeps``
    interleaved sweeps and the fastest time kept, so a burst of other load on a shared machine
    does not bend the curve."""
    blocks = engine.blocks
    q = feature.k + 1
    ctx = max(1, min(ctx, engine.max_model_len - q - 1))
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs: list[Sequence] = []

    def rand(n: int) -> list[int]:
        return torch.randint(2, V, (n,), generator=gen).tolist() if V > 2 else [0] * n

    def make(n: int) -> list[Sequence]:
        while len(seqs) < n:
            s = Sequence(f"__dspark_calibrate_{len(seqs)}", None, rand(ctx + 1), SamplingParams(max_tokens=1),
                         0, [])
            if not blocks.can_allocate(s, ctx + q):
                break
            blocks.allocate(s, ctx + q)
            s.num_computed_tokens = ctx
            seqs.append(s)
        return seqs[:n]

    points: list[tuple[str, int, object]] = []  # (kind, x, fn)
    src = feature.source
    try:
        with torch.inference_mode():
            # every verify length of one request (conc 1), then whole batches of k + 1 tokens each
            for T in [*range(1, q + 1), *(q * b for b in (2, 4, 8, 16, 32, 64) if q * b <= 384)]:
                per = min(T, q)
                B = -(-T // per)
                group = make(B)
                if len(group) < B or ctx + per >= engine.max_model_len:
                    break
                out = SchedulerOutput(decodes=[ScheduledSeq(s, 1) for s in group])
                plan = {s.request_id: rand(per - 1) for s in group} if per > 1 else None

                points.append(("verify", B * per, lambda out=out, plan=plan: engine.probe_forward(out, plan)))
            for B in (1, 64):
                group = make(B)
                if len(group) == B:
                    out = SchedulerOutput(decodes=[ScheduledSeq(s, 1) for s in group])
                    points.append(("prepare", B, lambda out=out: engine.probe_forward(out, prepare_only=True)))
            for B in (1, 8, 32, 64):
                group = make(B)
                if len(group) < B:
                    break
                rows = _Rows(group, [q - 1] * B, engine.block_size, engine.device)
                tok = torch.tensor(rand(B), dtype=torch.long, device=engine.device)
                carry = torch.zeros(B, src.hidden_size, dtype=engine.dtype, device=engine.device)

                def dstep(rows=rows, tok=tok, carry=carry):
                    c, n = feature._ar_step(rows, tok, carry if src.needs_hidden else None, 2)
                    feature._pick(rows, src.logits(n), n, 2)
                    engine.platform.synchronize()

                points.append(("draft", B, dstep))
            best = [math.inf] * len(points)
            for _, _, fn in points:
                fn()  # warm-up
            for _ in range(sweeps):
                for i, (_, _, fn) in enumerate(points):
                    best[i] = min(best[i], _time_once(fn), _time_once(fn))
    finally:
        for s in seqs:
            blocks.release(s)
    curve = {"verify": ([], []), "draft": ([], []), "prepare": ([], [])}
    for (kind, x, _), t in zip(points, best):
        curve[kind][0].append(x)
        curve[kind][1].append(t)
    # engine bookkeeping per step outside forwards, estimated as twice the input preparation
    px, pt = curve["prepare"]
    p1 = pt[0] if pt else 0.0
    per_req = max(pt[-1] - p1, 0.0) / max(px[-1] - 1, 1) if len(pt) > 1 else 0.0
    cost = StepCost(*curve["verify"], *curve["draft"], overhead_s=2 * p1, overhead_per_req_s=2 * per_req,
                    platform=engine.platform.name, key=f"{engine.fingerprint}-{feature.source.fingerprint}")
    logger.info("dspark step-time curve: verify %s, draft %s", list(zip(*curve["verify"])), list(zip(*curve["draft"])))
    return cost
