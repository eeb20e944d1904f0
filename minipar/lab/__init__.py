"""The code behind the workshop notebooks, one module per notebook.

    nb00  00_collectives          what each collective does and sends; the ring, step by step
    nb01  01_data_parallel        buckets, where the all-reduces happen, DP against DDP
    nb02  02_tensor_parallel      column and row splits, TP bytes, memory and time per rank
    nb03  03_pipeline_parallel    measured pipeline timelines, bubbles, the schedule explorer
    nb04  04_zero_and_amsp        where the memory goes, ZeRO/AMSP measured, AMSP's space
    nb05  05_3d_parallel_trainer  the process mesh, the trainer's seams one at a time, 3D
                                  layouts against the serial run
    nb06  06_scaling_experiments  weak/strong scaling measured and predicted, the pipeline's
                                  micro-batch trade-off, GPT 22B-1T on Frontier
    nb07  07_planning_at_scale    the Frontier study's layouts predicted, the planner's own
                                  pick, which piece of the model moves the prediction
    nb08  08_mixture_of_experts   routing, load balance, all-to-all bytes, dense vs MoE
    nb09  09_long_context         activations against s and cp, the ring drawn block by block,
                                  the causal imbalance measured, a 128k-token run planned

A notebook imports its module (``from minipar.lab import nb03``) and the package it teaches;
it carries no second copy of the code. Functions named ``*_experiment`` or documented as
running "on every rank" run inside ``minipar.runtime.dist.launch`` and return plain data; the
``draw_*`` functions turn results into figures (matplotlib is imported only when drawing).
The volumes they are checked against come from the planner (``minipar.plan``), the only
home of the closed forms.
"""
from ..bench import machine  # noqa: F401  (re-exported: every notebook prints its machine)


def explorer(draw, **controls):
    """An ipywidgets explorer around ``draw(**values)``, with a static drawing stored beside it.

    The cell first shows ``draw`` at the controls' starting values as ordinary output (a
    figure and its printed numbers): that is what a reader without a kernel sees (GitHub, a
    stored notebook), and what the text next to it may quote. Below it come the controls;
    moving one redraws in the widget's own area under them. (The widget's own first drawing
    is cleared, so JupyterLab does not show the starting figure twice.)
    """
    import ipywidgets as widgets
    ui = widgets.interactive(draw, **controls)
    ui.out.clear_output()
    draw(**ui.kwargs)           # the static drawing, stored with the notebook
    return ui


def traced_step(argv: list[str], name: str, op: str | None = None) -> dict:
    """Train with ``argv`` and ``--trace``; the last step's timeline, for notebooks 01, 04, 05.

    Returns ``dict(path, events, window=(start, end) ms of the last step, in_flight=[(start,
    end) ms of rank 0's asynchronous ``op`` ops issued in it], hidden_ms=the time they were in
    flight while rank 0's forward + backward ran)``. The trace file is written to the
    temporary folder (open it at ui.perfetto.dev).
    """
    import os
    import tempfile
    from ..runtime import trace
    path = os.path.join(tempfile.gettempdir(), f"minipar_trace_{name}.json")
    from .. import train
    train.run([*argv, "--quiet", "--trace", path])
    events = trace.load(path)
    steps = [e for e in events if e.get("pid") == 0 and e.get("cat") == "step"]
    last = max(steps, key=lambda e: e["ts"])
    window = (last["ts"] / 1e3, (last["ts"] + last["dur"]) / 1e3)
    inside = [iv for iv in trace.in_flight(events, 0, op) if window[0] <= iv[0] <= window[1]]
    compute = [iv for iv in trace.spans(events, 0, "forward + backward") if iv[0] >= window[0]]
    return dict(path=path, events=events, window=window, in_flight=inside,
                hidden_ms=trace.overlap_ms(inside, compute))
