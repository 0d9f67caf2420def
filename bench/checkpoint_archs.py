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
#: One per family for CI (tests/test_checkpoint_archs.py); the rest run in the full sweep.
CI_SUBSET = ("llama", "gpt2", "mixtral", "bert", "t5", "gemma2", "gpt_neox", "falcon")


def make_checkpoint(name: str, path: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Build ``name`` from its tiny config and save it sharded (3+ shards) at ``path``."""
    import transformers

    _, cfg_cls, model_cls, kwargs = ARCHS[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).eval().to(dtype)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=f"{max(4, total // 3000)}KB")
    return path


def _inputs(name: str) -> tuple[tuple, dict[str, Any]]:
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    return ((ids,), {"decoder_input_ids": ids[:, :5].clone()}) if ARCHS[name][0] == "encoder-decoder" else ((ids,), {})


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    err = (got.float() - ref.float()).pow(2).sum()
    return round(float(10 * torch.log10(ref.float().pow(2).sum() / err.clamp_min(1e-30))), 1)


def from_pretrained_check(name: str, src: Path, out: Path) -> dict[str, Any]:
    """Load the converted safetensors directory with ``from_pretrained`` and compare it with the source."""
    import transformers

    cls = getattr(transformers, ARCHS[name][2])
    ref = cls.from_pretrained(src).eval()
    low, info = cls.from_pretrained(out, output_loading_info=True)
    missing = [k for k in info["missing_keys"] if k not in ref.all_tied_weights_keys]
    args, kwargs = _inputs(name)
    with torch.no_grad():
        expected = ref(*args, **kwargs, return_dict=False)[0]
        got = low.eval()(*args, **kwargs, return_dict=False)[0]
    dtypes = sorted({str(p.dtype)[6:] for p in low.parameters()})
    return {"loads": not missing and not info["unexpected_keys"] and not info["mismatched_keys"],
            "missing": missing[:3], "sqnr_db": _sqnr(expected, got), "dtypes": dtypes}  # fmt: skip


def run_one(name: str, precision: str, level: str, work: Path) -> dict[str, Any]:
    """Convert ``name``'s checkpoint at ``precision``/``level``; exit code, SQNR and the from_pretrained check."""
    from amplite.errors import AmpliteError
    from amplite.save import convert_to_files

    src = work / name
    if not src.exists():
        make_checkpoint(name, src)
    out = work / f"{name}.{precision}.{level}"
    row: dict[str, Any] = {"arch": name, "family": ARCHS[name][0], "precision": precision, "level": level}
    start = time.perf_counter()
    try:
        saved = convert_to_files(src, _inputs(name), output=out, formats="safetensors,pt2", precision=precision,
                                 level=level)  # fmt: skip
        data = saved.result.report.data
        row.update(exit=saved.exit_code, sqnr_db=round(min(o["sqnr_db"] for o in data["verification"]["outputs"]), 1),
                   ratio=data["weights"]["ratio"], warnings=data.get("warnings", []))  # fmt: skip
        row["from_pretrained"] = from_pretrained_check(name, src, out)
    except AmpliteError as exc:
        row.update(exit=exc.exit_code, error=str(exc).splitlines()[0][:200])
    except Exception as exc:
        row.update(exit=3, error=f"{type(exc).__name__}: {exc}"[:200])
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The docs/models.md table."""
    lines = ["| architecture | family | config | exit | SQNR (dB) | weights after/before "
             "| from_pretrained (SQNR dB, dtypes) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        fp = r.get("from_pretrained")
        if fp:
            dts = "/".join(fp["dtypes"])
            fp_text = f"loads, {fp['sqnr_db']} dB, {dts}" if fp["loads"] else f"missing {fp['missing']}"
        else:
            fp_text = "refused: " + r.get("error", "").split(";")[0].replace("|", "/")
        sqnr = r.get("sqnr_db", "–")
        lines.append(f"| {r['arch']} | {r['family']} | {r['precision']} {r['level']} | {r['exit']} | {sqnr} | "
                     f"{r.get('ratio', '–')} | {fp_text} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(names: list[str]) -> int:
    """Run the sweep; with no names, write the results file and the docs table."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or list(ARCHS):
            for precision, level in CONFIGS:
                rows.append(run_one(name, precision, level, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    import torch as _torch
    import transformers as _tf

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    text = (f"From the run of {time.strftime('%Y-%m-%d')} at commit `{commit.strip()}` (torch {_torch.__version__}, "
            f"transformers {_tf.__version__}), CPU.\n\n" + table(rows))
    print(text)
    if not names:
        (ROOT / "bench" / "results-checkpoint-archs.json").write_text(json.dumps(rows, indent=1) + "\n")
        doc = ROOT / "docs" / "models.md"
        start, end = "<!-- checkpoint-archs:start -->", "<!-- checkpoint-archs:end -->"
        body = doc.read_text()
        if start in body:
            body = body[: body.index(start) + len(start)] + "\n" + text + body[body.index(end):]
            doc.write_text(body)
    return 0 if all(r["exit"] == 0 and (r.get("from_pretrained") or {}).get("loads") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
