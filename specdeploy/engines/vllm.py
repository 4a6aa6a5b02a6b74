"""vLLM 0.33.0: which of a build's modules it serves, the folder it loads, and the `vllm serve` command.

Read in the release's own source, the PyPI sdist vllm-0.33.0.tar.gz (vllm/_version.py: commit
4ba787ec9, tag v0.33.0); tests/data/vllm_0.33.0_flags.json holds the flags and fields read
(tests/engine_flags.py regenerates it from a checkout):

- transformers_utils/config.py maybe_override_with_speculators: `vllm serve <speculators folder>`
  serves the verifier named in its speculators_config and refuses a local one ("Speculators verifier
  must name a remote model repository. Select local verifiers explicitly with --model and
  --speculative-config"). A build's base is a local folder, so the route serves the build's model
  with --speculative-config {"model": <folder>, "method": ...}; a folder with speculators_config
  still loads as SpeculatorsConfig there (the draft's config.json has no model_type).
- config/speculative.py SpeculativeConfig: model, method (SpeculativeMethod: eagle3, dflash,
  draft_model, ..., no Medusa), num_speculative_tokens; no draft-tree field: vLLM drafts chains.
- transformers_utils/configs/speculators/algos.py update_eagle3 (a missing norm_before_residual is
  True), update_dflash (target_layer_ids = aux ids - 1, non-causal block).
- model_executor/models/llama_eagle3.py: midlayer.* or layers.0.*, d2t -> draft_id_to_target_id,
  t2d skipped, hidden_norm on the fc output, norm_before_residual honoured; qwen3_dflash.py.
- model_executor/models/interfaces.py EagleModelMixin: captures hidden_states + residual before
  layer i, so aux ids count layer inputs (our ids + 1, as the speculators export writes them).
- v1/spec_decode/dflash.py: 1 + num_speculative_tokens query positions per request (the block).
- engine/arg_utils.py (--speculative-config as JSON, --tensor-parallel-size,
  --pipeline-parallel-size), entrypoints/common/cli_args.py make_arg_parser (positional model_tag).
- model_executor/layers/quantization/modelopt.py QUANT_ALGOS (FP8 variants, NVFP4, MXFP8, mixed).
"""

from __future__ import annotations

import json

from specdeploy.engines import BuildFacts, EngineRelease, common_refusal

RELEASE = EngineRelease(engine="vLLM", version="0.33.0", install="vllm==0.33.0",
                        source="PyPI sdist vllm-0.33.0.tar.gz (sha256 f4c33c2503d52bb4...), commit 4ba787ec9 (tag v0.33.0)")
METHODS = {"eagle": "eagle3", "dflash": "dflash", "draft": "draft_model"}
# the quantize stage's ModelOpt formats this release loads (modelopt.py QUANT_ALGOS); INT8 SQ and the AWQ ones it refuses
QUANT_ALGOS = ("FP8", "NVFP4")
# targets read that capture auxiliary hidden states (SupportsEagle3: EAGLE-3 and DFlash alike)
AUX_TARGETS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def refusal(facts: BuildFacts) -> str | None:
    """Why this release gets no route for a build, or None."""
    if facts.kind == "medusa":
        return ("vLLM 0.33.0 has no Medusa proposer (config/speculative.py SpeculativeMethod: ngram, ngram_gpu, suffix, "
                "draft_model, custom_class, eagle, eagle3, dflash, dspark, extract_hidden_states and the MTP types)")
    return common_refusal(RELEASE, facts, QUANT_ALGOS)


def module_format(kind: str) -> str | None:
    """The `specdeploy export` format of the folder this release loads (None: the build's draft model as it is)."""
    return "speculators" if kind in ("eagle", "dflash") else None


def notes(facts: BuildFacts) -> list[str]:
    """What this release runs differently from the build's draft structure, or was not checked."""
    said = []
    if facts.structure.mode == "dynamic":
        said.append(f"vLLM 0.33.0 drafts a chain (SpeculativeConfig has no tree field): {facts.structure.max_draft_len} tokens "
                    f"deep, not the build's dynamic tree of {facts.structure.total} nodes")
    if facts.kind in ("eagle", "dflash") and facts.architecture not in AUX_TARGETS:
        said.append(f"the target's architecture {facts.architecture} was not read in vLLM 0.33.0 (read: "
                    f"{', '.join(sorted(AUX_TARGETS))}): it must implement SupportsEagle3 to hand the draft its hidden states")
    return said


def command(model: str, draft: str, facts: BuildFacts) -> list[str]:
    """`vllm serve` for the build's model with its draft (paths as given: `$BUILD_DIR/...`)."""
    spec = {"model": draft, "method": METHODS[facts.kind], "num_speculative_tokens": facts.structure.max_draft_len}
    argv = ["vllm", "serve", model, "--speculative-config", json.dumps(spec)]
    if facts.tp > 1:
        argv += ["--tensor-parallel-size", str(facts.tp)]
    if facts.pp > 1:
        argv += ["--pipeline-parallel-size", str(facts.pp)]
    return argv
