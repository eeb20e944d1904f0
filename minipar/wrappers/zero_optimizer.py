"""ZeRO-1/2's torch-optimizer surface: what lets ``minipar.zero.ShardedOptimizer`` stand where a
script has ``ZeroRedundancyOptimizer`` (or a plain optimizer): parameter groups and their
hyper-parameters (an LR scheduler's), clipping where the averaged gradient exists, and state
dicts in torch's own layout (every parameter's whole state under torch's indices), so a
checkpoint loads into a plain optimizer and back. The algorithm is ``minipar.zero``'s
``ShardedEngine``; ``ShardedOptimizer`` there names it as ``engine_class``.
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
    parameter group; ``gather(x, groups)`` gathers OS chunks (for state dicts)."""

    engine_class = None
    gather = None

    def __init__(self, params, optimizer_class, group=None, stage: int = 1,
                 element_wise: bool | None = None, **defaults):
        if stage not in (1, 2):
            raise UsageError(f"ShardedOptimizer stage must be 1 or 2, not {stage!r}; ZeRO-3 "
                             f"shards the parameters too: ShardedEngine or minipar.fsdp.fully_shard")
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
        d = comm.size(comm.resolve_group(group))
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self.engine = self.engine_class(
            None, group, (1, 1, d) if stage == 1 else (1, d, d),
            lambda shards: optimizer_class([{**h, "params": [s]} for h, s in zip(hyper, shards)]),
            units=[(None, ps) for ps in groups])
        self.stage, self.units, self.mesh = stage, self.engine.units, self.engine.mesh
        self.optimizer = self.engine.optimizer
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in inner.items():          # the class's defaults the caller left out
                g.setdefault(k, v)
        self.defaults = {**self.optimizer.defaults, **defaults}
        self._index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self._got_grad: set[int] = set()
        for p in self.engine._unit_of:
            p.register_post_accumulate_grad_hook(lambda p: self._got_grad.add(id(p)))
        self._clip, self.grad_norm = None, None
        self.optimizer.register_step_pre_hook(self._clip_averaged)
        self.zero_grad()
        self._built = True

    _built = False

    def add_param_group(self, param_group):
        if self._built:
            raise NotImplementedError("ShardedOptimizer: give every parameter group when it is built")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True):
        self.engine.zero_grad()
        self._got_grad.clear()

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
        missing = [p for p in self.engine._unit_of if id(p) not in self._got_grad]
        if missing:
            raise RuntimeError(f"ShardedOptimizer: {len(missing)} trainable parameters (shapes "
                               f"{[tuple(p.shape) for p in missing[:4]]}) got no gradient since the "
                               f"last step; torch would skip them, a flat slice cannot: leave them "
                               f"out of the optimizer or freeze them")
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in g.items() if k != "params"})   # an LR scheduler's
        if self.stage == 1:                     # a .grad someone replaced comes back into place
            for u in self.units:
                flat = u.flat_grad()
                u.attach_grads()
                u.grad_shard.copy_(flat)
        self.engine.step()
        self.zero_grad()                        # the step consumed the gradients
        for u in self.units:
            for p in u.params:
                p.grad = None
        return loss

    def state_dict(self) -> dict:
        """torch's ``state_dict()`` of the whole model (a collective: every rank)."""
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self._index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": full_state(self.units, self.mesh, self.optimizer, self._index,
                                    self.gather), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's layout (from ``state_dict()`` here, or from a plain torch optimizer)."""
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
