"""The GPT trainer, ``python -m minipar.train``: the machinery around the lessons.

Read ``loop.py`` first: one screen of step logic, nanoGPT's shape. The rest is named calls
it makes: ``config`` (the flags, checked once), ``engines`` (DP or ZeRO holding the model
states), ``steplog`` and ``report`` (what is recorded and printed), ``optim`` (schedule,
clipping, decay), ``checkpoint`` and ``pieces`` (state in the serial model's names),
``sample``, ``scaling`` (sweeps), ``mfu`` and ``memory``. How the paradigms are applied to the
model is ``minipar.parallelize``.
"""
from .config import RunConfig, parse_config, parser, world_size_from  # noqa: F401
from .loop import (Hooks, build_engine, build_mesh, build_model, build_policy,  # noqa: F401
                   build_runner, collect_state, main, make_optimizer, merge_states, run,
                   run_state, serial_params, with_state, worker)
