"""CPU checks of ``kernels_cuda.moe_stream``'s size rules (which ``fused_moe`` calls take it, and its block rows);
its arithmetic is checked on the H200 (``tests/test_moe_stream_gpu.py``)."""

import torch


def test_moe_stream_dispatch_rules(monkeypatch):
    from kernels_cuda import _tl
    from kernels_cuda.moe_stream import MAX_MEAN_ROWS, applies, block_rows

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")
    bf, e = torch.bfloat16, torch.empty
    w13, w2 = e(66, 2 * 1408, 2048, dtype=bf), e(66, 2048, 1408, dtype=bf)  # V2-Lite, shared experts folded

    def call(T, k=8, dtype=bf, w13=w13, w2=w2):
        return applies(e(T, w13.shape[2], dtype=dtype), w13, w2, e(T, k, dtype=torch.long))

    assert MAX_MEAN_ROWS == 64
    assert all(call(T) for T in (9, 64, 256, 528)) and not call(529)  # 529 x 8 slots > 64 rows x 66 experts
    assert not call(0) and not call(64, dtype=torch.float32)
    assert not applies(e(64, 2048, dtype=bf), w13.float(), w2, e(64, 8, dtype=torch.long))
    assert not call(64, w13=e(66, 2 * 1400, 2048, dtype=bf), w2=e(66, 2048, 1400, dtype=bf))  # width 1400: not 64s
    assert call(64, w13=e(257, 2 * 2048, 7168, dtype=bf), w2=e(257, 7168, 2048, dtype=bf), k=9)  # V3
    # block rows: the mean rows per expert rounded up to 16 / 32 / 64
    assert [block_rows(T * 8, 66) for T in (9, 64, 132, 133, 256, 512)] == [16, 16, 16, 32, 32, 64]
