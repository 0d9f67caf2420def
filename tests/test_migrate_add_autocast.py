"""Before/after tests of the --add-autocast codemod (mixed precision for plain FP32 loops)."""

from __future__ import annotations

import libcst as cst
import pytest
from libcst.codemod import CodemodContext

from amplite.migrate import AddAutocastCommand


def run(before: str, dtype: str = "bf16") -> tuple[str, list[str]]:
    """Apply the codemod; return the new code and its warnings."""
    context = CodemodContext()
    after = AddAutocastCommand(context, dtype=dtype).transform_module(cst.parse_module(before)).code  # type: ignore[arg-type]
    return after, context.warnings


LOOP = (
    "import torch\n"
    "\n"
    "model = Net()\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "sched = torch.optim.lr_scheduler.StepLR(opt, 1)\n"
    "# train\n"
    "for epoch in range(3):\n"
    "    for x, y in loader:\n"
    "        x, y = x.cuda(), y.cuda()\n"
    "        opt.zero_grad()\n"
    "\n"
    "        # forward\n"
    "        pred = model(x)  # logits\n"
    "        loss = criterion(pred, y)\n"
    "        loss += 0.1 * penalty(model)\n"
    "        loss.backward()\n"
    "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "        opt.step()  # update\n"
    "        sched.step()\n"
)


def test_bf16_wraps_forward_and_loss_only() -> None:
    after, warnings = run(LOOP)
    assert after == (
        "import torch\n"
        "\n"
        "model = Net()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, 1)\n"
        "# train\n"
        "for epoch in range(3):\n"
        "    for x, y in loader:\n"
        "        x, y = x.cuda(), y.cuda()\n"
        "        opt.zero_grad()\n"
        "\n"
        "        # forward\n"
        '        with torch.autocast("cuda", dtype=torch.bfloat16):\n'
        "            pred = model(x)  # logits\n"
        "            loss = criterion(pred, y)\n"
        "            loss += 0.1 * penalty(model)\n"
        "        loss.backward()\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        opt.step()  # update\n"
        "        sched.step()\n"
    )
    assert warnings == []
    assert run(after) == (after, [])


def test_fp16_adds_a_grad_scaler() -> None:
    after, warnings = run(LOOP, dtype="fp16")
    assert after == (
        "import torch\n"
        "\n"
        "model = Net()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, 1)\n"
        "# train\n"
        'scaler = torch.amp.GradScaler("cuda")\n'
        "for epoch in range(3):\n"
        "    for x, y in loader:\n"
        "        x, y = x.cuda(), y.cuda()\n"
        "        opt.zero_grad()\n"
        "\n"
        "        # forward\n"
        '        with torch.autocast("cuda", dtype=torch.float16):\n'
        "            pred = model(x)  # logits\n"
        "            loss = criterion(pred, y)\n"
        "            loss += 0.1 * penalty(model)\n"
        "        scaler.scale(loss).backward()\n"
        "        scaler.unscale_(opt)\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        scaler.step(opt)  # update\n"
        "        scaler.update()\n"
        "        sched.step()\n"
    )
    assert warnings == []
    assert run(after, dtype="fp16") == (after, [])


def test_device_type_follows_a_torch_device_variable() -> None:
    before = (
        "import torch\n"
        "from torch import nn\n"
        'device = torch.device("cuda" if torch.cuda.is_available() else "cpu")\n'
        "def train(model, device, loader, optimizer):\n"
        "    for data, target in loader:\n"
        "        data, target = data.to(device), target.to(device)\n"
        "        output = model(data)\n"
        "        loss = nn.functional.nll_loss(output, target)\n"
        "        loss.backward(retain_graph=True)\n"
        "        optimizer.step()\n"
    )
    after, _ = run(before, dtype="fp16")
    assert after == (
        "import torch\n"
        "from torch import nn\n"
        'device = torch.device("cuda" if torch.cuda.is_available() else "cpu")\n'
        "def train(model, device, loader, optimizer):\n"
        "    scaler = torch.amp.GradScaler(device.type)\n"
        "    for data, target in loader:\n"
        "        data, target = data.to(device), target.to(device)\n"
        "        with torch.autocast(device.type, dtype=torch.float16):\n"
        "            output = model(data)\n"
        "            loss = nn.functional.nll_loss(output, target)\n"
        "        scaler.scale(loss).backward(retain_graph=True)\n"
        "        scaler.step(optimizer)\n"
        "        scaler.update()\n"
    )


def test_while_loop_with_next_batch_and_missing_torch_import() -> None:
    before = (
        "it = iter(loader)\n"
        "while True:\n"
        "    batch = next(it)\n"
        "    loss = model(**batch).loss\n"
        "    loss.backward()\n"
        "    optimizer.step(); optimizer.zero_grad()\n"
    )
    after, _ = run(before, dtype="fp16")
    assert after == (
        "import torch\n"
        "\n"
        "it = iter(loader)\n"
        'scaler = torch.amp.GradScaler("cuda")\n'
        "while True:\n"
        "    batch = next(it)\n"
        '    with torch.autocast("cuda", dtype=torch.float16):\n'
        "        loss = model(**batch).loss\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer); scaler.update(); optimizer.zero_grad()\n"
    )


def test_files_already_using_amp_are_skipped() -> None:
    code = (
        "import torch\n"
        "scaler = torch.amp.GradScaler()\n"
        "for x in data:\n"
        "    loss = model(x)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
    )
    assert run(code, dtype="fp16") == (code, [])


NOT_UNDERSTOOD = {
    "outside_a_loop": ("loss = f()\nloss.backward()\n", "line 2: `.backward()` is not inside a loop"),
    "two_backward_calls": (
        "for x in data:\n    l1 = d(x)\n    l1.backward()\n    opt_d.step()\n    l2 = g(x)\n    l2.backward()\n",
        "line 3: several `.backward()` calls in one loop; --add-autocast left it unchanged\n"
        "line 6: several `.backward()` calls in one loop",
    ),
    "backward_on_expression": (
        "for x in data:\n    model(x).sum().backward()\n    optimizer.step()\n",
        "line 2: `.backward()` is not a plain `loss.backward()` statement",
    ),
    "no_step": (
        "for x in data:\n    loss = model(x)\n    loss.backward()\n",
        "line 3: no plain `optimizer.step()` in the same loop",
    ),
    "step_with_closure": (
        "for x in data:\n    loss = model(x)\n    loss.backward()\n    optimizer.step(closure)\n",
        "line 3: no plain `optimizer.step()` in the same loop",
    ),
    "only_scheduler_steps": (
        "for x in data:\n    loss = model(x)\n    loss.backward()\n    scheduler.step()\n",
        "line 3: no plain `optimizer.step()` in the same loop",
    ),
    "no_loss_assignment": (
        "for x in data:\n    loss.backward()\n    optimizer.step()\n",
        "line 2: could not find the forward pass computing `loss`",
    ),
    "loss_only_unpacked": (
        "for x, loss in data:\n    y = loss\n    loss = y\n    loss.backward()\n    optimizer.step()\n",
        "line 4: could not find the forward pass computing `loss`",
    ),
}


@pytest.mark.parametrize("name", sorted(NOT_UNDERSTOOD))
def test_code_it_cannot_understand_is_untouched_with_a_warning(name: str) -> None:
    before, warning = NOT_UNDERSTOOD[name]
    after, warnings = run(before, dtype="fp16")
    assert after == before
    assert warnings == f"{warning}; --add-autocast left it unchanged".split("\n")


def test_several_optimizers_are_fine_for_bf16_but_not_fp16() -> None:
    before = (
        "import torch\nfor x in data:\n    loss = model(x)\n    loss.backward()\n    opt_a.step()\n    opt_b.step()\n"
    )
    after, warnings = run(before, dtype="bf16")
    assert after == (
        "import torch\n"
        "for x in data:\n"
        '    with torch.autocast("cuda", dtype=torch.bfloat16):\n'
        "        loss = model(x)\n"
        "    loss.backward()\n"
        "    opt_a.step()\n"
        "    opt_b.step()\n"
    )
    assert warnings == []
    assert run(before, dtype="fp16") == (
        before,
        ["line 4: several optimizers step in this loop; --add-autocast left it unchanged"],
    )


def test_bad_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        AddAutocastCommand(CodemodContext(), dtype="fp8")  # type: ignore[arg-type]


def test_attribute_named_device_is_not_a_device_variable() -> None:
    before = (
        "import torch\n"
        'device = torch.device("cuda")\n'
        "def train(model, loader, optimizer):\n"
        "    for x in loader:\n"
        "        loss = model(x.to(model.device)).sum()\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
    )
    after, _ = run(before)
    assert after == (
        "import torch\n"
        'device = torch.device("cuda")\n'
        "def train(model, loader, optimizer):\n"
        "    for x in loader:\n"
        '        with torch.autocast("cuda", dtype=torch.bfloat16):\n'
        "            loss = model(x.to(model.device)).sum()\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
    )
