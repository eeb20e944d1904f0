"""The planner at scale (issue 32): any model (grouped-query attention, model files),
pipeline stages as frameworks cut them, per-stage memory, costs that grow with width, sets
of allowed values in the search, and bad input that ends in one line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from minipar.plan import Layout, PlanError, estimate, load_hardware, model_preset, search
from minipar.plan.shapes import ModelShape, load_model, model_from_dict, training_flops, with_seq_len

# the Ultra-Scale Playbook sweep's "llama-1B" (huggingface/bench_cluster create_configs.py):
# h 2048, F 4096, 32 heads (MHA), 24 layers, GPT-2's vocabulary, tied, sequence 4096
SWEEP_1B = ModelShape("llama-1B", "llama", 24, 2048, 32, 50257, 4096, 4096, tied_head=True,
                      bias=False, global_batch_tokens=1 << 20)


# --------------------------------------------------------------------------------------
# Any model: grouped-query attention, model files
# --------------------------------------------------------------------------------------
def test_llama3_counts_are_the_released_ones():
    assert model_preset("llama3-8b").params == 8_030_261_248
    assert model_preset("llama3-70b").params == 70_553_706_496
    assert model_preset("llama3-405b").params == 405_853_388_800
    assert model_preset("llama-7b").params == 6_738_415_616      # MHA unchanged


def test_gqa_shrinks_k_and_v_everywhere():
    from minipar.plan.compute import layer_gemms
    from minipar.plan.memory import layer_activation_bytes, tp_rank_params
    mha = model_preset("llama-7b")
    gqa = replace(mha, kv_heads=8)                  # K and V 1024 wide instead of 4096
    h = mha.hidden
    assert gqa.kv_hidden == 1024 and replace(mha, kv_heads=32).params == mha.params
    assert mha.layer_params - gqa.layer_params == 2 * h * (h - 1024)
    b, s = 1, mha.seq_len
    dense = training_flops(mha, b) - training_flops(gqa, b)
    assert dense == pytest.approx(3 * mha.layers * 2 * b * s * 2 * h * (h - 1024))
    assert layer_gemms(gqa, 10, 4)[0] == (10, (h + 2 * 1024) // 4, h)
    assert (tp_rank_params(mha, 4)["layer"] - tp_rank_params(gqa, 4)["layer"]
            == 2 * h * (h - 1024) // 4)
    # activations: K and V (2 bytes each, split by t) shrink to h_kv / h
    saved = layer_activation_bytes(mha, 1, 1) - layer_activation_bytes(gqa, 1, 1)
    assert saved == pytest.approx(s * h * 4 * (1 - 1024 / h))
    # the cp ring sends K and V: h_kv wide
    from minipar.plan.cp import ring_step_times
    assert (ring_step_times(gqa, "dgx-h100", 2)["send"] < ring_step_times(mha, "dgx-h100", 2)
            ["send"])


def test_megatron_fused_swiglu_keeps_three_f_wide_tensors():
    """Megatron-LM's fused SwiGLU saves its input (gate and up) and fc2 its own: one F-wide
    16-bit tensor per token fewer than PyTorch's silu and mul keep (frameworks.json)."""
    from minipar.plan.frameworks import load_framework
    from minipar.plan.memory import layer_activation_bytes
    from minipar.plan.peak import device_memory
    shape = model_preset("llama3-8b")
    s, f = shape.seq_len, shape.ffn
    for tp, sp in ((1, False), (4, False), (4, True)):
        saved = (layer_activation_bytes(shape, 2, tp, sp, glu_saved=4)
                 - layer_activation_bytes(shape, 2, tp, sp, glu_saved=3))
        assert saved == pytest.approx(2 * s * f * 2 / tp)        # b s F, 2 bytes
    megatron = load_framework("megatron-lm")
    assert megatron.glu_saved == 3 and load_framework("nanotron").glu_saved == 4
    lay = Layout(tp=4, pp=1, dp=2, micro_batch=1, sp=True, recompute="selective")
    fused = device_memory(shape, lay, flash=True, framework=megatron)
    plain = device_memory(shape, lay, flash=True, framework=replace(megatron, glu_saved=4))
    assert plain["activations"] - fused["activations"] == pytest.approx(
        shape.layers * s * f * 2 / 4)
    assert fused["total"] < plain["total"]
    # the search prunes and reports by the framework's count too
    results = search("llama3-70b", 256, "dgx-h100", framework="megatron-lm", flash=True, top=3)
    assert results
    for e in results:
        assert e.memory["total"] == pytest.approx(device_memory(
            model_preset("llama3-70b"), e.layout, flash=True, framework=megatron)["total"], abs=1)


def test_tp_must_split_whole_key_value_heads():
    from minipar.plan.layout import tp_violation
    assert tp_violation(32, 8, 8) is None and tp_violation(32, 8) is None
    assert "key/value heads" in tp_violation(32, 16, 8)
    with pytest.raises(PlanError, match="key/value heads"):
        estimate(model_preset("llama3-8b"), "dgx-h100", Layout(tp=16, dp=1, micro_batch=1))
    results = search("llama3-8b", 64, "dgx-h100", max_tp=32, top=50)
    assert all(8 % e.layout.tp == 0 for e in results)


def test_model_files_and_their_bad_input(tmp_path):
    good = tmp_path / "m.json"
    good.write_text(json.dumps({"arch": "llama", "layers": 24, "hidden": 2048, "heads": 32,
                                "kv_heads": 8, "ffn_hidden": 4096, "vocab": 50257,
                                "seq_len": 4096, "tied_head": True}))
    shape = load_model(good)
    assert (shape.name, shape.groups, shape.bias, shape.tied_head) == ("m", 8, False, True)
    assert model_preset(str(good)) == shape
    for data, match in (({"arch": "llama", "layers": 2, "hidden": 64, "heads": 8, "vocab": 9},
                         "lacks seq_len"),
                        ({"arch": "gpt", "layers": 2, "hidden": 64, "heads": 8, "vocab": 9,
                          "seq_len": 8, "kv_heads": 3}, "key/value heads do not divide"),
                        ({"arch": "gpt", "layers": 2, "hidden": 64, "heads": 8, "vocab": 9,
                          "seq_len": 8, "experts": 4}, "unknown field"),
                        ([1, 2], "JSON object")):
        with pytest.raises(PlanError, match=match):
            model_from_dict(data)


# --------------------------------------------------------------------------------------
# Pipeline stages as frameworks cut them
# --------------------------------------------------------------------------------------
def test_nanotron_balance_accepts_the_pp_the_playbook_sweep_ran():
    """nanotron's cost rule (bench_cluster's is_enough_layers_for_pp replays it): every pp
    that leaves no stage without a block runs, whether or not it divides the layers."""
    from minipar.plan.stages import split_violation, stages
    runs = [p for p in range(1, 25) if split_violation(SWEEP_1B, p, "balanced") is None]
    assert runs == list(range(1, 25))               # 24 layers + the head's blocks
    st = stages(SWEEP_1B, 5, "balanced")
    assert [x.layers for x in st] == [6, 5, 5, 6, 2] and st[-1].head
    # the head weighs V h / (4 h^2 + 3 F h) = 2.45 layers: the last stage takes fewer layers
    assert sum(x.layers for x in stages(SWEEP_1B, 7, "balanced")) == 24
    # even stages (minipar's trainer) refuse it, with the trainer's wording
    from minipar.plan.layout import pp_violation
    assert pp_violation(24, 5) == ("the model has 24 layers, which do not split into pp=5 "
                                   "equal stages; use a pp that divides 24")
    assert pp_violation(24, 5, uneven=True) is None
    assert "x chunks" in pp_violation(24, 4, chunks=4, uneven=True)   # interleaving stays even
    # a pp the rule cannot build is refused, asked directly too (it was a TypeError)
    from minipar.plan import device_memory
    from minipar.plan.frameworks import load_framework
    wide = ModelShape("1B", "llama", 16, 2048, 32, 131072, 4096, 8192, bias=False)
    with pytest.raises(PlanError, match="without a block"):
        device_memory(wide, Layout(tp=8, pp=16), framework=load_framework("nanotron"))


def test_megatron_and_deepspeed_uneven_stages():
    from minipar.plan.stages import stages
    shape = model_preset("llama-7b")                # 32 layers
    mega = [x.layers for x in stages(shape, 3, "megatron")]
    assert sum(mega) == 32 and mega[1:-1] == mega[1:-1][:1] * len(mega[1:-1])
    assert mega[-1] <= mega[0]                      # the last stage carries the head
    assert [x.layers for x in stages(shape, 4, "megatron")] == [8] * 4   # divides: even
    assert [x.layers for x in stages(shape, 5, "uniform")] == [7, 7, 6, 6, 6]
    with pytest.raises(PlanError, match="equal stages"):
        estimate(shape, "dgx-h100", Layout(pp=3, dp=1, micro_batch=1, microbatches=8))
    e = estimate(shape, "dgx-h100", Layout(pp=3, dp=1, micro_batch=1, microbatches=8),
                 framework="megatron-lm")
    assert e.fits and e.step_time > 0


def test_bubble_and_peak_memory_come_from_the_actual_split():
    from minipar.plan.estimate import stage_time
    from minipar.plan.frameworks import load_framework
    from minipar.plan.peak import stage_memory
    from minipar.plan.stages import stages
    hw, fw = load_hardware("dgx-h100"), load_framework("nanotron")
    lay = Layout(tp=1, pp=5, dp=1, micro_batch=1, microbatches=16)
    e = estimate(SWEEP_1B, hw, lay, framework=fw, flash=True)
    st = stages(SWEEP_1B, 5, "balanced")
    per_mb = [stage_time(SWEEP_1B, hw, lay, x, "tp,dp,pp", "mixed", True, fw)["per_mb"]
              for x in st]
    slow = max(range(5), key=lambda i: per_mb[i])
    assert e.times["stage"] == slow
    assert e.times["bubble"] == pytest.approx(sum(per_mb) - per_mb[slow])
    peaks = [stage_memory(SWEEP_1B, lay, x, True, "mixed", fw)["total"] for x in st]
    assert e.memory["total"] == pytest.approx(max(peaks))
    assert e.memory["stage"] == peaks.index(max(peaks)) == 0      # 1F1B: stage 0 holds 5


# --------------------------------------------------------------------------------------
# Memory that matches measured peaks
# --------------------------------------------------------------------------------------
def test_the_loss_and_sp_buffers_follow_the_framework():
    """Bytes per logit at the loss's peak: Megatron-LM 6, nanotron 8, torch's
    F.cross_entropy on a .float() copy 10, llm-foundry's fused loss 4 (plan.peak; measured on
    one H100 for this issue: 6.0, 8.0 and 10.0 in forward)."""
    from minipar.plan.frameworks import FRAMEWORKS
    assert {n: FRAMEWORKS[n].logit_bytes for n in ("megatron-lm", "nanotron", "fsdp",
                                                   "llm-foundry")} == {
        "megatron-lm": 6, "nanotron": 8, "fsdp": 10, "llm-foundry": 4}


# --------------------------------------------------------------------------------------
# Costs that grow with width
# --------------------------------------------------------------------------------------
def test_data_parallel_time_per_gigabyte_grows_with_the_nodes():
    from minipar.plan.network import collective_time
    hw = load_hardware("dgx-h100")
    per_gb = [collective_time("all_reduce", 1 << 30, 8 * n, 1, hw) / 1.074 for n in
              (2, 8, 32, 64)]
    assert per_gb == sorted(per_gb)
    assert per_gb[2] > 1.7 * per_gb[0]              # half the NICs' rate at 32 nodes


def test_tables_by_node_count_are_read_linear_in_log2_nodes_and_held_beyond():
    from minipar.plan.timing import by_nodes
    rows = [[2, 0.8], [8, 0.2], [32, 0.1]]
    assert by_nodes([], 4, 0.5) == 0.5                       # no rows: the default
    assert by_nodes(rows, 1, 0.5) == by_nodes(rows, 2, 0.5) == 0.8      # held below
    assert by_nodes(rows, 4, 0.5) == pytest.approx(0.5)      # halfway in log2 between 2, 8
    assert by_nodes(rows, 16, 0.5) == pytest.approx(0.15)
    assert by_nodes(rows, 8, 0.5) == 0.2 and by_nodes(rows, 512, 0.5) == 0.1


def test_the_fabric_slows_a_group_by_the_width_of_the_job_it_runs_in():
    """``fabric_efficiency`` is read at the job's width, the group's own when wider: a TP
    group over 2 nodes is slower in a 64-node job than alone, and a group inside a node never
    crosses the fabric."""
    from minipar.plan.network import collective_time
    from minipar.plan.timing import link_bandwidth, network_efficiency
    hw = replace(load_hardware("dgx-h100"), fabric_efficiency=[[2, 1.0], [64, 0.25]])
    nics = hw.inter_node_bandwidth * network_efficiency(2, hw)   # a node's, at 2 nodes
    alone = link_bandwidth(8, 2, 1, hw)                # the group's own width: 2 nodes, 1.0
    assert link_bandwidth(8, 2, 1, hw, 64) == pytest.approx(0.25 * nics)
    assert link_bandwidth(8, 2, 1, hw, 8) == pytest.approx(   # 2/5 of the way in log2 to 64
        min(alone, (1 - 0.75 * 2 / 5) * nics))
    times = [collective_time("all_reduce", 1 << 36, 16, 1, hw, job) for job in (0, 64)]
    assert times[1] / times[0] == pytest.approx(alone / (0.25 * nics), rel=1e-3)
    inside = [collective_time("all_reduce", 1 << 30, 8, 1, hw, job) for job in (0, 64)]
    assert inside[0] == inside[1]


def test_all_gather_and_reduce_scatter_run_at_their_share_of_the_all_reduce_s_rate():
    """A ring all-gather's (reduce-scatter's) bytes take 1/share as long; the all-reduce,
    the latency terms and point-to-point sends do not change."""
    from minipar.plan.network import collective_time
    from minipar.plan.timing import p2p_time, ring_bytes
    hw = replace(load_hardware("dgx-h100"), tree=None)
    slow = replace(hw, all_gather_efficiency=0.5, reduce_scatter_efficiency=0.8)
    for op, share in (("all_gather", 0.5), ("reduce_scatter", 0.8), ("all_reduce", 1.0)):
        base = collective_time(op, 0, 16, 1, hw)                 # latency alone
        bytes_time = collective_time(op, 1 << 30, 16, 1, hw) - base
        assert bytes_time > 0 and ring_bytes(op, 1 << 30, 16) > 0
        assert collective_time(op, 1 << 30, 16, 1, slow) - base == pytest.approx(
            bytes_time / share, rel=1e-9)
    assert p2p_time(1 << 20, True, slow) == p2p_time(1 << 20, True, hw)


def test_hidden_traffic_slows_compute_by_the_measured_contention():
    lay = Layout(dp=64, micro_batch=2, microbatches=1, shard=(64, 64, 64))
    hw = load_hardware("dgx-h100")
    shape = model_preset("llama-7b")
    slowed = estimate(shape, hw, lay, framework="fsdp")
    free = estimate(shape, replace(hw, overlap_slowdown=0.0), lay, framework="fsdp")
    assert hw.overlap_slowdown == 0.189 and "2507.03114" in hw.sources["overlap_slowdown"]
    assert slowed.times["compute"] - free.times["compute"] == pytest.approx(
        0.189 * slowed.times["dp_hidden"], rel=1e-6)


# --------------------------------------------------------------------------------------
# The framework check runs whatever cp is; sets of allowed values
# --------------------------------------------------------------------------------------
def test_framework_is_checked_without_cp_too():
    lay = Layout(dp=8, micro_batch=1, shard=(1, 1, 8))           # ZeRO-1
    with pytest.raises(PlanError, match="fsdp does not run shard spec"):
        estimate(model_preset("llama-7b"), "dgx-h100", lay, framework="fsdp")
    assert estimate(model_preset("llama-7b"), "dgx-h100", lay, framework="megatron-lm")


def test_search_takes_sets_of_allowed_values():
    res = search("llama-7b", 64, "dgx-h100", tp=(1, 2), zero=(0, 1), recompute=("none", "full"),
                 framework="megatron-lm", top=30)
    assert {e.layout.tp for e in res} <= {1, 2}
    assert all(e.layout.shard in ((1, 1, 1), (1, 1, e.layout.replicas)) for e in res)
    assert {e.layout.recompute for e in res} <= {"none", "full"}
    with pytest.raises(PlanError, match="empty"):
        search("llama-7b", 64, "dgx-h100", tp=())
    with pytest.raises(PlanError, match="does not divide"):
        search("llama3-8b", 64, "dgx-h100", tp=16)                   # a single value: why


@pytest.mark.parametrize("args,match", [
    (["params", "--model", "MISSING.json"], "cannot read model file"),
    (["search", "--model", "llama-7b", "--gpus", "8", "--hardware", "dgx-h100", "--tp", ","],
     "empty"),
    (["params", "--layers", "2", "--hidden", "64", "--heads", "8", "--kv-heads", "3",
      "--vocab", "9", "--seq-len", "8"], "key/value heads do not divide"),
    (["estimate", "--layers", "2", "--hidden", "64", "--vocab", "9", "--seq-len", "8",
      "--hardware", "dgx-h100", "--gpus", "1"], "missing --heads"),
])
def test_bad_model_input_exits_2_with_one_line(args, match):
    r = subprocess.run([sys.executable, "-m", "minipar.plan", *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and match in r.stderr, r.stderr


def test_cli_model_file_and_shape_flags(tmp_path):
    good = tmp_path / "one.json"
    good.write_text(json.dumps({"arch": "llama", "layers": 24, "hidden": 2048, "heads": 32,
                                "ffn_hidden": 4096, "vocab": 50257, "seq_len": 4096,
                                "tied_head": True, "global_batch_tokens": 1 << 20}))
    r = subprocess.run([sys.executable, "-m", "minipar.plan", "search", "--model", str(good),
                        "--gpus", "40", "--hardware", "dgx-h100", "--framework", "nanotron",
                        "--pp", "5", "--tp", "1,2", "--json", "--top", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert all(e["pp"] == 5 and e["tp"] in (1, 2) for e in out)
    r = subprocess.run([sys.executable, "-m", "minipar.plan", "params", "--model", "llama-7b",
                        "--kv-heads", "8", "--json"], capture_output=True, text=True,
                       timeout=60)
    assert json.loads(r.stdout)["params"] == replace(model_preset("llama-7b"), kv_heads=8).params


# --------------------------------------------------------------------------------------
# The published picks the issue names stay, or get closer
# --------------------------------------------------------------------------------------
def test_amsp_picks_move_towards_its_small_groups_and_frontier_stays_close():
    from minipar.plan import published
    minipar = published.amsp_rows()
    amsp = published.amsp_rows(framework="amsp")
    # before issue 32: (128,128,512) and (256,256,512); AMSP's engine (64,64,64)/(128,...)
    assert all(r["spec"][0] <= 64 for r in minipar)
    assert all(r["spec"][0] <= 32 for r in amsp)
    frontier = {r["case"]: r["error"] for r in published.points() if "Frontier" in r["case"]
                and r["error"] is not None}
    assert len(frontier) == 2 and all(-0.21 < x < 0 for x in frontier.values())


# --------------------------------------------------------------------------------------
# Bounded work, and bad input refused in one line before any (review findings)
# --------------------------------------------------------------------------------------
def _plan(capsys, *args):
    from minipar.plan.__main__ import main
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _refused(capsys, words, *args):
    code, out, err = _plan(capsys, *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and words in err, (code, err)
    return err


def test_divisors_are_every_divisor_in_order():
    from minipar.rules import divisors
    for n in range(0, 1500):
        assert divisors(n) == [k for k in range(1, n + 1) if n % k == 0]
    assert divisors(2**40) == [2**k for k in range(41)]
    assert divisors(720720)[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert len(divisors(720720)) == 240            # 2^4 3^2 5 7 11 13: 5 x 3 x 2 x 2 x 2 x 2


@pytest.mark.timeout(30)
def test_searches_that_hung_finish_or_refuse_in_one_line(capsys):
    # a trillion devices: refused before any work
    _refused(capsys, "--gpus must be from 1 to 1,048,576", "search", "--model", "gpt-175b",
             "--gpus", 2**40, "--hardware", "dgx-a100")
    # a billion micro-batches per replica: only micro-batch sizes up to 16 are tried
    _refused(capsys, "nothing fits", "search", "--model", "gpt-175b", "--gpus", 8,
             "--global-batch-tokens", "2048e9", "--hardware", "dgx-a100")
    from minipar.plan.search import _schedules
    sizes = {b for b, _, _ in _schedules(model_preset("gpt-175b"), 1, 10**9, None, (1,), 1, 16)}
    assert sizes == {1, 2, 4, 5, 8, 10, 16}       # the divisors of 10^9 up to 16


@pytest.mark.timeout(30)
def test_a_huge_range_is_refused_in_one_line(capsys):
    _refused(capsys, "more than the 4,096 values", "search", "--model", "gpt-175b", "--gpus",
             1024, "--hardware", "dgx-a100", "--tp", "1-100000000")
    _refused(capsys, "more than the 4,096 values", "search", "--model", "gpt-175b", "--gpus",
             1024, "--hardware", "dgx-a100", "--pp", "1-3000,5000-8000")
    from minipar.plan.arguments import int_set
    assert int_set("--tp")("1-4096") == tuple(range(1, 4097))


@pytest.mark.parametrize("field, rows, words", [
    ("inter_node_efficiency", [[2]], "is a pair [nodes, fraction]"),
    ("inter_node_efficiency", [2, 0.9], "is a pair [nodes, fraction]"),
    ("inter_node_efficiency", [[2, 0.9], [2, 0.8]], "strictly increasing nodes"),
    ("inter_node_efficiency", [[4, 0.9], [2, 0.95]], "strictly increasing nodes"),
    ("inter_node_efficiency", [[2, "0.9"]], "fraction must be finite"),
    ("inter_node_efficiency", {"2": 0.9}, "must be a list"),
    ("p2p_latency", 0.01, "one number: a profile from an older minipar; fit it again"),
    ("all_gather_efficiency", 1.5, "all_gather_efficiency is a fraction, at most 1"),
    ("bandwidth_by_size", [[4096, 0.5, 1]], "is a pair [bytes, factor]"),
    ("bandwidth_by_size", [[8192, 0.5], [4096, 0.4]], "strictly increasing bytes"),
    ("local_links", [[2, 1e11]], "must be a list of objects"),
    ("matmul_table", [1], "must be a list of objects"),
])
def test_malformed_hardware_tables_are_refused_in_one_line(tmp_path, capsys, field, rows,
                                                          words):
    from minipar.plan.hardware import PRESET_DIR
    data = json.loads((PRESET_DIR / "dgx-a100.json").read_text())
    data[field] = rows
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=re.escape(words)):
        load_hardware(path)
    _refused(capsys, words, "estimate", "--model", "llama-7b", "--gpus", 8, "--hardware", path)


@pytest.mark.timeout(30)
def test_megatron_first_and_last_stages_are_the_exhaustive_best():
    """``stages._megatron`` tries a few last-stage counts per first-stage count; every pair,
    tried here by brute force with the same objective (the slowest stage, the head counted
    in layers, ties to a lighter first stage, then a lighter last), picks the same split, and
    interleaved by v, the same split of multiples of v (Megatron-LM's rule), or none."""
    from minipar.plan.stages import _megatron, head_cost, layer_cost

    def exhaustive(shape, pp, v=1):
        l, head = shape.layers, head_cost(shape) / layer_cost(shape)
        best = None
        for first in range(v, l, v):
            for last in range(v, l - first + 1, v):
                rest = l - first - last
                if (pp == 2 and rest) or (pp > 2 and (rest < v * (pp - 2) or rest % (pp - 2)
                                                      or rest // (pp - 2) % v)):
                    continue
                mid = [rest // (pp - 2)] * (pp - 2) if pp > 2 else []
                key = (max([first, *mid, last + head]), first, last)
                if best is None or key < best[0]:
                    best = (key, (first, *mid, last))
        return None if best is None else best[1]

    for v in (2, 3, 4):
        for layers in range(4, 50):
            shape = replace(model_preset("llama-7b"), layers=layers)
            for pp in range(2, min(layers // v, 9) + 1):
                assert _megatron(shape, pp, v) == exhaustive(shape, pp, v), (layers, pp, v)

    for name, vocab in (("llama-7b", None), ("gpt-175b", None), ("llama-7b", 256_000),
                        ("llama3-8b", 1_000_000)):
        base = model_preset(name)
        base = base if vocab is None else replace(base, vocab=vocab)
        for layers in (*range(3, 30), 61, 97):
            shape = replace(base, layers=layers)
            for pp in range(2, min(layers, 9) + 1):
                assert _megatron(shape, pp) == exhaustive(shape, pp), (name, layers, pp)
    t0 = time.perf_counter()
    split = _megatron(replace(model_preset("gpt-175b"), layers=20001), 7)
    assert sum(split) == 20001 and time.perf_counter() - t0 < 5


def test_megatron_interleaves_uneven_stages_as_megatron_lm_runs_them():
    """Megatron-LM interleaves v chunks on uneven stages where the first, the last and each
    middle stage hold a multiple of v layers (its TransformerConfig checks); each stage's v
    chunks are equal, so the bubble and the activations come from that stage's chunk size."""
    from minipar.plan.estimate import stage_time
    from minipar.plan.frameworks import load_framework
    from minipar.plan.peak import in_flight, stage_memory
    from minipar.plan.stages import split_violation, stages
    from minipar.plan.anchors import all_rows
    shape = next(r["shape"] for r in all_rows() if r["shape"].name == "gpt-119b")
    assert shape.layers == 92                               # 92 layers: pp 4 gives 23 each
    assert [x.layers for x in stages(shape, 4, "megatron", 4)] == [24, 24, 24, 20]
    assert [x.layers for x in stages(shape, 4, "megatron", 2)] == [22, 24, 24, 22]
    assert "multiple of chunks=3" in split_violation(shape, 4, "megatron", 3)
    assert "equal stages" in split_violation(shape, 4, "even", 2)   # minipar's trainer refuses
    hw, fw = load_hardware("dgx-h100"), load_framework("megatron-lm")
    lay = Layout(tp=8, pp=4, dp=48, micro_batch=1, microbatches=16, v=4, sp=True,
                 shard=(1, 1, 48))
    e = estimate(shape, hw, lay, framework=fw, flash=True)
    st = stages(shape, 4, "megatron", 4)
    # the user reads the split off (Megatron-LM's --decoder-first/last-pipeline-num-layers)
    assert e.stages == (24, 24, 24, 20) and e.to_json()["stages"] == [24, 24, 24, 20]
    from minipar.plan.search import explain
    assert "  layers per pipeline stage, first to last: 24 x 3, 20\n" in explain(e)
    even = estimate(shape, hw, replace(lay, v=1, pp=2, dp=96, shard=(1, 1, 96)), framework=fw,
                    flash=True)
    assert even.stages == (46, 46) and "layers per pipeline stage" not in explain(even)
    per_mb = [stage_time(shape, hw, lay, x, fw.order, "mixed", True, fw)["per_mb"] for x in st]
    assert e.times["bubble"] == pytest.approx((sum(per_mb) - max(per_mb)) / 4)
    peaks = [stage_memory(shape, lay, x, True, "mixed", fw) for x in st]
    assert e.memory["total"] == pytest.approx(max(p["total"] for p in peaks))
    # the last stage's chunks are 5 layers, the others' 6: in flight as its own chunk size
    assert in_flight(st[3], 4, 16, 4) == 5 * min(16 * 4, 2 * 0 + 3 * 4 + 1)
    # the search interleaves it (before: v = 1 only, since 4 x v does not divide 92)
    best = search(shape, 1536, hw, tp=8, pp=4, framework=fw, flash=True,
                  global_batch_tokens=768 * 4096, top=1)[0]
    assert best.layout.v > 1, best.layout.describe()


def test_chunks_without_the_interleaved_schedule_are_refused():
    with pytest.raises(PlanError, match="needs --schedule interleaved, not 1f1b"):
        search("gpt-175b", 1024, "dgx-a100", v=4, schedule="1f1b")
    with pytest.raises(PlanError, match="needs --schedule interleaved, not gpipe"):
        search("gpt-175b", 1024, "dgx-a100", v=4, schedule="gpipe")
    # a set that allows 1 keeps 1 under 1f1b: v = 1 for all, as asked
    res = search("gpt-175b", 1024, "dgx-a100", v=(1, 4), schedule="1f1b", top=3)
    assert {e.layout.v for e in res} == {1}
    with pytest.raises(PlanError, match="interleaved needs --chunks of 2 or more"):
        search("gpt-175b", 1024, "dgx-a100", v=1, schedule="interleaved")
    res = search("gpt-175b", 1024, "dgx-a100", v=(1, 4), schedule="interleaved", top=3)
    assert {e.layout.v for e in res} == {4}


def test_default_sequence_parallelism_prices_a_tp_it_cannot_cut_without_it(capsys):
    """--sp by default is the framework's: on where it cuts the sequence, and a tp that does
    not divide it is priced without SP, not dropped; asked for, it refuses that tp."""
    shape = with_seq_len(model_preset("gpt-175b"), 2047)
    best = search(shape, 1024, "dgx-a100", global_batch_tokens=1536 * 2047, top=1)[0]
    assert best.layout.tp > 1 and not best.layout.sp
    even = search("gpt-175b", 1024, "dgx-a100", top=1)[0]
    assert even.layout.tp > 1 and even.layout.sp
    with pytest.raises(PlanError, match="or drop --sp"):
        search(shape, 1024, "dgx-a100", global_batch_tokens=1536 * 2047, tp=8, sp=True)


def test_estimate_refuses_a_global_batch_its_micro_batches_contradict(capsys):
    common = ("estimate", "--model", "llama-7b", "--tp", 8, "--gpus", 8, "--hardware",
              "dgx-a100")
    _refused(capsys, "--global-batch 4 disagrees with --microbatches 3", *common,
             "--microbatches", 3, "--global-batch", 4)
    code, out, err = _plan(capsys, *common, "--microbatches", 4, "--global-batch", 4, "--json")
    assert code == 0 and json.loads(out)["microbatches"] == 4      # dp 1 x b 1 x m 4 = 4


def test_estimate_of_a_shape_without_a_batch_asks_for_one(capsys):
    _refused(capsys, "model custom has no default batch; give --global-batch or "
             "--microbatches", "estimate", "--layers", 2, "--hidden", 64, "--heads", 4,
             "--vocab", 100, "--seq-len", 16, "--gpus", 1, "--hardware", "dgx-a100")
    _refused(capsys, "model custom has no default batch; give --batch or "
             "--global-batch-tokens", "flops", "--layers", 2, "--hidden", 64, "--heads", 4,
             "--vocab", 100, "--seq-len", 16)      # was a batch of 1, said nowhere


@pytest.mark.parametrize("args, words", [
    (("--model", "gpt-175b", "--gpus", 5, "--pp", 5), "96 layers, which do not split into pp=5"),
    (("--model", "llama3-8b", "--gpus", 16, "--tp", 16), "does not divide the 8 key/value heads"),
    (("--model", "llama-7b", "--gpus", 8, "--tp", 8, "--ffn-hidden", 11007),
     "does not divide the MLP width 11007"),
    (("--model", "llama-7b", "--gpus", 24, "--cp", 3), "not divisible by 6"),
])
def test_memory_refuses_the_layouts_estimate_refuses(capsys, args, words):
    _refused(capsys, words, "memory", *args)
    _refused(capsys, words, "estimate", *args, "--hardware", "dgx-a100")


def test_the_planner_asks_the_trainers_tp_questions(capsys):
    """The trainer passes the hidden and MLP widths and, with --sp, the sequence to
    ``rules.tp_violation`` (minipar.train.config); so does the planner, in estimate and
    search alike."""
    common = ("--model", "llama-7b", "--tp", 8, "--gpus", 8, "--hardware", "dgx-a100")
    for extra, words in ((("--ffn-hidden", 11007), "does not divide the MLP width 11007"),
                         (("--seq-len", 2047, "--sp"), "sequence length 2047 is not divisible "
                                                       "by 8")):
        _refused(capsys, words, "estimate", *common, "--global-batch", 8, *extra)
        _refused(capsys, words, "search", *common, *extra)
    # the released shapes still split as their frameworks split them: LLaMA's F = 11008 =
    # 2^8 x 43, LLaMA 3's 14336 = 2^11 x 7, each over tp 8
    for name in ("llama-7b", "llama3-8b", "llama3-70b", "gpt-175b"):
        e = estimate(model_preset(name), "dgx-h100",
                     Layout(tp=8, pp=1, dp=1, micro_batch=1, microbatches=1, sp=True),
                     check=True)
        assert e.step_time > 0


@pytest.mark.parametrize("kwargs, words", [
    (dict(tp=(3, 5)), "tp=3 does not divide the 1024 GPUs"),
    (dict(shard="3,3,3"), "shard factor 3 does not divide dp="),
    (dict(framework="megatron-lm", zero=3), "megatron-lm does not run ZeRO-3"),
    (dict(cp=4, max_cp=2), "cp=4 is above --max-cp 2"),
    (dict(v=2, pp=1), "interleaved needs --pp > 1"),
])
def test_an_empty_search_says_what_stood_in_the_way(kwargs, words):
    """Not the batch (1,536 sequences, which 1,024 data-parallel ranks do not divide: the
    first layout tried) but what refused the candidates that got furthest."""
    with pytest.raises(PlanError, match=re.escape(words)) as e:
        search("gpt-175b", 1024, "dgx-a100", **kwargs)
    assert "divide the batch" not in str(e.value)


def test_validate_needs_a_step_after_the_warm_up():
    r = subprocess.run([sys.executable, "-m", "minipar.bench", "validate", "--steps", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--steps" in r.stderr, r.stderr
