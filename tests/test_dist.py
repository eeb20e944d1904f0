"""The launcher, the environment readers and the process grid."""
import time

import pytest
import torch
import torch.distributed as tdist

from minipar import comm, dist


def _grid_coords(dp, pp, tp):
    g = dist.Grid(dp=dp, pp=pp, tp=tp)
    return dict(rank=g.rank, coords=(g.dp_rank, g.pp_rank, g.tp_rank), tp=g.tp_ranks,
                pp=g.pp_ranks, dp=g.dp_ranks, sizes=(comm.size(g.dp_group), comm.size(g.pp_group),
                                                    comm.size(g.tp_group)))


def test_grid_layout_matches_arange_view():
    out = dist.launch(_grid_coords, 8, dp=2, pp=2, tp=2)
    ranks = torch.arange(8).view(2, 2, 2)
    for r in out:
        d, p, t = r["coords"]
        assert ranks[d, p, t] == r["rank"]
        assert r["tp"] == ranks[d, p, :].tolist()        # TP neighbours are adjacent ranks
        assert r["pp"] == ranks[d, :, t].tolist()
        assert r["dp"] == ranks[:, p, t].tolist()
        assert r["sizes"] == (2, 2, 2)


def _group_sum(dp, pp, tp):
    g = dist.Grid(dp=dp, pp=pp, tp=tp)
    x = torch.tensor([float(g.rank)])
    comm.all_reduce(x, g.tp_group)
    return x.item(), sum(g.tp_ranks)


def test_groups_reduce_over_their_own_ranks():
    for got, expected in dist.launch(_group_sum, 4, dp=1, pp=2, tp=2):
        assert got == expected


def _raise_on_rank_1():
    if tdist.get_rank() == 1:
        raise ValueError("boom from rank one")
    x = torch.ones(4)
    tdist.all_reduce(x)  # rank 0 blocks here, waiting for the dead rank
    return x


def test_failing_rank_stops_all_fast_with_its_traceback():
    t = time.monotonic()
    with pytest.raises(dist.RankFailed) as e:
        dist.launch(_raise_on_rank_1, 2, timeout=60)
    assert "boom from rank one" in str(e.value) and "rank 1" in str(e.value)
    assert time.monotonic() - t < 30


def _sleep_forever():
    time.sleep(1000)


def test_timeout_kills_every_rank():
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        dist.launch(_sleep_forever, 2, timeout=3)
    assert time.monotonic() - t < 20


def _hard_exit():
    import os
    if tdist.get_rank() == 0:
        os._exit(7)
    time.sleep(1000)


def test_killed_rank_is_reported():
    with pytest.raises(dist.RankFailed, match="exit code 7"):
        dist.launch(_hard_exit, 2, timeout=60)


def test_env_torchrun_and_slurm():
    e = dist.env_from_os({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                          "MASTER_ADDR": "n0", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == (3, 8, 1, "n0", 1234)
    s = dist.env_from_os({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                          "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8(x2)",
                          "SLURM_NODELIST": "frontier[00012-00013]", "SLURM_JOBID": "77"})
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size) == (9, 16, 1, 8)
    assert s.master_addr == "frontier00012"
    assert dist.env_from_os({}) is None


def test_backend_auto_is_gloo_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert dist.resolve_backend("auto", 2) == "gloo"
    with pytest.raises(dist.UsageError, match="needs a GPU"):
        dist.resolve_backend("nccl", 1)


def test_backend_with_one_bound_gpu_per_task(monkeypatch):
    """srun --gpus-per-task 1 (Frontier): each of 8 tasks sees one GPU; that is NCCL's case."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert dist.resolve_backend("auto", 8) == "nccl"
    assert dist.resolve_backend("nccl", 8) == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert dist.resolve_backend("auto", 8) == "gloo"          # 4 GPUs for 8 processes: no
    with pytest.raises(dist.UsageError, match="one GPU per local process"):
        dist.resolve_backend("nccl", 8)
    assert dist.resolve_backend("auto", 4) == "nccl"
