"""The drop-ins' hard cases, each on two gloo ranks against torch's twin (FSDP2, DDP,
ZeroRedundancyOptimizer) or against one process where torch refuses.

* activation checkpointing inside and around sharded modules (reentrant, non-reentrant with
  its early stop, ``checkpoint_wrapper`` before ``fully_shard``, minipar's GPT with every
  ``recompute``): the losses, torch's ``clip_grad_norm_`` and the full state equal FSDP2's,
  and after every backward each parameter is its shard again, with storage;
* a parameter only some ranks use: the ranks issue the same collectives in the same order
  (never a unit summed into another), equal to one process averaging the ranks' losses.
"""
import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from test_wrappers import launched         # one launch per family, cached

pytestmark = pytest.mark.slow     # against torch's twins; test_wrappers' twins are quick

D, STEPS, BATCH, SEED = 2, 3, 8, 100
CKPT = ("inside-reentrant", "inside-non-reentrant", "around-non-reentrant", "around-reentrant",
        "checkpoint_wrapper")


class Block(nn.Module):
    def __init__(self, inside=None):
        super().__init__()
        self.fc1, self.fc2, self.inside = nn.Linear(8, 16), nn.Linear(16, 8), inside

    def inner(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x):
        if self.inside is None:
            return x + self.inner(x)
        return x + checkpoint(self.inner, x, use_reentrant=self.inside == "reentrant")


class Net(nn.Module):
    """An input layer, two residual blocks, a head; ``how`` one of ``CKPT`` (or None)."""

    def __init__(self, how=None):
        super().__init__()
        inside = how.split("inside-")[1] if how and how.startswith("inside-") else None
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 4)
        self.blocks = nn.ModuleList(Block(inside) for _ in range(2))
        self.around = how.split("around-")[1] if how and how.startswith("around-") else None

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x) if self.around is None else \
                checkpoint(b, x, use_reentrant=self.around == "reentrant")
        return self.out(x)


def make(how, seed):
    torch.manual_seed(seed)
    return Net(how)


def shard(fully_shard, model, how):
    """FSDP2's habit: each block, then the root; torchtitan's order for the wrapper."""
    for i, block in enumerate(model.blocks):
        if how == "checkpoint_wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
                checkpoint_wrapper
            block = model.blocks[i] = checkpoint_wrapper(block)
        fully_shard(block)
    fully_shard(model)
    return model


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def train(model, rank=0, d=1, clip=0.5):
    """AdamW, torch's clip_grad_norm_; [(loss, norm, every parameter a live shard)]."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(d)[rank], y.chunk(d)[rank]
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        out.append((float(loss.detach()), float(norm.detach()), live_shards(model)))
        opt.step()
    return out


def live_shards(model) -> bool:
    """Every parameter a user can reach is a DTensor shard whose storage is allocated."""
    from torch.distributed.tensor import DTensor
    return all(isinstance(p, DTensor) and p.to_local().untyped_storage().nbytes() > 0
               for p in model.parameters())


def full_state(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.replace("._checkpoint_wrapped_module", ""): v for k, v in state.items()}


def _checkpoint_runs():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from minipar import fsdp
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for how in CKPT:
        for name, fully_shard in (("minipar", fsdp.fully_shard), ("fsdp2", torch_fully_shard)):
            try:
                model = shard(fully_shard, make(how, SEED), how)
                out[(how, name)] = (train(model, r, d), full_state(model))
            except Exception as e:                          # noqa: BLE001 (the old code's crash)
                out[(how, name)] = f"{type(e).__name__}: {e}".splitlines()[0]
    return out


def serial(how=None):
    model = make(how, SEED)
    steps = train(model)
    return steps, {n: p.detach() for n, p in model.named_parameters()}


def assert_state(got, ref, tol):
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=tol, rtol=tol, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("how", CKPT)
def test_activation_checkpointing_in_sharded_modules_equals_fsdp2(how):
    ref_steps, ref_state = serial()
    for out in launched("ckpt", _checkpoint_runs):
        got, twin = out[(how, "minipar")], out[(how, "fsdp2")]
        assert not isinstance(twin, str), twin
        assert not isinstance(got, str), got
        (steps, state), (twin_steps, twin_state) = got, twin
        for (loss, norm, live), (t_loss, t_norm, _), (_, s_norm, _) in zip(steps, twin_steps, ref_steps):
            assert live                                     # no reachable freed storage
            assert loss == pytest.approx(t_loss, abs=1e-6)
            assert norm == pytest.approx(t_norm, abs=1e-6)  # every shard counted
            assert norm == pytest.approx(s_norm, abs=1e-5)  # = the one-process norm
        assert_state(state, twin_state, 1e-6)
        assert_state(state, ref_state, 1e-5)


# --------------------------------------------------------------------------------------
# minipar's GPT with every recompute mode under fully_shard
# --------------------------------------------------------------------------------------
RECOMPUTE = ("none", "selective", "full")


def gpt(recompute):
    from minipar import model as gpt_model
    return gpt_model.build(gpt_model.config("nano", n_layer=2, recompute=recompute), seed=SEED)


def gpt_batch(step, cfg):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
    return idx, idx.roll(-1, dims=1)


def train_gpt(model, rank=0, d=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    out = []
    for step in range(2):
        idx, tgt = gpt_batch(step, model.cfg)
        opt.zero_grad()
        loss = model(idx.chunk(d)[rank], tgt.chunk(d)[rank])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        out.append((float(loss.detach()), float(norm.detach()), d == 1 or live_shards(model)))
        opt.step()
    return out


def _gpt_runs():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from minipar import fsdp
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for recompute in RECOMPUTE:
        for name, fully_shard in (("minipar", fsdp.fully_shard), ("fsdp2", torch_fully_shard)):
            model = gpt(recompute)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            try:
                out[(recompute, name)] = (train_gpt(model, r, d), full_state(model))
            except Exception as e:                          # noqa: BLE001 (the old code's crash)
                out[(recompute, name)] = f"{type(e).__name__}: {e}".splitlines()[0]
    return out


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_gpt_every_recompute_mode_under_fully_shard_equals_fsdp2(recompute):
    model = gpt(recompute)
    ref_steps = train_gpt(model)
    ref_state = {n: p.detach() for n, p in model.named_parameters()}
    for out in launched("gpt", _gpt_runs):
        got, twin = out[(recompute, "minipar")], out[(recompute, "fsdp2")]
        assert not isinstance(twin, str), twin
        assert not isinstance(got, str), got
        (steps, state), (twin_steps, twin_state) = got, twin
        for (loss, norm, live), (t_loss, t_norm, _), (_, s_norm, _) in zip(steps, twin_steps, ref_steps):
            assert live
            assert loss == pytest.approx(t_loss, abs=1e-6)
            assert norm == pytest.approx(t_norm, abs=1e-6)
            assert norm == pytest.approx(s_norm, abs=1e-5)
        assert_state(state, twin_state, 1e-6)
        assert_state({n: state[n] for n in ref_state}, ref_state, 1e-5)


# --------------------------------------------------------------------------------------
# A parameter only some ranks use: the same collectives, in the same order, on every rank
# --------------------------------------------------------------------------------------
class Skippable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.use_b = nn.Linear(8, 8), nn.Linear(8, 8), True

    def forward(self, x):
        x = x + torch.tanh(self.a(x))
        return x + self.b(x) if self.use_b else x


class Branchy(nn.Module):
    """Two blocks of equal size; rank r's block r leaves out its second layer (a
    data-dependent branch, LayerDrop): equal units, each missing a gradient on one rank."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 4)
        self.blocks = nn.ModuleList(Skippable() for _ in range(2))

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.out(x)

    def branch_of(self, rank):
        for i, blk in enumerate(self.blocks):
            blk.use_b = i != rank


def serial_branchy():
    """One process: the average of the ranks' losses, each rank's half with its own branch."""
    torch.manual_seed(SEED)
    net = Branchy()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        for r, (xr, yr) in enumerate(zip(x.chunk(D), y.chunk(D))):
            net.branch_of(r)
            (F.mse_loss(net(xr), yr) / D).backward()
        opt.step()
    return {n: p.detach() for n, p in net.named_parameters()}


def _branch_runs():
    from minipar import fsdp
    r, d = tdist.get_rank(), tdist.get_world_size()
    torch.manual_seed(SEED)
    net = Branchy()
    net.branch_of(r)
    for blk in net.blocks:
        fsdp.fully_shard(blk)
    fsdp.fully_shard(net)
    out = {"fully_shard": branch_train(net, torch.optim.SGD(net.parameters(), lr=0.1), r, d)
           and full_state(net)}
    # the trainer's engine at ZeRO-3 and ZeRO-2, and ShardedOptimizer at stage 2
    from minipar import zero
    from minipar.wrappers.zero_optimizer import full_parameters
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)           # noqa: E731
    for stage in (2, 3):
        torch.manual_seed(SEED + r)
        net = Branchy()
        net.branch_of(r)
        engine = zero.ShardedEngine(net, None, zero.zero_spec(stage, d), sgd)
        branch_train(net, engine, r, d)
        out[f"engine zero{stage}"] = full_parameters(engine)
    torch.manual_seed(SEED + r)
    net = Branchy()
    net.branch_of(r)
    try:            # torch's optimizer skips a parameter without .grad; a flat slice cannot
        branch_train(net, zero.ShardedOptimizer(net.parameters(), torch.optim.SGD, stage=2,
                                                lr=0.1), r, d)
        out["ShardedOptimizer stage 2"] = {n: p.detach() for n, p in net.named_parameters()}
    except RuntimeError as e:
        out["ShardedOptimizer stage 2"] = str(e)
    return out


def branch_train(net, opt, r, d):
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(net(x.chunk(d)[r]), y.chunk(d)[r]).backward()
        opt.step()
    return True


BRANCH = ("fully_shard", "engine zero2", "engine zero3", "ShardedOptimizer stage 2")


@pytest.mark.parametrize("how", BRANCH)
def test_a_parameter_some_ranks_skip_is_reduced_in_order_as_zeros(how):
    ref = serial_branchy()
    for out in launched("branch", _branch_runs):
        if how == "ShardedOptimizer stage 2":               # refused, in one line, before a step
            assert "got no gradient since the last step" in out[how] and "\n" not in out[how]
            continue
        assert_state(out[how], ref, 1e-6)


# --------------------------------------------------------------------------------------
# ShardedOptimizer where ZeroRedundancyOptimizer stands: beside torch's DDP or minipar's
# DataParallel, built before or after it (nanoGPT's order), or alone
# --------------------------------------------------------------------------------------
ZERO_HABITS = ("torch-ddp-first", "torch-ddp-after", "dp-first", "dp-after", "alone")


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def train_zero(model, opt, clip, rank, d):
    """AdamW steps on this rank's half; ``clip``: None, or how to clip; [norm per step]."""
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x.chunk(d)[rank]), y.chunk(d)[rank]).backward()
        if clip == "method":                                # ZeRO alone: the average is in step
            opt.clip_grad_norm_(0.05)
        norms.append(None if clip in (None, "method") else float(clip()))
        opt.step()
        if clip == "method":
            norms[-1] = opt.grad_norm
    return norms


def _zero_habit_runs():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from minipar import dp, zero
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for clip in (False, True):
        for how in ZERO_HABITS + ("zro",):
            bare = mlp(SEED)
            wrap = {"torch": DDP, "dp": dp.DataParallel}.get(how.split("-ddp")[0].split("-")[0])
            optimizer = ZeroRedundancyOptimizer if how == "zro" else zero.ShardedOptimizer
            make_opt = lambda ps: optimizer(ps, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)  # noqa: E731
            if how == "zro":
                model = DDP(bare)
                opt = make_opt(model.parameters())
            elif how.endswith("first"):
                model = wrap(bare)
                opt = make_opt(model.parameters())
            elif how.endswith("after"):                     # nanoGPT: optimizer, then DDP
                opt = make_opt(bare.parameters())
                model = wrap(bare)
            else:
                model, opt = bare, make_opt(bare.parameters())
            torch_clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # noqa: E731
            use = None if not clip else "method" if how == "alone" else torch_clip
            try:
                norms = train_zero(model, opt, use, r, d)
                opt.consolidate_state_dict(0)
                state = opt.state_dict() if r == 0 else None
                out[(how, clip)] = (norms, {n: p.detach().clone() for n, p in bare.named_parameters()},
                                    state)
            except Exception as e:                          # noqa: BLE001 (the old code's refusal)
                out[(how, clip)] = f"{type(e).__name__}: {e}".splitlines()[0]
    return out


@pytest.mark.parametrize("clip", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", ZERO_HABITS)
def test_sharded_optimizer_equals_zero_redundancy_optimizer_beside_either_ddp_in_either_order(how, clip):
    for out in launched("zero-habits", _zero_habit_runs):
        got, twin = out[(how, clip)], out[("zro", clip)]
        assert not isinstance(got, str), got
        (norms, params, state), (t_norms, t_params, t_state) = got, twin
        if clip:
            assert norms == pytest.approx(t_norms, abs=1e-6)
            assert min(t_norms) > 0.05                      # the clip bites
        assert_state(params, t_params, 1e-6)
        if state is not None:
            assert state["param_groups"][0]["params"] == t_state["param_groups"][0]["params"]
            for i, s in t_state["state"].items():
                assert_state(state["state"][i], s, 1e-6)


# --------------------------------------------------------------------------------------
# DataParallel and a parameter no forward reached: DDP's find_unused_parameters
# --------------------------------------------------------------------------------------
class Unused(nn.Module):
    """``dead`` no rank uses; block r's ``b`` rank r skips (used by the other rank)."""

    def __init__(self):
        super().__init__()
        self.net, self.dead = Branchy(), nn.Linear(8, 8)

    def forward(self, x):
        return self.net(x)


def adamw_steps(model, rank, d):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x.chunk(d)[rank]), y.chunk(d)[rank]).backward()
        opt.step()


def _unused_runs():
    from torch.nn.parallel import DistributedDataParallel as DDP
    from minipar import dp
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for name, wrap in (("minipar", dp.DataParallel), ("ddp", DDP)):
        torch.manual_seed(SEED)
        model = Unused()
        model.net.branch_of(r)
        adamw_steps(wrap(model, find_unused_parameters=True), r, d)
        out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # a checkpoint of one loads into the other, both ways (DDP's names: module.<name>)
    mine, twin = dp.DataParallel(make(None, 1)), DDP(make(None, 2))
    saved = {k: v.clone() for k, v in mine.state_dict().items()}
    twin.load_state_dict(saved)
    mine.load_state_dict(DDP(make(None, 3)).state_dict())
    out["state dicts"] = (list(saved) == list(twin.state_dict()),
                          [torch.equal(a, b) for a, b in zip(saved.values(), twin.state_dict().values())],
                          [torch.equal(a, b) for a, b in zip(mine.state_dict().values(),
                                                            make(None, 3).state_dict().values())])
    torch.manual_seed(SEED)
    model = Unused()
    model.net.branch_of(r)
    try:                                    # DDP's default: a parameter without gradient is an error
        adamw_steps(dp.DataParallel(model), r, d)
    except RuntimeError as e:
        out["default"] = str(e)
    return out


def serial_unused():
    torch.manual_seed(SEED)
    model = Unused()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        for r, (xr, yr) in enumerate(zip(x.chunk(D), y.chunk(D))):
            model.net.branch_of(r)
            (F.mse_loss(model(xr), yr) / D).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_data_parallel_leaves_a_parameter_no_rank_used_without_gradient_as_ddp():
    ref = serial_unused()
    for out in launched("unused", _unused_runs):
        assert_state(out["minipar"], out["ddp"], 1e-6)
        assert_state(out["minipar"], ref, 1e-6)
        assert "find_unused_parameters=True" in out["default"] and "\n" not in out["default"]
        same_names, into_ddp, from_ddp = out["state dicts"]
        assert same_names and all(into_ddp) and all(from_ddp)


# --------------------------------------------------------------------------------------
# FSDP2's smaller habits: accumulation without sync in reduce_dtype, unshard/reshard, setters
# --------------------------------------------------------------------------------------
def accumulate_bf16(model, rank, d, micro=8):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.repeat(2, 1).chunk(d)[rank], y.repeat(2, 1).chunk(d)[rank]
        opt.zero_grad()
        for k, (xb, yb) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            model.set_requires_gradient_sync(k == micro - 1)
            (F.mse_loss(model(xb).float(), yb) / micro).backward()
        opt.step()


def _habit_runs():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from minipar import fsdp
    from minipar.runtime.errors import UsageError
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name, fully_shard in (("minipar", fsdp.fully_shard), ("fsdp2", torch_fully_shard)):
        model = make(None, SEED)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        accumulate_bf16(model, r, d)
        out[("bf16 accumulation", name)] = full_state(model)
        # unshard() before a forward (FSDP2's explicit prefetch), reshard() after
        x, _ = batch(0)
        with torch.no_grad():
            plain = model(x)
            model.unshard()
            out[("unshard", name)] = (torch.equal(model(x), plain), live_shards(model))
            model.unshard()
            model.reshard()
            out[("reshard", name)] = live_shards(model)
        model.set_reshard_after_backward(True)
    refusals = []
    for call in (lambda: model.set_reshard_after_backward(False),
                 lambda: model.set_modules_to_forward_prefetch([model.blocks[1]]),
                 lambda: model.set_modules_to_backward_prefetch([model.blocks[0]]),
                 lambda: model.unshard(async_op=True)):
        try:
            model = make(None, SEED)
            fsdp.fully_shard(model)
            call()
        except UsageError as e:
            refusals.append(str(e))
    out["refusals"] = refusals
    return out


def test_fully_shard_accumulates_without_sync_in_reduce_dtype_unshards_and_refuses_the_rest():
    for out in launched("fsdp habits", _habit_runs):
        assert_state(out[("bf16 accumulation", "minipar")], out[("bf16 accumulation", "fsdp2")], 1e-6)
        assert out[("unshard", "minipar")] == (True, True)    # FSDP2's root keeps full ones
        assert out[("unshard", "fsdp2")][0]
        assert out[("reshard", "minipar")] and out[("reshard", "fsdp2")]
        assert len(out["refusals"]) == 4 and all("\n" not in e for e in out["refusals"])
