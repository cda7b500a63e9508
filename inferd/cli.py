"""`inferd generate | serve | bench`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from inferd.errors import InferdError

# subcommands that live with their own package register themselves here: module with register(subparsers)
_PLUGIN_COMMANDS = [
    "inferd.server.cli",
    "inferd.bench.cli",
    "inferd.gateway.cli",
    "inferd.runtime.cli",
    "inferd.autoscale.cli",
    "inferd.deploy.cli",
    "inferd.disagg.cli",
    "inferd.labs.cli",
    "inferd.doctor",
]


def _add_generate(sub) -> None:
    from inferd.config import add_engine_args

    p = sub.add_parser("generate", help="complete prompts offline and print the text")
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from inferd import SamplingParams
    from inferd.config import engine_config_from_args
    from inferd.engine.engine import LLM

    llm = LLM(engine_config_from_args(args))
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=args.stop,
        seed=args.sampling_seed,
    )
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outs, strict=True):
        for c in out.outputs:
            print(f"--- {prompt!r} [{c.index}] finish={c.finish_reason}")
            print(prompt + c.text if not args.chat else c.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description="LLM inference serving: engine, server, benchmark")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for name in _PLUGIN_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def flag_help(command: str) -> dict[str, str | None]:
    """Every flag of `inferd <command>` and its --help text, for what explains a command line (the KServe lab's
    field table): the flags' descriptions live with the flags. (argparse lists a parser's actions only in its
    `_actions`.)"""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    out: dict[str, str | None] = {}
    for action in commands.choices[command]._actions:
        text = action.help % vars(action) if action.help and "%(" in action.help else action.help
        out.update(dict.fromkeys(action.option_strings, text))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except InferdError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
