"""Decode fusion on a GPU: the fused path (shared experts inside the routed ``fused_moe``, ``mla_kv_write``,
the router's ``linear_f32`` GEMV) and the unfused ops (``set_decode_fusion(False)``) give the same greedy
tokens on the embedded default model in bfloat16, eager and with CUDA graphs, at decode batches 1 to 8
(the GEMV's row buckets). Where the two part, the unfused run must have had a near-tie there (top-2 gap
< ``TIE`` nats, as in ``test_cuda_graphs_gpu``): bfloat16 rounds the shared expert's output differently
when it is summed in the fused combine.

With ``DEEPINFER_TL_DRYRUN=1`` and no GPU, :func:`test_decode_fusion_kernels_compile` compiles the kernels
of both paths at the default model's shapes (``kernel_warm.py``)."""

from __future__ import annotations

import pytest
import torch
from gpu_marks import GPU_OR_DRY, HAS_CUDA
from test_cuda_graphs_gpu import BASES, compare, greedy

pytestmark = GPU_OR_DRY
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (DEEPINFER_TL_DRYRUN only compiles)")


def _llm(eager: bool, fused: bool, **kw):
    from deepinfer_core import LLM

    llm = LLM(accelerator="nvidia", dtype="bfloat16", max_num_seqs=16, graph_batch_sizes=[1, 2, 4, 8],
              enforce_eager=eager, kv_cache_memory=1 << 30, decode_fusion=fused, **kw)
    return llm


def _embedded_weights() -> bool:
    import json

    from deepinfer_core.models.loader import EMBEDDED_MODEL

    index = EMBEDDED_MODEL / "model.safetensors.index.json"
    if not index.is_file():
        return (EMBEDDED_MODEL / "model.safetensors").is_file()
    return all((EMBEDDED_MODEL / f).is_file() for f in set(json.loads(index.read_text())["weight_map"].values()))


@needs_gpu
@pytest.mark.parametrize("eager", [True, False])
def test_fused_and_unfused_greedy_agree_random_v2_lite(eager, tmp_path):
    """The V2-Lite layout (two shared experts, 8 routed, V2 routing) at tiny widths with random bf16 weights:
    every request gives the same greedy tokens fused and unfused, or parts only at a near-tie."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from h200_suite import suite_config
    from random_checkpoint import write_config

    model_dir = str(write_config(tmp_path / "v2-lite", suite_config("v2-lite", "tiny", None)))
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(2, 500, (n,), generator=g).tolist()} for n in range(5, 13)]
    params = [greedy(8 + 4 * i) for i in range(8)]  # finishing one by one: decode batches 8 down to 1
    outs = []
    for fused in (False, True):
        llm = _llm(eager, fused, model=model_dir, load_format="random", seed=3)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        llm.shutdown()
    same, ties = compare(outs[1], outs[0])
    print(f"random V2-Lite tiny, fused vs unfused ({'eager' if eager else 'graphs'}): {same}/8 identical, "
          f"{ties} parted at near-ties")
    assert same + ties == 8


@needs_gpu
@pytest.mark.skipif(not _embedded_weights(), reason="the embedded model's weights are not in this checkout")
@pytest.mark.parametrize("eager", [True, False])
def test_fused_and_unfused_greedy_agree(eager):
    prompts = [BASES[i % len(BASES)] for i in range(8)]
    params = [greedy(8 + 4 * i) for i in range(8)]  # finishing one by one: decode batches 8 down to 1
    plain = _llm(eager, fused=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    llm = _llm(eager, fused=True)
    moes = [m for m in llm.engine.model.moe_layers().values()]
    assert moes and all(m._folded() for m in moes)
    got = llm.generate(prompts, params, use_tqdm=False)
    same, ties = compare(got, want)
    print(f"fused vs unfused ({'eager' if eager else 'graphs'}): {same}/8 identical, {ties} parted at near-ties")
    assert same >= 7


@pytest.mark.skipif(HAS_CUDA, reason="compile-only check for DEEPINFER_TL_DRYRUN=1 without a GPU")
@pytest.mark.parametrize("shape", ["default", "v2-lite-tiny"])
def test_decode_fusion_kernels_compile(shape):
    """The decode steps of both paths at batches 1..8 and a prefill, on the default model's shapes and the tiny
    V2-Lite of the random-weight test."""
    import json
    import sys
    from pathlib import Path

    from deepinfer_core.engine.graph_runner import DecodeGraphs
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.loader import EMBEDDED_MODEL, build_model
    from deepinfer_core.models.metadata import AttentionMetadata, PrefillMeta
    from kernels_cpu import ReferenceKernels
    from kernels_cuda import CudaKernels

    if shape == "default":
        cfg = ModelConfig.from_dict(json.loads((EMBEDDED_MODEL / "config.json").read_text()))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from h200_suite import suite_config

        cfg = ModelConfig.from_dict(suite_config("v2-lite", "tiny", None))
    model = build_model(Kernels(CudaKernels, ReferenceKernels), cfg, torch.bfloat16, torch.device("cpu"), 1024)
    model.post_load()
    assert all(m._folded() for m in model.moe_layers().values())
    bs = 16
    kv = [torch.zeros(8, bs, cfg.kv_entry_dim, dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
    sizes = [1, 2, 4, 8]
    graphs = DecodeGraphs(model, {"latent": kv}, sizes, 1024 // bs + 1, torch.device("cpu"), capture=False)
    with torch.inference_mode():
        for fused in (True, False):
            model.set_decode_fusion(fused)
            for n in sizes:
                graphs._forward(n)
            for n in (5, 70):  # prefills of one short prompt and of a batch of prompts (MoE tile configurations)
                lens, cu = torch.tensor([n]), torch.tensor([0, n])
                prefill = PrefillMeta(cu, cu, lens, torch.zeros(1, 5, dtype=torch.int32), has_prefix=False)
                model(torch.zeros(n, dtype=torch.long), torch.arange(n),
                      AttentionMetadata(n, torch.arange(n), prefill, None), {"latent": kv})


@needs_gpu
@pytest.mark.parametrize("eager", [True, False])
def test_programmatic_dependent_launch_gives_the_same_bits(eager, tmp_path, monkeypatch):
    """Programmatic dependent launch (``kernels_cuda/_tl.py``: ``DEEPINFER_PDL`` 1, or unset at one row) launches
    the batch-1 decode chain's kernels while the kernel before each still runs; only the synchronisation changes,
    so a request decodes the same tokens with the same logprobs, bit for bit, as without it. V2-Lite at its real
    widths (3 layers: the dense one and two MoE, random weights), so every kernel of the chain runs at its
    real-model tiles; a missing wait would read a stale activation or cache entry."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from h200_suite import suite_config
    from random_checkpoint import write_config

    from deepinfer_core import LLM

    model_dir = str(write_config(tmp_path / "v2-lite", suite_config("v2-lite", "full", 3)))
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(2, 50000, (n,), generator=g).tolist()} for n in (7, 300)]
    outs = []
    for pdl in ("0", "1", None):  # off, on everywhere, unset (on at one row on sm_90+: the chain here)
        if pdl is None:
            monkeypatch.delenv("DEEPINFER_PDL")
        else:
            monkeypatch.setenv("DEEPINFER_PDL", pdl)
        llm = LLM(model=model_dir, load_format="random", seed=3, accelerator="nvidia", dtype="bfloat16",
                  max_num_seqs=1, graph_batch_sizes=[1], enforce_eager=eager, kv_cache_memory=1 << 30)
        outs.append([o.outputs[0] for o in llm.generate(prompts, greedy(24), use_tqdm=False)])
        llm.shutdown()
    for off, *ons in zip(*outs):
        for on in ons:
            assert on.token_ids == off.token_ids
            assert [lp[t].logprob for lp, t in zip(on.logprobs, on.token_ids)] == \
                [lp[t].logprob for lp, t in zip(off.logprobs, off.token_ids)]


@needs_gpu
def test_the_engines_greedy_draw_is_the_reference_draw(tmp_path):
    """The sampler's greedy draw through the CUDA ``greedy_sample`` (one launch after the logits' GEMV, with
    programmatic dependent launch at one row) gives, on the very logits the engine samples, the tokens of the
    reference draw (argmax + logsumexp) and its logprobs and normaliser to float32 rounding; and the engine
    emits what the kernel drew. V2-Lite at its real widths (3 layers, random weights: a 102,400-token
    vocabulary), decode batches 2 and 1 under CUDA graphs.

    Each draw is checked against the reference in the same step: two separate runs need not give the same
    bf16 logits (the second run's prompts hit the prefix cache, so its prefill is chunked differently)."""
    import sys
    from collections import Counter
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from h200_suite import suite_config
    from random_checkpoint import write_config

    from deepinfer_core import LLM
    from kernels_cpu import ops as ref

    model_dir = str(write_config(tmp_path / "v2-lite", suite_config("v2-lite", "full", 3)))
    g = torch.Generator().manual_seed(6)
    prompts = [{"prompt_token_ids": torch.randint(2, 50000, (n,), generator=g).tolist()} for n in (9, 200)]
    llm = LLM(model=model_dir, load_format="random", seed=3, accelerator="nvidia", dtype="bfloat16",
              max_num_seqs=2, graph_batch_sizes=[1, 2], kv_cache_memory=1 << 30)
    kernels = llm.engine.kernels
    assert kernels.implements("greedy_sample")
    fused_op = kernels.greedy_sample
    assert fused_op is not ref.greedy_sample
    drawn = []  # per call: rows, the kernel's (tokens, logprobs, lse), the reference's on the same logits

    def checked(x: torch.Tensor):
        out = fused_op(x)
        drawn.append((x.shape[0], [t.clone() for t in out], ref.greedy_sample(x)))
        return out

    kernels.override("greedy_sample", checked)
    params = [greedy(12), greedy(20)]  # the first finishes early: batch 2, then 1
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert {rows for rows, _, _ in drawn} >= {1, 2}
    emitted = []
    for _, (tok, lp, lse), (r_tok, r_lp, r_lse) in drawn:
        assert torch.equal(tok, r_tok)
        torch.testing.assert_close(lse, r_lse, rtol=2e-6, atol=2e-5)
        torch.testing.assert_close(lp, r_lp, rtol=2e-6, atol=2e-5)
        emitted += list(zip(tok.tolist(), lp.tolist()))
    got = Counter((t, lp[t].logprob) for o in outs for lp, t in zip(o.logprobs, o.token_ids))
    assert sum(got.values()) == 12 + 20
    assert not got - Counter(emitted)  # every token the engine emitted (with its logprob) is one the kernel drew
