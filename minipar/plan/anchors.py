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
"""
from __future__ import annotations

from .shapes import ModelShape

# --------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------
def _megatron_h100(name, heads, hidden, layers):
    return ModelShape(name, "gpt", layers, hidden, heads, 131072, 4096, tied_head=False)


def _megatron_a100(name, heads, hidden, layers):
    return ModelShape(name, "gpt", layers, hidden, heads, 51200, 2048)


def _mpt(name, heads, hidden, layers):
    # llm-foundry's MPT yamls: GELU MLP 4h, no biases, no dropout, tied head, vocabulary
    # 50,368; the table's NumParams counts a position table (s x h), so the shape keeps one
    return ModelShape(name, "gpt", layers, hidden, heads, 50368, 2048, tied_head=True,
                      bias=False, dropout=False)


MEGATRON_README = ("NVIDIA/Megatron-LM README, images/model_table.png (commit 937571cf, "
                   "Megatron-Core r0.8.0): H100, vocabulary 131072, sequence 4096")
MEGATRON_2021 = ("NVIDIA/Megatron-LM README of 2021 (commit 50a4b5fa, "
                 "images/cases_april2021.png); TP x PP split and heads from Narayanan et al. "
                 "2021 (SC'21), Table 1")
KORTHIKANTI = ("Korthikanti et al. 2022 (arXiv 2205.05198), Table 5 (iteration times, "
               "DP = 1) with Table 3's configurations")
FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7c)")
TITAN = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3")
BLOOM = ("bigscience-workshop/bigscience train/tr11-176B-ml/tr11-176B-ml.slurm (TP 4, PP 12, "
         "micro-batch 2, global batch 2048, --checkpoint-activations, ZeRO-1 equivalent) and "
         "chronicles.md ('back at running at ~149TFLOPs')")

BLOOM_176B = ModelShape("bloom-176b", "gpt", 70, 14336, 112, 250880, 2048)


def _row(group, case, shape, hardware, framework, gpus, tp, pp, batch, metric, published, *,
         micro_batch=None, recompute=None, v=None, shard=None, flash=False, sp=None,
         chosen="micro-batch, interleaving and recomputation", source="",
         memory_gib=None, device_gib=None):
    """One published run (module docstring); ``device_gib``: the device memory the authors
    published where it differs from the preset's."""
    return dict(group=group, case=case, shape=shape, hardware=hardware, framework=framework,
                gpus=gpus, tp=tp, pp=pp, batch=batch, metric=metric, published=published,
                micro_batch=micro_batch, recompute=recompute, v=v, shard=shard, flash=flash,
                sp=sp, chosen=chosen, source=source, memory_gib=memory_gib,
                device_gib=device_gib)


# Narayanan et al. 2021 and Korthikanti et al. 2022 ran plain data parallelism (Megatron-LM's
# distributed optimizer is later), so their optimizer states are not sharded
PLAIN_DP = dict(shard=(1, 1, 1))


def megatron_h100() -> list[dict]:
    """The README's weak-scaling table (9 runs) and the strong-scaling ends of 177B."""
    rows = []
    table = [("1.7B", 16, 2048, 24, 1, 1, 48, 192, 41), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 47),
             ("16B", 48, 6144, 32, 4, 1, 192, 192, 49), ("32B", 56, 7168, 48, 8, 1, 384, 192, 46),
             ("70B", 64, 8192, 84, 8, 2, 768, 384, 42), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 43),
             ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 44),
             ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 48), ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 47)]
    for name, a, h, l, t, p, gpus, batch, mfu in table:
        rows.append(_row("Megatron-LM H100", f"GPT {name} on {gpus} H100 (Megatron-LM)",
                         _megatron_h100(f"gpt-{name.lower()}", a, h, l), "dgx-h100",
                         "megatron-lm", gpus, t, p, batch, "MFU", float(mfu), flash=True,
                         source=MEGATRON_README))
    strong = _megatron_h100("gpt-177b", 96, 12288, 96)
    for gpus, mfu in ((96, 47.0), (4608, 42.0)):
        rows.append(_row("Megatron-LM H100 strong", f"GPT 177B on {gpus} H100, batch 1152 "
                         f"(strong scaling)", strong, "dgx-h100", "megatron-lm", gpus, 8, 6,
                         1152, "MFU", mfu, flash=True,
                         source="NVIDIA/Megatron-LM README, strong-scaling text: '96 H100 "
                                "GPUs to 4,608 GPUs, using the same batch size of 1,152 "
                                "sequences ... MFU from 47% to 42%'; the layout (TP 8, PP 6) "
                                "of the weak-scaling table's 177B row"))
    return rows


def megatron_a100() -> list[dict]:
    """The 2021 README's table: 10 runs, percent of peak with full recomputation."""
    table = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 44), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 44),
             ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 46), ("18B", 48, 6144, 40, 8, 1, 256, 1024, 43),
             ("39B", 64, 8192, 48, 8, 2, 512, 1536, 44), ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 45),
             ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 47),
             ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 50),
             ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 52),
             ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 52)]
    return [_row("Megatron-LM A100 2021", f"GPT {name} on {gpus} A100 (Megatron-LM, 2021)",
                 _megatron_a100(f"gpt-{name.lower()}", a, h, l), "dgx-a100", "megatron-lm",
                 gpus, t, p, batch, "HFU", float(pct), recompute="full",
                 chosen="micro-batch and interleaving", source=MEGATRON_2021, **PLAIN_DP)
            for name, a, h, l, t, p, gpus, batch, pct in table]


def korthikanti() -> list[dict]:
    """Table 5: iteration seconds, full recomputation against selective + SP (as MFU of the
    published time, our FLOP count), and the abstract's 530B on 2,240 GPUs."""
    rows = []
    table = [("22B", 64, 6144, 48, 1, 4, 1.42, 1.10), ("175B", 96, 12288, 96, 8, 64, 18.13, 13.75),
             ("530B", 128, 20480, 105, 35, 280, 49.05, 37.83), ("1T", 160, 25600, 128, 64, 512, 94.42, 71.49)]
    for name, a, h, l, p, batch, full, selective in table:
        shape = _megatron_a100(f"gpt-{name.lower()}", a, h, l)
        for mode, seconds in (("full", full), ("selective", selective)):
            rows.append(_row(f"Korthikanti {name}", f"GPT {name}, TP 8 x PP {p}, {mode} "
                             f"recomputation{' + SP' if mode == 'selective' else ''}", shape,
                             "dgx-a100", "megatron-lm", 8 * p, 8, p, batch, "seconds",
                             seconds, micro_batch=1, recompute=mode, v=1,
                             sp=mode == "selective", chosen="nothing",
                             source=KORTHIKANTI, **PLAIN_DP))
    shape = _megatron_a100("gpt-530b", 128, 20480, 105)
    for mode, mfu in (("full", 42.1), ("selective", 54.2)):
        rows.append(_row("Korthikanti 530B at 2240", f"GPT 530B on 2240 A100, TP 8 x PP 35 x "
                         f"DP 8, {mode} recomputation", shape, "dgx-a100", "megatron-lm", 2240,
                         8, 35, 2240, "MFU", mfu, micro_batch=1, recompute=mode,
                         sp=mode == "selective", chosen="interleaving", **PLAIN_DP,
                         source="Korthikanti et al. 2022, abstract: 530B on 2,240 A100s, MFU "
                                "54.2% (selective + SP) against 42.1% (full); batch 2,240 "
                                "sequences our reading (280 per pipeline, as Table 3)"))
    return rows


def foundry() -> list[dict]:
    """MPT rows run on 16 to 64 GPUs (FSDP FULL_SHARD across nodes)."""
    shapes = {"1b": _mpt("mpt-1b", 16, 2048, 24), "3b": _mpt("mpt-3b", 32, 2560, 32),
              "13b": _mpt("mpt-13b", 40, 5120, 40), "30b": _mpt("mpt-30b", 64, 7168, 48),
              "70b": _mpt("mpt-70b", 64, 8192, 80)}
    table = [  # model, GPUs, hardware, MFU, micro-batch, grad accum, activation checkpointing
        ("70b", 64, "dgx-h100", 42.57, 8, 4, True), ("70b", 32, "dgx-h100", 36.15, 2, 16, True),
        ("30b", 32, "dgx-h100", 43.92, 14, 3, True), ("30b", 16, "dgx-h100", 43.07, 10, 3, True),
        ("13b", 64, "dgx-h100", 39.86, 2, 1, False), ("13b", 32, "dgx-h100", 39.95, 2, 1, False),
        ("13b", 16, "dgx-h100", 39.58, 2, 1, False), ("3b", 64, "dgx-h100", 40.80, 6, 3, False),
        ("3b", 32, "dgx-h100", 41.70, 6, 3, False), ("3b", 16, "dgx-h100", 43.73, 10, 3, False),
        ("1b", 64, "dgx-h100", 40.85, 20, 1, False), ("1b", 32, "dgx-h100", 41.52, 20, 1, False),
        ("1b", 16, "dgx-h100", 42.36, 20, 1, False),
        ("70b", 64, "dgx-a100", 53.33, 8, 4, True), ("70b", 32, "dgx-a100", 48.56, 2, 16, True)]
    rows = []
    for model, gpus, hw, mfu, b, accum, ckpt in table:
        gpu = "H100" if hw == "dgx-h100" else "A100-80GB"
        rows.append(_row(f"llm-foundry MPT-{model} {gpu}", f"MPT-{model} on {gpus} {gpu}, "
                         f"micro-batch {b} x {accum}{', AC' if ckpt else ''} (llm-foundry)",
                         shapes[model], hw, "llm-foundry", gpus, 1, 1, gpus * b * accum,
                         "MFU", mfu, micro_batch=b, recompute="full" if ckpt else "none",
                         shard=(gpus, gpus, gpus), flash=True, chosen="nothing",
                         source=f"{FOUNDRY}, '{gpu}' table, row {model} / 2048 / {gpus} GPUs"))
    return rows


def torchtitan() -> list[dict]:
    """Llama 3.1 8B, FSDP over 8 and 128 H100s: tokens/s per GPU (Tables 1, 3: their
    selective checkpointing is op-level, saving about half of the matmul outputs, which
    this planner does not model, so their memory is not held); and the peak reserved memory
    of Table 2's FSDP 8 x CP 1 row at 32,768 tokens with full checkpointing (Float8 linears,
    which keep bf16 activations; its throughput is Float8's and not held)."""
    from dataclasses import replace
    from .shapes import PRESETS
    shape = PRESETS["llama3-8b"]
    rows = [_row("torchtitan Llama 3.1 8B", f"Llama 3.1 8B on {gpus} H100, FSDP, local batch "
                 f"2, selective AC (torchtitan)", shape, "dgx-h100", "fsdp", gpus, 1, 1,
                 2 * gpus, "tokens/s per GPU", float(tps), micro_batch=2,
                 recompute="selective", shard=(gpus, gpus, gpus), flash=True,
                 chosen="nothing", source=f"{TITAN}: TPS/GPU {tps}", device_gib=96)
            for gpus, tps in ((8, 5762), (128, 5605))]
    rows.append(_row("torchtitan Llama 3.1 8B memory", "Llama 3.1 8B on 8 H100 (96 GB), FSDP, "
                     "sequence 32768, local batch 1, full AC (torchtitan)",
                     replace(shape, seq_len=32768), "dgx-h100", "fsdp", 8, 1, 1, 8,
                     "memory (GiB)", 83.9, micro_batch=1, recompute="full",
                     shard=(8, 8, 8), flash=True, chosen="nothing", memory_gib=83.9,
                     device_gib=96,
                     source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "
                            "Table 2, row FSDP 8, CP 1: 83.9 GiB (max reserved)"))
    return rows


def bloom() -> list[dict]:
    return [_row("BLOOM-176B", "BLOOM-176B on 384 A100-80GB (Megatron-DeepSpeed)", BLOOM_176B,
                 "dgx-a100", "megatron-deepspeed", 384, 4, 12, 2048, "HFU",
                 100 * 149 / 312, micro_batch=2, recompute="full", v=1, shard=(1, 1, 8),
                 chosen="nothing", source=BLOOM)]


def all_rows() -> list[dict]:
    """Every published multi-node run ``scorecard`` holds the planner to."""
    return megatron_h100() + megatron_a100() + korthikanti() + foundry() + torchtitan() + bloom()
