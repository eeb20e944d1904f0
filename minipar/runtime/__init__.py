"""How minipar runs: starting processes (``dist``: torchrun, Slurm, ``--nproc``; a fail-fast
launcher), the collective timeout (``timeouts``), what every command line shares (``cli``,
``errors``: one line and exit status 2 for bad input), the timeline recorder (``trace``) and the
smoke step of a cluster job (``smoke``). Torch-free at import: the planner uses ``cli``."""
