"""The full-model benchmark suite (``examples/benchmark.py --suite h200``) on a CPU at tiny scale: the
roofline definitions against a hand-computed example, transformers built on the engine's own weights
against the engine, and the whole suite end to end (JSON, PROFILE=1 traces, the sweep and its plot)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "sweep"))

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.models.config import ModelConfig  # noqa: E402

#: 2 layers (1 dense, 1 MoE), C 4, H 2, nope/rope/v 2, kv_lora 4, 4 experts top-2 of width 3, 1 shared, vocab 10.
HAND = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=10, hidden_size=4, intermediate_size=5,
            num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=4, q_lora_rank=None, qk_nope_head_dim=2,
            qk_rope_head_dim=2, v_head_dim=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=3, first_k_dense_replace=1, topk_method="greedy")


def test_roofline_hand_computed():
    from roofline import decode_roofline, decode_step_bytes, expected_distinct_experts, prefill_roofline

    cfg = ModelConfig.from_dict(HAND)
    # attention params per layer: q 2*4*4=32, kv_a 6*4=24, kv_b 2*4*4=32, o 4*4=16, kv_a_norm 4 -> 108
    b = decode_step_bytes(cfg, batch=2, context=3, experts_hit=3, wbytes=2)
    assert b == {"routed_experts": 3 * 3 * 4 * 3 * 2, "shared_experts": 72, "router": 4 * 4 * 4, "dense_mlp": 120,
                 "attention": 2 * 108 * 2, "norms": (2 * 2 * 4 + 4) * 2, "lm_head": 80, "embedding": 16,
                 "kv_cache": 2 * 3 * 6 * 2 * 2, "total": 1184}
    r = decode_roofline(cfg, 2, 3, tok_s=1.0, read_GBps=1184e-9, experts_hit=3)  # bound: 1 s per step
    # the cache spec's bytes per token (e.g. FP8 latent rows) replace the (kv_lora + rope) x w x layers default
    b8 = decode_step_bytes(cfg, batch=2, context=3, experts_hit=3, wbytes=2, kv_bytes_per_token=2 * 5)
    assert b8["kv_cache"] == 2 * 3 * 10 and b8["total"] == 1184 - 144 + 60
    assert r["roofline_tok_s"] == pytest.approx(2.0) and r["fraction"] == pytest.approx(0.5)
    # FP8 weights: the GEMM matrices (experts, dense MLP, q, kv_a, o) count 1 byte + a float32 scale per
    # 128x128 tile; kv_b (32 per layer), norms, router, head, embedding and the cache keep their bytes
    f = decode_step_bytes(cfg, batch=2, context=3, experts_hit=3, wbytes=2, fp8_matrices=True)
    w8 = 1 + 4 / 128**2
    assert f["routed_experts"] == pytest.approx(108 * w8) and f["dense_mlp"] == pytest.approx(60 * w8)
    assert f["attention"] == pytest.approx(2 * ((108 - 4 - 32) * w8 + (32 + 4) * 2))
    assert {k: f[k] for k in ("router", "norms", "lm_head", "embedding", "kv_cache")} == {
        k: b[k] for k in ("router", "norms", "lm_head", "embedding", "kv_cache")}
    # prefill of one 3-token prompt: per token 2*104 (attention) + 60 (dense) + 16 (router) + 3*36 (experts)
    # = 392 params -> 2*392*3 = 2352; attention 2 layers * 2 * (2 heads * 6) * 6 pairs = 288; LM head 2*10*4 = 80
    p = prefill_roofline(cfg, 3, 1, tok_s=1.5, matmul_TFLOPs=2720e-12)
    assert p["flops"] == 2720 and p["roofline_tok_s"] == pytest.approx(3.0) and p["fraction"] == pytest.approx(0.5)
    assert expected_distinct_experts(4, 2, 1) == 2 and expected_distinct_experts(4, 2, 2) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="experts_hit has 2 entries"):
        decode_step_bytes(cfg, 1, 1, [1.0, 2.0])


def test_pareto_front():
    from plot import pareto_front

    pts = [(100, 100), (50, 400), (60, 300), (40, 350), (10, 900), (5, 800)]
    assert pareto_front(pts) == [(10, 900), (50, 400), (60, 300), (100, 100)]


@pytest.mark.parametrize("shape", ["v2-lite", "v3-slice"])
def test_hf_twin_shares_the_engine_weights_and_matches(shape, tmp_path):
    from h200_suite import suite_config
    from hf_twin import hf_twin
    from random_checkpoint import write_config
    from tiny_models import check_against_hf

    model_dir = write_config(tmp_path / shape, suite_config(shape, "tiny", None))
    llm = LLM(str(model_dir), dtype="float32", accelerator="cpu", load_format="random", max_num_seqs=4,
              kv_cache_memory=4 << 20, enable_prefix_caching=False)
    model = llm.engine.model
    with torch.no_grad():  # far from flat logits, so that a wrongly mapped tensor shows
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(15.0)
    model.post_load()
    hf = hf_twin(model, model_dir, llm.engine.device)
    moe = model.layers[1].mlp
    hf_experts = hf.model.layers[1].mlp.experts
    hf_w = hf_experts.gate_up_proj if hasattr(hf_experts, "gate_up_proj") else hf_experts[0].gate_proj.weight
    assert hf_w.data_ptr() == moe.w13.data_ptr()  # a view of the engine's tensor, not a copy
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 512, (40,), generator=g).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                      prompt_logprobs=0, logprobs=0),
                       use_tqdm=False)[0]
    check_against_hf(hf, prompt, out, 6)
    llm.shutdown()


def test_suite_tiny_end_to_end(tmp_path, monkeypatch):
    import h200_suite
    from benchmark import main
    from plot import plot
    from roofline import decode_step_bytes, prefill_flops
    from sweep import main as sweep_main

    monkeypatch.setenv("PROFILE", "1")
    # a CPU captures no graphs: take the GPU's branch anyway (a second engine with enforce_eager=True)
    monkeypatch.setattr(h200_suite, "graphs_in_use", lambda llm: True)
    out = tmp_path / "out"
    main(["--suite", "h200", "--shape", "v2-lite", "--scale", "tiny", "--accelerator", "cpu", "--out", str(out),
          "--decode-batches", "1,2", "--context", "24", "--prefill-lens", "16,32", "--max-batched", "64",
          "--hf-batches", "2", "--hf-compiled-batches", "2", "--hf-new-tokens", "3", "--warmup", "1", "--window", "2"])
    res = json.loads((out / "results.json").read_text())
    mc = ModelConfig.from_dict(res["model_config"])
    assert [r["batch"] for r in res["decode"]] == [1, 2]
    for r in res["decode"]:
        assert r["tok_s"] > 0 and 0 < r["fraction"] < 1 and r["experts_source"] == "router"
        want = decode_step_bytes(mc, r["batch"], r["context"], r["experts_hit"], wbytes=4)["total"]  # float32
        assert r["bytes_per_step"] == pytest.approx(want)
        assert 0 <= r["idle"]["device_idle_share"] < 1 and r["idle"]["gaps"] == 2  # one per timed step
    assert [r["batch"] for r in res["decode_eager"]] == [1] and res["decode_eager"][0]["graphs_speedup"] > 0
    assert res["decode"][0]["experts_hit"] == mc.num_experts_per_tok  # one token hits exactly top-k experts
    assert 24 <= res["decode"][0]["context"] <= 24 + 20
    for r in res["prefill"]:
        assert r["tok_s"] > 0 and r["flops"] == prefill_flops(mc, r["prompt_len"], r["requests"])["total"]
    hf, hf_c = res["transformers"]  # eager, then the static cache under torch.compile (backend "eager" on a CPU)
    assert hf["batch"] == 2 and hf["decode_tok_s"] > 0 and len(hf["greedy_agree_prefix"]) == 2
    assert not hf["compiled"] and hf["experts_implementation"] == "grouped_mm"
    assert hf_c["compiled"] and hf_c["compile_backend"] == "eager" and hf_c["compile_s"] > 0
    assert hf_c["batch"] == 2 and hf_c["decode_tok_s"] > 0 and hf_c["greedy_agree_prefix"] == hf["greedy_agree_prefix"]
    sp = res["speedups_vs_transformers"]["2"]
    assert sp == {"eager": hf["speedup"], "compiled": hf_c["speedup"], "counted": min(hf["speedup"], hf_c["speedup"])}
    assert set(res["targets"]) == {"decode_b1_fraction", "decode_b64_256_min_fraction", "prefill_8k_fraction",
                                   "speedup_vs_transformers_b64"}
    assert res["targets"]["decode_b1_fraction"]["met"] is False  # a CPU is nowhere near its roofline here
    # PROFILE=1: gzipped chrome traces and kernel tables for a decode batch and the longest prefill
    for name in ("decode_b1", "prefill_32"):  # decode tables at batch 1 (and 64 where measured)
        trace = json.loads(gzip.open(out / f"{name}.trace.json.gz").read())
        assert any(ev.get("cat") == "cpu_op" for ev in trace["traceEvents"])
        assert (out / f"{name}.kernels.txt").read_text().startswith(name)
    prof = res["decode"][0]["profile"]
    assert prof["kernels"] and prof["launches_per_layer"] == pytest.approx(prof["launches_per_step"] / 2)
    assert "profile" not in res["decode"][1] and res["decode_fusion"] is True
    # the sweep and its plot
    sweep_json = tmp_path / "sweep.json"
    sweep_main(["--shape", "v3-slice", "--scale", "tiny", "--accelerator", "cpu", "--batches", "1,3",
                "--context", "16", "--warmup", "1", "--window", "2", "--out", str(sweep_json)])
    assert [r["batch"] for r in json.loads(sweep_json.read_text())["decode"]] == [1, 3]
    png = tmp_path / "pareto.png"
    summary = plot([sweep_json, out / "results.json"], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and all(s["front"] for s in summary)


def test_v4_flash_slice_tiny_end_to_end(tmp_path, monkeypatch):
    """``--shape v4-flash-slice --scale tiny`` on the CPU: prefill, decode through the graph runner's static
    per-group buffers (eager on a CPU) at each batch, and the reference-op baseline; the byte counts of the
    roofline by hand for the tiny widths (D 64, DI 16, window 8, CSA 4 with top-4, HCA 16, float32); with
    PROFILE=1 the kernel tables of decode b1 (replayed and eager) and of the prefill."""
    from benchmark import main
    from v4_suite import kv_bytes, suite_config

    from deepinfer_core.models.config_v4 import V4Config

    cfg = V4Config.from_dict(suite_config("tiny"))
    # per token at context 40: window 4 layers x 8 keys x 64 x 4 B; CSA 2 x 4 picks x 64 x 4 B + HCA 2 x 64 x 4 B;
    # indexer keys 2 x 10 x 16 x 4 B
    assert kv_bytes(cfg, 2, 40, 4) == {"window_kv": 2 * 8192, "compressed_kv": 2 * 2560, "indexer_keys": 2 * 1280}
    out = tmp_path / "v4"
    monkeypatch.setenv("PROFILE", "1")
    main(["--suite", "h200", "--shape", "v4-flash-slice", "--scale", "tiny", "--accelerator", "cpu", "--out", str(out),
          "--batches", "1,2", "--contexts", "40", "--prefill-len", "32", "--warmup", "1", "--window", "2",
          "--eager-batches", "1", "--baseline-batches", "1"])
    res = json.loads((out / "results.json").read_text())
    assert res["shape"] == "v4-flash-slice" and res["model_config"]["layer_types"] == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "compressed_sparse_attention"]
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(1, 40), (2, 40)]
    for r in res["decode"]:
        b = r["bytes"]
        assert r["step_ms"] > 0 and 0 < r["fraction"] < r["fraction_with_indexer"] < 1
        assert r["bytes_per_step"] == pytest.approx(b["dense"] + b["routed_experts"] + b["embedding"] + b["lm_head"]
                                                    + b["window_kv"] + b["compressed_kv"])
        assert b["window_kv"] == r["batch"] * 8192 and r["graphs"] is False
    assert res["decode"][0]["graphs_speedup"] > 0 and "graphs_speedup" not in res["decode"][1]
    (pre,) = res["prefill"]
    assert pre["prompt_len"] == 32 and pre["flops"]["total"] > pre["flops"]["weights"] > 0 and pre["fraction"] > 0
    base = res["baseline"]
    assert "transformers" in base["note"] and base["rows"][0]["batch"] == 1 and base["rows"][0]["speedup"] > 0
    for name in ("decode_b1_ctx40", "decode_b1_ctx40_eager", "prefill_32"):
        assert (out / f"{name}.kernels.txt").read_text().startswith(name)
        assert any(ev.get("cat") == "cpu_op"
                   for ev in json.loads(gzip.open(out / f"{name}.trace.json.gz").read())["traceEvents"])
    b1 = res["decode"][0]
    assert b1["profile"]["launches_per_step"] > 0 and b1["profile_eager"]["kernels"]
    assert "profile" not in res["decode"][1] and pre["profile"]["steps"] == 1
