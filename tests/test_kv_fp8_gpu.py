"""GPU conformance of the FP8 latent KV cache kernels (``kernels_cuda.kv_cache`` FP8 write and
``kernels_cuda.mla_decode`` over FP8 rows) at real-model shapes the kit does not reach: 656-byte rows, 16 and
128 heads, pages of 16 and 64, long contexts (split-KV + combine), ragged multi-token queries, and
graph capture. The kit's own FP8 cases run in ``test_kernels_cuda_gpu.py::test_conformance_kit``.

With ``DEEPINFER_TL_DRYRUN=1`` and no GPU the same calls only compile their kernels."""

import math

import pytest
import torch
from gpu_marks import DRY, GPU_OR_DRY, HAS_CUDA

from kernels_cpu import ops as ref
from kernels_cpu.kv_fp8 import quantize_latent_rows, row_bytes

pytestmark = GPU_OR_DRY
DEV = "cuda" if HAS_CUDA else "cpu"
L, R = 512, 64
W = row_bytes(L, R)  # 656


def fp8_paged(seq_lens, bs, seed=0):
    """A cache of FP8 rows (random latents quantised by the reference) and block tables padded with -1."""
    g = torch.Generator().manual_seed(seed)
    per = [max(1, math.ceil(n / bs)) for n in seq_lens]
    nb = sum(per) + 5
    order = torch.randperm(nb, generator=g)
    tables = torch.full((len(seq_lens), max(per) + 3), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per):
        tables[b, :n] = order[used:used + n]
        used += n
    rows = quantize_latent_rows(torch.randn(nb * bs, L + R, generator=g) * 2, W)
    return rows.view(nb, bs, W).to(DEV), tables.to(DEV)


CASES = [
    # label, heads, block size, q_lens, seq_lens, n_split (None: automatic)
    ("V2-Lite heads, bs16, decode", 16, 16, [1] * 6, [1, 15, 16, 17, 999, 2500], None),
    ("V2-Lite heads, bs64, decode", 16, 64, [1] * 5, [1, 63, 64, 65, 3001], None),
    ("V2-Lite heads, bs64, ragged (MTP)", 16, 64, [1, 3, 2, 4], [9, 3, 300, 1200], None),
    ("V2-Lite heads, bs64, one 32k context", 16, 64, [1], [32768], None),
    ("V3 heads, bs64, forced split", 128, 64, [1] * 3, [5, 700, 2000], 7),
    ("V3 heads, bs64, decode", 128, 64, [1] * 4, [1, 64, 65, 4097], None),
    ("V2-Lite heads, bs64, batch 1, 1 key", 16, 64, [1], [1], None),
    ("V2-Lite heads, bs64, batch 1, 63 keys", 16, 64, [1], [63], None),
    ("V2-Lite heads, bs64, batch 1, 65 keys", 16, 64, [1], [65], None),
    ("V2-Lite heads, bs64, batch 1, 4100 keys", 16, 64, [1], [4100], None),
    ("V2-Lite heads, bs16, ragged batch", 16, 16, [3, 1, 2], [70, 4096, 64], None),
    ("V2-Lite heads, bs64, batch 130 (one wave: no split)", 16, 64, [1] * 130, [1 + 37 * i for i in range(130)], None),
]

#: (heads, tile configuration) besides the defaults (16 heads: 64-key tiles, 8 consumer warps; 128 heads: the
#: warp-specialised kernel): the old 16-head default, 32-key tiles, V3's heads in 32-head tiles, and 16 heads
#: through the warp-specialised kernel
CFGS = [(16, {"BH": 16, "BN": 64, "stages": 2, "threads": 128}),
        (16, {"BH": 16, "BN": 32, "stages": 2, "threads": 128}),
        (128, {"BH": 32, "BN": 64, "stages": 2, "threads": 256}),
        (16, {"kernel": "ws", "BH": 64, "BN": 64}),  # the warp-specialised kernel, heads padded to 64
        (16, {"BH": 16, "BN": 64, "stages": 2, "threads": 256, "mma": "float16"})]  # f16 tiles and tensor cores


def _cfg_id(c):
    if isinstance(c, int):
        return f"H{c}"
    return f"BH{c['BH']}-BN{c['BN']}-" + c.get("kernel", f"t{c.get('threads')}") + ("-f16" if c.get("mma") else "")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mla_decode_fp8_real_shapes(case):
    from kernels_cuda.mla_decode import mla_decode

    _, H, bs, q_lens, seq_lens, n_split = case
    cache, tables = fp8_paged(seq_lens, bs)
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(sum(q_lens), H, L + R, generator=g)).to(torch.bfloat16).to(DEV)
    cu = torch.tensor([0, *q_lens], device=DEV).cumsum(0)
    sl = torch.tensor(seq_lens, device=DEV)
    scale = 192 ** -0.5
    out = mla_decode(q, cache, tables, cu, sl, scale, L, n_split=n_split)
    if DRY:
        return
    truth = ref.mla_decode(q.float(), cache, tables.clamp_min(0), cu, sl, scale, L)
    o, r = out.double().cpu(), truth.double().cpu()
    assert o.shape == r.shape and torch.isfinite(o).all()
    bound = 2e-2 * (r.abs() + r.pow(2).mean().sqrt())
    worst = ((o - r).abs() / bound).max().item()
    assert worst <= 1.0, f"{case[0]}: {worst:.2f}x the bf16 tolerance"


@pytest.mark.parametrize("heads,cfg", CFGS, ids=_cfg_id)
@pytest.mark.parametrize("seq_lens", [[1, 63, 64, 65], [5000]], ids=str)
def test_mla_decode_fp8_tile_configs(heads, cfg, seq_lens):
    from kernels_cuda.mla_decode import mla_decode

    cache, tables = fp8_paged(seq_lens, 64, seed=2)
    q = (torch.randn(len(seq_lens), heads, L + R, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    q = q.to(DEV)
    cu = torch.arange(len(seq_lens) + 1, device=DEV)
    sl = torch.tensor(seq_lens, device=DEV)
    out = mla_decode(q, cache, tables, cu, sl, 0.1, L, cfg=cfg)
    if DRY:
        return
    truth = ref.mla_decode(q.float(), cache, tables.clamp_min(0), cu, sl, 0.1, L)
    o, r = out.double().cpu(), truth.double().cpu()
    assert torch.isfinite(o).all()
    worst = ((o - r).abs() / (2e-2 * (r.abs() + r.pow(2).mean().sqrt()))).max().item()
    assert worst <= 1.0, f"{cfg}: {worst:.2f}x the bf16 tolerance"


@pytest.mark.parametrize("bs", [16, 64])
def test_paged_kv_write_fp8_is_bit_exact(bs):
    from kernels_cuda.kv_cache import paged_kv_write

    g = torch.Generator().manual_seed(bs)
    T, NB = 300, 40
    kv = torch.randn(T, L + R, generator=g) * torch.logspace(-6, 3, T)[:, None]
    kv[0] = 0
    kv[1, 7], kv[2, 300], kv[3, 9] = float("inf"), -float("inf"), float("nan")
    kv = kv.to(torch.bfloat16)
    slots = torch.randperm(NB * bs, generator=g)[:T]
    slots[::7] = -1
    cache = torch.randint(0, 255, (NB, bs, W), generator=g, dtype=torch.uint8)
    want = cache.clone()
    ref.paged_kv_write(want, slots, kv)
    got = cache.to(DEV)
    paged_kv_write(got, slots.to(DEV), kv.to(DEV))
    if not DRY:
        assert torch.equal(got.cpu(), want)


def test_mla_decode_fp8_graph_capture():
    if DRY:
        pytest.skip("needs a GPU")
    from kernels_cuda.mla_decode import mla_decode

    seq_lens = [100, 2000, 37]
    cache, tables = fp8_paged(seq_lens, 64)
    q = torch.randn(3, 16, L + R, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(4, device=DEV)
    sl = torch.tensor(seq_lens, device=DEV)
    mla_decode(q, cache, tables, cu, sl, 0.1, L)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = mla_decode(q, cache, tables, cu, sl, 0.1, L)
    q.copy_(torch.randn(3, 16, L + R, device=DEV, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(mla_decode(q, cache, tables, cu, sl, 0.1, L), out_g)
