"""The command lines of the engine releases specdeploy writes routes for, read from the releases' own
sources with `ast` (nothing imported, none of their dependencies installed): the oracle the route
tests check every generated command against.

    sglang_cli(site)   SGLang (a site-packages folder holding the sglang package, e.g. the release's
                       wheel installed without dependencies): every flag ServerArgs.add_cli_args
                       registers, the SpeculativeAlgorithm names, the target models' capture hooks
    vllm_cli(root)     vLLM (a checkout or an unpacked sdist): the literal add_argument flags of
                       `vllm serve`, SpeculativeConfig's fields and `method` values, the models with
                       SupportsEagle3, the ModelOpt quant_algo values

    python -m tests.engine_flags vllm ROOT OUT.json --source "what ROOT is (artifact, commit)"

regenerates tests/data/vllm_<version>_flags.json (the vLLM wheel is too large to fetch in a test).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------------------ shared


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _literal(node: ast.AST | None) -> Any:
    """The node's value where it is a literal, else None (a name or call resolved at run time)."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _strings(nodes: list[ast.expr]) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _add_argument_flags(tree: ast.Module) -> dict[str, dict[str, Any]]:
    """Every `*.add_argument("--flag", ...)` with literal names: its names and whether it takes a value."""
    flags: dict[str, dict[str, Any]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        names = [n for n in _strings(node.args) if n.startswith("-")]
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        action = _literal(keywords.get("action"))
        entry = {"value": action not in ("store_true", "store_false"), "choices": _literal(keywords.get("choices")),
                 "type": keywords["type"].id if isinstance(keywords.get("type"), ast.Name) else None}
        flags.update({name: entry for name in names})
    return flags


# ------------------------------------------------------------------------------ SGLang


def _unwrap_optional(node: ast.expr) -> ast.expr:
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Optional":
        return node.slice
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        return node.left if isinstance(node.right, ast.Constant) else node.right
    return node


def _field_flag(name: str, annotation: ast.expr) -> dict[str, Any] | None:
    """The CLI entry arg_utils.add_cli_args_from_dataclass makes of one `A[T, "help" | Arg(...)]` field."""
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id in ("A", "Annotated") and isinstance(annotation.slice, ast.Tuple)):
        return None
    kind, *meta = annotation.slice.elts
    arg: dict[str, ast.expr] | None = None
    for item in meta:
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            arg = {}
            break
        if isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.func.id == "Arg":
            arg = {k.arg: k.value for k in item.keywords if k.arg}
            break
    if arg is None or _literal(arg.get("no_cli")):
        return None
    inner = _unwrap_optional(kind)
    literal = (isinstance(inner, ast.Subscript) and isinstance(inner.value, ast.Name) and inner.value.id == "Literal")
    choices = _literal(inner.slice) if literal else _literal(arg.get("choices"))
    if literal and not isinstance(choices, tuple):
        choices = (choices,)
    type_name = inner.id if isinstance(inner, ast.Name) else None
    return {"names": [_literal(arg.get("cli_name")) or "--" + name.replace("_", "-"), *(_literal(arg.get("aliases")) or [])],
            "value": "action" not in arg and type_name != "bool", "type": type_name,
            "choices": list(choices) if choices is not None else None}


def sglang_cli(site: Path) -> dict[str, dict[str, Any]]:
    """`python -m sglang.launch_server`'s flags: the fields of every input namespace ServerArgs
    collects (srt/server_args.py _INPUT_NAMESPACES, srt/arg_groups/fields/*.py) as
    add_cli_args_from_dataclass registers them, plus add_cli_args' own add_argument calls."""
    srt = site / "sglang" / "srt"
    server_args = _parse(srt / "server_args.py")
    namespaces = next(set(e.id for e in node.value.elts) for node in server_args.body if isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets))
    flags = _add_argument_flags(server_args)
    for file in sorted((srt / "arg_groups" / "fields").glob("*.py")):
        for cls in _parse(file).body:
            if not (isinstance(cls, ast.ClassDef) and cls.name in namespaces):
                continue
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    entry = _field_flag(node.target.id, node.annotation)
                    if entry is not None:
                        names = entry.pop("names")
                        flags.update({name: entry for name in names})
    return flags


def sglang_algorithms(site: Path) -> set[str]:
    """SpeculativeAlgorithm's members (srt/speculative/spec_info.py): what from_string accepts, upper-cased."""
    tree = _parse(site / "sglang" / "srt" / "speculative" / "spec_info.py")
    enum = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeAlgorithm")
    return {t.id for n in enum.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def sglang_methods(site: Path, model_file: str, class_name: str) -> set[str]:
    """The methods a target model class defines itself (srt/models/<model_file>)."""
    tree = _parse(site / "sglang" / "srt" / "models" / model_file)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


# ------------------------------------------------------------------------------ vLLM


def _literal_alias(tree: ast.Module, name: str) -> list[str]:
    """The strings a module-level `Name = Literal[...]` admits, through the aliases it nests."""
    assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    node = assigned[name]
    items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    values: list[str] = []
    for item in items:
        values += [item.value] if isinstance(item, ast.Constant) else _literal_alias(tree, item.id)
    return values


VLLM_FILES = {
    "flags": ["vllm/engine/arg_utils.py", "vllm/entrypoints/common/cli_args.py"],
    "speculative_config": "vllm/config/speculative.py",
    "models": "vllm/model_executor/models",
    "modelopt": "vllm/model_executor/layers/quantization/modelopt.py",
}


def vllm_cli(root: Path) -> dict[str, Any]:
    """What `vllm serve` accepts and what its speculative config and loaders know, from a source tree."""
    flags: dict[str, dict[str, Any]] = {}
    for file in VLLM_FILES["flags"]:
        flags.update(_add_argument_flags(_parse(root / file)))
    spec = _parse(root / VLLM_FILES["speculative_config"])
    config = next(n for n in spec.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig")
    fields = sorted(n.target.id for n in config.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    eagle3 = sorted(cls.name for file in sorted((root / VLLM_FILES["models"]).glob("*.py")) for cls in _parse(file).body
                    if isinstance(cls, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "SupportsEagle3"
                                                             for b in cls.bases))
    modelopt = _parse(root / VLLM_FILES["modelopt"])
    linear = next(n.value for n in modelopt.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                  and n.target.id == "LINEAR_ALGOS")
    serve = _parse(root / VLLM_FILES["flags"][1])
    positionals = [n for node in ast.walk(serve) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "add_argument" for n in _strings(node.args)[:1] if not n.startswith("-")]
    return {"flags": flags, "positionals": positionals, "speculative_config_fields": fields,
            "speculative_methods": sorted(set(_literal_alias(spec, "SpeculativeMethod"))),
            "supports_eagle3": eagle3, "modelopt_quant_algos": sorted(_strings(linear.keys)) + ["MIXED_PRECISION"]}


def _version(root: Path) -> tuple[str, str | None]:
    """(version, commit) from vllm/_version.py, which a release's sdist carries (vcs-versioning writes it)."""
    values = {t.id: _literal(n.value) for n in _parse(root / "vllm" / "_version.py").body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    return values["__version__"], values.get("__commit_id__")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.engine_flags", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=["vllm"])
    parser.add_argument("root", type=Path, help="a vLLM checkout or unpacked sdist")
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", required=True, help="what ROOT is: the artifact and the commit or tag")
    args = parser.parse_args(argv)
    version, commit = _version(args.root)
    data = {"about": "vLLM's `vllm serve` command line and speculative config as one release has them, read with "
                     "tests/engine_flags.py (ast, nothing imported); the route tests check every generated command "
                     "against it", "version": version, "commit_id": commit, "source": args.source,
            "files": VLLM_FILES, **vllm_cli(args.root)}
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{args.out}: vLLM {version} ({len(data['flags'])} flags)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
