"""Whether the NPU graph being captured has its FIA host lengths updated before every replay.

FIA takes sequence lengths as host lists, which a captured graph would freeze. torch_npu 2.14's
documented remedy (``torch_npu/npu/graphs.py``: ``graph(..., auto_dispatch_capture=True)`` records
each FIA launch through its registered handler, ``_npugraph_handlers/ifa_handler.py``; then
``NPUGraph.update(cpu_update_input)`` rewrites the recorded ``actual_seq_qlen`` / ``actual_seq_kvlen``
before a replay) is used by ``AscendPlatform.graph_capture`` / ``graph_replay``, which set this flag
while capturing, so that ``kernels_ascend.attention`` takes FIA inside a capture only when its
lengths will be updated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_updated = False


def host_lengths_updated() -> bool:
    return _updated


@contextmanager
def updating_host_lengths() -> Iterator[None]:
    global _updated
    saved, _updated = _updated, True
    try:
        yield
    finally:
        _updated = saved
