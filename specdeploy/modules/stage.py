"""The import stage: `make engine ... MODULE=<folder>` writes build/<name>/spec/ from a module made
elsewhere instead of training one. It records itself as stage "spec" (settings: the kind, the
folder and the sha256 of every file read), so quantize, convert, package and the CPU runtime read
an imported module exactly as a trained one.

In order, before anything is written: detect the layout, fill the optional fields as the engines
do, check the module against the base (modules.spec.check: hidden size, vocabulary, verifier,
captured layers, RoPE, dtype) and against the module ModelOpt builds from its config. Then spec/
(spec_config.json, module.safetensors, and ModelOpt's own export beside them, as training writes),
and the gate: a few held-out chat prompts decoded with the module; an EAGLE-3 or DFlash module
whose acceptance length is under the floor is refused, naming what usually mis-loads. A wrongly
loaded head still decodes correctly (the target verifies every token) but accepts almost nothing,
an acceptance length near 1.0, the silent failure this catches; `make verify` checks the served
acceptance against the same floor again (served_gate).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from specdeploy.device import announce, resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json
from specdeploy.manifest import BuildDir
from specdeploy.modules import read_module
from specdeploy.modules.files import fingerprint
from specdeploy.modules.module import Module

STAGE = "spec"
OUT = "spec"
IMPORT_FORMAT = 2  # bump when the spec/ an import writes changes for the same input (2: DFlash names its rope_theta)
GATE_FLOOR = 1.2  # a mis-loaded EAGLE-3 / DFlash head accepts almost nothing: ~1.0
GATE_PROMPTS = 4  # held-out chat prompts (spec.validate's, as `spec validate` reads them)
GATE_TOKENS = 48
GATE_CHAIN = 3  # EAGLE-3 drafts a chain of 3 for the gate (DFlash: its block)


def run(build: BuildDir, spec: str, module_dir: str | Path, *, allow_pickle: bool = False, accept: tuple[str, ...] = (),
        gate_floor: float = GATE_FLOOR, device: Any = "auto", trust_remote_code: bool = False) -> Path:
    """Stage `spec` from a module folder: build/<name>/spec/ as the spec stage's contract has it."""
    source = Path(module_dir).expanduser().resolve()
    # keyed on the files' content, not the folder's path: the same module moved elsewhere is not imported
    # again (spec_config.json records where it was read from)
    settings = {"kind": spec, "files": fingerprint(source, allow_pickle=allow_pickle),
                "accept": sorted(accept), "gate_floor": gate_floor, "import_format": IMPORT_FORMAT}  # a higher floor gates again
    if build.completed(STAGE, settings, consumes=("resolve",)):
        return build.path(OUT)
    base_dir = build.path("base")
    module = checked_module(source, spec, base_dir, build_aliases(build), allow_pickle=allow_pickle, accept=accept)
    where = announce("spec import", resolve_device(device))
    with build.stage(STAGE, OUT, settings, consumes=("resolve",), device=where) as tmp:
        write_spec(module, source, base_dir, tmp, settings["files"], device=device, trust_remote_code=trust_remote_code)
        try:
            gate(base_dir, tmp, module, gate_floor, device=device, trust_remote_code=trust_remote_code)
        except SpecDeployError:
            shutil.rmtree(tmp, ignore_errors=True)  # refused: nothing of it stays in the build
            raise
    return build.path(OUT)


def build_aliases(build: BuildDir) -> list[str]:
    """The names the build's base goes by (the model named, the folder it resolved to)."""
    resolve = (build.record("resolve") or {}).get("settings") or {}
    return [str(resolve.get("model") or ""), str(resolve.get("source") or "")]


def checked_module(source: Path, spec: str, base_dir: Path, aliases: list[str], *, allow_pickle: bool = False,
                   accept: tuple[str, ...] = ()) -> Module:
    """The module read, normalised and checked against the base: refused with what differs."""
    from specdeploy.modules.spec import Base, check, check_fits, normalise

    module, _ = read_module(source, allow_pickle=allow_pickle)
    if module.kind != spec:
        raise SpecDeployError(f"{source} holds {'an EAGLE-3' if module.kind == 'eagle' else 'a ' + module.kind} module "
                              f"({module.layout} layout), not SPEC={spec}", hint=f"pass SPEC={module.kind}")
    base = Base.of(base_dir, *aliases)
    module = normalise(module, base)
    check(module, base, accept)
    check_fits(module, base_dir)
    return module


def write_spec(module: Module, source: Path, base_dir: Path, out: Path, files: dict[str, str], *, device: Any = "auto",
               trust_remote_code: bool = False) -> None:
    """spec_config.json + module.safetensors, and ModelOpt's export of EAGLE-3 / DFlash beside them."""
    from specdeploy.modules.spec import Base, spec_config, spec_tensors
    from specdeploy.checkpoints.modules import MODULE_FILE, SPEC_CONFIG
    from specdeploy.speculator.common import save_tensors
    from specdeploy.speculator.train import EXPORTS, export_draft

    provenance = {"layout": module.layout, "source": str(source), "files": files, "verifier": module.verifier,
                  "verifier_architectures": module.verifier_architectures}
    save_tensors(out / MODULE_FILE, spec_tensors(module))
    atomic_write_json(out / SPEC_CONFIG, spec_config(module, base_dir, Base.of(base_dir), provenance))
    if module.kind in EXPORTS:
        export_draft(base_dir, out, device=device, trust_remote_code=trust_remote_code)


# ---------------------------------------------------------------------------------- the gate


def gate(base_dir: Path, spec_dir: Path, module: Module, floor: float, *, device: Any = "auto",
         trust_remote_code: bool = False) -> float | None:
    """Acceptance length on GATE_PROMPTS held-out chat prompts (float32), recorded in spec_config.json;
    under `floor` the module is refused with the likely causes. None: not gated (Medusa, floor 0)."""
    from specdeploy.checkpoints.modules import SPEC_CONFIG
    from specdeploy.speculator.validate import load_for_validation, measure, overall

    if module.kind == "medusa" or floor <= 0:
        return None
    options = {"mode": "chain", "chain_len": GATE_CHAIN} if module.kind == "eagle" else {}
    target, tokenizer, proposer = load_for_validation(base_dir, spec_dir, "float32", options, device=device,
                                                      trust_remote_code=trust_remote_code)
    value = overall(measure(target, tokenizer, proposer, categories=("chat",), num_prompts=GATE_PROMPTS,
                            max_new_tokens=GATE_TOKENS))
    if value < floor:
        raise SpecDeployError(f"the imported {module.layout} module reaches an acceptance length of {value:.2f} on "
                              f"{GATE_PROMPTS} held-out chat prompts, under the floor {floor}: it drafts almost nothing the "
                              f"base accepts. Likely causes: {likely_causes(module)}",
                              hint="check those against the module's source (or pass --gate-floor 0 to import it anyway)")
    config_file = spec_dir / SPEC_CONFIG
    config = json.loads(config_file.read_text())
    config["imported"]["gate"] = {"acceptance_length": round(value, 3), "prompts": GATE_PROMPTS, "floor": floor}
    atomic_write_json(config_file, config)
    return value


def served_gate(spec_dir: Path, chat_acceptance: float | None) -> str | None:
    """`make verify`'s second look: an imported module that passed the gate at import must reach its
    floor again on the served chat prompts (a deployment that loaded it otherwise accepts ~1.0).
    The failure with its likely causes, or None (passed, no module, not an imported EAGLE-3 /
    DFlash module, or no chat prompts served)."""
    from specdeploy.checkpoints.modules import SPEC_CONFIG, read_spec_config
    from specdeploy.modules.spec import from_spec

    if not (spec_dir / SPEC_CONFIG).is_file():  # a draft-model, n-gram or plain build: no module
        return None
    recorded = (read_spec_config(spec_dir).get("imported") or {}).get("gate")
    if not recorded or chat_acceptance is None or chat_acceptance >= recorded["floor"]:
        return None
    module = from_spec(spec_dir)
    return (f"the served acceptance length on chat prompts is {chat_acceptance:.2f}, under the imported module's floor "
            f"{recorded['floor']} (it reached {recorded['acceptance_length']} at import): the deployment drafts almost "
            f"nothing the base accepts. Likely causes: {likely_causes(module)}")


def likely_causes(module: Module) -> str:
    rope = f"RoPE (theta {module.rope_theta:g}, scaling {module.rope_scaling or 'none'})"
    if module.kind == "dflash":
        return (f"the target layers ({module.layers}, 0-based layer outputs), the mask token ({module.mask_token_id}), "
                f"the block size ({module.block_size}), {rope}")
    vocab = ("none: the draft vocabulary is the target's" if "d2t" not in module.tensors else
             f"{module.draft_vocab_size} of {module.vocab_size} tokens")
    return (f"the captured layers ({module.layers}, 0-based layer outputs: vLLM and speculators count layer inputs, one "
            f"higher; order matters to fc), the draft vocabulary map (d2t: {vocab}), the first layer's norms "
            f"(hidden_norm on the {module.hidden_norm_input} output, norm_before_residual {module.norm_before_residual}), {rope}")
