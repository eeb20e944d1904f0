"""minipar: 3D-parallel LLM training (DP, TP, PP, ZeRO/AMSP) in small, readable, tested code.

Modules, one per paradigm, on shared foundations:
  dist   start-up (torchrun, Slurm, local launch) and the (dp, pp, tp) process grid
  comm   collectives that record their bytes and time
  p2p_order  a run's sends and receives, replayed under NCCL's rule (what would hang on a GPU)
  model  the GPT;  data  corpus, tokenizer, deterministic batches
  dp     data parallelism: naive, bucketed, overlapped
  tp     tensor parallelism (Megatron): f/g, column/row parallel, vocab-parallel, SP
  pp     pipeline parallelism: schedules as data, one executor
  zero   ZeRO-1/2/3 as presets of AMSP's (P, G, OS) sharding
  train  the trainer;  plan  the planner (torch-free; every closed-form volume lives there)
  bench  benchmarks against torch's own versions;  lab  the code behind the notebooks
  cli    what the command lines share (errors -> exit 2, number parsers, --help defaults)
  optim  LR schedule, global-norm clipping, weight decay;  pieces  a rank's state in serial names
  checkpoint  DCP checkpoints that move between layouts;  sample  text from a checkpoint
  smoke  one all-reduce on every rank: the first step of a cluster job
"""
__version__ = "0.1.0"
