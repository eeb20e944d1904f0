"""``python -m minipar.checkpoint``: the command; its code is ``minipar/train/checkpoint.py``."""
from .train.checkpoint import *  # noqa: F401,F403
from .train.checkpoint import main

if __name__ == "__main__":
    main()
