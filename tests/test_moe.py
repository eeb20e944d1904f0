"""Mixture of experts and expert parallelism (minipar.moe) against the single-process run.

The serial MoE model is the reference: the same seed on --ep 2 and --ep 4 (alone and with
data parallelism across EP groups, and under ZeRO-1), with tensor parallelism (with and
without SP), pipelines of every schedule and recomputation, must give its losses, gradients,
parameters, routing decisions, aux and z losses and drop rate; the all-to-all bytes each
rank records must equal the formula evaluated on the routing that rank actually made, and
recomputation must not change them.
"""
import math

import pytest
import torch

from conftest import NANO, assert_same_moe_training, assert_same_training, cli, serial_state
from minipar import comm, moe, train
from minipar.runtime import dist
from minipar.model import build, config
from minipar.plan import moe as plan_moe
from minipar.plan.shapes import trainer_presets
from minipar.mesh import Mesh
from minipar.train import run_state
from minipar.train.loop import Hooks, with_state

STATE = Hooks(end=with_state)   # every rank returns its history, parameters and gradients

E, K = 4, 2
MOE = ["--moe-experts", str(E), "--moe-top-k", str(K), "--capacity-factor", "1.0",
       "--steps", "8"]


# --------------------------------------------------------------------------------------
# The layer on its own, one process
# --------------------------------------------------------------------------------------
def test_router_weights_are_the_renormalised_top_k():
    logits = torch.randn(50, E, generator=torch.Generator().manual_seed(0))
    probs, weights, experts = moe.route(logits, K)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    for t in range(50):
        best = sorted(range(E), key=lambda e: -probs[t, e].item())[:K]
        assert experts[t].tolist() == best
        assert torch.allclose(weights[t], probs[t, best] / probs[t, best].sum())
    # k = 1: Switch's raw probability, not p / p = 1
    _, weights, experts = moe.route(logits, 1)
    torch.testing.assert_close(weights, probs.gather(1, experts))
    assert (weights < 1).all()


def test_top1_router_learns_from_the_task_loss():
    """At k = 1, with no aux or z loss, the cross-entropy alone gives the router a gradient
    (renormalising the one weight to p / p = 1 gave it ~1e-10)."""
    model = build(config("nano", moe_experts=E, moe_top_k=1, moe_aux_coef=0.0), seed=0)
    x, y = _batch()
    model(x, y).backward()
    for layer in moe.moe_layers(model):
        assert layer.router.weight.grad.norm() > 1e-4


def _mixtral_aux(logits, k):
    """Hugging Face's Mixtral ``load_balancing_loss_func`` for one layer's gate logits, as
    written there: tokens_per_expert counts each token's k choices over the tokens."""
    probs = torch.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, k, dim=-1)
    mask = torch.nn.functional.one_hot(selected, logits.shape[-1])          # (t, k, E)
    tokens_per_expert = mask.float().mean(dim=0)                            # (k, E)
    return (tokens_per_expert * probs.mean(dim=0).unsqueeze(0)).sum() * logits.shape[-1]


def test_aux_loss_convention_maps_to_mixtral_and_switch():
    """One sequence, one layer: Mixtral's = k x ours (docs/reference.md's coefficient
    mapping); at k = 1 ours is Switch's E sum_e f_e P_e. The objective sums the layers."""
    logits = torch.randn(16, E, generator=torch.Generator().manual_seed(2))
    for k in (1, 2, 3):
        probs, _, experts = moe.route(logits, k)
        ours = moe.load_balancing_loss(probs, experts, 16)
        assert _mixtral_aux(logits, k).item() == pytest.approx(k * ours.item(), rel=1e-6)
    probs, _, experts = moe.route(logits, 1)
    f = torch.bincount(experts[:, 0], minlength=E).float() / 16
    switch = E * (f * probs.mean(dim=0)).sum()
    assert moe.load_balancing_loss(probs, experts, 16).item() == pytest.approx(switch.item())
    model = build(config("nano", moe_experts=E, moe_top_k=K, moe_z_coef=1e-3), seed=0)
    x, y = _batch()
    model(x, y)
    layers = moe.moe_layers(model)
    want = sum(0.01 * m.aux_loss + 1e-3 * m.z_loss for m in layers)
    assert moe.penalty(model).item() == pytest.approx(want.item())
    stats = moe.step_stats(model)
    assert stats["aux_loss"] == pytest.approx(sum(m.aux_loss.item() for m in layers))
    assert stats["aux_loss"] > 3.5                       # 4 layers of about 1 each


def test_aux_loss_is_one_when_balanced_and_E_when_collapsed():
    s = 8                                                # two sequences of 8 tokens, top-1
    uniform = torch.full((2 * s, E), 1 / E)
    balanced = torch.arange(2 * s).remainder(E).unsqueeze(1)
    assert moe.load_balancing_loss(uniform, balanced, s).item() == pytest.approx(1.0)
    onehot = torch.zeros(2 * s, E)
    onehot[:, 0] = 1
    collapsed = torch.zeros(2 * s, 1, dtype=torch.long)
    assert moe.load_balancing_loss(onehot, collapsed, s).item() == pytest.approx(E)
    # per sequence, then the mean: sequence 1 collapsed, sequence 2 balanced
    mixed = torch.cat([onehot[:s], uniform[s:]]), torch.cat([collapsed[:s], balanced[s:]])
    assert moe.load_balancing_loss(*mixed, s).item() == pytest.approx((E + 1) / 2)


def test_capacity_keeps_first_choices_first_then_positions():
    s, cf = 6, 1.0
    experts = torch.randint(0, E, (2 * s, K), generator=torch.Generator().manual_seed(1))
    keep = moe.capacity_mask(experts, s, E, cf)
    capacity = math.ceil(cf * s * K / E)
    for b in range(2):                                   # a plain loop, in GShard's order
        used = [0] * E
        for j in range(K):
            for pos in range(s):
                e = experts[b * s + pos, j].item()
                assert keep[b * s + pos, j].item() == (used[e] < capacity)
                used[e] += 1
    assert moe.capacity_mask(experts, s, E, 0.0).all()  # dropless


def test_moe_model_build_is_deterministic_and_counted_by_the_planner():
    cfg = config("nano", moe_experts=E, moe_top_k=K, moe_every=2)
    a, b = build(cfg, seed=3), build(cfg, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    shape = trainer_presets()["nano"]
    counted = plan_moe.params(shape, plan_moe.MoE(E, K, 2))
    assert counted["total"] == sum(p.numel() for p in a.parameters())
    assert counted["experts"] == sum(p.numel() for n, p in a.named_parameters() if ".experts." in n)
    assert [i for i, blk in enumerate(a.blocks) if isinstance(blk.mlp, moe.MoE)] == [1, 3]


# --------------------------------------------------------------------------------------
# The layer on 4 ranks: routing, outputs, gradients and bytes equal the serial model's
# --------------------------------------------------------------------------------------
def _batch():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (8, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _serial(cf):
    model = build(config("nano", moe_experts=E, moe_top_k=K, capacity_factor=cf), seed=0)
    x, y = _batch()
    loss = model(x, y)
    loss.backward()
    routing = [m.routing for m in moe.moe_layers(model)]
    stats = moe.step_stats(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), routing, stats, grads


def _ep_rank(ep, cf):
    from minipar import dp
    from minipar.mesh import Mesh, param_groups
    grid = Mesh(dp=4, ep=ep)
    model = moe.expert_parallel(build(config("nano", moe_experts=E, moe_top_k=K,
                                             capacity_factor=cf), seed=0), grid.group("ep"))
    # experts reduce over their own group, edp (the trainer's way)
    engine = dp.DataParallel(model, group=grid.group("dp"), mode="bucketed",
                             groups=param_groups(model, grid, moe.expert_parameters(model)))
    x, y = _batch()
    rows = slice(2 * grid.coord("dp"), 2 * grid.coord("dp") + 2)
    comm.reset()
    engine.zero_grad()
    loss = model(x[rows], y[rows])
    loss.backward()
    moved = {op: b for op, b in comm.stats.bytes_by_op().items() if "all_to_all" in op}
    engine.finish_grad_sync()
    return dict(loss=loss.item(), routing=[m.routing for m in moe.moe_layers(model)],
                stats=moe.step_stats(model), moved=moved,
                grads={n: p.grad.clone() for n, p in model.named_parameters()})


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_expert_parallel_layer_equals_serial(ep, cf):
    loss, routing, stats, grads = _serial(cf)
    ranks = dist.launch(_ep_rank, 4, ep, cf, timeout=120)
    # the loss of the global batch and the routing of every token
    assert sum(r["loss"] for r in ranks) / 4 == pytest.approx(loss, abs=1e-5)
    t = 2 * 16                                           # tokens per rank
    for layer, (experts, keep) in enumerate(routing):
        for i, r in enumerate(ranks):
            got_experts, got_keep = r["routing"][layer]
            assert torch.equal(got_experts, experts[i * t:(i + 1) * t]), f"layer {layer} rank {i}"
            assert torch.equal(got_keep, keep[i * t:(i + 1) * t]), f"layer {layer} rank {i}"
    # aux loss (mean over ranks) and drops (sum over ranks) are the serial ones
    assert sum(r["stats"]["aux_loss"] for r in ranks) / 4 == pytest.approx(stats["aux_loss"], abs=1e-6)
    assert sum(r["stats"]["dropped"] for r in ranks) == stats["dropped"]
    assert (stats["dropped"] > 0) == (cf > 0)
    # every gradient: experts summed over their replicas / d, the rest averaged over d
    merged = {}
    for r in ranks:
        merged.update(r["grads"])
    assert set(merged) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(merged[name], g, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    # bytes: 2 (a_out + a_in) rows of d_model fp32 per layer, from this rank's routing
    d_model, per_rank = 32, E // ep
    for i, r in enumerate(ranks):
        group = range(i - i % ep, i - i % ep + ep)      # this rank's EP group
        expected = planned = 0
        for experts, keep in routing:
            def rows(src, dst):                          # kept assignments src sends to dst
                e = experts[src * t:(src + 1) * t][keep[src * t:(src + 1) * t]]
                return int(((e // per_rank) == dst % ep).sum())
            a_out = sum(rows(i, j) for j in group if j != i)
            a_in = sum(rows(j, i) for j in group if j != i)
            # forward: dispatch a_out rows, combine a_in rows; backward: the same again
            expected += (a_out + a_in + a_out + a_in) * d_model * 4
            planned += plan_moe.all_to_all_bytes(a_out, a_in, d_model, 4)
        assert planned == expected
        assert r["moved"]["all_to_all"] == expected
        assert r["moved"]["all_to_all_counts"] == len(routing) * (ep - 1) * per_rank * 8


# --------------------------------------------------------------------------------------
# The trainer: --ep 2, --ep 4, EP x DP, EP x ZeRO-1 against the serial MoE run
# --------------------------------------------------------------------------------------
_RUNS = {}


def moe_run(nproc, *extra):
    key = (nproc, *extra)
    if key not in _RUNS:
        _RUNS[key] = run_state(NANO + MOE + list(extra), nproc=nproc)
    return _RUNS[key]


@pytest.mark.parametrize("nproc,extra,same", [
    (2, ["--ep", "2"], []),
    (4, ["--ep", "4"], []),
    (4, ["--ep", "2"], []),                  # two EP groups: experts averaged over replicas
    pytest.param(4, ["--ep", "2", "--zero", "1"], [], marks=pytest.mark.slow),
    # clipping: each expert's norm counted once, by the first of its replicas
    pytest.param(4, ["--ep", "2"], ["--clip-grad", "0.05"], marks=pytest.mark.slow),
    pytest.param(4, ["--ep", "2", "--dp-mode", "naive"], [], marks=pytest.mark.slow),
    pytest.param(4, ["--ep", "2", "--zero", "3"], ["--microbatches", "2"], marks=pytest.mark.slow),
])
def test_trainer_expert_parallel_equals_serial(nproc, extra, same):
    """``extra``: the layout; ``same``: flags the serial reference runs with too."""
    ref = serial_state(MOE + same)
    got = moe_run(nproc, *extra, *same)
    # parameters after 8 Adam steps within 1e-4 (Adam divides by sqrt(v): a tiny gradient's
    # reordering noise moves its parameter by up to lr); losses and gradients within 1e-5
    assert_same_training(got, ref, loss_tol=1e-5, tol=1e-4)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"grad {name}: {m}")
    for a, b in zip(got["history"], ref["history"]):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], abs=1e-6)
        assert a["drop_rate"] == pytest.approx(b["drop_rate"], abs=1e-9)
    assert any(h["drop_rate"] > 0 for h in ref["history"])
    assert got["history"][-1]["comm_bytes"]["all_to_all"] > 0


def test_trainer_measurements_equal_the_planner(capsys):
    """fp32, plain DP, dp=4, ep=2: parameters and gradients per rank, and the routing-count
    all-to-all, as minipar.plan.moe and ``python -m minipar.plan memory`` say."""
    import json
    from minipar.plan.__main__ import main as plan_main
    last = moe_run(4, "--ep", "2")["history"][-1]
    got = last["model_state_bytes"]
    shape = trainer_presets()["nano"]
    plan = plan_moe.state_bytes(shape, plan_moe.MoE(E, K), dp=4, ep=2, zero=0, dtype="fp32")
    assert (got["params"], got["grads"]) == (plan["params"], plan["grads"])
    assert plan_main(["memory", "--model", "nano", "--gpus", "4", "--zero", "0", "--dtype", "fp32",
                      "--moe-experts", str(E), "--ep", "2", "--json"]) == 0
    cli_plan = json.loads(capsys.readouterr().out)
    assert (cli_plan["params_bytes"], cli_plan["grads_bytes"]) == (got["params"], got["grads"])
    counts = plan_moe.step_comm_bytes(shape, plan_moe.MoE(E, K), tokens=2 * 16, ep=2)
    assert last["comm_bytes"]["all_to_all_counts"] == counts["all_to_all_counts"]


def test_aux_loss_reaches_the_objective():
    """With a huge aux coefficient the router learns balance: aux loss falls towards 1."""
    hist = run_state(NANO + ["--moe-experts", "4", "--steps", "15", "--moe-aux-coef", "1.0",
                             "--lr", "1e-2"], nproc=1)["history"]
    free = run_state(NANO + ["--moe-experts", "4", "--steps", "15", "--moe-aux-coef", "0",
                             "--lr", "1e-2"], nproc=1)["history"]
    assert hist[-1]["aux_loss"] < free[-1]["aux_loss"]


# --------------------------------------------------------------------------------------
# MoE composes with TP (with and without SP), PP (every schedule) and recomputation:
# many layouts in one launch of 4 ranks, each against the serial MoE run
# --------------------------------------------------------------------------------------
SHORT = MOE[:-1] + ["4"]                 # 4 steps
QUICK = {  # name -> flags, on 4 processes
    "tp2 ep2": ["--tp", "2", "--ep", "2"],
    "tp2+sp ep2": ["--tp", "2", "--sp", "--ep", "2"],
    "pp2 1f1b ep2": ["--pp", "2", "--ep", "2"],
    "ep2": ["--ep", "2"],
    "ep2 recompute full": ["--ep", "2", "--recompute", "full"],
    "ep2 recompute selective": ["--ep", "2", "--recompute", "selective"],
}
SLOW = {
    "tp4": ["--tp", "4"],
    "pp2 gpipe tp2": ["--pp", "2", "--tp", "2", "--schedule", "gpipe"],
    "pp2 interleaved ep2": ["--pp", "2", "--ep", "2", "--schedule", "interleaved",
                            "--microbatches", "2"],
    "pp2 interleaved tp2+sp recompute full": ["--pp", "2", "--tp", "2", "--sp", "--schedule",
                                              "interleaved", "--microbatches", "2",
                                              "--recompute", "full"],
    "tp2+sp ep2 recompute full": ["--tp", "2", "--sp", "--ep", "2", "--recompute", "full"],
    "tp2 ep2 recompute selective": ["--tp", "2", "--ep", "2", "--recompute", "selective"],
    "ep4 zero1 recompute full": ["--ep", "4", "--zero", "1", "--recompute", "full"],
}
_LAUNCHES = {}


def _train_cases(cases: dict, nproc: int) -> dict:
    """On every rank: the trainer once per layout (one launch for them all)."""
    from minipar.train import parse_config, worker
    return {name: worker(parse_config(NANO + SHORT + flags + ["--nproc", str(nproc)]),
                         hooks=STATE) for name, flags in cases.items()}


def composed(cases: dict, name: str) -> dict:
    key = tuple(cases)
    if key not in _LAUNCHES:
        _LAUNCHES[key] = dist.launch(_train_cases, 4, cases, 4, timeout=240)   # < pytest's 300 s
    return train.merge_states([r[name] for r in _LAUNCHES[key]])


@pytest.mark.parametrize("cases,name", [(QUICK, n) for n in QUICK] + [
    pytest.param(SLOW, n, marks=pytest.mark.slow) for n in SLOW])
@pytest.mark.slow
def test_moe_composes_with_tp_pp_and_recompute(cases, name):
    """Losses, last gradients and parameters within 1e-5 of the serial run (fp32); the aux
    and z losses and the drop rate, gathered over TP ranks and pipeline stages, too."""
    ref = serial_state(SHORT)
    assert_same_moe_training(composed(cases, name), ref)
    assert ref["history"][0]["aux_loss"] > 3.5          # a sum over nano's 4 MoE layers


@pytest.mark.slow
def test_moe_checkpoint_moves_between_tp_and_pp(tmp_path):
    """Saved at step 2 as tp=2 x dp=2 (ep 2), resumed as pp=2 x dp=2 (ep 2): steps 3 and 4
    and the final parameters are the serial run's."""
    from minipar.train import run_state
    ref = serial_state(SHORT)
    first = SHORT[:-1] + ["2"]
    run_state(NANO + first + ["--tp", "2", "--ep", "2", "--save", str(tmp_path)], nproc=4)
    got = run_state(NANO + SHORT + ["--pp", "2", "--ep", "2", "--resume", str(tmp_path)], nproc=4)
    assert got["losses"] == pytest.approx(ref["losses"][2:], abs=1e-5)
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_tp_moe_state_bytes_equal_the_planner():
    """tp=2, dp=2, ep=2, fp32: experts replicated over TP, split over EP (minipar.plan.moe)."""
    got = composed(QUICK, "tp2 ep2")["history"][-1]["model_state_bytes"]
    plan = plan_moe.state_bytes(trainer_presets()["nano"], plan_moe.MoE(E, K), dp=2, ep=2,
                                zero=0, tp=2, dtype="fp32")
    assert (got["params"], got["grads"]) == (plan["params"], plan["grads"])


def _tp_layer_bytes(sp: bool, ep: int):
    """On 4 ranks (tp=2, dp=2): one MoE layer's forward and backward, its bytes by op."""
    from minipar import parallelize
    grid = Mesh(dp=2, tp=2, ep=ep)
    model = build(config("nano", moe_experts=E, moe_top_k=K, capacity_factor=1.0), seed=0)
    parallelize.parallelize(model, grid, sp=sp)     # MoE under TP: the composition's
    layer = model.blocks[0].mlp
    b, s = 2, 16
    x = torch.randn(b, s // 2 if sp else s, 32, generator=torch.Generator().manual_seed(grid.rank // 2))
    comm.reset()
    y = layer(x.requires_grad_())
    (y.square().sum() + layer.aux_loss).backward()
    return comm.stats.bytes_by_op()


@pytest.mark.parametrize("sp", [False, True])
def test_tp_moe_layer_bytes_equal_the_formula(sp):
    """The TP collectives of an MoE layer: the choices' all-gather, (without SP) the tokens'
    all-gathers, and the f all-reduces of the router's and experts' gradients."""
    ranks = dist.launch(_tp_layer_bytes, 4, sp, 2, timeout=120)
    want = plan_moe.tp_layer_comm_bytes(trainer_presets()["nano"], plan_moe.MoE(E, K),
                                        tokens=2 * 16, tp=2, sp=sp, ep=2)
    for r in ranks:
        assert r["all_gather"] == want["all_gather"]
        assert r["all_reduce"] == want["all_reduce"]


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.slow
def test_recompute_replays_routing_and_all_to_alls(mode):
    """--recompute: the gradients of the run without it, and per step the same all-to-all
    bytes (the recomputed forward replays the first one's routing and rows)."""
    plain, again = composed(QUICK, "ep2"), composed(QUICK, f"ep2 recompute {mode}")
    for name, g in plain["grads"].items():
        torch.testing.assert_close(again["grads"][name], g, atol=1e-6, rtol=0, msg=name)
    for a, b in zip(again["history"], plain["history"]):
        for op in ("all_to_all", "all_to_all_counts"):
            assert a["comm_bytes"][op] == b["comm_bytes"][op] > 0
        assert (a["aux_loss"], a["drop_rate"]) == (b["aux_loss"], b["drop_rate"])


def test_recompute_draws_the_same_router_noise():
    """Noisy top-k under --recompute full: the recomputation draws the first forward's noise
    again (checkpoint restores the RNG state), so the gradients are those of the run without
    recomputation (same seed), and the statistics count each forward once."""
    grads = {}
    for mode in ("none", "full"):
        from minipar import parallelize           # the layer replays its decisions there
        model = parallelize.parallelize(build(config("nano", moe_experts=E, moe_top_k=K,
                                                     moe_noise=1.0, recompute=mode), seed=0), Mesh())
        x, y = _batch()
        torch.manual_seed(5)
        model(x, y).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
        assert moe.step_stats(model)["assigned"] == 4 * 8 * 16 * K
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], g, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("flags,words", [
    (["--nproc", "4", "--tp", "4", "--seq-len", "10"], "multiple of 4"),
    (["--nproc", "4", "--ep", "3"], "divide"),
    (["--nproc", "2", "--ep", "2", "--moe-experts", "0"], "--moe-experts"),
    (["--nproc", "2", "--moe-top-k", "5"], "--moe-top-k"),
    (["--nproc", "2", "--capacity-factor", "-1"], "--capacity-factor"),
])
def test_bad_moe_layouts_are_refused_before_any_work(flags, words):
    from minipar.runtime.errors import UsageError
    from minipar.train import parse_config
    args = ["--model", "nano", "--batch-size", "8", "--moe-experts", "4", *flags]
    with pytest.raises(UsageError, match=words.replace("-", r"\-")):
        parse_config(args)


@pytest.mark.slow
def test_bad_moe_layout_exits_2_with_one_line():
    out = cli("minipar.train", "--model", "nano", "--moe-experts", "4", "--nproc", "4",
              "--tp", "4", "--seq-len", "10", timeout=60)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "MoE" in out.stderr, out.stderr


def test_moe_layout_rules_are_one_function_for_trainer_planner_and_layer():
    """rules.moe_violation is what the trainer, the planner and expert_parallel refuse with
    (the trainer's lines: test_bad_moe_layouts_are_refused_before_any_work above)."""
    from minipar import rules
    from minipar.plan import moe as plan_moe
    from minipar.runtime.errors import PlanError
    assert rules.moe_violation(8, 2, ep=4, dp=8) is None
    assert "multiple of --ep 4" in rules.moe_violation(6, 2, ep=4)
    assert "divide the data-parallel degree 6" in rules.moe_violation(8, 2, ep=4, dp=6)
    assert "--moe-top-k" in rules.moe_violation(8, 9)
    assert "--moe-every" in rules.moe_violation(8, 2, every=5, layers=4)
    assert "give --moe-experts" in rules.moe_violation(0, ep=2)
    with pytest.raises(PlanError, match="multiple of --ep 4"):
        plan_moe.check(plan_moe.MoE(experts=6, top_k=2), ep=4)
