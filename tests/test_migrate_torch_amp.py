"""Before/after tests of the torch.cuda.amp / torch.cpu.amp -> torch.amp codemod."""

from __future__ import annotations

import libcst as cst
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libcst.codemod import CodemodContext

from amplite.migrate import TorchAmpCommand


def run(before: str) -> tuple[str, list[str]]:
    """Apply the codemod; return the new code and its warnings."""
    context = CodemodContext()
    after = TorchAmpCommand(context).transform_module(cst.parse_module(before)).code
    return after, context.warnings


CASES = {
    "attribute_chain": (
        "import torch\n\nwith torch.cuda.amp.autocast():\n    y = model(x)\n",
        'import torch\n\nwith torch.amp.autocast("cuda"):\n    y = model(x)\n',
    ),
    "from_torch_cuda_import_amp_adds_torch": (
        "from torch.cuda import amp\n\nwith amp.autocast():\n    y = model(x)\n",
        'import torch\n\nwith torch.amp.autocast("cuda"):\n    y = model(x)\n',
    ),
    "aliases_and_positional_arguments": (
        "import os\n"
        "from torch.cuda.amp import autocast as ac, GradScaler\n"
        "\n"
        "scaler = GradScaler(1024.0, 2.0, enabled=True)\n"
        "with ac(False, torch.bfloat16):\n"
        "    pass\n",
        "import os\n"
        "import torch\n"
        "\n"
        'scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_factor=2.0, enabled=True)\n'
        'with torch.amp.autocast("cuda", enabled=False, dtype=torch.bfloat16):\n'
        "    pass\n",
    ),
    "cpu_autocast_keeps_all_arguments": (
        "import torch\n"
        "with torch.cpu.amp.autocast(enabled=flag, dtype=torch.bfloat16, cache_enabled=False):\n"
        "    pass\n",
        "import torch\n"
        'with torch.amp.autocast("cpu", enabled=flag, dtype=torch.bfloat16, cache_enabled=False):\n'
        "    pass\n",
    ),
    "torch_alias": (
        "import torch as th\ns = th.cuda.amp.GradScaler()\n",
        'import torch as th\ns = th.amp.GradScaler("cuda")\n',
    ),
    "dotted_import_becomes_import_torch": (
        "import torch.cuda.amp\nimport numpy as np\n\nwith torch.cuda.amp.autocast():\n    pass\n",
        'import torch\nimport numpy as np\n\nwith torch.amp.autocast("cuda"):\n    pass\n',
    ),
    "dotted_import_dropped_next_to_import_torch": (
        "import torch\nimport torch.cuda.amp\ns = torch.cuda.amp.GradScaler()\n",
        'import torch\ns = torch.amp.GradScaler("cuda")\n',
    ),
    "nested_with_and_comments": (
        "import torch\n"
        "from torch.cuda.amp import autocast\n"
        "\n"
        "with torch.no_grad():\n"
        "    # evaluation in half precision\n"
        "    with autocast(dtype=torch.float16):  # inner\n"
        "        with torch.cpu.amp.autocast():\n"
        "            y = model(x)  # forward\n",
        "import torch\n"
        "\n"
        "with torch.no_grad():\n"
        "    # evaluation in half precision\n"
        '    with torch.amp.autocast("cuda", dtype=torch.float16):  # inner\n'
        '        with torch.amp.autocast("cpu"):\n'
        "            y = model(x)  # forward\n",
    ),
    "multi_item_with": (
        "import torch\nwith torch.no_grad(), torch.cuda.amp.autocast(), open(f) as fh:\n    pass\n",
        'import torch\nwith torch.no_grad(), torch.amp.autocast("cuda"), open(f) as fh:\n    pass\n',
    ),
    "multi_line_call_keeps_layout_and_comments": (
        "import torch\n"
        "scaler = torch.cuda.amp.GradScaler(\n"
        "    init_scale=2.0**14,  # lower than the default\n"
        "    growth_interval=1000,\n"
        ")\n",
        "import torch\n"
        "scaler = torch.amp.GradScaler(\n"
        '    "cuda",\n'
        "    init_scale=2.0**14,  # lower than the default\n"
        "    growth_interval=1000,\n"
        ")\n",
    ),
    "hanging_indent_call": (
        "import torch\n"
        "with torch.cuda.amp.autocast(enabled=True,\n"
        "                             dtype=torch.float16):\n"
        "    pass\n",
        "import torch\n"
        'with torch.amp.autocast("cuda", enabled=True,\n'
        "                             dtype=torch.float16):\n"
        "    pass\n",
    ),
    "custom_fwd_and_bwd": (
        "import torch\n"
        "from torch.cuda.amp import custom_bwd\n"
        "\n"
        "class F(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)\n"
        "    def forward(ctx, x):\n"
        "        return x\n"
        "\n"
        "    @staticmethod\n"
        "    @custom_bwd  # gradients in the forward dtype\n"
        "    def backward(ctx, g):\n"
        "        return g\n",
        "import torch\n"
        "\n"
        "class F(torch.autograd.Function):\n"
        "    @staticmethod\n"
        '    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)\n'
        "    def forward(ctx, x):\n"
        "        return x\n"
        "\n"
        "    @staticmethod\n"
        '    @torch.amp.custom_bwd(device_type="cuda")  # gradients in the forward dtype\n'
        "    def backward(ctx, g):\n"
        "        return g\n",
    ),
    "custom_fwd_called_on_a_function": (
        "import torch\nf = torch.cuda.amp.custom_fwd(fn)\ng = torch.cuda.amp.custom_fwd(\n    fn,\n)\n",
        "import torch\n"
        'f = torch.amp.custom_fwd(fn, device_type="cuda")\n'
        "g = torch.amp.custom_fwd(\n"
        "    fn,\n"
        '    device_type="cuda",\n'
        ")\n",
    ),
    "annotations": (
        "import torch\n"
        "from torch.cuda.amp import GradScaler\n"
        "\n"
        "def step(scaler: torch.cuda.amp.GradScaler, other: GradScaler) -> None:\n"
        "    pass\n",
        "import torch\n\ndef step(scaler: torch.amp.GradScaler, other: torch.amp.GradScaler) -> None:\n    pass\n",
    ),
    "decorator_call_of_autocast": (
        "import torch\n@torch.cuda.amp.autocast()\ndef forward(x):\n    return x\n",
        'import torch\n@torch.amp.autocast("cuda")\ndef forward(x):\n    return x\n',
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewrite_and_idempotence(name: str) -> None:
    before, expected = CASES[name]
    after, warnings = run(before)
    assert after == expected
    assert warnings == []
    assert run(after) == (after, [])


def test_modern_code_is_untouched() -> None:
    code = (
        "import torch\n"
        "from torch import amp\n"
        'scaler = torch.amp.GradScaler("cuda")\n'
        'with torch.autocast("cuda"), amp.autocast("cpu"):\n'
        "    x = torch.cuda.is_available()  # not AMP\n"
    )
    assert run(code) == (code, [])


def test_unrewritable_references_are_kept_with_warnings() -> None:
    before = (
        "import torch\n"
        "from torch.cuda.amp import autocast\n"
        "\n"
        "with autocast():\n"
        "    pass\n"
        "make_ctx = autocast\n"
        "with autocast(*args):\n"
        "    pass\n"
    )
    after, warnings = run(before)
    assert after == (
        "import torch\n"
        "from torch.cuda.amp import autocast\n"
        "\n"
        'with torch.amp.autocast("cuda"):\n'
        "    pass\n"
        "make_ctx = autocast\n"
        "with autocast(*args):\n"
        "    pass\n"
    )
    assert warnings == [
        "line 6: `autocast` left unchanged (not a call or decorator); migrate it by hand",
        "line 7: `autocast` left unchanged (unpacked or extra positional arguments); migrate it by hand",
    ]


def test_dotted_import_kept_while_old_api_remains() -> None:
    before = "import torch.cuda.amp\nctx = torch.cuda.amp.autocast\n"
    after, warnings = run(before)
    assert after == before
    assert warnings == [
        "line 2: `torch.cuda.amp.autocast` left unchanged (not a call or decorator); migrate it by hand"
    ]


def test_too_many_positionals_is_declined() -> None:
    before = "import torch\ns = torch.cuda.amp.GradScaler(1.0, 2.0, 0.5, 100, True, 'extra')\n"
    after, warnings = run(before)
    assert after == before
    assert len(warnings) == 1 and warnings[0].startswith("line 2: `torch.cuda.amp.GradScaler` left unchanged")


IMPORTS = {
    "attribute": ("import torch\n", "torch.cuda.amp.{}"),
    "module_alias": ("import torch\nfrom torch.cuda import amp as A\n", "A.{}"),
    "name": ("import torch\nfrom torch.cuda.amp import autocast, GradScaler\n", "{}"),
    "name_alias": ("import torch\nfrom torch.cuda.amp import autocast as AC, GradScaler as GS\n", "{}"),
}
ALIASES = {"name_alias": {"autocast": "AC", "GradScaler": "GS"}}


@settings(max_examples=12, deadline=None, database=None)
@given(
    style=st.sampled_from(sorted(IMPORTS)),
    autocast_args=st.lists(
        st.sampled_from(["enabled=flag", "dtype=torch.bfloat16", "cache_enabled=False"]), unique=True
    ),
    scaler_args=st.lists(st.sampled_from(["init_scale=1024.0", "growth_interval=10", "enabled=flag"]), unique=True),
    comment=st.booleans(),
)
def test_generated_scripts_migrate_cleanly(
    style: str, autocast_args: list[str], scaler_args: list[str], comment: bool
) -> None:
    header, pattern = IMPORTS[style]
    names = ALIASES.get(style, {})
    suffix = "  # keep me" if comment else ""
    before = (
        f"{header}"
        f"scaler = {pattern.format(names.get('GradScaler', 'GradScaler'))}({', '.join(scaler_args)}){suffix}\n"
        "for x in data:\n"
        f"    with {pattern.format(names.get('autocast', 'autocast'))}({', '.join(autocast_args)}):{suffix}\n"
        "        loss = model(x)\n"
    )
    after, warnings = run(before)
    assert warnings == []
    scaler_call = ", ".join(['"cuda"', *scaler_args])
    autocast_call = ", ".join(['"cuda"', *autocast_args])
    assert after == (
        "import torch\n"
        f"scaler = torch.amp.GradScaler({scaler_call}){suffix}\n"
        "for x in data:\n"
        f"    with torch.amp.autocast({autocast_call}):{suffix}\n"
        "        loss = model(x)\n"
    )
    assert run(after) == (after, [])
