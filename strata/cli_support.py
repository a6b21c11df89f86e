"""The command line's edge: what the command modules (strata/cli.py, master/main.py, worker/main.py,
deploy/*.py) share to turn their argparse options into typed settings before a role gets them.

The roles and the core never see an argparse Namespace: a command loads its ``--config`` here
(:func:`config_of`: a bad one ends the command with its one line, exit 1) and checks
``--chunk-seconds`` against :data:`strata.config.CHUNK_SECONDS` (:func:`add_chunk_seconds`,
:func:`chunk_instants_of`), then passes plain values on.
"""

from __future__ import annotations

import argparse

from .config import CHUNK_SECONDS, Config, ConfigError, chunk_instants, load_config
from .errors import EXIT_REJECTED, CliError

__all__ = ["config_of", "level_of", "chunk_seconds_arg", "add_chunk_seconds", "chunk_instants_of"]


def config_of(args) -> Config:
    """The configuration named by a command's ``--config``; a bad one ends the command with its
    one-line reason (exit 1)."""
    try:
        return load_config(args.config)
    except ConfigError as e:
        raise CliError(str(e)) from None


def level_of(config: Config, text: str, flag: str = "--level") -> str:
    """The canonical level ``text`` names in ``config``'s lattice; an unknown one ends the command
    with one line (exit 2)."""
    try:
        return config.lattice.parse(text)
    except ValueError as e:
        raise CliError(f"{flag}: {e}", EXIT_REJECTED) from None


def chunk_seconds_arg(text: str) -> float:
    """``--chunk-seconds``'s argparse ``type``: a positive number of seconds (whether it is a whole
    number of instants is checked with the configuration, :func:`chunk_instants_of`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: {CHUNK_SECONDS.check.rule}") from None
    try:
        return CHUNK_SECONDS.check.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None


def add_chunk_seconds(parser: argparse.ArgumentParser) -> None:
    """The ``--chunk-seconds`` option, from its one declaration (:data:`strata.config.CHUNK_SECONDS`)."""
    parser.add_argument(f"--{CHUNK_SECONDS.name.replace('_', '-')}", type=chunk_seconds_arg,
                        default=CHUNK_SECONDS.default, metavar="SECONDS", help=CHUNK_SECONDS.doc)


def chunk_instants_of(config: Config, chunk_seconds: float | None) -> int:
    """The instants of a chunk of ``--chunk-seconds`` under ``config``'s instant length; a length
    that is not a positive whole multiple of it ends the command with one line (exit 2)."""
    try:
        return chunk_instants(chunk_seconds, config.instant_seconds)
    except ValueError as e:
        raise CliError(f"--chunk-seconds {chunk_seconds:g}: {e}", EXIT_REJECTED) from None
