"""A small GPT, nanoGPT-like: pre-LayerNorm blocks, causal self-attention, GELU MLP.

    idx (b s) -> Embedding -> Block x n_layer -> LMHead (LayerNorm, Linear, cross-entropy) -> loss

The model is three kinds of parts so that the parallel versions swap parts in rather than
branch inside: tensor parallelism replaces the Linear layers of a Block and the head's
projection and loss (``minipar.tp``), pipeline parallelism gives each stage a contiguous
slice of ``[embed, *blocks, head]`` (``minipar.pp``), and the sharded engines wrap
parameters without touching the code here (``minipar.zero``).

Activation recomputation (``recompute``, Korthikanti et al. 2022): ``"full"`` keeps only each
Block's input for the backward pass and runs the Block's forward again there; ``"selective"``
does that for the attention core alone (the softmax(Q K^T) V that holds the s x s scores,
when the kernel stores them). Both use ``torch.utils.checkpoint`` (non-reentrant), so they
compose with whatever the parallel versions swap in and with hooks on the Block: the
recomputed forward runs the same code on the same (gathered) parameters. A layout may give a
Block the contexts its recomputation runs in (``recompute_context``, checkpoint's
``context_fn``): ``minipar.parallelize`` does, so that an MoE layer replays its decisions.

Every layout builds this full model first with the same seed and then slices it, so the same
seed gives the same initial weights whatever the layout. The head is untied from the token
embedding (as in LLaMA), so the first and last pipeline stages share no parameter.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint, noop_context_fn

from .moe import MoE, penalty

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256      # byte-level tokenizer
    seq_len: int = 64          # context length
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 0              # 0 means 4 * d_model
    dropout: float = 0.0       # 0 keeps every layout bit-comparable with the serial run
    bias: bool = True
    # mixture of experts (minipar.moe): E experts replace the MLP of every moe_every-th block
    moe_experts: int = 0       # 0: dense
    moe_top_k: int = 2         # experts per token
    moe_every: int = 1         # 2: blocks 1, 3, 5... (every other block, as GShard)
    capacity_factor: float = 0.0   # 0: dropless; C: ceil(C s k / E) slots per expert and sequence
    moe_aux_coef: float = 0.01     # load-balancing loss coefficient (Switch)
    moe_z_coef: float = 0.0        # router z-loss coefficient (ST-MoE)
    moe_noise: float = 0.0         # std of noise on the router logits while training
    recompute: str = "none"    # activation recomputation: none, selective, full (see above)

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def is_moe(self, layer: int) -> bool:
        return self.moe_experts > 0 and layer % self.moe_every == self.moe_every - 1

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, GPTConfig] = {
    # trains visibly in a minute on 2 CPU cores
    "tiny": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=64),
    # what the unit tests use: 68k parameters, any layout up to tp=4, pp=4
    "nano": GPTConfig(n_layer=4, n_head=4, d_model=32, seq_len=16),
    # nano with 8 layers: interleaved pipelines of pp=4 stages x 2 chunks
    "nano8": GPTConfig(n_layer=8, n_head=4, d_model=32, seq_len=16),
    "small": GPTConfig(n_layer=8, n_head=8, d_model=256, seq_len=128),
    "medium": GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=256),
    # GPU-sized: GPT-2 small's shape with the byte vocabulary
    "gpt2": GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, d_model=1024, seq_len=1024),
}


def config(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# --------------------------------------------------------------------------------------
# Parts
# --------------------------------------------------------------------------------------
class Embedding(nn.Module):
    """Token plus learned position embedding: (b s) -> (b s d).

    ``positions``: the global position of each token of ``idx`` (None: 0..s-1). Context
    parallelism (``minipar.cp``) sets it to the positions of the chunks its rank holds."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.positions: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = (torch.arange(idx.shape[1], device=idx.device) if self.positions is None
                     else self.positions)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention. ``qkv``'s output features are laid out ``(three h d)``.

    The number of heads is read from ``qkv``'s width, so a column-parallel ``qkv`` that holds
    h/t heads runs the same code.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.recompute_core = cfg.recompute == "selective"

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal: (b h s d) x 3 -> (b h s d)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        q, k, v = rearrange(qkv, "b s (three h d) -> three b h s d", three=3, d=self.head_dim)
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        return self.proj(rearrange(y, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    With ``moe`` the MLP is a mixture of experts, each expert an MLP (``minipar.moe``)."""

    def __init__(self, cfg: GPTConfig, moe: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MoE(cfg, MLP) if moe else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.recompute = cfg.recompute == "full"
        self.recompute_context = noop_context_fn   # a layout's (checkpoint's context_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            if self.recompute_context is noop_context_fn:    # torch.compile traces this one
                return checkpoint(self.layer, x, use_reentrant=False)
            return checkpoint(self.layer, x, use_reentrant=False,
                              context_fn=self.recompute_context)
        return self.layer(x)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CrossEntropy(nn.Module):
    """Mean token cross-entropy; tensor parallelism swaps in a vocab-parallel one."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(rearrange(logits, "b s v -> (b s) v").float(),
                               rearrange(targets, "b s -> (b s)"))


class LMHead(nn.Module):
    """Final LayerNorm, projection to the vocabulary, and the loss: (b s d), (b s) -> ()."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.loss = CrossEntropy()

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.proj(self.ln(x)), targets)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe(i)) for i in range(cfg.n_layer))
        self.head = LMHead(cfg)
        self.apply(self._init)
        # GPT-2: scale the residual projections by 1/sqrt(2 n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") and not name.startswith("head"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def parts(self) -> list[nn.Module]:
        """The model as a list a pipeline can cut: [embed, block 0, ..., block L-1, head]."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets) + penalty(self)   # MoE: the router's auxiliary losses


def build(cfg: GPTConfig | str = "tiny", seed: int = 0) -> GPT:
    """The full serial model, deterministic in ``seed`` (every layout starts from this)."""
    if isinstance(cfg, str):
        cfg = config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
