"""Shared skip logic of the GPU test files: they run on a CUDA device, or only compile their TileLang
kernels with ``DEEPINFER_TL_DRYRUN=1`` and no GPU (``examples/kernel_warm.py``)."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DRY = os.environ.get("DEEPINFER_TL_DRYRUN", "") not in ("", "0") and not HAS_CUDA


def _have_tilelang() -> bool:
    try:
        import tilelang  # noqa: F401
    except Exception:
        return False
    return True


#: pytestmark of a file whose tests run on a GPU or, in dry-run mode, compile their kernels
GPU_OR_DRY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA or DRY), reason="needs a CUDA device"),
    pytest.mark.skipif(not _have_tilelang(), reason="tilelang is not installed (pip install '.[cuda]')"),
]
