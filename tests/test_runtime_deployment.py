"""deployment.json -> Decoder, the chat template, and the `specdeploy generate` command."""

from __future__ import annotations

import json

import pytest

from specdeploy.cli import main as cli_main
from specdeploy.errors import SpecDeployError
from specdeploy.runtime.deployment import Decoder, load_decoder
from specdeploy.runtime.types import SamplingParams
from tests.test_runtime_helpers import PROMPTS, hf_greedy, one_thread, target, tokenizer  # noqa: F401


def write_deployment(folder, model_dir, spec) -> str:
    path = folder / "deployment.json"
    path.write_text(json.dumps({"model_dir": str(model_dir), "dtype": "float32", "spec": spec}))
    return str(path)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_load_decoder_generates_exactly(kind, tmp_path, tiny_llama_dir, tiny_draft_dir, target, tokenizer):
    spec = {"kind": kind, "max_draft_len": 4, "draft_model_dir": str(tiny_draft_dir) if kind == "draft" else None}
    decoder = load_decoder(write_deployment(tmp_path, tiny_llama_dir, spec))
    assert (decoder.proposer is None) == (kind == "none")
    text, result = decoder.generate(PROMPTS[0], SamplingParams(max_new_tokens=20))
    assert result.token_ids == hf_greedy(target, tokenizer(PROMPTS[0])["input_ids"], 20)
    assert text == tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_draft_options_reach_the_proposer(tmp_path, tiny_llama_dir, tiny_draft_dir, target, tokenizer):
    spec = {"kind": "draft", "max_draft_len": 4, "draft_model_dir": str(tiny_draft_dir), "head_rows": 64,
            "stop_below": 0.3}
    decoder = load_decoder(write_deployment(tmp_path, tiny_llama_dir, spec))
    assert decoder.proposer.head.rows == 64 and decoder.proposer.stop_below == 0.3
    _, result = decoder.generate(PROMPTS[0], SamplingParams(max_new_tokens=20))
    assert result.token_ids == hf_greedy(target, tokenizer(PROMPTS[0])["input_ids"], 20)


def test_dflash_deployment(tmp_path, tiny_llama_dir, target, tokenizer):
    """A spec/ folder of kind dflash (spec_config.json + module.safetensors) serves exactly."""
    from safetensors.torch import save_file

    from specdeploy.runtime.proposers import build_proposer
    from specdeploy.runtime.proposers.dflash import modelopt_config

    fresh = build_proposer("dflash", target, block_size=3, mask_token_id=5)
    module_dir = tmp_path / "spec"
    module_dir.mkdir()
    save_file({f"dflash_module.{k}": v.contiguous() for k, v in fresh.module.state_dict().items()},
              str(module_dir / "module.safetensors"))
    config = modelopt_config(target.config, mask_token_id=5, block_size=3)
    (module_dir / "spec_config.json").write_text(json.dumps({"kind": "dflash", "modelopt_config": config}))
    decoder = load_decoder(write_deployment(tmp_path, tiny_llama_dir, {"kind": "dflash", "path": "spec", "max_draft_len": 2}))
    assert decoder.proposer.block_size == 3 and decoder.draft_len == 2
    _, result = decoder.generate(PROMPTS[2], SamplingParams(max_new_tokens=20))
    assert result.token_ids == hf_greedy(target, tokenizer(PROMPTS[2])["input_ids"], 20)
    assert result.metrics.draft_tokens > 0


def test_load_decoder_errors(tmp_path, tiny_llama_dir):
    with pytest.raises(SpecDeployError, match="cannot read"):
        load_decoder(tmp_path / "missing.json")
    with pytest.raises(SpecDeployError, match="draft_model_dir"):
        load_decoder(write_deployment(tmp_path, tiny_llama_dir, {"kind": "draft"}))
    with pytest.raises(SpecDeployError, match="needs spec.path"):
        load_decoder(write_deployment(tmp_path, tiny_llama_dir, {"kind": "medusa"}))


def test_chat_template_applied_when_asked(target, tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    decoder = Decoder(target, tokenizer, chat_template=True)
    wrapped = decoder.encode("Hello")
    assert tokenizer.decode(wrapped) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert decoder.encode("Hello", chat=False) == tokenizer("Hello")["input_ids"]
    tokenizer.chat_template = None
    assert decoder.encode("Hello") == tokenizer("Hello")["input_ids"]  # no template: the raw prompt


def test_generate_command(tiny_llama_dir, tiny_draft_dir, capsys):
    argv = ["generate", PROMPTS[1], "--model", str(tiny_llama_dir), "--spec", "draft", "--draft", str(tiny_draft_dir)]
    assert cli_main(argv + ["--max-new-tokens", "12", "--metrics-json"]) == 0
    out, err = capsys.readouterr()
    metrics = json.loads(err.strip().splitlines()[-1])
    assert 1 <= metrics["new_tokens"] <= 12 and out.strip()
    assert cli_main(argv + ["--max-new-tokens", "0"]) == 2
    assert "max_new_tokens must be positive" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "typo", "known"), [
    ({"kind": "ngram", "max_ngrams": 4}, "max_ngrams", "max_ngram"),
    ({"kind": "ngram", "max_draft_length": 4}, "max_draft_length", "min_ngram"),
    ({"kind": "draft", "head_row": 64}, "head_row", "head_rows"),
])
def test_a_misspelled_spec_key_is_refused_by_name(spec, typo, known, tmp_path, tiny_llama_dir, tiny_draft_dir):
    spec = {**spec, "max_draft_len": 4, "draft_model_dir": str(tiny_draft_dir) if spec["kind"] == "draft" else None}
    with pytest.raises(SpecDeployError, match=f"unknown {spec['kind']} option '{typo}'") as err:
        load_decoder(write_deployment(tmp_path, tiny_llama_dir, spec))
    assert known in err.value.hint


@pytest.mark.parametrize(("kind", "typo", "known"), [("eagle", "budgt", "budget"), ("medusa", "choises", "choices"),
                                                     ("dflash", "block_sise", "block_size"), ("draft", "stop_bellow", "stop_below")])
def test_proposer_factories_refuse_unknown_options(kind, typo, known, target):
    from specdeploy.runtime.proposers import build_proposer

    with pytest.raises(SpecDeployError, match=f"unknown {kind} option '{typo}'") as err:
        build_proposer(kind, target, **{typo: 1})
    assert known in err.value.hint


def test_generate_refuses_a_sliding_window_model_plainly(tmp_path, tiny_tokenizer_dir, capsys):
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, sliding_window=16)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    tokenizer.save_pretrained(tmp_path / "mistral")
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"  # repeats: n-gram drafts at once
    argv = ["generate", prompt, "--model", str(tmp_path / "mistral"), "--max-new-tokens", "24", "--device", "cpu"]
    assert cli_main(argv + ["--spec", "ngram"]) == 2
    err = capsys.readouterr().err
    assert "sliding-window attention (sliding_window=16, context 256)" in err and "--spec none" in err
    assert cli_main(argv + ["--spec", "none"]) == 0  # plain decoding stays possible
