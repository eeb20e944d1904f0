"""minipar's DP and ZeRO as wrappers outside code can use: toy models in a plain loop.

Each rank builds its model from its own seed (the wrappers broadcast rank 0's), trains on
its half of every global batch with an ordinary ``loss.backward(); opt.step()`` loop, with
and without accumulation, and must end where the single-process run on whole batches ends
(from rank 0's seed) and where torch's twin ends: DistributedDataParallel for every DP mode,
DDP + ZeroRedundancyOptimizer for ZeRO-1/2 (``ShardedOptimizer``). ZeRO-3 runs through
``ShardedEngine`` on the same non-GPT models. Two gloo ranks, one launch per family.
"""
import math

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F

from minipar import comm, dp, zero
from minipar.wrappers.zero_optimizer import full_parameters
from minipar.runtime import dist
from minipar.runtime.errors import UsageError

D, STEPS, BATCH, SEED = 2, 3, 8, 100
MODELS = ("mlp", "tied")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


class Tied(nn.Module):
    """A language-model shape: the output layer shares the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.emb, self.body = nn.Embedding(10, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.emb(x))))


def make(kind, seed):
    torch.manual_seed(seed)
    return MLP() if kind == "mlp" else Tied()


def batch(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "mlp":
        return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    x = torch.randint(0, 10, (BATCH,), generator=g)
    return x, (x * 3 + 1) % 10


def loss_fn(kind, out, y):
    return F.mse_loss(out, y) if kind == "mlp" else F.cross_entropy(out, y)


def train(kind, model, opt, micro, rank=0, d=1, no_sync=None, before=None, after=None):
    """The plain loop: ``micro`` backward passes per step (all but the last in no_sync)."""
    for step in range(STEPS):
        x, y = batch(kind, step)
        x, y = x.chunk(d)[rank], y.chunk(d)[rank]
        (before or opt.zero_grad)()
        for k, (xb, yb) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = k == micro - 1
            with (no_sync() if (no_sync and not last) else _nothing()):
                (loss_fn(kind, model(xb), yb) / micro).backward()
        (after or opt.step)()
    return model


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def consolidated(opt):
    """ZeroRedundancyOptimizer's way to a whole state dict, onto each rank in turn."""
    mine = None
    for to in range(tdist.get_world_size()):
        opt.consolidate_state_dict(to)          # a collective: every rank
        if tdist.get_rank() == to:
            mine = opt.state_dict()             # no communication
    return mine


def params_of(module):
    """{name: parameter} in the plain model's names (DDP and DataParallel: their .module's)."""
    module = module.module if isinstance(module, (dp.DataParallel, nn.parallel.DistributedDataParallel)) else module
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def serial(kind, micro=1, optimizer=adamw):
    """The single-process reference: rank 0's seed, whole batches."""
    model = make(kind, SEED)
    opt = optimizer(model.parameters())
    train(kind, model, opt, micro)
    return params_of(model), opt.state_dict()


def assert_close(got: dict, ref: dict, tol=1e-5):
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------------------
# DataParallel against serial and DDP
# --------------------------------------------------------------------------------------
def _dp_runs():
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for kind in MODELS:
        for micro in (1, 2):
            for mode in dp.MODES:
                model = dp.DataParallel(make(kind, SEED + r), mode=mode, bucket_mb=0.0005)
                assert model.d == d                     # group=None: the whole world
                train(kind, model, adamw(model.parameters()), micro, r, d, model.no_sync)
                out[(kind, micro, mode)] = params_of(model)
                if r == 0:                              # DDP's names: module.<name>
                    assert list(model.state_dict()) == \
                        [f"module.{k}" for k in model.module.state_dict()]
            ddp = nn.parallel.DistributedDataParallel(make(kind, SEED + r), bucket_cap_mb=0.0005)
            train(kind, ddp, adamw(ddp.parameters()), micro, r, d, ddp.no_sync)
            out[(kind, micro, "ddp")] = params_of(ddp.module)
    return out


_CACHE = {}


def launched(name, fn):
    if name not in _CACHE:
        _CACHE[name] = dist.launch(fn, D, timeout=240)
    return _CACHE[name]


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("mode", dp.MODES)
@pytest.mark.parametrize("kind", MODELS)
def test_data_parallel_equals_serial_and_ddp(kind, mode, micro):
    ref, _ = serial(kind, micro)
    for rank_out in launched("dp", _dp_runs):
        assert_close(rank_out[(kind, micro, mode)], ref)
        assert_close(rank_out[(kind, micro, mode)], rank_out[(kind, micro, "ddp")], tol=1e-6)


# --------------------------------------------------------------------------------------
# ShardedOptimizer (ZeRO-1/2) and ShardedEngine (ZeRO-3) against serial and torch's ZeRO
# --------------------------------------------------------------------------------------
def _zero_runs():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for kind in MODELS:
        for micro in (1, 2):
            for stage in (1, 2):
                model = make(kind, SEED + r)
                opt = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                            lr=1e-2, weight_decay=0.1)
                train(kind, model, opt, micro, r, d)
                out[(kind, micro, f"zero{stage}")] = (params_of(model), consolidated(opt))
            model = make(kind, SEED + r)
            engine = zero.ShardedEngine(model, None, zero.zero_spec(3, d), adamw)
            train(kind, model, engine, micro, r, d, before=engine.zero_grad, after=engine.step)
            out[(kind, micro, "zero3")] = (full_parameters(engine), None)
            ddp = nn.parallel.DistributedDataParallel(make(kind, SEED + r))
            zro = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
            train(kind, ddp, zro, micro, r, d, ddp.no_sync)
            out[(kind, micro, "zro")] = (params_of(ddp.module), None)
    # a checkpoint in torch's layout: saved at stage 1, loaded at stage 2, one more step on both
    a = make("mlp", SEED + r)
    opt_a = zero.ShardedOptimizer(a.parameters(), torch.optim.AdamW, stage=1, lr=1e-2)
    train("mlp", a, opt_a, 1, r, d)
    saved = consolidated(opt_a)
    b = make("mlp", 0)
    b.load_state_dict(a.state_dict())
    opt_b = zero.ShardedOptimizer(b.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    opt_b.load_state_dict(saved)
    reloaded = consolidated(opt_b)
    for model, opt in ((a, opt_a), (b, opt_b)):
        x, y = batch("mlp", 7)
        opt.zero_grad()
        loss_fn("mlp", model(x.chunk(d)[r]), y.chunk(d)[r]).backward()
        opt.step()
    out["resume"] = (saved, reloaded, params_of(a), params_of(b))
    # SGD with momentum and two parameter groups, stage 2
    model = make("mlp", SEED + r)
    groups = [{"params": model.fc1.parameters(), "lr": 0.05},
              {"params": list(model.fc2.parameters()) + list(model.fc3.parameters())}]
    opt = zero.ShardedOptimizer(groups, torch.optim.SGD, stage=2, lr=0.1, momentum=0.9)
    train("mlp", model, opt, 1, r, d)
    out[("mlp", 1, "sgd-groups")] = (params_of(model), consolidated(opt))
    return out


def sgd_groups(params):
    params = list(params)
    return torch.optim.SGD([{"params": params[:2], "lr": 0.05}, {"params": params[2:]}],
                           lr=0.1, momentum=0.9)


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", MODELS)
def test_zero_equals_serial_and_torch(kind, stage, micro):
    ref, ref_state = serial(kind, micro)
    for rank_out in launched("zero", _zero_runs):
        got, state = rank_out[(kind, micro, f"zero{stage}")]
        assert_close(got, ref)
        if stage < 3:   # torch's own state_dict, gathered from the slices
            assert state["param_groups"] == ref_state["param_groups"]
            assert set(state["state"]) == set(ref_state["state"])
            for i, s in ref_state["state"].items():
                assert_close(state["state"][i], s)
            assert_close(got, rank_out[(kind, micro, "zro")][0], tol=1e-6)


def serial_resumed():
    """The resume's single-process twin: AdamW(lr=1e-2) on rank 0's MLP for STEPS whole
    batches, its state dict then (a copy: the step updates the tensors in place), and the
    parameters after one more step on batch 7."""
    import copy
    model = make("mlp", SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train("mlp", model, opt, 1)
    state = copy.deepcopy(opt.state_dict())
    x, y = batch("mlp", 7)
    opt.zero_grad()
    loss_fn("mlp", model(x), y).backward()
    opt.step()
    return state, params_of(model)


def test_sharded_optimizer_resumes_from_its_state_dict_across_stages():
    ref_state, ref = serial_resumed()
    every = set(range(len(list(make("mlp", 0).parameters()))))    # the MLP's 6 parameters
    assert len(every) == 6 and set(ref_state["state"]) == every
    for rank_out in launched("zero", _zero_runs):
        saved, reloaded, a, b = rank_out["resume"]
        assert saved["param_groups"] == reloaded["param_groups"] == ref_state["param_groups"]
        assert set(saved["state"]) == set(reloaded["state"]) == every
        for i, s in ref_state["state"].items():            # step, exp_avg, exp_avg_sq each
            assert_close(saved["state"][i], s)
            assert_close(reloaded["state"][i], saved["state"][i], tol=0)
        assert_close(a, ref)                                # stage 1 went on as one process
        assert_close(b, ref)                                # and so did stage 2 after loading
        assert_close(a, b, tol=1e-6)


def test_sharded_optimizer_param_groups_and_sgd():
    ref, ref_state = serial("mlp", 1, sgd_groups)
    for rank_out in launched("zero", _zero_runs):
        got, state = rank_out[("mlp", 1, "sgd-groups")]
        assert_close(got, ref)
        assert state["param_groups"] == ref_state["param_groups"]
        assert set(state["state"]) == set(ref_state["state"]) == set(range(6))   # momentum each
        for i, s in ref_state["state"].items():
            assert_close(state["state"][i], s)


# --------------------------------------------------------------------------------------
# Never a silent wrong number
# --------------------------------------------------------------------------------------
def _raises(fn, *errors):
    try:
        fn()
    except errors as e:
        return str(e)
    return None


def _misuse():
    r, d = tdist.get_rank(), tdist.get_world_size()
    x, y = batch("mlp", 0)
    out = {}

    # 2. the engine's way, one more backward than begin_step announced, into a bucket in flight
    model = make("mlp", SEED + r)
    engine = dp.DataParallel(model, mode="overlapped", bucket_mb=0.0005)
    engine.zero_grad(); engine.begin_step(1)
    loss_fn("mlp", model(x), y).backward()
    out["extra micro-batch"] = _raises(lambda: loss_fn("mlp", model(x), y).backward(), RuntimeError)
    engine.finish_grad_sync()

    # 3. ZeRO: a parameter without a gradient, a non-element-wise optimizer, DP + ZeRO
    model = make("mlp", SEED + r)
    opt = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    loss_fn("mlp", model.fc1(x).sum(-1, keepdim=True), y[:, :1]).backward()
    out["unused parameter"] = _raises(opt.step, RuntimeError)
    if hasattr(torch.optim, "Adafactor"):
        out["adafactor"] = _raises(lambda: zero.ShardedOptimizer(
            make("mlp", 0).parameters(), torch.optim.Adafactor), UsageError)
    out["solo"] = dp.DataParallel(make("mlp", 0), group=comm.SOLO).d

    # 4. torch's clip where .grad is not the average: stage 1 stops at step, stage 2 at once
    for stage in (1, 2):
        model = make("mlp", SEED + r)
        opt = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
        loss_fn("mlp", model(x), y).backward()
        clip = _raises(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3), RuntimeError)
        out[f"torch clip, stage {stage}"] = clip or _raises(opt.step, RuntimeError)
    # 5. beside DataParallel: stage 2 refused, also when the DataParallel is built afterwards
    model = dp.DataParallel(make("mlp", SEED + r))
    out["stage 2 beside dp"] = _raises(lambda: zero.ShardedOptimizer(
        model.parameters(), torch.optim.AdamW, stage=2), UsageError)
    bare = make("mlp", SEED + r)
    opt = zero.ShardedOptimizer(bare.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    late = dp.DataParallel(bare)
    loss_fn("mlp", late(x), y).backward()
    out["dp built after"] = _raises(opt.step, UsageError)
    # 6. state_dict on one rank: never a wait for the others, one line until consolidated
    model = make("mlp", SEED + r)
    opt = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train("mlp", model, opt, 1, r, d)
    if r == 0:
        out["not consolidated"] = _raises(opt.state_dict, RuntimeError)
    opt.consolidate_state_dict(to=0)
    if r == 0:
        out["consolidated"] = sorted(opt.state_dict()["state"])
    else:
        out["other rank"] = _raises(opt.state_dict, RuntimeError)
    train("mlp", model, opt, 1, r, d)
    out["stale"] = _raises(opt.state_dict, RuntimeError)
    return out


def test_a_missing_average_is_an_error_never_a_silent_gradient():
    for out in launched("misuse", _misuse):
        assert "already being averaged" in out["extra micro-batch"]
        assert "no gradient" in out["unused parameter"]
        if "adafactor" in out:
            assert "element-wise" in out["adafactor"]
        assert out["solo"] == 1
        for stage in (1, 2):
            assert "opt.clip_grad_norm_" in out[f"torch clip, stage {stage}"]
            assert "\n" not in out[f"torch clip, stage {stage}"]
        assert "stage=1" in out["stage 2 beside dp"]
        assert "stage 2 has nothing to shard" in out["dp built after"]
        assert "consolidate_state_dict(to=" in out.get("not consolidated", out.get("other rank"))
        assert out.get("consolidated", [0, 1, 2, 3, 4, 5]) == [0, 1, 2, 3, 4, 5]
        assert "before the last step" in out["stale"] or "not consolidated" in out["stale"]


def test_units_of_any_module():
    mlp, tied = MLP(), Tied()
    assert [m for m, _ in zero.units_of(mlp)] == [mlp.fc1, mlp.fc2, mlp.fc3]
    # the tied weight belongs to both the embedding and the head: one unit on the root
    units = zero.units_of(tied)
    assert [m for m, _ in units] == [tied, tied.body]
    assert units[0][1] == [tied.emb.weight]
    assert [m for m, _ in zero.units_of(mlp, [mlp.fc3])] == [mlp, mlp.fc3]
    assert [m for m, _ in zero.units_of(mlp, lambda m: isinstance(m, nn.Linear))] == \
        [mlp.fc1, mlp.fc2, mlp.fc3]
    from minipar.model import build
    gpt = build("nano")
    assert [m for m, _ in zero.units_of(gpt)] == gpt.parts()


# --------------------------------------------------------------------------------------
# fsdp.fully_shard (ZeRO-3 as an nn.Module) against serial and torch's FSDP2
# --------------------------------------------------------------------------------------
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def policy(dtype):
    from minipar.precision import PrecisionPolicy
    return PrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)


def train_mixed(kind, model, opt, micro, rank=0, d=1, dtype="fp32"):
    """The plain loop with the loss in fp32 (the outputs come in the compute dtype)."""
    for step in range(STEPS):
        x, y = batch(kind, step)
        x, y = x.chunk(d)[rank], y.chunk(d)[rank]
        opt.zero_grad()
        for xb, yb in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(kind, model(xb).float(), yb) / micro).backward()
        opt.step()


def serial_mixed(kind, micro, dtype):
    """One process with the textbook recipe: the model in the compute dtype, fp32 masters
    that AdamW updates and that are cast into the model before every step."""
    model = make(kind, SEED)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(DTYPES[dtype])
    opt = adamw(masters.values())
    params = dict(model.named_parameters())
    for step in range(STEPS):
        with torch.no_grad():
            for n, m in masters.items():
                params[n].copy_(m)
        x, y = batch(kind, step)
        model.zero_grad()
        for xb, yb in zip(x.chunk(micro), y.chunk(micro)):
            xb = xb.to(DTYPES[dtype]) if xb.is_floating_point() else xb
            (loss_fn(kind, model(xb).float(), yb) / micro).backward()
        for n, m in masters.items():
            m.grad = params[n].grad.float()
        opt.step()
    return {n: m.detach().clone() for n, m in masters.items()}


def full_state(model):
    """FSDP2's way to the whole model: torch.distributed.checkpoint's function (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def shard_like_fsdp2(fully_shard, model, **kw):
    """FSDP2's habit: each unit (as ``zero.units_of`` finds them) first, then the root; the
    return value unused."""
    for unit, _ in zero.units_of(model):
        if unit is not model:
            fully_shard(unit, **kw)
    fully_shard(model, **kw)


def _fsdp_runs():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from minipar import fsdp
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for kind in MODELS:
        for micro in (1, 2):
            for dtype in DTYPES:
                model = make(kind, SEED + r)             # rank 0's weights are broadcast
                shard_like_fsdp2(fsdp.fully_shard, model, mp_policy=policy(dtype))
                out[(kind, micro, dtype, "shards")] = {n: tuple(p.to_local().shape)
                                                       for n, p in model.named_parameters()}
                comm.reset()                             # the step's traffic, not the broadcast
                train_mixed(kind, model, adamw(model.parameters()), micro, r, d, dtype)
                out[(kind, micro, dtype, "bytes")] = comm.stats.bytes_by_op()
                out[(kind, micro, dtype, "minipar")] = full_state(model)
                twin = make(kind, SEED)         # FSDP2 shards what each rank holds: one seed
                mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
                shard_like_fsdp2(torch_fully_shard, twin, mp_policy=mp)
                train_mixed(kind, twin, adamw(twin.parameters()), micro, r, d, dtype)
                out[(kind, micro, dtype, "fsdp2")] = full_state(twin)
    return out


def padded_unit_sizes(kind):
    """Each unit's elements as FSDP2 lays them out: every parameter's rows padded to a
    multiple of d; the root's unit first (None when the root owns no parameter)."""
    model = make(kind, 0)
    units = zero.units_of(model)
    sizes = [sum(math.ceil(p.shape[0] / D) * D * math.prod(p.shape[1:]) for p in ps)
             for _, ps in units]
    return (sizes[0] if units[0][0] is model else None), sizes[1:] if units[0][0] is model else sizes


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("kind", MODELS)
def test_fully_shard_equals_serial_and_torch_fsdp2(kind, micro, dtype):
    """fp32: equal to the serial run (1e-5) and to FSDP2 (1e-6). bf16/fp16: within the
    tolerance tests/test_precision.py justifies against the serial mixed-precision recipe (5%
    of the distance training moved the parameters), and equal to FSDP2, which rounds in the
    same places (the same casts and fp32 reduce-scatters: 1e-6)."""
    if dtype == "fp32":
        ref, _ = serial(kind, micro)
    else:
        ref = serial_mixed(kind, micro, dtype)
    theta0 = params_of(make(kind, SEED))
    for rank_out in launched("fsdp", _fsdp_runs):
        got = rank_out[(kind, micro, dtype, "minipar")]
        twin = rank_out[(kind, micro, dtype, "fsdp2")]
        assert all(v.dtype == torch.float32 for v in got.values())   # the fp32 masters
        got = {n: got[n] for n in ref}
        if dtype == "fp32":
            assert_close(got, ref)
        else:
            moved = _distance(ref, theta0)
            assert _distance(got, ref) <= 0.05 * moved, (_distance(got, ref), moved)
        assert_close(got, {n: twin[n] for n in ref}, tol=1e-6)
        if dtype == "fp32":     # bytes sent = the planner's ZeRO-3 closed form, per unit
            from minipar import plan
            root, blocks = padded_unit_sizes(kind)
            want = plan.zero_comm_bytes(blocks + ([root] if root else []), D, zero=3,
                                        dtype="fp32", microbatches=micro)
            if root:            # FSDP2's root keeps its parameters from forward to backward
                want["all_gather"] -= plan.zero_comm_bytes([root], D, zero=3, dtype="fp32",
                                                           microbatches=micro)["all_gather"] // 2
            sent = rank_out[(kind, micro, dtype, "bytes")]
            assert {op: sent.get(op, 0) for op in ("all_gather", "reduce_scatter")} == \
                {op: STEPS * want[op] for op in ("all_gather", "reduce_scatter")}
            assert sent.get("all_reduce", 0) == want["all_reduce"] == 0
        # the shards: this rank's rows of every parameter, ceil(n/d) (or fewer) of n
        for name, p in make(kind, 0).named_parameters():
            rows = rank_out[(kind, micro, dtype, "shards")][name]
            assert rows[1:] == tuple(p.shape[1:]) and rows[0] <= math.ceil(p.shape[0] / D)


def _distance(a, b):
    return math.sqrt(sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in a))


# --------------------------------------------------------------------------------------
# FSDP2's habits, one by one
# --------------------------------------------------------------------------------------
class Normed(nn.Module):
    """Linear layers around an RMSNorm whose weight a course's FSDP keeps replicated."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.RMSNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))

    def decay_groups(self):
        """A method a script calls after sharding, with nanoGPT's rule on shapes."""
        ps = list(self.parameters())
        return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def grads_of(module):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in module.named_parameters()}


def _habit_runs():
    from torch.distributed.tensor import DTensor
    from minipar import fsdp
    r, d = tdist.get_rank(), tdist.get_world_size()
    x, y = batch("mlp", 0)
    x, y = x.chunk(d)[r], y.chunk(d)[r]
    out = {}
    # in place, the return value unused: the module itself trains, its parameters the shards
    model = make("mlp", SEED + r)
    returned = fsdp.fully_shard(model)
    out["in place"] = (returned is model, isinstance(model, MLP), isinstance(model, fsdp.FSDPModule),
                       all(isinstance(p, DTensor) for p in model.parameters()))
    out["read after sharding"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    train("mlp", model, adamw(model.parameters()), 1, r, d)
    out["trained in place"] = full_state(model)
    # touching a parameter outside its module's forward: a clear error, never a crash
    out["direct forward"] = _raises(lambda: model.forward(x), RuntimeError)
    out["shard arithmetic"] = float(model.fc1.weight.detach().sum().full_tensor())
    # methods and shapes: a rule on p.dim() after sharding, the norm weight left replicated
    model = Normed()
    torch.manual_seed(SEED + r)
    model = Normed()
    for m in (model.fc1, model.fc2):
        fsdp.fully_shard(m)
    fsdp.fully_shard(model, ignored_params=set(model.norm.parameters()))
    opt = torch.optim.AdamW(model.decay_groups(), lr=1e-2)
    out["groups"] = [len(g["params"]) for g in opt.param_groups]
    out["norm is plain"] = not isinstance(model.norm.weight, DTensor)
    opt.zero_grad()
    loss_fn("mlp", model(x), y).backward()
    out["normed grads"] = grads_of(model)
    out["mixed clip"] = _raises(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
                                RuntimeError)
    opt.step()
    out["normed trained"] = full_state(model)
    # accumulation without the reduce-scatter until the last backward
    for sync_each in (True, False):
        model = make("mlp", SEED + r)
        fsdp.fully_shard(model, units=[model.fc1, model.fc2, model.fc3])
        comm.reset()
        xs, ys = x.chunk(2), y.chunk(2)
        for k in range(2):
            model.set_requires_gradient_sync(sync_each or k == 1)
            (loss_fn("mlp", model(xs[k]), ys[k]) / 2).backward()
        out[("grads", sync_each)] = grads_of(model)
        out[("reduce_scatters", sync_each)] = comm.stats.calls.get(("reduce_scatter", "world"), 0)
    # a weight tied across two calls would become two weights: refused
    tied = make("tied", SEED + r)
    fsdp.fully_shard(tied.emb)
    out["tied across calls"] = _raises(lambda: fsdp.fully_shard(tied), UsageError)
    # a full checkpoint of the plain model loads into the sharded one (torch's function)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    model = make("mlp", SEED + r)
    fsdp.fully_shard(model, units=[model.fc1])
    set_model_state_dict(model, make("mlp", 7).state_dict(),
                         options=StateDictOptions(full_state_dict=True))
    out["loaded"] = full_state(model)
    # frozen parameters are sharded too and never reduced; a DeviceMesh names the group
    from torch.distributed.device_mesh import init_device_mesh
    model = make("mlp", SEED + r)
    model.fc1.requires_grad_(False)
    fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (d,)), units=[model.fc1, model.fc2])
    out["frozen sharded"] = isinstance(model.fc1.weight, DTensor) and not model.fc1.weight.requires_grad
    train("mlp", model, adamw([p for p in model.parameters() if p.requires_grad]), 2, r, d)
    out["frozen"] = full_state(model)
    return out


def _serial_normed():
    torch.manual_seed(SEED)
    model = Normed()
    opt = torch.optim.AdamW(model.decay_groups(), lr=1e-2)
    x, y = batch("mlp", 0)
    opt.zero_grad()
    loss_fn("mlp", model(x), y).backward()
    grads = grads_of(model)
    opt.step()
    return grads, params_of(model)


def test_fully_shard_in_place_with_its_return_value_unused():
    ref, _ = serial("mlp", 1)
    theta0 = params_of(make("mlp", SEED))
    for out in launched("habits", _habit_runs):
        assert out["in place"] == (True, True, True, True)
        assert_close(out["read after sharding"], theta0, tol=0)   # rank 0's, broadcast
        assert_close(out["trained in place"], ref)
        assert out["shard arithmetic"] == pytest.approx(float(ref["fc1.weight"].sum()), abs=1e-5)
        assert "DTensor" in out["direct forward"]         # the shards, not freed storage


def test_fully_shard_methods_shapes_and_replicated_norms():
    grads, trained = _serial_normed()
    for out in launched("habits", _habit_runs):
        assert out["groups"] == [2, 3]                    # fc weights decay; biases, norm not
        assert out["norm is plain"]
        assert_close(out["normed grads"], grads, tol=1e-6)   # the norm's: averaged, identical
        assert "mixed torch.Tensor and DTensor" in out["mixed clip"]
        assert_close({n: out["normed trained"][n] for n in trained}, trained)


def test_fully_shard_accumulates_without_sync_and_refuses_cross_call_ties():
    # one process, rank 0's seed, the whole batch at once: each rank's two halved micro-batch
    # losses sum to the mean over its half, and the ranks' average is the mean over the batch
    model = make("mlp", SEED)
    x, y = batch("mlp", 0)
    loss_fn("mlp", model(x), y).backward()
    ref = grads_of(model)
    for out in launched("habits", _habit_runs):
        assert_close(out[("grads", False)], ref, tol=1e-6)
        assert_close(out[("grads", False)], out[("grads", True)], tol=1e-6)
        assert (out[("reduce_scatters", True)], out[("reduce_scatters", False)]) == (6, 3)
        assert "tied across two fully_shard calls" in out["tied across calls"]
        assert_close(out["loaded"], params_of(make("mlp", 7)), tol=0)


def test_fully_shard_frozen_parameters_and_a_mesh():
    model = make("mlp", SEED)
    model.fc1.requires_grad_(False)
    train("mlp", model, adamw([p for p in model.parameters() if p.requires_grad]), 2)
    for out in launched("habits", _habit_runs):
        assert out["frozen sharded"]
        assert_close(out["frozen"], params_of(model))


def test_fully_shard_on_one_process_and_ddp_arguments():
    """No process group: one rank, plain tensors, the same training; DDP's arguments."""
    from minipar import fsdp
    ref, _ = serial("mlp", 1)
    model = make("mlp", SEED)
    fsdp.fully_shard(model, units=[model.fc1])
    train("mlp", model, adamw(model.parameters()), 1)
    assert_close(params_of(model), ref)
    net = make("mlp", 0)
    assert dp.DataParallel(net, device_ids=None, output_device=None, find_unused_parameters=True,
                           gradient_as_bucket_view=True, static_graph=False).d == 1
    with pytest.raises(UsageError, match="leave them None on CPU"):
        dp.DataParallel(net, device_ids=[0])
    with pytest.raises(UsageError, match="mixed_precision"):
        dp.DataParallel(net, mixed_precision=object())
    with pytest.raises(TypeError, match="unexpected keyword"):
        dp.DataParallel(net, bucket_size=1)


# --------------------------------------------------------------------------------------
# Clipping: every wrapper equals clip_grad_norm_ on one process, with the norm biting
# --------------------------------------------------------------------------------------
MAX_NORM = 0.05          # well under every step's gradient norm (asserted): the clip bites


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)   # the update is the clipped gradient itself


def train_clipped(kind, model, opt, clip, rank=0, d=1):
    """The plain loop with a clip between backward and step; returns each step's norm."""
    norms = []
    for step in range(STEPS):
        x, y = batch(kind, step)
        opt.zero_grad()
        loss_fn(kind, model(x.chunk(d)[rank]), y.chunk(d)[rank]).backward()
        norm = clip()
        opt.step()
        norms.append(float(opt.grad_norm if norm is None else norm))
    return norms


def serial_clipped(kind):
    model = make(kind, SEED)
    opt = sgd(model.parameters())
    norms = train_clipped(kind, model, opt,
                          lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    return params_of(model), norms


def _clip_runs():
    from minipar import fsdp
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for kind in MODELS:
        for how in ("torch", "method"):
            model = dp.DataParallel(make(kind, SEED + r))
            clip = {"torch": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
                    "method": lambda: model.clip_grad_norm_(MAX_NORM)}[how]
            norms = train_clipped(kind, model, sgd(model.parameters()), clip, r, d)
            out[(kind, f"dp-{how}")] = (params_of(model), norms)
        for stage in (1, 2):
            model = make(kind, SEED + r)
            opt = zero.ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.5)
            norms = train_clipped(kind, model, opt, lambda: opt.clip_grad_norm_(MAX_NORM), r, d)
            out[(kind, f"zero{stage}")] = (params_of(model), norms)
        # ZeroRedundancyOptimizer's habit: beside DataParallel, torch's clip on the averages
        model = dp.DataParallel(make(kind, SEED + r))
        opt = zero.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.5)
        norms = train_clipped(kind, model, opt, lambda: torch.nn.utils.clip_grad_norm_(
            model.parameters(), MAX_NORM), r, d)
        out[(kind, "zero1-beside-dp-torch")] = (params_of(model), norms)
        for how in ("torch", "method", "function"):
            model = make(kind, SEED + r)
            shard_like_fsdp2(fsdp.fully_shard, model)
            clip = {"torch": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
                    "method": lambda: model.clip_grad_norm_(MAX_NORM),
                    "function": lambda: fsdp.clip_grad_norm_(model.parameters(), MAX_NORM)}[how]
            norms = train_clipped(kind, model, sgd(model.parameters()), clip, r, d)
            out[(kind, f"fsdp-{how}")] = (full_state(model), norms)
    return out


CLIPPED = ["dp-torch", "dp-method", "zero1", "zero2", "zero1-beside-dp-torch", "fsdp-torch",
           "fsdp-method", "fsdp-function"]


@pytest.mark.parametrize("how", CLIPPED)
@pytest.mark.parametrize("kind", MODELS)
def test_clipping_equals_clip_grad_norm_on_one_process(kind, how):
    ref, ref_norms = serial_clipped(kind)
    assert min(ref_norms) > 3 * MAX_NORM        # the clip bites at every step
    for rank_out in launched("clip", _clip_runs):
        got, norms = rank_out[(kind, how)]
        assert_close({n: got[n] for n in ref}, ref)
        assert norms == pytest.approx(ref_norms, rel=1e-5)


# --------------------------------------------------------------------------------------
# The trainer's engine under fp16: loss scaling, and a step skipped on every rank
# --------------------------------------------------------------------------------------
def _engine_fp16_runs():
    from minipar.precision import DynamicLossScaler, PrecisionPolicy
    r, d = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for spec in ((1, 1, d), (d, d, d)):
        model = make("mlp", SEED + r).to(torch.float16)
        scaler = DynamicLossScaler(init_scale=1024.0)
        engine = zero.ShardedEngine(model, None, spec, adamw,
                                    policy=PrecisionPolicy(torch.float16, torch.float32,
                                                           torch.float32, scaler))
        for step in range(STEPS + 1):
            x, y = batch("mlp", step)
            engine.zero_grad()
            loss = loss_fn("mlp", model(x.chunk(d)[r].half()).float(), y.chunk(d)[r])
            if step == STEPS and r == 1:
                loss = loss * float("inf")          # this rank alone overflows
            (loss * scaler.scale).backward()
            if step == STEPS:
                out[(spec, "trained")] = full_parameters(engine)
            engine.step()
        out[(spec, "after overflow")] = full_parameters(engine)
        out[(spec, "scaler")] = (scaler.skipped_steps, scaler.scale)
    return out


@pytest.mark.parametrize("spec", ["zero1", "zero3"])
def test_engine_fp16_loss_scaling_trains_like_serial_and_skips_overflow_everywhere(spec):
    ref = serial_mixed("mlp", 1, "fp16")
    theta0 = params_of(make("mlp", SEED))
    key = (1, 1, D) if spec == "zero1" else (D, D, D)
    for rank_out in launched("engine-fp16", _engine_fp16_runs):
        got = {n: v.float() for n, v in rank_out[(key, "trained")].items()}
        assert _distance(got, ref) <= 0.05 * _distance(ref, theta0)
        # rank 1's inf skipped the step on both ranks: nothing moved, the scale backed off
        assert_close(rank_out[(key, "after overflow")], rank_out[(key, "trained")], tol=0)
        assert rank_out[(key, "scaler")] == (1, 512.0)
