"""``python -m minipar.train``: see ``minipar.train.loop``."""
from .loop import main

main()
