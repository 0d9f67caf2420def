"""A user's ``--keep-fp32`` / ``--force-low`` pattern that matches no node is refused, not silently ignored.

A typo in a module path (``module:encodr.*``) used to convert "successfully" with the plan the user meant to
change; the refusal names what the model has. Pins amplite adds itself (training's batch norm, the budget
search, the checkpoint path's fp16 weight rules) are not the user's and are never refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amplite
from amplite.errors import ConfigError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.softmax(self.encoder(x), dim=-1))


X = (torch.randn(2, 8),)


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"keep_fp32": ["module:encodr.*"]}, "--keep-fp32 'module:encodr.*'"),
        ({"force_low": ["op:sofmax"]}, "--force-low 'op:sofmax'"),
        ({"keep_fp32": ["head", "node:no_such_node"]}, "--keep-fp32 'node:no_such_node'"),
    ],
)
def test_a_pattern_that_matches_nothing_is_refused_naming_what_exists(kw: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match="matches no node of this model") as info:
        amplite.convert(Net().eval(), X, precision="bf16", **kw)
    text = str(info.value)
    assert flag in text and "encoder.0" in text and "ops gelu, linear, softmax" in text


def test_patterns_that_match_change_the_plan() -> None:
    plain = amplite.convert(Net().eval(), X, precision="bf16", level="O2", verify=False)
    kept = amplite.convert(Net().eval(), X, precision="bf16", level="O2", verify=False, keep_fp32=["module:head"])
    fp32 = {e["node"] for e in kept.report.data["fp32_nodes"]}
    assert any("head" in n or "linear_2" in n for n in fp32)
    assert len(kept.report.data["fp32_nodes"]) > len(plain.report.data["fp32_nodes"])


def test_cli_refuses_in_one_line(cli, tmp_path) -> None:
    model = torch.export.export(Net().eval(), X)
    path = tmp_path / "net.pt2"
    torch.export.save(model, str(path))
    res = cli("convert", path, "--keep-fp32", "module:encodr.*", "-o", tmp_path / "out.pt2")
    assert res.exit_code == 2 and "matches no node" in res.stderr and res.stderr.count("\n") == 1
    assert not (tmp_path / "out.pt2").exists()


def test_training_pin_is_not_the_users_and_a_user_typo_is_refused() -> None:
    model = Net()
    net, _ = amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), (X, {}),
                                      precision="bf16", level="O1")  # batch_norm pin, no batch norm: fine
    assert net(*X).shape == (2, 4)
    model = Net()
    with pytest.raises(ConfigError, match="module:encodr"):
        amplite.prepare_training(model, torch.optim.SGD(model.parameters(), lr=0.1), (X, {}), precision="bf16",
                                 level="O1", keep_fp32=["module:encodr.*"])  # fmt: skip


def test_checkpoint_patterns_use_the_models_own_module_names(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    res = amplite.convert(tmp_path / "llama", precision="bf16", level="O2", keep_fp32=["module:model.layers.0.*"])
    kept = [e for e in res.report.data["fp32_nodes"] if e["reason"] == "user:keep module:model.layers.0.*"]
    assert kept and res.dtypes["lm.model.layers.0.mlp.down_proj.weight"] == torch.float32
    assert res.dtypes["lm.model.layers.1.mlp.down_proj.weight"] == torch.bfloat16
    with pytest.raises(ConfigError, match=r"'module:lm\.\*' matches no node.*modules lm_head, model"):
        amplite.convert(tmp_path / "llama", precision="bf16", keep_fp32=["module:lm.*"])
