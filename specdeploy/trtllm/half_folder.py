"""A float32 model folder in bfloat16, for TensorRT-LLM's PyTorch backend (the LLM-API route).

Its kernels lack float32 (NVIDIA/TensorRT-LLM#5260: "rmsnorm ... failed to dispatch data type
Float"; the maintainers' answer is to convert the model to fp16 or bf16), and the backend takes
the model's dtype from its config.json (`_torch/pyexecutor/model_loader.py` passes LLM()'s `dtype`
to no loader), so a float32 build's target (and a float32 draft-target draft) gets a bfloat16 copy
on that route. The CPU deployment and the other routes keep the float32 folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_bytes, atomic_write_json, checkpoint_files, link_folder

HALF_DTYPE = "bfloat16"
WEIGHTS = ".safetensors"


def needs_half(model_dir: Path) -> bool:
    """An unquantized float32 checkpoint (a quantized export already carries its own dtypes)."""
    from specdeploy.checkpoints import checkpoint_dtype

    model_dir = Path(model_dir)
    return checkpoint_dtype(model_dir) == "float32" and not (model_dir / "hf_quant_config.json").is_file()


def write_half(src: Path, dst: Path) -> Path:
    """dst: src's files with the checkpoint's weight files' floating tensors in bfloat16 (one file at
    a time; fileio.checkpoint_files, other *.safetensors left out) and a config declaring it, written
    for the release's transformers (hfcompat); the other files (tokenizer, shard index, generation
    config) as they are."""
    import torch
    from safetensors.torch import load_file, save

    from specdeploy.hfcompat import compatible_config, with_dtype, write_compatible

    src, dst = Path(src), Path(dst)
    weights = {file.name for file in checkpoint_files(src)}
    if not weights:
        raise SpecDeployError(f"{src} holds no safetensors weights to write in {HALF_DTYPE} for TensorRT-LLM's PyTorch backend",
                              hint="resolve the model from safetensors (or GGUF), or deploy it in bfloat16 / float16")
    link_folder(src, dst)
    for file in sorted(dst.glob(f"*{WEIGHTS}")):
        file.unlink()  # a hard link to the source: replaced, never written through
        if file.name not in weights:
            continue
        tensors = load_file(str(src / file.name))
        cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
        atomic_write_bytes(file, save(cast, metadata={"format": "pt"}))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").unlink()
    atomic_write_json(dst / "config.json", compatible_config(with_dtype(config, HALF_DTYPE)))
    write_compatible(dst)
    return dst
