"""Issue 47 item 5: an export failure names the file and line to change, first in the message, never
``<string>:1`` (torch's generated wrapper) and never lost off the end of torch's long message."""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path

import pytest
import torch

import amplite
from amplite.errors import ExportError

LIBRARY = '''
import torch


def batched_filter(boxes):
    if boxes.numel() == 0:  # data-dependent: the number of boxes kept
        return boxes
    return boxes * 2
'''

USER = '''
import torch
from torch import nn

from zoolib47.ops import batched_filter

CALL = eval("lambda f, x: f(x)")  # code generated at run time (filename <string>), as torch's own wrapper


class Detector(nn.Module):
    def forward(self, x):
        kept = x[x > 0]
        return CALL(batched_filter, kept)


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class Stats(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4, momentum=None)

    def forward(self, x):
        return self.bn(x)
'''


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A user's model file and an installed library (under a site-packages folder), both written here."""
    lib = tmp_path / "site-packages" / "zoolib47"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("")
    (lib / "ops.py").write_text(textwrap.dedent(LIBRARY))
    (tmp_path / "user47.py").write_text(textwrap.dedent(USER))
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("user47"), tmp_path
    for name in ("user47", "zoolib47", "zoolib47.ops"):
        importlib.sys.modules.pop(name, None)


def _line(path: Path, text: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if text in ln)


def test_a_failure_inside_a_library_names_its_line_and_the_users_call(user) -> None:
    module, root = user
    with pytest.raises(ExportError) as info:
        amplite.convert(module.Detector(), (torch.randn(16),), verify=False)
    message = str(info.value)
    lib_line = _line(root / "site-packages" / "zoolib47" / "ops.py", "boxes.numel() == 0")
    user_line = _line(root / "user47.py", "return CALL(batched_filter, kept)")
    assert "<string>" not in message, message
    where = re.match(r"torch\.export could not trace the model at (.*?): GuardOnDataDependent", message)
    assert where, message  # the location comes first, before torch's text
    assert where[1].startswith(f"zoolib47/ops.py:{lib_line} `if boxes.numel() == 0:"), where[1]
    assert where[1].endswith(f"called from {root / 'user47.py'}:{user_line}"), where[1]


def test_a_data_dependent_branch_in_the_users_file_is_named_first(user, cli, tmp_path: Path) -> None:
    module, root = user
    with pytest.raises(ExportError, match=rf"could not trace the model at {re.escape(str(root / 'user47.py'))}:"
                       rf"{_line(root / 'user47.py', 'if x.sum() > 0')} `if x.sum\(\) > 0:`: "):  # fmt: skip
        amplite.convert(module.Branchy(), (torch.randn(3, 4),), verify=False)


def test_batchnorm_without_momentum_in_train_mode_names_the_users_line_and_the_layer(user) -> None:
    module, root = user
    model = module.Stats().train()
    with pytest.raises(ExportError) as info:
        amplite.convert(model, (torch.randn(3, 4),), verify=False)
    message = str(info.value)
    assert f"at {root / 'user47.py'}:{_line(root / 'user47.py', 'return self.bn(x)')}" in message, message
    assert "inside torch/nn/modules/batchnorm.py:" in message and "num_batches_tracked" in message, message
    assert message.index("batchnorm.py") < message.index("GuardOnDataDependent"), message
    assert amplite.convert(module.Stats().eval(), (torch.randn(3, 4),), verify=False) is not None
