"""`amplite migrate` never breaks code silently (issue 14): re-exported names, all-or-nothing apex, an
independent --check scan, comments, conditional apex, options left dead by the migration."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from warnings import catch_warnings, simplefilter

import pytest

from amplite.migrate import format_report, migrate_paths, migrate_source


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


@contextmanager
def user_modules(folder: Path, *names: str) -> Iterator[dict[str, ModuleType]]:
    """The user's modules ``names`` imported from ``folder`` as an interpreter started there imports them
    (``folder`` first on the path, no module of those names loaded before); all of it undone afterwards."""
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    try:
        yield {n: importlib.import_module(n) for n in names}
    finally:
        sys.path.remove(str(folder))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def test_names_in_dunder_all_are_never_removed() -> None:
    before = _src('''
        from torch.cuda.amp import autocast, GradScaler
        __all__ = ["autocast", "GradScaler"]
    ''')
    after, warnings = migrate_source(before)
    assert after == before  # both names are the module's API
    compile(after, "reexport.py", "exec")
    assert [w.split(" is kept")[0] for w in warnings] == [
        "line 1: `from torch.cuda.amp import GradScaler`", "line 1: `from torch.cuda.amp import autocast`",
    ]  # fmt: skip
    assert all("re-exported (listed in __all__)" in w for w in warnings)

    used = _src('''
        import torch
        from torch.cuda.amp import GradScaler
        __all__ = ["GradScaler", "make"]

        def make():
            return GradScaler()
    ''')
    after, _ = migrate_source(used)
    assert after == used.replace("return GradScaler()", 'return torch.amp.GradScaler("cuda")')
    compile(after, "reexport.py", "exec")


def test_names_imported_by_other_files_of_the_run_are_kept(tmp_path: Path) -> None:
    (tmp_path / "util.py").write_text(_src('''
        import torch
        from torch.cuda.amp import autocast, GradScaler  # re-exported below


        def context():
            return autocast(enabled=False)
    '''))
    train = "from util import GradScaler\nimport util\n\nSCALER = GradScaler(enabled=False)\nCTX = util.context()\n"
    (tmp_path / "train.py").write_text(train)
    report = migrate_paths([tmp_path])
    assert report.exit_code == 0, format_report(report)
    util = (tmp_path / "util.py").read_text()
    assert "from torch.cuda.amp import GradScaler  # re-exported below\n" in util
    assert 'return torch.amp.autocast("cuda", enabled=False)' in util and "import autocast" not in util
    text = format_report(report)
    assert "util.py: warning: line 2: `from torch.cuda.amp import GradScaler` is kept" in text
    assert f"imported by {tmp_path / 'train.py'}:1" in text
    compile(util, "util.py", "exec")
    # The user's code still imports and runs (before the fix, `from util import GradScaler` failed).
    import torch

    with user_modules(tmp_path, "train", "util") as mods:
        assert isinstance(mods["train"].SCALER, torch.amp.GradScaler)


NO_SYNC = _src('''
    import torch
    from apex import amp
    from torch.cuda.amp import custom_fwd

    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    for step, (x, y) in enumerate(loader):
        with model.no_sync():
            loss = criterion(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
''')


def test_apex_is_all_or_nothing_when_autocast_cannot_be_placed() -> None:
    """Gradient accumulation under DDP no_sync: migrating without autocast would silently train in FP32."""
    after, warnings = migrate_source(NO_SYNC)
    assert after == NO_SYNC  # not even the torch.cuda.amp import is touched: the file is one unit
    compile(after, "accumulate.py", "exec")
    placed = [w for w in warnings if "cannot place autocast" in w]
    assert len(placed) == 1 and placed[0].startswith("line 9: ") and placed[0].endswith("the file is left unchanged")


def test_check_fails_on_every_deprecated_api_left(tmp_path: Path) -> None:
    files = {
        "accumulate.py": NO_SYNC,  # the apex codemod declines it
        "alias.py": "import torch.cuda.amp as A\nctx = A.autocast\n",  # a reference the codemod cannot rewrite
        "star.py": "from torch.cuda.amp import *\nwith autocast():\n    pass\n",
        "modern.py": 'import torch\nwith torch.autocast("cuda"):\n    pass\n',
    }
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    report = migrate_paths([tmp_path], mode="check")
    assert report.exit_code == 1
    found = {r.path.name: r.deprecated for r in report.files}
    assert not any(r.changed for r in report.files)  # none of them can be rewritten ...
    assert found["modern.py"] == [] and found["star.py"] == [(1, "from torch.cuda.amp import *", "torch.cuda.amp.*")]
    assert found["alias.py"] == [(1, "import torch.cuda.amp as A", "torch.cuda.amp"),
                                 (2, "A.autocast", "torch.cuda.amp.autocast")]  # fmt: skip
    assert (9, "amp.scale_loss", "apex.amp.scale_loss") in found["accumulate.py"]
    text = format_report(report)
    assert f"{tmp_path / 'alias.py'}:2: deprecated AMP API torch.cuda.amp.autocast: `A.autocast`" in text
    assert text.endswith("3 files still use deprecated AMP APIs")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == files  # --check changes nothing
    assert migrate_paths([tmp_path / "modern.py"], mode="check").exit_code == 0


def test_comments_of_removed_imports_survive() -> None:
    before = _src('''
        import torch
        from torch.cuda.amp import autocast  # noqa: F401  TODO: drop after upgrade
        from apex import amp  # NVIDIA apex

        model, optimizer = amp.initialize(model, optimizer)
        for x, y in loader:
            loss = criterion(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    ''')
    after, warnings = migrate_source(before)
    assert after == _src('''
        import torch
        # noqa: F401  TODO: drop after upgrade
        # NVIDIA apex

        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    ''')
    assert warnings == []
    compile(after, "train.py", "exec")
    dotted, _ = migrate_source("import torch.cuda.amp  # old\nimport torch\nx = torch.amp.GradScaler\n")
    assert dotted == "# old\nimport torch\nx = torch.amp.GradScaler\n"


CONDITIONAL = _src('''
    import argparse
    import torch
    from apex import amp

    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--opt-level", default="O1")


    def main(args, model, optimizer, loader):
        if args.fp16:
            model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            if args.fp16:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            optimizer.step()
        return model
''')


def test_conditional_apex_becomes_enabled_flags_and_dead_options_are_reported(tmp_path: Path) -> None:
    after, warnings = migrate_source(CONDITIONAL)
    assert after == _src('''
        import argparse
        import torch

        parser = argparse.ArgumentParser()
        parser.add_argument("--fp16", action="store_true")
        parser.add_argument("--opt-level", default="O1")


        def main(args, model, optimizer, loader):
            # amplite: opt_level=args.opt_level is not a literal: migrated as O1
            scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)
            for x, y in loader:
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                if args.fp16:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                scaler.step(optimizer)
                scaler.update()
            return model
    ''')
    assert warnings == [
        "line 7: option `--opt-level` no longer does anything: it fed amp.initialize(opt_level=args.opt_level), "
        "which the migration removed; remove or re-wire it"
    ]
    assert migrate_source(after) == (after, [])
    # The migrated module imports and trains (FP32 path: --fp16 off, as on this CPU machine).
    import torch

    (tmp_path / "train_cond.py").write_text(after)
    with user_modules(tmp_path, "train_cond") as mods, catch_warnings():
        simplefilter("ignore")  # autocast("cuda") on a CPU-only machine says it is disabled
        train_cond = mods["train_cond"]
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
        before = model.weight.detach().clone()
        args = train_cond.parser.parse_args([])
        train_cond.main(args, model, opt, data)
        assert not torch.equal(before, model.weight), "no step was taken"


@pytest.mark.parametrize("else_branch", [False, True])
def test_conditional_initialize_at_module_level(else_branch: bool) -> None:
    tail = 'else:\n    print("fp32")\n' if else_branch else ""
    before = (
        "import torch\nfrom apex import amp\nif use_amp:\n    model, opt = amp.initialize(model, opt)\n" + tail
        + "loss = model(x)\nwith amp.scale_loss(loss, opt) as s:\n    s.backward()\nopt.step()\n"
    )  # fmt: skip
    after, warnings = migrate_source(before)
    kept_if = 'if use_amp:\n    pass\nelse:\n    print("fp32")\n' if else_branch else ""
    assert after == (
        'import torch\nscaler = torch.amp.GradScaler("cuda", enabled=use_amp)\n' + kept_if
        + 'with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):\n    loss = model(x)\n'
        "scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()\n"
    )  # fmt: skip
    assert warnings == []
    compile(after, "m.py", "exec")


def test_comments_inside_parenthesized_imports_survive() -> None:
    before = _src('''
        import torch
        from torch.cuda.amp import (
            autocast,  # for eval
            GradScaler,  # training
        )
        s = GradScaler()
        ctx = autocast
    ''')
    after, warnings = migrate_source(before)
    assert warnings == ["line 7: `autocast` left unchanged (not a call or decorator); migrate it by hand"]
    assert after == _src('''
        import torch
        # training
        from torch.cuda.amp import (
            autocast,  # for eval
        )
        s = torch.amp.GradScaler("cuda")
        ctx = autocast
    ''')
    compile(after, "m.py", "exec")
    gone, _ = migrate_source(before.replace("ctx = autocast\n", ""))
    assert gone == 'import torch\n# for eval\n# training\ns = torch.amp.GradScaler("cuda")\n'


def test_reexported_apex_amp_is_kept() -> None:
    head = 'import torch\nfrom apex import amp\n__all__ = ["amp"]\n'
    after, warnings = migrate_source(head + 'model, opt = amp.initialize(model, opt, opt_level="O0")\n')
    assert after == head + 'scaler = torch.amp.GradScaler("cuda", enabled=False)\n'
    assert warnings == [
        "line 2: `from apex import amp` is kept: `amp` is re-exported (listed in __all__); switch its importers to "
        "torch.amp (with an explicit device), then remove it"
    ]
    compile(after, "m.py", "exec")
