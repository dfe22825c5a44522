"""DeepSeek-V4 end to end through ``LLM``: the engine derives its pools (swa, compressed, compressor
state) from the model's cache layout. Against transformers' ``DeepseekV4ForCausalLM`` in float32 on a
tiny well-separated config: greedy tokens identical and prompt logprobs within 1e-3, with chunk
boundaries inside compressor windows, async scheduling, preemption and recompute, bounded window KV
in a long decode, and no block leaks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import rand_ids

from deepinfer_core import LLM, SamplingParams

pytest.importorskip("deepinfer_core.models.deepseek_v4", reason="needs the DeepSeek-V4 model (issue 16's model half)")
tiny_v4 = pytest.importorskip("tiny_v4")
MIN_MARGIN, build_separated, min_margins, save_checkpoint = (tiny_v4.MIN_MARGIN, tiny_v4.build_separated,
                                                             tiny_v4.min_margins, tiny_v4.save_checkpoint)

TOL = 1e-3
N_NEW = 8
PROMPT_LENS = (45, 61, 37)
BS = 16  # lcm of the tiny config's compression rates (4, 16)


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(checkpoint dir, hf model, prompts, HF greedy continuations), well separated."""
    prompts = [rand_ids(n, 100 + i) for i, n in enumerate(PROMPT_LENS)]
    seed = 0
    for _ in range(10):
        hf, seed = build_separated("mixed", prompts, seed=seed)
        conts = [_hf_greedy(hf, p, N_NEW) for p in prompts]
        full = [p + c for p, c in zip(prompts, conts)]
        top2 = [_hf_logprobs(hf, s)[len(p) - 1:-1].topk(2, -1).values for s, p in zip(full, prompts)]
        if min(min_margins(hf, full).values()) >= MIN_MARGIN and min(float((t[:, 0] - t[:, 1]).min())
                                                                     for t in top2) > 1e-4:
            return save_checkpoint(hf, tmp_path_factory.mktemp("tiny_v4_engine")), hf, prompts, conts
        seed += 1
    raise RuntimeError("no well-separated tiny V4")


def _llm(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=4, max_num_batched_tokens=24, kv_cache_memory=8 << 20)
    opts.update(kw)
    return LLM(str(path), **opts)


def _check(hf, prompts, conts, outs) -> None:
    for p, c, o in zip(prompts, conts, outs):
        assert o.error is None, o.error
        assert o.outputs[0].token_ids == c
        mine = torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
        ref = _hf_logprobs(hf, p)[: len(p) - 1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        assert (mine - ref).abs().max().item() < TOL


@pytest.mark.parametrize("async_on", [False, True])
def test_v4_greedy_and_prompt_logprobs_match_transformers(v4, async_on):
    path, hf, prompts, conts = v4
    llm = _llm(path, async_scheduling=async_on)  # chunks of 24: boundaries inside CSA (4) and HCA (16) windows
    e = llm.engine
    assert type(e.model).__name__ == "DeepseekV4ForCausalLM" and e.block_size == BS
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, prompt_logprobs=0)
    _check(hf, prompts, conts, llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
    e.blocks.check_no_leaks()


def test_v4_preemption_and_recompute(v4):
    path, hf, prompts, conts = v4
    llm = _llm(path, max_num_batched_tokens=128)
    e = llm.engine
    per_block = sum(sum(t[0].numel() * t.element_size() for t in ts) for ts in e.kv_caches.values())
    # 7 blocks per pool: two prompts fit, not their growth -> preemption
    llm = _llm(path, max_num_batched_tokens=128, kv_cache_memory=7 * per_block)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    _check(hf, prompts, conts, outs)
    assert llm.engine.stats.preemptions > 0
    llm.engine.blocks.check_no_leaks()


def test_v4_window_kv_stays_bounded_in_a_long_decode(v4):
    path, hf, prompts, _ = v4
    llm = _llm(path, max_model_len=256)
    e = llm.engine
    n = 150
    e.add_request({"prompt_token_ids": prompts[2]}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                  "long")
    peak: dict[str, int] = {}
    done = []
    while e.has_unfinished():
        done += e.step()
        for pool, used in e.blocks.usage().items():
            peak[pool] = max(peak.get(pool, 0), used)
    windows = {name: p.window for name, p in e.blocks.pools.items() if p.window is not None}
    for pool, w in windows.items():
        assert peak[pool] <= -(-(w - 1) // BS) + 2, (pool, peak)
    full = [name for name, p in e.blocks.pools.items() if p.window is None]
    assert all(peak[f] == -(-(len(prompts[2]) + n - 1) // BS) for f in full), peak
    (out,) = [s for s in done if s.request_id == "long"]
    assert len(out.output_token_ids) == n
    e.blocks.check_no_leaks()


def test_v4_dp_ep_2_matches_transformers(v4):
    """Two data-parallel ranks, each with half of the routed experts (gloo all-to-all)."""
    path, hf, prompts, conts = v4
    llm = _llm(path, dp=2, ep=2)
    try:
        sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, prompt_logprobs=0)
        _check(hf, prompts, conts, llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
    finally:
        llm.shutdown()
