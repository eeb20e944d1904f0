"""The drop-in wrappers' compatibility surface: what makes minipar's DP, ZeRO and FSDP take the
place of torch's ``DistributedDataParallel``, ``ZeroRedundancyOptimizer`` and FSDP2's
``fully_shard`` in a user's own script. The algorithms are the lessons (``minipar.dp``,
``minipar.zero``); here: DDP's constructor arguments (``ddp_arguments``), state dicts in
torch's layouts (``zero_optimizer``) and FSDP2's contract (``fsdp``).
"""
from __future__ import annotations

from ..runtime.errors import UsageError

# DDP's arguments after bucket_cap_mb, in its order, and the values minipar can honour
# (None: any value; minipar's buckets are always the gradients' storage, and a parameter no
# backward reached is averaged as a zero; find_unused_parameters=True adds DDP's all-reduce
# of a used flag per parameter, so one no rank used keeps grad None)
DDP_REST = (("find_unused_parameters", None), ("check_reduction", None),
            ("gradient_as_bucket_view", None), ("static_graph", None),
            ("delay_all_reduce_named_params", (None,)), ("param_to_hook_all_reduce", (None,)),
            ("mixed_precision", (None,)), ("device_mesh", None),
            ("skip_all_reduce_unused_params", (False,)), ("bucket_cap_mb_list", (None,)),
            ("batched_grad_copy", None), ("forward_sync_buffers", None))


def ddp_arguments(module, device_ids, output_device, process_group, group, bucket_cap_mb,
                  bucket_mb, args: tuple, kwargs: dict):
    """DDP's constructor arguments as ``dp.DataParallel``'s: returns (group, bucket_mb,
    find_unused_parameters), or raises one line for a value with no minipar meaning."""
    if len(args) > len(DDP_REST):
        raise TypeError(f"DataParallel takes at most {8 + len(DDP_REST)} positional arguments")
    given = dict(zip((n for n, _ in DDP_REST), args))
    for name in kwargs:
        if name not in dict(DDP_REST) or name in given:
            raise TypeError(f"DataParallel got an unexpected keyword argument {name!r}")
    given.update(kwargs)
    for name, allowed in DDP_REST:
        if name in given and allowed is not None and given[name] not in allowed:
            raise UsageError(f"DataParallel: {name}={given[name]!r} is DDP's and not supported "
                             f"here; leave it {allowed[0]!r}")
    devices = {p.device for p in module.parameters()}
    if device_ids or output_device is not None:
        gpu = len(devices) == 1 and next(iter(devices)).type != "cpu"
        index = next(iter(devices)).index if gpu else None
        wanted = [d if isinstance(d, int) else getattr(d, "index", d) for d in device_ids or []]
        out = output_device if isinstance(output_device, int) or output_device is None \
            else output_device.index
        if not gpu or wanted not in ([], [index]) or out not in (None, index):
            raise UsageError(f"DataParallel: device_ids {device_ids} and output_device "
                             f"{output_device} must name the one GPU the module is on "
                             f"(parameters on {sorted(map(str, devices))}); leave them None on CPU")
    mesh = given.get("device_mesh")
    if sum(x is not None for x in (process_group, group, mesh)) > 1:
        raise UsageError("DataParallel: give one of group, process_group and device_mesh")
    if mesh is not None:
        if mesh.ndim != 1:
            raise UsageError(f"DataParallel: a 1-D device_mesh only (got {mesh.ndim}-D)")
        group = mesh.get_group()
    group = group if group is not None else process_group
    return (group, (bucket_cap_mb if bucket_cap_mb is not None else bucket_mb),
            bool(given.get("find_unused_parameters", False)))
