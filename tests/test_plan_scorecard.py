"""The planner held to published multi-node runs like for like (``plan.scorecard``): every
utilisation row within the stated band, the orders a source publishes kept, and the docs'
table the code's own output."""
from __future__ import annotations

from pathlib import Path

import pytest

from minipar.plan import scorecard

DOC = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


@pytest.fixture(scope="module")
def computed():
    return scorecard.rows()


def test_every_published_point_is_within_the_band(computed):
    util = [r for r in computed if r["compared"] in ("MFU", "HFU")]
    assert len(util) >= 40
    bad = [(r["case"], round(r["error"], 3)) for r in util if abs(r["error"]) > scorecard.BAND]
    assert not bad
    s = scorecard.summary(computed)
    assert s["median_abs"] < 0.15


def test_sources_that_compare_layouts_keep_their_order(computed):
    orders = {o["group"]: o for o in scorecard.rank_orders(computed)}
    # one model, several layouts or widths: the published order must hold
    for group in ("Korthikanti 22B", "Korthikanti 175B", "Korthikanti 530B", "Korthikanti 1T",
                  "Korthikanti 530B at 2240", "Megatron-LM H100 strong",
                  "llm-foundry MPT-70b H100", "llm-foundry MPT-30b H100",
                  "llm-foundry MPT-3b H100", "llm-foundry MPT-1b H100",
                  "llm-foundry MPT-70b A100-80GB", "torchtitan Llama 3.1 8B"):
        assert orders[group]["agrees"], (group, orders[group])
    # across model sizes (weak scaling) the order is looser: more than 60% of pairs, a floor
    # chosen below what the planner gets today (it guards against regressions)
    for group in ("Megatron-LM H100", "Megatron-LM A100 2021"):
        c, n = orders[group]["pairs"]
        assert c / n > 0.6, (group, c, n)


def test_published_memory_is_within_its_margin(computed):
    mem = [r for r in computed if r["memory_gib"] is not None]
    assert mem and all(abs(r["memory_predicted"] / r["memory_gib"] - 1) < 0.1 for r in mem)


def test_every_row_names_its_source_and_what_the_planner_chose(computed):
    for r in computed:
        assert r["source"] and r["chosen"] in ("nothing", "interleaving",
                                               "micro-batch and interleaving",
                                               "micro-batch, interleaving and recomputation")


def test_docs_table_is_the_codes(computed):
    doc = DOC.read_text()
    assert scorecard.table(computed) in doc
    assert scorecard.ranks_table(scorecard.rank_orders(computed)) in doc
    assert scorecard.summary_line(computed) in doc


def test_readme_quotes_the_generated_range(computed):
    s = scorecard.summary(computed)
    readme = (DOC.parent.parent / "README.md").read_text()
    quoted = (f"from {s['low']:+.0%} to {s['high']:+.0%}, median |error| "
              f"{s['median_abs']:.0%}")
    assert quoted in " ".join(readme.split())
