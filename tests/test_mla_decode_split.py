"""The MLA decode split policy (``kernels_cuda.mla_decode.choose_split``), on the CPU: a pure function of the
grid's shape (so fixed per CUDA-graph bucket), filling one wave when the grid is short of it and packing
waves when it is a little over."""

import math

import pytest

from kernels_cuda.mla_decode import MAX_SPLIT, choose_split

SMS = 132  # H100/H200 SXM


def waves_used(n_ctas: int, s: int) -> float:
    """The share of the launched waves' SM slots that hold a CTA."""
    return s * n_ctas / (math.ceil(s * n_ctas / SMS) * SMS)


@pytest.mark.parametrize("n_ctas,want", [(1, 64), (8, 16), (64, 2), (128, 1), (151, 6), (256, 1), (1024, 1)])
def test_choice_at_known_grids(n_ctas, want):
    # batch 1 with V2-Lite's 16 heads: the most splits (how many get keys is decided on the device);
    # 151 requests (the FP8 max batch at 32k): 6 splits, 906 CTAs in 7 waves, not 2 waves of which
    # the second is 14% full
    assert choose_split(n_ctas, SMS) == want


@pytest.mark.parametrize("n_ctas", range(1, 400))
def test_every_grid_gets_a_valid_and_well_packed_split(n_ctas):
    s = choose_split(n_ctas, SMS)
    assert 1 <= s <= MAX_SPLIT
    if s > 1:  # a split count pays for itself: fewer modelled waves per unit of work than no split
        assert math.ceil(s * n_ctas / SMS) / s < math.ceil(n_ctas / SMS)
    assert waves_used(n_ctas, s) >= min(0.75, waves_used(n_ctas, 1)) or s == MAX_SPLIT


def test_more_sms_never_means_fewer_ctas_in_flight():
    for n_ctas in (1, 8, 64, 151):
        assert choose_split(n_ctas, 2 * SMS) * n_ctas >= min(choose_split(n_ctas, SMS) * n_ctas, 2 * SMS)
