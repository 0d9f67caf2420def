"""amplite's own fuzzer for the files it reads: random and structured mutations, one verdict per case.

Targets (each builds its seed file by code, small, and mutates a copy):

- ``pt2``: a ``torch.export.save`` archive, through :func:`amplite.reading.pt2.load_program` (and, when it
  loads, one run of the program);
- ``inputs``: ``--inputs`` files (``.npz`` and ``torch.save``), through
  :func:`amplite.converter.inputs.load_inputs_file`;
- ``safetensors``: a shard's header, through :func:`amplite.checkpoint.source.read_header`;
- ``checkpoint``: a transformers checkpoint directory (``config.json``, index, shards), through
  :func:`amplite.checkpoint.source.open_checkpoint`, the meta build and the key mapping with its checks.

Mutations: *structured* ones parse a JSON record (the program, a config, a safetensors header), pick a random
value and replace it with one from :data:`HOSTILE` (huge and negative numbers, wrong types, deep nesting,
strings that would run code and touch a marker file) or delete it; *random* ones flip, insert, delete or
truncate bytes of the raw file. Each case ends in one verdict: ``ok`` (loaded), ``refused`` (an
:class:`~amplite.errors.AmpliteError`, the one-line exit-2 class), or a finding: ``crash`` (any other
exception: exit 3 in the CLI), ``hang`` (over the per-case time limit), ``marker`` (a payload ran).

Run it: ``python -m tests.fuzz --cases 2000 --seed 1`` (all targets; ``--target pt2`` for one). Run it under a
memory limit (``--max-memory-gb``, default 3) so that an allocation a file drives fails as ``MemoryError`` (a
crash) instead of swapping. ``make test`` runs a short seeded run (``tests/test_fuzz.py``); the long run and its
last result are in docs/security.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import resource
import signal
import struct
import sys
import tempfile
import time
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from amplite.errors import AmpliteError

MARKER = "__AMPLITE_FUZZ_MARKER__"


def hostile_values(marker: Path) -> list[Any]:
    touch = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    chrs = "+".join(f"(chr)({ord(c)})" for c in f"open({str(marker)!r},'w')")
    return [
        touch, f"x':{touch}, 'z", f"x=({touch})):#",  # out of a string literal, out of a parameter list
        f"(exec)({chrs})", f"Symbol('s0')+0*Integer((len)(((exec)({chrs}),)))", f"({touch}) is None",
        "Integer(9)**Integer(99999999)", "LShift(Integer(1), Integer(1000000000000000000))",
        "torch.os.system", "torch.ops.aten.from_file.default", "../../etc/passwd", "/etc/passwd", "a" * 10_000,
        "", " ", "\x00", "weight_0", "s0", 0, -1, 1, 2**31, 2**63, 10**18, -(10**18), 1e308, float("nan"), None, True,
        [], {}, [[[[[[[[]]]]]]]], {"as_int": 10**12}, {"as_expr": {"expr_str": touch}}, [0] * 1000,
    ]  # fmt: skip


# ----- mutations ---------------------------------------------------------------------------------------------
def mutate_json(doc: Any, rng: random.Random, hostile: list[Any]) -> Any:
    """Replace or delete one random value of ``doc`` (a parsed JSON document); returns the new document."""
    paths: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k in list(node):
                paths.append((node, k))
                walk(node[k])
        elif isinstance(node, list):
            for i in range(len(node)):
                paths.append((node, i))
                walk(node[i])

    walk(doc)
    if not paths:
        return rng.choice(hostile)
    parent, key = rng.choice(paths)
    nested = _json_container(parent[key])
    if nested is not None and rng.random() < 0.5:  # JSON inside a string (pytree specs, contexts): mutate within
        parent[key] = json.dumps(mutate_json(nested, rng, hostile))
    elif isinstance(parent, dict) and rng.random() < 0.15:
        del parent[key]
    elif rng.random() < 0.1:  # a deep structure where a value was (written as text by dumps below)
        parent[key] = f"__DEEP_{rng.choice((50, 500, 5000))}__"
    else:
        parent[key] = rng.choice(hostile)
    return doc


def _json_container(value: Any) -> Any:
    """The list or dict a string holds as JSON text, else None."""
    if not (isinstance(value, str) and value[:1] in "[{"):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, (list, dict)) else None


def dumps(doc: Any) -> bytes:
    """JSON text of ``doc``, with each ``__DEEP_n__`` placeholder turned into ``n`` nested lists."""
    import re

    text = json.dumps(doc, allow_nan=True)
    return re.sub(r'"__DEEP_(\d+)__"', lambda m: "[" * int(m[1]) + "0" + "]" * int(m[1]), text).encode()


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        pos = rng.randrange(max(len(buf), 1))
        if kind < 0.5 and buf:
            buf[pos] = rng.randrange(256)
        elif kind < 0.7:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind < 0.9 and buf:
            del buf[pos : pos + rng.randint(1, 64)]
        else:
            del buf[pos:]
    return bytes(buf)


def rezip(src: Path, dst: Path, edit: Callable[[str, bytes], bytes | None]) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info))
            if data is not None:
                zout.writestr(info.filename, data)


def mutate_zip_json(src: Path, dst: Path, rng: random.Random, hostile: list[Any], records: tuple[str, ...]) -> None:
    names = [n for n in zipfile.ZipFile(src).namelist() if n.endswith(records)]
    chosen = rng.choice(names)

    def edit(name: str, data: bytes) -> bytes | None:
        if name != chosen:
            return data
        return dumps(mutate_json(json.loads(data), rng, hostile))

    rezip(src, dst, edit)


# ----- targets -------------------------------------------------------------------------------------------------
class Target:
    """A file kind: a seed built by code, a mutation, and the amplite call that reads it."""

    name = ""

    def seed(self, d: Path) -> Path:
        raise NotImplementedError

    def mutate(self, seed: Path, dst: Path, rng: random.Random, hostile: list[Any]) -> Path:
        raise NotImplementedError

    def read(self, path: Path) -> None:
        raise NotImplementedError


class Pt2(Target):
    name = "pt2"
    RECORDS = ("models/model.json", "model_weights_config.json", "model_constants_config.json")

    def seed(self, d: Path) -> Path:
        class Small(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(4, 3)
                self.register_buffer("shift", torch.ones(3))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(self.lin(x))[: x.shape[0] // 2] + self.shift

        batch = torch.export.Dim("batch", min=2, max=64)
        ep = torch.export.export(Small(), (torch.randn(4, 4),), dynamic_shapes=({0: 2 * batch},))
        path = d / "seed.pt2"
        torch.export.save(ep, str(path))
        return path

    def mutate(self, seed: Path, dst: Path, rng: random.Random, hostile: list[Any]) -> Path:
        if rng.random() < 0.75:
            mutate_zip_json(seed, dst, rng, hostile, self.RECORDS)
        else:
            dst.write_bytes(mutate_bytes(seed.read_bytes(), rng))
        return dst

    def read(self, path: Path) -> None:
        from amplite.reading.pt2 import load_program

        program = load_program(path)
        module = program.module()  # FX generates and compiles forward() from the file's names here: unguarded
        # Running it: the CLI turns any exception the program raises on the inputs into the exit-2 "the example
        # inputs do not fit the model" (amplite.api), so only what happens outside the program is a finding.
        with contextlib.suppress(Exception):
            module(torch.randn(4, 4))


class Inputs(Target):
    name = "inputs"

    def seed(self, d: Path) -> Path:
        npz = d / "seed.npz"
        np.savez(npz, x=np.ones((2, 4), np.float32), ids=np.arange(8, dtype=np.int64))
        return npz

    def mutate(self, seed: Path, dst: Path, rng: random.Random, hostile: list[Any]) -> Path:
        choice = rng.random()
        if choice < 0.4:  # a .npy header with hostile fields
            def edit(name: str, data: bytes) -> bytes:
                shape = rng.choice([(10**18,), (-1,), (2**40, 2**40), (0,), ()])
                descr = rng.choice(["|V0", "|O", "<f4", "<U100000000", "|S0", "<f2"])
                header = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}".encode()
                header += b" " * (-(len(header) + 11) % 64) + b"\n"
                return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data[-16:]

            rezip(seed, dst.with_suffix(".npz"), edit)
            return dst.with_suffix(".npz")
        if choice < 0.7:  # torch.save of hostile objects
            obj = rng.choice([
                ((torch.zeros(4).expand(300_000_000, 4),), {}), ((), {1: torch.ones(2)}), ((), {"x": "str"}),
                [torch.ones(2)] * 3, {"x": torch.zeros(1).expand(10**9)}, ((torch.ones(2),), {"x": None}),
            ])  # fmt: skip
            out = dst.with_suffix(".pt")
            torch.save(obj, out)
            if rng.random() < 0.3:
                out.write_bytes(mutate_bytes(out.read_bytes(), rng))
            return out
        out = dst.with_suffix(".npz")
        out.write_bytes(mutate_bytes(seed.read_bytes(), rng))
        return out

    def read(self, path: Path) -> None:
        from amplite.converter.inputs import load_inputs_file

        load_inputs_file(path)


def _safetensors_bytes(header: Any, payload: bytes) -> bytes:
    raw = dumps(header)
    return struct.pack("<Q", len(raw)) + raw + payload


class Safetensors(Target):
    name = "safetensors"

    def seed(self, d: Path) -> Path:
        from safetensors.torch import save_file

        path = d / "model.safetensors"
        save_file({"a.weight": torch.ones(4, 4), "b.bias": torch.zeros(4, dtype=torch.bfloat16)}, str(path))
        return path

    def mutate(self, seed: Path, dst: Path, rng: random.Random, hostile: list[Any]) -> Path:
        data = seed.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header, payload = json.loads(data[8 : 8 + n]), data[8 + n :]
        out = dst.with_suffix(".safetensors")
        if rng.random() < 0.7:
            out.write_bytes(_safetensors_bytes(mutate_json(header, rng, hostile), payload))
        elif rng.random() < 0.5:
            out.write_bytes(struct.pack("<Q", rng.choice([0, 2**63, len(data) * 4, n + 1])) + data[8:])
        else:
            out.write_bytes(mutate_bytes(data, rng))
        return out

    def read(self, path: Path) -> None:
        from amplite.checkpoint.source import read_header

        read_header(path)


class Checkpoint(Target):
    name = "checkpoint"

    def seed(self, d: Path) -> Path:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32,
        )  # fmt: skip
        torch.manual_seed(0)
        out = d / "ckpt"
        transformers.LlamaForCausalLM(config).save_pretrained(out, max_shard_size="20KB")
        return out

    def mutate(self, seed: Path, dst: Path, rng: random.Random, hostile: list[Any]) -> Path:
        import shutil

        out = dst.with_suffix("")
        shutil.copytree(seed, out)
        files = sorted(p for p in out.iterdir() if p.suffix in (".json", ".safetensors"))
        victim = rng.choice(files)
        if victim.suffix == ".json":
            victim.write_bytes(dumps(mutate_json(json.loads(victim.read_text()), rng, hostile)))
        else:
            Safetensors().mutate(victim, victim.with_name("m"), rng, hostile).replace(victim)
        return out

    def read(self, path: Path) -> None:
        from amplite.checkpoint.keys import map_keys
        from amplite.checkpoint.model import build_meta_model
        from amplite.checkpoint.source import open_checkpoint

        ckpt = open_checkpoint(path)
        model, _ = build_meta_model(ckpt)
        map_keys(ckpt, model.lm)


def _write_targets() -> tuple[Target, ...]:
    from tests.fuzz_writes import Reports, Summaries  # what amplite writes (issue 45); imports this module

    return Reports(), Summaries()  # type: ignore[return-value]


TARGETS: dict[str, Target] = {t.name: t for t in (Pt2(), Inputs(), Safetensors(), Checkpoint(), *_write_targets())}


# ----- the run ---------------------------------------------------------------------------------------------------
class _Hang(BaseException):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang


def run(targets: list[str], cases: int, seed: int, per_case_s: int = 20, log: Callable[[str], None] = print) -> Counter:
    """Run ``cases`` mutations per target; return the verdict counts (findings are logged with their case)."""
    verdicts: Counter = Counter()
    signal.signal(signal.SIGALRM, _alarm)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        marker = root / "pwned"
        hostile = hostile_values(marker)
        for name in targets:
            target = TARGETS[name]
            seed_path = target.seed(root)
            rng = random.Random(f"{seed}:{name}")
            for case in range(cases):
                work = root / f"{name}-{case}"
                work.mkdir()
                path = target.mutate(seed_path, work / "case", rng, hostile)
                verdict, detail = _one(target, path, per_case_s)
                if marker.exists():
                    verdict, detail = "marker", "a payload ran"
                    marker.unlink()
                verdicts[f"{name}:{verdict}"] += 1
                if verdict not in ("ok", "refused"):
                    log(f"FINDING {name} case {case} (seed {seed}): {verdict}: {detail}")
                _rm(work)
    return verdicts


def _one(target: Target, path: Path, per_case_s: int) -> tuple[str, str]:
    signal.alarm(per_case_s)
    start = time.monotonic()
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            target.read(path)
        return "ok", ""
    except AmpliteError as exc:
        return "refused", str(exc)[:120]
    except _Hang:
        return "hang", f"over {per_case_s} s"
    except Exception as exc:  # every other class is a finding: the CLI would say "internal error" (exit 3)
        return "crash", f"{type(exc).__name__}: {str(exc)[:200]} ({time.monotonic() - start:.1f} s)"
    finally:
        signal.alarm(0)


def _rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="repeatable; default: all")
    parser.add_argument("--cases", type=int, default=200, help="cases per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-case-s", type=int, default=20)
    parser.add_argument("--max-memory-gb", type=float, default=3.0)
    args = parser.parse_args(argv)
    limit = int(args.max_memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(1)
    start = time.monotonic()
    verdicts = run(args.target or sorted(TARGETS), args.cases, args.seed, args.per_case_s)
    findings = sum(n for k, n in verdicts.items() if not k.endswith((":ok", ":refused")))
    print(json.dumps({"verdicts": dict(sorted(verdicts.items())), "findings": findings,
                      "seconds": round(time.monotonic() - start, 1)}))  # fmt: skip
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
