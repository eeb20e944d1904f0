"""--trace FILE: every rank's timeline as a Chrome/Perfetto trace, from minipar's own records."""
import json

import pytest

from conftest import NANO
from minipar.runtime import trace
from minipar.train import run


def _spans(events, rank, cat):
    return [e for e in events if e.get("pid") == rank and e["ph"] == "X" and e["cat"] == cat]


def test_trace_of_overlapped_dp_shows_every_bucket_in_flight_during_backward(tmp_path):
    path = tmp_path / "dp.json"
    history = run(NANO + ["--steps", "2", "--nproc", "2", "--dp-mode", "overlapped",
                          "--bucket-mb", "0.05", "--trace", str(path)])
    events = json.loads(path.read_text())["traceEvents"]      # valid JSON, Trace Event Format
    assert {e["pid"] for e in events} == {0, 1}
    steps = _spans(events, 0, "step")
    assert [e["name"] for e in steps] == ["step 1", "step 2"]
    for rank in (0, 1):
        begins = [e for e in events if e.get("pid") == rank and e["ph"] == "b"]
        ends = {e["id"]: e for e in events if e.get("pid") == rank and e["ph"] == "e"}
        assert begins and all(ends[b["id"]]["ts"] >= b["ts"] for b in begins)
        fb = _spans(events, rank, "compute")
        backward_ends = [e["ts"] + e["dur"] for e in fb if e["name"] == "forward + backward"]
        # the lesson: buckets are issued before backward ends
        assert any(b["ts"] < backward_ends[0] for b in begins if b["ts"] < steps[0]["ts"] + steps[0]["dur"])
    # the trace counts the bytes the metrics count: rank 0's ops of each step
    for step, record in zip(steps, history):
        inside = [e for e in events if e.get("pid") == 0 and e["ph"] in ("b", "X")
                  and e.get("cat") == "comm" and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        assert sum(e["args"]["bytes_sent"] for e in inside) == sum(record["comm_bytes"].values())


def test_serial_trace_has_block_forwards_and_draws(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    path = tmp_path / "serial.json"
    run(NANO + ["--steps", "1", "--nproc", "1", "--microbatches", "2", "--trace", str(path)])
    events = trace.load(str(path))
    forwards = _spans(events, 0, "forward")
    # one span per block and micro-batch
    names = [e["name"] for e in forwards]
    assert names and all(names.count(n) == 2 for n in set(names)), names
    ax = trace.plot(events, title="serial")
    assert ax.get_xlabel() == "time (ms)"


def test_trace_into_a_missing_folder_is_refused_before_training(tmp_path):
    from minipar.runtime.errors import UsageError
    with pytest.raises(UsageError, match="--trace"):
        run(NANO + ["--trace", str(tmp_path / "no" / "t.json")])


def test_bench_dp_writes_a_trace(tmp_path):
    from minipar.bench import dp as bench_dp
    path = tmp_path / "bench.json"
    bench_dp.main(["--nproc", "2", "--model", "nano", "--steps", "1", "--warmup", "0",
                   "--trace", str(path)])
    events = trace.load(str(path))
    names = {e["name"] for e in events if e.get("pid") == 1 and e["ph"] == "X"}
    assert {"naive step 0", "overlapped step 0"} <= names, names
    assert any(e.get("cat") == "comm" for e in events if e.get("pid") == 0)
