"""The Prefill LB inside a DP group: every rank's prefill time budget for a step is
``compute_quota_limit`` less its own decode cost, all-reduced MIN over the group (real gloo ranks)."""

from __future__ import annotations

from parallel_helpers import ep_checkpoint, workload

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.cost_model import CostModel

QUOTA = 0.030
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_prefill_budget_is_min_over_the_dp_group(tmp_path_factory, tmp_path):
    ckpt = ep_checkpoint(tmp_path_factory.getbasetemp())
    path = tmp_path / "linear.json"
    CostModel(a=0.0, b=1e-3, d=0.0, e=0.0).save(path)  # 1 ms per token, so a decode costs 1 ms
    kw = dict(dtype="float32", block_size=4, compute_quota_limit=QUOTA, cost_model=str(path))
    prompts = workload(8)
    ref = LLM(ckpt, **kw).generate(prompts, SP, use_tqdm=False)
    llm = LLM(ckpt, dp=2, ep=2, **kw)
    try:
        outs = llm.generate(prompts, SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        ranks = llm.metrics()["ranks"]
        budgets = [r["prefill_budgets"] for r in ranks]
        assert budgets[0] == budgets[1] and len(budgets[0]) > 3  # one budget per lock step, the same on both
        assert max(budgets[0]) == QUOTA  # a step with no decode anywhere: the whole quota
        # with decodes running the budget shrank by the busier rank's decode cost (1 ms each)
        assert min(budgets[0]) <= QUOTA - 0.002
    finally:
        llm.shutdown()
