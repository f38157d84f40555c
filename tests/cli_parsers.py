"""The options each command's parser declares (kube_vgpu_cli.PARSERS), for the docs checks."""

from __future__ import annotations

import argparse
import importlib

from kube_vgpu_cli import PARSERS, SUBCOMMANDS


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its subcommands' parsers."""
    out: set[str] = set()
    for a in parser._actions:
        out.update(a.option_strings)
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= options(sub)
    return out


def command_options(command: str) -> set[str]:
    """The options of ``command`` (a key of PARSERS, or ``kube-vgpu <alias>`` of a SUBCOMMANDS
    alias such as ``simulate``, which runs the same entry point as the command it stands for)."""
    if command not in PARSERS:
        name = command.removeprefix("kube-vgpu ")
        target = SUBCOMMANDS[name][0]
        command = next(c for c in PARSERS if c.startswith("kube-vgpu ")
                       and SUBCOMMANDS.get(c.removeprefix("kube-vgpu "), ("",))[0] == target)
    module, factory = PARSERS[command]
    return options(getattr(importlib.import_module(module), factory)())
