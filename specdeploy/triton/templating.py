"""The Triton model templates (specdeploy/triton/templates/, package data: an installed wheel
carries them): copying a template model folder, filling its `${name}` placeholders, and the digest
by which a changed template re-runs the `package` stage. (Not named templates.py: a module of
that name would stand beside the templates/ folder under the same import name.)

Templates use `${name}` placeholders like TensorRT-LLM's own; one filler (string.Template) fills
them. A placeholder left inside a `string_value: "${...}"` parameter is how the tensorrtllm
backend spells "unset", so those may stay; any other one left is an error.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path
from string import Template
from typing import Any

from specdeploy import prompts
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_text
from specdeploy.trtllm.build import BuildLimits

TEMPLATES = Path(__file__).resolve().parent / "templates"  # package data (pyproject.toml)
# code a template model imports from its own folder (Triton puts that folder on sys.path), copied in
# from the package at package time: one implementation, and a written repository that needs nothing
# else. {template model folder: {path inside it: source}}
SHARED_CODE = {"preprocessing": {"1/specdeploy_prompts.py": Path(prompts.__file__).resolve()}}
_UNSET_PARAM = re.compile(r'string_value:\s*"\$\{\w+\}"')
_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def fill(template: str, values: dict[str, Any], *, source: str = "template") -> str:
    """Substitute ${name}; fail on a placeholder left anywhere but an unset backend parameter."""
    text = Template(template).safe_substitute({k: text_value(v) for k, v in values.items()})
    leftover = _PLACEHOLDER.findall(_UNSET_PARAM.sub("", text))
    if leftover:
        raise SpecDeployError(
            f"{source}: no value for {sorted(set(leftover))}",
            hint="add them to the values its writer passes for this model (specdeploy/triton/cpu_repo.py, engine_repo.py)",
        )
    return text


def text_value(value: Any) -> str:
    """A value as a template (and a config parameter) spells it: booleans lower-case."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def backend_fill_args(values: dict[str, Any]) -> str:
    """The same values as one argument for the tensorrtllm_backend's tools/fill_template.py.

    It splits on unescaped ',' and then each item on unescaped ':', consuming one level of
    backslashes each time: '{0, 1}' travels as '{0\\, 1}', and a ':' inside a value needs both levels.
    """
    def esc(text: str) -> str:
        inner = text.replace("\\", "\\\\").replace(":", "\\:")
        return inner.replace("\\", "\\\\").replace(",", "\\,")

    return ",".join(f"{k}:{esc(text_value(v))}" for k, v in sorted(values.items()))


def copy_model(src: Path, out: Path) -> None:
    """One template model folder into `out`, with the package's own code it imports (SHARED_CODE)."""
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name, origin in SHARED_CODE.get(src.name, {}).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(origin, out / name)


def fill_model(out: Path, src: Path, values: dict[str, Any], rename: str | None = None) -> None:
    """Copy one template model folder into `out`, filling its config.pbtxt."""
    copy_model(src, out)
    path = out / "config.pbtxt"
    text = fill(path.read_text(), values, source=str(src.relative_to(TEMPLATES) / "config.pbtxt"))
    if rename:
        text = text.replace(f'name: "{src.name}"', f'name: "{rename}"', 1)
    atomic_write_text(path, text)
    (out / "1").mkdir(exist_ok=True)


def common_values(tokenizer_dir: str, limits: BuildLimits, max_batch_size: int, decoupled: bool) -> dict[str, Any]:
    """The inflight_batcher_llm templates' values shared by the CPU and the engine repository."""
    return {
        "triton_max_batch_size": max_batch_size,
        "decoupled_mode": decoupled,
        "max_queue_delay_microseconds": 0,
        "max_queue_size": 0,
        "logits_datatype": "TYPE_FP32",
        "encoder_input_features_data_type": "TYPE_FP16",
        "tokenizer_dir": tokenizer_dir,
        "add_special_tokens": True,  # as Decoder.encode: in-process and served prompts match
        "skip_special_tokens": True,
        "preprocessing_instance_count": 1,
        "postprocessing_instance_count": 1,
        "bls_instance_count": 1,
        "accumulate_tokens": False,
        # TensorRT-LLM's backend default (the parameter unset): NVIDIA's clients that leave the input
        # out expect the prompt in the output; specdeploy's client sends exclude_input_in_output itself
        "exclude_input_in_output": False,
        "max_beam_width": 1,
        # the same numbers trtllm-build gets (build.BuildLimits.fit): prompt and prompt + answer
        "max_input_len": limits.max_input_len,
        "max_output_len": limits.max_seq_len,
    }


def templates_digest() -> str:
    """Changing a template, or the code copied in beside one (SHARED_CODE), re-runs the stage."""
    files = {path.relative_to(TEMPLATES): path for path in TEMPLATES.rglob("*")
             if path.is_file() and "__pycache__" not in path.parts}
    for model in TEMPLATES.glob("*/*"):
        files.update({model.relative_to(TEMPLATES) / name: origin for name, origin in SHARED_CODE.get(model.name, {}).items()})
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(str(name).encode())
        digest.update(files[name].read_bytes())
    return digest.hexdigest()[:16]
