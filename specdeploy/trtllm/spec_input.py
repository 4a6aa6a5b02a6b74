"""What `convert` reads from the spec stage: build/<name>/spec/ (spec_config.json +
module.safetensors) as a SpecInput, or a plain run; the spec modules it refuses, and how many
tokens an external drafter proposes per step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdeploy.choices import ChoicesTree, validate_choices
from specdeploy.errors import SpecDeployError

KINDS = ("none", "medusa", "eagle", "dflash", "draft", "ngram")
DEFAULT_DRAFT_LEN = 4  # EAGLE-3 chain / draft-target / n-gram drafts per step when nothing says otherwise


@dataclass
class SpecInput:
    """What the spec stage produced (spec/spec_config.json + module.safetensors), or a plain run."""

    kind: str = "none"
    config: dict[str, Any] | None = None
    module: dict[str, torch.Tensor] | None = None
    tree: ChoicesTree | None = None
    draft_dir: Path | None = None
    max_draft_len: int | None = None


def load_spec(spec_dir: str | Path | None, *, kind: str | None = None, draft_model: str | Path | None = None,
              max_draft_len: int | None = None) -> SpecInput:
    """Read build/<name>/spec/; `kind`/`draft_model` override or stand in for it."""
    config: dict[str, Any] = {}
    if spec_dir is not None and (Path(spec_dir) / "spec_config.json").exists():
        config = json.loads((Path(spec_dir) / "spec_config.json").read_text())
    kind = kind or config.get("kind") or ("draft" if draft_model else "none")
    if kind not in KINDS:
        raise SpecDeployError(f"unknown spec kind {kind!r}", hint=f"one of {', '.join(KINDS)}")
    spec = SpecInput(kind=kind, config=config, max_draft_len=max_draft_len or config.get("max_draft_len"))
    if kind in ("medusa", "eagle", "dflash"):
        module_file = Path(spec_dir or ".") / "module.safetensors"
        if not module_file.exists():
            raise SpecDeployError(f"{module_file} not found", hint="run `specdeploy spec train` first: it writes the trained module there")
        from safetensors.torch import load_file

        spec.module = load_file(str(module_file))
        _refuse_quantized_module(spec.module)
        if kind == "medusa" and config.get("choices"):
            spec.tree = validate_choices(config["choices"], name="medusa_choices")
    if kind == "draft":
        found = draft_model or config.get("draft_model") or config.get("draft_model_dir")
        if not found:
            raise SpecDeployError("draft-target needs a draft model", hint="pass --draft-model or record draft_model in spec_config.json")
        spec.draft_dir = Path(found)
    return spec


def _refuse_quantized_module(module: dict[str, torch.Tensor]) -> None:
    scaled = [k for k in module if k.endswith(("weight_scale", "input_scale", "pre_quant_scale"))]
    if scaled:
        raise SpecDeployError(
            f"the spec module holds quantized tensors ({scaled[0]}, ...): quantized Medusa/EAGLE modules are not converted",
            hint="keep the module unquantized: the converter excludes medusa_heads* from quantization",
        )


QUANTIZED_SPEC_REASON = (
    "--quantize-spec wrote an FP8 module (quantized/spec/) that no TensorRT-LLM route here can deploy: the engine "
    "flow's Medusa converter writes unquantized heads, and that the LLM API loads ModelOpt's FP8 EAGLE-3 drafter "
    "export could not be confirmed in the llm_args/loader sources read for 1.2, 1.3 or main (formats.py)"
)


def refuse_quantized_spec(model_dir: Path) -> None:
    """Refuse to deploy an unquantized module beside a quality report measured with an FP8 one."""
    config = Path(model_dir) / "spec" / "spec_config.json"
    if config.exists() and json.loads(config.read_text()).get("quantization"):
        raise SpecDeployError(QUANTIZED_SPEC_REASON,
                              hint="rebuild without --quantize-spec (the module deploys unquantized; the quality report "
                                   "then measures what is deployed)")


def external_draft_len(spec: SpecInput) -> int:
    """--max-draft-len, else DFlash's whole block (block_size - 1 drafts), else the default chain."""
    block = (spec.config or {}).get("block_size") if spec.kind == "dflash" else None
    return int(spec.max_draft_len or (block - 1 if block else DEFAULT_DRAFT_LEN))
