"""The process mesh (named axes, derived ep/edp/dp_cp) and the parameter groups."""
import pytest
import torch

from minipar import comm, mesh, moe
from minipar.runtime import dist
from minipar.runtime.errors import UsageError

# (dp, pp, cp, tp, ep): every axis of size > 1 somewhere, and ep in {1, part, all} of dp
SHAPES_8 = [(2, 2, 1, 2, 1), (4, 1, 1, 2, 2), (8, 1, 1, 1, 4), (2, 1, 2, 2, 2), (4, 2, 1, 1, 4),
            (1, 2, 2, 2, 1)]
SHAPES_4 = [(4, 1, 1, 1, 2), (1, 1, 2, 2, 1), (2, 2, 1, 1, 2)]


def _what_each_rank_sees(shapes):
    out = []
    for dp, pp, cp, tp, ep in shapes:
        m = mesh.Mesh(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
        seen = {}
        for axis in mesh.AXES + mesh.DERIVED:
            g = m.group(axis)
            x = torch.tensor([float(m.rank)])
            comm.all_reduce(x, g)                     # the group really spans ranks(axis)
            seen[axis] = dict(size=m.size(axis), coord=m.coord(axis), ranks=m.ranks(axis),
                              group_size=comm.size(g), group_rank=comm.rank(g),
                              is_none=g is None, summed=x.item())
            a = m.axis(axis)                          # the same line, as the value engines take
            seen[axis]["axis"] = (a.group is g, a.size, a.rank, a.lines.tolist() == m.lines(axis).tolist())
        out.append(dict(rank=m.rank, seen=seen))
    return out


def _expected(shape, rank):
    """Each axis's line through ``rank``, from arange(world).view(dp, pp, cp, tp) directly."""
    dp, pp, cp, tp, ep = shape
    r = torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)
    d, p, c, t = (r == rank).nonzero()[0].tolist()
    x, e = divmod(d, ep)          # dp index = x * ep + e: ep consecutive dp indices
    return {"dp": (r[:, p, c, t].tolist(), d), "pp": (r[d, :, c, t].tolist(), p),
            "cp": (r[d, p, :, t].tolist(), c), "tp": (r[d, p, c, :].tolist(), t),
            "ep": (r[x * ep:(x + 1) * ep, p, c, t].tolist(), e),
            "edp": (r[e::ep, p, :, t].flatten().tolist(), x * cp + c),   # cp holds them too
            "dp_cp": (r[:, p, :, t].flatten().tolist(), d * cp + c)}


def _check(shapes, results):
    for per_rank in results:
        for shape, got in zip(shapes, per_rank):
            want = _expected(shape, got["rank"])
            for axis, (ranks, coord) in want.items():
                s = got["seen"][axis]
                where = f"shape {shape} rank {got['rank']} axis {axis}"
                assert s["ranks"] == ranks, where
                assert s["coord"] == coord == ranks.index(got["rank"]), where
                assert s["size"] == s["group_size"] == len(ranks), where
                assert s["is_none"] == (len(ranks) == 1), where
                assert s["group_rank"] == (coord if len(ranks) > 1 else 0), where
                assert s["summed"] == float(sum(ranks)), where
                assert s["axis"] == (True, len(ranks), coord, True), where


def test_mesh_axes_match_arange_view_8_ranks():
    _check(SHAPES_8, dist.launch(_what_each_rank_sees, 8, SHAPES_8, timeout=240))


def test_mesh_axes_match_arange_view_4_ranks():
    _check(SHAPES_4, dist.launch(_what_each_rank_sees, 4, SHAPES_4, timeout=120))


def test_mesh_single_process_and_bad_shapes():
    m = mesh.Mesh()
    assert all(m.size(a) == 1 and m.coord(a) == 0 and m.group(a) is None and m.ranks(a) == [0]
               for a in mesh.AXES + mesh.DERIVED)
    with pytest.raises(UsageError, match="must divide"):
        mesh.Mesh(dp=1, ep=2)
    with pytest.raises(UsageError, match="the world has 1"):
        mesh.Mesh(dp=2)
    with pytest.raises(KeyError, match="no mesh axis"):
        m.size("ddp")


def test_axis_lines_partition_the_world():
    lines = mesh.axis_lines(dp=4, pp=2, cp=1, tp=2, ep=2)
    for axis, t in lines.items():
        assert sorted(t.flatten().tolist()) == list(range(16)), axis
    assert lines["dp_cp"].tolist() == lines["dp"].tolist()       # cp = 1


def test_param_groups_split_experts_from_dense():
    from minipar.model import build, config
    cfg = config("nano", moe_experts=4, moe_top_k=2)
    model = build(cfg, seed=0)
    gs = mesh.param_groups(model, experts=moe.expert_parameters(model))
    assert [g.name for g in gs] == ["dense", "expert"]
    assert [g.reduce_axis for g in gs] == ["dp_cp", "edp"]
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(".experts." in names[id(p)] for p in gs[1].params)
    assert not any(".experts." in names[id(p)] for p in gs[0].params)
    assert sum(len(g) for g in gs) == len(list(model.parameters()))
    dense = mesh.param_groups(build(config("nano"), seed=0))
    assert [g.name for g in dense] == ["dense"]
