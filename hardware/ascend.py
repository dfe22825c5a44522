"""The Ascend platform: npu devices, HCCL, streams and events, NPU graphs, torch_npu kernels.

``torch_npu`` is imported lazily, only here and in ``kernels_ascend`` and only when the platform is
probed or used: an installed torch_npu without CANN makes ``import torch`` itself fail, so nothing
else may touch it. Every ``torch_npu.npu.*`` name used here is checked against the pinned wheel's
``torch_npu.npu.__all__`` (kernels_ascend/schemas/check.py).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from deepinfer_core.kv_cache_spec import KVCacheSpec
from deepinfer_core.platform import Availability, Platform


class AscendPlatform(Platform):
    name = "ascend"
    device_type = "npu"
    dist_backend = "hccl"
    kernel_backend = "ascend"
    core_api_version = "1.0"
    probe_priority = 20

    @classmethod
    def probe(cls) -> Availability:
        if importlib.util.find_spec("torch_npu") is None:
            return Availability.no("torch_npu is not installed (pip install torch-npu, with Ascend CANN)")
        if not (os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
                or os.path.isdir("/usr/local/Ascend")):
            return Availability.no("Ascend CANN toolkit not found (ASCEND_HOME_PATH unset, no /usr/local/Ascend)")
        try:
            import torch_npu

            n = torch_npu.npu.device_count()
        except Exception as exc:
            return Availability.no(f"torch_npu failed to load: {type(exc).__name__}: {exc}")
        if n == 0:
            return Availability.no("no Ascend NPU is visible (torch_npu.npu.device_count() == 0)")
        return Availability.yes()

    # ---- devices ------------------------------------------------------------------------
    def device_count(self) -> int:
        import torch_npu

        return torch_npu.npu.device_count()

    def device(self, index: int = 0) -> torch.device:
        return torch.device("npu", index)

    def set_device(self, index: int) -> None:
        import torch_npu

        torch_npu.npu.set_device(index)

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        import torch_npu

        return torch_npu.npu.mem_get_info(index)

    # ---- streams, events, sync ----------------------------------------------------------
    def synchronize(self, device: torch.device | None = None) -> None:
        import torch_npu

        torch_npu.npu.synchronize(device)

    def stream(self, device: torch.device | None = None) -> Any:
        import torch_npu

        return torch_npu.npu.Stream(device)

    def stream_context(self, stream: Any) -> AbstractContextManager:
        import torch_npu

        return torch_npu.npu.stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        import torch_npu

        return torch_npu.npu.Event(enable_timing=enable_timing)

    # ---- graphs -------------------------------------------------------------------------
    def supports_graph_capture(self) -> bool:
        return True

    def graph_capture_dtypes(self) -> tuple[torch.dtype, ...]:
        # kernels_ascend's decode ops never read device values on the host in these dtypes
        return (torch.bfloat16, torch.float16)

    def graph(self) -> Any:
        import torch_npu

        return torch_npu.npu.NPUGraph()

    @contextmanager
    def graph_capture(self, graph: Any, pool: Any = None) -> Iterator[None]:
        """Captures with ``auto_dispatch_capture``: every FIA launch is recorded with its host lengths
        (torch_npu/npu/graphs.py, _npugraph_handlers/ifa_handler.py), which :meth:`graph_replay`
        updates; kernels_ascend takes FIA inside the capture only under this flag."""
        import torch_npu

        from kernels_ascend.graph import updating_host_lengths

        with updating_host_lengths(), torch_npu.npu.graph(graph, pool=pool, auto_dispatch_capture=True):
            yield

    def graph_replay(self, graph: Any, seq_lens: list[int]) -> None:
        # one update dict is applied to every recorded FIA launch (NPUGraph.update, update_capture_record):
        # a decode graph's launches, one per layer, all read the step's KV lengths (one query each)
        graph.update([{"actual_seq_kvlen": seq_lens}])
        graph.replay()

    # ---- numerics and memory ------------------------------------------------------------
    def preferred_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def kv_cache_planes(self, spec: KVCacheSpec) -> tuple[int, ...]:
        # MLA's latent and rope key as two paged caches: the layout FIA's MLA mode reads with block_table
        # (docs: npu_fused_infer_attention_score_v2, 参数说明 key/value and query_rope/key_rope)
        return spec.parts if spec.parts else (spec.entry_dim,)

    def linear_weight_layout(self, w: torch.Tensor) -> torch.Tensor:
        # Expert stacks [E, N, K] are stored K-major so that kernels_ascend.moe reads
        # w.transpose(1, 2) ([E, K, N], what npu_grouped_matmul multiplies by) as a contiguous tensor.
        if w.dim() == 3 and w.is_floating_point():
            return w.transpose(-1, -2).contiguous().transpose(-1, -2)
        return w

    def supports_pinned_memory(self) -> bool:
        return True

    def supports_async_overlap(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        # mla_cache_planes: kv_cache_planes splits the MLA latent cache (latent, rope) for FIA; fia_in_graphs:
        # decode graphs capture FIA and update its host lengths per replay (graph_replay). Nothing here
        # has run on an NPU yet: checked by schema and CPU emulation only (docs/ascend.md)
        return {**super().describe(), "mla_cache_planes": True, "fia_in_graphs": True, "verified_on_hardware": False}
