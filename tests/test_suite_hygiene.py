"""Meta checks on the test suite itself: tests reach amplite through its public names and the declared
``node.meta`` keys, so that a refactor of internals breaks only the tests that name them on purpose.

Each check walks the tests' syntax trees (no import of the test modules), and fails naming file:line.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from amplite.passes import meta

TESTS = Path(__file__).parent

#: (test file, private name) -> why the test must reach it. An entry no test uses any more fails too.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {
    **{
        ("test_fp8.py", name): "the CUDA granule padding of torch._scaled_mm's operands: on the CPU the public "
        "scaled_mm_2d reaches it only as a whole, and its edge cases (no copy when the shape fits, the dtype kept) "
        "are what the mutation run found unpinned"
        for name in ("_pad", "_up")
    },
    **{
        ("test_spec_flow.py", name): "the spec's JSON codec tables are the one hand-kept list of its fields: "
        "issue 46 asks for a test that compares such a list with the definition it mirrors"
        for name in ("_DECODE", "_ENCODE")
    },
    ("test_spec_flow.py", "amplite.integrations._lazy"): "LazyAmplite is what both integrations (Lightning, "
    "Trainer) construct: the test checks the refusal at construction without building either framework's trainer",
    **{
        ("test_contract_backend_cutensor.py", name): "unit tests of the cuTENSOR backend against a fake nvmath: "
        "the plan cache, probe memo and their helpers are observable only on a GPU, and these tests kill the "
        "mutants of amplite/ops/cutensor_backend.py on CPU"
        for name in ("_plans", "_FAILED", "_free", "_probes", "_stride0_c", "_key", "_version_tuple", "_one_line",
                     "_execute", "_run_probe", "_alignment")
    },
    **{
        ("test_contract_backend.py", name): "the backend's probe memo and alignment helper, reached on CPU only "
        "through the fake nvmath (mutmut scope: amplite/ops)"
        for name in ("_probes", "_run_probe", "_stride0_c", "_alignment")
    },
    ("test_contract_op.py", "_alignment"): "the plan key must tell apart buffers of different alignment; only a GPU "
    "run reaches it through contract()",
    ("test_contract_op.py", "_key"): "as _alignment: the plan-cache key of two differently aligned views",
    ("fake_nvmath.py", "_alignment"): "the fake nvmath pins the alignment to 256 (a CUDA allocation's) for "
    "CPU tensors, whose allocator aligns less",
    ("test_contract_fallback.py", "_init_fn"): "torch's CustomOpDef._init_fn (not amplite's): runs the "
    "contract op's Python implementation under the test's dispatch mode, which torch offers no public hook for",
    ("test_fp8.py", "_kernel_ok"): "the FP8 GEMM probe is memoised per device type; a test that refuses "
    "torch._scaled_mm must clear the memo before and after, or the fallback is never taken",
    ("test_gpu_suite.py", "_probes"): "a GPU test that plants a stale probe to check reset_probes() drops it",
    ("test_calibration.py", "_SAME_ELEMENTS"): "the test's reference observer must skip exactly the ops the "
    "observer skips; a copy would be a hand-kept mirror (calibration becomes a pass in issue 46 item 2)",
    ("test_contract_fallback.py", "_decompose_contractions"): "the public path (package_aoti) compiles with "
    "inductor, minutes on CPU; the decomposition it packages is checked directly",
    ("test_integration_ddp.py", "_refuse_sharded"): "Lightning builds FSDPStrategy only on GPUs; no CPU trainer "
    "reaches the plugin's refusal",
    ("test_security_codegen.py", "_logging"): "torch logs at ERROR before it raises only inside a fake-tensor "
    "failure; the CLI's logging context is checked directly instead of crafting such a model",
    ("test_security_io.py", "amplite.migrate._safety"): "a SIGKILLed worker is the case under test; libcst's "
    "own crashes cannot be provoked on purpose through the public migrate()",
}


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every private amplite name a test module imports or reads as an attribute."""
    tree = _tree(path)
    amplite_names: set[str] = set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "amplite":
            if any(_is_private(part) for part in node.module.split(".")):
                found.append((node.lineno, node.module))
            for alias in node.names:
                amplite_names.add(alias.asname or alias.name)
                if _is_private(alias.name):
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "amplite":
                    amplite_names.add((alias.asname or alias.name).split(".")[0])
                    if any(_is_private(part) for part in alias.name.split(".")):
                        found.append((node.lineno, alias.name))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args:
            # mod = importlib.import_module("amplite.x"): the module behind an op of the same name
            arg = node.value.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("amplite."):
                amplite_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in amplite_names:
                found.append((node.lineno, node.attr))
        # monkeypatch.setattr(module, "_name", ...) and getattr(module, "_name") reach a private name too
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            if (
                isinstance(target, ast.Name)
                and target.id in amplite_names
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and _is_private(name.value)
            ):
                found.append((node.lineno, name.value))
    return found


def test_tests_reach_no_private_amplite_name_outside_the_allow_list() -> None:
    offenders, used = [], set()
    for path in sorted(TESTS.glob("*.py")):
        for line, name in private_uses(path):
            if (path.name, name) in PRIVATE_ALLOWED:
                used.add((path.name, name))
            else:
                offenders.append(f"{path.name}:{line}: {name}")
    assert not offenders, "use the public API or public behaviour (or allow-list with a reason):\n" + "\n".join(
        offenders
    )
    stale = sorted(set(PRIVATE_ALLOWED) - used)
    assert not stale, f"allow-list entries no test uses any more (remove them): {stale}"


def test_the_private_name_scan_sees_imports_attributes_and_setattr(tmp_path: Path) -> None:
    """The scan above can fail: each way of reaching a private name is reported."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import amplite.ops.cutensor_backend as cb\n"
        "from amplite.converter.calibration import _SAME_ELEMENTS\n"
        "from amplite.migrate._safety import run_in_pool\n"
        "def test(monkeypatch):\n"
        "    cb._plans.clear()\n"
        "    monkeypatch.setattr(cb, '_probes', {})\n"
        "    other = object()\n"
        "    other._private = 1\n"  # not an amplite name: not reported
    )
    expected = [(2, "_SAME_ELEMENTS"), (3, "amplite.migrate._safety"), (5, "_plans"), (6, "_probes")]
    assert sorted(private_uses(probe)) == expected


def test_tests_spell_amplite_meta_keys_through_their_constants() -> None:
    """``node.meta`` keys amplite's passes write are read and written in tests as the constants of
    ``amplite.passes.meta`` (``PRECISION_KEY``...), so that renaming a key cannot leave a test checking a key
    no pass writes any more (a ``"amplite_range" not in n.meta`` would then pass for nothing)."""
    declared = set(meta.KEYS)
    offenders = [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for path in sorted(TESTS.glob("*.py"))
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Constant) and node.value in declared
    ]
    assert not offenders, "use the constants of amplite.passes.meta:\n" + "\n".join(offenders)


def exact_counter_dicts(tree: ast.AST) -> list[int]:
    """Lines that compare a pass's ``counters`` with a whole dict literal (``counters == {...}``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            sides = (node.left, node.comparators[0])
            if any(isinstance(s, ast.Dict) for s in sides) and any("counters" in ast.unparse(s) for s in sides):
                lines.append(node.lineno)
    return lines


def test_counters_are_asserted_per_counter_not_as_a_whole_dict() -> None:
    """A pass may add a counter without breaking every test of it: tests state the counters they mean
    (``counters.items() >= {...}.items()``, ``counters["x"] >= 1``) and check the graph for the rest."""
    offenders = [
        f"{path.name}:{line}"
        for path in sorted(TESTS.glob("*.py"))
        for line in exact_counter_dicts(_tree(path))
    ]
    assert not offenders, "assert the counters meant, not the whole dict:\n" + "\n".join(offenders)
    probe = ast.parse("assert r.counters == {'casts_inserted': 1}\nassert r.counters.items() >= {'a': 1}.items()")
    assert exact_counter_dicts(probe) == [1]  # the scan sees the form it forbids, and lets the subset pass
