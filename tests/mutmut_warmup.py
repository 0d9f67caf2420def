"""pytest plugin for ``make mutate`` only (``-p tests.mutmut_warmup`` in ``[tool.mutmut]``).

mutmut forks one process per mutant from a server process that has collected the tests.

* Warm-up: the first ``torch.export`` in a process costs about a second of one-time set-up; doing it once
  in the server (``pytest_configure`` runs there during collection) saves that second in every mutant run.
  It also sets ``AMPLITE_TEST_PREWARM=1``: test modules whose models are costly to export (e.g.
  ``test_fusion_decisions.py``) then export them at import, in the server, instead of on first use.
  Only torch is called here, never amplite: a result cached from the unmutated code would hide mutants.
* Order: mutmut's fork server passes a mutant's tests in set order; they are run here fastest first (the
  durations of mutmut's stats run, ``mutmut-stats.json``), so that ``-x`` stops a killed mutant early.
* Budget: a mutant runs its fastest tests up to ``MUTMUT_TEST_BUDGET`` seconds of recorded test time
  (default 3; ``0`` runs them all). A survivor otherwise pays for every test that reaches its function.
  Only mutant runs are affected: the stats run, the clean run and the forced-fail run see every test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_warm = False


def pytest_configure(config: pytest.Config) -> None:
    global _warm
    if _warm:
        return
    _warm = True
    os.environ["AMPLITE_TEST_PREWARM"] = "1"  # test modules with costly fixtures build them at import (fork server)
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Softmax(-1)).eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), strict=False)
    program.module()(x)
    program.run_decompositions()


def _durations() -> dict[str, float]:
    path = Path("mutmut-stats.json")  # mutmut runs the tests inside mutants/
    try:
        return json.loads(path.read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    durations = _durations()
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))
    budget = float(os.environ.get("MUTMUT_TEST_BUDGET", "3"))
    if budget <= 0:
        return
    spent, keep = 0.0, 0
    for keep, item in enumerate(items, 1):  # noqa: B007 - keep is used after the loop
        spent += durations.get(item.nodeid, 0.0)
        if spent > budget:
            break
    else:
        return
    keep = max(keep - 1, 1)
    config.hook.pytest_deselected(items=items[keep:])
    del items[keep:]
