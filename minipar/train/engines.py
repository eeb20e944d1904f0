"""The trainer's two engines: data parallelism (``minipar.dp``) or ZeRO/AMSP (``minipar.zero``),
each holding the model states (parameters, gradients, optimizer) of one rank.

Both are built from the same values: the module, a mesh axis (``dp_cp``: every replica of the
model), the parameter groups (``minipar.mesh.param_groups``: dense, and MoE experts that
reduce over their own ``edp`` group) and the precision policy (``minipar.precision``), and
both answer what the rest of the trainer asks::

    zero_grad()  begin_step(m)  step()             the step (``step``: sync + update)
    model_state_bytes()                            what this rank holds, measured
    full_named_parameters()                        {local name: (full param, full grad)}
    flat_ranges()  sync_params()  optimizer        what the optimizer updates, as flat ranges
                                                   of local parameters (``pieces``: clipping,
                                                   checkpoints), and re-gathering after a load
"""
from __future__ import annotations

import torch

from .. import comm
from ..dp import DataParallel
from ..mesh import Axis, ParamGroup
from ..precision import PrecisionPolicy
from ..zero import ShardedEngine, gather_up


def _masters(optimizer, policy: PrecisionPolicy) -> dict:
    """Each updated tensor's fp32 master under a mixed policy (none in fp32: its own)."""
    return dict(zip(optimizer.params, optimizer.masters)) if policy.mixed else {}


def _unscaled(grad, optimizer, policy: PrecisionPolicy):
    """A 16-bit gradient as the optimizer saw it: without fp16's loss scale."""
    if grad is None or policy.loss_scaler is None:
        return grad
    return grad.float() / optimizer.grad_scale


class DataParallelEngine:
    """``dp.DataParallel`` over the dense group (and experts over theirs) with its optimizer."""

    def __init__(self, module, groups: list[ParamGroup], policy: PrecisionPolicy, make_optimizer,
                 mode: str = "overlapped", bucket_mb: float = 4.0):
        dense = groups[0].group
        self.dp = DataParallel(module, group=comm.SOLO if dense is None else dense, mode=mode,
                               bucket_mb=bucket_mb, groups=groups,
                               reduce_dtype=policy.reduce_dtype if policy.mixed else None)
        self.module, self.policy = module, policy
        self.optimizer = policy.optimizer(module.parameters(), make_optimizer)
        self.owner_group = {p: g.group for g in groups for p in g.params}

    def zero_grad(self):
        self.dp.zero_grad()

    def begin_step(self, microbatches: int):
        self.dp.begin_step(microbatches)

    def step(self):
        self.dp.finish_grad_sync()
        if self.policy.mixed:
            self.optimizer.step(main_grads=self.dp.main_grads)
        else:
            self.optimizer.step()
        self.dp.main_grads = {}              # the fp32 copies were transient

    def model_state_bytes(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.owner_group)
        grads = sum(b.buffer.numel() * b.buffer.element_size() for b in self.dp.buckets())
        optimizer = self.policy.state_bytes(self.optimizer)
        return dict(params=params, grads=grads, optimizer=optimizer, total=params + grads + optimizer)

    def full_named_parameters(self) -> dict:
        """Every replica holds them whole already (the gradient unscaled under fp16)."""
        return {n: (p.detach(), _unscaled(p.grad, self.optimizer, self.policy))
                for n, p in self.module.named_parameters()}

    def flat_ranges(self) -> list:
        """Per parameter (local name, shape, first element 0, 1-D views of what the optimizer
        updates: the fp32 master under mixed precision, its gradient and Adam's states, owner:
        the first rank of the parameter's reduce group)."""
        masters, out = _masters(self.optimizer, self.policy), []
        for name, p in self.module.named_parameters():
            q = masters.get(p, p)
            views = {"param": q.detach().view(-1)}
            if q.grad is not None:
                views["grad"] = q.grad.view(-1)
            views.update({k: v.view(-1) for k, v in self.optimizer.state.get(q, {}).items()
                          if torch.is_tensor(v) and v.numel() == p.numel()})
            out.append((name, p.shape, 0, views, comm.rank(self.owner_group.get(p)) == 0))
        return out

    def sync_params(self):
        """After a load: nothing to gather; the 16-bit parameters come from the masters."""
        if self.policy.mixed:
            self.optimizer.params_from_masters()


class ZeroEngine(ShardedEngine):
    """``zero.ShardedEngine`` over the ``dp_cp`` axis; MoE experts (a group with a process
    group of its own) stay whole, summed over their group at the step, in the policy's reduce
    dtype, and divided by its divisor."""

    def __init__(self, module, axis: Axis, spec, make_optimizer, groups: list[ParamGroup],
                 policy: PrecisionPolicy, units=None):
        self.whole_groups = [g for g in groups if g.group is not axis.group]
        super().__init__(module, axis, spec, make_optimizer, units=units, policy=policy,
                         whole=[p for g in self.whole_groups for p in g.params])
        for g in self.whole_groups:
            comm.broadcast_from_first(g.params, g.group)      # the experts: their group's first

    def step(self):
        super().step(before_update=self._reduce_whole)

    def _reduce_whole(self):
        wide = self.policy.reduce_dtype if self.policy.mixed else None
        for g in self.whole_groups:
            for p in g.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = p.grad if wide is None else p.grad.to(wide)
                comm.all_reduce(grad, g.group)
                p.grad.copy_(grad.div_(g.divisor))

    def full_named_parameters(self) -> dict:
        """{local name: (full parameter, full averaged gradient)}, gathered (bookkeeping)."""
        names = {p: n for n, p in self.module.named_parameters()}
        out, mesh = {}, self.mesh
        with comm.untracked():
            for u in self.units:
                flat = gather_up(u.p_shard, [mesh.p_group])
                grad = gather_up(u.os_grad, [mesh.os_group, mesh.g_group, mesh.p_group])
                offset = 0
                for p in u.params:
                    sl = slice(offset, offset + p.numel())
                    out[names[p]] = (flat[sl].view_as(p), grad[sl].view_as(p))
                    offset += p.numel()
        for p in self.whole:
            out[names[p]] = (p.detach(), _unscaled(p.grad, self.optimizer, self.policy))
        return out

    def flat_ranges(self) -> list:
        """Each parameter's part of this rank's OS shard (local name, shape, first element,
        1-D views of the parameter or its fp32 master, the averaged gradient and Adam's
        states, owner: replica 0 of ``zero_rep``); experts whole, owned by their group's first."""
        s_p, s_g, s_os = self.spec
        names = {p: n for n, p in self.module.named_parameters()}
        owner = comm.rank(self.mesh.rep_group) == 0
        masters, out = _masters(self.optimizer, self.policy), []
        for u in self.units:
            lo = (self.mesh.p_index * (u.N // s_p) + self.mesh.g_index * (u.N // s_g)
                  + self.mesh.os_index * (u.N // s_os))
            hi = lo + u.N // s_os
            param = masters.get(u.os_param, u.os_param)
            # the master's gradient exists during step() only (unscaled): what clipping scales
            flat = {"param": param.detach(), "grad": u.os_grad if param.grad is None else param.grad}
            flat.update({k: v for k, v in self.optimizer.state.get(param, {}).items()
                         if torch.is_tensor(v) and v.numel() == u.os_param.numel()})
            offset = 0
            for p in u.params:
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    out.append((names[p], p.shape, a - offset,
                                {k: v[a - lo:b - lo] for k, v in flat.items()}, owner))
                offset += p.numel()
        for g in self.whole_groups:
            for p in g.params:
                param = masters.get(p, p)
                views = {"param": param.detach().view(-1)}
                grad = p.grad if param.grad is None else param.grad
                if grad is not None:
                    views["grad"] = grad.view(-1)
                views.update({k: v.view(-1) for k, v in self.optimizer.state.get(param, {}).items()
                              if torch.is_tensor(v) and v.numel() == p.numel()})
                out.append((names[p], p.shape, 0, views, comm.rank(g.group) == 0))
        return out

    def sync_params(self):
        """After the OS shards were set outside ``step()`` (a checkpoint; the fp32 masters under
        mixed precision, rounded here): gather them up as the end of a step does."""
        with torch.no_grad():
            for p, m in _masters(self.optimizer, self.policy).items():
                p.copy_(m)
        from ..zero import all_gather_in_place
        for u in self.units:
            all_gather_in_place(u.g_slice, self.mesh.os_group)
            all_gather_in_place(u.p_shard, self.mesh.g_group)


def build_engine(cfg, mesh, module, policy: PrecisionPolicy, groups: list[ParamGroup],
                 make_optimizer):
    """DP over ``dp_cp`` (experts over ``edp``) or ZeRO/AMSP (``cfg.spec``) over ``dp_cp``: with
    context parallelism every cp rank holds the whole model, so its gradients are averaged,
    and its states sharded, over dp x cp ranks exactly as over data-parallel ones."""
    if cfg.spec is not None:
        return ZeroEngine(module, mesh.axis("dp_cp"), cfg.spec, make_optimizer, groups, policy,
                          units=module.parts())
    return DataParallelEngine(module, groups, policy, make_optimizer, cfg.dp_mode, cfg.bucket_mb)
