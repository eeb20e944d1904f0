"""precision.DynamicLossScaler and PrecisionPolicy (no processes)."""
import pytest
import torch

from minipar.precision import DynamicLossScaler, PrecisionPolicy, found_inf_anywhere


def test_unscale_divides_and_flags_non_finite():
    s = DynamicLossScaler(init_scale=8.0)
    grads = [torch.tensor([8.0, 16.0], dtype=torch.float16), torch.tensor([4.0]), None]
    flag = s.unscale_(grads)
    assert flag.item() == 0.0
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [0.5]
    bad = [torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")], dtype=torch.float16)]
    assert s.unscale_(bad).item() == 1.0
    assert not found_inf_anywhere(torch.zeros(1)) and found_inf_anywhere(torch.ones(1))


def test_growth_backoff_skip_counting():
    s = DynamicLossScaler(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=3)
    for _ in range(2):
        s.update(False)
    assert s.scale == 1024.0 and s.growth_tracker == 2
    s.update(False)                                  # the third clean step in a row: grow
    assert s.scale == 2048.0 and s.growth_tracker == 0
    s.update(False)
    s.update(True)                                   # overflow: back off, reset, count it
    assert s.scale == 1024.0 and s.growth_tracker == 0 and s.skipped_steps == 1
    s.update(False), s.update(False)
    assert s.scale == 1024.0                         # the interval restarted at the overflow
    s.update(True)
    assert s.scale == 512.0 and s.skipped_steps == 2


def test_state_dict_round_trip():
    a = DynamicLossScaler(init_scale=256.0, growth_interval=5)
    for f in (False, False, True, False):
        a.update(f)
    b = DynamicLossScaler(growth_interval=5)
    b.load_state_dict(a.state_dict())
    assert (b.scale, b.growth_tracker, b.skipped_steps) == (128.0, 1, 1)
    for f in (False, False, False, False):
        a.update(f), b.update(f)
    assert a.state_dict() == b.state_dict() and b.scale == 256.0


def test_bad_scaler_arguments():
    with pytest.raises(ValueError):
        DynamicLossScaler(init_scale=0.0)
    with pytest.raises(ValueError):
        DynamicLossScaler(growth_interval=0)
    with pytest.raises(ValueError):
        DynamicLossScaler(backoff_factor=1.5)


def test_policies_by_name():
    fp32 = PrecisionPolicy.from_name("fp32")
    assert fp32 == PrecisionPolicy() and not fp32.mixed and fp32.loss_scaler is None
    bf16 = PrecisionPolicy.from_name("bf16", reduce="bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.master_dtype) == \
        (torch.bfloat16, torch.bfloat16, torch.float32) and bf16.mixed and bf16.loss_scaler is None
    fp16 = PrecisionPolicy.from_name("fp16", loss_scale_init=128.0, loss_scale_window=7)
    assert fp16.param_dtype == torch.float16 and fp16.reduce_dtype == torch.float32
    assert fp16.loss_scaler.scale == 128.0 and fp16.loss_scaler.growth_interval == 7
    assert fp16.name == "fp16"
    with pytest.raises(ValueError):
        PrecisionPolicy.from_name("fp8")
