"""The planner held to what its numbers stand for: CPU cores shared by processes,
hardware files checked, collective tables that never extrapolate silently, engines charged
call by call, and the memory reserve against layouts that public runs executed."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from minipar.plan import Layout, estimate, load_hardware, model_preset, scaling
from minipar.plan.errors import PlanError
from minipar.plan.hardware import hardware_from_dict


# --------------------------------------------------------------------------------------
# Cores: processes that outnumber them are time-sliced (issue: 4 processes on 2 cores)
# --------------------------------------------------------------------------------------
def test_processes_beyond_the_cores_slow_the_prediction_and_say_so():
    hw = replace(load_hardware("laptop-cpu"), cores=2, fitted={"data": "stands for a fit"})
    shape = model_preset("tiny")
    per_process = {}
    for dp in (1, 2, 4):
        e = estimate(shape, hw, Layout(dp=dp, micro_batch=16 // dp), check=False, dtype="fp32")
        per_process[dp] = (e.tokens_per_s / dp, e.notes[1:], e.times["compute"])   # [0]: fit
    assert per_process[1][1] == per_process[2][1] == []            # a core each: no note
    assert per_process[4][1] == ["4 processes share 2 cores: compute predicted 2x slower "
                                 "per process (time-sliced)"]
    # the same work per process (weak: micro-batch 16/dp, so compare at equal tokens)
    one_core = replace(hw, cores=0)
    e4 = estimate(shape, one_core, Layout(dp=4, micro_batch=4), check=False, dtype="fp32")
    assert per_process[4][2] == pytest.approx(2 * e4.times["compute"])
    # weak-scaling efficiency at 4 processes on 2 cores falls to about half, not ~98%
    rows = scaling(shape, hw, Layout(dp=1, micro_batch=16), gpus=[1, 2, 4], dtype="fp32")
    eff = {r["gpus"]: r["efficiency"] for r in rows}
    assert eff[4] < 0.55 and eff[2] > 0.8


def test_laptop_preset_knows_this_machines_cores():
    import os
    hw = load_hardware("laptop-cpu")
    assert hw.cores == len(os.sched_getaffinity(0))
    assert "cores" in hw.sources
    assert replace(hw, cores=0).oversubscription(64) == 1.0       # GPUs: an engine each
    assert replace(hw, cores=4, gpus_per_node=4).oversubscription(16) == 1.0   # 4 a node


# --------------------------------------------------------------------------------------
# Hardware files: every number finite and positive
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("intra_node_latency", float("nan")), ("inter_node_latency", -1e-6),
    ("intra_node_latency", 0.0), ("inter_node_bandwidth", 0.0),
    ("peak_flops", float("inf")), ("peak_flops", -1.0), ("collective_latency", -1e-6),
    ("hbm_bandwidth", float("nan")), ("compute_efficiency", 1.5),
    ("tree", {"base_latency": 0, "intra_latency": 0, "inter_latency": 1e-5,
              "bandwidth_factor": 0.9}),
    ("local_links", [{"devices": 2, "bandwidth": 0}]),
    ("collective_table", [{"op": "all_gather", "bytes": 1e6, "per_node": 8, "nodes": 2,
                           "seconds": float("nan")}]),
])
def test_hardware_numbers_must_be_finite_and_positive(field, value):
    data = json.loads(json.dumps(load_hardware("dgx-a100").to_dict()))
    data[field] = value
    with pytest.raises(PlanError, match=field.split("_")[0]):
        hardware_from_dict(data)


def test_every_preset_loads():
    from minipar.plan import hardware_presets
    for name in hardware_presets():
        hw = load_hardware(name)
        assert hw.peak_flops > 0 and math.isfinite(hw.peak_flops)


# --------------------------------------------------------------------------------------
# The memory reserve: measured for a profile; layouts public runs executed must fit
# --------------------------------------------------------------------------------------
def test_layouts_that_public_runs_executed_fit():
    from minipar.plan.published import executed_runs
    runs = executed_runs()
    assert len(runs) == 3 and all(r["source"] for r in runs)
    for r in runs:
        e = estimate(r["shape"], r["hardware"], r["layout"], framework=r["framework"],
                     flash=r["flash"])
        assert e.fits, (r["name"], e.memory["total"] / 2**30, e.capacity / 2**30)
        # the fixed 30% margin of before rejected each of them: the test can fail
        old = estimate(r["shape"], r["hardware"], r["layout"], framework=r["framework"],
                       flash=r["flash"], reserve=0.3)
        assert not old.fits, r["name"]


def test_the_reserve_is_the_frameworks_measured_one_unless_given():
    from minipar.plan.frameworks import CACHING_ALLOCATOR_RESERVE, FRAMEWORKS
    hw = load_hardware("dgx-a100")
    shape, lay = model_preset("llama-7b"), Layout(dp=8, micro_batch=1, shard=(8, 8, 8))
    e = estimate(shape, hw, lay, framework="fsdp")
    assert e.capacity == pytest.approx((hw.memory_bytes - hw.runtime_bytes)
                                       * (1 - CACHING_ALLOCATOR_RESERVE))
    assert estimate(shape, hw, lay, framework="fsdp", reserve=0.0).capacity == pytest.approx(
        hw.memory_bytes - hw.runtime_bytes)
    assert FRAMEWORKS["minipar"].memory_reserve is None          # then the hardware's
    assert estimate(shape, hw, lay).capacity == pytest.approx(hw.usable_bytes())
    for name in ("dgx-a100", "dgx-h100", "a800-ib", "frontier-mi250x"):
        assert "GMLake" in load_hardware(name).sources["fragmentation"]


# --------------------------------------------------------------------------------------
# Collective tables: interpolated between node counts, never extrapolated silently
# --------------------------------------------------------------------------------------
def _table_hw():
    hw = load_hardware("a800-ib")
    rows = [{"op": "all_gather", "bytes": 1 << 24, "per_node": 8, "nodes": n, "seconds": t}
            for n, t in ((2, 1e-3), (8, 4e-3))]
    return hw, replace(hw, collective_table=rows)


def test_table_interpolates_between_node_counts_and_refuses_beyond():
    from minipar.plan.network import collective_time, coverage
    hw, table = _table_hw()
    n = 1 << 24
    assert collective_time("all_gather", n, 16, 1, table) == pytest.approx(1e-3)    # 2 nodes
    # 4 nodes: halfway between 2 and 8 in log2(nodes)
    assert collective_time("all_gather", n, 32, 1, table) == pytest.approx(2.5e-3)
    assert coverage("all_gather", 32, 1, table) is None
    # 16 nodes: beyond the widest row, so the alpha-beta model, never faster than the widest
    # row measured (widening a group never makes a byte cheaper), and flagged
    assert collective_time("all_gather", n, 128, 1, table) == pytest.approx(
        max(collective_time("all_gather", n, 128, 1, hw), 4e-3))
    assert coverage("all_gather", 128, 1, table) == (
        "all_gather over 128 ranks (16 nodes): measured only over 16-64 ranks")
    # no table: a group inside one node is NCCL's intra-node model, one across nodes flagged
    assert coverage("all_gather", 8, 1, hw) is None
    assert "no measured table" in coverage("reduce_scatter", 16, 1, hw)


def test_search_output_flags_groups_wider_than_the_table():
    from minipar.plan import search
    _, table = _table_hw()
    best = search("llama-7b", 1024, table, tp=1, pp=1, shard=(1, 8, 8), top=1)[0]
    js = best.to_json()
    assert sorted(js["unvalidated"]) == [    # below the table's node counts too: no guess
        "all_gather over 8 ranks (1 node): measured only over 16-64 ranks",
        "all_reduce over 128 ranks (128 nodes): no measured table"]
    assert {"tp", "pp", "dp", "micro_batch", "microbatches", "shard", "recompute",
            "memory_bytes", "step_time_s", "mfu"} <= set(js)
    inside = search("llama-7b", 32, table, tp=1, pp=1, top=1, shard=(32, 32, 32),
                    global_batch_tokens=32 * 2048)[0]
    assert [u for u in inside.unvalidated if u.startswith("all_gather")] == []   # 4 nodes


# --------------------------------------------------------------------------------------
# Engines charged as they issue calls: DeepSpeed ZeRO-3 and AMSP gather module by module
# --------------------------------------------------------------------------------------
def test_zero3_engines_gather_per_module_and_pay_each_latency():
    from minipar.plan.estimate import dp_collectives
    shape = model_preset("llama-7b")
    lay = Layout(dp=64, micro_batch=1, microbatches=1, shard=(64, 64, 64))
    gathers = {fw: next(c for c in dp_collectives(shape, lay, fw, "mixed")
                        if c.kind == "gather").calls
               for fw in ("fsdp", "deepspeed-zero3", "amsp")}
    assert gathers == {"fsdp": 32 + 2, "deepspeed-zero3": 32 * 9 + 2, "amsp": 32 * 9 + 2}
    gpt = model_preset("gpt-22b")
    c = next(c for c in dp_collectives(gpt, lay, "deepspeed-zero3", "mixed") if c.kind == "gather")
    assert c.calls == gpt.layers * 6 + 2
    # the same bytes in more calls: slower by the extra calls' latency
    fsdp = estimate(shape, "a800-ib", lay, framework="fsdp", overlap=0.0)
    ds = estimate(shape, "a800-ib", lay, framework="deepspeed-zero3", overlap=0.0)
    assert ds.times["dp_calls"] > fsdp.times["dp_calls"]
    assert ds.times["dp_comm"] > fsdp.times["dp_comm"]


def test_docs_table_of_published_points_is_the_codes():
    from pathlib import Path
    from minipar.plan.published import points, points_table
    rows = points()
    doc = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    assert points_table(rows) in doc
    # like for like: no prediction without the authors' layout, the metric they reported
    for r in rows:
        assert (r["predicted"] is None) == r["layout_source"].startswith("not found") or \
            "unverified" in r["layout_source"]
        assert r["metric"] in ("MFU", "HFU") and r["source"]


# --------------------------------------------------------------------------------------
# Presets from what they stand for: measured collective rows, derived efficiencies
# --------------------------------------------------------------------------------------
def test_shipped_collective_tables_are_cited_and_never_extrapolate():
    from minipar.plan.network import collective_time, coverage
    for name, widest in (("frontier-mi250x", 256), ("a800-ib", 3)):
        hw = load_hardware(name)
        assert hw.collective_table and "not found" in hw.sources["collective_table"].lower()
        assert max(r["nodes"] for r in hw.collective_table) == widest
        model = replace(hw, collective_table=None)
        # a measured row is read off as measured, not modelled
        r = max(hw.collective_table, key=lambda r: (r["nodes"], r["bytes"]))
        t = collective_time(r["op"], r["bytes"], r["per_node"] * r["nodes"], 1, hw)
        assert t == pytest.approx(r["seconds"])
        assert t != pytest.approx(collective_time(r["op"], r["bytes"],
                                                  r["per_node"] * r["nodes"], 1, model))
        # beyond the widest row: the alpha-beta model, no faster than the widest row, flagged
        wide = 8 * widest * 2
        floor = collective_time("all_reduce", 1 << 28, 8 * widest, 1, hw)
        assert collective_time("all_reduce", 1 << 28, wide, 1, hw) == pytest.approx(
            max(floor, collective_time("all_reduce", 1 << 28, wide, 1, model)))
        assert coverage("all_reduce", wide, 1, hw).endswith(
            f"measured only over 8-{8 * widest} ranks")
    # a800-ib: no reduce-scatter was found: flagged across nodes, the intra-node model inside one
    assert "no measured table" in coverage("reduce_scatter", 16, 1, hw)
    assert coverage("reduce_scatter", 8, 1, hw) is None
    # frontier-mi250x: reduce-scatter measured over 1-128 nodes, all-gather over 1-64
    hw = load_hardware("frontier-mi250x")
    for op, widest in (("reduce_scatter", 128), ("all_gather", 64)):
        assert coverage(op, 8 * widest, 1, hw, 1 << 30) is None
        assert coverage(op, 8 * widest * 2, 1, hw, 1 << 30).endswith(
            f"measured only over 8-{8 * widest} ranks")
        assert coverage(op, 16, 1, hw, 1 << 20) == (f"{op} of 1 MiB over 16 ranks (2 nodes): "
                                                    "measured only from 2 MiB")


def test_frontier_all_reduce_between_measured_node_counts_is_interpolated():
    from minipar.plan.network import collective_time, coverage
    hw = load_hardware("frontier-mi250x")
    n = 1 << 30
    t64, t256 = (collective_time("all_reduce", n, 8 * k, 1, hw) for k in (64, 256))
    assert (t64, t256) == (pytest.approx(39.133494e-3), pytest.approx(41.870461e-3))
    t128 = collective_time("all_reduce", n, 8 * 128, 1, hw)       # halfway in log2(nodes)
    assert t128 == pytest.approx((t64 + t256) / 2)
    # below the sizes measured there (64 MiB): the model, and said so
    model = replace(hw, collective_table=None)
    assert (collective_time("all_reduce", 1 << 20, 8 * 128, 1, hw)
            == collective_time("all_reduce", 1 << 20, 8 * 128, 1, model))
    assert coverage("all_reduce", 8 * 128, 1, hw, 1 << 20) == (
        "all_reduce of 1 MiB over 1024 ranks (128 nodes): measured only from 64 MiB")
    assert coverage("all_reduce", 8 * 128, 1, hw, 1 << 30) is None
    # an estimate names such calls, the loss's small all-reduce over a TP group of 8 too
    e = estimate(model_preset("gpt-22b"), hw, Layout(tp=8, pp=1, dp=8, micro_batch=1),
                 framework="megatron-deepspeed", check=False)
    assert "all_reduce of 8 KiB over 8 ranks (1 node): measured only from 1 MiB" in e.unvalidated


def test_docs_show_each_shipped_row_against_the_model_it_replaces():
    from pathlib import Path
    from minipar.plan.published import table_vs_model, table_vs_model_table
    rows = table_vs_model()
    shipped = {(n, r["op"], r["per_node"], r["nodes"])
               for n in ("frontier-mi250x", "a800-ib")
               for r in load_hardware(n).collective_table}
    assert {(r["hardware"], r["op"], r["per_node"], r["nodes"]) for r in rows} == shipped
    assert all(0 < r["ratio"][0] <= r["ratio"][1] for r in rows)
    doc = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    assert table_vs_model_table(rows) in doc
