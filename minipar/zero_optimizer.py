"""ZeRO-1 and ZeRO-2 shaped like a torch optimizer, for any model in a plain loop.

``ShardedOptimizer`` makes one flat ``shard.Unit`` per parameter group and runs ZeRO's step
(``zero.sharded_optimizer_step``, ``zero.reduce_scatter_gradient``) on it; see ``minipar.zero``
for the idea and the volumes.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import comm, dp
from .train import optim
from . import zero
from .runtime.errors import UsageError
from .shard import GroupGrid, ShardMesh, Spec, Unit, gather_up

# --------------------------------------------------------------------------------------
# ZeRO-1 and ZeRO-2 shaped like a torch optimizer, for any model in a plain loop
# --------------------------------------------------------------------------------------
# Optimizers whose update of an element reads only that element's parameter, gradient and
# state (and scalars such as the step count): a flat slice across tensors leaves them exact.
ELEMENT_WISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
    "Rprop", "ASGD") if hasattr(torch.optim, name))
_SCALAR_STATE = ("step", "eta", "mu", "mu_product")   # per-tensor scalars of those optimizers


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``) over ``group``, shaped like a torch optimizer.

    Where one process writes ``torch.optim.AdamW(model.parameters(), lr=1e-3)``, each of d
    ranks writes ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`` on the
    bare model (group=None: the whole world; rank 0's parameters are broadcast first) and runs
    the same loop. Each parameter group's trainable parameters become one flat ``Unit``
    (their ``.data`` become views into it); this rank keeps the optimizer state of its 1/d
    slice only, and the gradients are averaged here, not by a DataParallel:

    * stage 1: backward accumulates this rank's gradients (``.grad`` are views into the
      unit's flat gradient); ``step()`` reduce-scatters them down to this rank's slice,
      updates it, and all-gathers the parameters;
    * stage 2: as soon as backward is done with a unit, its gradient is reduce-scattered into
      this rank's slice and the full gradient is dropped (after every backward pass: with
      accumulation, m reduce-scatters per step); ``step()`` updates and all-gathers.

    Bytes one rank sends per step (Psi = parameter bytes, padded; m backward passes)::

        reduce_scatter  (d-1)/d Psi  (stage 2: m times)      all_gather  (d-1)/d Psi
        broadcast       Psi from the first rank, once, when it is built

    What keeps the numbers torch's (each is checked; a violation raises):
    * only element-wise optimizers (``ELEMENT_WISE``; ``element_wise=True`` vouches for
      another): a per-tensor statistic (Adafactor's rows and columns, LAMB's trust ratio)
      over a slice of several tensors would silently differ;
    * every trainable parameter gets a gradient before each ``step()``: torch skips a
      parameter without one, a flat slice cannot;
    * not over the parameters of a ``dp.DataParallel``, which would average them a second time.
    ``step()`` consumes the gradients (as ``zero_grad(set_to_none=True)`` after it) and
    ``.grad`` never holds the average: read gradients through the optimizer, not ``.grad``.
    ``state_dict()`` is torch's own layout (every parameter's whole state, torch's indices),
    gathered from the slices, so it loads into a plain optimizer and back: call it, and
    ``load_state_dict()``, on every rank.
    """

    def __init__(self, params, optimizer_class, group=None, stage: int = 1,
                 element_wise: bool | None = None, **defaults):
        if stage not in (1, 2):
            raise UsageError(f"ShardedOptimizer stage must be 1 (optimizer states) or 2 (and "
                             f"gradients), not {stage!r}; ZeRO-3 shards the parameters too: "
                             f"zero.ShardedEngine(model, group, zero_spec(3, d), make_optimizer)")
        if not (optimizer_class in ELEMENT_WISE if element_wise is None else element_wise):
            raise UsageError(
                f"ShardedOptimizer updates flat slices that cut across tensors, exact only for "
                f"element-wise optimizers ({', '.join(c.__name__ for c in ELEMENT_WISE)}); "
                f"{getattr(optimizer_class, '__name__', optimizer_class)} may compute per-tensor "
                f"statistics. Use torch.distributed.optim.ZeroRedundancyOptimizer (whole "
                f"parameters per rank), or element_wise=True if each update is element by element")
        super().__init__(params, defaults)
        self.stage, self.group = stage, dp.resolve_group(group)
        d = comm.size(self.group)
        self.mesh = ShardMesh(GroupGrid(self.group), Spec(1, 1, d) if stage == 1 else Spec(1, d, d))
        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        for params in trainable:
            if not params:
                raise UsageError("ShardedOptimizer: a parameter group has no trainable parameter")
            if len({(p.dtype, p.device) for p in params}) > 1:
                raise UsageError("ShardedOptimizer: the parameters of one group must share a "
                                 "dtype and a device (make one group per dtype)")
            if any(dp.is_wrapped(p) for p in params):
                raise UsageError("ShardedOptimizer averages the gradients itself (reduce-"
                                 "scatter); give it the bare model's parameters, not those of a "
                                 "dp.DataParallel, which would average them a second time")
        self.units = [Unit(None, params, self.mesh) for params in trainable]
        dp.broadcast_from_first([u.flat for u in self.units], self.group)
        self.optimizer = optimizer_class([
            {**{k: v for k, v in g.items() if k != "params"}, "params": [u.os_param]}
            for g, u in zip(self.param_groups, self.units)])
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in inner.items():          # the class's defaults the caller left out
                g.setdefault(k, v)
        self.defaults = {**self.optimizer.defaults, **defaults}
        self._index = {id(p): i for i, p in enumerate(p for g in self.param_groups
                                                      for p in g["params"])}
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._views = {}                         # stage 1: each .grad a view into the flat gradient
        for u in self.units if stage == 1 else []:
            offset = 0
            for p in u.params:
                self._views[p] = u.grad_shard[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self._got_grad: set[int] = set()
        self._in_backward = False
        self._clip = None                        # (max_norm, norm_type) for the coming step
        self.grad_norm: float | None = None      # the norm the last clipping step measured
        self.optimizer.register_step_pre_hook(self._clip_averaged)
        # the OS shards (each os_param's .grad is the averaged gradient at the step) tile the
        # model once over the group: ZeRO-1/2 have no replicas of a shard
        optim.register_sharded([u.os_param for u in self.units], self.group)
        optim.register_elsewhere(list(self._unit_of), (
            f"ShardedOptimizer stage {stage}: after backward "
            + ("each .grad holds this rank's own gradient, not the average"
               if stage == 1 else "each .grad is None (reduce-scattered into the shards)")
            + "; the averaged gradient exists only inside step(): call "
              "opt.clip_grad_norm_(max_norm) before opt.step(), it clips there"))
        self.zero_grad()
        for p in self._unit_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._built = True

    # torch's Optimizer.__init__ adds the groups it is given through add_param_group; after
    # that the flat units are laid out and a new group would have none
    _built = False

    def add_param_group(self, param_group):
        if self._built:
            raise NotImplementedError("ShardedOptimizer: give every parameter group when it is built")
        super().add_param_group(param_group)

    # -- gradients ---------------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter):
        self._got_grad.add(id(p))
        if self.stage == 1:
            return
        if not self._in_backward:               # the first gradient of a backward pass
            self._in_backward = True
            for u in self.units:
                u.ready = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        u = self._unit_of[p]
        u.ready += 1
        if u.ready == len(u.params):
            zero.reduce_scatter_gradient(u, self.mesh)   # ZeRO-2: the full gradient is dropped

    def _end_of_backward(self):
        """Units that this backward reached only in part (a parameter it did not use)."""
        self._in_backward = False
        for u in self.units:
            if any(p.grad is not None for p in u.params):
                zero.reduce_scatter_gradient(u, self.mesh)

    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients (stage 1 keeps ``.grad`` as views into the flat gradient)."""
        for u in self.units:
            u.grad_shard.zero_()
            for p in u.params:
                p.grad = self._views[p] if self.stage == 1 else None
        self._got_grad.clear()
        self._in_backward = False     # a backward that raised never ran its end callback

    # -- clipping, where the averaged gradient exists -------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Clip the coming ``step()``'s averaged gradient to the global norm ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` on one process (the norm the step measured is then
        ``self.grad_norm``). The average exists only inside the step (after the
        reduce-scatter), so the clip is applied there, right before the update: one scalar
        all-reduce of the shards' sums of squares."""
        self._clip = (float(max_norm), float(norm_type))

    def _clip_averaged(self, optimizer, args=(), kwargs=None):
        if self._clip is None:
            return
        (max_norm, norm_type), self._clip = self._clip, None
        self.grad_norm = float(optim.clip_grad_norm_([u.os_param for u in self.units],
                                                     max_norm, norm_type))

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        missing = [p for p in self._unit_of if id(p) not in self._got_grad]
        if missing:
            raise RuntimeError(
                f"ShardedOptimizer: {len(missing)} of {len(self._unit_of)} trainable parameters "
                f"(shapes {[tuple(p.shape) for p in missing[:4]]}...) got no gradient since the "
                f"last step; torch's optimizer would skip them, a flat slice cannot: leave them "
                f"out of the optimizer or freeze them (requires_grad=False)")
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in g.items() if k != "params"})   # e.g. an LR scheduler's
        for u in self.units:
            if self.stage == 1:                 # a .grad someone replaced (set_to_none) comes back
                for p in u.params:
                    if p.grad is None:
                        self._views[p].zero_()
                    elif p.grad is not self._views[p]:
                        self._views[p].copy_(p.grad)
            elif any(p.grad is not None for p in u.params):
                zero.reduce_scatter_gradient(u, self.mesh)
        zero.sharded_optimizer_step(self.units, self.optimizer, self.mesh)
        for u in self.units:                    # the step consumed the gradients
            u.grad_shard.zero_()
            for p in u.params:
                p.grad = None
        self._got_grad.clear()
        return loss

    # -- checkpoints in torch's layout ---------------------------------------------------------
    def _os_offset(self, u: Unit) -> int:
        s_p, s_g, s_os = self.mesh.spec
        return (self.mesh.p_index * (u.N // s_p) + self.mesh.g_index * (u.N // s_g)
                + self.mesh.os_index * (u.N // s_os))

    def state_dict(self) -> dict:
        """torch's ``Optimizer.state_dict()`` of the whole model (a collective: every rank)."""
        state = {}
        with comm.untracked():
            for u in self.units:
                mine = self.optimizer.state.get(u.os_param, {})
                whole = {k: gather_up(v, [self.mesh.os_group, self.mesh.g_group, self.mesh.p_group])
                         if torch.is_tensor(v) and v.dim() == 1 else v for k, v in mine.items()}
                offset = 0
                for p in u.params:
                    if whole:
                        state[self._index[id(p)]] = {
                            k: (v[offset:offset + p.numel()].view_as(p).clone()
                                if torch.is_tensor(v) and v.dim() == 1
                                else v.clone() if torch.is_tensor(v) else v)
                            for k, v in whole.items()}
                    offset += p.numel()
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's layout (from ``state_dict()`` here, or from a plain torch optimizer)."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("load_state_dict: the saved parameter groups do not match this "
                             "optimizer's (their number or their sizes differ)")
        index = {}
        for g, inner, saved in zip(self.param_groups, self.optimizer.param_groups, saved_groups):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            g.update(hyper)
            inner.update(hyper)
            index.update({id(p): i for p, i in zip(g["params"], saved["params"])})
        for u in self.units:
            per = [state_dict["state"].get(index[id(p)]) for p in u.params]
            if all(s is None for s in per):
                self.optimizer.state.pop(u.os_param, None)
                continue
            if any(s is None for s in per):
                raise ValueError("load_state_dict: state for some parameters of a group but not all")
            n_os, start = u.os_param.numel(), self._os_offset(u)
            mine = {}
            for k, v in per[0].items():
                if self._per_element(k, [s[k] for s in per], u.params):
                    flat = torch.cat([s[k].reshape(-1).to(u.flat.device) for s in per]
                                     + [per[0][k].new_zeros(u.N - u.numel).to(u.flat.device)])
                    mine[k] = flat[start:start + n_os].clone()
                else:
                    mine[k] = v.clone() if torch.is_tensor(v) else v
            self.optimizer.state[u.os_param] = mine

    @staticmethod
    def _per_element(key, values, params) -> bool:
        if not all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, params)):
            return False
        return any(p.dim() > 0 for p in params) or key not in _SCALAR_STATE
