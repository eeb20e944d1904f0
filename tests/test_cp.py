"""Context parallelism (``minipar.cp``): ring attention against one process's
``scaled_dot_product_attention`` (outputs and gradients), on one process (the ring's schedule,
every rank in turn) and on gloo ranks (the real ring), and its bytes against the planner."""
import pytest
import torch
import torch.nn.functional as F

from minipar import comm, cp
from minipar.runtime import dist
from minipar.plan.cp import cp_attention_bytes

B, H, S, D = 2, 3, 16, 8


def _qkv(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=dtype) for _ in range(3)]


def _reference(q, k, v, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def test_local_positions_hold_chunks_i_and_2n_minus_1_minus_i():
    assert cp.local_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert cp.local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert cp.local_positions(16, 4, 1, balanced=False).tolist() == [4, 5, 6, 7]
    x = torch.arange(3 * 16).view(3, 16)
    for balanced in (True, False):
        parts = [cp.shard_sequence(x, 4, r, balanced) for r in range(4)]
        assert torch.equal(cp.unshard_sequence(parts, balanced), x)
        assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(16))


def test_block_backward_is_autograds():
    q, k, v = (x[:, :, :6] for x in _qkv())
    for causal in (True, False):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse = cp.block_attention(qq, kk, vv, causal, scale=0.3)
        dout = torch.randn_like(out)
        want = torch.autograd.grad(out, (qq, kk, vv), dout)
        delta = (dout * out).sum(-1)
        got = cp.block_attention_backward(q, k, v, dout, lse.detach(), delta.detach(), causal, 0.3)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_merge_is_one_softmax_over_both_blocks():
    q, k, v = _qkv()
    whole, lse = cp.block_attention(q, k, v, causal=False, scale=0.5)
    a = cp.block_attention(q, k[:, :, :5], v[:, :, :5], causal=False, scale=0.5)
    b = cp.block_attention(q, k[:, :, 5:], v[:, :, 5:], causal=False, scale=0.5)
    out, merged = cp.merge(*a, *b)
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(merged, lse)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_simulated_ring_equals_sdpa(n, balanced):
    q, k, v = _qkv()
    dout = torch.randn_like(q)
    out, dq, dk, dv = _reference(q, k, v, dout)
    got = cp.simulate(q, k, v, n, balanced, dout=dout)
    for name, want in dict(out=out, dq=dq, dk=dk, dv=dv).items():
        torch.testing.assert_close(got[name], want, atol=1e-12, rtol=1e-10, msg=name)


def test_plain_split_idles_rank_0_and_the_balanced_split_does_not():
    assert cp.work_per_rank(64, 4, balanced=True) == [cp.work_per_rank(64, 4)[0]] * 4
    plain = cp.work_per_rank(64, 4, balanced=False)
    assert plain == sorted(plain) and plain[-1] > 5 * plain[0]
    assert sum(plain) == sum(cp.work_per_rank(64, 4)) == 64 * 65 // 2   # the same causal work
    # the step-by-step trace: rank 0 of a plain split computes only at step 0
    trace = cp.simulate(*_qkv(), n=4, balanced=False)["trace"]
    assert [row[0] for row in trace] == [0, None, None, None]
    assert all(j is not None for row in cp.simulate(*_qkv(), n=4)["trace"] for j in row)


def _ring_worker(dtype):
    """On 4 gloo ranks: cp = 2 (rings {0,1}, {2,3}) and cp = 4, against SDPA and the formula."""
    torch.set_num_threads(1)
    me = torch.distributed.get_rank()
    groups = {2: [torch.distributed.new_group(r) for r in ([0, 1], [2, 3])][me // 2],
              4: torch.distributed.new_group([0, 1, 2, 3])}
    q, k, v = _qkv(dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    out, dq, dk, dv = _reference(q, k, v, dout)
    results = {}
    for n, group in groups.items():
        for balanced in (True, False):
            ring = cp.Ring.of(group, balanced)
            mine = [cp.shard_sequence(x, n, ring.index, balanced, dim=2).requires_grad_()
                    for x in (q, k, v)]
            comm.reset()
            y = cp.ring_attention(*mine, ring)
            y.backward(cp.shard_sequence(dout, n, ring.index, balanced, dim=2))
            errors = [(y.detach() - cp.shard_sequence(out, n, ring.index, balanced, dim=2))]
            errors += [(x.grad - cp.shard_sequence(g, n, ring.index, balanced, dim=2))
                       for x, g in zip(mine, (dq, dk, dv))]
            results[(n, balanced)] = dict(err=max(e.abs().max().item() for e in errors),
                                          sent=comm.stats.sent[("send", "cp")])
    return results


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5)])
def test_ring_on_gloo_equals_sdpa_and_sends_the_formula(dtype, tol):
    e = torch.tensor([], dtype=dtype).element_size()
    for rank, res in enumerate(dist.launch(_ring_worker, 4, dtype, timeout=120)):
        for (n, balanced), r in res.items():
            assert r["err"] < tol, (rank, n, balanced, r["err"])
            want = cp_attention_bytes(B, S, H * D, n, bytes_per_elem=e)["total"]
            assert r["sent"] == want, (rank, n, balanced, r["sent"], want)


def test_bench_measures_the_ring_and_says_why_torch_cannot_run_here():
    from minipar.bench.cp import measure
    for r in dist.launch(measure, 2, seq_len=64, heads=2, head_dim=8, reps=1, warmup=0,
                         timeout=120):
        assert r["sent"] == r["formula"] == cp_attention_bytes(1, 64, 16, 2)["total"]
        assert r["max_diff"] < 1e-5
        assert r["ring"] > 0 and (r["torch_cp"] is not None or r["torch_cp_reason"])


def test_planner_layout_memory_learn_cp():
    import dataclasses
    from minipar import plan
    from minipar.plan.cp import cp_layer_activation_bytes
    shape = dataclasses.replace(plan.model_preset("llama-7b"), seq_len=32768)
    one = plan.Layout(tp=8, dp=1, sp=True, recompute="selective")
    two = dataclasses.replace(one, cp=2)
    assert two.gpus == 16 and "cp=2" in two.describe()
    m1 = plan.device_memory(shape, one, flash=True)
    m2 = plan.device_memory(shape, two, flash=True)
    assert m2["activations"] == m1["activations"] / 2
    assert m2["params"] == m1["params"]          # replicated over cp (no ZeRO here)
    per_layer = cp_layer_activation_bytes(shape, 1, cp=2, tp=8, sp=True, recompute="selective")
    assert per_layer == plan.layer_activation_bytes(
        dataclasses.replace(shape, seq_len=16384), 1, tp=8, sp=True, recompute="selective",
        flash=True)
    zero1 = dataclasses.replace(two, shard=(1, 1, 2))      # ZeRO-1 over dp x cp = 2 ranks
    assert plan.device_memory(shape, zero1, flash=True)["optimizer"] < m2["optimizer"]
    plan.check_layout(shape, zero1)
    with pytest.raises(plan.PlanError, match="not divisible"):
        plan.check_layout(dataclasses.replace(shape, seq_len=32766), two)


def test_ring_bytes_formula_counts_messages():
    # cp = 4, b = 2, s = 16, h = 24 fp32: a K/V block is 2*2*4*24*4 = 1536 B
    assert cp_attention_bytes(2, 16, 24, 4) == dict(forward=3 * 1536, backward=7 * 1536,
                                                    total=10 * 1536)
    assert cp_attention_bytes(2, 16, 24, 4, recompute="full")["forward"] == 6 * 1536
    assert cp_attention_bytes(2, 16, 24, 1)["total"] == 0


def test_a_sequence_that_does_not_cut_evenly_is_refused_not_truncated():
    """10 tokens over cp 2 (4 chunks) would lose tokens 8 and 9: one line instead."""
    from minipar import cp
    from minipar.runtime.errors import UsageError
    with pytest.raises(UsageError, match="not divisible by 4"):
        cp.local_positions(10, 2, 0)
    with pytest.raises(UsageError, match="3 equal chunks"):
        cp.local_positions(10, 3, 0, balanced=False)
    assert sorted(torch.cat([cp.local_positions(12, 2, r) for r in range(2)]).tolist()) == list(range(12))
    # one rank holds the whole sequence, any length (MoE's token share asks at cp 1 too)
    assert cp.local_positions(9, 1, 0).tolist() == list(range(9))
