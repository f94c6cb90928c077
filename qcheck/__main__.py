"""``python -m qcheck``: the invariant matrix (default); more subcommands as they land."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qcheck", description=__doc__)
    sub = p.add_subparsers(dest="command")
    m = sub.add_parser("matrix", help="run every invariant on every case (the default)")
    for parser in (p, m):
        parser.add_argument("--recipe", action="append", dest="recipes", metavar="NAME",
                            help="only this recipe (repeatable); default: every registered recipe")
        parser.add_argument("--model", action="append", dest="models", metavar="NAME",
                            help="only this model (repeatable): mixtral, gemma")
        parser.add_argument("--path", action="append", dest="paths", metavar="NAME",
                            help="only this path (repeatable): dense, sparse")
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _matrix(args: argparse.Namespace) -> int:
    from qcheck import matrix

    as_tuple = lambda xs: tuple(xs) if xs else None  # noqa: E731
    rows = matrix.run_matrix(as_tuple(args.recipes), models=as_tuple(args.models), paths=as_tuple(args.paths))
    print(matrix.to_json(rows) if args.json else matrix.format_table(rows))
    failed = [r.case.id for r in rows if not r.ok]
    if failed:
        print(f"\n{len(failed)} of {len(rows)} cases failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"\nall {len(rows)} cases pass")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _matrix(args)
    except ValueError as e:  # bad names: the message lists the valid ones
        print(f"qcheck: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
