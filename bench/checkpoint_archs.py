"""Architecture sweep for ``amplite convert DIR``: tiny transformers checkpoints, sharded, converted.

Each architecture is built from a small config, saved with ``save_pretrained(max_shard_size=...)``, then
converted at bf16 O2 and fp16 O1 (safetensors + .pt2, block-wise verification), and the safetensors
output is loaded back with ``from_pretrained`` and compared with the FP32 source on other inputs.

    python bench/checkpoint_archs.py            # full sweep: bench/results-checkpoint-archs.json + docs/models.md table
    python bench/checkpoint_archs.py llama t5   # some architectures, printed only

``tests/test_checkpoint_archs.py`` runs a subset per family in CI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: this checkout's amplite, not an installed one
    sys.path.insert(0, str(ROOT))
VOCAB = 128
_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
#: name -> (family, config class, model class, config kwargs)
ARCHS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": ("decoder", "LlamaConfig", "LlamaForCausalLM", dict(_DEC, tie_word_embeddings=False)),
    "mistral": ("decoder", "MistralConfig", "MistralForCausalLM", _DEC),
    "qwen2": ("decoder", "Qwen2Config", "Qwen2ForCausalLM", dict(_DEC, tie_word_embeddings=True)),
    "qwen3": ("decoder", "Qwen3Config", "Qwen3ForCausalLM", dict(_DEC, head_dim=8)),
    "phi3": ("decoder", "Phi3Config", "Phi3ForCausalLM", dict(_DEC, pad_token_id=0)),
    "phi": ("decoder", "PhiConfig", "PhiForCausalLM", dict(_DEC)),
    "gemma": ("decoder", "GemmaConfig", "GemmaForCausalLM", dict(_DEC, head_dim=8)),
    "gemma2": ("decoder", "Gemma2Config", "Gemma2ForCausalLM", dict(_DEC, head_dim=8)),
    "starcoder2": ("decoder", "Starcoder2Config", "Starcoder2ForCausalLM", _DEC),
    "gpt2": ("decoder", "GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                              n_positions=64, bos_token_id=0, eos_token_id=0)),
    "opt": ("decoder", "OPTConfig", "OPTForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           max_position_embeddings=64, word_embed_proj_dim=32)),
    "falcon": ("decoder", "FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=32,
                                                                    num_hidden_layers=2, num_attention_heads=4)),
    "gpt_neox": ("decoder", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_DEC, rotary_pct=0.5)),
    "mixtral": ("moe", "MixtralConfig", "MixtralForCausalLM", dict(_DEC, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_DEC, num_experts=4, num_experts_per_tok=2,
                                                                       moe_intermediate_size=32,
                                                                       shared_expert_intermediate_size=32)),
    "bert": ("encoder", "BertConfig", "BertForMaskedLM", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                              num_hidden_layers=2, num_attention_heads=4,
                                                              max_position_embeddings=64)),
    "roberta": ("encoder", "RobertaConfig", "RobertaForMaskedLM", dict(vocab_size=VOCAB, hidden_size=32,
                                                                       intermediate_size=64, num_hidden_layers=2,
                                                                       num_attention_heads=4,
                                                                       max_position_embeddings=64, pad_token_id=1)),
    "t5": ("encoder-decoder", "T5Config", "T5ForConditionalGeneration", dict(vocab_size=VOCAB, d_model=32, d_ff=64,
                                                                             num_layers=2, num_heads=4, d_kv=8,
                                                                             decoder_start_token_id=0)),
    "bart": ("encoder-decoder", "BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
}
CONFIGS = (("bf16", "O2"), ("fp16", "O1"))
#: The registry's families: bf16 O2 only (the output that stores low precision; O1's safetensors output is the
#: source unchanged), so that the whole registry runs in about an hour on a shared 2-core machine.
REGISTRY_CONFIGS = (("bf16", "O2"),)
#: One per family for CI (tests/test_checkpoint_archs.py); the rest run in the full sweep.
CI_SUBSET = ("llama", "gpt2", "mixtral", "bert", "t5", "gemma2", "gpt_neox", "falcon")


def family(name: str) -> str:
    """decoder / moe / encoder / encoder-decoder for the hand-written configs, ``causal-lm`` for the registry's."""
    return ARCHS[name][0] if name in ARCHS else "causal-lm"


def make_checkpoint(name: str, path: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Build ``name`` from its tiny config and save it sharded (3+ shards) at ``path``.

    ``name`` is a key of :data:`ARCHS` or a ``model_type`` of transformers' causal-LM registry
    (``bench.tiny_causal``: raises ``ValueError`` with the reason when the family does not build tiny).
    """
    import transformers

    if name in ARCHS:
        _, cfg_cls, model_cls, kwargs = ARCHS[name]
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).eval().to(dtype)
    else:
        from bench.tiny_causal import build

        model = build(name, seed).to(dtype)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=f"{max(4, total // 3000)}KB")
    return path


def _inputs(name: str) -> tuple[tuple, dict[str, Any]]:
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    return ((ids,), {"decoder_input_ids": ids[:, :5].clone()}) if family(name) == "encoder-decoder" else ((ids,), {})


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    err = (got.float() - ref.float()).pow(2).sum()
    return round(float(10 * torch.log10(ref.float().pow(2).sum() / err.clamp_min(1e-30))), 1)


def _class(name: str) -> type:
    import transformers

    from bench.tiny_causal import registry

    return getattr(transformers, ARCHS[name][2] if name in ARCHS else registry()[name])


def from_pretrained_check(name: str, src: Path, out: Path, precision: str = "bf16") -> dict[str, Any]:
    """Load the converted safetensors directory with ``from_pretrained`` (``dtype="auto"``: as its config.json
    says) and compare it with the FP32 source, beside the naive cast ``from_pretrained(src, dtype=low)``;
    a causal LM also generates 4 greedy tokens from the converted directory."""
    cls = _class(name)
    ref = cls.from_pretrained(src).eval()
    low, info = cls.from_pretrained(out, dtype="auto", output_loading_info=True)
    naive = cls.from_pretrained(src, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[precision]).eval()
    missing = [k for k in info["missing_keys"] if k not in ref.all_tied_weights_keys]
    args, kwargs = _inputs(name)
    with torch.no_grad():
        expected = ref(*args, **kwargs, return_dict=False)[0]
        got = low.eval()(*args, **kwargs, return_dict=False)[0]
        cast = naive(*args, **kwargs, return_dict=False)[0]
    row: dict[str, Any] = {"loads": not missing and not info["unexpected_keys"] and not info["mismatched_keys"],
                           "missing": missing[:3], "sqnr_db": _sqnr(expected, got),
                           "naive_sqnr_db": _sqnr(expected, cast),
                           "dtypes": sorted({str(p.dtype)[6:] for p in low.parameters()})}  # fmt: skip
    if family(name) != "encoder" and family(name) != "encoder-decoder":
        try:
            with torch.no_grad():
                ids = low.generate(args[0], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
            row["generates"] = bool(ids.shape[1] == args[0].shape[1] + 4)
        except Exception as exc:
            row["generates"] = False
            row["generate_error"] = f"{type(exc).__name__}: {exc}"[:160]
    return row


def correct(row: dict[str, Any]) -> bool:
    """Converted and correct: exit 0, loads with from_pretrained, generates (causal LMs), logits as the naive cast
    or better (within 1 dB, or both above 100 dB: unchanged weights)."""
    fp = row.get("from_pretrained") or {}
    same = fp.get("sqnr_db", -1e9) >= min(fp.get("naive_sqnr_db", 1e9) - 1.0, 100.0)
    return row.get("exit") == 0 and bool(fp.get("loads")) and fp.get("generates", True) and same


def measured(row: dict[str, Any]) -> bool:
    """Whether the row has the naive-cast comparison (rows of runs before it was added do not)."""
    return "naive_sqnr_db" in (row.get("from_pretrained") or {})


def run_one(name: str, precision: str, level: str, work: Path) -> dict[str, Any]:
    """Convert ``name``'s checkpoint at ``precision``/``level``; exit code, SQNR and the from_pretrained check."""
    from amplite.errors import AmpliteError
    from amplite.save import convert_to_files

    src = work / name
    row: dict[str, Any] = {"arch": name, "family": family(name), "precision": precision, "level": level}
    if not src.exists():
        try:
            make_checkpoint(name, src)
        except ValueError as exc:  # the registry family does not build from a tiny config: said, not dropped
            return {**row, "exit": None, "builds": False, "error": str(exc), "commit": COMMIT}
        except Exception as exc:  # transformers' own save_pretrained fails on the tiny config
            return {**row, "exit": None, "builds": False, "error": f"save: {type(exc).__name__}: {exc}"[:200],
                    "commit": COMMIT}  # fmt: skip
    out = work / f"{name}.{precision}.{level}"
    start = time.perf_counter()
    try:
        saved = convert_to_files(src, _inputs(name), output=out, formats="safetensors,pt2", precision=precision,
                                 level=level)  # fmt: skip
        data = saved.result.report.data
        row.update(exit=saved.exit_code, sqnr_db=round(min(o["sqnr_db"] for o in data["verification"]["outputs"]), 1),
                   ratio=data["weights"]["ratio"], warnings=data.get("warnings", []))  # fmt: skip
        row["from_pretrained"] = from_pretrained_check(name, src, out, precision)
    except AmpliteError as exc:
        row.update(exit=exc.exit_code, error=str(exc).splitlines()[0][:200])
    except Exception as exc:
        row.update(exit=3, error=f"{type(exc).__name__}: {exc}"[:200])
    row["seconds"] = round(time.perf_counter() - start, 1)
    row["commit"] = COMMIT
    return row


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return out.strip()


#: The commit this process's code is from (read once: later commits do not change a running sweep's code).
COMMIT = _commit()


def outcome(row: dict[str, Any]) -> str:
    """One line: correct, or what went wrong (the refusal's reason, the loader's or generation's failure)."""
    fp = row.get("from_pretrained")
    if row.get("exit") != 0:
        return f"refused (exit {row.get('exit')}): " + row.get("error", "").split(";")[0].replace("|", "/")
    if not fp:
        return "not loaded"
    if not fp["loads"]:
        return f"from_pretrained misses {fp['missing']}"
    if not measured(row):
        return f"loads (run at {row.get('commit', 'c35d2fe')}: naive cast and generation not measured)"
    if not fp.get("generates", True):
        return "does not generate: " + fp.get("generate_error", "").replace("|", "/")
    return "correct" if correct(row) else f"worse than the naive cast ({fp['sqnr_db']} < {fp['naive_sqnr_db']} dB)"


def table(rows: list[dict[str, Any]]) -> str:
    """The docs/models.md table (families that build), then the families that do not build tiny."""
    lines = ["| architecture | family | config | exit | block-wise SQNR (dB) | weights after/before "
             "| from_pretrained SQNR (dB), dtypes | naive cast SQNR (dB) | outcome |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    built = [r for r in rows if r.get("builds", True)]
    for r in built:
        fp = r.get("from_pretrained") or {}
        fp_text = f"{fp['sqnr_db']}, {'/'.join(fp['dtypes'])}" if fp else "–"
        lines.append(f"| {r['arch']} | {r['family']} | {r['precision']} {r['level']} | {r['exit']} | "
                     f"{r.get('sqnr_db', '–')} | {r.get('ratio', '–')} | {fp_text} | {fp.get('naive_sqnr_db', '–')} | "
                     f"{outcome(r)} |")  # fmt: skip
    families = sorted({r["arch"] for r in built})
    judged = [r for r in built if measured(r) or r.get("exit") != 0]
    good = sorted({r["arch"] for r in judged} - {r["arch"] for r in judged if not correct(r)})
    bad = sorted({r["arch"] for r in judged if not correct(r) and r.get("exit") == 0})
    refused = sorted({r["arch"] for r in judged if r.get("exit") == 2})
    exit3 = sorted({r["arch"] for r in built if r.get("exit") == 3})
    older = sorted({r["arch"] for r in built} - {r["arch"] for r in judged})
    lines += ["", f"{len(families)} families build from a tiny config; {len(good)} are converted and correct in "
              f"every configuration measured; refused with their reason (exit 2): {', '.join(refused) or 'none'}; "
              f"converted but not correct: {', '.join(bad) or 'none'}; exit 3 (internal error): "
              f"{', '.join(exit3) or 'none'}"
              + (f"; from an earlier run without the naive-cast and generation columns: {', '.join(older)}"
                 if older else "") + "."]  # fmt: skip
    unbuilt = [r for r in rows if not r.get("builds", True)]
    if unbuilt:
        lines += ["", f"Not swept ({len(unbuilt)} registry families that do not build from a tiny config here): "
                  + "; ".join(f"{r['arch']} ({r['error'].replace('|', '/')[:90]})" for r in unbuilt) + "."]  # fmt: skip
    missing = [n for n in all_names() if n not in {r["arch"] for r in rows}]
    if missing:
        lines += ["", f"Not run yet ({len(missing)} registry families: the sweep was stopped before them): "
                  + ", ".join(missing) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


#: Registry families that failed before (issue 44), swept first.
FIRST = ("recurrent_gemma", "mamba2", "gpt_neo", "granitemoe", "phimoe", "rwkv", "deepseek_v32", "axk2",
         "dots3_note_text", "cohere2", "gemma3_text", "ministral", "qwen3_next")  # fmt: skip


def all_names() -> list[str]:
    """The hand-written configs, then every family of transformers' causal-LM registry."""
    from bench.tiny_causal import registry

    return list(dict.fromkeys([*ARCHS, *(n for n in FIRST if n in registry()), *registry()]))


def _timed(name: str, precision: str, level: str, work: Path, limit: int = 420) -> dict[str, Any]:
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise TimeoutError(f"over {limit} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(limit)
    try:
        return run_one(name, precision, level, work)
    except TimeoutError as exc:
        return {"arch": name, "family": family(name), "precision": precision, "level": level, "exit": None,
                "error": f"bench timeout: {exc}"}  # fmt: skip
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str]) -> int:
    """Run the sweep. No names: every family, results file and docs table written (after each row for the file);
    ``--update NAME...`` (or ``--update --registry``): re-run those and merge them into both; names alone: printed
    only."""
    if argv[:1] == ["--merge"]:  # rows printed by runs over parts of the list (parallel processes), merged
        logs = [json.loads(line) for log in argv[1:] for line in Path(log).read_text().splitlines()
                if line.startswith("{")]  # fmt: skip
        return write_results(_merge(_load_results(), logs))
    update = "--update" in argv
    names = [a for a in argv if a not in ("--update", "--registry")]
    if "--registry" in argv:  # the registry's families that have no hand-written config
        names += [n for n in all_names() if n not in ARCHS]
    results = ROOT / "bench" / "results-checkpoint-archs.json"
    old = json.loads(results.read_text()) if update and results.exists() else []
    rows: list[dict[str, Any]] = []
    write = update or not names
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or all_names():
            for precision, level in CONFIGS if name in ARCHS else REGISTRY_CONFIGS:
                rows.append(_timed(name, precision, level, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
                if not rows[-1].get("builds", True):
                    break
            if write:
                results.write_text(json.dumps(_merge(old, rows), indent=1) + "\n")
    rows = _merge(old, rows)
    if write:
        return write_results(rows)
    print(table(rows))
    return 0 if all(correct(r) for r in rows if r.get("builds", True) and measured(r)) else 1


def _load_results() -> list[dict[str, Any]]:
    path = ROOT / "bench" / "results-checkpoint-archs.json"
    return json.loads(path.read_text()) if path.exists() else []


def write_results(rows: list[dict[str, Any]]) -> int:
    """bench/results-checkpoint-archs.json and the docs/models.md table (each row names the commit it ran at)."""
    import torch as _torch
    import transformers as _tf

    (ROOT / "bench" / "results-checkpoint-archs.json").write_text(json.dumps(rows, indent=1) + "\n")
    commits = sorted({r.get("commit", "c35d2fe") for r in rows})
    text = (f"From the runs up to {time.strftime('%Y-%m-%d')} at commits {', '.join(f'`{c}`' for c in commits)} "
            f"(torch {_torch.__version__}, transformers {_tf.__version__}), CPU; each row's commit is in "
            "bench/results-checkpoint-archs.json.\n\n" + table(rows))  # fmt: skip
    print(text)
    doc = ROOT / "docs" / "models.md"
    start, end = "<!-- checkpoint-archs:start -->", "<!-- checkpoint-archs:end -->"
    body = doc.read_text()
    if start in body:
        body = body[: body.index(start) + len(start)] + "\n" + text + body[body.index(end):]
        doc.write_text(body)
    return 0 if all(correct(r) for r in rows if r.get("builds", True)) else 1


def _merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with the rows of ``new`` replacing those of the same architecture (order of ``all_names``)."""
    fresh = {r["arch"] for r in new}
    rows = [r for r in old if r["arch"] not in fresh] + new
    order = {n: i for i, n in enumerate(all_names())}
    return sorted(rows, key=lambda r: (order.get(r["arch"], len(order)), r.get("precision", ""), r.get("level", "")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
