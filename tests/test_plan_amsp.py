"""AMSP's scale-aware partitioner (``search(objective="amsp")``, ``search.amsp_*``): at
1,024 A800s for LLaMA 7B-30B (TP = PP = 1) the least AMSP communication time among the specs
that fit, each group on the fastest links its size allows: the groups stay inside a node
while memory allows, and each pick says in one line per group why not the next size."""
from __future__ import annotations

from dataclasses import replace

import pytest

from minipar.plan.estimate import estimate
from minipar.plan.frameworks import load_framework
from minipar.plan.hardware import load_hardware
from minipar.plan.search import amsp_cost, amsp_key, amsp_reasons, search
from minipar.plan.shapes import model_preset
from minipar.plan.sharding import shard_specs
from minipar.plan.timing import placement

HW = load_hardware("a800-ib")


@pytest.fixture(scope="module", params=["llama-7b", "llama-13b", "llama-30b"])
def pick(request):
    best = search(request.param, 1024, HW, tp=1, pp=1, objective="amsp", top=1)[0]
    return model_preset(request.param), best


def test_groups_stay_inside_a_node_while_memory_allows(pick):
    shape, best = pick
    stride = best.layout.replica_stride("tp,pp,dp", HW.gpus_per_node)
    nodes = [placement(s, stride, HW.gpus_per_node)[1] for s in best.layout.shard]
    # the old objective (the planner's own model, nothing hidden) spread OS over 8-16
    # nodes ((1,1,64), (1,128,128), (1,256,256)); AMSP keeps the groups in a node
    if shape.name != "llama-30b":
        assert nodes == [1, 1, 1], best.layout.describe()
    if shape.name == "llama-7b":             # nothing forces more than the optimizer states
        assert best.layout.shard[:2] == (1, 1)
    # a group crosses nodes only where memory forces it: the next smaller size does not fit
    lines = amsp_reasons(shape, HW, best, load_framework("minipar"), "tp,pp,dp", "mixed", False)
    for n, line in zip(nodes, lines):
        assert n == 1 or "(inside a node) does not fit" in line, line


def test_the_pick_is_the_least_amsp_time_among_the_specs_that_fit(pick):
    shape, best = pick
    fw, lay = load_framework("minipar"), best.layout
    keys = {}
    for spec in shard_specs(lay.replicas, HW.gpus_per_node):
        other = replace(lay, shard=spec)
        if estimate(shape, HW, other, framework=fw, check=False).fits:
            keys[spec] = amsp_key(amsp_cost(shape, HW, other, fw, "tp,pp,dp", "mixed"), spec)
    assert keys[lay.shard] == min(keys.values())
    # and a smaller group than the pick's never fits with less AMSP time
    assert all(keys[s] >= keys[lay.shard] for s in keys if sum(s) < sum(lay.shard))


def test_each_group_is_explained_in_one_line(pick):
    shape, best = pick
    lines = amsp_reasons(shape, HW, best, load_framework("minipar"), "tp,pp,dp", "mixed", False)
    assert [line.split("=")[0] for line in lines] == ["P", "G", "OS"]
    if shape.name == "llama-13b":            # memory keeps the optimizer group at 8
        assert "OS=8 (inside a node): 4 (inside a node) does not fit" in lines[2]
    for line in lines:                       # the next size up crosses nodes and costs more
        if "16 (across 2 nodes) costs" in line:
            assert float(line.split("16 (across 2 nodes) costs ")[1].split(" s")[0]) > 0


def test_amsp_time_counts_links_by_group_size():
    # one all-reduce of the same gradient: hierarchical inside a node first is cheaper on
    # AMSP's links than a flat one over all 1,024 ranks, and a group of 16 pays the NICs
    shape, fw = model_preset("llama-7b"), load_framework("minipar")
    lay = search(shape, 1024, HW, tp=1, pp=1, shard=(1, 1, 8), top=1)[0].layout
    flat, node, wide = (amsp_cost(shape, HW, replace(lay, shard=s), fw, "tp,pp,dp", "mixed")
                        for s in ((1, 1, 1), (1, 1, 8), (1, 1, 16)))
    assert node < wide < flat


def test_the_command_line_explains_the_pick_in_text_and_json(capsys):
    """``search --objective amsp`` prints one line per group, and its ``--json`` carries the
    same explanation."""
    import json
    from minipar.plan.__main__ import main
    args = ["search", "--model", "llama-7b", "--gpus", "1024", "--hardware", "a800-ib", "--tp",
            "1", "--pp", "1", "--objective", "amsp", "--top", "1"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    explained = json.loads(capsys.readouterr().out)[0]["explain"]
    for group in ("P", "G", "OS"):
        assert f"AMSP's partitioner, {group}=" in text and f"AMSP's partitioner, {group}=" in explained
