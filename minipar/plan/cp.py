"""Context parallelism in closed form: ring attention's bytes, and activations split over cp.

``minipar.cp`` cuts every sequence of s tokens over the N = cp ranks of a ring (rank i holds
chunks i and 2N-1-i of 2N). Per layer and micro-batch of b sequences, width h (h/t per TP
rank), e bytes per element, one K/V block is

    B = 2 b (s/N) (h/t) e

and each rank sends, point to point to its right neighbour,

    forward    (N-1) B         every other rank's K/V passes through once
                               (x2 when the forward is recomputed: selective or full)
    backward   (N-1) B + N B   K/V again, and the K/V gradients, one hop more to get home

Nothing else in the model talks over cp: the other layers work token by token. The
parameters are replicated over cp, so their gradients are reduced over dp x cp ranks (the
trainer's ``"dp_cp"`` group): the data-parallel formulas hold with dp -> dp cp.

Activations: every tensor a layer keeps is per token, so one rank keeps a layer of s/N tokens
(``layer_activation_bytes`` of the same shape at sequence length s/N), and ring attention
never stores the s x s scores (flash attention's arithmetic): activations fall as 1/cp.
"""
from __future__ import annotations


from .memory import check_cp, cp_layer_activation_bytes  # noqa: F401  (cp's, kept with the rest of memory)
from .shapes import ModelShape


def kv_block_bytes(micro_batch: int, seq_len: int, hidden: int, cp: int, tp: int = 1,
                   bytes_per_elem: int = 4) -> int:
    """B = 2 b (s/cp) (h/tp) e: one rank's K and V for one layer, the ring's message."""
    return 2 * micro_batch * (seq_len // cp) * (hidden // tp) * bytes_per_elem


def cp_attention_bytes(micro_batch: int, seq_len: int, hidden: int, cp: int, tp: int = 1,
                       bytes_per_elem: int = 4, recompute: str = "none") -> dict[str, int]:
    """Bytes one rank sends for ring attention in one layer and micro-batch (forward and
    backward): ``{"forward", "backward", "total"}``; all 0 at cp = 1."""
    check_cp(seq_len, cp)
    if cp == 1:
        return dict(forward=0, backward=0, total=0)
    block = kv_block_bytes(micro_batch, seq_len, hidden, cp, tp, bytes_per_elem)
    forwards = 1 if recompute == "none" else 2
    out = dict(forward=forwards * (cp - 1) * block, backward=(2 * cp - 1) * block)
    out["total"] = out["forward"] + out["backward"]
    return out


def cp_comm_bytes(micro_batch: int, seq_len: int, hidden: int, cp: int, layers: int,
                  microbatches: int = 1, tp: int = 1, bytes_per_elem: int = 4,
                  recompute: str = "none") -> int:
    """Bytes one rank sends over cp in one step: ``layers`` (this stage's) x micro-batches."""
    per_layer = cp_attention_bytes(micro_batch, seq_len, hidden, cp, tp, bytes_per_elem,
                                   recompute)["total"]
    return layers * microbatches * per_layer


def ring_step_times(shape: ModelShape, hardware, cp: int, tp: int = 1, micro_batch: int = 1,
                    dtype: str = "mixed") -> dict[str, float]:
    """One ring step of one layer's forward: the K/V message's send time (``p2p_time``: on
    NVLink while tp x cp ranks fit in a node, else on the node's share of the network) and the
    half block of attention it overlaps with (4 (h/t) FLOPs a score, (s/cp)^2 / 2 scores: the
    causal balance). The ring hides its traffic while send <= compute."""
    from .hardware import load_hardware
    from .memory import ACTIVATION_BYTES
    from .network import p2p_time
    hw = load_hardware(hardware)
    if cp == 1:
        return dict(send=0.0, compute=0.0, across_nodes=False)
    across = tp * cp > hw.gpus_per_node
    block = kv_block_bytes(micro_batch, shape.seq_len, shape.hidden, cp, tp,
                           ACTIVATION_BYTES[dtype])
    local = shape.seq_len // cp
    flops = 4 * (shape.hidden // tp) * local * local / 2 * micro_batch
    return dict(send=p2p_time(block, across, hw),
                compute=flops / (hw.peak_flops * hw.compute_efficiency), across_nodes=across)


def cp_search(shape: ModelShape, hardware, tp: int = 8, cps=(1, 2, 4, 8, 16, 32, 64),
              micro_batch: int = 1, recompute: str = "selective", shard=(1, 1, 1),
              dtype: str = "mixed") -> list[dict]:
    """For a long-context run of one data-parallel replica (tp x cp GPUs, SP on): per cp that
    cuts the sequence, the memory of one GPU (``device_memory`` with ``Layout(cp=...)``),
    whether it fits, the ring's bytes per layer and whether its messages hide behind the
    attention they overlap. ``best`` marks the smallest cp that fits and hides its ring."""
    from .hardware import load_hardware
    from .layout import Layout
    from .memory import ACTIVATION_BYTES, device_memory
    hw = load_hardware(hardware)
    rows = []
    for n in cps:
        if shape.seq_len % (2 * n) and n > 1:
            continue
        layout = Layout(tp=tp, cp=n, sp=tp > 1, micro_batch=micro_batch, recompute=recompute,
                        shard=shard)
        memory = device_memory(shape, layout, flash=True, dtype=dtype)
        times = ring_step_times(shape, hw, n, tp, micro_batch, dtype)
        rows.append(dict(cp=n, gpus=layout.gpus, memory=memory,
                         fits=memory["total"] <= hw.usable_bytes(),
                         ring_bytes_per_layer=cp_attention_bytes(
                             micro_batch, shape.seq_len, shape.hidden, n, tp,
                             ACTIVATION_BYTES[dtype], recompute)["total"],
                         send_s=times["send"], compute_s=times["compute"],
                         across_nodes=times["across_nodes"],
                         hidden=times["send"] <= times["compute"], best=False))
    for r in rows:
        if r["fits"] and (r["hidden"] or r["cp"] == 1):
            r["best"] = True
            break
    return rows
