"""First contact with a real Ascend NPU (Atlas A2/A3, CANN and torch_npu installed): what the CPU
emulation could not prove. Nothing here has been run yet (docs/ascend.md).

    DEEPINFER_ACCELERATOR=ascend python examples/ascend_check.py

1. the conformance kit on the NPU for every op kernels_ascend overrides (float32, bfloat16, float16),
   latent caches in the platform's planes;
2. the FIA paths at DeepSeek sizes (MLA decode over the latent/rope planes: 512 + 64, block sizes 16
   and 128, ragged queries; prefill: TND with qk 192 / v 128) against the reference ops;
3. the engine on the embedded model in bfloat16, eager against NPU-graph decode: same tokens.
"""

from __future__ import annotations

import math
import time

import torch


def _close(name: str, out: torch.Tensor, truth: torch.Tensor, rtol: float = 2e-2) -> None:
    out, truth = out.detach().cpu().double(), truth.double()
    err = (out - truth).abs()
    bound = rtol * (truth.abs() + truth.pow(2).mean().sqrt())
    status = "ok" if bool((err <= bound).all()) else "FAILED"
    print(f"  {name}: max error {err.max().item():.3e} ({status})")
    if status != "ok":
        raise SystemExit(1)


def fia_at_deepseek_sizes(dev: torch.device) -> None:
    from kernels_ascend import attention
    from kernels_cpu import ops as ref

    g = torch.Generator().manual_seed(0)
    for bs in (16, 128):
        for q_lens in ([1] * 8, [1, 3, 16, 2]):
            seq_lens = [5 + 37 * i for i in range(len(q_lens))]
            per = [math.ceil(n / bs) for n in seq_lens]
            nb = sum(per) + 4
            tables = torch.randperm(nb, generator=g)[: sum(per)].split(per)
            width = max(per)
            bt = torch.zeros(len(per), width, dtype=torch.int32)
            for b, t in enumerate(tables):
                bt[b, : len(t)] = t
            cache = (torch.randn(nb, bs, 576, generator=g) * 0.5).bfloat16()
            q = torch.randn(sum(q_lens), 128, 576, generator=g).bfloat16()
            cu = torch.tensor([0, *q_lens]).cumsum(0)
            args = (q, cache, bt, cu, torch.tensor(seq_lens), 576**-0.5, 512)
            planes = (cache[..., :512].contiguous().to(dev), cache[..., 512:].contiguous().to(dev))  # the layout
            dev_args = (q.to(dev), planes, *(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args[2:]))
            out = attention.mla_decode(*dev_args)
            _close(f"mla_decode bs={bs} q_lens={q_lens}", out, ref.mla_decode(q.float(), cache.float(), *args[2:]))
    q_lens, k_lens = [7, 1, 33], [7, 40, 33]
    q = torch.randn(sum(q_lens), 16, 192, generator=g).bfloat16()
    k = torch.randn(sum(k_lens), 16, 192, generator=g).bfloat16()
    v = torch.randn(sum(k_lens), 16, 128, generator=g).bfloat16()
    cq, ck = torch.tensor([0, *q_lens]).cumsum(0), torch.tensor([0, *k_lens]).cumsum(0)
    out = attention.mla_prefill(q.to(dev), k.to(dev), v.to(dev), cq.to(dev), ck.to(dev), 192**-0.5)
    _close("mla_prefill TND 192/128", out, ref.mla_prefill(q.float(), k.float(), v.float(), cq, ck, 192**-0.5))


def engine_graphs_vs_eager() -> None:
    from deepinfer_core import LLM, SamplingParams

    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range("]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(dtype="bfloat16", accelerator="ascend", enforce_eager=eager, max_num_seqs=8)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        print(f"  enforce_eager={eager}: {time.perf_counter() - t0:.2f} s, graphs: "
              f"{llm.engine.runner.graphs_off_reason or 'captured'}")
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
    print("  eager and graph decode give the same tokens:", tokens[True] == tokens[False])
    if tokens[True] != tokens[False]:
        raise SystemExit(1)


def main() -> None:
    from deepinfer_core.selection import select_platform
    from deepinfer_core.testing import check_kernel_backend
    from kernels_ascend import AscendKernels

    platform = select_platform("ascend")  # raises with the reason when torch_npu/CANN/NPU is missing
    dev = platform.device(0)
    print("1. conformance kit on", dev)
    checked = check_kernel_backend(AscendKernels, dev, (torch.float32, torch.bfloat16, torch.float16),
                                   planes=platform.kv_cache_planes)
    print(f"  {len(checked)} (op, dtype) pairs conform")
    print("2. FIA at DeepSeek sizes")
    fia_at_deepseek_sizes(dev)
    print("3. engine: eager vs NPU graphs")
    engine_graphs_vs_eager()


if __name__ == "__main__":
    main()
