"""TRT-LLM checkpoint conversion, validated offline (TensorRT-LLM cannot be installed beside the
project's stack, docs/environment.md):

- the reader (TRT-LLM layout -> HF) reproduces the source logits bit for bit, for tp/pp shards;
- an independent oracle, ModelOpt's own export_tensorrt_llm_checkpoint (the exporter NVIDIA ships
  for TRT-LLM), writes the same tensors under the same names for the same tp/pp;
- every config.json field is one TRT-LLM's config classes read (field sets in formats.py, read
  from tensorrt_llm/models/{modeling_utils,llama/config,qwen/config,medusa/config}.py);
- forbidden combinations fail with a clear error.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdeploy.errors import SpecDeployError
from specdeploy.trtllm import formats
from specdeploy.trtllm.engine_checkpoint import convert_all
from specdeploy.trtllm.reader import build_hf_model, read_checkpoint
from specdeploy.trtllm.spec_input import load_spec

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 300, 2]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _source_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return _logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())


def _config(out: Path, role: str = "target") -> dict:
    return json.loads((out / role / "config.json").read_text())


def _check_fields(config: dict) -> None:
    """Every key is a field TRT-LLM's config class for this architecture takes."""
    family = formats.QWEN_CONFIG_FIELDS if config.get("qwen_type") or config.get("model_type") == "qwen2" else formats.LLAMA_CONFIG_FIELDS
    allowed = formats.PRETRAINED_CONFIG_FIELDS | family
    if config["architecture"] == "MedusaForCausalLM":
        allowed |= formats.MEDUSA_FIELDS
    assert set(config) <= allowed, set(config) - allowed
    required = {"architecture", "dtype", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "mapping", "quantization", "position_embedding_type"}
    assert required <= set(config)
    assert set(config["mapping"]) == formats.MAPPING_FIELDS
    assert config["mapping"]["world_size"] == config["mapping"]["tp_size"] * config["mapping"]["pp_size"]
    assert set(config["quantization"]) <= formats.QUANT_CONFIG_FIELDS
    assert config["position_embedding_type"] == "rope_gpt_neox"


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2)])
def test_base_round_trip_reproduces_logits_exactly(tiny_llama_dir, tmp_path, tp, pp):
    convert_all(tiny_llama_dir, tmp_path, tp=tp, pp=pp)
    config = _config(tmp_path)
    _check_fields(config)
    assert config["architecture"] == "LlamaForCausalLM" and config["mapping"] == {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    assert sorted(p.name for p in (tmp_path / "target").glob("rank*.safetensors")) == sorted(f"rank{r}.safetensors" for r in range(tp * pp))
    model = build_hf_model(read_checkpoint(tmp_path / "target"))
    assert torch.equal(_logits(model), _source_logits(tiny_llama_dir))


def test_shards_hold_what_each_rank_declares(tiny_llama_dir, tmp_path):
    """tp=2 x pp=2: embedding on the first stage, ln_f/lm_head on the last, local layer indices,
    column/row halves that concatenate back to the HF weights."""
    convert_all(tiny_llama_dir, tmp_path, tp=2, pp=2)
    ranks = [load_file(str(tmp_path / "target" / f"rank{r}.safetensors")) for r in range(4)]
    src = load_file(str(tiny_llama_dir / "model.safetensors"))
    for r, tensors in enumerate(ranks):
        first, last = r // 2 == 0, r // 2 == 1
        assert ("transformer.vocab_embedding.weight" in tensors) == first
        assert ("lm_head.weight" in tensors) == last and ("transformer.ln_f.weight" in tensors) == last
        assert not any(k.startswith("transformer.layers.1.") for k in tensors)  # 2 layers / 2 stages
    # stage 1, layer 0 is global layer 1: q/k/v halves per rank, o_proj split along its input
    hd, q, kv = 16, 64, 32
    for t in range(2):
        qkv = ranks[2 + t]["transformer.layers.0.attention.qkv.weight"]
        assert qkv.shape == (q // 2 + kv, 64)
        assert torch.equal(qkv[: q // 2], src["model.layers.1.self_attn.q_proj.weight"].chunk(2)[t])
        assert torch.equal(qkv[q // 2: q // 2 + kv // 2], src["model.layers.1.self_attn.k_proj.weight"].chunk(2)[t])
    dense = torch.cat([ranks[2 + t]["transformer.layers.0.attention.dense.weight"] for t in range(2)], dim=1)
    assert torch.equal(dense, src["model.layers.1.self_attn.o_proj.weight"])
    fc = torch.cat([ranks[2 + t]["transformer.layers.0.mlp.fc.weight"] for t in range(2)])
    assert torch.equal(fc, src["model.layers.1.mlp.gate_proj.weight"])  # GatedMLP activates fc
    assert hd * 4 == q


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (4, 1)])
def test_matches_modelopt_trtllm_export(tiny_llama_dir, tmp_path, tp, pp):
    """Same names, shapes and values as NVIDIA's exporter (except the embedding, which ModelOpt
    shards with use_parallel_embedding=True and we replicate with use_parallel_embedding=False)."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.inference_mode():
        export_tensorrt_llm_checkpoint(model, "llama", torch.float16, export_dir=tmp_path / "oracle",
                                       inference_tensor_parallel=tp, inference_pipeline_parallel=pp)
    convert_all(tiny_llama_dir, tmp_path / "ours", tp=tp, pp=pp)
    oracle_cfg = json.loads((tmp_path / "oracle" / "config.json").read_text())
    assert oracle_cfg["mapping"] == _config(tmp_path / "ours")["mapping"]
    for r in range(tp * pp):
        theirs = load_file(str(tmp_path / "oracle" / f"rank{r}.safetensors"))
        ours = load_file(str(tmp_path / "ours" / "target" / f"rank{r}.safetensors"))
        assert set(theirs) == set(ours)
        for name, t in theirs.items():
            if name == "transformer.vocab_embedding.weight" and tp > 1:
                continue
            assert t.shape == ours[name].shape, name
            assert torch.equal(t, ours[name].to(t.dtype)), name


def test_qwen2_with_qkv_bias_round_trip(tmp_path, tiny_tokenizer_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    for layer in model.model.layers:  # make the q/k/v biases matter
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    model.config.architectures = ["Qwen2ForCausalLM"]
    model.save_pretrained(tmp_path / "qwen")
    convert_all(tmp_path / "qwen", tmp_path / "out", tp=2)
    config = _config(tmp_path / "out")
    _check_fields(config)
    assert config["architecture"] == "Qwen2ForCausalLM" and config["qwen_type"] == "qwen2" and config["attn_bias"] is True
    rank0 = load_file(str(tmp_path / "out" / "target" / "rank0.safetensors"))
    assert rank0["transformer.layers.0.attention.qkv.bias"].shape == (32 + 2 * 16,)  # q/2 + k/2 + v/2
    assert "transformer.layers.0.attention.dense.bias" not in rank0  # Qwen2: bias on q/k/v only
    assert torch.equal(torch.cat([load_file(str(tmp_path / "out" / "target" / f"rank{r}.safetensors"))["lm_head.weight"] for r in range(2)]),
                       model.model.embed_tokens.weight.detach())  # tied embedding written as lm_head
    rebuilt = build_hf_model(read_checkpoint(tmp_path / "out" / "target"))
    assert torch.equal(_logits(rebuilt), _logits(model))


@pytest.mark.parametrize("tp, pp, message", [
    (3, 1, "not divisible by --tp-size 3"),
    (1, 3, "do not split evenly"),
    (8, 1, "not divisible by --tp-size 8"),
])
def test_forbidden_mappings_fail_clearly(tiny_llama_dir, tmp_path, tp, pp, message):
    with pytest.raises(SpecDeployError, match=message):
        convert_all(tiny_llama_dir, tmp_path, tp=tp, pp=pp)
    assert not list(tmp_path.glob("target/rank*.safetensors"))


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SpecDeployError, match="GPT2LMHeadModel is not supported"):
        convert_all(tmp_path, tmp_path / "out")


# ------------------------------------------------------------------------------ Medusa

def _medusa_model(base: Path, heads: int = 3, layers: int = 1):
    import modelopt.torch.speculative as mtsp
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    mtsp.convert(model, [("medusa", {"medusa_num_heads": heads, "medusa_num_layers": layers})])
    return model


@pytest.fixture(scope="module")
def medusa_spec(tiny_llama_dir, tmp_path_factory):
    """A spec/ folder as the spec stage writes it, from a ModelOpt Medusa model (2 ResBlocks/head)."""
    torch.manual_seed(7)
    model = _medusa_model(tiny_llama_dir, heads=3, layers=2)
    for p in model.medusa_heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    spec = tmp_path_factory.mktemp("medusa_spec")
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("medusa_heads.")}, str(spec / "module.safetensors"))
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    (spec / "spec_config.json").write_text(json.dumps({"kind": "medusa", "modelopt_config": {"medusa_num_heads": 3, "medusa_num_layers": 2}, "choices": choices}))
    return spec, model


@pytest.mark.parametrize("tp", [1, 2])
def test_medusa_round_trip_reproduces_head_logits(tiny_llama_dir, tmp_path, medusa_spec, tp):
    spec_dir, source = medusa_spec
    convert_all(tiny_llama_dir, tmp_path, tp=tp, spec=load_spec(spec_dir))
    config = _config(tmp_path)
    _check_fields(config)
    assert (config["architecture"], config["num_medusa_heads"], config["num_medusa_layers"], config["max_draft_len"]) == ("MedusaForCausalLM", 3, 2, 5)
    rank0 = load_file(str(tmp_path / "target" / "rank0.safetensors"))
    assert rank0["medusa_heads.2.medusa_layers.1.linear.weight"].shape == (64 // tp, 64)
    assert rank0["medusa_heads.0.lm_head.weight"].shape == (384 // tp, 64)
    layout = read_checkpoint(tmp_path / "target")
    rebuilt = _medusa_model(tiny_llama_dir, heads=3, layers=2)
    rebuilt.load_state_dict({**layout.tensors, **layout.module}, strict=True)
    with torch.no_grad():
        want, got = source(IDS), rebuilt(IDS)
    assert torch.equal(want.logits, got.logits)
    assert all(torch.equal(a, b) for a, b in zip(want.medusa_logits, got.medusa_logits))


def test_medusa_names_match_modelopt_trtllm_export(tiny_llama_dir, tmp_path, medusa_spec):
    """ModelOpt's TRT-LLM export maps its Medusa heads to MedusaForCausalLM names: ours agree."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    spec_dir, _ = medusa_spec
    model = _medusa_model(tiny_llama_dir, heads=3, layers=2)
    model.load_state_dict(load_file(str(spec_dir / "module.safetensors")), strict=False)
    with torch.inference_mode():
        export_tensorrt_llm_checkpoint(model, "llama", torch.float16, export_dir=tmp_path / "oracle", inference_tensor_parallel=1)
    convert_all(tiny_llama_dir, tmp_path / "ours", spec=load_spec(spec_dir))
    theirs = load_file(str(tmp_path / "oracle" / "rank0.safetensors"))
    ours = load_file(str(tmp_path / "ours" / "target" / "rank0.safetensors"))
    medusa = {k for k in theirs if k.startswith("medusa_heads.")}
    assert medusa and medusa == {k for k in ours if k.startswith("medusa_heads.")}
    for k in medusa:
        assert torch.equal(theirs[k], ours[k].half()), k


# -------------------------------------------------------------------- what the engine flow refuses

@pytest.mark.parametrize("kind, reason", [
    ("eagle", "EAGLE-1/2 (EagleForCausalLM) only"),
    ("ngram", "nothing in the Triton engine repository supplies them"),
])
def test_engine_flow_refuses_what_it_would_serve_wrongly(tiny_llama_dir, tmp_path, kind, reason):
    from specdeploy.trtllm.spec_input import SpecInput
    from specdeploy.trtllm.specmodules import EngineFlowUnsupported

    with pytest.raises(EngineFlowUnsupported, match=re.escape(reason)) as err:
        convert_all(tiny_llama_dir, tmp_path, spec=SpecInput(kind=kind))
    assert "--route llmapi" in err.value.hint
    assert not (tmp_path / "target").exists()


# ------------------------------------------------------------------------- draft-target

def test_draft_target_writes_two_plain_checkpoints(tiny_llama_dir, tiny_draft_dir, tmp_path):
    spec = load_spec(None, kind="draft", draft_model=tiny_draft_dir, max_draft_len=5)
    summary = convert_all(tiny_llama_dir, tmp_path, spec=spec)
    assert summary == {"kind": "draft", "tp_size": 1, "pp_size": 1, "max_draft_len": 5}
    for role, src in (("target", tiny_llama_dir), ("draft", tiny_draft_dir)):
        config = _config(tmp_path, role)
        _check_fields(config)
        assert config["architecture"] == "LlamaForCausalLM"
        assert torch.equal(_logits(build_hf_model(read_checkpoint(tmp_path / role))), _source_logits(src))
    assert _config(tmp_path, "draft")["hidden_size"] == 32


def test_cli_convert_direct(tiny_llama_dir, tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "specdeploy", "convert", "--hf-dir", str(tiny_llama_dir), "--out", str(tmp_path),
                           "--spec", "none", "--tp-size", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _config(tmp_path)["mapping"]["tp_size"] == 2
    bad = subprocess.run([sys.executable, "-m", "specdeploy", "convert", "--hf-dir", str(tiny_llama_dir), "--out", str(tmp_path / "x"),
                          "--spec", "none", "--tp-size", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "not divisible by --tp-size 3" in bad.stderr


def test_the_biases_a_llama_config_declares_are_the_engines_too(tmp_path):
    """TensorRT-LLM ignores bias tensors its config does not ask for (a warning): the engine
    computed without the attention and MLP biases the checkpoint held."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(cfg).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(tmp_path / "biased")
    convert_all(tmp_path / "biased", tmp_path / "out")
    config = _config(tmp_path / "out")
    assert config["attn_bias"] is True and config["mlp_bias"] is True
    rank0 = load_file(str(tmp_path / "out" / "target" / "rank0.safetensors"))
    assert {"transformer.layers.0.attention.qkv.bias", "transformer.layers.0.mlp.fc.bias"} <= set(rank0)
