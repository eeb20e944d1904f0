"""The code behind the notebooks' cells, one module per notebook (``nb08`` for notebook 08).

Notebooks import these; the package stays the single copy of the code they run.
"""
