"""Checkpoint directories laid out the ways real ones are: tensors of mixed dtypes, a tensor no module reads,
one unsharded file with tied embeddings, a tensor missing from both the shards and the index. Each
converted directory is read back by transformers' own ``from_pretrained`` and compared with the source."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from amplite.errors import AmpliteError
from amplite.save import convert_to_files
from tests.conftest import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.tensor([[3, 17, 101, 5, 250, 42, 9]])
UNREAD = "model.layers.0.self_attn.rotary_emb.inv_freq"  # what older transformers versions saved


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "src", 256, "40KB")


def _rewrite(src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        save_file(change(load_file(shard)), shard, metadata={"format": "pt"})
    return dst


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return (20 * torch.log10(want.norm() / (got.float() - want).norm())).item()


def _logits(path: Path) -> tuple[torch.Tensor, torch.dtype]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(IDS).logits.float(), model.dtype


@pytest.fixture(scope="module")
def mixed(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Norms in FP32, every other weight in bf16, plus a tensor no module reads."""

    def mix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v if "norm" in k else v.bfloat16() for k, v in state.items()}
        if "model.embed_tokens.weight" in state:
            out[UNREAD] = torch.ones(4)
        return out

    return _rewrite(source, tmp_path_factory.mktemp("mixed") / "ckpt", mix)


def test_the_plan_of_a_mixed_checkpoint_counts_the_bytes_on_disk(mixed: Path) -> None:
    """Planned from metadata (nothing materialised): the bytes before are the shards' as stored (FP32 and
    bf16), and O2 stores every tensor the model reads in 2 bytes (the unread one is copied as it is)."""
    import amplite

    state = {k: v for s in mixed.glob("*.safetensors") for k, v in load_file(s).items()}
    weights = amplite.convert(mixed, precision="fp16", level="O2").report.data["weights"]
    assert weights["bytes_before"] == sum(v.numel() * v.element_size() for v in state.values())
    unread = state[UNREAD].numel() * state[UNREAD].element_size()
    assert weights["bytes_after"] == 2 * sum(v.numel() for k, v in state.items() if k != UNREAD) + unread


def test_mixed_dtypes_and_an_unread_tensor_convert_to_one_dtype_and_load(mixed: Path, tmp_path: Path) -> None:
    """At fp16 O2 every weight the model reads is stored fp16 (none stays bf16 or FP32), the unread one is named
    in a warning, and from_pretrained's logits stay within 40 dB of the mixed source's."""
    want, _ = _logits(mixed)
    res = convert_to_files(mixed, output=tmp_path / "out", precision="fp16", level="O2", verify=False)
    stored = {k: v for s in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(s).items()}
    assert {v.dtype for k, v in stored.items() if k != UNREAD} == {torch.float16}
    assert any(UNREAD in w for w in res.result.data["warnings"]), res.result.data["warnings"]
    got, dtype = _logits(tmp_path / "out")
    assert dtype == torch.float16 and _sqnr_db(got, want) >= 40


def test_an_unsharded_tied_checkpoint_stays_tied_and_loads(tmp_path: Path) -> None:
    """One model.safetensors without an index, tie_word_embeddings: the head is not stored (transformers ties
    it on load) and the bf16 O2 output matches the FP32 source within 35 dB."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "tied")
    assert [p.name for p in (tmp_path / "tied").glob("*.safetensors")] == ["model.safetensors"]
    want, _ = _logits(tmp_path / "tied")
    convert_to_files(tmp_path / "tied", output=tmp_path / "out", precision="bf16", level="O2", verify=False)
    stored = {k: v for s in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(s).items()}
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    assert {v.dtype for v in stored.values()} == {torch.bfloat16}
    got, dtype = _logits(tmp_path / "out")
    assert dtype == torch.bfloat16 and _sqnr_db(got, want) >= 35


def test_a_tensor_missing_from_shards_and_index_is_refused_naming_it(source: Path, tmp_path: Path) -> None:
    """transformers would initialise it at random and warn; amplite refuses before writing anything."""
    gone = "model.layers.1.mlp.down_proj.weight"
    broken = _rewrite(source, tmp_path / "broken", lambda st: {k: v for k, v in st.items() if k != gone})
    index = broken / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    del doc["weight_map"][gone]
    index.write_text(json.dumps(doc))
    with pytest.raises(AmpliteError) as info:
        convert_to_files(broken, output=tmp_path / "out", precision="fp16", level="O2", verify=False)
    assert info.value.exit_code == 2 and gone in info.value.problem and info.value.fix
    assert not (tmp_path / "out").exists()


def _edit_header(shard: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite a safetensors shard's JSON header in place, keeping its data bytes."""
    raw = shard.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    edit(header)
    text = json.dumps(header).encode()
    shard.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size :])


def _floats(header: dict) -> None:
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [float(v) for v in header[name]["data_offsets"]]


@pytest.mark.parametrize(
    "edit",
    [_floats, lambda h: h.update(__metadata__={"format": 1}), lambda h: h.update(__metadata__=["pt"])],
    ids=["float-offsets", "metadata-int", "metadata-list"],
)
def test_a_header_safetensors_would_refuse_is_refused_when_the_directory_is_opened(
    source: Path, tmp_path: Path, edit: Callable[[dict], None]
) -> None:
    """The header check promises that safetensors' own SafetensorError never reaches the user: an offset of
    8.0 or a metadata value that is not a string passed it (they compare or iterate like good ones), and
    safetensors' "invalid JSON in header: invalid type" surfaced later, after the model was traced."""
    from amplite.checkpoint import open_checkpoint

    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    _edit_header(shard, edit)
    with pytest.raises(AmpliteError) as info:
        open_checkpoint(bad)
    assert info.value.exit_code == 2 and shard.name in info.value.problem and "regenerate" in info.value.fix
    assert "SafetensorError" not in info.value.problem
