"""Context parallelism: ring attention over the ``cp`` ranks, so one sequence is split across them.

**The idea** (Liu et al. 2023, *Ring Attention with Blockwise Transformers*; Megatron-LM's
``--context-parallel-size``; torchtitan's ``context_parallel``). Every layer of a transformer
but attention works token by token, so a sequence of s tokens can be cut into N pieces, one per
rank, and the embedding, LayerNorms, MLPs and the loss run on s/N tokens without talking.
Attention is the one place where a token needs the others: its query must meet every earlier
key and value. Ring attention brings them: the N ranks form a ring, each starts with its own
K/V block, and at each of N steps computes its queries against the block it holds, then
passes the block to its right neighbour and receives the next one from its left. After N steps
every query has met every key. Nobody ever holds more than two K/V blocks, so attention's
memory per rank is that of s/N tokens, and the score matrix is never larger than (s/N)^2.

**Merging partial results** exactly as flash attention merges key blocks (Dao et al. 2022):
a block's softmax is normalised by its own log-sum-exp ``lse``; two partial outputs combine as

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

so the final output is exactly softmax(q K^T) V over all blocks (``merge``, exercise ex09).
The backward pass uses the final ``lse`` to recompute each block's probabilities, and the
gradients of K and V travel round the ring *with* the block they belong to, arriving home
after N hops (``RingAttention.backward``).

**Causal load balance.** Cut the sequence plainly into N pieces and rank 0's queries (the
first tokens) see only its own keys, while rank N-1's see every block: rank 0 computes one
half-masked block and then idles while rank N-1 computes N of them, and every step waits for
the slowest rank. Megatron-LM and torchtitan cut the sequence into 2N chunks instead and give
rank i chunks i and 2N-1-i (one early, one late): every rank then computes the same work at
every step (a block with its half masked, or half a block; ``visible_block``). ``work_per_rank``
counts it; notebook 09 measures both.

**Collectives** (point-to-point on the ring, recorded by ``minipar.comm`` under ``"cp"``):
per layer and micro-batch of b sequences of s tokens, width h (h/t heads' worth under TP), e
bytes an element, with one K/V block ``B = 2 b (s/N) (h/t) e`` bytes, each rank sends

    forward    (N-1) B          K/V blocks round the ring (again when the forward is recomputed)
    backward   (N-1) B + N B    K/V again, and their gradients, which go one more hop home

so ``(3N-2) B`` per layer, in ``N - 1 + 2N - 1`` messages that overlap with the block
computations (``isend``/``irecv`` are posted before the block is computed). Posting is not
enough to be safe: NCCL/RCCL complete a send only together with its receive, in the order each
rank posted them, so if every rank posted its receive first the ring would hang there (gloo
would not show it). Even ranks send first and odd ranks receive first (``Ring.shift``);
``minipar.p2p_order`` replays the order under NCCL's rule in the tests. The closed form is
``minipar.plan.cp.cp_attention_bytes``.
Parameters are replicated over ``cp``: their gradients are averaged over ``dp x cp``.

Shapes: ``b h s d`` is batch, heads, this rank's tokens (s/N), head size; ``two`` stacks K and V.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import einsum, rearrange

from . import comm, rules
from .runtime.errors import UsageError
from .model import GPT, CausalSelfAttention


# --------------------------------------------------------------------------------------
# Which tokens a rank holds
# --------------------------------------------------------------------------------------
def chunks_of(rank: int, n: int, balanced: bool = True) -> tuple[int, ...]:
    """The chunks rank ``rank`` of ``n`` holds: (i, 2n-1-i) of 2n chunks, or (i,) of n."""
    return (rank, 2 * n - 1 - rank) if balanced else (rank,)


def local_positions(seq_len: int, n: int, rank: int, balanced: bool = True) -> torch.Tensor:
    """The global positions of the seq_len/n tokens rank ``rank`` holds, in its local order."""
    if n == 1:
        return torch.arange(seq_len)
    pieces = 2 * n if balanced else n
    if seq_len % pieces:                       # never drop the tail tokens silently
        raise UsageError(rules.cp_violation(seq_len, n) if balanced else
                         f"{seq_len} tokens do not cut into {n} equal chunks")
    c = seq_len // pieces
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks_of(rank, n, balanced)])


def shard_sequence(x: torch.Tensor, n: int, rank: int, balanced: bool = True,
                   dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (the sequence): (b s ...) -> (b s/n ...)."""
    if n == 1:
        return x
    where = local_positions(x.shape[dim], n, rank, balanced).to(x.device)
    return x.index_select(dim, where)


def unshard_sequence(parts: list[torch.Tensor], balanced: bool = True,
                     dim: int = 1) -> torch.Tensor:
    """The inverse of ``shard_sequence``: every rank's part, in rank order, back in order."""
    n = len(parts)
    full = torch.cat(parts, dim)
    where = torch.cat([local_positions(full.shape[dim], n, r, balanced) for r in range(n)])
    return full.index_select(dim, torch.argsort(where).to(full.device))


# --------------------------------------------------------------------------------------
# One block of attention, and merging blocks (flash attention's arithmetic)
# --------------------------------------------------------------------------------------
def _up(x: torch.Tensor) -> torch.Tensor:
    """Compute in fp32 at least (bf16/fp16 inputs); float64 stays (the tests' precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = einsum(_up(q), _up(k), "b h i d, b h j d -> b h i j") * scale
    if causal:   # square block on the diagonal: local order is global order inside it
        i, j = s.shape[-2:]
        s = s.masked_fill(torch.ones(i, j, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


def block_attention(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v for one block, and each query's log-sum-exp (both fp32).

    (b h i d), (b h j d), (b h j d) -> out (b h i d), lse (b h i). ``causal`` masks the
    upper triangle (a block on the diagonal); every row keeps at least its own key.
    """
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = einsum(torch.exp(s - lse[..., None]), _up(v), "b h i j, b h j d -> b h i d")
    return out, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention outputs over disjoint key blocks -> the output over both.

    ``out_*`` (b h i d) are each normalised by their own block's softmax, ``lse_*`` (b h i)
    the log-sum-exp of their scores. Returns (out, lse) as if one softmax had run over the
    union of the keys. At least one of ``lse_a``, ``lse_b`` is finite in every row.
    """
    # EXERCISE ex09 begin
    # lse = log(exp(lse_a) + exp(lse_b)) computed stably; reweight each output by exp(lse_x - lse)
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b
    # EXERCISE ex09 end
    return out, lse


def block_attention_backward(q, k, v, dout, lse, delta, causal: bool, scale: float):
    """Gradients of one block given the *final* lse and ``delta = rowsum(dout * out)``.

    p = exp(s - lse) is this block's share of the full softmax, so with dp = dout v^T the
    softmax's backward is ds = p (dp - delta): flash attention's backward, one block at a time.
    Returns dq (b h i d), dk, dv (b h j d), in fp32 (or float64).
    """
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    dout = _up(dout)
    dv = einsum(p, dout, "b h i j, b h i d -> b h j d")
    dp = einsum(dout, _up(v), "b h i d, b h j d -> b h i j")
    ds = p * (dp - delta[..., None])
    dq = einsum(ds, _up(k), "b h i j, b h j d -> b h i d") * scale
    dk = einsum(ds, _up(q), "b h i j, b h i d -> b h j d") * scale
    return dq, dk, dv


# --------------------------------------------------------------------------------------
# The schedule: which part of block (my queries, rank j's keys) is visible
# --------------------------------------------------------------------------------------
_ALL = slice(None)


def visible_block(me: int, j: int, n: int, s_local: int, balanced: bool = True):
    """(query rows, key columns, causal) of the part of (my queries x rank j's keys) that the
    causal mask leaves, or None when it leaves nothing.

    Plain split: earlier ranks' keys are all visible, later ranks' none (rank 0 idles).
    Balanced split (chunks i and 2n-1-i): for j < me, j's early chunk precedes both of my
    chunks and its late chunk follows both: the first half of the keys, all queries. For
    j > me, only my late chunk comes after j's two chunks: all keys, the second half of the
    queries. Either way s_local^2 / 2 scores, the work of the diagonal block: balanced.
    """
    if j == me:
        return _ALL, _ALL, True
    if not balanced:
        return (_ALL, _ALL, False) if j < me else None
    half = s_local // 2
    if j < me:
        return _ALL, slice(0, half), False
    return slice(half, None), _ALL, False


def work_per_rank(seq_len: int, n: int, balanced: bool = True) -> list[int]:
    """Attention scores each rank computes for one head and sequence (all steps together)."""
    s_local = seq_len // n
    out = []
    for me in range(n):
        total = 0
        for j in range(n):
            block = visible_block(me, j, n, s_local, balanced)
            if block is not None:
                rows = len(range(s_local)[block[0]])
                cols = len(range(s_local)[block[1]])
                total += rows * (rows + 1) // 2 if block[2] else rows * cols
        out.append(total)
    return out


def forward_step(q, kv, out, lse, me: int, j: int, n: int, balanced: bool, scale: float) -> bool:
    """Merge (my queries x rank j's K/V) into ``out``, ``lse`` in place; False if nothing seen."""
    block = visible_block(me, j, n, q.shape[2], balanced)
    if block is None:
        return False
    rows, cols, causal = block
    o, l = block_attention(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale)
    out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)
    return True


def backward_step(q, kv, dout, lse, delta, dq, dkv, me: int, j: int, n: int, balanced: bool,
                  scale: float) -> None:
    """Add block (me, j)'s gradients into ``dq`` (mine) and ``dkv`` (rank j's, travelling)."""
    block = visible_block(me, j, n, q.shape[2], balanced)
    if block is None:
        return
    rows, cols, causal = block
    gq, gk, gv = block_attention_backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                          dout[:, :, rows], lse[:, :, rows],
                                          delta[:, :, rows], causal, scale)
    dq[:, :, rows] += gq
    dkv[0][:, :, cols] += gk.to(dkv.dtype)
    dkv[1][:, :, cols] += gv.to(dkv.dtype)


# --------------------------------------------------------------------------------------
# The ring
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ring:
    """This rank's place on its ``cp`` line: the global ranks in ring order, and its index."""

    ranks: tuple[int, ...] = (0,)
    index: int = 0
    balanced: bool = True

    @property
    def n(self) -> int:
        return len(self.ranks)

    @property
    def right(self) -> int:
        return self.ranks[(self.index + 1) % self.n]

    @property
    def left(self) -> int:
        return self.ranks[(self.index - 1) % self.n]

    @classmethod
    def of(cls, group, balanced: bool = True) -> "Ring":
        """The ring of a process group (None: a ring of one, plain causal attention)."""
        if comm.size(group) == 1:
            return cls(balanced=balanced)
        return cls(tuple(comm.global_ranks(group)), comm.rank(group), balanced)

    def shift(self, send: torch.Tensor, into: torch.Tensor) -> list[comm.Handle]:
        """Post: ``send`` to the right neighbour, the left one's into ``into``. Wait on both.

        Even ranks post the send first, odd ranks the receive (TransformerEngine's ring does
        the same). NCCL pairs a send with its receive in the order each rank posted them, on
        one queue per communicator: had every rank posted its receive first, every rank would
        wait in it for a neighbour also waiting in its receive, and the ring would hang.
        """
        if self.index % 2 == 0:
            return [comm.isend(send, self.right, label="cp"),
                    comm.irecv(into, self.left, label="cp")]
        return [comm.irecv(into, self.left, label="cp"), comm.isend(send, self.right, label="cp")]


def _wait(handles):
    for h in handles:
        h.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against every rank's keys, round the ring."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        n, me, scale = ring.n, ring.index, 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)       # bf16/fp16 accumulate in fp32
        # laid out (b s h d) in memory, as SDPA's output: the model's "b h s d -> b s (h d)"
        # is then a view, and the output projection saves this very storage, not a copy
        out = rearrange(torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=acc,
                                    device=q.device), "b s h d -> b h s d")
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])                                  # (two b h s d): one message
        for t in range(n):
            if t < n - 1:                                         # next block in flight while
                incoming = torch.empty_like(kv)                   # this one is computed
                pending = ring.shift(kv, incoming)
            forward_step(q, kv, out, lse, me, (me - t) % n, n, ring.balanced, scale)
            if t < n - 1:
                _wait(pending)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        n, me, scale = ring.n, ring.index, 1.0 / math.sqrt(q.shape[-1])
        delta = (_up(dout) * _up(out)).sum(-1)                    # (b h s)
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)                                # gradient of the block held
        for t in range(n):
            if t < n - 1:
                incoming = torch.empty_like(kv)
                pending = ring.shift(kv, incoming)
            backward_step(q, kv, dout, lse, delta, dq, dkv, me, (me - t) % n, n,
                          ring.balanced, scale)
            if n > 1:     # the gradient follows its block; after n hops it is home
                arriving = torch.empty_like(dkv)
                _wait(ring.shift(dkv, arriving))
                dkv = arriving
            if t < n - 1:
                _wait(pending)
                kv = incoming
        return dq.to(q.dtype), dkv[0], dkv[1], None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """(b h s d) x 3 -> (b h s d): causal attention over the whole sequence, s/N tokens here."""
    if ring.n == 1:   # one rank: the same causal attention the serial model runs
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return RingAttention.apply(q, k, v, ring)


# --------------------------------------------------------------------------------------
# The same schedule on one process (tests, notebook 09): every rank in turn at each step
# --------------------------------------------------------------------------------------
def simulate(q, k, v, n: int, balanced: bool = True, dout=None):
    """Ring attention of n simulated ranks on full (b h s d) tensors, in global order.

    Runs ``forward_step`` (and with ``dout`` ``backward_step``) for every rank at every step,
    passing blocks as the ring would. Returns ``dict(out=, lse=, trace=)`` and with ``dout``
    also ``dq, dk, dv``; ``trace[t][me]`` is the rank whose block ``me`` used at step t, or
    None where the mask left nothing to compute.
    """
    split = lambda x: [shard_sequence(x, n, r, balanced, dim=2) for r in range(n)]   # noqa
    qs, ks, vs = split(q), split(k), split(v)
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs = [torch.zeros(x.shape, dtype=_up(x).dtype) for x in qs]
    lses = [torch.full(x.shape[:-1], float("-inf"), dtype=_up(x).dtype) for x in qs]
    kvs = [torch.stack([a, b]) for a, b in zip(ks, vs)]
    trace = []
    for t in range(n):
        held = [kvs[(me - t) % n] for me in range(n)]     # after t shifts to the right
        trace.append([(me - t) % n if forward_step(qs[me], held[me], outs[me], lses[me], me,
                                                   (me - t) % n, n, balanced, scale) else None
                      for me in range(n)])
    merge_back = lambda xs: unshard_sequence(xs, balanced, dim=2)   # noqa: E731
    result = dict(out=merge_back(outs), lse=merge_back(lses), trace=trace)
    if dout is not None:
        douts = split(dout)
        deltas = [(a * b).sum(-1) for a, b in zip(douts, outs)]
        dqs = [torch.zeros_like(x) for x in outs]
        dkvs = [torch.zeros_like(kv) for kv in kvs]
        for t in range(n):
            for me in range(n):
                j = (me - t) % n
                backward_step(qs[me], kvs[j], douts[me], lses[me], deltas[me], dqs[me], dkvs[j],
                              me, j, n, balanced, scale)
        result.update(dq=merge_back(dqs), dk=merge_back([d[0] for d in dkvs]),
                      dv=merge_back([d[1] for d in dkvs]))
    return result


# --------------------------------------------------------------------------------------
# The serial GPT -> the context-parallel GPT
# --------------------------------------------------------------------------------------
class RingSelfAttention(CausalSelfAttention):
    """``CausalSelfAttention`` (its qkv and proj, TP's or serial) whose core is ring attention."""

    @classmethod
    def from_attention(cls, attn: CausalSelfAttention, ring: Ring) -> "RingSelfAttention":
        new = cls.__new__(cls)
        new.__dict__.update(attn.__dict__)        # the same submodules, parameters, settings
        new.ring = ring
        return new

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.ring)


def parallelize(model: GPT, group, seq_len: int, balanced: bool = True) -> GPT:
    """In place: every block's attention becomes ring attention over ``group`` (the cp axis),
    and the embedding adds the global positions of this rank's tokens. Parameter names and
    shapes stay: the parameters are replicated over cp. Apply after ``tp.parallelize``."""
    ring = Ring.of(group, balanced)
    if ring.n == 1:
        return model
    if model.cfg.dropout:      # said, not silently dropped: the ring has no attention dropout
        raise UsageError(f"ring attention applies no attention dropout, but the model has "
                         f"dropout={model.cfg.dropout}; use dropout 0 with context parallelism")
    for block in model.blocks:
        block.attn = RingSelfAttention.from_attention(block.attn, ring)
    model.embed.positions = local_positions(seq_len, ring.n, ring.index, balanced).to(
        next(model.parameters()).device)
    return model

