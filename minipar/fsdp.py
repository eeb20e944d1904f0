"""ZeRO-3 with FSDP2's contract, ``fully_shard(module)``: the surface is
``minipar/wrappers/fsdp.py``, the algorithm ``minipar/zero.py``."""
from .wrappers.fsdp import ShardedDataParallel, fully_shard  # noqa: F401
