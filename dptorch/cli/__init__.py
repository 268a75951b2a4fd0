"""The ``dptorch`` command (:mod:`.commands`) and the examples it runs (:mod:`.examples`)."""

from dptorch.cli.commands import COMMANDS, CommandError, build_parser, main

__all__ = ["COMMANDS", "CommandError", "build_parser", "main"]
