"""`specdeploy verify`: its options, and main(), which runs verify, prints the figures and the
headlines, and exits 1 when exactness, served parity, --ar-lower-bound or an imported module's
acceptance floor (modules.stage.served_gate) fails."""

from __future__ import annotations

import argparse

from specdeploy.device import add_device_arg
from specdeploy.manifest import add_build_args, build_from_args
from specdeploy.modules.stage import served_gate
from specdeploy.parity import NEAR_TIE, NEAR_TIE_CAP
from specdeploy.verify.cpu_server import OUT, verify
from specdeploy.verify.summary import _flat, headlines
from specdeploy.verify.trtllm_server import GPU_OUT, GPU_SERVED, TRTLLM_PHASES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_args(parser)
    add_device_arg(parser)  # where the Hugging Face reference computes
    parser.add_argument("--url", help="use a running server (gRPC host:port) instead of starting one")
    parser.add_argument("--server", choices=["cpu", "trtllm"], default="cpu",
                        help="cpu (default): the CPU repository (exact parity where the dtype allows); trtllm: a TensorRT-LLM "
                             "deployment at --url (reference in float32 on --device, near-tie rule)")
    parser.add_argument("--route", choices=["engine", "llmapi"],
                        help="--server trtllm: the GPU route served (default: the one gpu_routes.json recommends)")
    parser.add_argument("--phase", choices=TRTLLM_PHASES, default="all",
                        help="--server trtllm: served (ask the server, write its answers to --served-file; loads no "
                             "model), reference (judge that file; needs no server: run it after the server stopped, so "
                             "the reference does not compete with TensorRT-LLM's KV cache for the GPU), all (default: "
                             "both in one go, the server still up)")
    parser.add_argument("--served-file",
                        help=f"--server trtllm: the served phase's answers (default <build>/{GPU_SERVED}); the reference "
                             "phase takes prompts, max tokens and route from it")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per category (chat, code); default 4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--near-tie", type=float,
                        help="where parity cannot be exact (bf16; fp32 with quantized activations; any TensorRT-LLM server): "
                             "a divergence passes when the reference's top-2 logit margin there is <= this. Default: on the "
                             "CPU deployment, measured (the p99 of how far the served model's own rounding moves a margin "
                             f"between one forward and a verify round's shape, within [{NEAR_TIE:g}, {NEAR_TIE_CAP:g}]); "
                             f"{NEAR_TIE:g} for TensorRT-LLM")
    parser.add_argument("--no-baseline", action="store_true", help="skip the autoregressive twin (no speed-up figure)")
    parser.add_argument("--ar-lower-bound", type=float, help="fail when the acceptance length is below this")


def main(args: argparse.Namespace) -> int:
    build = build_from_args(args)
    summary = verify(build, per_category=args.prompts, max_new_tokens=args.max_new_tokens, url=args.url,
                     near_tie=args.near_tie, baseline=not args.no_baseline, device=args.device, server=args.server,
                     route=args.route, phase=args.phase, served_file=args.served_file)
    if args.server == "trtllm" and args.phase == "served":
        print(f"{len(summary['prompts'])} served answers of {summary['server']}: "
              f"{args.served_file or build.root / GPU_SERVED}; judge them with --phase reference")
        return 0
    for key, value in _flat(summary).items():
        print(f"{key:>28}: {value:.3f}" if isinstance(value, float) else f"{key:>28}: {value}")
    print("\n".join(headlines(summary)))
    if summary.get("seconds"):
        print("time (s): " + ", ".join(f"{name.replace('_', ' ')} {value:.0f}" for name, value in summary["seconds"].items()))
    for d in summary["divergences"]:
        replayed = ", reproduced in-process: rounding" if d.get("reproduced_in_process") else ""
        print(f"  divergence at token {d['token']} (margin {d['margin']}{replayed}): {d['prompt']!r}")
    out = build.path(GPU_OUT if args.server == "trtllm" else OUT)
    print(f"reports: {out}/verify.json, verify.md, acceptance_length.png" + (", speedup.png" if summary["speedup"] else ""))
    if summary["parity_rule"] != "exact" and args.server == "cpu":
        print(f"note: served {summary['dtype']} cannot be exact, so its divergences are judged by the near-tie rule; "
              "report a. is the exact check (float64, in-process, the same deployment)")
    failed = not summary["parity_ok"]
    if summary.get("exactness") and not summary["exactness"]["ok"]:
        print("FAIL: speculative decoding changed the greedy output in float64 (report a.): a bug in speculation")
        failed = True
    accepted = summary["acceptance_length"]
    if args.ar_lower_bound is not None and (accepted is None or accepted < args.ar_lower_bound):
        print("FAIL: --ar-lower-bound cannot be checked: the server reported no draft counts" if accepted is None
              else f"FAIL: acceptance length {accepted:.2f} < --ar-lower-bound {args.ar_lower_bound}")
        failed = True
    mis_loaded = served_gate(build.path("spec"), summary.get("acceptance_length_chat"))
    if mis_loaded:
        print(f"FAIL: {mis_loaded}")
        failed = True
    if not summary["parity_ok"]:
        print("FAIL: served output differs from the Hugging Face reference (see divergences above)")
    return 1 if failed else 0
