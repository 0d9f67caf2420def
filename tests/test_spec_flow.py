"""One ConvertSpec from every entry point to the passes (issue 46): built once, handed down whole, serialised
whole, and no precision or level string compared anywhere past its parser."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import amplite
from amplite.batch import Job, defaults_from_options
from amplite.converter import pipeline
from amplite.errors import ConfigError
from amplite.options import ConvertOptions
from amplite.policy import Level, Override, RuleSource
from amplite.spec import PATH_DEFAULTS, ConvertSpec, Fp8Spec, RangeSpec
from fixtures.zoo import make

ROOT = Path(__file__).resolve().parents[1]

# -- to_json / from_json ------------------------------------------------------------------------------------------

_names = st.text("abcxyz_.*", min_size=1, max_size=8)
_override = st.builds(
    Override,
    st.sampled_from(["keep_fp32", "force_low"]),
    st.builds(lambda p, n: p + n, st.sampled_from(["", "op:", "module:", "node:"]), _names),
    st.sampled_from([s for s in RuleSource if s.is_override]),
    st.sampled_from(["", "isolated-error"]),
)
_ranges = st.builds(
    RangeSpec,
    st.sampled_from([None, True, False]),
    st.floats(min_value=1.0, max_value=6e4),
    st.one_of(st.none(), st.integers(1, 1 << 20)),
    st.one_of(st.none(), st.floats(min_value=50.0, max_value=99.999)),
)
_specs = st.builds(
    ConvertSpec,
    precision=st.sampled_from([torch.float16, torch.bfloat16]),
    level=st.sampled_from(list(Level)),
    level_source=st.sampled_from(["argument", "AMPLITE_LEVEL", "default"]),
    overrides=st.lists(_override, max_size=4).map(tuple),
    low_precision_io=st.booleans(),
    dynamic_batch=st.booleans(),
    dynamic_dims=st.dictionaries(
        _names, st.lists(st.integers(-3, 3), min_size=1, max_size=3).map(tuple), max_size=3
    ).map(lambda d: tuple(d.items())),
    fuse=st.booleans(),
    fuse_reason=st.text(max_size=20),
    ranges=_ranges,
    fold_batchnorm=st.booleans(),
    gpu_profile=st.sampled_from(["H100", "A100", "L4"]),
    fp8=st.one_of(st.none(), st.builds(Fp8Spec.of, st.booleans())),
    path=st.sampled_from(list(PATH_DEFAULTS)),
    module_prefix=st.sampled_from(["", "lm."]),
)


@settings(max_examples=150, deadline=None)
@given(_specs)
def test_to_json_from_json_round_trips_every_spec(spec: ConvertSpec) -> None:
    text = json.dumps(spec.to_json(), allow_nan=False)  # plain JSON: it goes into .pt2 archives
    assert ConvertSpec.from_json(json.loads(text)) == spec


def test_the_json_codec_covers_exactly_the_spec_fields() -> None:
    """The decoder table is the one hand-kept list here: it must name every field, and no other."""
    from amplite.spec import _DECODE, _ENCODE

    names = {f.name for f in fields(ConvertSpec)}
    assert set(_DECODE) == names and set(_ENCODE) <= names
    assert set(ConvertSpec().to_json()) == names


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"level": "O9"}, "level"),
        ({"precision": "fp8"}, "precision"),  # the low dtype: FP8 is its own field
        ({"precision": "fp32"}, "precision"),
        ({"low_precision_io": 1}, "low_precision_io"),
        ({"dynamic_dims": {"x": ["1"]}}, "dynamic_dims"),
        ({"ranges": {"enabled": None}}, "ranges"),
        ({"overrides": [{"action": "keep_fp32", "pattern": "x", "source": "range", "why": ""}]}, "overrides"),
        ({"fp8": {"activations": "sometimes", "reason": "", "weights": ""}}, "fp8"),
        ({"path": "elsewhere"}, "path"),
    ],
)
def test_from_json_refuses_a_bad_field_in_one_line_naming_it(change: dict, field: str) -> None:
    data = {**ConvertSpec().to_json(), **change}
    with pytest.raises(ConfigError, match=f"field '{field}' is not valid") as info:
        ConvertSpec.from_json(data)
    assert "\n" not in info.value.one_line() and info.value.exit_code == 2


def test_from_json_refuses_missing_and_unknown_fields() -> None:
    data = ConvertSpec().to_json()
    for bad in ({k: v for k, v in data.items() if k != "level"}, {**data, "script": "x"}, [1, 2]):
        with pytest.raises(ConfigError, match="not a ConvertSpec record"):
            ConvertSpec.from_json(bad)


# -- per-path defaults are one table ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATH_DEFAULTS))
def test_each_path_takes_its_defaults_from_the_table(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AMPLITE_LEVEL", raising=False)
    default = PATH_DEFAULTS[path]
    spec = ConvertOptions().spec(path)
    assert spec.path == path and spec.level is default["level"] and spec.level_source == "default"
    assert spec.precision_name == default["precision"] and spec.fold_batchnorm is default["fold_batchnorm"]
    if default["fuse_contractions"] is False:
        assert spec.fuse is False and spec.fuse_reason == "off (requested)"
    monkeypatch.setenv("AMPLITE_LEVEL", "O3")  # the environment beats a path's default, as on every path
    assert ConvertOptions().spec(path).level is Level.O3
    assert ConvertOptions(level="O0").spec(path).level is Level.O0


def test_an_unknown_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown conversion path 'video'"):
        ConvertSpec.build(path="video")  # type: ignore[arg-type]


# -- the spec reaches the passes whole ----------------------------------------------------------------------------


class _Spy:
    """Records the spec each ``rewrite`` call gets (``run_pipeline`` and the training variants call it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.specs: list[ConvertSpec] = []
        real = pipeline.rewrite

        def spy(original, inputs, spec, **kw):
            self.specs.append(spec)
            return real(original, inputs, spec, **kw)

        monkeypatch.setattr(pipeline, "rewrite", spy)
        monkeypatch.setattr("amplite.training.variants.rewrite", spy)


def test_convert_hands_its_spec_to_the_passes_and_keeps_it_in_the_result(monkeypatch, tmp_path: Path) -> None:
    spy = _Spy(monkeypatch)
    model, inputs = make("mlp")
    result = amplite.convert(model, inputs, precision="bf16", level="O2", keep_fp32=["op:gelu*"], verify=False)
    assert spy.specs == [result.spec]
    assert (result.spec.precision, result.spec.level, result.spec.path) == (torch.bfloat16, Level.O2, "module")
    saved = result.save(tmp_path / "m.pt2")
    from amplite.converter.emit import read_conversion

    assert read_conversion(saved).spec == result.spec  # type: ignore[union-attr]


def test_prepare_training_hands_a_training_spec_to_the_passes(monkeypatch) -> None:
    monkeypatch.delenv("AMPLITE_LEVEL", raising=False)
    spy = _Spy(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.GELU())
    amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8),
                             keep_fp32=["op:gelu*"])  # fmt: skip
    (spec,) = spy.specs
    assert (spec.path, spec.precision, spec.level, spec.fold_batchnorm) == ("training", torch.bfloat16, Level.O1, False)
    assert [(r.pattern, r.source) for r in spec.overrides] == [("op:batch_norm*", RuleSource.TRAINING),
                                                               ("op:gelu*", RuleSource.USER)]  # fmt: skip
    assert spec.range_rules() is not None and spec.range_rules().max_reduction_depth is None  # bf16: pow rule only


@pytest.mark.parametrize("precision", ["fp8", "fp4"])
def test_training_refuses_a_precision_it_cannot_train_before_any_work(precision: str) -> None:
    from amplite.integrations._lazy import LazyAmplite

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError) as info:
        amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4),
                                 precision=precision)  # fmt: skip
    assert precision in info.value.one_line() and "\n" not in info.value.one_line()
    with pytest.raises(ConfigError):
        LazyAmplite(precision, None, (), ())  # the integrations: at construction, not at the first batch


# -- batch: a job is options and a path ---------------------------------------------------------------------------


def test_a_job_is_options_and_a_path_with_the_api_defaults(tmp_path: Path) -> None:
    assert not {f.name for f in fields(Job)} & set(ConvertOptions.names()), "a Job re-declares an option"
    job = Job.from_dict({"path": str(tmp_path / "m.pt2"), "keep_fp32": ["op:mm*"], "level": 2})
    # what the manifest does not set is amplite.convert's default: fusion "auto", not a batch-only False
    assert job.options.fuse_contractions == ConvertOptions.default("fuse_contractions") == "auto"
    assert job.options.level == Level.O2 and job.options.keep_fp32 == ("op:mm*",)
    assert Job.from_dict(job.to_dict()) == job  # what the worker receives reads back as the same job
    assert json.loads(json.dumps(job.to_dict())) == job.to_dict()


@pytest.mark.parametrize(
    ("entry", "names"),
    [
        ({"dynamic_dims": ["x"]}, r"'dynamic_dims': cannot parse --dynamic-dim 'x'"),
        ({"range_percentile": 20}, r"'range_percentile': range percentile 20 is out of range"),
        ({"precision": "fp8", "level": "O0"}, r"fp8 at O0 converts nothing"),
        ({"precision": "fp32"}, r"'precision': unknown precision 'fp32'"),
    ],
)
def test_a_manifest_value_the_spec_refuses_is_a_manifest_error_before_the_batch(entry: dict, names: str,
                                                                              tmp_path: Path) -> None:  # fmt: skip
    from amplite.batch import ManifestError

    with pytest.raises(ManifestError, match=names):
        Job.from_dict({"path": str(tmp_path / "m.pt2"), **entry})


def test_batch_defaults_are_manifest_values_of_the_options(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    given = ConvertOptions(level="O2", calibration="calib", dynamic_dims=("x:0",))
    assert defaults_from_options(given) == {"level": "O2", "calib": str(tmp_path / "calib"),
                                            "dynamic_dims": ["x:0"]}  # fmt: skip


# -- no precision or level string compared past the parser ------------------------------------------------------

_NAMES = r"(?:fp16|bf16|fp8|O[0-3])"
_COMPARISON = re.compile(
    rf"""(?:==|!=)\s*["']{_NAMES}["']"""  # x == "fp16"
    rf"""|["']{_NAMES}["']\s*(?:==|!=)"""  # "fp16" == x
    rf"""|\bin\s*[(\[{{]\s*["']{_NAMES}["']"""  # x in ("fp16", ...), x not in ["O0", ...]
)
#: Modules that may compare such strings, and why.
_PARSERS = {
    "amplite/levels.py": "the parser of precision and level names",
    "amplite/spec.py": "the spec's own parser",
    "amplite/migrate/": "apex opt_level literals in the user's source code and the dtype of the code migrate writes",
    "amplite/cli/migrate.py": "migrate's --dtype (the autocast code it writes; the CLI may not import the levels)",
    "amplite/checkpoint/fp8_model.py": "a transformers config's quant_method, not an amplite precision",
}


def test_the_grep_pattern_finds_the_comparisons_it_is_for() -> None:
    for line in ['if precision == "fp16":', "if 'O3' != level:", 'x not in ("bf16", "fp16")', 'lvl in ["O2"]',
                 'ok = {"fp8", 1}; y in {"fp8"}']:  # fmt: skip
        assert _COMPARISON.search(line), line
    for line in ['mode == "fp32"', 'PRECISIONS = {"fp16": 1}', 'level: str = "O1"']:
        assert not _COMPARISON.search(line), line


def test_no_precision_or_level_string_is_compared_outside_the_parsers() -> None:
    found = []
    for path in sorted((ROOT / "amplite").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in _PARSERS):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _COMPARISON.search(line.split("#", 1)[0]):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "compare typed values (torch.dtype, Level, spec.fp8) instead:\n" + "\n".join(found)


# -- key lists kept by hand match what they mirror --------------------------------------------------------------


def test_the_manifest_keys_are_the_job_fields_and_the_options() -> None:
    from amplite.batch.keys import RUN_ONLY
    from amplite.batch.keys_table import JOB_KEYS, TOLERANCE_KEYS, conversion_keys
    from amplite.verify.compare import Tolerance

    own = {f.name for f in fields(Job)} - {"options", "line"}
    spellings = {"calib", "calib_loader", "tolerance"}  # calibration's two manifest spellings, the tolerance table
    assert set(JOB_KEYS) == own | spellings | set(conversion_keys())
    assert set(conversion_keys()) <= set(ConvertOptions.names())
    assert set(RUN_ONLY) <= own | {"line"} | spellings  # calib: hashed by its batches, not its path
    assert set(TOLERANCE_KEYS) == {f.name for f in fields(Tolerance)} - {"criteria"}


def test_every_path_default_is_a_build_keyword_of_every_path() -> None:
    import inspect
    from typing import get_args

    from amplite.spec import EntryPath

    keywords = set(inspect.signature(ConvertSpec.build).parameters)
    assert all(set(d) == set(PATH_DEFAULTS["module"]) <= keywords for d in PATH_DEFAULTS.values())
    assert set(get_args(EntryPath)) == set(PATH_DEFAULTS)  # the type names exactly the table's paths


def test_the_options_convert_llm_fixes_are_options() -> None:
    from amplite.llm.convert import FIXED_OPTIONS

    assert set(FIXED_OPTIONS) <= set(ConvertOptions.names())
