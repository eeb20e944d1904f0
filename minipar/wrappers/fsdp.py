"""ZeRO-3 with FSDP2's contract: ``fully_shard(module)`` changes the module in place.

The idea is ``minipar.zero``'s at (s_p, s_g, s_os) = (d, d, d) (ZeRO-3, Rajbhandari et al.
2020; FSDP, Zhao et al. 2023): each of d ranks keeps 1/d of every parameter, of its gradient
and of its optimizer state; a unit is all-gathered before its forward and again before its
backward, freed after each, and its gradient reduce-scattered once backward is done with it.
What this file adds is FSDP2's layout and surface, so that a script written for
``torch.distributed.fsdp.fully_shard`` runs with only its import changed::

    for block in model.blocks:                # a unit per block, then the root: the rest
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)      # the same module, changed in place
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)      # steps this rank's shards
    for x, y in batches:
        opt.zero_grad()
        model(x, y).backward()                # each shard's .grad: the averaged gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the global norm
        opt.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

**Dim-0 shards.** Each parameter of shape (n, ...) is cut into d chunks of c = ceil(n/d) rows
(the last ranks may hold fewer, or none); this rank's rows become the module's parameter, a
``DTensor`` placed ``Shard(0)`` whose shape is the whole parameter's. So shape rules
(``p.dim() >= 2``), ``numel()``, torch's optimizers, ``torch.nn.utils.clip_grad_norm_`` (a
global norm: DTensor sums the ranks' partial norms) and ``torch.distributed.checkpoint``'s
``get_model_state_dict``/``get_optimizer_state_dict`` (``full_state_dict=True``) see what they
would see on one process. The communication is minipar's own (``minipar.comm``), one
collective per unit: the unit's shards, each padded to c rows, are copied into one buffer
(copy-in), all-gathered rank after rank, and each parameter's rows copied out of the d
pieces (copy-out); the gradient takes the reverse way through one reduce-scatter.

**In place.** The module keeps its class (a subclass adds ``FSDPModule``'s few methods) and
its methods; ``fully_shard`` returns it. Between forward passes its parameters are the
shards; during its forward they are the gathered full tensors (swapped in and out of the
module's ``_parameters``), so no tensor a user can reach ever has freed storage. A call shards
what the calls on its sub-modules did not; the outermost becomes the root at the first
forward and runs the end of each backward for all of them. A weight tied across two calls
would silently be two weights: it is refused (call ``fully_shard`` on a module holding both).

**Left out.** ``ignored_params`` and 0-dim parameters stay whole plain parameters on every
rank (broadcast from rank 0 when built, their gradients averaged by the end of each
backward); torch's ``clip_grad_norm_`` refuses a mix of DTensors and plain tensors, and
``minipar.fsdp.clip_grad_norm_`` (also ``model.clip_grad_norm_``) takes both. Frozen
parameters are sharded too, and never reduced.

**Gradients.** After each backward every shard's ``.grad`` holds its average over the group
(reduce-scatter in ``reduce_dtype``, sum then divide by d), added to what ``.grad`` held:
accumulation as on one process. A unit reduces when its module's backward is over (a
post-backward function on its inputs, ``zero.PostBackward``), or at the end of the backward,
in module order, when its inputs needed no gradient; a unit no backward reached, or a
gradient a rank's branch did not make, is reduced as zeros. So every rank issues the same
collectives in the same order, whichever parameters its graph used.
``set_requires_gradient_sync(False)`` keeps the full gradients instead (summed in
``reduce_dtype``), until a backward with sync on.

**Activation checkpointing** (``torch.utils.checkpoint`` inside or around a sharded module,
reentrant or not; ``checkpoint_wrapper`` before ``fully_shard``): from a unit's pre-backward
to its post-backward its module shows the gathered parameters, so a recomputation that skips
the module's hooks uses them, and the post-backward (or the end of the backward) shows the
shards again even when torch stops the recomputed forward early.

**Precision** (``mp_policy``, FSDP2's ``MixedPrecisionPolicy`` or minipar's
``PrecisionPolicy``, read by attribute): shards stay in the module's dtype (the masters);
the copy-in casts them to ``param_dtype``, the unit computes in it (floating inputs cast to
it), gradients are reduced in ``reduce_dtype`` and added to the masters' ``.grad``.

Bytes one rank sends per step (Psi: the units' parameters in ``param_dtype``, each padded to
d c rows; Psi_r: the same in ``reduce_dtype``; m backward passes)::

    all_gather      2m (d-1)/d Psi       before each forward and each backward
    reduce_scatter   m (d-1)/d Psi_r     every backward (unless sync is off)
    broadcast        Psi_fp32 from rank 0, once, when it is built
"""
from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map

from .. import comm
from ..runtime.errors import UsageError
from ..zero import after_backward, alloc_storage, free_storage, storage_bytes, units_of


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward=True, mp_policy=None,
                ignored_params=None, shard_placement_fn=None, offload_policy=None, group=None,
                units=None, prefetch: bool = True) -> nn.Module:
    """Shard ``module``'s parameters (those no earlier call on a sub-module took) over
    ``mesh`` (a 1-D DeviceMesh) or ``group`` (None: the whole world; ``comm.SOLO``: one rank),
    in place; returns the module. ``units``: minipar's shortcut for the nesting, modules (or
    a policy ``module -> bool``, read as ``zero.units_of`` reads it) sharded first, one call
    each. The other arguments are FSDP2's (see the module's docstring)."""
    if isinstance(module, FSDPModule):
        raise UsageError(f"fully_shard: {type(module).__name__} is already sharded")
    if shard_placement_fn is not None:
        raise UsageError("fully_shard: only dim-0 shards (leave shard_placement_fn=None)")
    if getattr(offload_policy, "pin_memory", None) is not None:
        raise UsageError("fully_shard: CPU offload is not supported (leave offload_policy out)")
    if reshard_after_forward not in (True, False, None):
        raise UsageError(f"fully_shard: reshard_after_forward must be True or False, not "
                         f"{reshard_after_forward!r}")
    if mesh is not None and group is not None:
        raise UsageError("fully_shard: give mesh or group, not both")
    if mesh is not None:
        if mesh.ndim != 1:
            raise UsageError(f"fully_shard: a 1-D mesh only (got {mesh.ndim}-D; HSDP is not supported)")
        group = mesh.get_group()
    if units is not None:
        for unit, _ in units_of(module, units):
            if unit is not module and not isinstance(unit, FSDPModule):
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                            mp_policy=mp_policy, ignored_params=ignored_params,
                            group=None if mesh is not None else group, prefetch=prefetch)
    state = State(module, comm.resolve_group(group), mesh, mp_policy,
                  reshard_after_forward is not False, prefetch, ignored_params or ())
    module.__dict__["_minipar_fsdp"] = state
    module.__class__ = _sharded_class(type(module))
    return module


class FSDPModule:
    """What ``fully_shard`` adds to a module's class (FSDP2's ``FSDPModule``)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """False: backward passes keep the full gradients (no reduce-scatter, no average);
        the next backward with True reduces everything accumulated."""
        for m in self.modules() if recurse else [self]:
            if isinstance(m, FSDPModule):
                m._minipar_fsdp.sync = bool(requires_gradient_sync)

    def unshard(self, async_op: bool = False):
        """Gather this module's parameters now and show them (FSDP2's explicit prefetch): its
        next forward uses them; ``reshard()`` or that forward gives the shards back."""
        if async_op:
            raise UsageError("fully_shard: unshard(async_op=True) is not supported; call "
                             "unshard() (it waits), or rely on prefetch=True")
        st = self._minipar_fsdp
        if st.unit is not None:
            st.unit.gather()
            st.unit.show(full=True)
            st.kept = True

    def reshard(self):
        """Free this module's gathered parameters and show the shards (outside forward and
        backward they are already)."""
        st = self._minipar_fsdp
        if st.unit is not None:
            st.unit.free()
            st.unit.show(full=False)
            st.kept = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        if not reshard_after_backward:
            raise UsageError("fully_shard: set_reshard_after_backward(False) is not supported; "
                             "minipar frees every unit after its backward")

    def set_modules_to_forward_prefetch(self, modules):
        raise UsageError("fully_shard: explicit prefetch lists are not supported; fully_shard("
                         "..., prefetch=True) gathers the next unit in module order")

    set_modules_to_backward_prefetch = set_modules_to_forward_prefetch

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm_(self.parameters(), max_norm, norm_type)


@functools.lru_cache(maxsize=None)
def _sharded_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over shards (DTensors) and whole replicated
    parameters together, which torch's refuses: the norm of the whole averaged gradient,
    each element counted once; returns it (a plain tensor)."""
    from torch.distributed.tensor import DTensor
    parameters = [parameters] if torch.is_tensor(parameters) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    p = float(norm_type)
    norms = []
    for part in ([g for g in grads if isinstance(g, DTensor)],
                 [g for g in grads if not isinstance(g, DTensor)]):
        if part:
            n = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, p) for g in part]), p)
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms), p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total


# --------------------------------------------------------------------------------------
# One managed parameter and a unit of them: FSDP2's layout
# --------------------------------------------------------------------------------------
class Param:
    """A parameter of shape (n, ...) as this rank's ``chunk`` rows (c = ceil(n/d)), rows
    ``lo:hi`` of it: ``sharded`` (the module's parameter between uses, a DTensor when d > 1)
    and ``full`` (the one it computes with: its ``.data`` a view into the unit's gathered
    buffer, so that its own version counter ignores the buffer's refills)."""

    def __init__(self, slots, value: torch.Tensor, state: "State"):
        self.slots = slots                      # [(module, name)]: a tied weight has several
        self.shape, self.numel = value.shape, value.numel()
        self.width = math.prod(value.shape[1:])
        self.chunk = -(-value.shape[0] // state.d)
        self.lo = min(state.rank * self.chunk, value.shape[0])
        self.hi = min(self.lo + self.chunk, value.shape[0])
        self.mesh = state.mesh
        local = value.detach()[self.lo:self.hi].clone()
        self.sharded = nn.Parameter(self.as_shard(local), requires_grad=value.requires_grad)
        self.full = nn.Parameter(torch.empty(0, dtype=state.param_dtype, device=value.device),
                                 requires_grad=value.requires_grad)
        self.acc = None                         # sync off: the gradients kept, in reduce_dtype

    def as_shard(self, local: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return local
        from torch.distributed.tensor import DTensor, Shard
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                  shape=self.shape, stride=torch.empty(self.shape, device="meta").stride())

    def unreduced_grad(self, dtype) -> torch.Tensor | None:
        """The full gradient not reduced yet, in ``dtype``: the sum kept with sync off plus
        what the last backward left in ``full.grad``; both are taken."""
        g, self.full.grad = self.full.grad, None
        acc, self.acc = self.acc, None
        if g is None:
            return acc
        return g.to(dtype) if acc is None else acc.add_(g.to(dtype))

    def local(self) -> torch.Tensor:
        return self.sharded if self.mesh is None else self.sharded.to_local()

    def show(self, which: nn.Parameter):
        for m, name in self.slots:
            m._parameters[name] = which


class Unit:
    """The parameters one call manages, gathered and reduced together. ``block``: one rank's
    share of the collective buffers (each parameter's c rows, padded); ``unsharded``: the full
    parameters, allocated only while gathered."""

    def __init__(self, params: list[Param], state: "State"):
        self.params, self.state = params, state
        self.block = sum(p.chunk * p.width for p in params)
        self.trainable = any(p.full.requires_grad for p in params)
        self.unsharded = torch.empty(sum(p.numel for p in params), dtype=state.param_dtype,
                                     device=params[0].full.device)
        offset = 0
        for p in params:
            p.full.data = self.unsharded[offset:offset + p.numel].view(p.shape)
            offset += p.numel
        free_storage(self.unsharded)
        self.handle = self.gathered = None   # an all-gather in flight, and its output
        self.waiting = 0                     # forward calls whose backward has not ended
        self.reduced = False

    def start_gather(self):
        """Copy-in this rank's rows (cast to ``param_dtype``), all-gather (async)."""
        if self.handle is not None or storage_bytes(self.unsharded):
            return
        st = self.state
        mine = self.unsharded.new_zeros(self.block)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                rows = p.local().reshape(-1)
                mine[offset:offset + rows.numel()].copy_(rows)
                offset += p.chunk * p.width
        self.gathered = mine.new_empty(st.d * self.block)
        self.handle = comm.all_gather(self.gathered, mine, st.group, async_op=True)

    def gather(self):
        """The full parameters, ready: wait, then copy-out each one's rows from the d pieces."""
        self.start_gather()
        if self.handle is None:
            return
        self.handle.wait()
        alloc_storage(self.unsharded)
        pieces, offset = self.gathered.view(self.state.d, self.block), 0
        with torch.no_grad():
            for p in self.params:
                rows = pieces[:, offset:offset + p.chunk * p.width].reshape(-1, p.width)
                p.full.data.view(-1, p.width).copy_(rows[:p.shape[0]])
                offset += p.chunk * p.width
        self.handle = self.gathered = None

    def show(self, full: bool):
        """The module shows the gathered parameters (full) or the shards."""
        for p in self.params:
            p.show(p.full if full else p.sharded)

    def keep_unreduced(self):
        """Sync off: each full gradient accumulates in ``reduce_dtype`` (FSDP2's)."""
        for p in self.params:
            p.acc = p.unreduced_grad(self.state.reduce_dtype)

    def free(self):
        if self.handle is not None:
            self.handle.wait()
        self.handle = self.gathered = None
        free_storage(self.unsharded)

    def reduce(self):
        """Reduce-scatter the full gradients (copy-in, each padded to d c rows, in
        ``reduce_dtype``), divide by d, add this rank's rows to each shard's ``.grad``."""
        st = self.state
        pieces = torch.zeros(st.d, self.block, dtype=st.reduce_dtype, device=self.unsharded.device)
        offset = 0
        for p in self.params:
            g = p.unreduced_grad(st.reduce_dtype)
            if g is not None:
                rows = F.pad(g.reshape(p.shape[0], p.width), (0, 0, 0, st.d * p.chunk - p.shape[0]))
                pieces[:, offset:offset + p.chunk * p.width].copy_(rows.view(st.d, -1))
            offset += p.chunk * p.width
        mine = pieces.new_empty(self.block)
        comm.reduce_scatter(mine, pieces.view(-1), st.group)
        mine.div_(st.d)                         # gloo has no AVG: sum, then divide
        offset = 0
        with torch.no_grad():
            for p in self.params:
                if p.full.requires_grad:
                    local = mine[offset:offset + (p.hi - p.lo) * p.width]
                    local = local.view(p.hi - p.lo, *p.shape[1:]).to(p.sharded.dtype)
                    if p.sharded.grad is None:
                        p.sharded.grad = p.as_shard(local.clone())
                    else:
                        (p.sharded.grad if p.mesh is None else p.sharded.grad.to_local()).add_(local)
                offset += p.chunk * p.width
        self.reduced = True


# --------------------------------------------------------------------------------------
# One fully_shard call: its unit, its replicated parameters, and the hooks that move them
# --------------------------------------------------------------------------------------
class State:
    """What one ``fully_shard`` call keeps, on the module (``module._minipar_fsdp``)."""

    def __init__(self, module: nn.Module, group, mesh, mp_policy, reshard: bool, prefetch: bool,
                 ignored):
        self.module, self.group, self.reshard, self.prefetch = module, group, reshard, prefetch
        self.d, self.rank = comm.size(group), comm.rank(group)
        self.sync, self.root, self.states = True, None, []
        self.kept = False                       # gathered by unshard() for the next forward
        self.in_backward = self.callback_queued = False
        ignored = {id(p) for p in ignored}
        slots: dict[int, list] = {}
        values: dict[int, nn.Parameter] = {}
        for m in _managed_modules(module):
            for name, p in m._parameters.items():
                if p is not None:
                    slots.setdefault(id(p), []).append((m, name))
                    values[id(p)] = p
        self._refuse_ties_across_calls(module, values)
        managed = [values[i] for i in slots if i not in ignored and values[i].dim() > 0]
        kept = [values[i] for i in slots if i in ignored or values[i].dim() == 0]
        self.replicated = [p for p in kept if p.requires_grad]
        self.mesh = mesh if self.d > 1 else None
        if self.d > 1 and mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            pg = tdist.group.WORLD if group is comm.WORLD else group
            device = (managed or list(module.parameters()) or [torch.empty(0)])[0].device.type
            self.mesh = DeviceMesh.from_group(pg, device)
        # precision: a value read by attribute (FSDP2's MixedPrecisionPolicy or PrecisionPolicy)
        master = {p.dtype for p in managed}
        if len(master) > 1 or len({p.device for p in managed}) > 1:
            raise UsageError("fully_shard: the parameters one call shards must share one dtype "
                             "and device (build the model in fp32; mp_policy casts it)")
        master = master.pop() if master else torch.float32
        if getattr(mp_policy, "loss_scaler", None) is not None:
            raise UsageError("fully_shard does not scale the loss: scale it yourself "
                             "(precision.DynamicLossScaler) and pass a policy without a loss_scaler")
        if getattr(mp_policy, "master_dtype", master) != master:
            raise UsageError(f"fully_shard: the masters are the module's own {master} parameters; "
                             f"the policy asks for {mp_policy.master_dtype}")
        self.param_dtype = getattr(mp_policy, "param_dtype", None) or master
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None) or self.param_dtype
        self.output_dtype = getattr(mp_policy, "output_dtype", None)
        self.cast_inputs = getattr(mp_policy, "cast_forward_inputs", True) and self.param_dtype != master
        # rank 0's values everywhere (ranks may have built different models), then the shards
        comm.broadcast_from_first(managed + kept + list(module.buffers()), group)
        params = [Param(slots[id(p)], p, self) for p in managed]
        self._originals = [weakref.ref(p) for p in managed]
        self.unit = Unit(params, self) if params else None
        for p in params:
            p.show(p.sharded)
            if p.full.requires_grad:
                p.full.register_post_accumulate_grad_hook(self._on_grad_ready)
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    def _refuse_ties_across_calls(self, module, values):
        inner = [m._minipar_fsdp for m in module.modules() if isinstance(m, FSDPModule)]
        for p in values.values():
            if any(ref() is p for s in inner for ref in s._originals):
                raise UsageError("fully_shard: a parameter is tied across two fully_shard calls "
                                 "(it would become two weights); call fully_shard on a module "
                                 "that holds every use of it, not on each")

    # -- the root: the outermost call, found at the first forward ---------------------------
    def _become_root(self):
        self.root = self
        self.states = [m._minipar_fsdp for m in self.module.modules() if isinstance(m, FSDPModule)]
        for s in self.states:
            s.root = self

    def _neighbour(self, step: int) -> "Unit | None":
        states = self.root.states
        if self not in states:                  # sharded after the root's first forward
            return None
        k = states.index(self) + step
        return states[k].unit if 0 <= k < len(states) else None

    # -- forward ----------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        if self.root is None:
            self._become_root()
        if self.root is self and not self.in_backward:
            for s in self.states:               # gathered before a step changed the shards
                if s.unit is not None and not s.kept:
                    s.unit.free()
        recomputing = self.root.in_backward     # activation checkpointing's second forward
        if self.unit is not None:
            self._adopt()
            self.unit.gather()
            nxt = self._neighbour(+1) if self.prefetch and not recomputing else None
            if nxt is not None:
                nxt.start_gather()              # overlaps this unit's forward
            self.unit.show(full=True)
        if self.cast_inputs:
            cast = lambda t: (t.to(self.param_dtype)   # noqa: E731
                              if torch.is_tensor(t) and t.is_floating_point() else t)
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        if self.unit is not None and self.unit.trainable and torch.is_grad_enabled() \
                and not recomputing:
            args, kwargs = self._mark_post_backward(args, kwargs)
        return args, kwargs

    def _mark_post_backward(self, args, kwargs):
        """The inputs that need a gradient through ``zero.PostBackward``: its backward runs
        when this call's backward is done, at the same place in every rank's graph."""
        marked = after_backward(self._post_backward, args, kwargs)
        if marked is None:
            return args, kwargs
        self.unit.waiting += 1
        return marked

    def _adopt(self):
        """A parameter the user replaced since (``load_state_dict(assign=True)``) is the shard now."""
        for p in self.unit.params:
            now = p.slots[0][0]._parameters[p.slots[0][1]]
            if now is not p.sharded and now is not p.full:
                if getattr(now, "shape", None) != p.shape:
                    raise UsageError(f"fully_shard: {p.slots[0][1]} was replaced by a tensor of "
                                     f"shape {tuple(now.shape)}, not {tuple(p.shape)}")
                p.sharded = now

    def _post_forward(self, module, args, output):
        self.kept = False
        if self.unit is not None:
            if self.root.in_backward:           # a recomputation inside backward: keep it
                return output
            self.unit.show(full=False)
            # FSDP2's: the root keeps its parameters for the backward right after its forward
            if not torch.is_grad_enabled() or self.reshard and self.root is not self:
                self.unit.free()
        if torch.is_grad_enabled():             # its output's gradient comes just before its backward
            for t in tree_leaves(output):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        if self.root is self:
            for s in self.states:               # a prefetch no module used (a skipped branch)
                if s.unit is not None and s.unit.handle is not None:
                    s.unit.free()
            if self.output_dtype is not None:
                output = tree_map(lambda t: t.to(self.output_dtype) if torch.is_tensor(t)
                                  and t.is_floating_point() else t, output)
        return output

    # -- backward ---------------------------------------------------------------------------
    def _begin_backward(self):
        root = self.root
        if not root.callback_queued:
            root.callback_queued = root.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(root._end_of_backward)

    def _pre_backward(self, grad):
        self._begin_backward()
        if self.unit is not None:
            self.unit.gather()
            self.unit.show(full=True)           # for a recomputation that skips the hooks
            prev = self._neighbour(-1) if self.prefetch else None
            if prev is not None:
                prev.start_gather()             # overlaps this unit's backward
        return None

    def _on_grad_ready(self, full: nn.Parameter):
        self._begin_backward()
        if self.unit.reduced:
            name = next(p.slots[0][1] for p in self.unit.params if p.full is full)
            raise RuntimeError(f"fully_shard: a gradient of {name} arrived after its module's "
                               f"backward had ended and its unit was reduced (a use outside "
                               f"the module's forward); call fully_shard on a module that "
                               f"holds every use of it")

    def _post_backward(self):
        self.unit.waiting -= 1
        if self.unit.waiting == 0:              # every forward call's backward is done
            self._finish_backward()

    def _finish_backward(self):
        """Free the unit, show its shards again, reduce it (once a backward, with sync on)."""
        u = self.unit
        u.free()
        u.show(full=False)
        if u.trainable and not u.reduced:
            if self.sync:
                u.reduce()
            else:
                u.keep_unreduced()

    def _end_of_backward(self):
        """Every state of the tree, in module order: what no post-backward finished (inputs
        that needed no gradient, a call whose backward never ran), then the replicated
        gradients. Which units finish here depends only on the graph's shape, so every rank
        issues the same collectives in the same order, whichever parameters its branch used;
        no async work outlives backward, no reachable tensor has freed storage."""
        for s in self.states:
            if s.unit is not None:
                s._finish_backward()
                s.unit.waiting, s.unit.reduced = 0, False
            if s.sync and s.replicated:
                s._average_replicated()
        self.in_backward = self.callback_queued = False

    def _average_replicated(self):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, self.group)
        flat.div_(self.d)
        offset = 0
        for p in self.replicated:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()


def _managed_modules(module: nn.Module) -> list[nn.Module]:
    """``module`` and its sub-modules (depth first, as ``named_parameters``), not looking into
    those an earlier call sharded."""
    out, seen, todo = [], set(), [module]
    while todo:
        m = todo.pop()
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
            todo += reversed([c for c in m.children() if not isinstance(c, FSDPModule)])
    return out
