"""The launcher from a Jupyter kernel, as notebooks run it headless (nbclient, like nbval and
`jupyter nbconvert --execute`): results come back, a failing rank reports why, a function
defined in a cell is refused with one line (it used to kill the rank before its traceback
could be queued: "rank 0 died with exit code 1 and no traceback"), and the ranks see the
kernel's environment as it is at each launch, not as it was when the forkserver started."""
import os

import pytest

from conftest import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

TESTS = os.path.join(ROOT, "tests")

CELLS = [
    f"import os, sys\nsys.path[:0] = [{ROOT!r}, {TESTS!r}]\n"
    "import torch\ntorch.set_num_threads(1)\nfrom minipar.runtime import dist\nimport test_dist",
    "print('ok', all(a == b for a, b in dist.launch(test_dist._group_sum, 4, 1, 2, 2, timeout=120)))",
    "try:\n    dist.launch(test_dist._raise_on_rank_1, 2, timeout=120)\n"
    "except dist.RankFailed as e:\n    print('failed:', str(e).splitlines()[0], '|', 'boom from rank one' in str(e))",
    "def in_a_cell():\n    return 1\n"
    "try:\n    dist.launch(in_a_cell, 2)\nexcept dist.UsageError as e:\n    print('refused:', e)",
    "os.environ['MINIPAR_TIMEOUT'] = '7'\n"
    "print('timeouts', dist.launch(test_dist._group_timeouts, 2, timeout=120)[0])",
    "import ipywidgets as widgets\nfrom IPython.display import display\n"
    "display(widgets.interactive(lambda x=1: print('widget', x), x=(0, 3)))",
]


@pytest.mark.slow   # the notebooks (full suite) launch from a kernel too
def test_launch_from_a_jupyter_kernel():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": ROOT}})
    client.execute()
    out = []
    for cell in nb.cells:
        out.append("".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"))
    assert out[1].strip() == "ok True"
    assert out[2].strip() == "failed: rank 1 failed: | True"
    assert out[3].startswith("refused: launch(in_a_cell, ...): the ranks cannot import")
    assert out[4].strip() == "timeouts [7.0, 7.0, 7.0]"
