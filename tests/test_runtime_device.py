"""The runtime computes where the target lives: every tensor it creates (prompt, pending token,
tree ids, masks, positions, KV indices, proposer buffers, the sampling generator) is made on the
target's device, deployment.json's "device" picks that device, and `generate --device` reaches it.

On this CPU the plumbing is checked by watching tensor factories: a TorchFunctionMode records each
torch.tensor/zeros/arange/... call made from specdeploy/runtime code and the device it was given.
A call without device= would make a CPU tensor next to a CUDA target. The `gpu` tests run the same
decoding on CUDA against transformers."""

from __future__ import annotations

import importlib.util
import json
import locale
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache

import specdeploy.runtime
from specdeploy.cli import main as cli_main
from specdeploy.errors import SpecDeployError
from specdeploy.runtime import decoding
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.deployment import deployment_device, load_decoder
from specdeploy.runtime.kv_cache import keep_path
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.sampling import make_generator
from specdeploy.runtime.types import DraftTree, SamplingParams, model_device
from specdeploy.runtime.verify import ancestry, tree_attention_mask, tree_position_ids
from specdeploy.triton.templating import TEMPLATES
from tests.conftest import CUDA
from tests.test_runtime_helpers import PROMPTS, draft, hf_greedy, one_thread, target, tokenizer  # noqa: F401

FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "randperm", "eye", "linspace", "logspace", "empty_strided", "scalar_tensor"}
RUNTIME_DIR = str(Path(specdeploy.runtime.__file__).parent)
MODEL_PY = TEMPLATES / "cpu" / "tensorrt_llm" / "1" / "model.py"
# most of the vocabulary: the n-gram proposer finds the last token earlier even when sampling
WIDE_PROMPT = list(range(3, 200))

PROPOSERS = {
    "none": lambda target, draft: None,
    "ngram": lambda target, draft: build_proposer("ngram", target),
    "draft": lambda target, draft: build_proposer("draft", target, draft_model=draft),
    "medusa": lambda target, draft: build_proposer("medusa", target, choices=[[0], [1], [0, 0], [0, 0, 0]]),
    "eagle-chain": lambda target, draft: build_proposer("eagle", target, mode="chain", chain_len=3),
    "eagle-static": lambda target, draft: build_proposer("eagle", target, mode="static", choices=[[0], [1], [0, 0]]),
    "eagle-dynamic": lambda target, draft: build_proposer("eagle", target, mode="dynamic", depth=3, draft_vocab=96),
    "dflash": lambda target, draft: build_proposer("dflash", target, block_size=4),
    "dflash-restricted": lambda target, draft: build_proposer("dflash", target, block_size=4, head_rows=64),
    "draft-restricted": lambda target, draft: build_proposer("draft", target, draft_model=draft, head_rows=64, stop_below=0.3),
}


class FactoryCalls(TorchFunctionMode):
    """Every tensor factory called from specdeploy/runtime: (where, device given, device made)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object, torch.device]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        caller = sys._getframe(1).f_code
        if getattr(func, "__name__", "") in FACTORIES and caller.co_filename.startswith(RUNTIME_DIR):
            where = f"{Path(caller.co_filename).name}:{caller.co_name} torch.{func.__name__}"
            self.calls.append((where, kwargs.get("device"), result.device))
        return result

    def undirected(self) -> list[str]:
        return sorted({where for where, given, _ in self.calls if given is None})

    def made_on(self) -> set[torch.device]:
        return {made for _, _, made in self.calls}


def run_watched(target, proposer, params: SamplingParams, prompt: list[int]):
    with FactoryCalls() as watch:
        result = generate(target, prompt, params, proposer, draft_len=4, adaptive=False)
    return result, watch


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_every_runtime_tensor_is_made_on_the_target_device(kind, temperature, target, draft, tokenizer):
    proposer = PROPOSERS[kind](target, draft)
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=3 if temperature else None)
    result, watch = run_watched(target, proposer, params, WIDE_PROMPT)
    assert result.metrics.new_tokens > 0
    assert watch.calls, "the watcher saw no factory call: it is not watching the runtime"
    assert watch.undirected() == [], "tensor factories without device= in the runtime"
    assert watch.made_on() == {model_device(target)}
    if kind != "none":
        assert result.metrics.draft_tokens > 0, "speculation never ran: the proposers went unchecked"


def test_the_watcher_names_a_factory_call_without_a_device():
    with FactoryCalls() as watch:
        ancestry([-1, 0])  # no device: a CPU tensor, whatever the target
        torch.zeros(2)  # not runtime code: not its business
    assert watch.undirected() == ["verify.py:ancestry torch.tensor"]


def test_the_request_generator_is_made_on_the_target_device(target, tokenizer, monkeypatch):
    made = []

    def spy(seed, device="cpu"):
        made.append(make_generator(seed, device))
        return made[-1]

    monkeypatch.setattr(decoding, "make_generator", spy)
    generate(target, tokenizer(PROMPTS[1])["input_ids"], SamplingParams(max_new_tokens=4, temperature=0.7, seed=1))
    assert [g.device for g in made] == [model_device(target)]


def test_make_generator_on_cpu_draws_like_torch_default():
    """Same seed, same stream as a plain torch.Generator: CPU sampling is unchanged."""
    ours, plain = make_generator(11, torch.device("cpu")), torch.Generator().manual_seed(11)
    assert ours.device == torch.device("cpu")
    assert torch.equal(torch.rand(8, generator=ours), torch.rand(8, generator=plain))


# --------------------------------------------------------------------------- device arguments
# `meta` is a real non-CPU device on every torch build: a helper that ignored its device
# argument would hand back a CPU tensor


def test_tree_helpers_honour_their_device_argument():
    parents = [-1, -1, 0, 2]
    tree = DraftTree(tokens=torch.tensor([1, 2, 3, 4]), parents=parents)
    mask = tree_attention_mask(parents, 3, torch.float32, torch.device("meta"))
    assert mask.device.type == "meta" and mask.shape == (1, 1, 5, 8) and mask.dtype == torch.float32
    assert tree_position_ids(tree, 3, "meta").device.type == "meta"
    assert ancestry(parents, "meta").device.type == "meta"
    assert DraftTree.empty("meta").tokens.device.type == "meta"
    # the CPU values: the pending token sees the prefix, node 3 sees its ancestors 0 and 2 only
    cpu = tree_attention_mask(parents, 3, torch.float32)[0, 0]
    assert cpu[0, :4].eq(0).all() and cpu[0, 4:].eq(torch.finfo(torch.float32).min).all()
    assert (cpu[4] == 0).tolist() == [True, True, True, True, True, False, True, True]


def test_keep_path_indexes_on_the_cache_device():
    cache = DynamicCache()
    keys = torch.empty(1, 2, 9, 4, device="meta")
    cache.update(keys, keys.clone(), 0)
    with FactoryCalls() as watch:
        keep_path(cache, 5, [1, 3])  # a gather (not a crop): needs an index tensor
    assert [(given, made.type) for _, given, made in watch.calls] == [(torch.device("meta"), "meta")]
    assert cache.layers[0].keys.shape == (1, 2, 8, 4)


# --------------------------------------------------------------------------- deployment.json


def test_deployment_device_field(tmp_path):
    path = tmp_path / "deployment.json"
    cpu = torch.device("cpu")
    assert deployment_device({}, path) == cpu  # packaged before the field: the CPU
    assert deployment_device({"device": "cpu"}, path) == cpu
    assert deployment_device({"device": "auto"}, path) == (torch.device("cuda", torch.cuda.current_device()) if CUDA else cpu)
    assert deployment_device({"device": "cuda:0"}, path, override="cpu") == cpu  # a KIND_GPU instance / --device wins
    for bad in ("gpu", "cuda:x", 3):
        with pytest.raises(SpecDeployError, match=r"deployment.json: device .* is not a device") as err:
            deployment_device({"device": bad}, path)
        assert "auto, cpu, cuda or cuda:N" in err.value.hint


@pytest.mark.skipif(CUDA, reason="checks the refusal where torch sees no GPU")
def test_deployment_on_cuda_without_a_gpu_is_refused(tmp_path, tiny_llama_dir):
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"model_dir": str(tiny_llama_dir), "dtype": "float32", "device": "cuda", "spec": {}}))
    with pytest.raises(SpecDeployError, match="sees no CUDA device"):
        load_decoder(path)


@pytest.mark.parametrize("device", ["cpu", "auto", None])
def test_load_decoder_runs_where_deployment_json_says(device, tmp_path, tiny_llama_dir, target, tokenizer):
    config = {"model_dir": str(tiny_llama_dir), "dtype": "float32", "spec": {"kind": "ngram", "max_draft_len": 4}}
    if device:
        config["device"] = device
    (tmp_path / "deployment.json").write_text(json.dumps(config))
    decoder = load_decoder(tmp_path / "deployment.json")
    expected = deployment_device(config, tmp_path / "deployment.json")
    assert decoder.device == expected == model_device(decoder.target)
    if expected.type != "cpu":
        return  # `auto` on a GPU host: the gpu tests below compare outputs there
    _, result = decoder.generate(PROMPTS[0], SamplingParams(max_new_tokens=12))
    assert result.token_ids == hf_greedy(target, tokenizer(PROMPTS[0])["input_ids"], 12)


@pytest.mark.parametrize("dtype,device,warned", [("float64", "cuda:0", True), ("float64", "cpu", False),
                                                  ("float32", "cuda:0", False)])
def test_float64_on_a_gpu_is_served_but_said(dtype, device, warned, tmp_path, monkeypatch, capsys, target, tokenizer):
    """The package stage may choose float64 to prove exact parity: allowed on CUDA, but logged."""
    from specdeploy.runtime import deployment

    loaded = []
    monkeypatch.setattr(deployment, "resolve_device", torch.device)  # no GPU needed to reach the check
    monkeypatch.setattr(deployment, "load_model", lambda *args: loaded.append(args) or (target, tokenizer))
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"model_dir": "m", "dtype": dtype, "device": device, "spec": {}}))
    load_decoder(path)
    assert loaded[0][1:] == (dtype, torch.device(device))
    assert ("serves in float64 on cuda:0" in capsys.readouterr().err) == warned


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_generate_command_device(device, tiny_llama_dir, capsys):
    argv = ["generate", PROMPTS[1], "--model", str(tiny_llama_dir), "--spec", "ngram", "--max-new-tokens", "6",
            "--no-stream", "--device", device]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    where = "cuda" if device == "auto" and CUDA else "cpu"
    assert f"specdeploy generate: computing on {where}" in err


def test_generate_command_takes_the_deployment_device_unless_told(tmp_path, tiny_llama_dir, capsys):
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"model_dir": str(tiny_llama_dir), "dtype": "float32", "device": "bogus", "spec": {}}))
    argv = ["generate", "hi", "--deployment", str(path), "--max-new-tokens", "3", "--no-stream"]
    assert cli_main(argv) == 2  # the file's device is read (and refused)...
    assert "device 'bogus' is not a device" in capsys.readouterr().err
    assert cli_main(argv + ["--device", "cpu"]) == 0  # ...unless --device overrides it
    assert "computing on cpu" in capsys.readouterr().err


# --------------------------------------------------------------------------- the Triton model


@pytest.fixture()
def triton_model(monkeypatch):
    """The Python-backend model.py, imported with a stand-in for Triton's pb_utils."""
    pb_utils = types.SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)
    spec = importlib.util.spec_from_file_location("specdeploy_triton_model", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as Triton's stub does: its dataclasses resolve their module
    ctype = locale.setlocale(locale.LC_CTYPE)
    spec.loader.exec_module(module)  # sets the stub's locale: this process gets its own back
    locale.setlocale(locale.LC_CTYPE, ctype)
    return module


def test_kind_gpu_instance_runs_on_its_gpu(triton_model):
    assert triton_model.instance_device({"model_instance_kind": "GPU", "model_instance_device_id": "1"}) == "cuda:1"
    assert triton_model.instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}) is None
    assert triton_model.instance_device({}) is None  # then deployment.json's device


# --------------------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def cuda_pair(tiny_llama_dir, tiny_draft_dir):
    """Target and draft in fp32 on the GPU (only `gpu` tests ask for it)."""
    from specdeploy.checkpoints import load_causal_lm

    device = f"cuda:{torch.cuda.current_device()}"
    return load_causal_lm(tiny_llama_dir, "float32", device=device), load_causal_lm(tiny_draft_dir, "float32", device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_gpu_greedy_equals_transformers_on_cuda(kind, cuda_pair, tokenizer):
    target, draft = cuda_pair
    assert model_device(target).type == "cuda"
    proposer = PROPOSERS[kind](target, draft)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        result, watch = run_watched(target, proposer, SamplingParams(max_new_tokens=32), ids)
        assert result.token_ids == hf_greedy_on(target, ids, 32)
        assert watch.undirected() == [] and watch.made_on() == {model_device(target)}


@pytest.mark.gpu
def test_gpu_sampling_uses_a_cuda_generator_and_is_reproducible(cuda_pair, tokenizer):
    target, draft = cuda_pair
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=50, seed=5)
    proposer = build_proposer("draft", target, draft_model=draft)
    ids = tokenizer(PROMPTS[2])["input_ids"]
    first, watch = run_watched(target, proposer, params, ids)
    second, _ = run_watched(target, proposer, params, ids)
    assert first.token_ids == second.token_ids and first.metrics.draft_tokens > 0
    assert watch.made_on() == {model_device(target)}


@pytest.mark.gpu
def test_gpu_draft_given_on_cpu_moves_to_the_target(cuda_pair, tiny_draft_dir):
    from specdeploy.checkpoints import load_causal_lm

    target, _ = cuda_pair
    proposer = build_proposer("draft", target, draft_model=load_causal_lm(tiny_draft_dir, "float32", device="cpu"))
    assert model_device(proposer.draft) == model_device(target)


def hf_greedy_on(model, ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids], device=model_device(model)), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(ids):].tolist()
