"""Greedy sampling's reductions over the vocabulary on one GPU: the device time (CUDA-graph replays) of the
greedy draw and the chosen token's logprob as torch's ``argmax`` and ``logsumexp`` over each row (what
``engine/sampler.py`` ran before ``greedy_sample``), the same in two stages (the row cut into chunks reduced in
parallel, then the chunks' results), and the CUDA backend's ``greedy_sample`` (one launch: ``kernels_cuda/
sampling.py``); whether they give the same tokens.

At batch 1 the one-stage reductions over 102,400 logits ran about 45 us a step in the V2-Lite b1 kernel table
(``docs/h200/s12/bf16_b1_after.kernels.txt``: ``reduce_kernel`` ArgMax 22.6, sum 11.5, max 10.5 us).

    python examples/sample_bench.py [--vocab 102400] [--rows 1,8,64] [--chunks 200]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_stage(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tok = x.argmax(-1)
    return tok, x.gather(1, tok[:, None])[:, 0] - torch.logsumexp(x, -1)


def two_stage(x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, V = x.shape
    v = x.view(R, chunks, V // chunks)
    m1, i1 = v.max(-1)  # [R, chunks]: each chunk's max and its first index
    j = m1.argmax(-1)  # the first chunk holding the row's max
    tok = j * (V // chunks) + i1.gather(1, j[:, None])[:, 0]
    lse = torch.logsumexp(torch.logsumexp(v, -1), -1)
    return tok, x.gather(1, tok[:, None])[:, 0] - lse


def main() -> None:
    from mla_decode_bench import graph_us  # noqa: PLC0415  (examples/, on the path as this script's folder)

    from kernels_cuda.sampling import greedy_sample  # noqa: PLC0415

    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--chunks", type=int, default=200)
    args = ap.parse_args()
    assert args.vocab % args.chunks == 0
    for R in map(int, args.rows.split(",")):
        x = torch.randn(R, args.vocab, device="cuda") * 4
        a, b, c = one_stage(x), two_stage(x, args.chunks), greedy_sample(x)
        same = bool((a[0] == b[0]).all()) and bool((a[0] == c[0]).all())
        err = max((a[1] - b[1]).abs().max().item(), (a[1] - c[1]).abs().max().item())
        t1 = graph_us(lambda x=x: one_stage(x), 10, 200)
        t2 = graph_us(lambda x=x: two_stage(x, args.chunks), 10, 200)
        t3 = graph_us(lambda x=x: greedy_sample(x), 10, 200)
        t_arg = graph_us(lambda x=x: x.argmax(-1), 10, 200)
        t_lse = graph_us(lambda x=x: torch.logsumexp(x, -1), 10, 200)
        print(f"rows {R:3d}: one stage {t1:6.2f} us (argmax {t_arg:5.2f}, logsumexp {t_lse:5.2f}), two stages "
              f"{t2:6.2f} us, greedy_sample {t3:6.2f} us ({R * args.vocab * 4 / t3 / 1e3:.0f} GB/s); same tokens "
              f"{same}, logprob max diff {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
