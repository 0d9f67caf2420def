"""``check --train-steps`` on batches that do not fit the model (issue 28): exit 2 naming the batch, never
"internal error"; batches whose sizes change train (each new size traced once)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from fixtures import train_zoo

LOADERS = textwrap.dedent('''
    import torch

    def _ids(shape=(8, 12)):
        return torch.randint(0, 200, shape, generator=torch.Generator().manual_seed(0))

    def float_ids():
        ids = _ids()
        yield {"inputs": ids, "target": ids[:, 0] % 5}
        yield {"inputs": ids.float(), "target": ids[:, 0] % 5}

    def extra_rank():
        ids = _ids()
        yield {"inputs": ids, "target": ids[:, 0] % 5}
        yield {"inputs": ids[None], "target": ids[:, 0] % 5}

    def unknown_keyword():
        ids = _ids()
        yield {"inputs": ids, "target": ids[:, 0] % 5}
        yield {"inputs": ((ids,), {"extra": ids}), "target": ids[:, 0] % 5}

    def int32_ids():
        ids = _ids()
        yield {"inputs": ids, "target": ids[:, 0] % 5}
        yield {"inputs": ids.int(), "target": ids[:, 0] % 5}

    def three_lengths():
        for n in (12, 9, 5, 12):
            ids = _ids((8, n))
            yield {"inputs": ids, "target": ids[:, 0] % 5}
''')


@pytest.fixture()
def weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "gate_loaders.py").write_text(LOADERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "w.pt"
    torch.save(train_zoo.transformer().state_dict(), path)
    return path


def _check(cli, weights: Path, loader: str):
    return cli("check", weights, "--model-factory", "fixtures.train_zoo:transformer", "--data-loader",
               f"gate_loaders:{loader}", "--train-steps", "4", "--precision", "bf16", "--level", "O2")  # fmt: skip


@pytest.mark.parametrize(
    ("loader", "needle"),
    [
        ("float_ids", "batch 1 (step 1) does not fit the model: RuntimeError: Expected tensor for argument #1"),
        ("extra_rank", "batch 1 (step 1) does not fit the model: RuntimeError: The size of tensor a"),
        ("unknown_keyword", "unexpected keyword argument 'extra'"),
        ("int32_ids", "is int32 on cpu; the graph was traced with int64"),
    ],
)
def test_a_batch_that_does_not_fit_is_exit_2_naming_it(cli, weights: Path, loader: str, needle: str) -> None:
    res = _check(cli, weights, loader)
    assert res.exit_code == 2, res.output
    err = res.stderr
    assert needle in err and "internal error" not in err and "Traceback" not in res.output
    assert err.count("\n") == 1 and err.startswith("error:") and "fix:" in err


def test_batches_of_changing_length_train_and_gate(cli, weights: Path) -> None:
    res = _check(cli, weights, "three_lengths")
    assert res.exit_code == 0, res.stdout
    assert "training: 4 steps, bf16 O2" in res.stdout
