"""Context parallelism in closed form: ring attention's bytes, and activations split over cp.

``minipar.cp`` cuts every sequence of s tokens over the N = cp ranks of a ring (rank i holds
chunks i and 2N-1-i of 2N). Per layer and micro-batch of b sequences, width h (h/t per TP
rank), e bytes per element, one K/V block is

    B = 2 b (s/N) (h_kv/t) e

(h_kv = h without grouped-query attention; ``hidden`` below is that K/V width) and each
rank sends, point to point to its right neighbour,

    forward    (N-1) B         every other rank's K/V passes through once
                               (x2 when the forward is recomputed: selective or full)
    backward   (N-1) B + N B   K/V again, and the K/V gradients, one hop more to get home

Nothing else in the model talks over cp: the other layers work token by token. The
parameters are replicated over cp, so their gradients are reduced over dp x cp ranks (the
trainer's ``"dp_cp"`` group): the data-parallel formulas hold with dp -> dp cp.

Activations: every tensor a layer keeps is per token, so one rank keeps a layer of s/N tokens
(``layer_activation_bytes`` of the same shape at sequence length s/N), and ring attention
never stores the s x s scores (flash attention's arithmetic): activations fall as 1/cp.

Time (``ring_step_times``, ``ring_times``; ``estimate`` adds the rest at s/N tokens): each K/V
message is posted before a block of attention and waited for after it, so it hides behind the
block while it is sent faster; the K/V gradients' hops are sent after their block and waited for
(minipar's ring), so they are exposed. The ring stays inside a node while tp x N ranks fit one
(cp sits next to tp in the rank order), else each message shares the node's network links.
"""
from __future__ import annotations

from .compute import attention_core
from .errors import raise_if
from .hardware import load_hardware
from .layout import cp_violation
from .memory import ACTIVATION_BYTES, kv_block_bytes
from .memory import cp_layer_activation_bytes  # noqa: F401  (cp's, in memory, which needs it)
from .network import p2p_time, placement
from .shapes import ModelShape


def ring_messages(cp: int, recompute: str = "none") -> tuple[int, int]:
    """(forward, backward) K/V messages a rank sends per layer and micro-batch (above)."""
    return (cp - 1) * (1 if recompute == "none" else 2), 2 * cp - 1


def cp_attention_bytes(micro_batch: int, seq_len: int, hidden: int, cp: int, tp: int = 1,
                       bytes_per_elem: int = 4, recompute: str = "none") -> dict[str, int]:
    """Bytes one rank sends for ring attention in one layer and micro-batch (forward and
    backward): ``{"forward", "backward", "total"}``; all 0 at cp = 1."""
    raise_if(cp_violation(seq_len, cp))
    if cp == 1:
        return dict(forward=0, backward=0, total=0)
    block = kv_block_bytes(micro_batch, seq_len, hidden, cp, tp, bytes_per_elem)
    forward, backward = ring_messages(cp, recompute)
    return dict(forward=forward * block, backward=backward * block,
                total=(forward + backward) * block)


def cp_comm_bytes(micro_batch: int, seq_len: int, hidden: int, cp: int, layers: int,
                  microbatches: int = 1, tp: int = 1, bytes_per_elem: int = 4,
                  recompute: str = "none") -> int:
    """Bytes one rank sends over cp in one step: ``layers`` (this stage's) x micro-batches."""
    return layers * microbatches * cp_attention_bytes(micro_batch, seq_len, hidden, cp, tp,
                                                      bytes_per_elem, recompute)["total"]


def ring_step_times(shape: ModelShape, hardware, cp: int, tp: int = 1, micro_batch: int = 1,
                    dtype: str = "mixed", flash: bool = False, stride: int | None = None,
                    gpus: int | None = None) -> dict[str, float]:
    """One ring step of one layer: the K/V message's send time (``p2p_time``; its ranks
    ``stride`` devices apart, tp by default: both rank orders place cp next to tp) and the
    attention it overlaps, forward and backward. The compute model prices the whole s x s
    square (``compute.attention_core``), cp blocks of (s/cp)^2 per rank; the balanced split
    gives every rank exactly half a block at every step (``minipar.cp.visible_block``), so a
    message hides behind half of 1/cp of the modelled core, while send <= compute."""
    hw = load_hardware(hardware)
    if cp == 1:
        return dict(send=0.0, compute=0.0, compute_backward=0.0, across_nodes=False)
    across = placement(cp, stride or tp, hw.gpus_per_node)[1] > 1
    block = kv_block_bytes(micro_batch, shape.seq_len, shape.kv_hidden, cp, tp,
                           ACTIVATION_BYTES[dtype])
    fwd, bwd = attention_core(shape, hw, micro_batch, tp, cp, dtype, flash)
    c = hw.step_calibration * hw.oversubscription(gpus or cp * tp)    # as compute_parts
    return dict(send=p2p_time(block, across, hw, hw.nodes(gpus or cp * tp)),
                compute=c * fwd / cp / 2, compute_backward=c * bwd / cp / 2, across_nodes=across)


def ring_times(shape: ModelShape, hardware, layout, order: str = "tp,pp,dp", dtype: str = "mixed",
               flash: bool = False, layers: int | None = None) -> dict[str, float]:
    """Seconds per step of the ring on a stage of ``layers`` layers (default the heaviest of
    equal stages), as ``minipar.cp`` runs it (module docstring): per layer and micro-batch
    cp-1 K/V sends forward (x2 when recomputed) and cp-1 backward, each exposed by
    max(0, send - block), and cp hops of the K/V gradients, exposed whole.
    ``{"cp_comm": all the ring's send time, "cp_exposed": what no block hides}``."""
    cp = layout.cp
    if cp == 1:
        return dict(cp_comm=0.0, cp_exposed=0.0)
    step = ring_step_times(shape, hardware, cp, layout.tp, layout.micro_batch, dtype, flash,
                           layout.strides(order)["cp"], layout.gpus)
    send = step["send"]
    forward, backward = ring_messages(cp, layout.recompute)
    per_layer_exposed = (forward * max(0.0, send - step["compute"])
                         + (cp - 1) * max(0.0, send - step["compute_backward"]) + cp * send)
    times = layout.microbatches * (-(-shape.layers // layout.pp) if layers is None else layers)
    return dict(cp_comm=times * (forward + backward) * send, cp_exposed=times * per_layer_exposed)
