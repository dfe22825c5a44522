"""toyaccel against DeepInfer's conformance kit: `pip install .` then `pytest tests`."""

import pytest
import torch
from deepinfer_toyaccel.kernels import ToyAccelKernels

from deepinfer_core.selection import select_platform
from deepinfer_core.testing import check_kernel_backend, check_op, kernel_conformance_cases

DEVICE = "cpu"  # the toy's "device"; a real accelerator passes its own, e.g. "xpu"


@pytest.mark.parametrize("op,dtype", kernel_conformance_cases(ToyAccelKernels))
def test_op_matches_reference(op, dtype):
    check_op(ToyAccelKernels, op, dtype, device=DEVICE)


def test_whole_backend_in_one_call():
    checked = check_kernel_backend(ToyAccelKernels, DEVICE, dtypes=(torch.float32,))
    assert checked == [("rms_norm", torch.float32), ("silu_and_mul", torch.float32)]


def test_platform_is_selectable_by_name():
    platform = select_platform("toyaccel")
    assert (platform.name, platform.kernel_backend) == ("toyaccel", "toyaccel")
