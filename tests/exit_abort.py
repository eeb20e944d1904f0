"""The gloo abort at exit, made frequent: "terminate called without an active exception".

Each rank keeps a sub-group alive past ``destroy_process_group()`` (as a Mesh or a
``fully_shard`` DeviceMesh does), posts an async all-reduce on it of a tensor whose Python
object it drops at once, and returns. gloo's worker thread then holds the last reference;
releasing it runs the tensor's ``__del__``, which sleeps (the delayed worker thread). Ended by
interpreter finalization (``spawn``: a user's script under torch.multiprocessing.spawn), the
thread takes the GIL back while the interpreter finalizes, Python ends it, and the forced
unwind through C++ calls std::terminate (SIGABRT). Ended by minipar's launcher (``launch``:
``dist.launch``, every rank through ``dist.finish`` and ``os._exit``) it cannot happen.

    python tests/exit_abort.py spawn|launch RUNS  ->  "runs R aborted A failed F"

(``launch``: one fresh ``python tests/exit_abort.py launch-runs RUNS`` launches the RUNS runs
one after another, each a ``dist.launch`` of two fresh ranks forked from its forkserver, and
writes a line after each to the stderr every rank writes to: no run's part may say
"terminate called". The abort lives in a rank's own end, and every run's ranks are new
processes, so one launcher serves all runs: a launcher process per run cost a Python start
and two torch imports each, most of the test's time.)
"""
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as tdist

DELAY_S = 0.3


class SlowToFree(torch.Tensor):
    """A tensor whose release keeps the releasing thread busy (and off the GIL) a while."""

    def __del__(self):
        time.sleep(DELAY_S)


KEEP = []    # the sub-group outlives destroy_process_group, its worker threads with it


def body():
    group = tdist.new_group([0, 1])
    KEEP.append(group)
    t = torch.ones(1 << 12).as_subclass(SlowToFree)
    work = tdist.all_reduce(t, async_op=True, group=group)
    del t, work              # the op is in flight: gloo's worker thread frees the tensor
    return "done"


def _spawned(rank, folder):
    tdist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                             world_size=2)
    body()
    tdist.destroy_process_group()


def main(how: str, runs: int) -> None:
    import torch.multiprocessing as mp
    aborted = failed = 0
    if how == "launch":          # one launcher for every run; a rank's abort shows on stderr
        r = subprocess.run([sys.executable, __file__, "launch-runs", str(runs)],
                           capture_output=True, text=True, timeout=60 + 60 * runs)
        parts = r.stderr.split(END_OF_RUN)
        ended = parts[:-1]       # the text after the last marker belongs to no run
        if len(ended) != runs or r.returncode != 0:
            print(r.stderr[-2000:], file=sys.stderr)
        for part in ended:
            aborted += "terminate called" in part
            failed += "terminate called" not in part and (RUN_FAILED in part)
        failed += runs - len(ended)          # runs that never reached their marker
        print(f"runs {runs} aborted {aborted} failed {failed}")
        return
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="minipar_abort_") as folder:
            ctx = mp.spawn(_spawned, args=(folder,), nprocs=2, join=False)
            for p in ctx.processes:
                p.join(60)
        codes = [p.exitcode for p in ctx.processes]
        aborted += any(c is not None and c < 0 for c in codes)
        failed += any(c is None or c > 0 for c in codes)
    print(f"runs {runs} aborted {aborted} failed {failed}")


END_OF_RUN = "=== exit_abort: end of run ===\n"
RUN_FAILED = "=== exit_abort: run failed ===\n"


def launch_runs(runs: int) -> None:
    """``runs`` launches in this one process; after each, a marker line on stderr (the ranks
    have been joined by then, so whatever they wrote comes before it)."""
    import traceback
    from minipar.runtime import dist
    for _ in range(runs):
        try:
            assert dist.launch(body, 2, timeout=60) == ["done", "done"]
        except BaseException:  # noqa: BLE001 - a failed run is counted, the next one runs
            traceback.print_exc()
            sys.stderr.write(RUN_FAILED)
        sys.stderr.write(END_OF_RUN)
        sys.stderr.flush()


if __name__ == "__main__":
    if sys.argv[1] == "launch-runs":
        launch_runs(int(sys.argv[2]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
