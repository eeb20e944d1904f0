"""Published multi-node training runs, as data: what ran, on what, and what it measured.

Every row is a run its authors published with its layout, so the planner can be held to it
like for like (``scorecard``): the same model shape, hardware, framework, degrees, batch and
sequence; where the authors did not say (the micro-batch, interleaving, recomputation), the
row says so and ``scorecard`` lets the planner choose within what was published. A row
carries only what its authors published: no per-row setting tunes the planner to it (the
device memory of torchtitan's 96 GB H100s is what they published), and nothing in the
planner is fitted to these rows.

Sources, each row naming its own: Megatron-LM's README tables (H100, 2024; A100, 2021 with
Narayanan et al. 2021's splits), Korthikanti et al. 2022's Table 5 and abstract, llm-foundry's
benchmark tables, torchtitan's Llama 3.1 benchmarks (tokens/s and memory: their 500 W H100s
have no stated peak) and BLOOM-176B's slurm script and chronicles.

The rows live in ``anchors.csv`` beside this module, one run a line, in this order:

* Megatron-LM H100: the README's weak-scaling table (9 runs) and the strong-scaling ends of
  177B (96 and 4,608 GPUs, batch 1,152, the weak-scaling table's TP 8 x PP 6); GPT shapes
  with vocabulary 131,072, sequence 4,096 and an untied head;
* Megatron-LM A100 2021: the 2021 README's table, 10 runs, percent of peak (HFU) with full
  recomputation; GPT shapes with vocabulary 51,200 and sequence 2,048, tied head;
* Korthikanti: Table 5's iteration seconds, full recomputation against selective + SP (held
  as the MFU of the published time, our FLOP count), and the abstract's 530B on 2,240 GPUs
  (batch 2,240 our reading: 280 per pipeline, as Table 3). Narayanan et al. 2021 and
  Korthikanti et al. 2022 ran plain data parallelism (Megatron-LM's distributed optimizer
  is later), so their optimizer states are not sharded (shard 1-1-1);
* llm-foundry: the MPT rows run on 16 to 64 GPUs (FSDP FULL_SHARD across nodes), batch
  GPUs x micro-batch x gradient accumulation; the shapes are llm-foundry's MPT yamls (GELU
  MLP 4h, no biases, no dropout, tied head, vocabulary 50,368; the table's NumParams counts
  a position table, s x h, so the shape keeps one);
* torchtitan: Llama 3.1 8B (the ``llama3-8b`` preset), FSDP over 8 and 128 H100s: tokens/s
  per GPU (Tables 1, 3: their selective checkpointing is op-level, saving about half of the
  matmul outputs, which this planner does not model, so their memory is not held); and the
  peak reserved memory of Table 2's FSDP 8 x CP 1 row at 32,768 tokens with full
  checkpointing (Float8 linears, which keep bf16 activations; its throughput is Float8's
  and not held);
* BLOOM-176B: HFU 149 TFLOP/s over the A100's 312 (100 x 149 / 312).

Columns: ``group`` (the source, and the model where a source compares several runs of one),
``case``; the model shape (``model`` is its name, then the fields of ``shapes.ModelShape``;
1/0 for true/false); ``hardware`` and ``framework`` (a preset and a profile); ``gpus``,
``tp``, ``pp``, ``batch`` (sequences); ``metric`` (MFU, HFU, seconds, tokens/s per GPU or
memory (GiB)) and the ``published`` figure; what the authors published of the rest
(``micro_batch``, ``recompute``, ``v``, ``shard`` as s_p-s_g-s_os, ``flash``, ``sp``),
empty where they did not; ``chosen``: what ``scorecard`` lets the planner choose;
``memory_gib``: the published memory, where published; ``device_gib``: the device memory
the authors published where it differs from the preset's; ``source``.
"""
from __future__ import annotations

import csv
from pathlib import Path

from .shapes import ModelShape

DATA = Path(__file__).resolve().parent / "anchors.csv"
SHAPE = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
         "tied_head", "bias", "dropout", "global_batch_tokens")
ROW = ("group", "case", "shape", "hardware", "framework", "gpus", "tp", "pp", "batch",
       "metric", "published", "micro_batch", "recompute", "v", "shard", "flash", "sp",
       "chosen", "source", "memory_gib", "device_gib")
INTS = {"layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
        "global_batch_tokens", "gpus", "tp", "pp", "batch", "micro_batch", "v", "device_gib"}
FLOATS = {"published", "memory_gib"}
FLAGS = {"tied_head", "bias", "dropout", "flash", "sp"}


def _value(column: str, text: str):
    """One cell as its field's type; empty: not published (None)."""
    if text == "":
        return None
    if column in INTS:
        return int(text)
    if column in FLOATS:
        return float(text)
    if column in FLAGS:
        return text == "1"
    return tuple(int(x) for x in text.split("-")) if column == "shard" else text


def all_rows() -> list[dict]:
    """Every published multi-node run ``scorecard`` holds the planner to."""
    with open(DATA, newline="") as f:
        table = [{k: _value(k, v) for k, v in line.items()} for line in csv.DictReader(f)]
    return [{k: ModelShape(r["model"], **{f: r[f] for f in SHAPE}) if k == "shape" else r[k]
             for k in ROW} for r in table]
