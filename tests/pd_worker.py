"""An engine in its own process for the P/D tests: ``python pd_worker.py SPEC.json``.

SPEC: {"llm": LLM keyword arguments, "requests": path, "out": path}. The engine is built first (a
p2p transport joins its process group then), then the worker waits for the ``requests`` file:
{"prompts": [...], "params": [SamplingParams dicts]}. Writes {"tokens", "kv_transfer_params", "tiers",
"errors", "metrics"} to ``out``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

torch.set_num_threads(1)


def main(spec_path: str) -> None:
    from deepinfer_core import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(**spec["llm"])
    deadline = time.monotonic() + 600
    while not os.path.exists(spec["requests"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no requests file {spec['requests']}")
        time.sleep(0.05)
    with open(spec["requests"]) as f:
        req = json.load(f)
    outs = llm.generate(req["prompts"], [SamplingParams.from_dict(p) for p in req["params"]], use_tqdm=False)
    result = {"tokens": [o.outputs[0].token_ids for o in outs],
              "kv_transfer_params": [o.kv_transfer_params for o in outs],
              "tiers": [o.metrics.num_cached_tokens_by_tier for o in outs],
              "errors": [None if o.error is None else str(o.error) for o in outs],
              "metrics": {k: v for k, v in llm.metrics().items() if isinstance(v, (int, float))}}
    llm.engine.blocks.check_no_leaks()
    llm.shutdown()
    with open(spec["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
