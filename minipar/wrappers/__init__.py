"""The drop-in wrappers' compatibility surface: what makes minipar's DP, ZeRO and FSDP take the
place of torch's ``DistributedDataParallel``, ``ZeroRedundancyOptimizer`` and FSDP2's
``fully_shard`` in a user's own script. The algorithms are the lessons (``minipar.dp``,
``minipar.zero``); here: state dicts in torch's layouts and FSDP2's contract (``fsdp``).
"""
