"""The drop-in wrappers' compatibility surface: what makes minipar's DP, ZeRO and FSDP take the
place of torch's ``DistributedDataParallel``, ``ZeroRedundancyOptimizer`` and FSDP2's
``fully_shard`` in a user's own script. The algorithms are the lessons (``minipar.dp``,
``minipar.zero``), which import nothing from here; here: DDP's constructor arguments
(``ddp.DataParallel``), torch's optimizer shape and state dicts for ZeRO-1/2
(``zero_optimizer.ShardedOptimizer``) and FSDP2's contract (``fsdp``, also ``minipar.fsdp``)::

    from minipar.wrappers import DataParallel as DDP
    from minipar.wrappers import ShardedOptimizer as ZeroRedundancyOptimizer
    from minipar.wrappers import fully_shard
"""
from .ddp import DataParallel  # noqa: F401
from .fsdp import FSDPModule, clip_grad_norm_, fully_shard  # noqa: F401
from .zero_optimizer import ShardedOptimizer  # noqa: F401
