"""One prompt encoding everywhere: what verify's reference, validation, the planner, bench,
calibration and distillation feed the model is what the served preprocessing makes of the text a
client sends, for a tokenizer that adds a BOS and a chat template that writes one (Llama 2/3)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from specdeploy import data
from specdeploy.triton.templating import TEMPLATES, copy_model
from tests.tiny import make_llama, make_tokenizer

PREPROCESSING = TEMPLATES / "inflight_batcher_llm" / "preprocessing"  # the template: package copies the prompt code in
CHAT = "Why is the sky blue?"
CODE = "def add(a, b):\n"
ANSWER = "Light scatters."
# the same chat shape without a BOS of its own: the served preprocessing adds the tokenizer's
NO_BOS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bos_llama")
    make_llama(out, make_tokenizer(out, adds_bos=True))
    return out


@pytest.fixture(params=["template with BOS", "template without BOS"])
def tokenizer(request, bos_dir):
    tokenizer = AutoTokenizer.from_pretrained(bos_dir)
    if request.param == "template without BOS":
        tokenizer.chat_template = NO_BOS_TEMPLATE
    return tokenizer


@pytest.fixture()
def served(monkeypatch, tokenizer, tmp_path):
    """text -> the ids the served preprocessing model (imported with a stand-in for Triton's
    pb_utils, its folder on sys.path as Triton's stub puts it) makes of it, as packaged."""
    folder = tmp_path / "preprocessing"
    copy_model(PREPROCESSING, folder)  # as `specdeploy package` writes it: specdeploy_prompts.py beside model.py
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace())
    monkeypatch.syspath_prepend(str(folder / "1"))
    spec = importlib.util.spec_from_file_location("specdeploy_preprocessing", folder / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenizer.save_pretrained(tmp_path)
    config = {"parameters": {"tokenizer_dir": {"string_value": str(tmp_path)},
                             "add_special_tokens": {"string_value": "true"}}}  # as package writes it
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path)})

    def ids(text: str) -> list[int]:
        encoded, lengths = model._encode(np.array([[text.encode()]], dtype=object))
        return encoded[0, :lengths[0, 0]].tolist()

    return ids


def _client_text(tokenizer, prompt: str) -> str:
    """What a chat client sends: the user turn in the model's chat template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


@pytest.fixture()
def data_prompts(monkeypatch):
    """The data packages' prompts replaced by one chat and one code prompt."""
    monkeypatch.setattr(data, "sharegpt_prompts", lambda *args, **kwargs: [CHAT])
    monkeypatch.setattr(data, "humaneval_prompts", lambda *args, **kwargs: [CODE])
    monkeypatch.setattr(data, "sharegpt_conversations", lambda *args, **kwargs: [
        [{"role": "user", "content": CHAT}, {"role": "assistant", "content": ANSWER}]])


def test_the_served_preprocessing_gives_a_templated_prompt_one_bos(tokenizer, served):
    bos = tokenizer.bos_token_id
    assert served(_client_text(tokenizer, CHAT)).count(bos) == 1
    assert served(CODE)[0] == bos and served(CODE).count(bos) == 1


def test_verifys_reference_reads_the_prompt_the_server_reads(tokenizer, served, bos_dir):
    from specdeploy.checkpoints import load_causal_lm
    from specdeploy.verify.reference import Reference, load_prompts

    reference = Reference(load_causal_lm(bos_dir), tokenizer)
    for text in (_client_text(tokenizer, CHAT), CODE):
        assert reference.ids(text)[0].tolist() == served(text)
    for prompt in load_prompts(1, tokenizer):  # what verify sends: the chat template's text, code as it is
        assert reference.ids(prompt.text_input)[0].tolist() == served(prompt.text_input)


def test_validation_and_distillation_feed_what_is_served(tokenizer, served):
    from specdeploy.speculator.validate import encode

    assert encode(tokenizer, CHAT, "chat") == served(_client_text(tokenizer, CHAT))
    assert encode(tokenizer, CODE, "code") == served(CODE)


def test_the_planner_and_bench_measure_what_is_served(tokenizer, served, data_prompts):
    from specdeploy.bench import load_prompts
    from specdeploy.runtime.planner import calibration_prompts

    assert calibration_prompts(tokenizer, 2) == [served(_client_text(tokenizer, CHAT)), served(CODE)]
    assert load_prompts("sharegpt", 1, tokenizer, chat=True) == [served(_client_text(tokenizer, CHAT))]
    assert load_prompts("humaneval", 1, tokenizer, chat=False) == [served(CODE)]


def test_calibration_and_the_quality_report_see_what_is_served(tokenizer, served, data_prompts):
    """Calibration and teacher-forced distillation read a user turn and its answer: as the server
    would read that conversation sent as text."""
    from specdeploy.quantize.calibrate import calibration_batches
    from specdeploy.quantize.report import report_prompts
    from specdeploy.speculator.distill import read_ids

    conversation = [{"role": "user", "content": CHAT}, {"role": "assistant", "content": ANSWER}]
    expected = served(tokenizer.apply_chat_template(conversation, tokenize=False))
    assert calibration_batches(tokenizer, 1, 512)[0][0].tolist() == expected
    assert read_ids(tokenizer, conversation, 512) == expected
    assert report_prompts(tokenizer, 1) == [served(_client_text(tokenizer, CHAT))]


def test_the_runtimes_generate_reads_what_is_served(tokenizer, served):
    """`specdeploy generate` (Decoder.encode) encodes a prompt as the server would read it."""
    from specdeploy.runtime.deployment import Decoder

    decoder = Decoder(target=None, tokenizer=tokenizer, chat_template=True)
    assert decoder.encode(CHAT) == served(_client_text(tokenizer, CHAT))
    assert decoder.encode(CODE, chat=False) == served(CODE)
