"""Before/after tests of the apex amp -> torch.amp codemod."""

from __future__ import annotations

import libcst as cst
import pytest
from libcst.codemod import CodemodContext

from amplite.migrate import ApexAmpCommand


def run(before: str) -> tuple[str, list[str]]:
    """Apply the codemod; return the new code and its warnings."""
    context = CodemodContext()
    after = ApexAmpCommand(context).transform_module(cst.parse_module(before)).code
    return after, context.warnings


def loop(init: str, body: str = "") -> str:
    """A module-level apex training script with the given amp.initialize line."""
    return (
        "import torch\n"
        "from apex import amp\n"
        "\n"
        f"{init}\n"
        "for x, y in loader:\n"
        f"{body}"
        "    out = model(x)\n"
        "    loss = crit(out, y)\n"
        "    with amp.scale_loss(loss, optimizer) as scaled_loss:\n"
        "        scaled_loss.backward()\n"
        "    optimizer.step()\n"
    )


def migrated(scaler: str, autocast: str | None = 'torch.autocast("cuda", dtype=torch.float16)') -> str:
    """The expected migration of :func:`loop` (``scaler`` replaces the initialize line)."""
    forward = (
        f"    with {autocast}:\n        out = model(x)\n        loss = crit(out, y)\n"
        if autocast
        else "    out = model(x)\n    loss = crit(out, y)\n"
    )
    return (
        "import torch\n"
        "\n"
        f"{scaler}\n"
        "for x, y in loader:\n"
        f"{forward}"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
    )


LEVELS = {
    "default_is_O1": ("model, optimizer = amp.initialize(model, optimizer)", 'scaler = torch.amp.GradScaler("cuda")'),
    "O1": (
        'model, optimizer = amp.initialize(model, optimizer, opt_level="O1")',
        'scaler = torch.amp.GradScaler("cuda")',
    ),
    "O2": (
        'model, optimizer = amp.initialize(model, optimizer, opt_level="O2")',
        "# amplite: apex O2 (FP16 weights, FP32 master copy) is now autocast: weights stay FP32\n"
        'scaler = torch.amp.GradScaler("cuda")',
    ),
    "O3_has_no_loss_scaling": (
        "model, optimizer = amp.initialize(model, optimizer, opt_level='O3')",
        "# amplite: apex O3 (pure FP16, no loss scaling) is now autocast: weights stay FP32\n"
        'scaler = torch.amp.GradScaler("cuda", enabled=False)',
    ),
    "static_loss_scale": (
        'model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=128.0)',
        "# amplite: apex's static loss_scale=128.0 is now the initial dynamic scale\n"
        'scaler = torch.amp.GradScaler("cuda", init_scale=128.0)',
    ),
    "dynamic_loss_scale_and_verbosity": (
        'model, optimizer = amp.initialize(model, optimizer, loss_scale="dynamic", verbosity=0)',
        'scaler = torch.amp.GradScaler("cuda")',
    ),
    "non_literal_level_and_dropped_options": (
        "model, optimizer = amp.initialize(model, optimizer,\n"
        "                                  opt_level=args.opt_level,  # from the CLI\n"
        "                                  keep_batchnorm_fp32=True, loss_scale=args.loss_scale)",
        "# amplite: opt_level=args.opt_level is not a literal: migrated as O1\n"
        "# amplite: dropped amp.initialize options: keep_batchnorm_fp32, loss_scale\n"
        "# from the CLI\n"  # every comment survives (issue 14.9)
        'scaler = torch.amp.GradScaler("cuda")',
    ),
}
#: Options that no longer do anything are reported (issue 14.11); literals only get the note.
LEVEL_WARNINGS = {
    "non_literal_level_and_dropped_options": [
        "line 4: `args.opt_level` (amp.initialize opt_level=) no longer does anything after the migration; "
        "remove the option that sets it or re-wire it",
        "line 4: `args.loss_scale` (amp.initialize loss_scale=) no longer does anything after the migration; "
        "remove the option that sets it or re-wire it",
    ],
}


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_opt_levels(name: str) -> None:
    init, scaler = LEVELS[name]
    after, warnings = run(loop(init))
    assert after == migrated(scaler)
    assert warnings == LEVEL_WARNINGS.get(name, [])
    assert run(after) == (after, [])


def test_enabled_flag_drives_scaler_and_autocast() -> None:
    after, _ = run(loop("model, optimizer = amp.initialize(model, optimizer, enabled=args.amp)"))
    assert after == migrated(
        'scaler = torch.amp.GradScaler("cuda", enabled=args.amp)',
        'torch.autocast("cuda", dtype=torch.float16, enabled=scaler.is_enabled())',
    )


def test_O0_is_fp32_with_a_disabled_scaler_and_no_autocast() -> None:
    after, _ = run(loop('model, optimizer = amp.initialize(model, optimizer, opt_level="O0")'))
    assert after == migrated('scaler = torch.amp.GradScaler("cuda", enabled=False)', autocast=None)


def test_scaler_shared_across_functions_checkpoints_and_clipping() -> None:
    before = (
        '"""Training entry point."""\n'
        "import torch\n"
        "try:\n"
        "    from apex import amp\n"
        "except ImportError:\n"
        "    amp = None\n"
        "\n"
        "# the scaler lives in main()\n"
        "\n"
        "\n"
        "def main(args):\n"
        "    model, optimizer = build(args)\n"
        '    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")\n'
        "    if args.resume:\n"
        "        ckpt = torch.load(args.resume)\n"
        '        amp.load_state_dict(ckpt["amp"])\n'
        "    for epoch in range(args.epochs):\n"
        "        train(model, optimizer, args)\n"
        '        torch.save({"model": model.state_dict(), "amp": amp.state_dict()}, "ckpt.pt")\n'
        "\n"
        "\n"
        "def train(model, optimizer, args):\n"
        "    for x, y in args.loader:\n"
        "        loss = model(x, y)\n"
        "        with amp.scale_loss(loss, optimizer, delay_unscale=False) as scaled_loss:\n"
        "            scaled_loss.backward()\n"
        "        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip)\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
    )
    after, warnings = run(before)
    assert after == (
        '"""Training entry point."""\n'
        "import torch\n"
        "\n"
        "# the scaler lives in main()\n"
        "\n"
        "\n"
        "def main(args):\n"
        "    model, optimizer = build(args)\n"
        "    global scaler\n"
        '    scaler = torch.amp.GradScaler("cuda")\n'
        "    if args.resume:\n"
        "        ckpt = torch.load(args.resume)\n"
        "        # amplite: GradScaler state replaces apex amp state in checkpoints\n"
        '        scaler.load_state_dict(ckpt["amp"])\n'
        "    for epoch in range(args.epochs):\n"
        "        train(model, optimizer, args)\n"
        '        torch.save({"model": model.state_dict(), "amp": scaler.state_dict()}, "ckpt.pt")\n'
        "\n"
        "\n"
        "def train(model, optimizer, args):\n"
        "    for x, y in args.loader:\n"
        '        with torch.autocast("cuda", dtype=torch.float16):\n'
        "            loss = model(x, y)\n"
        "        scaler.scale(loss).backward()\n"
        "        scaler.unscale_(optimizer)\n"
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)\n"
        "        scaler.step(optimizer)\n"
        "        scaler.update()\n"
        "        optimizer.zero_grad()\n"
    )
    assert warnings == []
    assert run(after) == (after, [])


def test_master_params_without_the_model_in_scope_uses_param_groups() -> None:
    before = (
        "from apex import amp\n"
        "import torch\n"
        "def main(model, opt):\n"
        "    model, opt = amp.initialize(model, opt)\n"
        "    run(opt)\n"
        "def run(opt):\n"
        "    loss = compute()\n"
        "    with amp.scale_loss(loss, opt) as s:\n"
        "        s.backward()\n"
        "    clip(amp.master_params(opt))\n"
        "    opt.step()\n"
    )
    after, _ = run(before)
    assert after == (
        "import torch\n"
        "def main(model, opt):\n"
        "    global scaler\n"
        '    scaler = torch.amp.GradScaler("cuda")\n'
        "    run(opt)\n"
        "def run(opt):\n"
        '    with torch.autocast("cuda", dtype=torch.float16):\n'
        "        loss = compute()\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.unscale_(opt)\n"
        '    clip((p for group in opt.param_groups for p in group["params"]))\n'
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
    )


def test_scaled_loss_used_twice_gets_a_variable_and_comments_survive() -> None:
    before = (
        "import torch\n"
        "import apex\n"
        "\n"
        "net2, opt2 = apex.amp.initialize(net, opt)\n"
        "for x in data:\n"
        "    l = net2(x).sum()\n"
        "    # backward with loss scaling\n"
        "    with apex.amp.scale_loss(l, opt2) as s:  # scale\n"
        "        s.backward(retain_graph=True)\n"
        "        log(s.item())  # scaled value\n"
        "    opt2.step(); opt2.zero_grad(); sched.step()  # update\n"
    )
    after, _ = run(before)
    assert after == (
        "import torch\n"
        "\n"
        "net2, opt2 = net, opt\n"
        'scaler = torch.amp.GradScaler("cuda")\n'
        "for x in data:\n"
        '    with torch.autocast("cuda", dtype=torch.float16):\n'
        "        l = net2(x).sum()\n"
        "    # backward with loss scaling\n"
        "    s = scaler.scale(l)  # scale\n"
        "    s.backward(retain_graph=True)\n"
        "    log(s.item())  # scaled value\n"
        "    scaler.step(opt2); scaler.update(); opt2.zero_grad(); sched.step()  # update\n"
    )


def test_scaler_name_avoids_collisions_and_torch_import_is_added() -> None:
    before = (
        "from apex import amp\n"
        "scaler = 2.0\n"
        "model, optimizer = amp.initialize(model, optimizer)\n"
        "loss = model(x)\n"
        "with amp.scale_loss(loss, optimizer) as s:\n"
        "    s.backward()\n"
        "optimizer.step()\n"
    )
    after, warnings = run(before)
    assert after == (
        "import torch\n"
        "\n"  # AddImportsVisitor separates the import block it creates
        "scaler = 2.0\n"
        'grad_scaler = torch.amp.GradScaler("cuda")\n'
        'with torch.autocast("cuda", dtype=torch.float16):\n'
        "    loss = model(x)\n"
        "grad_scaler.scale(loss).backward()\n"
        "grad_scaler.step(optimizer)\n"
        "grad_scaler.update()\n"
    )
    assert warnings == []


def test_guard_with_other_statements_is_kept() -> None:
    before = (
        "import torch\n"
        "try:\n"
        "    from apex import amp\n"
        "    HAS_APEX = True\n"
        "except ImportError:\n"
        "    HAS_APEX = False\n"
        "model, optimizer = amp.initialize(model, optimizer)\n"
    )
    after, _ = run(before)
    assert after == (
        "import torch\n"
        "try:\n"
        "    HAS_APEX = True\n"
        "except ImportError:\n"
        "    HAS_APEX = False\n"
        'scaler = torch.amp.GradScaler("cuda")\n'
    )


UNSUPPORTED = {
    "unknown_api": (
        "from apex import amp\n"
        'amp.register_float_function(torch, "sigmoid")\n'
        "model, optimizer = amp.initialize(model, optimizer)\n",
        "line 2: `amp.register_float_function` has no torch.amp equivalent",
    ),
    "no_initialize": (
        "from apex import amp\nwith amp.scale_loss(loss, optimizer) as s:\n    s.backward()\noptimizer.step()\n",
        "line 2: no amp.initialize in this file",
    ),
    "initialize_in_else": (
        "from apex import amp\nif fp32:\n    pass\nelse:\n    model, optimizer = amp.initialize(model, optimizer)\n",
        "line 5: amp.initialize must be a plain statement in a function or module body, or in one `if` there",
    ),
    "o3_under_if": (
        'from apex import amp\nif f:\n    model, opt = amp.initialize(model, opt, opt_level="O3")\n',
        "line 3: apex O3 under an `if`: no scaler to carry the condition",
    ),
    "initialize_in_nested_if": (
        "from apex import amp\nif a:\n    if b:\n        model, optimizer = amp.initialize(model, optimizer)\n",
        "line 4: amp.initialize must be a plain statement in a function or module body, or in one `if` there",
    ),
    "no_forward_before_scale_loss": (
        "from apex import amp\n"
        "model, optimizer = amp.initialize(model, optimizer)\n"
        "with amp.scale_loss(loss, optimizer) as s:\n"
        "    s.backward()\n"
        "optimizer.step()\n",
        "line 3: cannot place autocast: no forward pass computing `loss` in the statements before amp.scale_loss "
        "in its block (a forward inside another `with`, a loop or a helper block is not followed); without "
        "autocast the migrated file would train in FP32",
    ),
    "inference_only": (
        "from apex import amp\nmodel = amp.initialize(model)\n",
        "line 2: amp.initialize needs exactly one optimizer (not a list, not inference-only)",
    ),
    "optimizer_list": (
        "from apex import amp\nmodels, opts = amp.initialize([a, b], [o1, o2])\n",
        "line 2: amp.initialize needs exactly one optimizer (not a list, not inference-only)",
    ),
    "scale_loss_outside_with": (
        "from apex import amp\n"
        "model, optimizer = amp.initialize(model, optimizer)\n"
        "ctx = amp.scale_loss(loss, optimizer)\n",
        "line 3: amp.scale_loss is only migrated as `with amp.scale_loss(...) as x:`",
    ),
    "no_step_after_scale_loss": (
        "from apex import amp\n"
        "model, optimizer = amp.initialize(model, optimizer)\n"
        "with amp.scale_loss(loss, optimizer) as s:\n"
        "    s.backward()\n"
        "step_elsewhere(optimizer)\n",
        "line 3: no plain `optimizer.step()` after amp.scale_loss in this function",
    ),
    "module_passed_around": (
        "from apex import amp\nmodel, optimizer = amp.initialize(model, optimizer)\nuse(amp)\n",
        "line 3: apex amp is used other than through a supported call",
    ),
    "unknown_opt_level": (
        'from apex import amp\nmodel, optimizer = amp.initialize(model, optimizer, opt_level="O4")\n',
        'line 2: unknown opt_level "O4"',
    ),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_files_are_left_untouched_with_a_warning(name: str) -> None:
    before, warning = UNSUPPORTED[name]
    after, warnings = run(before)
    assert after == before
    assert warnings == [f"{warning}; the file is left unchanged"]


def test_files_without_apex_are_untouched() -> None:
    code = "import torch\nfor x in data:\n    loss = model(x)\n    loss.backward()\n    optimizer.step()\n"
    assert run(code) == (code, [])
