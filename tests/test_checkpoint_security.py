"""Hostile checkpoint directories (issue 27, cases 5-8): exit 2, one line, nothing run, nothing written."""

from __future__ import annotations

import builtins
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from amplite.errors import AmpliteError
from amplite.save import convert_to_files
from bench.checkpoint_archs import make_checkpoint
from tests import fresh
from tests.conftest import Cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("sec") / "llama")


@pytest.fixture
def ckpt(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "src"))


def _cfg(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def _refused(src: Path, out: Path, match: str, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """In-process: exit code 2 naming ``match``, and nothing at the destination."""
    if monkeypatch is not None:
        def no_prompt(*_: object) -> str:
            raise AssertionError("amplite reached an interactive prompt")

        monkeypatch.setattr(builtins, "input", no_prompt)
    out.mkdir(exist_ok=True)
    with pytest.raises(AmpliteError, match=match) as info:
        convert_to_files(src, output=out / "m", formats="safetensors,pt2", verify=False)
    assert info.value.exit_code == 2
    assert not out.exists() or list(out.iterdir()) == []


def _cli(*args: str, limit_gb: float | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m amplite`` in a fresh process: for the refusals under a memory limit (RLIMIT_DATA applies to a
    whole process, which must not be the test runner)."""
    limits = {} if limit_gb is None else {resource.RLIMIT_DATA: int(limit_gb * 2**30)}
    return fresh.run([sys.executable, "-m", "amplite", *args], cwd=ROOT, timeout=timeout, rlimits=limits)


def test_auto_map_is_refused_without_a_prompt(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              cli: Cli) -> None:
    marker = tmp_path / "ran"
    (ckpt / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    _cfg(ckpt, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}, architectures=["EvilForCausalLM"])
    _refused(ckpt, tmp_path / "out", "auto_map", monkeypatch)
    # The CLI in-process: ``input`` still raises (monkeypatched by _refused), so a prompt would be exit 3
    proc = cli("convert", ckpt, "-o", tmp_path / "cli")
    assert proc.exit_code == 2 and "auto_map" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "cli").exists()


@pytest.mark.parametrize("arch", ["pipeline", "Trainer", "AutoTokenizer", "BertForMaskedLM", "LlamaTokenizer"])
def test_only_transformers_model_classes_of_the_model_type_are_built(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    import transformers

    called = []
    for name in ("pipeline", "Trainer", "AutoTokenizer"):
        monkeypatch.setattr(transformers, name, lambda *a, n=name, **k: called.append(n))
    _cfg(ckpt, architectures=[arch])
    _refused(ckpt, tmp_path / "out", f"{arch}.*not a transformers model class", monkeypatch)
    assert called == []


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink-shard", "subdir"])
def test_shards_outside_the_directory_are_refused(ckpt: Path, tmp_path: Path, where: str) -> None:
    index = _index(ckpt)
    first = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside.safetensors"
    shutil.copy(ckpt / first, outside)
    if where == "symlink-shard":
        (ckpt / first).unlink()
        (ckpt / first).symlink_to(outside)
    else:
        target = {"dotdot": "../outside.safetensors", "absolute": str(outside), "subdir": "sub/x.safetensors"}[where]
        index["weight_map"] = {k: (target if v == first else v) for k, v in index["weight_map"].items()}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(ckpt, tmp_path / "out", "symlink|inside the checkpoint directory")


def test_symlinked_side_files_and_pickles_are_not_copied(ckpt: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (ckpt / "tokenizer.json").symlink_to(secret)
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    (ckpt / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    convert_to_files(ckpt, output=out, verify=False)
    assert (out / "tokenizer_config.json").read_text() == "{}"
    assert not (out / "tokenizer.json").exists() and not (out / "pytorch_model.bin").exists()
    plan = json.loads((out / "amplite-plan.json").read_text())
    assert any("tokenizer.json" in s for s in plan["not_copied"])
    assert any("pytorch_model.bin" in s for s in plan["not_copied"])


def test_a_tensor_in_two_shards_is_refused(ckpt: Path, tmp_path: Path) -> None:
    index = _index(ckpt)
    name = "model.layers.0.input_layernorm.weight"
    home = index["weight_map"][name]
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != home)
    tensors = load_file(ckpt / other)
    tensors[name] = load_file(ckpt / home)[name] * 1000.0
    save_file(tensors, str(ckpt / other), metadata={"format": "pt"})
    _refused(ckpt, tmp_path / "out", name)


def test_a_hundred_thousand_layers_exit_2_in_seconds_under_a_memory_limit(ckpt: Path, tmp_path: Path) -> None:
    _cfg(ckpt, num_hidden_layers=100000)
    start = time.perf_counter()
    proc = _cli("convert", str(ckpt), "-o", str(tmp_path / "m"), "--no-verify", limit_gb=3, timeout=90)
    assert time.perf_counter() - start < 60
    assert proc.returncode == 2 and "num_hidden_layers is 100000" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_a_computed_position_buffer_is_bounded_before_it_is_allocated(tmp_path: Path) -> None:
    """BERT's position_ids buffer at max_position_embeddings 3e8 would be (1, 3e8) int64 = 2.4 GB: refused
    under a 3 GiB data limit, before it exists."""
    src = make_checkpoint("bert", tmp_path / "bert")
    _cfg(src, max_position_embeddings=300_000_000)
    proc = _cli("convert", str(src), "-o", str(tmp_path / "m"), "--no-verify", limit_gb=3, timeout=90)
    assert proc.returncode == 2 and "buffers" in proc.stderr and "position_ids" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


@pytest.mark.parametrize(("changes", "match"), [
    ({"num_attention_heads": 10**9}, "config.json"),
    ({"max_position_embeddings": 3e8}, "max_position_embeddings"),  # a float: transformers' own validation
    ({"vocab_size": 10**9}, r"lm_head.weight \(128, 32\)"),  # meta: no allocation, then the shape check
])  # fmt: skip
def test_config_sizes_are_checked_on_meta(ckpt: Path, tmp_path: Path, changes: dict, match: str) -> None:
    _cfg(ckpt, **changes)
    _refused(ckpt, tmp_path / "out", match)


def test_a_learned_position_table_is_checked_against_its_shard(tmp_path: Path) -> None:
    src = make_checkpoint("gpt2", tmp_path / "gpt2")
    _cfg(src, n_positions=300_000_000)
    _refused(src, tmp_path / "out", r"transformer.wpe.weight \(64, 32\).*\(300000000, 32\)")


def test_symlinked_config_is_refused(ckpt: Path, tmp_path: Path) -> None:
    real = tmp_path / "config.json"
    shutil.move(ckpt / "config.json", real)
    os.symlink(real, ckpt / "config.json")
    _refused(ckpt, tmp_path / "out", "symlink")


def test_count_bound_reads_only_count_keys(ckpt: Path, tmp_path: Path) -> None:
    """A size that is not a module count (block_size, num_experts_per_tok) is not refused for exceeding the
    shards' module numbers; an expert count is."""
    from amplite.checkpoint.model import check_config
    from amplite.checkpoint.source import open_checkpoint

    _cfg(ckpt, block_size=4096, num_experts_per_tok=1000, max_window_layers=28)
    check_config(open_checkpoint(ckpt))
    _cfg(ckpt, num_local_experts=100000)
    with pytest.raises(AmpliteError, match="num_local_experts is 100000"):
        check_config(open_checkpoint(ckpt))
