"""Models bigger than RAM: convert a generated ~3B-parameter Llama-style checkpoint by streaming.

Generates a random-weight checkpoint on disk from a config (sharded safetensors, written shard by shard
so generation itself fits), measures the disk's sequential write and read speed in the same run, then
runs ``amplite convert DIR`` at bf16 O2 and fp16 O1 (each in a fresh process, with block-wise
verification) and reports wall time, peak RSS, output size and throughput against the targets:

* peak RSS <= 1.5 x the largest shard + 2 GiB (independent of model size);
* throughput >= 0.5 x the disk's sequential read+write speed.

With ``--llm`` it also runs the generation check of ``amplite convert DIR --tolerance token_agreement>=...``
(``amplite.llm.checkpoint.verify_checkpoint``, in a fresh process per output): the source loaded in FP32
greedily continues the default prompts (``--llm-steps`` per prompt) and its perplexity is measured, the FP32
model is dropped, then the written safetensors directory is loaded as ``from_pretrained`` loads it and fed
FP32's tokens (teacher forcing): token agreement, first divergence and perplexity delta go in the
"Generation" table, with that process's peak RSS (one model at a time: about one FP32 copy, reported apart
from the streamed conversion's). Results are also printed as ``RESULT {json}`` lines as each step finishes.

    python bench/bench_big.py                       # ~3.4B parameters, ~12.8 GiB FP32 (needs ~40 GB free)
    python bench/bench_big.py --layers 4 --keep     # smaller, and keep the files
    python bench/bench_big.py --markdown bench/RESULTS-big.md
    python bench/bench_big.py --llm                 # + token agreement and perplexity delta (needs ~1x FP32 RAM)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def llama_config(layers: int) -> dict:
    """OpenLLaMA-3B's shape (hidden 3200, MLP 8640, 32 heads, vocab 32000)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3200,
        "intermediate_size": 8640, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }  # fmt: skip


def generate(path: Path, config: dict, shard_bytes: int) -> tuple[int, int]:
    """Write a random checkpoint shard by shard; returns (parameters, largest shard bytes)."""
    import transformers
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    shapes = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total, params, largest = 0, 0, 0, 0
    weight_map: dict[str, str] = {}
    names: list[list[str]] = [[]]

    def flush() -> None:
        nonlocal size, largest
        idx = len(names)
        name = f"model-{idx:05d}.safetensors"
        save_file(shards[-1], str(path / name), metadata={"format": "pt"})
        largest = max(largest, (path / name).stat().st_size)
        weight_map.update({t: name for t in names[-1]})
        shards[-1].clear()
        names.append([])
        size = 0

    for name, shape in shapes:
        n = 1
        for s in shape:
            n *= s
        t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        if size + t.nbytes > shard_bytes and shards[-1]:
            flush()
        shards[-1][name] = t
        names[-1].append(name)
        size += t.nbytes
        total += t.nbytes
        params += n
    flush()
    count = len(names) - 1
    renamed = {}
    for i in range(1, count + 1):
        old, new = f"model-{i:05d}.safetensors", f"model-{i:05d}-of-{count:05d}.safetensors"
        os.replace(path / old, path / new)
        renamed[old] = new
    index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return params, largest


def disk_speed(folder: Path, nbytes: int = 2 * 2**30) -> tuple[float, float]:
    """Sequential write (fsynced) and read speed in bytes/s of one file in ``folder``."""
    probe = folder / "disk-probe.bin"
    block = os.urandom(64 * 2**20)
    start = time.perf_counter()
    with probe.open("wb") as fh:
        for _ in range(nbytes // len(block)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    write = nbytes / (time.perf_counter() - start)
    with contextlib.suppress(OSError):  # read from the disk, not the page cache, where the machine allows it
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    start = time.perf_counter()
    with probe.open("rb") as fh:
        while fh.read(64 * 2**20):
            pass
    read = nbytes / (time.perf_counter() - start)
    probe.unlink()
    return write, read


def convert(src: Path, out: Path, precision: str, level: str) -> dict:
    """One ``amplite convert`` in a fresh process: wall time, peak RSS, output bytes, verification."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "amplite", "convert", str(src), "--precision", precision, "--level", level,
         "-o", str(out), "--verify-max-memory", "4"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    wall = time.perf_counter() - start
    report_path = out.with_name(out.name + ".report.json")
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    size = sum(p.stat().st_size for p in out.glob("*.safetensors")) if out.exists() else 0
    ver = report.get("verification") or {}
    return {"config": f"{precision} {level}", "rc": proc.returncode, "wall_s": wall,
            # the converting process's own high-water mark, recorded in its report at the end
            "peak_rss_bytes": (report.get("streaming") or {}).get("peak_rss_bytes", 0), "output_bytes": size,
            "timings": report.get("timings", {}), "passed": ver.get("passed"),
            "sqnr_db": (ver.get("outputs") or [{}])[0].get("sqnr_db"),
            "peak_weight_bytes": ver.get("peak_weight_bytes"), "stderr": proc.stderr[-500:]}  # fmt: skip


def llm_check(src: Path, out: Path, config: str, steps: int) -> dict:
    """The generation check of a written output in a fresh process: agreement, perplexity delta, time, peak RSS."""
    code = (
        "import json, resource, time\n"
        "from amplite.llm.checkpoint import verify_checkpoint\n"
        "t = time.perf_counter()\n"
        f"m = verify_checkpoint({str(src)!r}, {str(out)!r}, steps={steps})\n"
        "d = dict(m.to_dict(), wall_s=time.perf_counter() - t,\n"
        "         peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
        "print('LLM-JSON ' + json.dumps(d))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LLM-JSON ")), None)
    data = json.loads(line[9:]) if line else {}
    dtype = json.loads((out / "config.json").read_text()).get("dtype") if (out / "config.json").exists() else None
    return {"config": config, "rc": proc.returncode, "stored": dtype, **data, "stderr": proc.stderr[-500:]}


def llm_lines(checks: list[dict]) -> list[str]:
    """The "Generation" table: token agreement, first divergences, perplexities and their delta."""
    lines = ["", "Generation (the generation check of `amplite convert DIR --tolerance token_agreement>=...`: FP32 "
             "source vs the written safetensors directory loaded by from_pretrained, teacher-forced greedy, default "
             "prompts; criteria token_agreement>=0.99, ppl_delta<=1%):", "",
             "| output | stored as | rc | token agreement | first divergence per prompt | ppl FP32 | ppl converted "
             "| ppl delta | passed | wall s | peak RSS GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in checks:
        if c["rc"] != 0 or "token_agreement" not in c:
            lines.append(f"| {c['config']} | {c.get('stored')} | {c['rc']} | failed: {c['stderr'][-120:]!r} ||||||||")
            continue
        lines.append(
            f"| {c['config']} | {c['stored']} | 0 | {c['token_agreement']:.2%} "
            f"({c['agreeing_tokens']}/{c['prompts'] * c['steps']}) | {c['first_divergence']} | {c['ppl_fp32']:.2f} "
            f"| {c['ppl_converted']:.2f} | {c['ppl_delta']:.3%} | {c['passed']} | {c['wall_s']:.0f} "
            f"| {c['peak_rss_bytes'] / 2**30:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=26, help="decoder layers (26: ~3.4B parameters)")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/amplite-big"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    ap.add_argument("--llm", action="store_true", help="also measure token agreement and perplexity delta")
    ap.add_argument("--llm-steps", type=int, default=32, help="greedy steps per prompt for --llm")
    ap.add_argument("--configs", default="bf16:O2,fp16:O1", help="comma list of precision:level to convert")
    args = ap.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    src = args.work / "llama"
    t0 = time.perf_counter()
    params, largest = generate(src, llama_config(args.layers), int(args.shard_gb * 2**30))
    gen_s = time.perf_counter() - t0
    fp32_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    write_bps, read_bps = disk_speed(args.work)
    disk_rw = 1 / (1 / write_bps + 1 / read_bps)  # bytes/s to read a byte and write a byte
    print("RESULT " + json.dumps({"params": params, "largest_shard": largest, "fp32_bytes": fp32_bytes,
                                  "generate_s": gen_s, "write_bps": write_bps, "read_bps": read_bps}), flush=True)
    runs = []
    for p, lvl in (c.split(":") for c in args.configs.split(",")):
        runs.append(convert(src, args.work / f"out-{p}-{lvl}", p, lvl))
        print("RESULT " + json.dumps(runs[-1]), flush=True)
    rss_target = 1.5 * largest + 2 * 2**30
    lines = [
        "## Big models (bench/bench_big.py)", "",
        f"Generated Llama-style checkpoint: {params / 1e9:.2f}B parameters, {fp32_bytes / 2**30:.1f} GiB FP32 in "
        f"{len(list(src.glob('*.safetensors')))} shards (largest {largest / 2**30:.2f} GiB), generated in "
        f"{gen_s:.0f} s. Disk, same run: sequential write {write_bps / 2**20:.0f} MiB/s, read "
        f"{read_bps / 2**20:.0f} MiB/s (read+write of one byte: {disk_rw / 2**20:.0f} MiB/s). "
        f"Peak-RSS target: 1.5 × largest shard + 2 GiB = {rss_target / 2**30:.2f} GiB.", "",
        "| config | rc | wall s | peak RSS GiB | RSS target met | output GiB | throughput MiB/s (FP32 in / s) "
        "| ≥ 0.5 × disk read+write | verified | SQNR dB | weights held in verification MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        thr = fp32_bytes / r["wall_s"]
        lines.append(
            f"| {r['config']} | {r['rc']} | {r['wall_s']:.0f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
            f"{'yes' if r['peak_rss_bytes'] <= rss_target else 'NO'} | {r['output_bytes'] / 2**30:.2f} | "
            f"{thr / 2**20:.0f} | {'yes' if thr >= 0.5 * disk_rw else 'NO'} ({thr / disk_rw:.2f}×) | "
            f"{r['passed']} | {r['sqnr_db'] if r['sqnr_db'] is None else round(r['sqnr_db'], 1)} | "
            f"{(r['peak_weight_bytes'] or 0) / 2**20:.0f} |"
        )
    lines += ["", "Phases (s): " + "; ".join(
        f"{r['config']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["timings"].items()) for r in runs), ""]
    checks = []
    for r in runs if args.llm else []:
        p, lvl = r["config"].split()
        checks.append(llm_check(src, args.work / f"out-{p}-{lvl}", r["config"], args.llm_steps))
        print("RESULT " + json.dumps(checks[-1]), flush=True)
    if checks:
        lines += [*llm_lines(checks), ""]
    text = "\n".join(lines)
    print(text)
    for r in runs:
        if r["rc"] != 0:
            print(f"{r['config']} failed: {r['stderr']}", file=sys.stderr)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0 if all(r["rc"] == 0 for r in runs + checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
