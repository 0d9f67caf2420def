"""Beyond one machine: a Dask executor runs the jobs; shards run separately and merge into one summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amplite.batch import convert_many, iter_convert_many, load_jobs, merge_shards, run_batch
from fixtures.write_fixtures import write


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dist")
    for name in ("mlp", "rmsnorm", "embedding"):
        write(name, d, ("state_dict",))
    return d


def _jobs(d: Path) -> list[dict]:
    return [
        {"name": "mlp", "path": str(d / "mlp.state.pt"), "model_factory": "fixtures.zoo:mlp",
         "inputs": ["x:4x32:float32"]},
        {"name": "rmsnorm", "path": str(d / "rmsnorm.state.pt"), "model_factory": "fixtures.zoo:rmsnorm",
         "inputs": ["x:4x64:float32"], "precision": "bf16"},
    ]  # fmt: skip


def test_dask_executor_runs_the_jobs(models: Path, tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
        distributed.get_task_stream(client) as stream,
    ):
        result = convert_many(_jobs(models), tmp_path / "out", executor=client.get_executor())
    assert result.exit_code == 0, [r.error for r in result.results]
    assert [r.name for r in result.results] == ["mlp", "rmsnorm"]
    assert len(stream.data) == 2 and all(t["worker"] for t in stream.data)  # each job ran as a Dask task
    for name in ("mlp", "rmsnorm"):
        row = json.loads((tmp_path / "out" / name / "result.json").read_text())
        assert row["status"] == "ok" and (tmp_path / "out" / name / "model.pt2").is_file()


def test_streaming_yields_each_result(models: Path, tmp_path: Path) -> None:
    names = [r.name for r in iter_convert_many(_jobs(models), tmp_path / "out", workers=2)]
    assert sorted(names) == ["mlp", "rmsnorm"]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["exit_code"] == 0


def test_shards_then_merge(models: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "zoo.toml"
    entries = []
    for i in range(6):  # six cheap models: mlp and embedding under different names and settings
        fixture = ("mlp", "embedding")[i % 2]
        spec = "x:4x32:float32" if fixture == "mlp" else "ids:4x12:int64[0,500)"
        entries.append(
            f'[[model]]\nname = "m{i}"\npath = "{models / f"{fixture}.state.pt"}"\n'
            f'model_factory = "fixtures.zoo:{fixture}"\ninputs = ["{spec}"]\nlevel = "O{1 + i % 2}"\n'
        )
    manifest.write_text("\n".join(entries))
    everyone = {j.name for j in load_jobs(manifest, trust_code=True)}  # the manifest names factories (code)
    shard_dirs, seen = [], []
    for i in range(3):
        out = tmp_path / f"shard{i}"
        result = run_batch(manifest, out, shard=f"{i}/3", jobs=2, progress=False, trust_code=True)
        assert result.exit_code == 0
        doc = json.loads((out / "summary.json").read_text())
        assert doc["shard"] == f"{i}/3"
        seen.append({r["name"] for r in doc["models"]})
        shard_dirs.append(out)
    assert set().union(*seen) == everyone and sum(map(len, seen)) == len(everyone)  # a partition
    merged = merge_shards(shard_dirs, tmp_path / "all")
    assert merged.exit_code == 0 and sorted(r.name for r in merged.results) == sorted(everyone)
    doc = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert doc["counts"] == {"ok": 6} and len(doc["merged_from"]) == 3
    for row in doc["models"]:  # rows point at the shard directories that hold the models
        assert (tmp_path / "all" / row["output_dir"] / "model.pt2").is_file()
