"""The split-KV combine of ``kernels_cuda.v4_attention`` (plain torch, runs on the CPU): partial states
built the way the split kernel builds them, from contiguous runs of keys with every split's running max
starting at the sink, must merge into the one-pass softmax with the sink counted once; and the split
choice must leave large batches and prefill on the one-pass kernel."""

import math

import pytest
import torch

from kernels_cuda.v4_attention import BH, LOG2E, choose_splits, combine_splits


def _one_pass(scores, values, mask, sinks, scale):
    """softmax over [sink, keys] (masked keys dropped), the sink contributing no value: [T, H, D]."""
    s = torch.where(mask[:, None, :], scores * scale, torch.tensor(-math.inf, dtype=scores.dtype))
    logits = torch.cat((sinks[None, :, None].expand(s.shape[0], -1, 1), s), dim=-1)
    p = torch.softmax(logits, dim=-1)[..., 1:]
    return torch.einsum("thn,tnd->thd", p, values)


def _partials(scores, values, mask, sinks, scale, bounds):
    """Per split [lo, hi): the kernel's state after its keys: m (raw units, starts at sink / scale),
    l (starts at 0), unnormalised O, with exp2 in units of c = scale log2(e)."""
    c = scale * LOG2E
    T_, H, N = scores.shape
    os_, ms, ls = [], [], []
    for lo, hi in bounds:
        s = torch.where(mask[:, None, lo:hi], scores[..., lo:hi], torch.tensor(-math.inf, dtype=scores.dtype))
        m = torch.maximum(sinks[None, :] / scale, s.amax(-1) if hi > lo else torch.full((T_, H), -math.inf,
                                                                                            dtype=s.dtype))
        p = torch.exp2((s - m[..., None]) * c)
        os_.append(torch.einsum("thn,tnd->thd", p, values[:, lo:hi]))
        ms.append(m)
        ls.append(p.sum(-1))
    return torch.stack(os_, 1), torch.stack(ms, 1), torch.stack(ls, 1)


@pytest.mark.parametrize("bounds", [[(0, 64), (64, 128), (128, 192)], [(0, 100), (100, 192)], [(0, 192)],
                                    [(0, 7), (7, 8), (8, 192)]])
def test_combine_matches_one_pass_with_sink_once(bounds):
    g = torch.Generator().manual_seed(len(bounds))
    T_, H, N, D, scale = 3, 4, 192, 32, 32**-0.5
    scores = torch.randn(T_, H, N, generator=g, dtype=torch.float64) * 4
    values = torch.randn(T_, N, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(T_, N, generator=g) < 0.6
    mask[0] = False  # token 0: every key masked -> the sink takes all the mass, output 0
    mask[1, :64] = False  # token 1: the first split (and a whole run) fully masked
    mask[1, 100:] = False
    o, m, l_ = _partials(scores, values, mask, sinks, scale, bounds)
    out = combine_splits(o, m, l_, sinks, scale)
    want = _one_pass(scores, values, mask, sinks, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    assert out[0].abs().max() == 0


def test_split_choice_by_batch():
    sms, tiles = 132, 10  # H200; CSA at V4-Flash: 2 window tiles + 512 picks / 64
    assert choose_splits(1, 64, tiles, sms) == tiles  # 4 CTAs: one split per key tile
    assert choose_splits(16, 64, tiles, sms) == 5  # 64 CTAs -> ~2 per SM
    assert choose_splits(33, 64, tiles, sms) == 1  # 132 CTAs fill the chip
    assert choose_splits(256, 64, tiles, sms) == 1
    assert choose_splits(8192, 64, tiles, sms) == 1  # prefill
    assert choose_splits(1, BH, 1, sms) == 1  # nothing to split
