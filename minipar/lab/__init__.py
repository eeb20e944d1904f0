"""The code behind the workshop notebooks, one module per notebook.

    nb05  05_3d_parallel_trainer  the process grid, the trainer's seams one at a time, 3D
                                  layouts against the serial run
    nb06  06_scaling_experiments  weak/strong scaling measured here and predicted, the
                                  pipeline's micro-batch trade-off, GPT 22B-1T on Frontier

A notebook imports its module (``from minipar.lab import nb06``) and the package it teaches;
it carries no second copy of the code. The ``draw_*`` functions turn results into figures
(matplotlib is imported only when drawing).
"""
from ..bench import machine  # noqa: F401  (every notebook prints its machine)
