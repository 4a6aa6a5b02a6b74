"""Every Hugging Face folder the GPU host loads, read by the transformers its TensorRT-LLM release
pins, must read as our transformers (5.x) reads it: the oracle is that other transformers, not
this project's code.

- The pins are each release's own (specdeploy/trtllm/releases.py, from the release's wheel
  metadata): TensorRT-LLM 1.2.1 pins transformers==4.57.3, 1.1.0 (NVIDIA's Triton images
  25.12-26.02) pins ==4.56.0. The 1.3 / 1.4 pre-releases pin 5.5.4, a 5.x like ours: not run here.
- Each runs in a venv of its own, made once and cached under the specdeploy cache dir, keyed by
  its pins (PyPI + the CPU torch wheel: measured 36-84 s each on the 2-core machine beside a
  running `make engine`; 1.2 GB each).
- A miniature of the default build (SmolLM2's traits: tied embeddings, RoPE theta 100000, a
  ChatML template, extra special tokens) goes through resolve, spec (EAGLE-3, 2 steps), quantize
  (FP8), convert and package, plus a draft-target draft model copy and a DFlash drafter.
  tests/release_probe.py reads each folder in our venv and in the oracle's: configs (RoPE as the
  architecture's rotary embedding computes it, heads, head_dim, vocabulary, tying, dtype, layers,
  eps, quantization_config, the drafters' own fields), tokenizers (ids, decoding, special tokens,
  chat template), and a CPU forward of the unquantized models.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdeploy import resolve
from specdeploy.manifest import BuildDir
from specdeploy.quantize import stage as quantize_stage
from specdeploy.speculator.train import TrainSettings, train
from specdeploy.triton import stage
from specdeploy.trtllm import build as trt_build
from specdeploy.trtllm import convert, draft_folders, llmapi, releases, spec_input
from tests.oracle import TRANSFORMERS, oracle_venv
from tests.test_trtllm_llmapi import dflash_spec
from tests.tiny import make_tokenizer

# transformers version -> the release that pins it (the oracles: the 4.x pins, older than ours)
RELEASES = {r.transformers: f"TensorRT-LLM {r.version}" for r in releases.RELEASES.values() if r.transformers in TRANSFORMERS}
PROBE = Path(__file__).with_name("release_probe.py")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPTS = ["Hello! How can I help you today?", "def add(a, b):\n    return a + b\n", "  two  spaces\tand a tab\n",
           "héllo wörld, 日本語 😀", "<|im_start|>user\nhi<|im_end|>\n", "call <tool>print(i * i)</tool> now", "a"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the weather in Paris."}]
FORWARD_IDS = [1, 17, 60, 2, 201, 33, 385, 7, 120, 99, 3, 250]
TINY = dict(num_prompts=8, max_new_tokens=24, window=48, batch_size=4, draft_vocab=96, distill_batch=8, teacher_forced=0)


# ------------------------------------------------------------------------------ oracle venvs


def oracle_python(version: str) -> Path:
    """The python of a venv with transformers==`version` and the pins beside it (tests/oracle.py)."""
    return oracle_venv(f"transformers-{version}")


def probe(python: Path | str, request: dict[str, Any], scratch: Path) -> dict[str, Any]:
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "request.json").write_text(json.dumps(request))
    done = subprocess.run([str(python), str(PROBE), str(scratch / "request.json"), str(scratch / "result.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((scratch / "result.json").read_text())


# ------------------------------------------------------------------------------ the build


def chat_model(out: Path) -> Path:
    """SmolLM2's traits in miniature, saved by our transformers: a ChatML template and extra special
    tokens (+ miniature()'s)."""
    tokenizer = make_tokenizer(out)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>", "</tool>"]})
    tokenizer.chat_template = CHATML
    return miniature(out, tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, seed=0)


def miniature(out: Path, tokenizer: Any, *, hidden: int, layers: int, heads: int, kv_heads: int, seed: int) -> Path:
    """A Llama with tied embeddings and RoPE theta 100000 (not 4.x's default 10000), with its tokenizer."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         tie_word_embeddings=True, initializer_range=0.3, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def cpu_tokenizer_dir(build: BuildDir) -> Path:
    """The tokenizer folder package gave the pre/postprocessing models (one folder for the CPU and
    the engine repositories), as their model.py resolves it: relative to the model's folder."""
    model_folder = build.path("triton_repo") / "cpu" / "preprocessing"
    text = (model_folder / "config.pbtxt").read_text()
    found = re.search(r'key: "tokenizer_dir" value: \{ string_value: "([^"]+)" \}', text)
    assert found, "preprocessing/config.pbtxt names no tokenizer_dir"
    return (model_folder / found.group(1)).resolve()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{"source": what the pipeline read, "written": what it wrote for the GPU host}."""
    root = tmp_path_factory.mktemp("release")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEPLOY_CACHE", str(root / "cache"))  # distillation data, hashes: private to this build
        model = chat_model(root / "model")
        draft = miniature(root / "draft", AutoTokenizer.from_pretrained(model), hidden=32, layers=1, heads=2, kv_heads=1, seed=1)
        build = BuildDir(root / "build")
        resolve.run(build, str(model))
        with build.stage("spec", "spec", {"kind": "eagle"}, consumes=("resolve",)) as tmp:
            train(build.path("base"), tmp, TrainSettings(kind="eagle", steps=2, **TINY), device="cpu")
        quantize_stage.run(build, "fp8", calib_size=8, report=False, device="cpu")
        convert.run(build)
        trt_build.run(build)
        stage.run(build, spec="eagle", device="cpu")
        draft_target = root / "draft_target"
        convert.convert_routes(build.path("quantized"), draft_target, spec_input.load_spec(None, kind="draft", draft_model=draft),
                               route="llmapi", root=root)
        plain = root / "plain"  # the unquantized float32 base on the LLM-API route: its bfloat16 copy
        convert.convert_routes(build.path("base"), plain, spec_input.load_spec(None, kind="none"), route="llmapi", root=root)
        dflash_spec(build.path("base"), root / "dflash_spec")
        dflash = draft_folders.dflash_draft(root / "dflash_spec", root / "dflash")
    ckpt = build.path("trtllm_ckpt")
    return {
        "source": {"base": model, "draft_model": draft},
        "written": {"base": build.path("base"), "quantized": build.path("quantized"),
                    "eagle3_draft": ckpt / "llmapi" / draft_folders.DRAFT_FOLDER, "dflash_draft": dflash,
                    "draft_model": draft_target / convert.DRAFT_MODEL, "triton_tokenizer": cpu_tokenizer_dir(build),
                    "model_bf16": plain / "llmapi" / llmapi.HALF_TARGET,
                    "draft_model_bf16": draft_target / "llmapi" / llmapi.HALF_DRAFT},
    }


def request_for(found: dict[str, Path]) -> dict[str, Any]:
    tokenizers = ("base", "quantized", "draft_model", "triton_tokenizer", "model_bf16", "draft_model_bf16")
    return {
        "configs": {name: str(path) for name, path in found.items() if name != "triton_tokenizer"},
        "tokenizers": {name: str(found[name]) for name in tokenizers if name in found},
        "forwards": {name: str(found[name]) for name in ("base", "draft_model")},
        "prompts": PROMPTS, "messages": MESSAGES, "forward_ids": FORWARD_IDS,
    }


@pytest.fixture(scope="module")
def ours(folders, tmp_path_factory) -> dict[str, Any]:
    """Our reads of the written folders, and of their sources as "source:<name>"."""
    request = request_for(folders["written"])
    for kind, found in request_for(folders["source"]).items():
        if isinstance(found, dict):
            request[kind].update({f"source:{name}": path for name, path in found.items()})
    return probe(sys.executable, request, tmp_path_factory.mktemp("ours"))


@pytest.fixture(scope="module", params=list(RELEASES), ids=lambda v: f"transformers-{v}")
def theirs(request, folders, tmp_path_factory) -> dict[str, Any]:
    read = probe(oracle_python(request.param), request_for(folders["written"]), tmp_path_factory.mktemp("theirs"))
    assert read["transformers"] == request.param
    return read


# ------------------------------------------------------------------------------ the checks


def readable(read: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    value = read[kind][name]
    assert "error" not in value, f"transformers {read['transformers']} cannot read {name}: {value['error']}\n{value['traceback']}"
    return value


def same(theirs: dict[str, Any], ours: dict[str, Any], kind: str) -> None:
    """Every folder read alike: a list of (folder, field, theirs, ours) differences must be empty."""
    differ = []
    for name in theirs[kind]:
        mine, other = readable(ours, kind, name), readable(theirs, kind, name)
        differ += [(name, key, other.get(key), mine[key]) for key in mine if other.get(key) != mine[key]]
    assert not differ, f"transformers {theirs['transformers']} reads otherwise than ours:\n" + "\n".join(map(str, differ))


def test_configs_read_alike(theirs, ours):
    # RoPE compared as the architecture's rotary embedding computes it, so exactly: same torch, same formula
    same(theirs, ours, "configs")
    base = ours["configs"]["base"]
    assert base["rope"] == {"rope_theta": 100000.0, "rope_type": "default"} and base["tie_word_embeddings"] is True
    assert ours["configs"]["quantized"]["quantization_config"]["quant_algo"] == "FP8"


def test_tokenizers_and_chat_template_read_alike(theirs, ours):
    # base/ is also what the engine route's preprocessing/postprocessing models load (triton_tokenizer)
    same(theirs, ours, "tokenizers")
    base = ours["tokenizers"]["base"]
    assert base["chat"].startswith("<|im_start|>system\nBe brief.<|im_end|>") and {384, 385} <= set(base["all_special_ids"])


def test_unquantized_forward_alike(theirs, ours):
    """Logits of base/ and the draft model on the same ids. Tolerance 1e-5 of the logits' scale:
    both run the same torch CPU kernels in float32, so only reassociation could differ (measured
    here: bit-identical); a misread config (RoPE theta, eps, tying) moves logits by O(1)."""
    for name in theirs["forwards"]:
        mine = torch.tensor(readable(ours, "forwards", name)["logits"])
        other = torch.tensor(readable(theirs, "forwards", name)["logits"])
        scale = float(mine.abs().max())
        torch.testing.assert_close(other, mine, rtol=0, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


def test_written_folders_read_as_their_sources_in_our_venv(ours):
    """The 4.x spellings added beside 5.x's change nothing our transformers reads."""
    for kind in ("configs", "tokenizers", "forwards"):
        sources = [name for name in ours[kind] if name.startswith("source:")]
        assert sources
        for source in sources:
            assert readable(ours, kind, source) == readable(ours, kind, source.removeprefix("source:")), (kind, source)


def test_drafters_are_in_the_deployment_dtype(folders, ours):
    """bfloat16 by default, not ModelOpt's float32 export (TensorRT-LLM's kernels mostly lack fp32);
    integer tensors (EAGLE-3's d2t vocabulary map) stay as they are. So are a float32 target's and
    draft model's copies on the LLM-API route (read alike by the release's transformers above)."""
    for name in ("eagle3_draft", "dflash_draft", "model_bf16", "draft_model_bf16"):
        with safe_open(str(folders["written"][name] / "model.safetensors"), "pt") as weights:
            dtypes = {weights.get_tensor(k).dtype for k in weights.keys()}
        assert {d for d in dtypes if d.is_floating_point} == {torch.bfloat16}, (name, dtypes)
        assert ours["configs"][name]["dtype"] == "bfloat16"


SCALED_ROPE = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 100000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128, "rope_theta": 500000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
]


def test_scaled_rope_reads_alike(tmp_path):
    """The RoPE scalings TensorRT-LLM's Llama/Qwen loaders map, in config.json files our transformers
    saved and hfcompat completed (config-only folders: no model behind them)."""
    from specdeploy.hfcompat import write_compatible

    configs = {}
    for rope in SCALED_ROPE:
        folder = tmp_path / rope["rope_type"]
        LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rope_parameters=dict(rope)).save_pretrained(folder)
        write_compatible(folder)
        configs[rope["rope_type"]] = str(folder)
    request = {"configs": configs, "tokenizers": {}, "forwards": {}, "prompts": [], "messages": [], "forward_ids": []}
    mine = probe(sys.executable, request, tmp_path / "ours")
    assert {name: read["rope"]["rope_type"] for name, read in mine["configs"].items()} == {n: n for n in configs}
    for version in RELEASES:
        same(probe(oracle_python(version), request, tmp_path / version), mine, "configs")
