"""`specdeploy export --format sglang`: the folder SGLang 0.5.23 loads (specdeploy/engines/sglang.py),
from a module imported in any layout, reads back through `specdeploy spec import` to the same module
bit for bit in float32, holds what SGLang's LlamaForCausalLMEagle3 looks for, and is refused for a
module SGLang's first layer would compute differently."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import tests.tiny_modules as tm
from specdeploy.errors import SpecDeployError
from specdeploy.modules import export
from tests import test_modules
from tests.test_modules import assert_same_module, imported, spec_of, write_layout

pytestmark = pytest.mark.usefixtures("spec_cache")
base = test_modules.base  # the fixture: the tiny 8-layer Llama every tiny module fits


def _full_vocabulary() -> dict[str, torch.Tensor]:
    """tests.tiny_modules' EAGLE-3 module drafting over the whole vocabulary: no d2t, a full lm_head."""
    weights = {k: v for k, v in tm.eagle_weights().items() if k not in ("d2t", "t2d")}
    weights["lm_head.weight"] = torch.randn(tm.VOCAB, tm.HIDDEN, generator=torch.Generator().manual_seed(3))
    return weights


@pytest.mark.parametrize("kind,layout", [("eagle", "eagle3"), ("eagle", "speculators"), ("eagle", "specforge"),
                                         ("dflash", "dflash"), ("dflash", "speculators")])
def test_sglang_export_then_import_is_bit_identical(kind, layout, base, tmp_path):
    first = imported(tmp_path / "first", base, kind, write_layout(kind, layout, tmp_path / "src", base))
    out = export.export(first, "sglang", tmp_path / "exported")
    assert_same_module(first, imported(tmp_path / "again", base, kind, out))
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    if kind == "dflash":  # z-lab's layout, what SGLang's DFlashDraftModel reads
        assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == tm.DFLASH_LAYERS
        return
    # what models/llama_eagle3.py reads: layers.0.* (midlayer.* is its legacy alias), d2t for hot_token_id,
    # the 0-based layer outputs (set_eagle3_layers_to_capture adds 1), its own lm_head, float32 as stored
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["tie_word_embeddings"] is False
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == tm.EAGLE_LAYERS
    assert config["draft_vocab_size"] == tm.DRAFT_VOCAB and "hidden_norm_input" not in config
    assert not any(k.startswith("midlayer.") for k in tensors) and "t2d" not in tensors
    assert torch.equal(tensors["d2t"], tm.eagle_weights()["d2t"]) and tensors["d2t"].dtype == torch.int64
    assert tensors["layers.0.hidden_norm.weight"].dtype == torch.float32


def test_a_full_vocabulary_module_keeps_its_own_head(base, tmp_path):
    """draft_vocab_size is written even when it is the target's: SGLang reads a missing one as 'take the
    target's lm_head', which is not this module's."""
    source = tm.eagle_speculators(tmp_path / "src", _full_vocabulary(), str(base), draft_vocab_size=tm.VOCAB)
    first = imported(tmp_path / "first", base, "eagle", source)
    out = export.export(first, "sglang", tmp_path / "exported")
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == tm.VOCAB
    assert "d2t" not in load_file(str(out / "model.safetensors"))
    assert_same_module(first, imported(tmp_path / "again", base, "eagle", out))


def test_a_modelopt_trained_layer_survives_and_a_residual_norm_is_refused(base, tmp_path):
    first = imported(tmp_path / "first", base, "eagle", write_layout("eagle", "eagle3", tmp_path / "src", base))
    config_file = first.path("spec") / "spec_config.json"
    config = json.loads(config_file.read_text())
    arch = config["modelopt_config"]["eagle_architecture_config"]
    del arch["hidden_norm_input"]  # as the spec stage trains it: ModelOpt's first layer
    config_file.write_text(json.dumps(config))
    out = export.export(first, "sglang", tmp_path / "exported", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["hidden_norm_input"] == "input_layernorm"
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    again = imported(tmp_path / "again", base, "eagle", out)
    assert spec_of(again)[0]["modelopt_config"]["eagle_architecture_config"]["hidden_norm_input"] == "input_layernorm"

    residual = imported(tmp_path / "residual", base, "eagle",
                        write_layout("eagle", "speculators", tmp_path / "src2", base, norm_before_residual=True))
    with pytest.raises(SpecDeployError, match="un-normed fc output as its residual") as refused:
        export.export(residual, "sglang", tmp_path / "refused")
    assert "--format speculators" in refused.value.hint and not (tmp_path / "refused").exists()
