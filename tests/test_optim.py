"""Around Adam (minipar.train.optim): LR schedule, global gradient clipping, weight decay.

Clipping is checked where it is subtle: the global norm must count every element of the serial
model's gradient exactly once in every layout (TP slices and replicated norms, pipeline
stages, ZeRO's OS shards). Every layout family runs with a max norm that really clips, plus
warm-up, a cosine schedule and weight decay, and must give the serial run's norms, losses,
final parameters and gradients.
"""
import math

import pytest
import torch

from conftest import NANO, assert_same_training, serial_state
from minipar import data
from minipar.train import optim
from minipar.model import build, config
from minipar.train import parse_config, run_state

CLIP = 0.5
FULL = ["--steps", "10", "--clip-grad", str(CLIP), "--warmup", "2", "--lr-schedule", "cosine",
        "--min-lr", "3e-4", "--weight-decay", "0.1", "--eval-every", "5", "--eval-batches", "2"]

LAYOUTS = {  # name -> (flags, processes)
    "dp": (["--dp-mode", "bucketed"], 2),
    "tp+sp": (["--tp", "2", "--sp"], 2),
    "pp": (["--pp", "2"], 2),
    "zero1": (["--zero", "1"], 2),
    "zero3": (["--zero", "3"], 2),
    "shard1,2,2x2": (["--shard", "1,2,2"], 4),      # G and OS over 2, two replicas of each shard
    "3d": (["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "1", "--microbatches", "2"], 8),
}


def test_lr_schedule_shapes():
    lr, steps = 1.0, 10
    assert [optim.lr_at(s, lr, steps, warmup=4) for s in (1, 2, 4, 5, 10)] == [0.25, 0.5, 1, 1, 1]
    cos = [optim.lr_at(s, lr, steps, warmup=0, schedule="cosine", min_lr=0.1) for s in range(1, 11)]
    assert cos == sorted(cos, reverse=True) and cos[-1] == pytest.approx(0.1)
    assert optim.lr_at(5, lr, steps, schedule="cosine", min_lr=0.0) == pytest.approx(0.5)
    lin = [optim.lr_at(s, lr, steps, warmup=2, schedule="linear", min_lr=0.0) for s in (2, 6, 10)]
    assert lin == pytest.approx([1.0, 0.5, 0.0])


def test_decay_groups_follow_nanogpt():
    names = {n: p.ndim for n, p in build("nano").named_parameters()}
    decayed = {n for n, nd in names.items() if optim.decays(n, nd)}
    assert "embed.pos.weight" not in decayed and "embed.tok.weight" in decayed
    assert "blocks.0.attn.qkv.weight" in decayed and "head.proj.weight" in decayed
    assert not any(n.endswith("bias") or ".ln" in n for n in decayed)


def test_serial_run_equals_adamw_with_param_groups():
    """Our masked decay + schedule + clipping == torch's AdamW with nanoGPT's two parameter
    groups, torch's clip_grad_norm_ and the same LR per step, written out here."""
    flags = NANO + FULL
    ours = serial_state(FULL)
    cfg = parse_config(flags)
    model = build(cfg.model_cfg, seed=cfg.seed)
    decay = [p for n, p in model.named_parameters() if optim.decays(n, p.ndim)]
    other = [p for n, p in model.named_parameters() if not optim.decays(n, p.ndim)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    train_tokens, _ = data.split(data.ByteTokenizer().encode(data.load_text(None)))
    batches = data.Batches(train_tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    norms = []
    for step in range(1, cfg.steps + 1):
        for g in opt.param_groups:
            g["lr"] = optim.lr_at(step, cfg.lr, cfg.steps, 2, "cosine", 3e-4)
        opt.zero_grad()
        model(*batches.global_batch_at(step)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    assert all(n > CLIP for n in norms[:5]), f"the max norm must really clip: {norms}"
    got = [h["grad_norm"] for h in ours["history"]]
    assert got == pytest.approx(norms, rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours["params"][n], p.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if LAYOUTS[n][1] > 2
                                  else n for n in LAYOUTS])
def test_clipping_equals_serial_in_every_layout(name):
    flags, nproc = LAYOUTS[name]
    ref = serial_state(FULL)
    got = run_state(NANO + FULL + flags, nproc=nproc)
    norms = [h["grad_norm"] for h in ref["history"]]
    assert sum(n > CLIP for n in norms) >= 5, f"the max norm must really clip: {norms}"
    for a, b in zip(got["history"], ref["history"]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), a["step"]
        assert a["lr"] == b["lr"]
        assert ("val_loss" in a) == ("val_loss" in b) == (a["step"] % 5 == 0)
        if "val_loss" in a:
            assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5
    assert_same_training(got, ref, loss_tol=1e-5, tol=1e-4)


def test_val_loss_is_held_out():
    """The held-out split is the corpus's last tenth and training batches never reach it."""
    tokens = torch.arange(1000)
    train, val = data.split(tokens)
    assert val.tolist() == list(range(900, 1000)) and train.numel() == 900
    b = data.Batches(train, 16, 64, seed=3)
    assert max(int(b.global_batch_at(s)[1].max()) for s in range(1, 30)) < 900
    assert math.isclose(data.HELD_OUT, 0.1)
