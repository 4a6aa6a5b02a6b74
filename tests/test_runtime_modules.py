"""The runtime's torch-only speculative modules (specdeploy.checkpoints.modules) against ModelOpt's.

Each kind's module is converted with ModelOpt as the spec stage converts it (offline base, fixed
seed), given random non-trivial weights and saved as the spec stage saves it (spec_config.json +
module.safetensors). The torch-only module loaded from that folder computes the same outputs as
ModelOpt's module loaded from it (as the runtime loaded it before), and the proposer drafts the
same trees with either. With ModelOpt unimportable, deployments of each kind load and decode
exactly the base's greedy output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, DynamicCache, LlamaConfig, Qwen2Config

from specdeploy.attention import use_cpu_sdpa
from specdeploy.errors import SpecDeployError
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.proposers.dflash import DFlashProposer
from specdeploy.runtime.proposers.dflash import modelopt_config as dflash_runtime_config
from specdeploy.runtime.proposers.eagle import EagleProposer
from specdeploy.runtime.proposers.medusa import MedusaProposer
from specdeploy.runtime.types import SamplingParams
from specdeploy.checkpoints.modules import MODULE_FILE, MODULE_PREFIXES, SPEC_CONFIG
from specdeploy.speculator import convert_model, load_module_model, load_module_weights, module_state_dict
from specdeploy.speculator import dflash as dflash_spec
from specdeploy.checkpoints.modules import eagle as eagle_config
from specdeploy.checkpoints.modules import medusa as medusa_config
from specdeploy.speculator import eagle as eagle_spec
from specdeploy.speculator.common import load_offline_base
from tests.test_runtime_helpers import hf_greedy, one_thread, target  # noqa: F401

PROMPTS = [[5, 17, 33, 90, 4, 8, 9], [100, 101, 102, 7], [3, 60, 61, 62, 63, 64, 65, 66, 67, 12, 13]]
DRAFT_VOCAB, BLOCK = 96, 4
TIGHT = {"rtol": 1e-6, "atol": 1e-6}  # float32; the two modules run the same operations
EAGLE_VARIANTS = {  # eagle_architecture_config changes, and the spec stage's draft vocabulary / depth
    "fc": ({}, DRAFT_VOCAB, 1),  # what the spec stage trains (hidden_norm_input "fc")
    "fc-norm-before-residual": ({"norm_before_residual": True}, DRAFT_VOCAB, 1),  # speculators' layer
    "input-layernorm": ({"hidden_norm_input": "input_layernorm"}, DRAFT_VOCAB, 1),  # ModelOpt's own layer
    "full-vocab-2-layers": ({}, 10**6, 2),  # no lm_head / d2t: drafts through the target's head
}


def write_spec(kind: str, base_dir: Path, out: Path, arch: dict | None = None, draft_vocab: int = DRAFT_VOCAB,
               eagle_layers: int = 1) -> Path:
    """A ModelOpt-converted module, as the spec stage converts and saves it, with random weights."""
    base_config = AutoConfig.from_pretrained(base_dir)
    layers, vocab = base_config.num_hidden_layers, base_config.vocab_size
    generator = torch.Generator().manual_seed(1)
    if kind == "eagle":
        config = eagle_config.modelopt_config(base_config, draft_vocab_size=draft_vocab, num_layers=eagle_layers, offline=True)
        config["eagle_architecture_config"].update(arch or {})
        online = eagle_spec.online_config(config)
        extra = {"hidden_layers": eagle_config.hidden_layers(layers), "draft_vocab_size": min(draft_vocab, vocab)}
    elif kind == "dflash":
        config = dflash_spec.modelopt_config(base_config, block_size=BLOCK, anchors=8, offline=True)
        online = dflash_spec.online_config(config)
        extra = {"hidden_layers": dflash_spec.hidden_layers(layers), "block_size": BLOCK}
    else:
        config = online = medusa_config.modelopt_config(num_heads=3, num_layers=1)
        ids = torch.sort(torch.randperm(vocab, generator=generator)[:DRAFT_VOCAB]).values.tolist()
        extra = {"hidden_layers": medusa_config.hidden_layers(layers), "draft_vocab_ids": ids, "choices": [[0], [1], [0, 0], [0, 0, 0]]}
    torch.manual_seed(0)
    model = convert_model(load_offline_base(base_dir, torch.float32), kind, config)
    prefix = MODULE_PREFIXES[kind]
    with torch.no_grad():  # trained-looking weights: norms not all ones, ResBlocks not the identity, a real d2t
        for key, tensor in model.state_dict().items():  # tensors sharing the module's storage
            if not key.startswith(prefix):
                continue
            if key.endswith("d2t"):
                tensor.copy_(torch.sort(torch.randperm(vocab, generator=generator)[: len(tensor)]).values - torch.arange(len(tensor)))
            elif "norm" in key:
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * tensor.shape[-1] ** -0.5)
    out.mkdir(parents=True, exist_ok=True)
    save_file(module_state_dict(model, kind), str(out / MODULE_FILE))
    (out / SPEC_CONFIG).write_text(json.dumps({"format_version": 1, "kind": kind, "modelopt_config": online, **extra}))
    return out


def torch_only(name: str):
    """specdeploy.checkpoints.modules' `name`, imported when a test runs (so that each test, not the
    collection, fails where the package is missing)."""
    import specdeploy.checkpoints.modules as modules

    return getattr(modules, name)


def modelopt_module(kind: str, target, spec_dir: Path):
    """ModelOpt's module loaded from spec_dir, as the runtime loaded it before (float32, CPU)."""
    config = json.loads((spec_dir / SPEC_CONFIG).read_text())["modelopt_config"]
    if kind == "dflash":
        skeleton = dflash_spec.converted(target.config, config)
        load_module_weights(skeleton, "dflash", spec_dir)
        return skeleton.dflash_module.eval()
    skeleton = load_module_model(target.config, kind, config, spec_dir)
    return skeleton.eagle_module if kind == "eagle" else skeleton.medusa_heads


class Recorder:
    """Wraps a proposer; keeps every draft tree it proposed."""

    def __init__(self, inner) -> None:
        self.inner, self.trees = inner, []
        self.kind, self.hidden_layers = inner.kind, inner.hidden_layers

    def reset(self) -> None:
        self.inner.reset()

    def update(self, accepted, proposed) -> None:
        self.inner.update(accepted, proposed)

    def propose(self, state, max_tokens):
        tree = self.inner.propose(state, max_tokens)
        self.trees.append((tree.tokens.tolist(), list(tree.parents)))
        return tree


def drafts(target, proposer, new_tokens: int = 16) -> list:
    """Every round's draft tree over PROMPTS; the output is the target's greedy output."""
    recorder, params = Recorder(proposer), SamplingParams(max_new_tokens=new_tokens)
    for prompt in PROMPTS:
        assert generate(target, prompt, params, recorder, adaptive=False).token_ids == generate(target, prompt, params).token_ids
    assert any(tokens for tokens, _ in recorder.trees)  # it really drafted
    return recorder.trees


@pytest.fixture(scope="module")
def specs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime_modules")
    folders = {f"eagle-{name}": write_spec("eagle", tiny_llama_dir, root / f"eagle-{name}", arch, vocab, layers)
               for name, (arch, vocab, layers) in EAGLE_VARIANTS.items()}
    return {**folders, **{kind: write_spec(kind, tiny_llama_dir, root / kind) for kind in ("dflash", "medusa")}}


def assert_same_eagle_outputs(reference, mine, head_of) -> None:
    """Two forwards over a cache (a causal prompt of 6, then a tree of 3 nodes: the first and two
    children of it) of two rows: outputs, logits and cache entries agree."""
    for module in (reference, mine):
        module._maybe_init_rope()
    torch.testing.assert_close(mine.rotary_emb.inv_freq, reference.rotary_emb.inv_freq, rtol=0, atol=0)
    assert mine.rotary_emb.attention_scaling == reference.rotary_emb.attention_scaling
    generator = torch.Generator().manual_seed(2)
    n, hidden = 6, reference.config.hidden_size
    aux = torch.randn(2, n, reference.fc.in_features, generator=generator)
    embeds, more = torch.randn(2, n, hidden, generator=generator), torch.randn(2, 3, hidden, generator=generator)
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None].expand(2, 1, n, n)
    tree = torch.full((2, 1, 3, n + 3), torch.finfo(torch.float32).min)
    tree[..., : n + 1] = 0.0
    tree[:, :, 1, n + 1] = tree[:, :, 2, n + 2] = 0.0
    outputs = []
    with torch.no_grad():
        for module in (reference, mine):
            cache = DynamicCache(config=module.config)
            post, pre, _ = module(module.fc(aux), embeds, attention_mask=causal, position_ids=torch.arange(n)[None].expand(2, n),
                                  past_key_values=cache, use_cache=True)
            post2, pre2, _ = module(pre[:, -3:], more, attention_mask=tree, position_ids=torch.tensor([[6, 7, 7]] * 2),
                                    past_key_values=cache, use_cache=True)
            outputs.append([post, pre, post2, pre2, head_of(module)(post2), cache.layers[0].keys, cache.layers[-1].values])
    for ours, theirs in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(ours, theirs, **TIGHT)


@pytest.mark.parametrize("variant", list(EAGLE_VARIANTS))
def test_eagle_module_computes_what_modelopts_computes(target, specs, variant):
    spec_dir = specs[f"eagle-{variant}"]
    config = json.loads((spec_dir / SPEC_CONFIG).read_text())["modelopt_config"]
    reference, mine = modelopt_module("eagle", target, spec_dir), torch_only("load_module")("eagle", target.config, config, spec_dir)
    assert type(mine).__module__ == "specdeploy.checkpoints.modules.eagle"
    assert mine.state_dict().keys() == reference.state_dict().keys()
    assert_same_eagle_outputs(reference, mine, lambda m: m.lm_head if hasattr(m, "lm_head") else target.get_output_embeddings())
    if hasattr(reference, "d2t"):
        assert torch.equal(mine.d2t, reference.d2t) and mine.d2t.abs().sum() > 0


# bases unlike the tiny Llama: another RoPE base, another config class, llama3 RoPE scaling
OTHER_BASES = {
    "llama-theta-1e6": (LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                    num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6), {}),
    "qwen2": (Qwen2Config(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=5, num_attention_heads=6,
                          num_key_value_heads=2, rope_theta=1e6), {}),
    "llama3-rope": (LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5),
                    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64, "rope_theta": 5e5}}),
}


@pytest.mark.parametrize("base", list(OTHER_BASES))
def test_modules_match_modelopts_on_other_bases(base):
    """Config-level fidelity (RoPE, head sizes, default target layers) beyond the tiny Llama:
    ModelOpt's freshly converted module and ours, given the same weights, compute the same."""
    base_config, arch = OTHER_BASES[base]
    config = eagle_config.modelopt_config(base_config, draft_vocab_size=64, num_layers=2)
    config["eagle_architecture_config"].update(arch)
    config["eagle_export_rope_scaling"] = {}  # as the import stage writes it: the module's own RoPE
    reference = load_module_model(base_config, "eagle", config).eagle_module
    mine = torch_only("build_module")("eagle", base_config, config)
    assert {k: v.shape for k, v in mine.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    mine.load_state_dict(reference.state_dict())
    assert_same_eagle_outputs(reference, mine, lambda m: m.lm_head)
    # DFlash: the runtime's config (no target_layer_ids: ModelOpt's default, the middle layer)
    config = dflash_runtime_config(base_config, mask_token_id=299, block_size=BLOCK)
    skeleton = dflash_spec.converted(base_config, config)
    reference, mine = skeleton.dflash_module.float(), torch_only("build_module")("dflash", base_config, config)
    assert mine.config.target_layer_ids == skeleton.target_layer_ids
    assert {k: v.shape for k, v in mine.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    mine.load_state_dict(reference.state_dict())
    assert_same_dflash_outputs(reference, mine)
    # trained (ModelOpt) and served with the base's RoPE base, which ModelOpt's export writes
    head_dim = mine.config.head_dim
    theta = base_config.rope_parameters["rope_theta"]
    expected = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    torch.testing.assert_close(reference.rotary_emb.inv_freq, expected)


def assert_same_dflash_outputs(reference, mine) -> None:
    generator = torch.Generator().manual_seed(3)
    n, hidden = 7, reference.config.hidden_size
    context = torch.randn(2, n, reference.fc.in_features, generator=generator)
    block = torch.randn(2, BLOCK, hidden, generator=generator)
    with torch.no_grad():
        outputs = [module(noise_embedding=block, target_hidden=context, position_ids=torch.arange(n + BLOCK)[None].expand(2, -1))
                   for module in (reference, mine)]
    torch.testing.assert_close(outputs[1], outputs[0], **TIGHT)
    torch.testing.assert_close(mine.rotary_emb.inv_freq, reference.rotary_emb.inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("variant", list(EAGLE_VARIANTS))
def test_eagle_proposer_drafts_what_it_drafted_with_modelopt(target, specs, variant):
    spec_dir = specs[f"eagle-{variant}"]
    layers = tuple(json.loads((spec_dir / SPEC_CONFIG).read_text())["hidden_layers"])
    reference = use_cpu_sdpa(modelopt_module("eagle", target, spec_dir))
    head = reference.lm_head if hasattr(reference, "lm_head") else target.get_output_embeddings()
    for options in ({"mode": "dynamic", "depth": 4, "topk": 3, "width": 2}, {"mode": "chain", "chain_len": 3}):
        ours = drafts(target, build_proposer("eagle", target, spec_dir=spec_dir, **options))
        theirs = drafts(target, EagleProposer(reference, target.get_input_embeddings(), head, layers, **options))
        assert ours == theirs


def test_dflash_module_and_drafts_match_modelopts(target, specs):
    spec_dir = specs["dflash"]
    config = json.loads((spec_dir / SPEC_CONFIG).read_text())["modelopt_config"]
    reference, mine = modelopt_module("dflash", target, spec_dir), torch_only("load_module")("dflash", target.config, config, spec_dir)
    assert mine.state_dict().keys() == reference.state_dict().keys()
    assert mine.config.target_layer_ids == dflash_spec.converted(target.config, config).target_layer_ids == [1]
    assert_same_dflash_outputs(reference, mine)
    ours = drafts(target, build_proposer("dflash", target, spec_dir=spec_dir))
    theirs = drafts(target, DFlashProposer(reference, target.get_input_embeddings(), target.get_output_embeddings(),
                                           (2,), block_size=BLOCK, mask_token_id=config["dflash_mask_token_id"]))
    assert ours == theirs


def test_medusa_heads_and_drafts_match_modelopts(target, specs):
    spec_dir = specs["medusa"]
    spec = json.loads((spec_dir / SPEC_CONFIG).read_text())
    reference = modelopt_module("medusa", target, spec_dir)
    mine = torch_only("load_module")("medusa", target.config, spec["modelopt_config"], spec_dir)
    assert mine.state_dict().keys() == reference.state_dict().keys()
    h = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for ours, theirs in zip(mine, reference):
            torch.testing.assert_close(ours(h), theirs(h), **TIGHT)
    proposer = build_proposer("medusa", target, spec_dir=spec_dir)
    assert proposer.vocab_ids.tolist() == spec["draft_vocab_ids"]
    ours = drafts(target, proposer)
    theirs = drafts(target, MedusaProposer(reference, proposer.choices, torch.tensor(spec["draft_vocab_ids"])))
    assert ours == theirs


def test_a_module_saved_for_another_config_is_refused(target, specs, tmp_path):
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    (spec_dir / MODULE_FILE).write_bytes((specs["eagle-fc"] / MODULE_FILE).read_bytes())
    spec = json.loads((specs["eagle-fc"] / SPEC_CONFIG).read_text())
    spec["modelopt_config"]["eagle_architecture_config"]["num_hidden_layers"] = 2
    (spec_dir / SPEC_CONFIG).write_text(json.dumps(spec))
    with pytest.raises(SpecDeployError, match="does not match the module spec_config.json describes"):
        build_proposer("eagle", target, spec_dir=spec_dir)
    spec["modelopt_config"]["eagle_architecture_config"].update(num_hidden_layers=1, intermediate_size=64)
    (spec_dir / SPEC_CONFIG).write_text(json.dumps(spec))
    with pytest.raises(SpecDeployError, match="does not match the module spec_config.json describes"):
        build_proposer("eagle", target, spec_dir=spec_dir)


BLOCKED = """
import json, sys
sys.modules["modelopt"] = None  # `import modelopt...` raises ModuleNotFoundError from here on
from specdeploy.runtime.deployment import load_decoder
from specdeploy.runtime.types import SamplingParams

results = {}
for path in sys.argv[2:]:
    decoder = load_decoder(path)
    result = decoder.generate_ids(json.loads(sys.argv[1]), SamplingParams(max_new_tokens=20))
    results[path] = {"tokens": result.token_ids, "drafted": result.metrics.draft_tokens}
loaded = sorted(name for name, module in sys.modules.items() if name.startswith("modelopt") and module is not None)
stages = ("specdeploy.speculator", "specdeploy.quantize", "specdeploy.resolve", "specdeploy.trtllm", "specdeploy.modules")
print(json.dumps({"results": results, "modelopt_modules": loaded, "stage_modules": sorted(m for m in sys.modules if m.startswith(stages))}))
"""


def test_deployments_serve_without_modelopt(target, specs, tiny_llama_dir, tmp_path):
    """The Triton stub on the GPU host had no ModelOpt: each kind loads and decodes exactly without it,
    and without importing any stage."""
    paths = []
    for kind in ("eagle-fc", "dflash", "medusa"):
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps({"model_dir": str(tiny_llama_dir), "dtype": "float32",
                                    "spec": {"kind": kind.split("-")[0], "path": str(specs[kind]), "max_draft_len": 4}}))
        paths.append(str(path))
    prompt = PROMPTS[2]
    done = subprocess.run([sys.executable, "-c", BLOCKED, json.dumps(prompt), *paths], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["modelopt_modules"] == []
    assert out["stage_modules"] == []  # serving reads downward only: no training, quantize or import stage
    plain = hf_greedy(target, prompt, 20)
    for path in paths:
        assert out["results"][path]["tokens"] == plain, path
        assert out["results"][path]["drafted"] > 0, path
