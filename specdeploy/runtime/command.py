"""`specdeploy generate`: generate in-process with the speculative-decoding runtime."""

from __future__ import annotations

import argparse
import json
import sys

from specdeploy.device import add_device_arg, announce, resolve_device
from specdeploy.runtime.types import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    parser.add_argument("--deployment", help="a deployment.json from the package stage (overrides --model/--spec)")
    parser.add_argument("--model", default="smollm2-135m", help="HF folder, .gguf file or bundled name")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--spec", default="ngram", choices=["none", "draft", "ngram", "medusa", "eagle", "dflash"])
    parser.add_argument("--draft", help="draft model for --spec draft (folder, .gguf or bundled name)")
    parser.add_argument("--spec-path", help="trained Medusa/EAGLE module folder for --spec medusa|eagle")
    parser.add_argument("--choices", help="Medusa/EAGLE choices tree, e.g. '[[0], [0, 0], [1]]'")
    parser.add_argument("--draft-len", type=int, help="most draft tokens per round (chains adapt up to it)")
    parser.add_argument("--draft-shape", choices=["fixed", "auto"], default="fixed",
                        help="auto: calibrate on held-out prompts and draft the chain length / tree size that "
                             "maximizes expected tokens/s on this machine (see runtime/planner.py)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--no-stream", action="store_true", help="print the text once, at the end")
    parser.add_argument("--metrics-json", action="store_true", help="print the request's metrics as JSON on stderr")
    # default None: a --deployment runs where its deployment.json says, a --model on `auto`
    add_device_arg(parser, default=None)


def _decoder(args: argparse.Namespace):
    from specdeploy.resolve import resolve_model_dir
    from specdeploy.runtime.deployment import Decoder, load_decoder, load_model, make_proposer

    if args.deployment:
        decoder = load_decoder(args.deployment, device=args.device)
        decoder.chat_template = decoder.chat_template or args.chat
        return decoder
    target, tokenizer = load_model(resolve_model_dir(args.model), args.dtype, resolve_device(args.device or "auto"))
    spec = {
        "kind": args.spec,
        "draft_model_dir": str(resolve_model_dir(args.draft)) if args.draft else None,
        "path": args.spec_path,
        "choices": args.choices,
    }
    proposer = make_proposer(spec, target, tokenizer)
    return Decoder(target, tokenizer, proposer, draft_len=args.draft_len, chat_template=args.chat)


def _plan_shape(decoder, max_len: int | None) -> None:
    """--draft-shape auto: the planner's shape for this machine (or plain decoding)."""
    from specdeploy.runtime.decoding import DEFAULT_DRAFT_LEN
    from specdeploy.runtime.planner import calibration_prompts, choose_draft_shape, describe

    prompts = calibration_prompts(decoder.tokenizer)
    plan = choose_draft_shape(decoder.target, decoder.proposer, prompts, max_len=max_len or DEFAULT_DRAFT_LEN)
    print(f"specdeploy generate: {describe(plan)}", file=sys.stderr)
    decoder.proposer = decoder.proposer if plan.shape is not None else None
    decoder.draft_len = plan.shape.size if plan.shape is not None else None
    decoder.adaptive = False  # the plan is the schedule: every round drafts its shape


def main(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_strings=tuple(args.stop),
    )
    params.validate()  # fail before loading models
    decoder = _decoder(args)
    announce("generate", decoder.device)
    if args.draft_shape == "auto" and decoder.proposer is not None:
        _plan_shape(decoder, args.draft_len)

    def show(piece: str) -> None:
        print(piece, end="", flush=True)

    text, result = decoder.generate(prompt, params, None if args.no_stream else show)
    print(text if args.no_stream else "")
    metrics = result.metrics
    if args.metrics_json:
        print(json.dumps({"finish_reason": result.finish_reason, **metrics.as_dict()}), file=sys.stderr)
    else:
        print(
            f"[{metrics.new_tokens} tokens, {metrics.tokens_per_s:.1f} tok/s, "
            f"{metrics.acceptance_length:.2f} tokens/forward, finish: {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0
