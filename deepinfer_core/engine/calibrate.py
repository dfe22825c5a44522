"""`deepinfer calibrate`: time real prefill forwards on this platform and model, fit the prefill
cost model ``cost(q, c)`` and store it where the engine looks for it.

    deepinfer calibrate [--model DIR] [--accelerator NAME] [--dtype DT]
"""

from __future__ import annotations

import argparse
import time

from deepinfer_core.engine.cost_model import CostModel, default_path
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput

Q_GRID = (16, 64, 256, 1024)
C_GRID = (0, 256, 1024)


def time_prefill(engine, q: int, c: int, repeats: int = 3) -> float:
    """Median seconds of one forward computing q new tokens over c cached ones."""
    seq = engine.add_request({"prompt_token_ids": [2 + i % 97 for i in range(q + c + 1)]},
                             SamplingParams(max_tokens=1), request_id=f"calibrate-{q}-{c}")
    engine.scheduler.remove_waiting(seq)
    engine.blocks.allocate(seq, q + c)
    times = []
    for _ in range(repeats):
        seq.num_computed_tokens = c
        batch = engine.runner.prepare(SchedulerOutput(prefills=[ScheduledSeq(seq, q)]))
        engine.platform.synchronize()
        t = time.perf_counter()
        engine.runner.forward(batch)
        engine.platform.synchronize()
        times.append(time.perf_counter() - t)
    engine.blocks.release(seq)
    engine._seqs.pop(seq.request_id, None)
    return sorted(times)[len(times) // 2]


def calibrate(engine, q_grid=Q_GRID, c_grid=C_GRID) -> CostModel:
    limit = engine.max_model_len - 1
    samples = []
    time_prefill(engine, 16, 0, repeats=1)  # warm-up
    for q in q_grid:
        for c in c_grid:
            if q + c < limit and engine.blocks.fits(q + c):
                samples.append((q, c, time_prefill(engine, q, c)))
    return CostModel.fit(samples, platform=engine.platform.name, model_fingerprint=engine.fingerprint)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="deepinfer calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--accelerator", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default=None, help="where to write the cost model (default: the engine's path)")
    args = ap.parse_args(argv)
    from deepinfer_core.llm import LLM

    llm = LLM(model=args.model, accelerator=args.accelerator, dtype=args.dtype, enable_prefix_caching=False)
    engine = llm.engine
    model = calibrate(engine)
    path = args.out or default_path(engine.platform.name, engine.fingerprint)
    from pathlib import Path

    model.save(Path(path))
    print(f"cost(q, c) = {model.a:.3e} + {model.b:.3e}*q + {model.d:.3e}*q*c + {model.e:.3e}*q^2  [s]")
    print(f"saved to {path}")


if __name__ == "__main__":
    main()
