"""ZeRO-3 with FSDP2's contract, ``fully_shard(module)`` in place: the surface is
``minipar/wrappers/fsdp.py``, the algorithm ``minipar/zero.py``."""
from .wrappers.fsdp import FSDPModule, clip_grad_norm_, fully_shard  # noqa: F401
