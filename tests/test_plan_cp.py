"""The planner learns context parallelism: ``Layout(cp=...)`` in memory, time, search and the
command line (no processes; torch only to read the trainer's mesh).

What the trainer measures is held against the same numbers elsewhere: the ring's bytes
(tests/test_cp_train.py compares every rank's measured sends with ``estimate(...).cp_bytes``)
and one rank's activations (measured with ``saved_tensors_hooks``, same file)."""
import dataclasses
import json

import pytest

from minipar.plan import (Layout, PlanError, check_layout, estimate, load_hardware,
                          model_preset, search)
from minipar.plan.__main__ import main
from minipar.plan.cp import cp_comm_bytes, kv_block_bytes, ring_step_times
from minipar.plan.network import p2p_time
from minipar.plan.shapes import with_seq_len

LONG = with_seq_len(model_preset("llama-7b"), 32768)
H100 = "dgx-h100"


def _replica(cp, **kw):
    """One data-parallel replica of LONG: TP 8 with SP, cp ranks, one sequence."""
    return Layout(tp=8, sp=True, cp=cp, **kw)


def test_estimate_counts_the_rings_bytes_as_the_formula():
    for cp, recompute, dtype, e in ((2, "none", "mixed", 2), (4, "selective", "fp32", 4),
                                    (8, "full", "mixed", 2)):
        lay = _replica(cp, recompute=recompute, microbatches=3, pp=2)
        got = estimate(LONG, H100, lay, dtype=dtype).cp_bytes
        assert got == cp_comm_bytes(1, 32768, 4096, cp, layers=16, microbatches=3, tp=8,
                                    bytes_per_elem=e, recompute=recompute) > 0
    assert estimate(LONG, H100, _replica(1), dtype="mixed").cp_bytes == 0


def test_activations_fall_as_one_over_cp_and_states_stay_replicated():
    one = estimate(LONG, H100, _replica(1, recompute="selective"), flash=True).memory
    for cp in (2, 4, 8, 16):
        got = estimate(LONG, H100, _replica(cp, recompute="selective"), flash=True).memory
        assert got["activations"] == one["activations"] / cp
        assert (got["params"], got["grads"], got["optimizer"]) == (
            one["params"], one["grads"], one["optimizer"])
    # ZeRO shards over dp x cp (the trainer's dp_cp group): ZeRO-3 over 2 x 4 ranks
    zero3 = dataclasses.replace(_replica(4, dp=2), shard=(8, 8, 8))
    states = estimate(LONG, H100, zero3, flash=True).memory
    assert states["params"] == pytest.approx(one["params"] / 8, rel=1e-6)
    with pytest.raises(PlanError, match="divide"):     # a spec over dp alone is not one
        check_layout(LONG, dataclasses.replace(_replica(4, dp=2), shard=(1, 1, 3)))


def test_compute_splits_by_cp_and_the_ring_is_priced_message_by_message():
    base = estimate(LONG, H100, _replica(1), flash=True).times
    for cp in (2, 4):
        lay = _replica(cp)
        t = estimate(LONG, H100, lay, flash=True).times
        assert t["compute_attention"] == pytest.approx(base["compute_attention"] / cp)
        assert t["tp_comm"] < base["tp_comm"]              # messages of s/cp tokens
        step = ring_step_times(LONG, H100, cp, tp=8, flash=True, gpus=lay.gpus)
        block = kv_block_bytes(1, 32768, 4096, cp, 8, 2)
        assert step["across_nodes"]                        # tp 8 fills the node
        assert step["send"] == p2p_time(block, True, load_hardware(H100))
        messages = 32 * ((cp - 1) + (2 * cp - 1))          # per layer: forward, backward
        assert t["cp_comm"] == pytest.approx(messages * step["send"])
        # the K/V gradients' hops wait; the K/V sends hide behind their blocks where they can
        assert t["cp_exposed"] >= 32 * cp * step["send"] * (1 - 1e-9)
        assert t["step"] == pytest.approx(sum(t[k] for k in (
            "compute", "tp_comm", "cp_exposed", "bubble", "pp_comm", "dp_exposed")))
    inside = ring_step_times(LONG, H100, 2, tp=4, flash=True)   # tp x cp = 8: one node
    assert not inside["across_nodes"]
    assert inside["send"] < ring_step_times(LONG, H100, 2, tp=8, flash=True)["send"]


@pytest.mark.slow     # searches at scale (seconds each)
def test_search_weighs_cp_only_where_memory_forces_it():
    long = search("llama-7b", 64, H100, seq_len=131072, flash=True,
                  global_batch_tokens=32 * 131072, top=3)
    assert long[0].layout.cp > 1
    # without cp, 128k tokens fit only by recomputing everything, and run slower
    no_cp = search("llama-7b", 64, H100, seq_len=131072, flash=True, cp=1,
                   global_batch_tokens=32 * 131072, top=3)
    assert {e.layout.recompute for e in no_cp} == {"full"}
    assert long[0].step_time < no_cp[0].step_time
    short = search("llama-7b", 64, H100, seq_len=8192, flash=True,
                   global_batch_tokens=512 * 8192, top=5)
    assert all(e.layout.cp == 1 for e in short)
    # the cost model alone would trade TP for cp at 2048 tokens (search's docstring says why
    # it is not trusted there): only --max-cp opens it
    default = search("gpt-175b", 1024, "dgx-a100", top=1)[0]
    opened = search("gpt-175b", 1024, "dgx-a100", top=1, max_cp=8)[0]
    assert default.layout.cp == 1 and default.layout.tp == 4
    assert opened.layout.cp == 4 and opened.layout.tp == 2
    assert 0.04 < default.step_time / opened.step_time - 1 < 0.06
    with pytest.raises(PlanError, match="context parallelism"):
        search("llama-7b", 64, H100, cp=2, framework="fsdp")


def test_nb09_at_scale_fits_from_cp_2_and_the_ring_stops_hiding_past_cp_4():
    from minipar.lab import nb09
    rows = {r["cp"]: r for r in nb09.at_scale()}
    assert not rows[1]["fits"] and all(rows[n]["fits"] for n in rows if n > 1)
    assert [n for n in rows if n > 1 and rows[n]["hidden"]] == [2, 4]
    assert all(rows[n]["memory"]["activations"] == rows[1]["memory"]["activations"] / n
               for n in rows)


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_estimate_and_search_with_cp(capsys):
    code, out, err = _cli(capsys, "estimate", "--model", "llama-7b", "--hardware", H100,
                          "--seq-len", 131072, "--tp", 8, "--sp", "--cp", 4, "--gpus", 64,
                          "--global-batch", 16, "--recompute", "selective",
                          "--flash-attention", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert (got["cp"], got["dp"], got["fits"]) == (4, 2, True) and got["cp_bytes"] > 0
    assert "CP ring" in got["explain"]
    code, out, err = _cli(capsys, "search", "--model", "llama-7b", "--gpus", 64,
                          "--hardware", H100, "--seq-len", 131072, "--flash-attention",
                          "--global-batch-tokens", 32 * 131072, "--top", 2)
    assert code == 0, err
    assert "context parallelism weighed" in out and " cp " in out.splitlines()[2]
    code, out, err = _cli(capsys, "memory", "--model", "llama-7b", "--gpus", 16, "--tp", 8,
                          "--cp", 2, "--zero", 3, "--json")
    assert code == 0, err
    assert json.loads(out)["shard"] == {"p": 2, "g": 2, "os": 2}       # over dp x cp


@pytest.mark.parametrize("args, words", [
    (["estimate", "--model", "llama-7b", "--hardware", H100, "--gpus", 24, "--cp", 3],
     "not divisible by 6"),
    (["estimate", "--model", "llama-7b", "--hardware", H100, "--gpus", 12, "--tp", 8,
      "--cp", 2], "multiple of tp*pp*cp"),
    (["estimate", "--model", "llama-7b", "--hardware", H100, "--gpus", 32, "--tp", 8, "--sp",
      "--cp", 2, "--seq-len", 4100], "over --tp 8"),
    (["estimate", "--model", "llama-7b", "--hardware", H100, "--gpus", 16, "--cp", 2,
      "--framework", "fsdp"], "no context parallelism"),
    (["estimate", "--model", "llama-7b", "--hardware", H100, "--gpus", 16, "--tp", 4, "--cp", 2,
      "--seq-len", 4100, "--moe-experts", 8, "--ep", 2], "a cp rank's share 2050"),
    (["search", "--model", "llama-7b", "--hardware", H100, "--gpus", 64, "--cp", 3],
     "not divisible by 6"),
    (["search", "--model", "llama-7b", "--hardware", H100, "--gpus", 64, "--cp", 0], "--cp"),
])
def test_bad_cp_exits_2_with_one_line(capsys, args, words):
    code, out, err = _cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and words in err, err


def test_moe_under_cp_routes_a_cp_share_and_gathers_the_choices(capsys):
    """MoE at cp=2 against cp=1 on the same replicas: each rank's all-to-all bytes halve (it
    routes b s/cp tokens), the experts stay whole per rank while the rest is sharded over
    dp x cp, and the choices' all-gather over cp is charged, blocking."""
    from minipar.plan import moe as plan_moe
    from minipar.plan.timing import collective_time
    shape, moe, hw = model_preset("llama-7b"), plan_moe.MoE(8, 2), load_hardware(H100)
    one, two = (plan_moe.adjust(estimate(shape, hw, Layout(tp=2, cp=cp, dp=4,
                                                           shard=(1, 1, 4 * cp))),
                                shape, moe, 2, hw) for cp in (1, 2))
    a2a = [float(e.notes[-1].split("all-to-all ")[1].split(" MiB")[0].replace(",", ""))
           for e in (one, two)]
    assert a2a[1] == pytest.approx(a2a[0] / 2, rel=1e-3)
    states = plan_moe.state_bytes(shape, moe, dp=4, ep=2, shard=(1, 1, 8), tp=2, cp=2)
    assert two.memory["optimizer"] == states["optimizer"] < one.memory["optimizer"]
    assert two.memory["params"] == one.memory["params"]        # experts and the rest replicated
    dense = estimate(shape, hw, Layout(tp=2, cp=2, dp=4, shard=(1, 1, 8)))
    choices = 1 * shape.seq_len * 2 * plan_moe.COUNT_BYTES       # b s k int64, whole sequence
    gather = shape.layers * collective_time("all_gather", choices, 2, 2, hw)
    assert two.times["cp_exposed"] == pytest.approx(dense.times["cp_exposed"] + gather)
    code, out, err = _cli(capsys, "estimate", "--model", "llama-7b", "--hardware", H100,
                          "--gpus", 16, "--tp", 2, "--cp", 2, "--moe-experts", 8, "--ep", 2)
    assert code == 0 and "MoE: 8 experts" in out, err


def test_expert_replica_placement_is_the_trainers_mesh():
    """The planner's edp group (an expert's replicas: dp/ep x cp) against ``minipar.mesh``'s
    ``edp`` lines: as many members per node, for every small layout."""
    import itertools
    from minipar.mesh import axis_lines
    from minipar.plan.moe import edp_stride
    from minipar.plan.timing import placement
    for tp, cp, pp, dp, ep, per_node in itertools.product((1, 2), (1, 2, 4), (1, 2), (2, 4, 8),
                                                          (1, 2), (4, 8)):
        lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp)
        edp = axis_lines(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)["edp"][0].tolist()
        nodes = [r // per_node for r in edp]
        want = max(nodes.count(n) for n in set(nodes))
        got = placement(len(edp), edp_stride(lay, "tp,pp,dp", per_node, ep), per_node)[0]
        assert got == want, (tp, cp, pp, dp, ep, per_node)


def test_replica_placement_is_the_trainers_mesh():
    """The planner's dp x cp group (strides, members per node) against ``minipar.mesh``'s
    ``dp_cp`` and ``cp`` lines, minipar's rank order (tp, cp, pp, dp innermost first)."""
    import itertools
    from minipar.mesh import axis_lines
    from minipar.plan.layout import dp_per_node
    for tp, cp, pp, dp, per_node in itertools.product((1, 2, 4), (1, 2, 4), (1, 2), (1, 2, 4),
                                                      (4, 8)):
        lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp)
        lines = axis_lines(dp=dp, pp=pp, cp=cp, tp=tp)
        replicas = lines["dp_cp"][0].tolist()
        nodes = [r // per_node for r in replicas]
        assert dp_per_node(lay, per_node) == max(nodes.count(n) for n in set(nodes))
        ring = lines["cp"][0].tolist()
        assert all(b - a == lay.strides()["cp"] for a, b in zip(ring, ring[1:]))


@pytest.mark.parametrize("model, gpus", [("llama3-70b", 1024), ("llama3-405b", 16384)])
def test_128k_tokens_on_thousands_of_h100s_price_the_lessons_ring(model, gpus):
    """At 131,072 tokens Megatron-LM's search takes context parallelism, and its ring is
    minipar.cp's: per layer and micro-batch (3N - 2) K/V blocks of 2 b (s/N) (h_kv/t) e bytes
    (N - 1 more when the forward is recomputed; tests/test_cp.py measures these sends on
    gloo), each message timed on its own, behind a block of the balanced 2N-chunk split,
    which gives every rank the same half block at every step (``minipar.cp``)."""
    import torch
    from minipar import cp as lesson
    from minipar.plan.frameworks import load_framework
    from minipar.plan.peak import stage_list
    shape = with_seq_len(model_preset(model), 131072)
    best = search(shape, gpus, H100, framework="megatron-lm", flash=True,
                  global_batch_tokens=16 * 2**20, top=1)[0]
    lay, n, fw = best.layout, best.layout.cp, load_framework("megatron-lm")
    assert 8 <= n <= 64 and best.fits, lay.describe()
    layers = max(st.layers for st in stage_list(shape, lay, fw))
    block = 2 * lay.micro_batch * (131072 // n) * (shape.kv_hidden // lay.tp) * 2    # bf16
    messages = (1 if lay.recompute == "none" else 2) * (n - 1) + 2 * n - 1
    assert best.cp_bytes == layers * lay.microbatches * messages * block
    step = ring_step_times(shape, H100, n, lay.tp, lay.micro_batch, flash=True,
                           stride=lay.strides(fw.order)["cp"], gpus=lay.gpus)
    assert step["across_nodes"] and step["send"] == p2p_time(block, True, load_hardware(H100))
    assert best.times["cp_comm"] == pytest.approx(layers * lay.microbatches * messages
                                                  * step["send"])
    # the lesson's balanced ring: every rank computes at every one of its N steps, the same
    # work, half the causal square in all: what ring_step_times hides each message behind
    q = torch.zeros(1, 1, 64, 2)
    assert all(None not in row for row in lesson.simulate(q, q, q, 4)["trace"])
    work = lesson.work_per_rank(64, 4)
    assert len(set(work)) == 1 and sum(work) == 64 * 65 // 2


@pytest.mark.slow     # searches at scale (seconds each)
def test_cp_is_searched_where_only_it_divides_the_batch():
    # 128 sequences of 128k tokens on 8,192 GPUs: even stages of 126 layers allow pp 1 or 2,
    # so tp x pp reaches 16 and dp = 512 > 128 sequences; only cp divides the batch (the
    # search used to stop at cp = 1: "no layout ... can run")
    best = search("llama3-405b", 8192, H100, seq_len=131072, flash=True,
                  global_batch_tokens=16 * 2**20, top=1)[0]
    assert best.layout.cp > 1 and best.fits and best.layout.global_batch == 128
