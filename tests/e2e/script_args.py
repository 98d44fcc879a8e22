"""Command-line parsing shared by the e2e learning tests run as scripts (`python tests/e2e/test_X.py ...`)."""

from __future__ import annotations


def split_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`--flag value` pairs for every run, the other tokens: seeds, `off`), in their order."""
    flags, tokens = [], []
    while argv:
        if argv[0].startswith("--"):
            flags, argv = [*flags, *argv[:2]], argv[2:]
        else:
            tokens, argv = [*tokens, argv[0]], argv[1:]
    return flags, tokens
