"""minipar: how LLMs are trained across many GPUs, in small code you can read, run and change.

The lessons, one paradigm each, in reading order (each with a notebook and an exercise):
  p2p_order    a ring all-reduce from send/recv; the order of sends NCCL can run (00, ex01)
  dp           data parallelism: naive, bucketed, overlapped (01, ex02)
  tp           tensor parallelism (Megatron): f/g, column/row, vocab-parallel, SP (02, ex03-04)
  schedules    pipeline schedules as data: GPipe, 1F1B, interleaved (03, ex05);  pp  the executor
  zero         ZeRO-1/2/3 as presets of AMSP's (s_p, s_g, s_os) sharding (04, ex06-07)
  parallelize  the composition: every paradigm applied to the GPT in one order (05)
  moe          mixture of experts and expert parallelism (08, ex08)
  cp           context parallelism: ring attention (09, ex09)
What they stand on: comm (collectives that record their bytes), mesh (named axes; parameter
groups), model (the GPT), data, precision (the policy; fp32 masters), rules (what a layout obeys).
Machinery, to skip on a first read: train (the trainer), wrappers (drop-ins for torch's DDP,
ZeroRedundancyOptimizer and FSDP2), runtime (start-up, launcher, command lines), plan (the
planner), bench, lab (the notebooks' code), exercises.
"""
__version__ = "0.1.0"
