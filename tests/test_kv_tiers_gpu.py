"""KV swap-in on a GPU: blocks fetched from the persistent store are copied into the device cache on
a side stream, one event per layer, and the next step's layer i waits for layer i's copies only.
A hit must still generate exactly what a cold engine generates. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": [5 + (s * 37 + i * 11) % 3000 for i in range(200 + 17 * s)]} for s in range(4)]


def test_swap_in_is_layer_by_layer_and_replays_exactly(tmp_path):
    kv = {"backend": "3fs", "path": str(tmp_path / "kv"), "offload_on_finish": True}
    cold = LLM(accelerator="nvidia", dtype="bfloat16", block_size=16, kv_store=kv)
    expected = [o.outputs[0].token_ids for o in cold.generate(_prompts(), PARAMS, use_tqdm=False)]
    cold.shutdown()
    del cold

    warm = LLM(accelerator="nvidia", dtype="bfloat16", block_size=16, kv_store=kv)
    runner = warm.engine.runner
    seen: list[int] = []
    original = runner.swap_in_events

    def record(events):
        seen.append(len(events))
        original(events)

    runner.swap_in_events = record
    outs = warm.generate(_prompts(), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert seen and all(n == len(runner.kv_caches["latent"]) for n in seen), seen  # one event per layer
    assert all(o.metrics.num_cached_tokens_by_tier.get("persistent", 0) > 0 for o in outs)
    assert runner.layer_ready is None  # consumed by the step that needed it
    warm.shutdown()
