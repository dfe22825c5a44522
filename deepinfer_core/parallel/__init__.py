"""Data-parallel attention with expert-parallel MoE over ``torch.distributed`` (``LLM(dp=N, ep=N)``).

See ``README.md`` in this package for single-machine and ``torchrun`` (multi-node) use.
"""

from deepinfer_core.parallel.expert_parallel import ExpertParallel, combine, migrate_layer, transfer_plan
from deepinfer_core.parallel.launcher import (
    DPLoadBalancer,
    ParallelEngine,
    WorkerFailure,
    check_parallel_config,
)

__all__ = ["DPLoadBalancer", "ExpertParallel", "ParallelEngine", "WorkerFailure", "check_parallel_config",
           "combine", "migrate_layer", "transfer_plan"]
