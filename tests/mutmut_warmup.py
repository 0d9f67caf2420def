"""pytest plugin for ``make mutate`` only (``-p tests.mutmut_warmup`` in ``[tool.mutmut]``).

mutmut forks one process per mutant from a server process that has collected the tests. The first
``torch.export`` in a process costs about a second of one-time set-up; doing it once in the server
(``pytest_configure`` runs there during collection) saves that second in every forked mutant run.
Only torch is called here, never amplite: a result cached from the unmutated code would hide mutants.
"""

from __future__ import annotations

import pytest

_warm = False


def pytest_configure(config: pytest.Config) -> None:
    global _warm
    if _warm:
        return
    _warm = True
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Softmax(-1)).eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), strict=False)
    program.module()(x)
    program.run_decompositions()
