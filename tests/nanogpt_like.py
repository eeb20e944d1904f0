"""A training script the way nanoGPT's ``train.py`` is written, in three data-parallel flavours:
DDP, DDP + ZeroRedundancyOptimizer, and FSDP2 (``fully_shard`` per block, then the root).

It imports torch's wrappers below. ``tests/test_porting.py`` runs it as written and again with
only those import lines changed to minipar's (``MINIPAR_IMPORTS``), and compares the two loss
for loss, their collectives per step, and their checkpoints loaded into a plain GPT and AdamW.
The model is nanoGPT's (a tied embedding, ``configure_optimizers`` deciding weight decay by
``p.dim() >= 2``, ``get_num_params``), tiny enough for two gloo ranks on a CPU.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
# -- the wrappers: the only lines a port to minipar changes ---------------------------------
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.fsdp import fully_shard
# -------------------------------------------------------------------------------------------

TORCH_IMPORTS = (
    "from torch.nn.parallel import DistributedDataParallel as DDP",
    "from torch.distributed.optim import ZeroRedundancyOptimizer",
    "from torch.distributed.fsdp import fully_shard",
)
MINIPAR_IMPORTS = (
    "from minipar.dp import DataParallel as DDP",
    "from minipar.zero import ShardedOptimizer as ZeroRedundancyOptimizer",
    "from minipar.fsdp import fully_shard",
)


@dataclass
class GPTConfig:
    block_size: int = 8
    vocab_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(config.n_embd, config.bias), CausalSelfAttention(config)
        self.ln_2, self.mlp = LayerNorm(config.n_embd, config.bias), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True):
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def optim_groups(self, weight_decay):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        return [{"params": decay_params, "weight_decay": weight_decay},
                {"params": nodecay_params, "weight_decay": 0.0}]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return torch.optim.AdamW(self.optim_groups(weight_decay), lr=learning_rate, betas=betas)


# -- the run's settings, as train.py's globals ------------------------------------------------
max_iters, gradient_accumulation_steps, batch_size = 3, 2, 4   # batch_size: global, per micro-step
learning_rate, weight_decay, betas, grad_clip = 3e-3, 0.1, (0.9, 0.95), 0.05
seed = 1337


def get_batch(iter_num, micro_step, rank=0, world=1):
    """The global micro-batch (batch_size sequences) of this iteration; each rank its slice."""
    g = torch.Generator().manual_seed(1000 * iter_num + micro_step)
    data = torch.randint(0, GPTConfig.vocab_size, (batch_size, GPTConfig.block_size + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    n = batch_size // world
    return x[rank * n:(rank + 1) * n].contiguous(), y[rank * n:(rank + 1) * n].contiguous()


def train(model, raw_model, optimizer, rank, world, ddp=False):
    """nanoGPT's loop: accumulate, clip, step (DDP syncs only the last micro-step)."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses, norms = [], []
    for iter_num in range(max_iters):
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            X, Y = get_batch(iter_num, micro_step, rank, world)
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * gradient_accumulation_steps)
    return losses, norms


def run_serial():
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    optimizer = model.configure_optimizers(weight_decay, learning_rate, betas, "cpu")
    losses, norms = train(model, model, optimizer, 0, 1)
    return dict(losses=losses, norms=norms, model=model.state_dict(),
                optimizer=optimizer.state_dict(), num_params=model.get_num_params())


def run_ddp(rank, world):
    torch.manual_seed(seed)
    model = DDP(GPT(GPTConfig()), device_ids=None)
    raw_model = model.module
    optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, betas, "cpu")
    losses, norms = train(model, raw_model, optimizer, rank, world, ddp=True)
    checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()} \
        if rank == 0 else None
    return dict(losses=losses, norms=norms, checkpoint=checkpoint)


def run_zero(rank, world):
    torch.manual_seed(seed)
    raw_model = GPT(GPTConfig())
    # nanoGPT's order: the optimizer first, then DDP around the model
    optimizer = ZeroRedundancyOptimizer(raw_model.optim_groups(weight_decay),
                                        optimizer_class=torch.optim.AdamW, lr=learning_rate,
                                        betas=betas)
    model = DDP(raw_model)
    losses, norms = train(model, raw_model, optimizer, rank, world, ddp=True)
    optimizer.consolidate_state_dict(to=0)
    checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()} \
        if rank == 0 else None
    return dict(losses=losses, norms=norms, checkpoint=checkpoint)


def run_fsdp(rank, world):
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = model.configure_optimizers(weight_decay, learning_rate, betas, "cpu")
    shapes = {n: (tuple(p.shape), p.dim()) for n, p in model.named_parameters()}
    num_params = model.get_num_params()
    losses, norms = train(model, model, optimizer, rank, world)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    checkpoint = {"model": get_model_state_dict(model, options=options),
                  "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    return dict(losses=losses, norms=norms, checkpoint=checkpoint if rank == 0 else None,
                shapes=shapes, num_params=num_params)
