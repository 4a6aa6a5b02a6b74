"""Modules made elsewhere (specdeploy/modules/): every layout imports to the same spec/, drafts the
same tokens, runs its first layer as the engines do, exports and imports back bit for bit, and a
module that does not fit the base is refused before anything is written."""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import tests.tiny_modules as tm
from specdeploy import checkpoints, resolve
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir, build_name
from specdeploy.modules import export, stage
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.types import SamplingParams
from tests.tiny import make_llama

pytestmark = pytest.mark.usefixtures("spec_cache")

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox jumps over"]
LAYOUTS = {"eagle": tm.EAGLE_LAYOUTS, "dflash": tm.DFLASH_LAYOUTS, "medusa": tm.MEDUSA_LAYOUTS}
WEIGHTS = {"eagle": tm.eagle_weights, "dflash": tm.dflash_weights, "medusa": tm.medusa_weights}


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """tests.tiny's Llama, 8 layers deep: the base every tiny module fits."""
    out = tmp_path_factory.mktemp("base8")
    make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), layers=tm.LAYERS, seed=0)
    return out


def write_layout(kind: str, layout: str, out: Path, base: Path, weights: dict | None = None, **overrides) -> Path:
    weights = WEIGHTS[kind]() if weights is None else weights
    writer = LAYOUTS[kind][layout]
    needs_verifier = layout.startswith(("speculators", "medusa"))
    return writer(out, weights, str(base), **overrides) if needs_verifier else writer(out, weights)


def imported(root: Path, base: Path, kind: str, source: Path, **options) -> BuildDir:
    build = BuildDir(root)
    resolve.run(build, str(base))
    stage.run(build, kind, source, gate_floor=options.pop("gate_floor", 0), **options)
    return build


def spec_of(build: BuildDir) -> tuple[dict, dict]:
    spec = build.path("spec")
    return json.loads((spec / "spec_config.json").read_text()), load_file(str(spec / "module.safetensors"))


def assert_same_module(a: BuildDir, b: BuildDir) -> None:
    (config_a, tensors_a), (config_b, tensors_b) = spec_of(a), spec_of(b)
    assert sorted(tensors_a) == sorted(tensors_b)
    assert all(torch.equal(tensors_a[k], tensors_b[k]) and tensors_a[k].dtype == tensors_b[k].dtype for k in tensors_a)
    assert config_a["modelopt_config"] == config_b["modelopt_config"]
    assert config_a["hidden_layers"] == config_b["hidden_layers"]


def nothing_written(build: BuildDir) -> bool:
    return not build.path("spec").exists() and not (build.root / ".spec.partial").exists() and build.record("spec") is None


# ------------------------------------------------------------------------------ every layout, one module


@pytest.mark.parametrize("kind", LAYOUTS)
def test_every_layout_imports_to_the_same_spec(kind, base, tmp_path):
    builds = {}
    for layout in LAYOUTS[kind]:
        source = write_layout(kind, layout, tmp_path / f"src-{layout}", base)
        builds[layout] = imported(tmp_path / f"build-{layout}", base, kind, source)
        config, _ = spec_of(builds[layout])
        assert config["kind"] == kind and config["imported"]["files"] == stage.fingerprint(source)
        assert builds[layout].record("spec")["settings"]["files"] == config["imported"]["files"]
    first, *rest = builds.values()
    for other in rest:
        assert_same_module(first, other)
    config, tensors = spec_of(first)
    if kind == "eagle":  # 0-based layer outputs; speculators' [2, 4, 5] count inputs
        arch = config["modelopt_config"]["eagle_architecture_config"]
        assert arch["eagle_aux_hidden_state_layer_ids"] == tm.EAGLE_LAYERS and config["hidden_layers"] == [2, 4, 5]
        assert arch["hidden_norm_input"] == "fc" and arch["draft_vocab_size"] == tm.DRAFT_VOCAB
        assert torch.equal(tensors["eagle_module.d2t"], tm.eagle_weights()["d2t"])
        assert (first.path("spec") / "eagle3_export" / "config.json").is_file()  # as training writes spec/
    if kind == "dflash":
        assert config["hidden_layers"] == [4] and config["block_size"] == tm.BLOCK
        assert config["modelopt_config"]["dflash_mask_token_id"] == tm.MASK


def test_an_imported_dflash_module_runs_with_its_rope_theta(base, tmp_path):
    """z-lab's drafters run RoPE theta 1e6 (Qwen3); the module the CPU runtime loads from spec/ must
    too, not Qwen3Config's 10000 (transformers 5 keeps the base's theta in rope_parameters, so the
    base config's attribute it used to be copied from is absent)."""
    from transformers import AutoConfig

    from specdeploy.checkpoints.modules import load_module, read_spec_config

    high = tmp_path / "base_1e6"
    high.mkdir()
    for file in base.iterdir():
        if file.is_file():
            (high / file.name).write_bytes(file.read_bytes())
    config = json.loads((high / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    (high / "config.json").write_text(json.dumps(config))
    source = write_layout("dflash", "dflash", tmp_path / "src", high)
    zlab = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**zlab, "rope_theta": 1e6}))
    build = imported(tmp_path / "build", high, "dflash", source)
    spec = read_spec_config(build.path("spec"))
    assert spec["modelopt_config"]["dflash_architecture_config"]["rope_theta"] == 1e6
    module = load_module("dflash", AutoConfig.from_pretrained(high), spec["modelopt_config"], build.path("spec"))
    assert module.config.rope_parameters["rope_theta"] == 1e6


@pytest.mark.parametrize("field,value", [("causal", True), ("output_multiplier", 2.0), ("final_logit_softcapping", 30.0),
                                         ("attention_value_scale", 0.5), ("projector_type", "domino")])
def test_a_dflash_variant_the_runtime_does_not_compute_is_refused(base, tmp_path, field, value):
    """ModelOpt's exporter writes `causal` (true for a drafter trained with causal blocks, no tensor
    says so); SGLang reads the others. Imported, each used to become the plain bidirectional module."""
    source = write_layout("dflash", "dflash", tmp_path / "src", base)
    config = json.loads((source / "config.json").read_text())
    config["dflash_config"] = {**config["dflash_config"], field: value}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDeployError, match=f"{field}={value!r}"):
        imported(tmp_path / "build", base, "dflash", source)
    plain = {"causal": False, "output_multiplier": 1.0, "final_logit_softcapping": 0.0, "projector_type": "dflash"}
    config["dflash_config"] = {**config["dflash_config"], field: plain.get(field)}
    (source / "config.json").write_text(json.dumps(config))
    imported(tmp_path / "plain", base, "dflash", source)  # the plain values import


def _drafts(base: Path, spec_dir: Path, kind: str) -> tuple[list, list]:
    """Every draft proposed while decoding PROMPTS (float32), and the answers."""
    target = checkpoints.load_causal_lm(base, dtype="float32")
    tokenizer = checkpoints.load_tokenizer(base)
    options = {"mode": "chain", "chain_len": 3} if kind == "eagle" else {}
    proposer = build_proposer(kind, target, spec_dir=spec_dir, **options)
    drafts, answers = [], []
    propose = proposer.propose

    def recorded(state, max_tokens):
        tree = propose(state, max_tokens)
        drafts.append(tree.tokens.tolist())
        return tree

    proposer.propose = recorded
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        # adaptive off: its draft lengths follow the host's timing, and the drafts are compared across layouts
        result = generate(target, ids, SamplingParams(max_new_tokens=24), proposer, adaptive=False)
        assert result.token_ids == generate(target, ids, SamplingParams(max_new_tokens=24)).token_ids  # exact
        answers.append(result.token_ids)
    return drafts, answers


@pytest.mark.parametrize("kind", LAYOUTS)
def test_the_same_weights_draft_identical_tokens_through_every_layout(kind, base, tmp_path):
    seen = {}
    for layout in LAYOUTS[kind]:
        source = write_layout(kind, layout, tmp_path / f"src-{layout}", base)
        build = imported(tmp_path / f"build-{layout}", base, kind, source)
        seen[layout] = _drafts(base, build.path("spec"), kind)
    (drafts, answers), *rest = seen.values()
    assert sum(len(d) for d in drafts) > 10 and any(len(d) > 1 for d in drafts)
    assert all(other == (drafts, answers) for other in rest)


# ------------------------------------------------------------------------------ the first layer's norms


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, tm.HEAD_DIM, 2).float() / tm.HEAD_DIM)
    angles = torch.cat([positions[:, None] * inv[None]] * 2, dim=-1)
    half = tm.HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def reference_logits(w: dict, aux: torch.Tensor, embeds: torch.Tensor, norm_before_residual: bool) -> torch.Tensor:
    """The EAGLE authors' layer, written here from cnets.py's LlamaDecoderLayeremb (speculators'
    norm_before_residual: the normed hidden state is the residual): draft logits per position."""
    layer = {k.removeprefix("midlayer."): v for k, v in w.items()}
    n = len(aux)
    h = aux @ w["fc.weight"].T
    normed = _rms(h, layer["hidden_norm.weight"])
    x = torch.cat([_rms(embeds, layer["input_layernorm.weight"]), normed], dim=-1)
    positions = torch.arange(n).float()
    q = _rope((x @ layer["self_attn.q_proj.weight"].T).view(n, tm.HEADS, tm.HEAD_DIM).transpose(0, 1), positions)
    k = _rope((x @ layer["self_attn.k_proj.weight"].T).view(n, tm.KV_HEADS, tm.HEAD_DIM).transpose(0, 1), positions)
    v = (x @ layer["self_attn.v_proj.weight"].T).view(n, tm.KV_HEADS, tm.HEAD_DIM).transpose(0, 1)
    k, v = k.repeat_interleave(tm.HEADS // tm.KV_HEADS, 0), v.repeat_interleave(tm.HEADS // tm.KV_HEADS, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(tm.HEAD_DIM) + torch.full((n, n), float("-inf")).triu(1)
    attention = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ layer["self_attn.o_proj.weight"].T
    hidden = (normed if norm_before_residual else h) + attention
    x = _rms(hidden, layer["post_attention_layernorm.weight"])
    gated = torch.nn.functional.silu(x @ layer["mlp.gate_proj.weight"].T) * (x @ layer["mlp.up_proj.weight"].T)
    out = hidden + gated @ layer["mlp.down_proj.weight"].T
    return _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


def _module_logits(spec_dir: Path, base: Path, aux: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    from transformers import AutoConfig

    from specdeploy.checkpoints.modules import read_spec_config
    from specdeploy.speculator import load_module_model

    module = load_module_model(AutoConfig.from_pretrained(base), "eagle", read_spec_config(spec_dir)["modelopt_config"],
                               spec_dir).eagle_module
    module._maybe_init_rope()
    n = len(aux)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    post, _, _ = module(module.fc(aux)[None], embeds[None], attention_mask=mask, position_ids=torch.arange(n)[None])
    return module.lm_head(post)[0]


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_first_layer_computes_what_the_engines_compute(norm_before_residual, base, tmp_path):
    weights = tm.eagle_weights()
    source = write_layout("eagle", "speculators", tmp_path / "src", base, weights, norm_before_residual=norm_before_residual)
    build = imported(tmp_path / "build", base, "eagle", source)
    generator = torch.Generator().manual_seed(5)
    aux, embeds = torch.randn(6, 3 * tm.HIDDEN, generator=generator), torch.randn(6, tm.HIDDEN, generator=generator)
    with torch.no_grad():
        expected = reference_logits(weights, aux, embeds, norm_before_residual)
        assert torch.allclose(_module_logits(build.path("spec"), base, aux, embeds), expected, atol=1e-4)
        # ModelOpt's own placement (hidden_norm on input_layernorm(fc)) computes something else
        config_file = build.path("spec") / "spec_config.json"
        config = json.loads(config_file.read_text())
        config["modelopt_config"]["eagle_architecture_config"].update(hidden_norm_input="input_layernorm",
                                                                      norm_before_residual=False)
        config_file.write_text(json.dumps(config))
        assert not torch.allclose(_module_logits(build.path("spec"), base, aux, embeds), expected, atol=1e-2)


# ------------------------------------------------------------------------------ export, import back


def test_a_norm_before_residual_module_gets_no_trtllm_folder(base, tmp_path):
    """The LLM-API route and --format sglang refuse it (their first layer adds the un-normed residual);
    --format trtllm wrote the folder without a word. --format speculators (vLLM runs it) still exports."""
    source = write_layout("eagle", "speculators", tmp_path / "src", base, tm.eagle_weights(), norm_before_residual=True)
    build = imported(tmp_path / "build", base, "eagle", source)
    with pytest.raises(SpecDeployError, match="no TensorRT-LLM layout for this module: .*norm_before_residual") as err:
        export.export(build, "trtllm", tmp_path / "trtllm")
    assert "--format speculators" in err.value.hint and not (tmp_path / "trtllm").exists()
    assert (export.export(build, "speculators", tmp_path / "speculators") / "config.json").is_file()


ROUND_TRIPS = [("eagle", "eagle3", "trtllm"), ("eagle", "eagle3", "speculators"), ("dflash", "dflash", "trtllm"),
               ("dflash", "dflash", "speculators"), ("dflash", "dflash", "dflash")]


@pytest.mark.parametrize("kind,layout,fmt", ROUND_TRIPS)
def test_export_then_import_is_bit_identical(kind, layout, fmt, base, tmp_path):
    source = write_layout(kind, layout, tmp_path / "src", base)
    first = imported(tmp_path / "first", base, kind, source)
    out = export.export(first, fmt, tmp_path / "exported", dtype="float32")
    again = imported(tmp_path / "again", base, kind, out)
    assert_same_module(first, again)
    config = json.loads((out / "config.json").read_text())
    if fmt == "speculators" and kind == "eagle":  # the vocabulary map as speculators reads it: d2t and t2d
        tensors = load_file(str(out / "model.safetensors"))
        assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == tm.DRAFT_VOCAB
        assert torch.equal(torch.nonzero(tensors["t2d"]).squeeze(1), torch.arange(tm.DRAFT_VOCAB) + tensors["d2t"])
        assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    if fmt == "trtllm" and kind == "eagle":
        assert "midlayer.fc.weight" not in load_file(str(out / "model.safetensors"))
        assert load_file(str(out / "model.safetensors"))["midlayer.hidden_norm.weight"].dtype == torch.float32


@pytest.mark.parametrize("fmt", ["trtllm", "speculators"])
def test_a_modelopt_trained_layer_survives_the_round_trip_and_is_flagged(fmt, base, tmp_path):
    first = imported(tmp_path / "first", base, "eagle", write_layout("eagle", "eagle3", tmp_path / "src", base))
    config_file = first.path("spec") / "spec_config.json"  # as the spec stage trains it: no hidden_norm_input
    config = json.loads(config_file.read_text())
    del config["modelopt_config"]["eagle_architecture_config"]["hidden_norm_input"]
    config_file.write_text(json.dumps(config))
    out = export.export(first, fmt, tmp_path / "exported", dtype="float32")
    assert json.loads((out / "config.json").read_text())["hidden_norm_input"] == "input_layernorm"
    assert any("hidden_norm" in note for note in export.notes(first))
    again = imported(tmp_path / "again", base, "eagle", out)
    arch = spec_of(again)[0]["modelopt_config"]["eagle_architecture_config"]
    assert arch["hidden_norm_input"] == "input_layernorm"


def test_export_refuses_what_no_engine_loads(base, tmp_path):
    medusa = imported(tmp_path / "medusa", base, "medusa", write_layout("medusa", "medusa", tmp_path / "m", base))
    with pytest.raises(SpecDeployError, match="engine flow"):
        export.export(medusa, "speculators", tmp_path / "out")
    eagle = imported(tmp_path / "eagle", base, "eagle", write_layout("eagle", "eagle3", tmp_path / "e", base))
    with pytest.raises(SpecDeployError, match="--format dflash writes DFlash"):
        export.export(eagle, "dflash", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_float32_trtllm_export_says_tensorrt_llm_will_not_serve_it(base, tmp_path, capsys):
    """--format trtllm --dtype float32 stays allowed (specdeploy's import reads it back bit for bit),
    but TensorRT-LLM's PyTorch backend runs a drafter in its config's dtype and lacks float32 kernels:
    the export says so and what to run instead; the default (bfloat16) says nothing of it."""
    build = imported(tmp_path / "build", base, "eagle", write_layout("eagle", "eagle3", tmp_path / "src", base))
    parser = argparse.ArgumentParser()
    export.add_arguments(parser)
    for dtype, warned in (["--dtype", "float32"], True), ([], False):
        out = tmp_path / f"out{len(dtype)}"
        assert export.main(parser.parse_args(["--build-dir", str(build.root), "--format", "trtllm", "--out", str(out), *dtype])) == 0
        printed = capsys.readouterr().out
        assert ("#5260" in printed and "--dtype bfloat16" in printed) is warned, printed
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == ("float32" if warned else "bfloat16")


# ------------------------------------------------------------------------------ refusals


@pytest.fixture(scope="module")
def wide_base(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("base8_wide")
    make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), hidden=96, layers=tm.LAYERS, seed=1)
    return out


def _pickled(out: Path, base: Path) -> Path:
    source = write_layout("eagle", "eagle3", out, base)
    torch.save(load_file(str(source / "model.safetensors")), source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    return source


def _vocabulary(out: Path, base: Path) -> Path:
    source = write_layout("dflash", "dflash", out, base)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "vocab_size": 500}))
    return source


def _no_vocab_map(out: Path, base: Path) -> Path:
    """What `speculators convert` makes of a draft folder without t2d: draft_vocab_size kept, d2t gone."""
    weights = {k: v for k, v in tm.eagle_weights().items() if k not in ("d2t", "t2d")}
    return write_layout("eagle", "speculators", out, base, weights)


OTHER_MODEL = Path("meta-llama/Llama-3.1-8B-Instruct")
# case: (kind, the module folder, the message); "hidden size" is checked against a base 96 wide
REFUSALS = {
    "hidden size": ("eagle", lambda out, base: write_layout("eagle", "eagle3", out, base), r"hidden size: module 64, base 96"),
    "vocabulary": ("dflash", _vocabulary, r"vocabulary: module 500 tokens, base 384"),
    "layers beyond the base": ("eagle", lambda out, base: write_layout(
        "eagle", "speculators", out, base, eagle_aux_hidden_state_layer_ids=[2, 4, 12]), r"\[11\] are outside the base's 8 layers"),
    "pickle without --allow-pickle": ("eagle", _pickled, r"(?s)unpickling can run arbitrary code.*--allow-pickle"),
    "d2t dropped": ("eagle", _no_vocab_map, r"draft_vocab_size 96 < 384 but no d2t"),
    "verifier": ("medusa", lambda out, base: write_layout("medusa", "medusa", out, OTHER_MODEL), r"--module-accept verifier"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_module_that_does_not_fit_is_refused_and_nothing_is_written(case, base, wide_base, tmp_path):
    kind, make, message = REFUSALS[case]
    build = BuildDir(tmp_path / "build")
    resolve.run(build, str(wide_base if case == "hidden size" else base))
    with pytest.raises(SpecDeployError, match=message) as refused:
        stage.run(build, kind, make(tmp_path / "src", base), gate_floor=0)
    assert refused.value.hint  # what to pass
    assert nothing_written(build)


def test_checking_a_module_leaves_modelopts_tables_off_the_meta_device(base, tmp_path):
    """The fit check builds ModelOpt's module on the meta device; ModelOpt first imported there kept its
    NVFP4 tables as meta tensors, and an NVFP4 quantize later in the same process failed."""
    import subprocess
    import sys

    source = write_layout("eagle", "eagle3", tmp_path / "src", base)
    script = ("import sys; from pathlib import Path; from specdeploy.modules import stage; "
              "stage.checked_module(Path(sys.argv[1]), 'eagle', Path(sys.argv[2]), []); "
              "from modelopt.torch.quantization.qtensor import nvfp4_tensor as t; "
              "print(t.e2m1_bounds.device.type, t.e2m1_values.device.type)")
    done = subprocess.run([sys.executable, "-c", script, str(source), str(base)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["cpu", "cpu"]  # after whatever ModelOpt prints on import


def test_what_the_user_vouches_for_is_imported(base, tmp_path):
    pickled = _pickled(tmp_path / "pickled", base)
    assert_same_module(imported(tmp_path / "a", base, "eagle", pickled, allow_pickle=True),
                       imported(tmp_path / "b", base, "eagle", write_layout("eagle", "eagle3", tmp_path / "st", base)))
    other = write_layout("medusa", "medusa", tmp_path / "medusa", OTHER_MODEL)
    build = imported(tmp_path / "c", base, "medusa", other, accept=("verifier",))
    assert spec_of(build)[0]["imported"]["verifier"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_a_lora_of_the_base_beside_a_modelopt_export_is_no_part_of_the_module(base, tmp_path, capsys):
    """ModelOpt's export of a module trained with eagle_base_lora: adapter_model.safetensors beside
    model.safetensors. The module is the draft file alone (transformers reads model.safetensors
    only), and the user is told the LoRA is not applied."""
    plain = write_layout("eagle", "eagle3-modelopt", tmp_path / "plain", base)
    beside = Path(shutil.copytree(plain, tmp_path / "beside"))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, tm.HIDDEN)},
              str(beside / "adapter_model.safetensors"))
    assert_same_module(imported(tmp_path / "a", base, "eagle", beside), imported(tmp_path / "b", base, "eagle", plain))
    assert "adapter_model.safetensors (a LoRA of the base" in capsys.readouterr().out


def test_the_kind_must_match_spec(base, tmp_path):
    source = write_layout("eagle", "eagle3", tmp_path / "src", base)
    build = BuildDir(tmp_path / "build")
    resolve.run(build, str(base))
    with pytest.raises(SpecDeployError, match="pass SPEC=eagle"):
        stage.run(build, "dflash", source, gate_floor=0)
    assert nothing_written(build)


def test_spec_import_and_export_on_the_command_line(base, tmp_path, capsys):
    from specdeploy import cli

    source = write_layout("medusa", "medusa", tmp_path / "src", base)
    build = ["--model", str(base), "--spec", "medusa", "--build-dir", str(tmp_path / "build")]
    assert cli.main(["spec", "import", *build, "--module", str(source)]) == 0
    assert "imported from medusa layout" in capsys.readouterr().out
    assert cli.main(["export", *build, "--format", "speculators", "--out", str(tmp_path / "out")]) == 2
    assert "no speculators layout holds Medusa heads" in capsys.readouterr().err
    assert cli.main(["spec", "import", *build, "--module", str(source), "--module-accept", "tokenizer"]) == 2
    assert "acceptable differences: verifier, rope" in capsys.readouterr().err
    record = BuildDir(tmp_path / "build").record("spec")
    moved = shutil.move(source, tmp_path / "elsewhere")  # the same files in another folder: imported already
    assert cli.main(["spec", "import", *build, "--module", str(moved)]) == 0
    assert BuildDir(tmp_path / "build").record("spec") == record


# ------------------------------------------------------------------------------ the gate


@pytest.fixture(scope="module")
def cycle(tmp_path_factory, tiny_tokenizer_dir) -> tuple[Path, dict]:
    """A base that answers a fixed cycle (token u is followed by f(u)) and an EAGLE-3 module that
    predicts two tokens ahead from the output of layer 1, which it reads first: drafts are accepted,
    but only with the captured layers in their order. Attention contributes nothing anywhere, so every
    position's hidden states are a function of its token: layers 1, 3 and 4 each add a different MLP."""
    out = tmp_path_factory.mktemp("cycle")
    model = make_llama(out, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), layers=tm.LAYERS, seed=7)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.zero_()
            if index not in (1, 3, 4):
                layer.mlp.down_proj.weight.zero_()
            elif index > 1:  # far enough from layer 1's output that reading theirs first predicts other tokens
                layer.mlp.down_proj.weight.mul_(8)
        states = model(torch.arange(tm.VOCAB)[:, None], output_hidden_states=True).hidden_states
        codes = {layer: states[layer][:, 0] for layer in (2, 4, 5)}  # outputs of layers 1, 3, 4
        final = _rms(states[-1][:, 0], torch.ones(tm.HIDDEN))  # the last entry is after the final norm
        follow = torch.randperm(tm.VOCAB, generator=torch.Generator().manual_seed(0))
        model.lm_head.weight.zero_()
        model.lm_head.weight[follow] = 20 * _unit(final)
    model.save_pretrained(out)
    weights = {k: torch.zeros_like(v) if "o_proj" in k or "down_proj" in k else v for k, v in tm.eagle_weights().items()
               if k not in ("d2t", "t2d")}
    weights["fc.weight"] = torch.cat([torch.eye(tm.HIDDEN), torch.zeros(tm.HIDDEN, 2 * tm.HIDDEN)], dim=1)
    weights["norm.weight"] = torch.ones(tm.HIDDEN)
    weights["lm_head.weight"] = torch.zeros(tm.VOCAB, tm.HIDDEN)
    weights["lm_head.weight"][follow[follow]] = 20 * _unit(_rms(codes[2], torch.ones(tm.HIDDEN)))
    return out, weights


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + 1e-6)  # the pad token embeds to zeros


def _cycle_module(out: Path, weights: dict, base: Path) -> Path:
    return tm.eagle_speculators(out, weights, str(base), draft_vocab_size=tm.VOCAB)


def test_the_gate_passes_a_module_that_drafts_and_names_causes_when_the_layers_are_permuted(cycle, tmp_path):
    base, weights = cycle
    build = imported(tmp_path / "right", base, "eagle", _cycle_module(tmp_path / "right_src", weights, base),
                     gate_floor=stage.GATE_FLOOR)
    gate = spec_of(build)[0]["imported"]["gate"]
    assert gate["acceptance_length"] > 1.5 and gate["floor"] == stage.GATE_FLOOR
    # `make verify` looks again at the served chat acceptance: a deployment that mis-loaded the module fails
    assert stage.served_gate(build.path("spec"), gate["acceptance_length"]) is None
    assert stage.served_gate(build.path("spec"), None) is None  # no chat prompts served
    assert stage.served_gate(tmp_path / "no_module", 1.0) is None  # a draft-model, n-gram or plain build
    assert re.search(r"acceptance length on chat prompts is 1\.05, under the imported module's floor 1\.2.*captured layers",
                     stage.served_gate(build.path("spec"), 1.05))
    ungated = imported(tmp_path / "ungated", base, "eagle", _cycle_module(tmp_path / "ungated_src", weights, base))
    assert stage.served_gate(ungated.path("spec"), 1.0) is None  # imported with --gate-floor 0: no floor to hold
    # the same module asked again with a floor: gated now (not skipped as imported), and held by verify
    stage.run(ungated, "eagle", tmp_path / "ungated_src", gate_floor=stage.GATE_FLOOR)
    assert spec_of(ungated)[0]["imported"]["gate"]["floor"] == stage.GATE_FLOOR
    assert stage.served_gate(ungated.path("spec"), 1.05) is not None

    permuted = dict(weights, **{"fc.weight": weights["fc.weight"].roll(2 * tm.HIDDEN, dims=1)})  # fc reads layer 4 first
    wrong = BuildDir(tmp_path / "wrong")
    resolve.run(wrong, str(base))
    with pytest.raises(SpecDeployError, match=r"under the floor 1\.2.*captured layers \(\[1, 3, 4\].*d2t"):
        stage.run(wrong, "eagle", _cycle_module(tmp_path / "wrong_src", permuted, base), gate_floor=stage.GATE_FLOOR)
    assert nothing_written(wrong)


def test_make_engine_takes_a_module_and_every_later_stage_runs_unchanged(base, tmp_path):
    import subprocess
    import sys

    source = write_layout("eagle", "speculators", tmp_path / "speculators_module", base)
    cmd = [sys.executable, "-m", "specdeploy", "engine", "--model", str(base), "--spec", "eagle", "--module", str(source),
           "--quant", "fp8", "--build-root", str(tmp_path / "builds"), "--gate-floor", "0", "--calib-size", "8",
           "--no-quant-report", "--cpu-draft-shape", "fixed"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    build = BuildDir(tmp_path / "builds" / build_name(str(base), "eagle", "fp8", str(source)))
    assert sorted(build.manifest()["stages"]) == ["build", "convert", "package", "quantize", "resolve", "spec"]
    config = spec_of(build)[0]
    assert "training" not in config and config["imported"]["source"] == str(source.resolve())
    draft = build.path("trtllm_ckpt") / "llmapi" / "eagle3_draft"
    assert json.loads((draft / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == tm.EAGLE_LAYERS
    deployment = json.loads((build.path("triton_repo") / "cpu" / "tensorrt_llm" / "1" / "deployment.json").read_text())
    assert deployment["spec"]["kind"] == "eagle"
    # the CPU deployment drafts with the imported module
    from specdeploy.runtime.deployment import load_decoder

    decoder = load_decoder(build.path("triton_repo") / "cpu" / "tensorrt_llm" / "1" / "deployment.json")
    _, result = decoder.generate(PROMPTS[0], SamplingParams(max_new_tokens=12))
    assert result.metrics.draft_tokens > 0
