"""The real speculators library (PyPI, 0.9.0) as the oracle for the speculators layout: it loads what
`specdeploy export --format speculators` writes and reads back the same config and tensors, and its
own converter from the EAGLE authors' layout gives a folder our import drafts identically from.

speculators needs numpy >= 2 (the project pins 1.26), so it runs in a venv of its own, made once and
cached under the specdeploy cache dir (tests/oracle.py; ~2 min the first time). torchvision and
torchaudio come with it from PyPI and are removed: their builds break transformers' imports beside
the CPU torch.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tests.tiny_modules as tm
from specdeploy import checkpoints, resolve
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.modules import export, stage
from tests.oracle import oracle_venv
from tests.test_modules import _drafts, base, imported, write_layout  # noqa: F401 (base: the fixture)

PROBE = Path(__file__).with_name("speculators_probe.py")


@pytest.fixture(scope="module")
def oracle() -> Path:
    return oracle_venv("speculators-0.9.0")


def run_probe(oracle: Path, *args: str) -> None:
    done = subprocess.run([str(oracle), str(PROBE), *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def read_back(oracle: Path, folder: Path, scratch: Path) -> tuple[dict, dict]:
    run_probe(oracle, "read", str(folder), str(scratch / "read.json"), str(scratch / "read.safetensors"))
    return json.loads((scratch / "read.json").read_text()), load_file(str(scratch / "read.safetensors"))


@pytest.mark.parametrize("kind,layout", [("eagle", "eagle3"), ("dflash", "dflash")])
def test_speculators_reads_our_export(kind, layout, oracle, base, tmp_path):
    build = imported(tmp_path / "build", base, kind, write_layout(kind, layout, tmp_path / "src", base))
    out = export.export(build, "speculators", tmp_path / "exported", verifier=str(base))
    read, tensors = read_back(oracle, out, tmp_path)
    assert read["version"] == "0.9.0"
    ours = load_file(str(out / "model.safetensors"))
    assert set(ours) <= set(tensors) and all(torch.equal(tensors[k], ours[k]) for k in ours)
    layer = read["layer"]
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"],
            layer["intermediate_size"], layer["vocab_size"]) == (tm.HIDDEN, tm.HEADS, tm.KV_HEADS, tm.HEAD_DIM, tm.INTER, tm.VOCAB)
    assert read["rope_theta"] == 10000.0 and read["verifier"] == {"name_or_path": str(base), "architectures": ["LlamaForCausalLM"]}
    config = read["config"]
    if kind == "eagle":
        assert read["class"] == "Eagle3DraftModel" and layer["model_type"] == "llama"
        assert config["draft_vocab_size"] == tm.DRAFT_VOCAB and config["norm_before_residual"] is False
        assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in tm.EAGLE_LAYERS]
        # the vocabulary map survived: the library holds our d2t and a t2d of draft_vocab_size entries
        assert torch.equal(tensors["d2t"], tm.eagle_weights()["d2t"]) and int(tensors["t2d"].sum()) == tm.DRAFT_VOCAB
    else:
        assert read["class"] == "DFlashDraftModel" and layer["model_type"] == "qwen3"
        assert (config["block_size"], config["mask_token_id"], config["aux_hidden_state_layer_ids"]) == (
            tm.BLOCK, tm.MASK, [i + 1 for i in tm.DFLASH_LAYERS])
        # the full-vocabulary head is the verifier's: what our DFlash drafts through
        assert torch.equal(tensors["lm_head.weight"], load_file(str(base / "model.safetensors"))["lm_head.weight"])


def test_speculators_computes_our_rope_from_our_export(oracle, base, tmp_path):
    """A module with a base's RoPE that is not the default (theta 500000, llama3 scaling, as Llama
    3.1's): the frequencies speculators' own rotary embedding computes from our export are the ones
    our runtime's module drafts with (transformers 5 keeps RoPE in rope_parameters, which we write)."""
    from specdeploy.runtime.proposers import build_proposer

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    source = write_layout("eagle", "eagle3", tmp_path / "src", base)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0, "rope_scaling": scaling}))
    build = imported(tmp_path / "build", base, "eagle", source, accept=("rope",))  # the tiny base's theta is 10000
    read, _ = read_back(oracle, export.export(build, "speculators", tmp_path / "exported", verifier=str(base)), tmp_path)
    target = checkpoints.load_causal_lm(base, dtype="float32")
    ours = build_proposer("eagle", target, spec_dir=build.path("spec")).module.rotary_emb.inv_freq
    plain = 1.0 / 500000.0 ** (torch.arange(0, tm.HEAD_DIM, 2).float() / tm.HEAD_DIM)
    assert read["rope_theta"] == 500000.0 and not torch.allclose(ours, plain)  # scaled, the low frequencies 8x lower
    assert torch.allclose(torch.tensor(read["inv_freq"]), ours, rtol=1e-6)


def test_speculators_own_converter_gives_what_our_import_drafts_from(oracle, base, tmp_path):
    authors = write_layout("eagle", "eagle3", tmp_path / "authors", base)
    converted = tmp_path / "converted"
    run_probe(oracle, "convert-eagle3", str(authors), str(base), str(converted), json.dumps([i + 1 for i in tm.EAGLE_LAYERS]))
    direct = imported(tmp_path / "direct", base, "eagle", authors)
    through = imported(tmp_path / "through", base, "eagle", converted)
    assert json.loads((through.path("spec") / "spec_config.json").read_text())["imported"]["layout"] == "speculators"
    assert _drafts(base, through.path("spec"), "eagle") == _drafts(base, direct.path("spec"), "eagle")


def test_speculators_converter_drops_a_trtllm_drafts_d2t_and_our_import_refuses_the_result(oracle, base, tmp_path):
    """The route the issue names: `speculators convert --algorithm eagle3` on the eagle3_draft folder
    (no t2d) keeps draft_vocab_size but loses d2t; imported, that is refused, not drafted wrongly."""
    build = imported(tmp_path / "build", base, "eagle", write_layout("eagle", "eagle3", tmp_path / "src", base))
    draft = export.export(build, "trtllm", tmp_path / "eagle3_draft", dtype="float32")
    converted = tmp_path / "converted"
    run_probe(oracle, "convert-eagle3", str(draft), str(base), str(converted), json.dumps([i + 1 for i in tm.EAGLE_LAYERS]))
    assert json.loads((converted / "config.json").read_text())["draft_vocab_size"] == tm.DRAFT_VOCAB
    assert "d2t" not in load_file(str(converted / "model.safetensors"))
    again = BuildDir(tmp_path / "again")
    resolve.run(again, str(base))
    with pytest.raises(SpecDeployError, match="draft_vocab_size 96 < 384 but no d2t"):
        stage.run(again, "eagle", converted, gate_floor=0)
