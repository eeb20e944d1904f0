"""The GPT trainer, ``python -m minipar.train``: the machinery around the lessons.

Read ``loop.py`` first: one screen of step logic, nanoGPT's shape. The rest is named calls
it makes: ``config`` (the flags, checked once), ``report`` (what is printed), ``steplog``
(metrics), ``optim`` (schedule, clipping, decay), ``checkpoint`` and ``pieces`` (state in
the serial model's names), ``sample``, ``scaling`` (sweeps), ``mfu`` and ``memory``.
How the paradigms are applied to the model is ``minipar.parallelize``.
"""
from .config import RunConfig, parse_config, parser, world_size_from  # noqa: F401
from .loop import (build_engine, build_mesh, build_model, build_policy, build_runner, main,  # noqa: F401,E501
                   collect_state, make_optimizer, merge_states, run, run_state, serial_params,
                   worker)
