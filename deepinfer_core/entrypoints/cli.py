"""The ``deepinfer`` command: argparse subcommands, each implemented in a module imported on demand.

To add a subcommand, write a module with an ``add_arguments(parser)``-style function and a
``run(args) -> int``-style function, and add one line to :data:`SUBCOMMANDS`::

    "generate": Subcommand(
        "generate text from a prompt",
        run="deepinfer_core.entrypoints.cli_generate:run_generate",
        add_arguments="deepinfer_core.entrypoints.cli_generate:add_generate_arguments",
    ),

Only the module of the subcommand being run is imported (``deepinfer --help`` imports none), so a
subcommand that needs torch or a backend does not slow down or break the others.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Subcommand:
    """A ``deepinfer <name>`` subcommand; ``run``/``add_arguments`` are ``"module:function"`` paths."""

    help: str
    run: str
    add_arguments: str | None = None


SUBCOMMANDS: dict[str, Subcommand] = {
    "backends": Subcommand(
        "list installed backends, whether each can run here and why not, and the libraries each found",
        run="deepinfer_core.entrypoints.cli_plugins:run_backends",
        add_arguments="deepinfer_core.entrypoints.cli_plugins:add_backends_arguments",
    ),
    "ops": Subcommand(
        "show which plugin serves each catalogued op on a backend, and what it shadows",
        run="deepinfer_core.entrypoints.cli_plugins:run_ops",
        add_arguments="deepinfer_core.entrypoints.cli_plugins:add_ops_arguments",
    ),
    "generate": Subcommand(
        "generate text for prompts with the offline engine",
        run="deepinfer_core.entrypoints.cli_generate:run_generate",
        add_arguments="deepinfer_core.entrypoints.cli_generate:add_generate_arguments",
    ),
    "bench": Subcommand(
        "measure prefill/decode throughput of the engine against transformers",
        run="deepinfer_core.entrypoints.cli_bench:run_bench",
        add_arguments="deepinfer_core.entrypoints.cli_bench:add_bench_arguments",
    ),
    "plan": Subcommand(
        "predict each rank's weight and KV memory for a parallel layout, before loading anything",
        run="deepinfer_core.entrypoints.cli_plan:run_plan",
        add_arguments="deepinfer_core.entrypoints.cli_plan:add_plan_arguments",
    ),
    "serve": Subcommand(
        "serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)",
        run="deepinfer_core.entrypoints.openai.api_server:run_serve",
        add_arguments="deepinfer_core.entrypoints.openai.api_server:add_serve_arguments",
    ),
}


def _resolve(path: str) -> Callable[..., Any]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _version() -> str:
    from deepinfer_core import __version__

    return __version__


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``selected``'s module is imported to add that subcommand's options."""
    parser = argparse.ArgumentParser(
        prog="deepinfer", description="deepinfer: inference engine for the DeepSeek-V4 model family"
    )
    parser.add_argument("--version", action="version", version=f"deepinfer {_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        sub_parser.set_defaults(_run=command.run)
        if name == selected and command.add_arguments:
            _resolve(command.add_arguments)(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((arg for arg in argv if arg in SUBCOMMANDS), None)
    parser = build_parser(selected)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(_resolve(args._run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
