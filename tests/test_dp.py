"""Data parallelism: every variant, with and without accumulation, equals the serial run,
equals torch DDP, and sends exactly 2(d-1)/d x gradient bytes per step."""
import pytest
import torch
import torch.distributed as tdist

from minipar import comm, data, dp
from minipar.runtime import dist
from minipar.model import build, config, num_params
from minipar.train import run_state

from conftest import NANO, assert_same_training, serial_state


# Quick tier: every mode on 2 ranks; the 4-rank runs of the same code are in the full suite.
CASES = ([(2, mode, 1) for mode in dp.MODES]
         + [pytest.param(4, mode, 1, marks=pytest.mark.slow) for mode in dp.MODES]
         + [(2, "naive", 2)]
         + [pytest.param(2, mode, 2, marks=pytest.mark.slow) for mode in dp.MODES if mode != "naive"])


@pytest.mark.parametrize("nproc,mode,micro", CASES)
def test_dp_equals_serial(nproc, mode, micro):
    got = run_state(NANO + ["--dp-mode", mode, "--microbatches", str(micro), "--bucket-mb", "0.01"],
                    nproc=nproc)
    assert_same_training(got, serial_state(), loss_tol=1e-5, tol=1e-5)


@pytest.mark.parametrize("mode", dp.MODES)
@pytest.mark.parametrize("micro", [1, 4])
def test_allreduce_bytes_equal_formula_every_step(mode, micro):
    """One all-reduce of every gradient per step, whatever the micro-batch count."""
    d = 2
    got = run_state(NANO + ["--steps", "3", "--dp-mode", mode, "--microbatches", str(micro),
                            "--bucket-mb", "0.01"], nproc=d)
    grad_bytes = num_params(build("nano")) * 4
    for h in got["history"]:
        assert h["comm_bytes"] == {"all_reduce": 2 * (d - 1) * grad_bytes // d}


def test_model_state_bytes_are_replicated_full_copies():
    got = run_state(NANO + ["--steps", "2"], nproc=2)
    phi = num_params(build("nano"))
    ms = got["history"][-1]["model_state_bytes"]
    assert ms["params"] == 4 * phi and ms["grads"] == 4 * phi
    # AdamW: exp_avg and exp_avg_sq (8 bytes/param) plus one scalar step per tensor
    n_tensors = len(list(build("nano").parameters()))
    assert 8 * phi <= ms["optimizer"] <= 8 * phi + 8 * n_tensors


def _versus_ddp(mode, steps):
    cfg = config("nano")
    tokens = data.ByteTokenizer().encode(data.default_corpus())
    batches = data.Batches(tokens, cfg.seq_len, 8, seed=0)
    r, d = tdist.get_rank(), tdist.get_world_size()
    ours, theirs = build(cfg, seed=0), build(cfg, seed=0)
    engine = dp.DataParallel(ours, group=comm.WORLD, mode=mode, bucket_mb=0.01)
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=3e-3)
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(theirs.parameters(), lr=3e-3)
    losses = []
    for step in range(1, steps + 1):
        x, y = batches.local_batch(step, r, d)
        engine.zero_grad(); engine.begin_step(1)
        a = ours(x, y); a.backward(); engine.finish_grad_sync(); ours_opt.step()
        opt.zero_grad()
        b = ddp(x, y); b.backward(); opt.step()
        losses.append((a.item(), b.item()))
    diffs = [(p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters())]
    return losses, max(diffs)


@pytest.mark.parametrize("mode", dp.MODES)
def test_dp_equals_torch_ddp(mode):
    for losses, max_param_diff in dist.launch(_versus_ddp, 2, mode=mode, steps=10):
        for a, b in losses:
            assert abs(a - b) < 1e-6
        assert max_param_diff < 1e-6


def _overlap_launches_before_step():
    """The overlapped variant starts bucket all-reduces during backward, not after it."""
    model = build("nano", seed=0)
    engine = dp.DataParallel(model, group=comm.WORLD, mode="overlapped", bucket_mb=0.001)
    x = torch.randint(0, 256, (2, 16))
    engine.zero_grad(); engine.begin_step(1)
    model(x, x).backward()
    in_flight = sum(b.handle is not None for b in engine.buckets())
    engine.finish_grad_sync()
    return in_flight, len(engine.buckets())


def test_overlapped_launches_during_backward():
    in_flight, n = dist.launch(_overlap_launches_before_step, 2)[0]
    assert n > 3 and in_flight == n


def _hand_driven_without_begin_step(steps, mode="overlapped", set_to_none=False):
    """A reader driving the engine by hand may never call begin_step, or may zero the grads
    with the optimizer (set_to_none) instead of the engine: grads must still average."""
    r, d = tdist.get_rank(), tdist.get_world_size()
    model = build("nano", seed=0)
    engine = dp.DataParallel(model, group=comm.WORLD, mode=mode, bucket_mb=0.01)
    worst = 0.0
    for step in range(steps):
        xs = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 * step + k))
              for k in range(d)]
        ref = build("nano", seed=0)
        for k in range(d):
            (ref(xs[k], xs[k]) / d).backward()
        if set_to_none:
            model.zero_grad(set_to_none=True)
        else:
            engine.zero_grad()
        model(xs[r], xs[r]).backward()
        engine.finish_grad_sync()
        worst = max(worst, max((p.grad - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), ref.parameters())))
    return worst


def test_overlapped_without_begin_step_still_averages():
    assert max(dist.launch(_hand_driven_without_begin_step, 2, steps=3)) < 1e-6


@pytest.mark.parametrize("mode", ["bucketed", "overlapped"])
def test_grads_zeroed_to_none_by_the_optimizer_still_average(mode):
    assert max(dist.launch(_hand_driven_without_begin_step, 2, steps=3, mode=mode,
                           set_to_none=True)) < 1e-6


def _frozen_and_groups():
    from minipar.mesh import ParamGroup
    torch.manual_seed(tdist.get_rank())             # every rank builds different weights
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    net[0].weight.requires_grad_(False)             # a frozen weight, as DDP broadcasts it too
    dp.DataParallel(net)
    trainable = [p for p in net.parameters() if p.requires_grad]
    refusals = []
    for listed in (trainable[:1], trainable + trainable[:1]):      # one left out; one twice
        try:
            dp.DataParallel(net, groups=[ParamGroup("dense", tuple(listed), "dp", None, 2)])
        except ValueError as e:
            refusals.append(str(e))
    # a group over its own process group (experts): a frozen weight may be one of its, so
    # the dense group's first rank cannot be broadcast over it
    own = tdist.new_group([0, 1])                   # a process group of its own
    try:
        dp.DataParallel(net, groups=[ParamGroup("dense", tuple(trainable[:1]), "dp", None, 2),
                                     ParamGroup("expert", tuple(trainable[1:]), "edp", own, 2)])
    except ValueError as e:
        refusals.append(str(e))
    return net[0].weight.detach().clone(), refusals


def test_frozen_weights_are_rank_0s_and_groups_must_list_every_trainable_parameter_once():
    """torch's DDP broadcasts every parameter when built, frozen ones too; a parameter group
    list that leaves a trainable parameter out (never averaged) or lists one twice (averaged
    twice) is refused with one line."""
    (f0, r0), (f1, r1) = dist.launch(_frozen_and_groups, 2)
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))[0].weight
    assert torch.equal(f0, f1) and torch.equal(f0, expected.detach())
    assert len(r0) == 3 and all("exactly once" in r for r in r0[:2]), r0
    assert "frozen parameters beside groups with their own process group" in r0[2]
