"""``python -m qcheck``: the invariant matrix (default); more subcommands as they land."""

from __future__ import annotations

import argparse
import os
import sys


def _add_recipes_option(parser: argparse.ArgumentParser, default=None) -> None:
    parser.add_argument("--recipes", action="append", dest="recipe_modules", metavar="MODULE", default=default,
                        help="import this recipe module (a dotted name or a .py path) first; repeatable")


def _jobs(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--jobs takes a positive integer or 'auto', got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qcheck", description=__doc__)
    _add_recipes_option(p)
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
        parser.add_argument("--jobs", type=_jobs, default=argparse.SUPPRESS if parser is m else "auto",
                            metavar="N",
                            help="worker processes (default: auto, one per CPU on CPU-only JAX; 1: this process)")
        parser.add_argument("--golden-dir", metavar="DIR", default=argparse.SUPPRESS if parser is m else None,
                            help="golden directory for the golden column (default: $QCHECK_GOLDEN_DIR, else ./golden)")
    r = sub.add_parser("rng", help="entry parameters of an unrolled decoder's train step, per depth")
    r.add_argument("--model", required=True, help="mixtral or gemma")
    r.add_argument("--recipe", required=True, help="a registered recipe")
    r.add_argument("--layers", type=int, nargs="+", default=[1, 2, 8], metavar="N",
                   help="layer counts to compile (default: 1 2 8)")
    r.add_argument("--apply-rngs", choices=("none", "shared", "private"),
                   help="override the recipe's RNG mode (private: the control)")
    r.add_argument("--json", action="store_true",
                   help='print {"1": {"total": n, "u32": m}, ...} instead of a table')
    g = sub.add_parser("golden", help="write, rewrite or check golden cases")
    gsub = g.add_subparsers(dest="golden_command", required=True, metavar="{add,update,check}")
    for name, nargs, text in (
        ("add", "+", "write the golden cases of new recipes (refuses to overwrite)"),
        ("update", "*", "rewrite golden cases (default: every registered recipe) and say what changed"),
        ("check", "*", "check golden cases against this run (default: every case in the directory)"),
    ):
        x = gsub.add_parser(name, help=text, description=text)
        x.add_argument("names", nargs=nargs, metavar="RECIPE")
        x.add_argument("--golden-dir", metavar="DIR",
                       help="golden directory (default: $QCHECK_GOLDEN_DIR, else ./golden)")
    for parser in (m, r, g, *gsub.choices.values()):
        _add_recipes_option(parser, default=argparse.SUPPRESS)  # does not clobber the top level's
    return p


def _golden(args: argparse.Namespace) -> int:
    from qcheck import golden

    root = golden.golden_dir(args.golden_dir, default="golden")
    if args.golden_command == "check":
        golden.golden_cases(tuple(args.names) or None)  # unknown names fail here, listing the valid ones
        found, strays = golden.collect(root)
        chosen = [c for c in found if not args.names or c.recipe in args.names]
        failed = [str(e) for e in strays if not args.names]
        for case in chosen:
            try:
                golden.check_case(case, root)
            except (AssertionError, ValueError) as e:
                failed.append(str(e))
                print(f"FAIL {case.id}")
            else:
                print(f"ok   {case.id}")
        for text in failed:
            print(f"\n{text}", file=sys.stderr)
        return 1 if failed else 0
    cases = golden.golden_cases(tuple(args.names) if args.names else None)
    if args.golden_command == "add":
        if taken := [str(c.file(root)) for c in cases if c.file(root).exists()]:
            print(f"qcheck: error: golden files exist, nothing written: {', '.join(taken)}; rewrite "
                  f"them with `{golden.update_command(cases[0].recipe, root)}`", file=sys.stderr)
            return 1
    lines = [golden.write_case(c, root, overwrite=args.golden_command == "update") for c in cases]
    for line in lines:
        print(line)
    print(golden.summarize(lines))
    return 0


def _rng(args: argparse.Namespace) -> int:
    import json

    from qcheck.invariants import rng_entry_params
    from qcheck._choices import check_choice
    from qcheck.moe import MODELS
    from qcheck.recipes import ApplyRngs, get_recipe

    if any(n < 1 for n in args.layers):
        raise ValueError(f"--layers must be positive integers, got {args.layers}")
    check_choice("model", args.model, tuple(MODELS))
    get_recipe(args.recipe)
    mode = None if args.apply_rngs is None else ApplyRngs(args.apply_rngs)
    counts = rng_entry_params(args.model, args.recipe, depths=tuple(args.layers), apply_rngs=mode)
    table = {str(n): {"total": c["total"], "u32": c.get("u32", 0)} for n, c in counts.items()}
    if args.json:
        print(json.dumps(table))
        return 0
    said = args.apply_rngs or "the recipe's own"
    print(f"{args.recipe} on {args.model}, RNG mode: {said}; entry parameters of the train step")
    print(f"{'layers':>6}  {'total':>6}  {'u32':>5}")
    for n, c in table.items():
        print(f"{n:>6}  {c['total']:>6}  {c['u32']:>5}")
    return 0


def _matrix(args: argparse.Namespace) -> int:
    import os

    from qcheck import golden, matrix
    from qcheck.cases import cases

    if getattr(args, "golden_dir", None):
        os.environ[golden.ENV] = args.golden_dir  # the golden column reads it; this process only

    as_tuple = lambda xs: tuple(xs) if xs else None  # noqa: E731
    selected = cases(as_tuple(args.recipes), models=as_tuple(args.models), paths=as_tuple(args.paths))
    with_paths = args.recipes is None and args.paths is None and not args.json
    jobs = matrix.default_jobs() if args.jobs == "auto" else args.jobs
    tasks = len(selected) + (4 if with_paths else 0)
    with matrix.worker_pool(min(jobs, tasks), tuple(args.recipe_modules or ())) as pool:
        rows = matrix.run_matrix(as_tuple(args.recipes), models=as_tuple(args.models), paths=as_tuple(args.paths),
                                 executor=pool)
        print(matrix.to_json(rows) if args.json else matrix.format_table(rows), flush=True)
        failed = [r.case.id for r in rows if not r.ok]
        if with_paths:
            failed += _paths_agree(as_tuple(args.models), executor=pool)
    if failed:
        print(f"\n{len(failed)} checks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"\nall {len(rows)} cases pass")
    return 0


def _paths_agree(models: tuple[str, ...] | None, executor=None) -> list[str]:
    """Print the dense == sparse rows for ``none``; returns the labels that failed."""
    from qcheck.matrix import run_paths_agree
    from qcheck.moe import MODELS

    print()
    failed = []
    for row in run_paths_agree(models or tuple(MODELS), executor=executor):
        if row.cell.status == "fail":
            failed.append(row.label)
            print(f"dense == sparse  {row.label:<18} FAIL {row.cell.detail.removeprefix('AssertionError: ')}")
        else:
            print(f"dense == sparse  {row.label:<18} pass (max |diff| {row.cell.figure:.2g})")
    return failed


def main(argv: list[str] | None = None) -> int:
    from qcheck import _xla_env

    _xla_env.configure()  # before JAX starts a backend; see qcheck/_xla_env.py
    args = _parser().parse_args(argv)
    if cache := os.environ.get(_xla_env.PERSISTENT_CACHE_ENV):
        _xla_env.use_compilation_cache(cache)
    _xla_env.default_to_cpu()  # the invariants are CPU numerics, on any host
    from qcheck import _fast_jit

    _fast_jit.install()  # after default_to_cpu: it asks the default device's platform
    commands = {"rng": _rng, "golden": _golden}
    try:
        from qcheck.recipes import import_recipes

        for spec in args.recipe_modules or ():
            import_recipes(spec)
        return commands.get(args.command, _matrix)(args)
    except (ValueError, ImportError) as e:  # bad names list the valid ones; bad files are named
        print(f"qcheck: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
