"""What the real speculators library reads from a folder, or makes of one with its own converter: run
as a script in the speculators oracle venv (tests/test_modules_speculators.py), importing only
speculators, torch, safetensors and the standard library.

    python speculators_probe.py read FOLDER RESULT.json TENSORS.safetensors
        SpeculatorModel.from_pretrained(FOLDER): its config as the library holds it, and the module's
        tensors as loaded (buffers included)
    python speculators_probe.py convert-eagle3 SOURCE VERIFIER OUT LAYER_IDS(json)
        speculators' own EAGLE-3 converter from the EAGLE authors' layout
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file

MODULE_TENSORS = ("layers.", "fc.", "norm.", "hidden_norm.", "lm_head.", "d2t", "t2d")
LAYER_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "rms_norm_eps", "vocab_size")


def read(folder: str, result: str, tensors: str) -> None:
    from speculators import SpeculatorModel

    import speculators

    model = SpeculatorModel.from_pretrained(folder)
    config = model.config
    layer = config.transformer_layer_config
    fields = {name: getattr(config, name, None) for name in (
        "speculators_model_type", "draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
        "aux_hidden_state_layer_ids", "block_size", "mask_token_id", "norm_before_fc", "fc_norm", "norm_output")}
    verifier = config.speculators_config.verifier
    out = {
        "version": getattr(speculators, "__version__", None) or _version(),
        "class": type(model).__name__,
        "config": fields,
        "layer": {name: getattr(layer, name, None) for name in LAYER_FIELDS},
        "rope_theta": dict(getattr(layer, "rope_parameters", None) or {}).get("rope_theta", getattr(layer, "rope_theta", None)),
        # the frequencies the library's own rotary embedding computes from the config it read
        "inv_freq": next((m.inv_freq.tolist() for m in model.modules() if hasattr(m, "inv_freq")), None),
        "verifier": {"name_or_path": verifier.name_or_path, "architectures": list(verifier.architectures)},
        "algorithm": config.speculators_config.algorithm,
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k.startswith(MODULE_TENSORS)}
    save_file(state, tensors)
    with open(result, "w") as handle:
        json.dump(out, handle, indent=2, default=str)


def _version() -> str:
    from importlib import metadata

    return metadata.version("speculators")


def convert_eagle3(source: str, verifier: str, out: str, layer_ids: str) -> None:
    from speculators.convert.entrypoints import convert_model

    convert_model(model=source, verifier=verifier, algorithm="eagle3", output_path=out,
                  eagle_aux_hidden_state_layer_ids=json.loads(layer_ids), norm_before_residual=False)


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"read": read, "convert-eagle3": convert_eagle3}[sys.argv[1]](*sys.argv[2:])
