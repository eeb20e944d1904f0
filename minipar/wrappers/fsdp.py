"""ZeRO-3 as an nn.Module, with FSDP2's contract: ``fully_shard(module)`` in a plain loop.

The idea (ZeRO-3, Rajbhandari et al. 2020; FSDP, Zhao et al. 2023): each of d ranks keeps
1/d of every parameter, of its gradient and of its optimizer state. A unit of the model (a
block, the embedding, ...: ``zero.units_of``, FSDP's wrapping policy) is all-gathered just
before its forward and again before its backward, and freed after each; once backward is
done with a unit, its gradient is reduce-scattered, so each rank keeps the averaged gradient
of its own 1/d only. The optimizer is any torch optimizer, built afterwards over
``model.parameters()``, which are this rank's shards: it updates 1/d of the model.

This is the trainer's ZeRO-3 engine (``zero.ShardedEngine``) without its optimizer: the same
``zero.Unit`` buffers and ``zero.ShardedUnits`` hooks, at the point (s_p, s_g, s_os) =
(d, d, d), over one group. What it adds is FSDP2's surface::

    model = fsdp.fully_shard(Net(), mp_policy=precision.PrecisionPolicy(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)       # steps this rank's shards
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()       # each shard's .grad: the averaged gradient
        model.clip_grad_norm_(1.0)            # optional: the global norm, as on one process
        opt.step()
    full = model.state_dict()                 # a collective: the full fp32 state, every rank

The contract, and where it differs from ``torch.distributed.fsdp.fully_shard``:

* ``fully_shard`` returns a ``ShardedDataParallel`` wrapping the module (FSDP2 changes the
  module's class in place); forward and backward are the module's. Rank 0's parameters and
  buffers are broadcast when it is built, as DDP (FSDP2 shards what each rank holds), so ranks
  may start from different seeds. ``group=None`` is the whole world, ``comm.SOLO`` one rank.
* ``parameters()`` / ``named_parameters()`` are the shards under the module's own names: this
  rank's piece of each parameter as a flat 1-D tensor (the flat unit cut into d equal chunks,
  so a piece may be empty), where FSDP2 gives DTensors sharded on dim 0. Element-wise
  optimizers (SGD, Adam, AdamW, ...) are exact on them; per-tensor statistics are not.
* After each backward pass every shard's ``.grad`` holds its averaged gradient: reduce-scatter
  (sum) in ``reduce_dtype``, then division by d (gloo has no AVG), then added in fp32 to what
  ``.grad`` already holds (accumulation across backward passes, as on one process; the
  optimizer's ``zero_grad`` resets it). A parameter no backward reached gets a zero gradient.
  The end of backward also waits on every gather still in flight: no async work outlives it.
* Mixed precision (``mp_policy``: ``precision.PrecisionPolicy(param_dtype, reduce_dtype)``):
  the shards the optimizer sees are fp32 masters; each forward casts them into the
  ``param_dtype`` units that are gathered and computed with (FSDP2's cast at all-gather time),
  floating-point inputs are cast to ``param_dtype``, outputs are left as computed. fp16 needs
  a loss scale from the caller (``precision.DynamicLossScaler``; FSDP2 leaves it to
  ``ShardedGradScaler``): the wrapper refuses a policy that carries a scaler, rather than
  ignore it.
* Which parameters stay replicated: frozen ones (``requires_grad=False``, kept whole on every
  rank, broadcast from rank 0) and the buffers. Every trainable parameter is sharded; one
  used by two units (tied embeddings) goes to the root unit, whose forward spans both uses.
* Full parameters: ``state_dict()`` gathers the full state, parameters in fp32 (a collective:
  call it on every rank); ``load_state_dict()`` takes a full one (e.g. the bare model's) and
  keeps this rank's shards. ``clip_grad_norm_(max_norm)`` clips by the norm of the whole
  averaged gradient 

Bytes one rank sends per step (Psi = padded parameter bytes in ``param_dtype``, Psi_r the
same in ``reduce_dtype``; m backward passes)::

    all_gather      2m (d-1)/d Psi       parameters, before each forward and each backward
    reduce_scatter   m (d-1)/d Psi_r     gradients, every backward pass
    broadcast        Psi_fp32 from rank 0, once, when it is built

Model-state bytes one rank holds between steps: Phi'/d parameters of the compute dtype, 4 Phi'/d
of fp32 masters (when the compute dtype is not fp32), 4 Phi'/d of gradient, and the optimizer's
state of its Phi'/d elements.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .. import comm
from ..mesh import Axis
from ..runtime.errors import UsageError
from ..zero import ShardedUnits, ShardMesh, Spec, Unit, gather_up, reduce_scatter_down, units_of


def fully_shard(module: nn.Module, group=None, units=None, mp_policy=None,
                prefetch: bool = True) -> "ShardedDataParallel":
    """ZeRO-3 over ``group`` (None: the whole world): see ``ShardedDataParallel``.

    ``units``: which modules are gathered together, as ``zero.units_of`` reads it (None: each
    child that owns parameters, ModuleList/ModuleDict looked into; a list of modules, such as
    minipar's ``GPT.parts()``; or a policy
    ``module -> bool``, FSDP's auto-wrap policy). ``mp_policy``: a ``PrecisionPolicy``-shaped
    value (``param_dtype``, ``reduce_dtype``, ``master_dtype``, ``loss_scaler``); None: fp32.
    """
    return ShardedDataParallel(module, group, units, mp_policy, prefetch)


class ShardedDataParallel(ShardedUnits, nn.Module):
    """The module, its trainable parameters sharded over ``group`` (ZeRO-3; FSDP2's contract)."""

    def __init__(self, module: nn.Module, group=None, units=None, mp_policy=None,
                 prefetch: bool = True):
        nn.Module.__init__(self)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise UsageError("fully_shard: the module has no trainable parameter to shard")
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise UsageError("fully_shard: the trainable parameters must share one dtype and "
                             "device (build the model in fp32; mp_policy casts it)")
        master = params[0].dtype
        param_dtype = reduce_dtype = master
        if mp_policy is not None:
            if mp_policy.loss_scaler is not None:
                raise UsageError("fully_shard does not scale the loss: scale it yourself "
                                 "(precision.DynamicLossScaler) and pass a policy without a "
                                 "loss_scaler")
            if mp_policy.master_dtype != master:
                raise UsageError(f"fully_shard: the masters are the module's own {master} "
                                 f"parameters; the policy asks for {mp_policy.master_dtype}")
            param_dtype = mp_policy.param_dtype
            reduce_dtype = mp_policy.reduce_dtype or param_dtype
        self.group = comm.resolve_group(group)
        self.d = comm.size(self.group)
        self.param_dtype, self.master_dtype = param_dtype, master
        comm.broadcast_from_first(list(module.parameters()) + list(module.buffers()), self.group)
        mesh = ShardMesh(Axis.of_group(self.group), Spec(self.d, self.d, self.d))
        ShardedUnits.__init__(self, module, mesh, units_of(module, units), prefetch,
                              reduce_dtype=None if reduce_dtype == param_dtype else reduce_dtype,
                              grad_dtype=master, reduce_each_backward=True, dtype=param_dtype)
        # the shards: this rank's piece of each parameter, a view into its unit's P shard
        # (fp32 masters under a lower param_dtype), its .grad a view into the G shard
        names = {p: n for n, p in module.named_parameters()}
        self._shards: list[tuple[str, nn.Parameter, Unit, slice]] = []
        for u in self.units:
            source = u.p_shard if u.master is None else u.master
            lo = mesh.p_index * u.p_shard.numel()
            hi = lo + u.p_shard.numel()
            offset = 0
            for p in u.params:
                a, b = max(lo, offset), min(hi, offset + p.numel())
                piece = slice(a - lo, b - lo) if a < b else slice(0, 0)
                self._shards.append((names[p], nn.Parameter(source[piece]), u, piece))
                offset += p.numel()
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._in_backward = False

    # -- an nn.Module whose parameters are the shards ---------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        for name, shard, _, _ in self._shards:
            yield prefix + name, shard
        for name, p in self._frozen:
            yield prefix + name, p

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    def forward(self, *args, **kwargs):
        for u in self.units:                    # the optimizer stepped the masters
            if u.master is not None:
                u.p_shard.copy_(u.master)
        if self.param_dtype != self.master_dtype:
            cast = lambda t: (t.to(self.param_dtype)   # noqa: E731
                              if torch.is_tensor(t) and t.is_floating_point() else t)
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        out = self.module(*args, **kwargs)
        for u in self.units:                    # a prefetch no unit used (a skipped branch)
            if u.handle is not None:
                self._free(u)
        return out

    # -- gradients: averaged into the shards' .grad by the end of each backward ---------------
    def _on_grad_ready(self, p: nn.Parameter):
        if not self._in_backward:               # the first gradient of this backward pass
            self._in_backward = True
            self._reduced = set()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        super()._on_grad_ready(p)

    def reduce(self, u: Unit):
        for _, shard, owner, piece in self._shards:   # .grad reset by the optimizer's zero_grad
            if owner is u:
                view = u.grad_shard[piece]
                if shard.grad is None:
                    view.zero_()
                elif shard.grad is not view:
                    view.copy_(shard.grad)
                shard.grad = view
        summed = reduce_scatter_down(u.flat_grad(), [self.mesh.p_group, self.mesh.g_group])
        u.grad_shard.add_(summed.div_(self.d))        # sum, then divide: the average
        for p in u.params:
            p.grad = None                               # the full gradient is dropped
        self._reduced.add(id(u))

    def _end_of_backward(self):
        self._in_backward = False
        self.settle()
        for u in self.units:          # a unit no backward reached: every rank issues the same
            if id(u) not in self._reduced:      # collectives, its shards get a zero gradient
                self.reduce(u)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every shard's gradient by ``min(1, max_norm / (norm + 1e-6))``, the norm being the
        whole model's averaged gradient's (one scalar all-reduce: the shards tile the model
        once over the group; frozen parameters have no gradient); returns the norm."""
        grads = [s.grad for _, s, _, _ in self._shards if s.grad is not None]
        p = float(norm_type)
        if math.isinf(p):
            local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
            total = comm.all_reduce_scalars([local], self.group, op="max")[0]
        else:
            local = sum(float(g.double().abs().pow(p).sum()) for g in grads)
            total = comm.all_reduce_scalars([local], self.group)[0] ** (1 / p)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return torch.tensor(total)

    # -- the full state ---------------------------------------------------------------------
    def _full_names(self) -> dict[nn.Parameter, list[str]]:
        """Every name of each parameter (a tied weight has two, as in the module's state dict)."""
        out: dict[nn.Parameter, list[str]] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            out.setdefault(p, []).append(n)
        return out

    def state_dict(self, *args, **kwargs) -> dict:
        """The module's full state dict, parameters in the masters' dtype (a collective)."""
        full = dict(self.module.state_dict(*args, **kwargs))     # buffers, frozen parameters
        prefix = kwargs.get("prefix", "")
        names = self._full_names()
        with comm.untracked(), torch.no_grad():
            for u in self.units:
                whole = gather_up(u.p_shard if u.master is None else u.master, [self.mesh.p_group])
                offset = 0
                for p in u.params:
                    value = whole[offset:offset + p.numel()].view_as(p).clone()
                    for n in names[p]:
                        full[prefix + n] = value
                    offset += p.numel()
        return full

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a full state dict (the bare module's names): each rank keeps its shards."""
        names = self._full_names()
        sharded = {n for u in self.units for p in u.params for n in names[p]}
        missing = sorted(n for u in self.units for p in u.params
                         if not any(k in state_dict for k in names[p]) for n in names[p][:1])
        if missing:
            raise KeyError(f"load_state_dict: no value for {missing[:4]}")
        with torch.no_grad():
            for u in self.units:
                target = u.p_shard if u.master is None else u.master
                values = [next(state_dict[k] for k in names[p] if k in state_dict) for p in u.params]
                full = torch.cat([v.reshape(-1).to(target) for v in values]
                                 + [target.new_zeros(u.N - u.numel)])
                target.copy_(full.chunk(self.d)[self.mesh.p_index])
        rest = {k: v for k, v in state_dict.items() if k not in sharded}
        result = self.module.load_state_dict(rest, strict=False)
        if strict:
            unexpected = [k for k in result.unexpected_keys]
            absent = [k for k in result.missing_keys if k not in sharded]
            if unexpected or absent:
                raise KeyError(f"load_state_dict: unexpected {unexpected[:4]}, missing {absent[:4]}")
        return result
