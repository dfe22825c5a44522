"""Shared fixtures: tiny random DeepSeek checkpoints (see ``tiny_models``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The tiny models run in microseconds per op; several intra-op threads on a small shared machine
# only add synchronisation (50x slower measured on 2 cores).
torch.set_num_threads(1)

from tiny_models import write_checkpoint  # noqa: E402

#: The default test model: DeepSeek-V3 style (noaux_tc routing with groups, a dense first layer, a
#: shared expert, q_lora, v_head_dim != qk_nope_head_dim) with a tokenizer.
TINY_V3 = dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)


#: The longest test files (seconds on CI's two cores), collected first: ``make test`` runs two workers, each
#: taking whole files in collection order (``pytest -n 2 --dist loadfile``), and a long file taken last would run
#: alone at the end.
SLOW_FIRST = ("test_kernels_cuda_compile.py", "test_parallel.py", "test_server.py", "test_v4_prefix.py",
              "test_pd_router_n.py", "test_dspark_confidence.py", "test_pdl_compile.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-shape op tests, whatever an earlier test set (use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory):
    """(checkpoint dir, the transformers model it was saved from)."""
    path, hf = write_checkpoint(tmp_path_factory.mktemp("tiny_v3"), "v3", seed=1, **TINY_V3)
    return path, hf


@pytest.fixture(scope="session")
def tiny_v3_path(tiny_v3) -> str:
    return str(tiny_v3[0])
