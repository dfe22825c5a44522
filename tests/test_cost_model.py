"""The prefill cost model: fitting, calibration on a real model, and time-budgeted chunked prefill."""

from __future__ import annotations

import random

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.calibrate import calibrate
from deepinfer_core.engine.cost_model import CostModel


def test_fit_recovers_coefficients_and_max_tokens_is_tight():
    true = CostModel(a=2e-3, b=1e-5, d=3e-9, e=2e-8)
    samples = [(q, c, true.cost(q, c)) for q in (16, 64, 256, 1024) for c in (0, 256, 1024)]
    fit = CostModel.fit(samples)
    for q, c, t in samples:
        assert fit.cost(q, c) == pytest.approx(t, rel=1e-6)
    budget = true.cost(300, 100)
    n = true.max_tokens(100, budget, cap=4096)
    assert n == 300 and true.cost(n + 1, 100) > budget
    assert true.max_tokens(0, true.a / 2, cap=10) == 0  # not even one token fits
    assert true.max_tokens(0, 10.0, cap=7) == 7  # capped


def test_calibrate_fits_a_positive_model(tiny_v3_path, tmp_path):
    llm = LLM(tiny_v3_path, dtype="float32", block_size=4, enable_prefix_caching=False)
    model = calibrate(llm.engine, q_grid=(8, 32, 96), c_grid=(0, 64))
    assert model.b > 0 or model.e > 0, model
    assert model.cost(96, 64) > model.cost(8, 0)
    path = tmp_path / "cm.json"
    model.save(path)
    assert CostModel.load(path) == model
    llm.engine.blocks.check_no_leaks()


def test_time_budget_limits_prefill_chunks_and_keeps_outputs(tiny_v3_path, tmp_path):
    path = tmp_path / "linear.json"
    CostModel(a=0.0, b=1e-3, d=0.0, e=0.0).save(path)  # 1 ms per token
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 128) for _ in range(n)]} for n in (90, 41, 7)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = LLM(tiny_v3_path, dtype="float32", block_size=4).generate(prompts, sp, use_tqdm=False)

    llm = LLM(tiny_v3_path, dtype="float32", block_size=4, compute_quota_limit=0.030, cost_model=str(path))
    sizes: list[list[int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        sizes.append([s.num_new_tokens for s in out.prefills])
        return out

    llm.engine.scheduler.schedule = recording
    timed = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in timed] == [o.outputs[0].token_ids for o in free]
    step_totals = [sum(s) for s in sizes if s]
    assert max(step_totals) <= 30, step_totals  # 30 ms at 1 ms per token
    assert len(step_totals) >= 138 // 30  # the prompts really were split over several steps
