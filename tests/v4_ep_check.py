"""Rank body of the V4 expert-parallel check (spawned by ``test_deepseek_v4.py``): every rank holds
half of the routed experts of a tiny V4 checkpoint and runs each MoE layer through
``ExpertParallel``; the result must equal the single-process MoE over all experts."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist


def ep_rank(rank: int, world_size: int, port: int, path: str) -> None:
    from deepinfer_core.communicator import TorchDistCommunicator
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer_core.models.loader import SafetensorsReader
    from deepinfer_core.parallel.expert_parallel import ExpertParallel
    from kernels_cpu import ReferenceKernels

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        cfg = DeepseekV4ForCausalLM.parse_config(json.loads((Path(path) / "config.json").read_text()))
        k = Kernels(ReferenceKernels, ReferenceKernels)
        E = cfg.n_routed_experts
        per = E // world_size

        def build(expert_range):
            m = DeepseekV4ForCausalLM.create(k, cfg, torch.float32, torch.device("cpu"), 64, expert_range)
            m.load_weights(SafetensorsReader(Path(path)))
            return m

        full, part = build(None), build((rank * per, (rank + 1) * per))
        moes = [m for m in part.modules() if hasattr(m, "local_experts")]  # as the EP worker finds them
        ExpertParallel(TorchDistCommunicator(), E, moes, torch.device("cpu"))
        g = torch.Generator().manual_seed(10 + rank)
        T = 0 if rank == 1 else 7 + rank  # uneven, one rank without tokens
        x = torch.randn(T, cfg.hidden_size, generator=g)
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
        with torch.no_grad():
            for i, layer in enumerate(part.layers):  # hash and learned layers
                got, want = layer.ffn(x, ids), full.layers[i].ffn(x, ids)
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                    raise AssertionError(f"rank {rank} layer {i}: expert-parallel MoE differs by "
                                         f"{(got - want).abs().max().item():.3g}")
    finally:
        dist.destroy_process_group()
