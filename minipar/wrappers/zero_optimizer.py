"""ZeRO-1/2's torch-optimizer surface: what lets ``minipar.zero.ShardedOptimizer`` stand where a
script has ``ZeroRedundancyOptimizer`` (or a plain optimizer): parameter groups and their
hyper-parameters (an LR scheduler's), clipping where the averaged gradient exists, and state
dicts in torch's own layout (every parameter's whole state under torch's indices), so a
checkpoint loads into a plain optimizer and back: ``consolidate_state_dict(to)`` on every
rank, then ``state_dict()`` on rank ``to`` (ZeroRedundancyOptimizer's pair). The algorithm is
``minipar.zero``'s ``ShardedEngine``; ``ShardedOptimizer`` there names it as ``engine_class``.

Beside ``minipar.dp.DataParallel`` or torch's ``DistributedDataParallel`` (as
ZeroRedundancyOptimizer beside DDP, built before or after it: nanoGPT builds the optimizer
first), the gradients are already averaged by the end of backward: stage 1 then takes its
slice of them without communicating and only all-gathers the updated parameters
(all_reduce 2 (d-1)/d Psi + all_gather (d-1)/d Psi, as DDP + ZeroRedundancyOptimizer), and
``torch.nn.utils.clip_grad_norm_`` sees the averaged gradients. Stage 2 has nothing to shard
there (the wrapper holds every full gradient) and is refused. The wrapper is looked for when
the optimizer is built and again at its first step: DataParallel through the hooks torch
keeps on the parameters, DDP through the parameter list it keeps.

Alone, the averaging happens inside ``step()``, so between backward and step ``.grad`` is not
the averaged gradient: stage 1's is this rank's own, stage 2's was reduce-scattered away.
``torch.nn.utils.clip_grad_norm_`` would clip the wrong thing, so it stops with one line
naming ``opt.clip_grad_norm_``: stage 1 at ``step()`` (the gradients it left changed in place
after backward), stage 2 at once (its ``.grad`` is a stand-in that refuses every use).
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..runtime.errors import UsageError

# updates that read only each element's own parameter, gradient and state: a flat slice
# across tensors leaves them exact
ELEMENT_WISE = tuple(getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adamax", "NAdam",
                     "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD") if hasattr(torch.optim, n))
# per-tensor scalars of those optimizers (not sliced with the parameters)
SCALAR_STATE = ("step", "eta", "mu", "mu_product")


class OptimizerSurface(torch.optim.Optimizer):
    """A torch optimizer whose work is a ZeRO engine (``engine_class``) of one unit per
    parameter group; ``gather(x, groups)`` gathers OS chunks (for state dicts).
    ``process_group``, ``parameters_as_bucket_view`` and ``overlap_with_ddp`` are
    ZeroRedundancyOptimizer's (the units are flat buffers already; no DDP overlap)."""

    engine_class = None
    gather = None

    def __init__(self, params, optimizer_class, group=None, stage: int = 1,
                 element_wise: bool | None = None, *, process_group=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults):
        if stage not in (1, 2):
            raise UsageError(f"ShardedOptimizer stage must be 1 or 2, not {stage!r}; ZeRO-3 "
                             f"shards the parameters too: ShardedEngine or minipar.fsdp.fully_shard")
        if overlap_with_ddp:
            raise UsageError("ShardedOptimizer: overlap_with_ddp is not supported; leave it False "
                             "(DataParallel averages, then the optimizer steps its slice)")
        if group is not None and process_group is not None:
            raise UsageError("ShardedOptimizer: give group or process_group, not both")
        group = group if group is not None else process_group
        if not (optimizer_class in ELEMENT_WISE if element_wise is None else element_wise):
            raise UsageError(
                f"ShardedOptimizer updates flat slices across tensors, exact only for element-wise "
                f"optimizers ({', '.join(c.__name__ for c in ELEMENT_WISE)}); "
                f"{getattr(optimizer_class, '__name__', optimizer_class)} may not be: use "
                f"torch's ZeroRedundancyOptimizer, or element_wise=True if it is")
        super().__init__(params, defaults)
        groups = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        for ps in groups:
            if not ps or len({(p.dtype, p.device) for p in ps}) > 1:
                raise UsageError("ShardedOptimizer: each parameter group needs trainable "
                                 "parameters of one dtype and device (make one group per dtype)")
        self.stage = stage
        self.beside = self._averager(comm.resolve_group(group))
        d = comm.size(comm.resolve_group(group))
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self.engine = self.engine_class(
            None, group, (1, 1, d) if stage == 1 else (1, d, d),
            lambda shards: optimizer_class([{**h, "params": [s]} for h, s in zip(hyper, shards)]),
            units=[(None, ps) for ps in groups])
        self.units, self.mesh = self.engine.units, self.engine.mesh
        self.optimizer = self.engine.optimizer
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in inner.items():          # the class's defaults the caller left out
                g.setdefault(k, v)
        self.defaults = {**self.optimizer.defaults, **defaults}
        self._index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self._params = list(self.engine._unit_of)
        self._got_grad: set[int] = set()
        self._queued, self._left = False, {}    # the .grad tensors backward left, and versions
        self._steps, self._consolidated = 0, None
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad)
            if stage == 2 and self.beside is None:
                p.register_hook(lambda grad, p=p: self._drop_stand_in(p) or grad)
        self._clip, self.grad_norm = None, None
        self.optimizer.register_step_pre_hook(self._clip_averaged)
        self.zero_grad()
        self._built = True

    _built = False

    def _averager(self, group):
        """The data-parallel wrapper that averages these parameters' gradients by the end of
        each backward: ``minipar.dp.DataParallel`` (found through the post-accumulate-grad
        hooks torch keeps on each parameter) or torch's ``DistributedDataParallel`` (found
        through the list of parameters it keeps, ``_module_parameters``); None if none."""
        from ..dp import DataParallel
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        found = {}
        for p in params:
            for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
                owner = getattr(hook, "__self__", None)
                if isinstance(owner, DataParallel):
                    found[id(owner)] = (owner, owner.group, owner._bucket_of)
        for ddp in _torch_ddps_over(params[0]) if params else ():
            found[id(ddp)] = (ddp, ddp.process_group, set(ddp._module_parameters))
        if not found:
            return None
        name = type(next(iter(found.values()))[0]).__name__
        if self.stage == 2:
            raise UsageError(f"ShardedOptimizer(stage=2) beside {name}: it already holds and "
                             f"averages every full gradient, so stage 2 has nothing to shard; "
                             f"use stage=1 (as ZeroRedundancyOptimizer beside DDP)")
        if len(found) > 1:
            raise UsageError("ShardedOptimizer: its parameters are inside two data-parallel "
                             "wrappers; wrap the model once")
        ((owner, dp_group, inside),) = found.values()
        if comm.global_ranks(comm.resolve_group(dp_group)) != comm.global_ranks(group):
            raise UsageError(f"ShardedOptimizer beside {name}: both must work over the same "
                             f"process group")
        if any(p not in inside for p in params):
            raise UsageError(f"ShardedOptimizer beside {name}: some of its parameters are "
                             f"outside the {name} (their gradients would not be averaged); "
                             f"wrap the whole model, or none of it")
        return owner

    def add_param_group(self, param_group):
        if self._built:
            raise NotImplementedError("ShardedOptimizer: give every parameter group when it is built")
        super().add_param_group(param_group)

    # -- what backward leaves in .grad, and who may touch it -----------------------------------
    def _on_grad(self, p):
        self._got_grad.add(id(p))
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self):
        self._queued = False
        if self.beside is not None:
            return
        if self.stage == 2:                     # every gradient is in its shard now
            self.engine.settle()
            for p in self._params:
                if p.grad is None:
                    p.grad = _stand_in(p)
        self._note_grads()

    def _note_grads(self):
        self._left = {id(p): (p.grad, None if p.grad is None or isinstance(p.grad, _Reduced)
                              else p.grad._version) for p in self._params}

    def _check_grads(self):
        """Stage 1 alone: a ``.grad`` changed in place (or replaced) since backward left it
        means someone clipped or scaled this rank's unaveraged gradient."""
        for p in self._params:
            g, version = self._left.get(id(p), (None, None))
            if p.grad is not g or (g is not None and version is not None and g._version != version):
                raise RuntimeError(
                    "ShardedOptimizer: a .grad was changed after backward (torch.nn.utils."
                    "clip_grad_norm_?), but it holds this rank's own gradient, averaged only "
                    "inside step(); clip with opt.clip_grad_norm_(max_norm)")

    @staticmethod
    def _drop_stand_in(p):
        if isinstance(p.grad, _Reduced):        # the next backward accumulates from nothing
            p.grad = None

    def _drop_stand_ins(self):
        for p in self._params:
            self._drop_stand_in(p)

    def zero_grad(self, set_to_none: bool = True):
        if self.beside is not None:             # DataParallel's buckets take the gradients
            for p in self._params:
                p.grad = None
        else:
            self.engine.zero_grad()
        self._got_grad.clear()
        self._note_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Clip the coming step's averaged gradient to ``max_norm`` (global norm, as torch's
        ``clip_grad_norm_`` on one process); the norm is ``self.grad_norm`` after the step."""
        self._clip = (float(max_norm), float(norm_type))

    def _clip_averaged(self, optimizer, args=(), kwargs=None):
        if self._clip is None:
            return
        (max_norm, p), self._clip = self._clip, None
        grads = [u.os_grad for u in self.units]      # they tile the model once over the group
        if math.isinf(p):
            total = comm.all_reduce_scalars([max((float(g.abs().max()) for g in grads if g.numel()),
                                                 default=0.0)], self.engine.group, op="max")[0]
        else:
            part = sum(float(g.double().abs().pow(p).sum()) for g in grads)
            total = comm.all_reduce_scalars([part], self.engine.group)[0] ** (1 / p)
        self.grad_norm = total
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        missing = [p for p in self._params if id(p) not in self._got_grad]
        if missing:
            raise RuntimeError(f"ShardedOptimizer: {len(missing)} trainable parameters (shapes "
                               f"{[tuple(p.shape) for p in missing[:4]]}) got no gradient since the "
                               f"last step; torch would skip them, a flat slice cannot: leave them "
                               f"out of the optimizer or freeze them")
        if self.beside is None and self._steps == 0:
            self.beside = self._averager(self.engine.group)    # nanoGPT's order: DDP built after
        if self.beside is None and self.stage == 1:
            self._check_grads()
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in g.items() if k != "params"})   # an LR scheduler's
        self._drop_stand_ins()
        if self.beside is not None:
            self._step_averaged()
        else:
            if self.stage == 1:                 # a .grad someone replaced comes back into place
                for u in self.units:
                    flat = u.flat_grad()
                    u.attach_grads()
                    u.grad_shard.copy_(flat)
            self.engine.step()
        self._steps += 1
        self.zero_grad()                        # the step consumed the gradients
        for p in self._params:
            p.grad = None
        self._note_grads()
        return loss

    def _step_averaged(self):
        """Beside DataParallel: each rank's slice of the averaged gradient, no communication;
        the step; the updated slices all-gathered (ZeroRedundancyOptimizer's broadcasts)."""
        if getattr(self.beside, "_pending", False):   # DataParallel's accumulation, unaveraged
            self.beside.finish_grad_sync()
        for u in self.units:
            u.os_grad.copy_(u.flat_grad()[u.os_slice])
        self.optimizer.step()
        for u in self.units:                    # OS slices -> G slice -> P shard, in place
            u.g_slice.copy_(self.gather(u.os_param, [self.mesh.os_group]))
            u.p_shard.copy_(self.gather(u.g_slice, [self.mesh.g_group]))

    # -- state dicts in torch's layout -------------------------------------------------------
    def _full_state_dict(self) -> dict:
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": full_state(self.units, self.mesh, self.optimizer, self._index,
                                    self.gather), "param_groups": groups}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state (torch's layout) onto the group's rank ``to``: a collective,
        called on every rank (ZeroRedundancyOptimizer's)."""
        full = self._full_state_dict()
        self._consolidated = (full, self._steps) if comm.rank(self.engine.group) == to else None

    def state_dict(self) -> dict:
        """The state ``consolidate_state_dict`` gathered here (no communication, so a call on
        one rank never waits for the others); one process: the state itself."""
        if comm.size(self.engine.group) == 1:
            return self._full_state_dict()
        if self._consolidated is None:
            raise RuntimeError(f"ShardedOptimizer: the state is not consolidated on this rank: call "
                               f"consolidate_state_dict(to={comm.rank(self.engine.group)}) on every "
                               f"rank first, as with ZeroRedundancyOptimizer")
        full, at = self._consolidated
        if at != self._steps:
            raise RuntimeError("ShardedOptimizer: the consolidated state is from before the last "
                               "step; call consolidate_state_dict(to=...) on every rank again")
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's layout (from ``state_dict()`` here, or from a plain torch optimizer),
        on every rank: each keeps its slices."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("load_state_dict: the saved parameter groups do not match this "
                             "optimizer's (their number or their sizes differ)")
        index = {}
        for g, inner, s in zip(self.param_groups, self.optimizer.param_groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
            inner.update({k: v for k, v in s.items() if k != "params"})
            index.update({id(p): i for p, i in zip(g["params"], s["params"])})
        load_full_state(self.units, self.mesh, self.optimizer, state_dict["state"], index)


def _torch_ddps_over(param) -> list:
    """torch's ``DistributedDataParallel`` modules that hold ``param`` (it keeps no hook a
    Python caller can see, only its list ``_module_parameters``)."""
    import gc
    from torch.nn.parallel import DistributedDataParallel
    out = []
    for holder in gc.get_referrers(param):
        if isinstance(holder, list):
            for owner in gc.get_referrers(holder):
                owners = gc.get_referrers(owner) if isinstance(owner, dict) else [owner]
                out += [o for o in owners if isinstance(o, DistributedDataParallel)
                        and o.__dict__.get("_module_parameters") is holder and o not in out]
    return out


class _Reduced(torch.Tensor):
    """Stage 2's ``.grad`` between backward and step: the gradient lives in this rank's shard,
    so any use of this stand-in (a clip, a norm, a print) stops with one line."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("ShardedOptimizer(stage=2): this .grad was reduce-scattered into the "
                           "optimizer's shard and is not held here; clip with "
                           "opt.clip_grad_norm_(max_norm), not torch.nn.utils.clip_grad_norm_")


def _stand_in(p) -> torch.Tensor:
    """A ``.grad`` of ``p``'s shape, dtype and device that holds one element."""
    return torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).as_subclass(_Reduced)


def os_offset(u, mesh) -> int:
    """Where this rank's OS chunk starts in the unit's flat buffer."""
    s_p, s_g, s_os = mesh.spec
    return mesh.p_index * (u.N // s_p) + mesh.g_index * (u.N // s_g) + mesh.os_index * (u.N // s_os)


def _per_element(key, values, params) -> bool:
    if not all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, params)):
        return False
    return any(p.dim() > 0 for p in params) or key not in SCALAR_STATE


def full_state(units, mesh, optimizer, index: dict[int, int], gather) -> dict[int, dict]:
    """{torch index: whole state} of every parameter, gathered from the OS chunks (a collective
    over the unit's groups; ``gather(x, groups)``: ``minipar.zero.gather_up``)."""
    state = {}
    with comm.untracked():
        for u in units:
            mine = optimizer.state.get(u.os_param, {})
            whole = {k: gather(v, [mesh.os_group, mesh.g_group, mesh.p_group])
                     if torch.is_tensor(v) and v.dim() == 1 else v for k, v in mine.items()}
            offset = 0
            for p in u.params:
                if whole:
                    state[index[id(p)]] = {
                        k: (v[offset:offset + p.numel()].view_as(p).clone()
                            if torch.is_tensor(v) and v.dim() == 1
                            else v.clone() if torch.is_tensor(v) else v)
                        for k, v in whole.items()}
                offset += p.numel()
    return state


def load_full_state(units, mesh, optimizer, state: dict, index: dict[int, int]) -> None:
    """Cut each parameter's whole state (torch's layout, ``index``: id -> saved index) down to
    this rank's OS chunks."""
    for u in units:
        per = [state.get(index[id(p)]) for p in u.params]
        if all(s is None for s in per):
            optimizer.state.pop(u.os_param, None)
            continue
        if any(s is None for s in per):
            raise ValueError("load_state_dict: state for some parameters of a group but not all")
        n_os, start = u.os_param.numel(), os_offset(u, mesh)
        mine = {}
        for k, v in per[0].items():
            if _per_element(k, [s[k] for s in per], u.params):
                flat = torch.cat([s[k].reshape(-1).to(u.flat.device) for s in per]
                                 + [per[0][k].new_zeros(u.N - u.numel).to(u.flat.device)])
                mine[k] = flat[start:start + n_os].clone()
            else:
                mine[k] = v.clone() if torch.is_tensor(v) else v
        optimizer.state[u.os_param] = mine


def full_parameters(engine) -> dict:
    """{name: the full parameter} of a ``zero.ShardedEngine``'s module, gathered from the P
    shards (bookkeeping: untracked), e.g. to compare with one process."""
    names, out = {p: n for n, p in engine.module.named_parameters()}, {}
    with comm.untracked():
        for u in engine.units:
            flat, offset = u.p_shard, 0
            if comm.size(engine.mesh.p_group) > 1:
                flat = u.p_shard.new_empty(u.p_shard.numel() * comm.size(engine.mesh.p_group))
                comm.all_gather(flat, u.p_shard, engine.mesh.p_group)
            for p in u.params:
                out[names[p]] = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
    return out | {names[p]: p.detach().clone() for p in engine.whole}
