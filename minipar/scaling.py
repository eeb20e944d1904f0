"""``python -m minipar.scaling``: the command; its code is ``minipar/train/scaling.py``."""
from .train.scaling import *  # noqa: F401,F403
from .train.scaling import main

if __name__ == "__main__":
    main()
