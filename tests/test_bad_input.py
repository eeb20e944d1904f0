"""Every command users type, fuzzed: bad input ends with exit status 2 and one line on
stderr ("error: ..."), before any work starts (nothing on stdout, no process launched).

One table, by command. Rows take ``{tmp}`` (a fresh folder holding the fixture files made by
``_fixtures``) and run in this process through each command's own entry point, so a row that
is not caught would visibly start training (and time out) rather than pass.

To add a command: a runner in ENTRY and its rows in a list below (NEW_COMMANDS holds the
rows of the commands added by other issues: sample, checkpoint, scaling). A message of
"a|b" accepts either part (where two checks may fairly come first).
"""
import importlib
import os
import sys

import pytest

from minipar.runtime import cli, dist


_NCCL_TOO_MANY = dist.gpu_count() + 1     # --nproc 2 is valid on a host with two GPUs


def _fixtures(tmp):
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (tmp / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e ".encode("latin-1") * 200)
    (tmp / "adir").mkdir()
    (tmp / "bad.json").write_text('{"name": "x", "peak_tflops": ')            # malformed JSON
    (tmp / "wrong.json").write_text('{"name": "x"}')                        # missing fields
    (tmp / "list.json").write_text('[1, 2, 3]')                             # not an object
    (tmp / "nan.json").write_text('{"name": "x", "peak_tflops": NaN}')
    (tmp / "empty.py").write_text("")
    (tmp / "notes.txt").write_text("not python")
    (tmp / "binary.py").write_bytes(b"\xff\xfe\x00garbage\x81")
    import json
    from minipar.plan.hardware import PRESET_DIR
    good = json.loads((PRESET_DIR / "dgx-a100.json").read_text())
    for name, field, value in (("hw-nan-latency", "intra_node_latency", float("nan")),
                               ("hw-negative-latency", "inter_node_latency", -1e-6),
                               ("hw-zero-latency", "intra_node_latency", 0),
                               ("hw-zero-bandwidth", "inter_node_bandwidth", 0),
                               ("hw-inf-bandwidth", "intra_node_bandwidth", float("inf")),
                               ("hw-negative-peak", "peak_flops", -3e14),
                               ("hw-zero-peak", "peak_flops", 0),
                               ("hw-nan-hbm", "hbm_bandwidth", float("nan"))):
        (tmp / f"{name}.json").write_text(json.dumps({**good, field: value}))


def _train(argv):
    from minipar import train
    return train.main(argv)


def _plan(argv):
    from minipar.plan.__main__ import main
    return main(argv)


def _guarded(module):
    def run(argv):
        return cli.main_guard(importlib.import_module(module).main, argv)
    return run


ENTRY = {
    "train": _train,
    "plan": _plan,
    "bench": _guarded("minipar.bench.__main__"),
    "exercises": _guarded("minipar.exercises.__main__"),
}

TRAIN = [
    ("--model nano --moe-experts 4 --recompute full --compile", "torch.compile"),
    ("--save /proc/minipar-run", "cannot be written"),        # tried, not read off mode bits
    ("--moe-top-k 3", "--moe-top-k applies to an MoE model"),   # dense: would be ignored
    ("--capacity-factor nan", "--capacity-factor"),
    ("--moe-experts -4", "--moe-experts must be >= 0"),     # rules.moe_violation, as the plan's
    ("--moe-experts 4 --ep 0", "--ep must be >= 1"),
    # zero, negative, NaN, infinity, huge
    ("--nproc 0", "--nproc"),
    ("--nproc -2", "--nproc"),
    ("--nproc 100000", "100000"),
    ("--steps 0", "--steps"),
    ("--steps -3", "--steps"),
    ("--batch-size 0", "--batch-size"),
    ("--tp 0", "--tp"),
    ("--pp -1", "--pp"),
    ("--dp 0 --nproc 2", "--dp"),
    ("--chunks 0", "--chunks"),
    ("--microbatches 0", "--microbatches"),
    ("--log-every 0", "--log-every"),
    ("--seq-len 0", "--seq-len"),
    ("--lr 0", "--lr"),
    ("--lr -1", "--lr"),
    ("--lr nan", "--lr"),
    ("--lr inf", "--lr"),
    ("--bucket-mb 0", "--bucket-mb"),
    ("--bucket-mb nan", "--bucket-mb"),
    ("--bucket-mb inf", "--bucket-mb"),
    ("--timeout 0", "--timeout"),
    ("--timeout nan", "--timeout"),
    ("--timeout -5", "--timeout"),
    ("--seed -1", "--seed"),
    ("--seed 99999999999999999999", "--seed"),
    ("--steps 1e3", "--steps"),
    ("--model huge", "--model"),
    ("--dtype fp8", "--dtype"),
    ("--reduce-dtype fp16 --dtype bf16", "needs --dtype fp16"),
    ("--dtype fp16 --loss-scale-init 0", "--loss-scale-init"),
    ("--dtype fp16 --loss-scale-window 0", "--loss-scale-window"),
    ("--zero 5", "--zero"),
    # shapes that do not divide
    ("--nproc 3 --tp 3", "head"),                                  # 4 heads over tp=3
    ("--nproc 2 --pp 2 --model nano --schedule interleaved --chunks 3 --microbatches 4", "layer"),
    ("--nproc 3 --pp 3 --model nano --batch-size 12", "layer"),    # 4 layers over pp=3
    ("--nproc 2 --batch-size 5", "not divisible by dp=2"),
    ("--nproc 2 --pp 2 --batch-size 6 --microbatches 4", "microbatches"),
    ("--nproc 2 --tp 2 --sp --seq-len 33", "seq"),
    ("--nproc 3 --tp 2", "do not divide into tp=2"),
    ("--nproc 4 --dp 3", "--dp 3"),
    ("--sp", "needs --tp > 1"),
    ("--schedule interleaved", "needs --pp > 1"),
    ("--zero 1 --shard 1,1,2 --nproc 2", "not both"),
    ("--shard 1,x,2 --nproc 2", "shard"),
    ("--shard 0,1,2 --nproc 2", "shard"),
    ("--shard 1,2,4 --nproc 2", "shard"),
    # more local processes than GPUs: refused on any host (none here; two on a 2-GPU node)
    (f"--backend nccl --nproc {_NCCL_TOO_MANY} --batch-size {_NCCL_TOO_MANY}", "GPU"),
    # sequence length above what the data holds
    ("--seq-len 1000000", "--seq-len"),
    # --data: missing, empty, binary, not UTF-8, a folder
    ("--data /nonexistent/corpus.txt", "no such file"),
    ("--data {tmp}/empty.txt", "--data"),
    ("--data {tmp}/binary.bin", "--data"),
    ("--data {tmp}/latin1.txt", "--data"),
    ("--data {tmp}/adir", "--data"),
    # --metrics: missing folder, a folder, not writable
    ("--metrics /no/such/dir/m.jsonl", "--metrics"),
    ("--metrics {tmp}/adir", "--metrics"),
    ("--metrics /proc/minipar-metrics.jsonl", "--metrics"),
]

PLAN = [
    ("", "command"),
    ("bogus", "bogus"),
    ("memory --params 175B", "--gpus"),
    ("memory --params 175B --gpus 0 --zero 1", "--gpus"),
    ("memory --params nan --gpus 8 --zero 1", "--params"),
    ("memory --params -5 --gpus 8 --zero 1", "--params"),
    ("memory --params 175B --gpus 8 --zero 1 --shard 1,2,4", "--shard"),
    ("memory --params 175B --gpus 8 --shard 1,3,4", "shard"),
    ("memory --params 175B --gpus 8 --tp 3 --zero 1", "tp*pp"),
    ("params", "--model"),
    ("params --model nope", "nope"),
    ("params --layers 0 --hidden 64 --vocab 100 --seq-len 16", "--layers"),
    ("flops --model gpt-175b --batch 8 --step-time nan --gpus 8 --hardware dgx-a100", "--step-time"),
    ("flops --model gpt-175b --batch 8 --step-time -1 --gpus 8 --hardware dgx-a100", "--step-time"),
    ("flops --model gpt-175b --batch 8 --step-time inf --gpus 8 --hardware dgx-a100", "--step-time"),
    ("search --model gpt-175b --gpus 8", "--hardware"),
    ("estimate --model llama-7b --gpus 8 --hardware dgx-h100 --moe-experts -4",
     "--moe-experts must be >= 0"),
    ("flops --model llama-7b --ep 0", "--ep must be >= 1"),
    ("search --model nope --gpus 8 --hardware dgx-a100", "nope"),
    ("search --model gpt-175b --gpus 8 --hardware nope", "nope"),
    ("search --model gpt-175b --gpus 8 --hardware {tmp}/bad.json", "bad.json"),
    ("search --model gpt-175b --gpus 8 --hardware {tmp}/wrong.json", "wrong.json"),
    ("search --model gpt-175b --gpus 8 --hardware {tmp}/list.json", "list.json"),
    ("search --model gpt-175b --gpus 8 --hardware {tmp}/nan.json", "nan.json"),
    ("search --model gpt-175b --gpus 8 --hardware {tmp}/binary.bin", "binary.bin"),
    ("search --model gpt-175b --gpus 8 --hardware {tmp}/adir", "adir"),
    ("search --model gpt-175b --gpus 8 --hardware dgx-a100 --top 0", "--top"),
    ("search --model gpt-175b --gpus 8 --hardware dgx-a100 --overlap 2", "--overlap"),
    ("search --model gpt-175b --gpus 8 --hardware dgx-a100 --overlap nan", "--overlap"),
    ("estimate --model gpt-175b --hardware dgx-a100 --gpus 8 --tp 3", "tp"),
    ("estimate --model gpt-175b --hardware dgx-a100 --gpus 8 --tp 8 --pp 2", "gpus"),
    # parameter counts: zero, negative, non-finite, overflowing
    ("memory --params 0 --gpus 8 --zero 1", "--params"),
    ("memory --params 1e400 --gpus 8 --zero 1", "--params"),
    ("memory --params 1e30 --gpus 8 --zero 1", "--params"),
    ("memory --params inf --gpus 8 --zero 1", "--params"),
    ("search --model llama-7b --gpus 8 --hardware dgx-a100 --global-batch-tokens 0", "--global"),
    # heads that do not divide the hidden size
    ("params --layers 2 --hidden 64 --heads 3 --vocab 100 --seq-len 16", "heads"),
    ("flops --layers 2 --hidden 64 --heads 5 --vocab 100 --seq-len 16 --batch 2", "heads"),
    # hardware files with NaN, negative or zero latencies, bandwidths, peaks
    *((f"search --model gpt-22b --gpus 64 --hardware {{tmp}}/{name}.json", field)
      for name, field in (("hw-nan-latency", "intra_node_latency"),
                          ("hw-negative-latency", "inter_node_latency"),
                          ("hw-zero-latency", "intra_node_latency"),
                          ("hw-zero-bandwidth", "inter_node_bandwidth"),
                          ("hw-inf-bandwidth", "intra_node_bandwidth"),
                          ("hw-negative-peak", "peak_flops"),
                          ("hw-zero-peak", "peak_flops"),
                          ("hw-nan-hbm", "hbm_bandwidth"))),
    ("estimate --model gpt-22b --hardware {tmp}/hw-zero-bandwidth.json --gpus 8",
     "inter_node_bandwidth"),
]

BENCH = [
    ("", "choose a benchmark"),
    ("bogus", "choose a benchmark"),
    ("dp --nproc 0", "--nproc"),
    ("dp --bucket-mb nan", "--bucket-mb"),
    ("dp --bucket-mb 0", "--bucket-mb"),
    ("dp --warmup -1", "--warmup"),
    ("dp --model nope", "--model"),
    ("tp --d-model 0", "--d-model"),
    ("tp --warmup -2", "--warmup"),
    ("tp --nproc 3", "--nproc 3"),                  # 4 heads of a 256-wide block: no split
    ("pp --model nope", "--model"),
    ("pp --micro-batch 0", "--micro-batch"),
    ("zero --nproc 0", "--nproc"),
    ("zero --warmup -1", "--warmup"),
    ("cp --heads 0", "--heads"),
    ("cp --nproc 4 --seq-len 100", "--seq-len"),
    ("gpu --warmup -1", "--warmup"),
    ("calibrate --nproc 0", "--nproc"),
    ("calibrate --out {tmp}/adir", "--out"),
    ("calibrate --out /proc/minipar-hw.json", "--out"),
    ("validate --steps 0", "--steps"),
    ("validate --layouts bogus", "bogus"),
    ("calibrate --out /no/such/dir/hw.json", "--out"),
]

EXERCISES = [
    ("", "cmd"),
    ("check ex99", "ex99"),
    ("check ex01 --file /nonexistent/ex01.py", "no such file"),
    ("check ex01 --file {tmp}/empty.py", "empty"),
    ("check ex01 --file {tmp}/notes.txt", "not a Python file"),
    ("check ex01 --file {tmp}/adir", "not a Python file"),
    ("check ex01 --file {tmp}/binary.py", "UTF-8"),
    ("check ex01 --timeout nan", "--timeout"),
    ("check ex01 --timeout 0", "--timeout"),
    ("check ex01 --solution --file {tmp}/empty.py", "not both"),
    ("make ex99", "ex99"),
    ("make ex01 --out {tmp}/notes.txt", "not a folder"),
]

# Commands of other open issues (sample, checkpoint, scaling): rows run once the module exists.
NEW_COMMANDS = {
    "sample": [
        ("", "--resume"),
        ("--resume /no/such/checkpoint --prompt hi", "/no/such/checkpoint"),
        ("--resume {tmp}/adir --prompt hi", "adir"),
        ("--resume {tmp}/adir --prompt hi --tokens 0", "--tokens|adir"),
        ("--resume {tmp}/adir --prompt hi --temperature nan", "--temperature|adir"),
        ("--resume {tmp}/adir --prompt hi --temperature -1", "--temperature|adir"),
        ("--resume {tmp}/adir --prompt hi --top-k 0", "--top-k|adir"),
        ("--resume {tmp}/adir --prompt hi --device mps", "--device"),
        ("--resume {tmp}/adir --prompt hi --device meta", "--device"),
    ],
    "checkpoint": [
        ("", "command"),
        ("info /no/such/checkpoint", "/no/such/checkpoint"),
        ("info {tmp}/adir", "adir"),
        ("info {tmp}/empty.txt", "empty.txt"),
    ],
    "scaling": [
        ("", "mode"),
        ("weak --nproc-list 1,2 --point-timeout nan", "--point-timeout"),
        ("bogus --nproc-list 1,2", "bogus"),
        ("weak --nproc-list 0,2", "--nproc-list"),
        ("weak --nproc-list 1,x", "--nproc-list"),
        ("strong --nproc-list 1,2 --out {tmp}/adir", "--out"),
        ("strong --nproc-list 1,2 --plot /proc/minipar-plot.png", "--plot"),
    ],
}
for _name in NEW_COMMANDS:
    ENTRY[_name] = _guarded(f"minipar.{_name}")

ROWS = ([("train", a, m) for a, m in TRAIN] + [("plan", a, m) for a, m in PLAN] +
        [("bench", a, m) for a, m in BENCH] + [("exercises", a, m) for a, m in EXERCISES] +
        [(c, a, m) for c, rows in NEW_COMMANDS.items() for a, m in rows])


def _has_main(command):
    try:
        module = importlib.import_module(f"minipar.{command}")
    except ImportError:
        return False
    return hasattr(module, "main") or importlib.util.find_spec(f"minipar.{command}.__main__")


@pytest.mark.parametrize("command,argv,message", ROWS,
                         ids=[f"{c}: {a or '(nothing)'}" for c, a, _ in ROWS])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, monkeypatch, command, argv, message):
    if command in NEW_COMMANDS and not _has_main(command):
        pytest.skip(f"minipar.{command} does not exist yet")
    from minipar import train
    monkeypatch.setattr(dist, "launch", _no_launch)
    monkeypatch.setattr(train, "worker", _no_launch)
    _fixtures(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv.split()]
    try:
        status = ENTRY[command](args)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert status == 2, f"exit status {status}\nstdout: {out[-800:]}\nstderr: {err[-800:]}"
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert any(m in lines[0] for m in message.split("|")), lines[0]
    assert out == "", f"work started before the error: {out[-800:]}"


def _no_launch(*a, **k):
    raise AssertionError("training or a launch started before the input was checked")


@pytest.mark.slow
def test_far_more_processes_than_cores_runs_but_warns_once(capsys, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr(dist, "_WARNED_OVERSUBSCRIBED", False)
    assert dist.launch(_rank, 6, timeout=120) == list(range(6))
    assert dist.launch(_rank, 6, timeout=120) == list(range(6))
    err = capsys.readouterr().err
    assert err.count("warning: 6 processes on 1 CPU core") == 1, err


def _rank():
    import torch.distributed as tdist
    return tdist.get_rank()
