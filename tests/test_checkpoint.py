"""Checkpoints (minipar.checkpoint): resume in the same layout bit for bit, in other layouts
within the equivalence tolerance, PyTorch's own DCP tools read them, an interrupted save is
never resumed, and a bad checkpoint is one line with exit status 2 before any training.

One uninterrupted 20-step run in a 3-D-ish layout (TP 2 x DP 2, ZeRO-1, 4 ranks) saves at
steps 10 and 20; every resume starts from its step-10 checkpoint and must reproduce its
steps 11..20.
"""
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import NANO, ROOT, cli
from minipar.train import checkpoint
from minipar import train
from minipar.runtime.dist import UsageError
from minipar.model import build

SAVED_AS = ["--tp", "2", "--dp", "2", "--zero", "1"]
TRAIN = ["--clip-grad", "0.5", "--warmup", "3", "--lr-schedule", "cosine", "--weight-decay", "0.1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted run: 20 steps, checkpoints at 10 and 20."""
    root = str(tmp_path_factory.mktemp("ckpt") / "run")
    full = train.run_state(NANO + TRAIN + SAVED_AS + ["--save", root, "--save-every", "10"],
                           nproc=4)
    return dict(root=root, step10=checkpoint.step_dir(root, 10), full=full)


def _resume(saved, flags, nproc):
    return train.run_state(NANO + TRAIN + flags + ["--resume", saved["step10"]], nproc=nproc)


def test_save_layout_and_manifest(saved):
    assert checkpoint.complete_checkpoints(saved["root"]) == [
        checkpoint.step_dir(saved["root"], 10), checkpoint.step_dir(saved["root"], 20)]
    files = sorted(os.listdir(saved["step10"]))
    assert files == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                     "__3_0.distcp", "manifest.json"], "each of the 4 ranks writes its part"
    m = checkpoint.read_manifest(saved["step10"])
    assert m["step"] == 10 and m["layout"]["tp"] == 2 and m["layout"]["zero"] == 1
    assert m["model"]["preset"] == "nano" and m["versions"]["torch"] == torch.__version__
    assert m["data"]["next_step"] == 11


def test_same_layout_resume_is_bit_identical(saved):
    got = _resume(saved, SAVED_AS, nproc=4)
    assert got["losses"] == saved["full"]["losses"][10:]
    for name, p in saved["full"]["params"].items():
        assert torch.equal(got["params"][name], p), name


@pytest.mark.parametrize("flags,nproc", [(["--pp", "2"], 2), ([], 1), (["--zero", "3"], 2)],
                         ids=["pp2", "serial", "zero3"])
def test_resume_in_another_layout(saved, flags, nproc):
    got = _resume(saved, flags, nproc)
    ref = saved["full"]
    assert len(got["losses"]) == 10
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"][10:]), 11):
        assert abs(a - b) <= 1e-4, f"step {step}: {a} != uninterrupted {b}"
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, atol=1e-4, rtol=1e-4)


def test_pytorch_dcp_loads_it_into_a_plain_model(saved):
    """PyTorch's own get_state_dict / dcp.load / set_state_dict on a serial GPT and AdamW read
    the checkpoint that 4 ranks of TP x ZeRO-1 wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = build("nano", seed=1)          # another seed: every value must come from the file
    opt = train.make_optimizer(model.parameters(), 1e-3)
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # "assuming ... a single process"
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=checkpoint.step_dir(saved["root"], 20))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved["full"]["params"][name]), name
        st = opt.state[p]
        assert float(st["step"]) == 20 and st["exp_avg_sq"].min() >= 0 and st["exp_avg"].abs().sum() > 0


@pytest.mark.slow
def test_info_export_and_sample(saved, tmp_path, capsys):
    from minipar.train import sample
    checkpoint.main(["info", saved["root"]])
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["step"] == 20
    out = tmp_path / "model.pt"
    checkpoint.main(["export", saved["step10"], str(out)])
    model = build("nano")
    model.load_state_dict(torch.load(out))   # strict: every serial name, every full shape
    flags = ["--resume", saved["root"], "--prompt", "def ", "--tokens", "30", "--seed", "1"]
    text = sample.run(flags)
    # 30 sampled bytes after the prompt; any that end no complete UTF-8 character are left out
    assert text.startswith("def ") and 4 < len(text.encode()) <= 4 + 30
    assert sample.run(flags) == text
    r = cli("minipar.sample", *flags)      # the command itself, as the README runs it
    assert r.returncode == 0 and r.stdout == text + "\n", r.stderr


@pytest.mark.slow
def test_interrupted_save_is_never_resumed(saved, tmp_path):
    """A rank killed in the middle of saving step 4 (after the DCP files, before the marker):
    no step-4 checkpoint exists, and --resume takes step 2."""
    root = tmp_path / "run"
    # a fresh process: the launcher's process server keeps the environment it started with
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "faults.py"), "save", "0:4",
                        "--", "--nproc", "2", *NANO, "--steps", "4", "--save", str(root),
                        "--save-every", "2"], capture_output=True, text=True, timeout=180,
                       cwd=ROOT, env=env)
    assert r.returncode != 0 and "injected crash on rank 0 while saving step 4" in r.stderr
    assert sorted(os.listdir(root)) == [".step-000004.tmp", "step-000002"]
    assert checkpoint.find(str(root)) == checkpoint.step_dir(str(root), 2)
    cfg = train.parse_config(NANO + ["--resume", str(root), "--steps", "6"])
    assert cfg.start_step == 2 and cfg.resume == checkpoint.step_dir(str(root), 2)
    # a checkpoint folder without its marker is refused by name too
    torn = tmp_path / "torn"
    shutil.copytree(saved["step10"], torn)
    os.remove(torn / "COMPLETE")
    with pytest.raises(UsageError, match="incomplete checkpoint"):
        train.parse_config(NANO + ["--resume", str(torn)])


def _damaged(saved, tmp_path, how):
    bad = tmp_path / "bad"
    shutil.copytree(saved["step10"], bad)
    if how == "manifest":
        (bad / "manifest.json").write_text("{ not json")
    elif how == "truncated":
        with open(bad / "__2_0.distcp", "r+b") as f:
            f.truncate(100)
    elif how == "metadata":
        (bad / ".metadata").write_bytes(b"garbage")
    elif how in ("vocab", "newer-config", "step-text", "step-float", "no-layout"):
        m = json.loads((bad / "manifest.json").read_text())
        if how == "vocab":
            m["model"]["config"]["vocab_size"] = 300
        elif how == "newer-config":                   # a field this GPTConfig does not know
            m["model"]["config"]["rope_theta"] = 1e4
        elif how == "step-text":
            m["step"] = "abc"
        elif how == "step-float":                     # int() would have read it as 10
            m["step"] = 10.7
        else:
            del m["layout"]
        (bad / "manifest.json").write_text(json.dumps(m))
    return str(bad)


BAD_CHECKPOINTS = [
    ("missing", "no such folder"),
    ("empty", "no complete checkpoint"),
    ("manifest", "manifest.json is damaged"),
    ("truncated", "missing or truncated"),
    ("metadata", "DCP metadata is damaged"),
    ("vocab", "another model (vocab_size 300 here 256)"),
    ("newer-config", "manifest.json is damaged (TypeError"),
    ("step-text", "manifest.json is damaged (ValueError"),
    ("step-float", "manifest.json is damaged (ValueError: step 10.7 is not a whole number"),
    ("no-layout", "manifest.json is damaged (KeyError"),
    ("other-model", "another model (n_layer 4 here 8)"),
    ("done", "give --steps above 10"),
]


@pytest.mark.parametrize("how,message", BAD_CHECKPOINTS, ids=[b[0] for b in BAD_CHECKPOINTS])
def test_bad_checkpoint_is_a_usage_error(saved, tmp_path, how, message):
    flags = list(NANO)
    if how == "missing":
        path = str(tmp_path / "nothing")
    elif how == "empty":
        path = str(tmp_path)
    elif how == "other-model":
        path, flags = saved["step10"], flags + ["--model", "nano8"]
    elif how == "done":
        path, flags = saved["step10"], flags + ["--steps", "10"]
    else:
        path = _damaged(saved, tmp_path, how)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train.parse_config(flags + ["--resume", path])


@pytest.mark.slow
def test_bad_checkpoint_exits_2_with_one_line(saved, tmp_path):
    r = cli("minipar.train", *NANO, "--resume", _damaged(saved, tmp_path, "truncated"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:")
    assert "step" not in r.stdout


def _fused_adamw(params, lr):
    return torch.optim.AdamW(list(params), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                             fused=True)


def test_resume_with_fused_adam(tmp_path, monkeypatch):
    """The trainer uses fused AdamW on a GPU; injected here on the CPU (torch has a CPU fused
    kernel): save at step 2, resume, and steps 3..4 repeat the uninterrupted run bit for bit,
    with the step counter where a fused optimizer keeps it (its parameter's device, fp32)."""
    made = []
    monkeypatch.setattr(train.loop, "make_optimizer",
                        lambda params, lr: made.append(_fused_adamw(params, lr)) or made[-1])
    root = str(tmp_path / "run")
    full = train.run_state(NANO + ["--steps", "4", "--save", root, "--save-every", "2"], nproc=1)
    resumed = train.run_state(NANO + ["--steps", "4", "--resume", checkpoint.step_dir(root, 2)],
                              nproc=1)
    assert resumed["losses"] == full["losses"][2:]
    for name, p in full["params"].items():
        assert torch.equal(resumed["params"][name], p), name
    opt = made[-1]
    assert opt.param_groups[0]["fused"]
    fresh = _fused_adamw([torch.nn.Parameter(torch.ones(2))], 1e-3)
    fresh.param_groups[0]["params"][0].grad = torch.ones(2)
    fresh.step()
    want = next(iter(fresh.state.values()))["step"]
    for p, s in opt.state.items():
        assert (s["step"].device, s["step"].dtype) == (p.device, want.dtype)
        assert float(s["step"]) == 4


def test_loaded_step_counter_lives_on_the_fused_kernels_device():
    """A stand-in for CUDA parameters (the meta device): for a fused or capturable group the
    counter a checkpoint loads into is made on the parameter's device, as Adam makes it;
    for the plain kernel a CPU scalar, as Adam makes it."""
    for flag, device in (("fused", "meta"), ("capturable", "meta"), (None, "cpu")):
        p = torch.nn.Parameter(torch.zeros(3, device="meta"))
        opt = torch.optim.AdamW([p])
        if flag:
            opt.param_groups[0][flag] = True     # what AdamW(fused=True) sets on a GPU
        checkpoint.ensure_adam_state(opt)
        step = opt.state[p]["step"]
        assert (step.device.type, step.dtype) == (device, torch.float32), flag


def test_save_never_overwrites_or_prunes_a_later_run(saved, tmp_path):
    """--save into a folder holding a step past where this run starts (another run's) is
    refused before training: a fresh run would overwrite it, and --keep would prune the
    checkpoint this run just wrote in favour of the other run's later one."""
    folder = tmp_path / "runs"
    shutil.copytree(saved["step10"], folder / "step-000010")
    with pytest.raises(UsageError, match="already holds step-000010"):
        train.parse_config(NANO + ["--save", str(folder), "--keep", "1"])
    train.parse_config(NANO + ["--steps", "12", "--save", str(folder), "--resume", str(folder)])


def test_export_checks_its_output_before_loading(saved, tmp_path, capsys):
    from minipar.train.checkpoint import main
    (tmp_path / "old.pt").write_bytes(b"keep me")
    for out, words in ((tmp_path, "is a folder"), (tmp_path / "old.pt", "--force"),
                       (tmp_path / "no" / "x.pt", "folder does not exist")):
        with pytest.raises(SystemExit) as e:
            main(["export", saved["step10"], str(out)])
        assert e.value.code == 2 and words in capsys.readouterr().err
    assert (tmp_path / "old.pt").read_bytes() == b"keep me"


def test_resuming_on_another_corpus_is_said():
    from types import SimpleNamespace
    from minipar.train import report
    saved = {"training": {"seed": 0}, "data": {"source": "built-in corpus"}}
    said = []
    report.note_changed_training(said.append, saved, SimpleNamespace(seed=0, data="other.txt"))
    assert said == ["note: continuing with other training flags than the checkpoint's: "
                    "data built-in corpus -> other.txt"]
    said.clear()
    report.note_changed_training(said.append, saved, SimpleNamespace(seed=0, data=None))
    assert said == []
