"""``python -m minipar.sample``: the command; its code is ``minipar/train/sample.py``."""
from .train.sample import *  # noqa: F401,F403
from .train.sample import main

if __name__ == "__main__":
    main()
