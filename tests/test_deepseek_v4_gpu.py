"""DeepSeek-V4 on a CUDA device with the reference ops (the kernels a GPU backend does not override
yet): the same chunked prefill + decode as ``test_deepseek_v4.py`` against transformers on the CPU.
Run on a GPU machine: ``pytest -q tests/test_deepseek_v4_gpu.py``."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import rand_ids
from tiny_v4 import build_separated, save_checkpoint
from v4_harness import Harness

from deepinfer_core.kernels import Kernels
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.models.loader import SafetensorsReader
from kernels_cpu import ReferenceKernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("variant", ["mixed", "hca_sigmoid_hc2"])
def test_cuda_matches_transformers(variant, tmp_path):
    prompts = [rand_ids(n, 200 + i) for i, n in enumerate((45, 61))]
    hf, _ = build_separated(variant, prompts)
    path = save_checkpoint(hf, tmp_path / variant)
    cfg = DeepseekV4ForCausalLM.parse_config(json.loads((path / "config.json").read_text()))
    model = DeepseekV4ForCausalLM.create(Kernels(ReferenceKernels, ReferenceKernels), cfg, torch.float32,
                                         torch.device("cuda"), 256)
    model.load_weights(SafetensorsReader(path))
    h = Harness(model, 16, 96, 2, device="cuda")
    out = torch.cat([h.step([(0, prompts[0][:13]), (1, prompts[1][:30])]).cpu(),
                     h.step([(0, prompts[0][13:]), (1, prompts[1][30:])]).cpu()])
    order = list(range(13)) + list(range(43, 43 + 32)) + list(range(13, 43)) + list(range(75, 106))
    mine = torch.log_softmax(model.logits(out[order].cuda()).cpu(), -1)
    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(hf(torch.tensor([p]), use_cache=False).logits[0], -1) for p in prompts])
    assert (mine - ref).abs().max().item() < 1e-3
