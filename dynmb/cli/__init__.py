"""The ``dynmb`` command (``pyproject.toml``: ``dynmb = "dynmb.cli:main"``). Thin: each verb's
module parses its flags, calls the library and prints; see ``dynmb.cli.main``.

Verbs (``dynmb VERB --help`` for each): datasets, lengths, plan, schedule, simulate,
memory, profile, fit, run, compare.
"""

from dynmb.cli.main import VERBS, build_parser, main

__all__ = ["main", "build_parser", "VERBS"]
