"""Serving engines beside TensorRT-LLM: vLLM and SGLang, one named release each, read at its sources
(docs/engines.md). For a packaged build, each gets the speculative module in the layout that release
loads and the exact command that serves it with the build's draft structure, or the reason it gets
none; nothing here imports either engine (neither is installed where builds are made).

    vllm.py     vLLM 0.33.0: the speculators folder, `vllm serve ... --speculative-config '{...}'`
    sglang.py   SGLang 0.5.23: its EAGLE-3 folder (also `specdeploy export --format sglang`),
                `python3 -m sglang.launch_server ... --speculative-algorithm EAGLE3|DFLASH|STANDALONE`
    routes.py   triton_repo/{vllm,sglang}/ at package time: module folder, serve.sh, the route records

Each engine module has RELEASE, refusal(facts) -> str | None, notes(facts), module_format(kind) and
command(model, draft, facts), all reading one BuildFacts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdeploy.trtllm.llmapi import DraftStructure

# The builds no engine route is written for, whatever the engine: the same reason for both.
NO_MODULE = {
    "none": "this build has no speculative module",
    "ngram": ("an n-gram build has no module to ship: vLLM's `ngram` method and SGLang's NGRAM algorithm take "
              "their own settings, not checked against the CPU runtime's prompt lookup, so no route is written "
              "(docs/engines.md)"),
}


@dataclass(frozen=True)
class EngineRelease:
    """One engine release, as read: what to install and which artifact the facts come from."""

    engine: str  # vLLM | SGLang
    version: str
    install: str  # the pip requirement that gets this release
    source: str  # the artifact read (and its commit where the artifact names one)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BuildFacts:
    """What an engine's route depends on in a build."""

    kind: str  # eagle | dflash | draft | medusa | ngram | none
    structure: DraftStructure | None  # what convert named for the GPU host (None: no speculation)
    quant_algo: str | None = None  # the served model's ModelOpt quant_algo (None: unquantized)
    architecture: str | None = None  # the served model's architectures[0]
    norm_before_residual: bool = False  # EAGLE-3 first layer: the residual is the normed fc output
    tp: int = 1  # convert's tensor / pipeline parallel sizes, which the commands keep
    pp: int = 1


def common_refusal(release: EngineRelease, facts: BuildFacts, quant_algos: tuple[str, ...]) -> str | None:
    """Why `release` gets no route for this build, for the reasons every engine shares."""
    if facts.kind in NO_MODULE:
        return NO_MODULE[facts.kind]
    if facts.quant_algo is not None and facts.quant_algo not in quant_algos:
        return (f"{release.engine} {release.version} loads ModelOpt checkpoints quantized as {', '.join(quant_algos)} "
                f"(of the formats the quantize stage writes), not {facts.quant_algo}")
    return None
