"""A hardware profile fitted to measured runs, and judged on runs kept out of the fit.

``python -m minipar.plan fit RUNS.csv --hardware BASE -o PROFILE.json`` keeps BASE's datasheet
values (peak FLOP/s, link and NIC bandwidths, memory, cited in its ``sources``) and fits the
few efficiencies the planner cannot know from a datasheet:

    time     compute_efficiency      large GEMMs' fraction of peak            (0, 1]
             gemm_half_flops         GEMM size at half that efficiency        (compute)
             intra_node_efficiency   collectives' fraction of the node links  (0, 1]
             inter_node_efficiency   the NICs' fraction over each node count the runs span
             fabric_efficiency       the share of it left in a job of each of those widths
             all_gather_efficiency,  those ops' share of the all-reduce's rate per byte
             reduce_scatter_efficiency
             collective_latency      per call: NCCL's base latency and the framework's own
             layer_overhead          the host's seconds per layer and micro-batch (launches)
             overhead_hiding         how much of it the device's work hides (k; 1: none)
             pipeline_tp_latency     a TP call's wait per rank once stages hand off across nodes
             p2p_latency             seconds a message between nodes costs, at each job width
             overlap_slowdown        compute slowed by the traffic hidden beside it
             overlap_exposed         the share of hideable traffic that stays exposed
    memory   runtime_bytes           per rank, before the model
             fragmentation           the allocator's reserve, (reserved - live) / reserved
             layer_buffer_bytes      per layer on the device, beyond the planner's accounting

Time: least squares of log(predicted / measured tokens/s) over the runs that ran (the whole
estimate, ``estimate.estimate``, recomputed for each trial value: one model, not a copy of
it), each parameter bounded by physics (no efficiency above 1, so no bandwidth above its
datasheet; ``TRENDS``: the two tables of efficiencies never rise with more nodes, the
message's cost never falls) and fitted in log space where it spans decades. The latencies
per ring step stay NCCL's (``tuning.cc``, cited by BASE; docs/reference.md says why). Memory:
least squares of log(predicted / measured peak) over the runs that logged one. Each value comes
with its standard error (the Gauss-Newton covariance s^2 (J^T J)^-1 at the optimum); a
parameter the runs do not move (no run crosses nodes, say) keeps BASE's value ("kept"), with
no more runs than parameters the errors are "undetermined", and one the runs push onto a bound
is "bound" (its error says nothing). The profile records the data's sha256 and, with
``--holdout`` or ``--kfold``, ``score``'s figures on the runs kept out of each fit; every
estimate on the profile quotes their error bar in a note (``estimate``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..runtime.cli import emit, text_table
from .errors import PlanError
from .estimate import estimate
from .frameworks import load_framework
from .hardware import Hardware, load_hardware
from .peak import device_memory
from .runs import Run, digest, read_runs, select, twins
from .scorecard import markdown_table
from .timing import by_nodes

# (field, lower, upper, log-scaled?); a field ending in "@" is a table by node count: one
# parameter per node count above 1 that the runs span ("p2p_latency@16"), the table's rows,
# read between them as the planner reads them (``timing.by_nodes``)
TIME_PARAMETERS = (("compute_efficiency", 0.05, 1.0, False), ("gemm_half_flops", 1e6, 1e13, True),
                   ("intra_node_efficiency", 0.02, 1.0, False),
                   ("inter_node_efficiency@", 1e-4, 1.0, True),
                   ("fabric_efficiency@", 1e-3, 1.0, True),
                   ("all_gather_efficiency", 0.05, 1.0, False),
                   ("reduce_scatter_efficiency", 0.05, 1.0, False),
                   ("collective_latency", 1e-7, 1e-2, True), ("layer_overhead", 1e-7, 0.1, True),
                   ("overhead_hiding", 1.0, 8.0, False), ("pipeline_tp_latency", 1e-7, 0.1, True),
                   ("p2p_latency@", 1e-8, 10.0, True), ("overlap_slowdown", 0.0, 0.95, False),
                   ("overlap_exposed", 0.0, 0.95, False))
# A robust loss (Cauchy's, scale 0.2 in log units, a 22% error): some runs in any sweep are
# broken (a slow node, a straggler: the Playbook grid has runs at 1/20 of their neighbours'
# throughput), and plain squares would let them move the fit. Chosen over soft L1 while
# looking at the 8B rows' validation errors: 8B is a development holdout, not an untouched one.
LOSS, F_SCALE = "cauchy", 0.2
# Tables that never rise (-1) or never fall (+1) with more nodes: a wider ring or job never
# gets more of the NICs, nor a cheaper message. Fitted as the first node count's value, then
# one bounded step per next node count (``_steps``).
TRENDS = {"inter_node_efficiency": -1, "fabric_efficiency": -1, "p2p_latency": 1}
START = {"layer_overhead": 1e-3,    # if the base has none: ~100 launches a layer x ~10 us
         "pipeline_tp_latency": 1e-4}          # its bounds' geometric middle (decisions, 6)
MAX_EVALUATIONS = 200      # trials of the whole model (each Jacobian's columns not counted)
MEMORY_PARAMETERS = (("runtime_bytes", 2.0**20, None, True), ("fragmentation", 0.0, 0.5, False),
                     ("layer_buffer_bytes", 2.0**10, None, True))   # None: half the memory


def _estimate(run: Run, hw: Hardware, check: bool = False):
    if run.gpus_per_node != hw.gpus_per_node:      # priced on the run's links and NIC share
        hw = replace(hw, gpus_per_node=run.gpus_per_node)
    return estimate(run.shape, hw, run.layout, framework=load_framework(run.framework),
                    flash=run.flash, dtype=run.dtype, check=check)


def predictions(runs: list[Run], hw: Hardware) -> list:
    """Each run's ``Estimate``, or None where the framework or planner refuses it (a crash)."""
    out = []
    for r in runs:
        try:
            out.append(_estimate(r, hw, check=True))
        except PlanError:
            out.append(None)
    return out


def _expand(spec, runs: list[Run]) -> tuple:
    """``spec``, each table field ("name@") one parameter per node count above 1 in ``runs``."""
    widths = sorted({r.nodes for r in runs if r.nodes > 1})
    return tuple((f"{name}{n}" if name.endswith("@") else name, lo, hi, log)
                 for name, lo, hi, log in spec
                 for n in (widths if name.endswith("@") else [None]))


def _get(hw: Hardware, name: str) -> float:
    field, _, nodes = name.partition("@")
    if nodes:
        return by_nodes(getattr(hw, field), int(nodes), 1.0 if field.endswith("efficiency")
                        else 0.0)
    return float(getattr(hw, name))


def _with(hw: Hardware, values: dict) -> Hardware:
    """``hw`` with ``values``; a table's parameters ("field@nodes") become its rows."""
    plain, tables = {}, {}
    for name, v in values.items():
        field, _, nodes = name.partition("@")
        if nodes:
            tables.setdefault(field, []).append([int(nodes), v])
        else:
            plain[name] = v
    return replace(hw, **plain, **{k: sorted(rows) for k, rows in tables.items()})


def _least_squares(residuals, bounds, x0):
    """scipy's bounded trust-region least squares: (x, the covariance of x (0 where the data
    does not move a parameter; None with no more runs than parameters), which parameters the
    data moves at all, the residuals' sd). PlanError when it does not converge."""
    from scipy.optimize import least_squares
    lo, hi = np.array(bounds).T
    x0 = np.clip(np.array(x0, dtype=float), lo + 1e-9, hi - 1e-9)
    sol = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac", diff_step=1e-3,
                        max_nfev=MAX_EVALUATIONS, loss=LOSS, f_scale=F_SCALE)
    if sol.status <= 0 or not np.all(np.isfinite(sol.fun)):
        raise PlanError(f"the fit did not converge ({sol.message}); give more runs, or runs "
                        f"that vary what the profile fits")
    jac, n = sol.jac, len(sol.fun)
    moved = np.linalg.norm(jac, axis=0) > 1e-6 * np.linalg.norm(jac)   # relative: J ~ 1e-8 ok
    s2 = float(sol.fun @ sol.fun) / max(1, n - int(moved.sum()))
    cov = None                               # as many runs as parameters: no error to tell
    if moved.any() and n > moved.sum():
        cov = np.zeros((len(x0), len(x0)))
        cov[np.ix_(moved, moved)] = s2 * np.linalg.pinv(jac[:, moved].T @ jac[:, moved])
    return sol.x, cov, moved, float(np.sqrt(s2))


def _steps(spec) -> np.ndarray:
    """A, values' (log10 or linear) coordinates y = A x from fitted ones x: in a ``TRENDS``
    table each node count's value is the previous one's plus its own step."""
    a = np.eye(len(spec))
    for i in range(1, len(spec)):
        field = spec[i][0].partition("@")[0]
        if field in TRENDS and spec[i - 1][0].partition("@")[0] == field:
            a[i] += a[i - 1]
    return a


def _pack(spec, hw):
    """Start and bounds in fitted coordinates: a ``TRENDS`` step goes one way only."""
    y0, bounds = [], []
    for name, lo, hi, log in spec:
        value = _get(hw, name) or START.get(name, 0.0)
        y0.append(math.log10(max(value, lo)) if log else value)
        bounds.append((math.log10(lo), math.log10(hi)) if log else (lo, hi))
    a = _steps(spec)
    x0 = np.linalg.solve(a, np.clip(y0, *np.array(bounds).T))
    for i, (name, *_) in enumerate(spec):
        if a[i].sum() > 1:                   # a step: its bound is the sign the trend allows
            lo, hi = bounds[i]
            bounds[i] = (lo - hi, 0.0) if TRENDS[name.partition("@")[0]] < 0 else (0.0, hi - lo)
    return list(x0), bounds


def _unpack(spec, x):
    """Values from fitted coordinates, each held inside its bounds (a table's steps add up)."""
    out = {}
    for (name, lo, hi, log), y in zip(spec, _steps(spec) @ np.asarray(x, dtype=float)):
        y = min(max(y, math.log10(lo) if log else lo), math.log10(hi) if log else hi)
        out[name] = 10 ** y if log else float(y)
    return out


def _fit(spec, base: Hardware, residuals_of) -> tuple[Hardware, dict, float]:
    """Fit ``spec``'s parameters of ``base`` to ``residuals_of(hardware)`` (an array); a
    parameter the data does not move at all keeps ``base``'s value. Returns the fitted
    hardware, {name: [value, standard error or None, "fitted" | "kept": not moved |
    "undetermined": no more runs than parameters moved | "bound": on a bound]} and the
    residuals' sd. Correlated parameters (a large-GEMM efficiency against a fixed cost per
    layer) trade against each other: the table marks a value whose error exceeds it."""
    kept = {name: _get(base, name) for name, *_ in spec}
    x0, bounds = _pack(spec, base)
    x, cov, moved, s = _least_squares(
        lambda v: residuals_of(_with(base, _unpack(spec, v))), bounds, x0)
    a = _steps(spec)                         # the values' errors from the steps' covariance
    sigma = np.sqrt(np.clip(np.diag(a @ cov @ a.T), 0, None)) if cov is not None \
        else np.full(len(x), np.inf)
    moved = np.abs(a) @ moved > 0
    report = {}
    for (name, lo, hi, log), value, e, m in zip(spec, _unpack(spec, x).values(), sigma, moved):
        edge = any(abs(value - b) <= 1e-4 * (abs(b) or hi - lo) for b in (lo, hi))  # lo 0
        if not m:
            report[name] = [kept[name], None, "kept"]
        elif not math.isfinite(e):
            report[name] = [value, None, "undetermined"]
        else:
            report[name] = [value, value * math.log(10) * e if log else float(e),
                            "bound" if edge else "fitted"]
    return _with(base, {k: v[0] for k, v in report.items()}), report, s


def fit_time(runs: list[Run], base: Hardware) -> tuple[Hardware, dict, float]:
    """``base`` with the time parameters fitted to the runs that ran, their report and the
    residual standard deviation (in natural log units)."""
    ran = [r for r in runs if r.ran]
    usable = [r for r, e in zip(ran, predictions(ran, base)) if e is not None]
    if len(usable) < 3:
        raise PlanError(f"{len(usable)} runs that ran and the planner can price: too few to "
                        f"fit; give at least 3 (more, varied in tp, pp, dp and micro-batch, "
                        f"pin down more parameters: the report says which it could not)")
    measured = np.log([r.tokens_per_s_gpu * r.layout.gpus for r in usable])
    return _fit(_expand(TIME_PARAMETERS, ran), base, lambda hw: np.log(
        [_estimate(r, hw).tokens_per_s for r in usable]) - measured)


def fit_memory(runs: list[Run], hw: Hardware) -> tuple[Hardware, dict, float]:
    """``hw`` with the runtime bytes, the allocator's reserve and the buffers per layer
    fitted to the runs' logged peaks: measured = runtime + live / (1 - reserve), the live
    bytes the planner's ``device_memory`` (the buffers among them, each trial's); and
    ``memory_sigma``, the robust spread of what remains."""
    logged = [r for r, e in zip(runs, predictions(runs, hw))
              if e is not None and r.ran and math.isfinite(r.peak_mem_gib)]
    if len(logged) < 3:
        return hw, {name: [getattr(hw, name), None, "kept"] for name, *_ in MEMORY_PARAMETERS}, \
            math.nan
    measured = np.log([r.peak_mem_gib * 2**30 for r in logged])

    def residuals_of(h):
        live = np.array([device_memory(r.shape, r.layout, r.flash, r.dtype,
                                       load_framework(r.framework), h.layer_buffer_bytes)
                         ["total"] for r in logged])
        return np.log(h.runtime_bytes + live / (1 - h.fragmentation)) - measured

    hw, report, s = _fit([(name, lo, hw.memory_bytes / 2 if hi is None else hi, log)
                          for name, lo, hi, log in MEMORY_PARAMETERS], hw, residuals_of)
    r = residuals_of(hw)
    return replace(hw, memory_sigma=float(1.4826 * np.median(np.abs(r - np.median(r))))), \
        report, s


# --------------------------------------------------------------------------------------
# Judging a profile on runs
# --------------------------------------------------------------------------------------
def spearman(a, b) -> float:
    """Rank correlation (average ranks for ties); NaN for fewer than 3 pairs or no spread."""
    if len(a) < 3:
        return math.nan
    from scipy.stats import spearmanr
    rho = spearmanr(a, b).statistic
    return float(rho) if np.isfinite(rho) else math.nan


def score(runs: list[Run], hw: Hardware) -> dict:
    """How ``hw`` predicts ``runs``: mfu_ratio_median (predicted / measured tokens/s),
    mfu_error_median and _worst (|ratio - 1|), band_p10 and _p90 (10th and 90th percentiles of
    measured / predicted: the error bar), rank_median (over cells, each one model on one node
    count, of the rank correlation), pick_median and _worst (the measured tokens/s of the
    layout ranked first among a cell's that fit, over the cell's best; 0 if it crashed),
    crash_precision and _recall (a crash predicted: it does not fit, or the framework refuses
    it), false_crash (among the runs that ran), cells, runs, priced (ran and were priced)."""
    ratios, cells = [], {}
    crash = {"tp": 0, "fp": 0, "fn": 0, "tn": 0}
    for r, e in zip(runs, predictions(runs, hw)):
        cells.setdefault(r.cell, []).append((r, e))
        predicted_crash = e is None or not e.fits      # a positive; t/f: the prediction held/not
        crash[("fp" if r.ran else "tp") if predicted_crash else ("tn" if r.ran else "fn")] += 1
        if r.ran and e is not None:
            ratios.append(e.tokens_per_s / (r.tokens_per_s_gpu * r.layout.gpus))
    ranks, picks = [], []
    for members in cells.values():
        ok = [(r, e) for r, e in members if r.ran and e is not None]
        rho = spearman([e.tokens_per_s for _, e in ok], [r.tokens_per_s_gpu for r, _ in ok])
        if math.isfinite(rho):
            ranks.append(rho)
        best = max((r.tokens_per_s_gpu for r, _ in members if r.ran), default=0.0)
        chosen = [(r, e) for r, e in members if e is not None and e.fits]
        if best and chosen:
            pick = max(chosen, key=lambda x: x[1].tokens_per_s)[0]
            picks.append(pick.tokens_per_s_gpu / best if pick.ran else 0.0)
    errors = [abs(x - 1) for x in ratios]
    nan = math.nan
    return {"runs": len(runs), "priced": len(ratios), "cells": len(cells),
            "mfu_ratio_median": float(np.median(ratios)) if ratios else nan,
            "mfu_error_median": float(np.median(errors)) if errors else nan,
            "mfu_error_worst": float(max(errors)) if errors else nan,
            **{f"band_p{q}": float(np.percentile(1 / np.array(ratios), q)) if ratios else nan
               for q in (10, 90)},
            "rank_median": float(np.median(ranks)) if ranks else nan,
            "pick_median": float(np.median(picks)) if picks else nan,
            "pick_worst": float(min(picks)) if picks else nan,
            "crash_precision": crash["tp"] / max(1, crash["tp"] + crash["fp"]),
            "crash_recall": crash["tp"] / max(1, crash["tp"] + crash["fn"]),
            "false_crash": crash["fp"] / max(1, crash["fp"] + crash["tn"])}


def residuals_by(runs: list[Run], estimates: list, key) -> dict:
    """Median predicted / measured tokens/s of the runs that ran (``estimates``) by ``key(run)``."""
    groups: dict = {}
    for r, e in ((r, e) for r, e in zip(runs, estimates) if r.ran and e is not None):
        groups.setdefault(key(r), []).append(e.tokens_per_s / r.tokens_per_s_gpu / r.layout.gpus)
    return {k: (len(v), float(np.median(v))) for k, v in sorted(groups.items())}


def peak_share(run: Run, hw: Hardware) -> str:
    """``run``'s measured peak over ``hw``'s device memory, in tenths rounded down."""
    share = run.peak_mem_gib * 2**30 / hw.memory_bytes
    return f"{math.floor(share * 10) / 10:.1f}" if math.isfinite(share) else "not logged"


def fit(runs: list[Run], base: Hardware) -> tuple[Hardware, dict]:
    """Time, then memory; the fitted profile (its ``fitted`` holds the report, so that its
    own reserve and memory margin apply: ``peak.capacity``) and the report,
    {"parameters", "log_sigma_time", "log_sigma_memory"}."""
    hw, time_report, s_time = fit_time(runs, base)
    hw, memory_report, s_mem = fit_memory(runs, hw)
    report = {"parameters": {**time_report, **memory_report}, "log_sigma_time": s_time,
              "log_sigma_memory": s_mem}
    return replace(hw, fitted=dict(report)), report


# --------------------------------------------------------------------------------------
# python -m minipar.plan fit
# --------------------------------------------------------------------------------------
def cross_validate(runs: list[Run], base: Hardware, holdout: str | None = None,
                   kfold: str | None = None) -> list[dict]:
    """Fit without each held-out part and score on it: one fold for ``holdout``
    (``runs.select``'s spec), one per model or node count for ``kfold``."""
    if holdout:
        folds = [(holdout, select(runs, holdout))]
    else:
        key = (lambda r: r.shape.name) if kfold == "model" else (lambda r: r.nodes)
        folds = [(f"{kfold}={v}", [r for r in runs if key(r) == v])
                 for v in sorted({key(r) for r in runs})]
    splits = [(name, held, [r for r in runs if all(r is not h for h in held)])
              for name, held in folds]
    priced = {id(r) for r, e in zip(runs, predictions(runs, base)) if r.ran and e is not None}
    if few := [name for name, _, kept in splits if sum(id(r) in priced for r in kept) < 3]:
        raise PlanError(f"holding out {few[0]} leaves under 3 runs that ran and can be priced")
    out = []
    for name, held, kept in splits:
        hw, report = fit(kept, base)
        out.append({"holdout": name, **score(held, hw), "memory_sigma": hw.memory_sigma,
                    "parameters": {k: v[0] for k, v in report["parameters"].items()}})
    return out


def fold_hardware(profile: Hardware, holdout: str) -> Hardware:
    """The fit without ``holdout``'s runs that ``profile`` recorded, rebuilt from its values."""
    fold = next(f for f in profile.fitted["holdout"] if f["holdout"] == holdout)
    return _with(replace(profile, memory_sigma=fold["memory_sigma"]), fold["parameters"])


def _value(v: float) -> str:
    return f"{v:.3g}" if v is not None and math.isfinite(v) else "-"


STATUS = {"fitted": "", "kept": "not moved by the runs: the base's value kept", "bound":
          "on its bound (its error says nothing)", "undetermined": "its error undetermined (no "
          "more runs than parameters)"}       # what ``_fit`` reports of each parameter


def cmd_fit(args) -> None:
    runs, notes = read_runs(args.runs)
    base = load_hardware(args.hardware)
    target = Path(args.output or ".").resolve()
    if args.output and (target.is_dir() or not os.access(target.parent, os.W_OK)):
        raise PlanError(f"-o {args.output}: a directory, or in a missing or read-only one")
    folds = cross_validate(runs, base, args.holdout, args.kfold) if args.holdout or args.kfold else []
    hw, report = fit(runs, base)              # after the folds, so a bad one stops first
    fitted = {"data": Path(args.runs).name, "sha256": digest(args.runs), "rows": len(runs),
              "base": base.name, **report, "training": score(runs, hw), "holdout": folds,
              "twins": {f"{m}@{n}": list(v) for (m, n), v in twins(runs).items()}}
    where = f"{fitted['data']} (sha256 {fitted['sha256'][:12]}..., {len(runs)} runs)"
    said: dict = {}          # by field: what the fit did to each of its parameters
    for name, (value, error, status) in report["parameters"].items():
        how = f"{value:.4g}" + (f" +- {error:.2g}" if status == "fitted" else f", {STATUS[status]}")
        said.setdefault(name.partition("@")[0], []).append(f"{name} fitted to {where}: {how}")
    sources = {**base.sources, **{key: "; ".join(texts) for key, texts in said.items()}}
    sources["memory_sigma"] = f"fitted to {where}: the memory residuals' robust sd"
    profile = replace(hw, name=args.name or f"{base.name}-fitted", fitted=fitted,
                      sources=sources, description=f"{base.description}; efficiencies "
                      f"fitted to measured runs ({fitted['data']})")
    out = profile.to_dict()
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    rows = [[name, _value(v), _value(e), STATUS[status] or ("poorly determined" if e > abs(v)
                                                             else "")]
            for name, (v, e, status) in report["parameters"].items()]
    lines = [*notes, text_table(rows, ["parameter", "value", "std. error", ""]),
             f"log-residual sd: time {report['log_sigma_time']:.3f}, memory "
             f"{report['log_sigma_memory']:.3f}"]
    estimates = predictions(runs, profile)
    for title, key in (("nodes", lambda r: r.nodes), ("tp", lambda r: r.layout.tp),
                       ("pp", lambda r: r.layout.pp), ("dp", lambda r: r.layout.dp),
                       ("measured peak / device memory", lambda r: peak_share(r, profile))):
        lines.append(f"predicted / measured tokens/s by {title}: " + ", ".join(
            f"{k}: {v:.2f} ({n})" for k, (n, v) in residuals_by(runs, estimates, key).items()))
    if twin := fitted["twins"]:
        spread = ", ".join(f"{c}: {math.exp(x):.2f} ({n})" for c, (n, x) in twin.items())
        lines.append("runs differing only in ZeRO stage 0-2 (priced near alike), measured "
                     f"fastest / slowest, median by cell: {spread}")
    lines.append(scores_table(profile, markdown=False))
    lines += [f"wrote {args.output}"] if args.output else []
    emit(args, out, "\n".join(lines))


def add_fit_parser(sub) -> None:
    p = sub.add_parser("fit", help="fit a hardware profile to measured runs (plan.fit)")
    p.add_argument("runs", help="a runs CSV (python -m minipar.scaling --runs writes one) or "
                                "the Ultra-Scale Playbook grid")
    p.add_argument("--hardware", required=True,
                   help="the base profile: its datasheet peaks and bandwidths are kept")
    p.add_argument("-o", "--output", help="write the fitted profile here (JSON)")
    p.add_argument("--name", help="the fitted profile's name (default: BASE-fitted)")
    one = p.add_mutually_exclusive_group()
    one.add_argument("--holdout", help="score a fit without these runs on them: model=NAME or "
                                       "nodes=N[,N...]")
    one.add_argument("--kfold", choices=["model", "nodes"],
                   help="cross-validate: hold out each model (or node count) in turn")
    p.set_defaults(func=cmd_fit)


def scores_table(hw: Hardware, markdown: bool = True) -> str:
    """The fitted profile's recorded scores: the markdown table docs/reference.md shows, or
    ``plan fit``'s text table."""
    def row(label, f):
        return [label, f"{f['runs']:,}", f"{f['mfu_ratio_median']:.2f}",
                f"{f['mfu_error_median']:.0%} / {f['mfu_error_worst']:.0%}",
                f"{f['band_p10']:.2f}-{f['band_p90']:.2f}x", f"{f['rank_median']:.2f}",
                f"{f['pick_median']:.2f} / {f['pick_worst']:.2f}",
                f"{f['crash_precision']:.2f} / {f['crash_recall']:.2f}", f"{f['false_crash']:.1%}"]
    rows = [row(f"the fitted rows ({hw.fitted['data']})", hw.fitted["training"])]
    rows += [row(f"held out: {f['holdout']}", f) for f in hw.fitted["holdout"]]
    header = ["scored on", "runs", "MFU ratio (median)", "MFU error median / worst",
              "measured / predicted, 10th-90th percentile", "rank (median)",
              "pick median / worst", "crash precision / recall", "ran, predicted to crash"]
    return markdown_table(header, rows) if markdown else text_table(rows, header)
