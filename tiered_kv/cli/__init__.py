"""The ``tiered-kv`` command line (console script ``tiered_kv.cli:main``).

Exit codes: 0 success; 1 the command ran and found a problem (verify found bad entries, show's
key is missing or corrupt, copy skipped blocks, the demo's outputs differ); 2 bad usage or
configuration (a missing path, a file that is not a store, a bad URL: one line on stderr, no
traceback); 3 the store or metrics endpoint cannot be reached right now; 130 interrupted;
141 stdout was closed early (``| head``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tiered_kv.cli import demo_command, maintenance_commands, store_commands
from tiered_kv.cli.render import EXIT_PROBLEM, error_exit
from tiered_kv.errors import TieredKVError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-kv", description="KV-cache tiers for LLM engines")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_command.add_parser(sub)
    store_commands.add_parsers(sub)
    maintenance_commands.add_parsers(sub)
    return parser


def _fail(message: str, code: int) -> int:
    print(f"tiered-kv: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # warnings of the media (a Redis that is down, a corrupt block) are part of the reports;
    # on stderr they would only repeat them. -v shows them and the progress logs.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except BrokenPipeError:  # stdout closed early (| head): no message, like a SIGPIPE death
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except LookupError as exc:  # e.g. show: no such key
        return _fail(str(exc.args[0] if exc.args else exc), EXIT_PROBLEM)
    except (TieredKVError, OSError) as exc:
        return _fail(*error_exit(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
