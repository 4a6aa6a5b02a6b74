"""SGLang 0.5.23: which of a build's modules it serves, the EAGLE-3 folder its loader reads
(`specdeploy export --format sglang`), and the `python3 -m sglang.launch_server` command.

Read in the release itself, the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl
(sha256 00b3cd5b...; it records no commit), under sglang/srt/ (python/sglang/srt/ in the repository):

- models/llama_eagle3.py LlamaForCausalLMEagle3: a LlamaConfig with draft_vocab_size (None: the
  lm_head comes from the target) and eagle_config.eagle_aux_hidden_state_layer_ids (fc reads that many
  layers, else num_aux_hidden_states, else 3); load_weights takes `layers.0.*` and maps the legacy
  `midlayer.*` onto it, turns d2t into hot_token_id (target = draft + d2t[draft]) and skips t2d;
  tie_word_embeddings makes the lm_head the target's embedding, so it is written false. The first
  layer takes the fc output as its residual and applies hidden_norm to it: no norm_before_residual.
- models/llama.py / qwen2.py / qwen3.py set_eagle3_layers_to_capture (and set_dflash_layers_to_capture:
  Llama and Qwen3 only): layer_ids + 1, i.e. the ids are the 0-based layer outputs we record.
- model_executor/model_runner_components/spec_aux_hidden_state.py: the ids come from the draft's
  eagle_config; speculative/eagle_worker_v2.py init_lm_head: the draft takes the target's embeddings.
- models/dflash.py DFlashDraftModel, speculative/dflash_utils.py parse_dflash_draft_config: z-lab's
  layout (dflash_config.target_layer_ids, mask_token_id, block_size), what `--format dflash` writes.
- arg_groups/fields/spec.py and server_args.py (the flags), speculative/spec_info.py
  SpeculativeAlgorithm (EAGLE3, DFLASH, STANDALONE, ...; no Medusa), arg_groups/speculative_hook.py
  (topk 1: num_draft_tokens = num_steps + 1; DFLASH: steps = topk = 1, num_draft_tokens = the block),
  speculative/eagle_utils.py organize_draft_results (num_draft_tokens - 1 drafted nodes),
  configs/model_config.py _parse_modelopt_quant_config (FP8, NVFP4/FP4, MXFP8, MIXED_PRECISION).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdeploy.engines import BuildFacts, EngineRelease, common_refusal
from specdeploy.errors import SpecDeployError

if TYPE_CHECKING:
    from specdeploy.modules.module import Module

RELEASE = EngineRelease(engine="SGLang", version="0.5.23", install="sglang==0.5.23",
                        source="PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl (sha256 00b3cd5b265ac76c...)")
ALGORITHMS = {"eagle": "EAGLE3", "dflash": "DFLASH", "draft": "STANDALONE"}
# the quantize stage's ModelOpt formats this release maps (configs/model_config.py); INT8 SQ and AWQ it does not
QUANT_ALGOS = ("FP8", "NVFP4")
# targets read: the kinds whose hidden states each captures (set_eagle3_ / set_dflash_layers_to_capture)
CAPTURE = {"LlamaForCausalLM": ("eagle", "dflash"), "Qwen2ForCausalLM": ("eagle",), "Qwen3ForCausalLM": ("eagle", "dflash")}
NO_RESIDUAL_NORM = ("SGLang 0.5.23's first EAGLE-3 layer takes the un-normed fc output as its residual "
                    "(models/llama_eagle3.py), and this module adds the normed one (norm_before_residual)")


def refusal(facts: BuildFacts) -> str | None:
    """Why this release gets no route for a build, or None."""
    if facts.kind == "medusa":
        return ("SGLang 0.5.23 has no Medusa algorithm (speculative/spec_info.py SpeculativeAlgorithm: DFLASH, UNO, DSPARK, "
                "EAGLE, EAGLE3, FROZEN_KV_MTP, STANDALONE, NGRAM)")
    why = common_refusal(RELEASE, facts, QUANT_ALGOS)
    if why or facts.kind not in ("eagle", "dflash"):
        return why
    if facts.kind == "eagle" and facts.norm_before_residual:
        return NO_RESIDUAL_NORM
    if facts.kind == "dflash" and facts.pp > 1:
        return "SGLang 0.5.23 runs DFLASH with pp_size 1 only (arg_groups/speculative_hook.py _handle_dflash)"
    if facts.architecture in CAPTURE and facts.kind not in CAPTURE[facts.architecture]:
        return (f"SGLang 0.5.23's {facts.architecture} does not capture the hidden states {ALGORITHMS[facts.kind]} drafts from "
                f"(no set_dflash_layers_to_capture in its model file)")
    return None


def module_format(kind: str) -> str | None:
    """The `specdeploy export` format of the folder this release loads (None: the build's draft model as it is)."""
    return {"eagle": "sglang", "dflash": "dflash"}.get(kind)


def notes(facts: BuildFacts) -> list[str]:
    """What was not checked for this build."""
    if facts.kind in ("eagle", "dflash") and facts.architecture not in CAPTURE:
        hook = "eagle3" if facts.kind == "eagle" else "dflash"
        return [f"the target's architecture {facts.architecture} was not read in SGLang 0.5.23 (read: "
                f"{', '.join(sorted(CAPTURE))}): it must implement set_{hook}_layers_to_capture"]
    return []


def command(model: str, draft: str, facts: BuildFacts) -> list[str]:
    """`python3 -m sglang.launch_server` for the build's model with its draft (paths as given: `$BUILD_DIR/...`)."""
    structure = facts.structure
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", model, "--speculative-algorithm",
            ALGORITHMS[facts.kind], "--speculative-draft-model-path", draft]
    if facts.kind == "dflash":  # the verify window: the pending token and the drafted chain
        argv += ["--speculative-num-draft-tokens", str(structure.max_draft_len + 1)]
    else:  # a chain is topk 1; num_draft_tokens counts the pending token beside the drafted nodes
        topk = structure.topk if structure.mode == "dynamic" else 1
        argv += ["--speculative-num-steps", str(structure.max_draft_len), "--speculative-eagle-topk", str(topk),
                 "--speculative-num-draft-tokens", str(structure.tokens_per_step + 1)]
    if facts.tp > 1:
        argv += ["--tp-size", str(facts.tp)]
    if facts.pp > 1:
        argv += ["--pp-size", str(facts.pp)]
    return argv


# ---------------------------------------------------------------------------------- the EAGLE-3 folder


def write_eagle3(module: Module, out: Path, *, max_positions: int, dtype: str) -> Path:
    """out/config.json + out/model.safetensors as LlamaForCausalLMEagle3 loads them, from an EAGLE-3
    `module` normalised against its base (spec.normalise: layers and vocabulary map resolved)."""
    import torch

    from specdeploy.fileio import atomic_write_json
    from specdeploy.modules.module import later_layer_norms
    from specdeploy.speculator.common import save_tensors

    if module.norm_before_residual:
        raise SpecDeployError(f"no SGLang layout for this module: {NO_RESIDUAL_NORM}",
                              hint="serve it with vLLM (--format speculators) or the CPU deployment")
    # floats in the serving dtype; d2t stays the integer offsets hot_token_id is made from
    tensors = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v).contiguous()
               for k, v in later_layer_norms(module.tensors, "input_layernorm", "hidden_norm").items()}
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    atomic_write_json(out / "config.json", _config(module, max_positions, dtype))
    return out


def _config(module: Module, max_positions: int, dtype: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": module.hidden_size,
        # null without a head of its own (it drafts over the whole vocabulary): SGLang then takes the target's
        # lm_head (llama_eagle3.py load_lm_head_from_target); a number makes it build an empty one
        "vocab_size": module.vocab_size, **module.arch,
        "draft_vocab_size": module.draft_vocab_size if "lm_head.weight" in module.tensors else None,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": max_positions, "rope_theta": module.rope_theta, "rope_scaling": module.rope_scaling,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(module.layers), "use_aux_hidden_state": True},
        "dtype": dtype,
    }
    if module.hidden_norm_input != "fc":  # a module ModelOpt trained: SGLang ignores it, our import reads it back
        config["hidden_norm_input"] = module.hidden_norm_input
    return config
