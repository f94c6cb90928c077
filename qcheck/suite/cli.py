"""``qcheck`` (or ``python -m qcheck``): the invariant matrix, golden cases, and the RNG table."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from qcheck.suite.progress import Progress

_MATRIX_HELP = """\
Every case (recipe x model x path, and Mixtral's dense layer with token
dropping) against every invariant that applies to it, then the dense == sparse
rows for the unquantized layer. Exits 1 if any cell fails.

Columns:
{columns}

A cell reads "pass [figure]", "-" (does not apply), "not supported [n]" or
"known defect [n]" (a library recipe declares that its library refuses the
case, or fails this check on it; the check is run and must still fail so), or
"FAIL [n]": note or failure n is printed in full below the table, with what to
run to fix it where there is one.
"""


def _matrix_help(width: int = 78) -> str:
    """The matrix's help: the columns are each invariant's ``doc``, wrapped beside its name."""
    import textwrap

    try:
        from qcheck.suite.invariants import INVARIANTS
    except ImportError as e:  # the invariants need the library, which says what this environment lacks
        return _MATRIX_HELP.format(columns=f"  ({e})")
    indent = 2 + max(len(inv.name) for inv in INVARIANTS) + 1
    columns = "\n".join(textwrap.fill(inv.doc, width, initial_indent=f"  {inv.name:<{indent - 3}} ",
                                      subsequent_indent=" " * indent, break_on_hyphens=False)
                        for inv in INVARIANTS)
    return _MATRIX_HELP.format(columns=columns)


class _Parser(argparse.ArgumentParser):
    """Renders the matrix's help when it is shown, not when the command line is parsed: it imports the library."""

    def format_help(self) -> str:
        if self.description is _MATRIX_HELP:
            self.description = _matrix_help()
        return super().format_help()


def _add_recipes_option(parser: argparse.ArgumentParser, default=None) -> None:
    parser.add_argument("--recipes", action="append", dest="recipe_modules", metavar="MODULE", default=default,
                        help="import this recipe module (a dotted name or a .py path) first, and run its recipes "
                        "(unless --recipe names others); repeatable")


def _jobs(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--jobs takes a positive integer or 'auto', got {text!r}")
    return int(text)


class _Version(argparse.Action):
    """``--version``: qcheck's version and the toolchain it runs on (versions, backend, XLA's division form)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print qcheck's version and the toolchain it runs on, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        import importlib.metadata

        from qcheck._versions import DISTRIBUTION
        from qcheck.suite._toolchain import describe

        try:
            version = importlib.metadata.version(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            version = "(not installed)"
        print(f"qcheck {version} on {describe()}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qcheck", description=_MATRIX_HELP,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version)
    _add_recipes_option(p)
    sub = p.add_subparsers(dest="command", metavar="{matrix,coverage,golden,rng}")
    m = sub.add_parser("matrix", help="run every invariant on every case (the default)", description=_MATRIX_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for parser in (p, m):
        parser.add_argument("--recipe", action="append", dest="recipes", metavar="NAME",
                            help="only this recipe (repeatable); default: the --recipes modules' recipes, else "
                            "every registered recipe")
        parser.add_argument("--model", action="append", dest="models", metavar="NAME",
                            help="only this model (repeatable): mixtral, gemma")
        parser.add_argument("--path", action="append", dest="paths", metavar="NAME",
                            help="only this path (repeatable): dense, sparse")
        parser.add_argument("--json", action="store_true", help="print JSON (every cell, failures in full)")
        parser.add_argument("--jobs", type=_jobs, default=argparse.SUPPRESS if parser is m else "auto",
                            metavar="N",
                            help="worker processes (default: auto, one per CPU on CPU-only JAX; 1: this process)")
        parser.add_argument("--golden-dir", metavar="DIR", default=argparse.SUPPRESS if parser is m else None,
                            help="your recipes' golden cases (default: $QCHECK_GOLDEN_DIR, else ./golden); "
                            "qcheck's own recipes' cases ship with qcheck")
    c = sub.add_parser("coverage", help="the quantization coverage map of each case's layer: every matmul, where it "
                       "is, how each operand reached it, and its own error")
    c.add_argument("--recipe", action="append", dest="recipes", metavar="NAME",
                   help="only this recipe (repeatable); default: the --recipes modules' recipes, else every one")
    c.add_argument("--model", action="append", dest="models", metavar="NAME", help="only this model (repeatable)")
    c.add_argument("--path", action="append", dest="paths", metavar="NAME", help="only this path (repeatable)")
    c.add_argument("--no-errors", action="store_true",
                   help="trace only: leave out each matmul's error (which compiles the layer once more)")
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
        ("add", "+", "write every golden case of new recipes, all or none (never overwrites)"),
        ("update", "*", "rewrite golden cases and say what changed (default: the --recipes modules' recipes, "
                        "else every recipe whose cases live here)"),
        ("check", "*", "check golden cases against this run (default: the --recipes modules' recipes, else "
                       "every registered recipe)"),
    ):
        x = gsub.add_parser(name, help=text, description=text)
        x.add_argument("names", nargs=nargs, metavar="RECIPE")
        x.add_argument("--golden-dir", metavar="DIR",
                       help="your recipes' golden cases (default: $QCHECK_GOLDEN_DIR, else ./golden)")
    for parser in (m, c, r, g, *gsub.choices.values()):
        _add_recipes_option(parser, default=argparse.SUPPRESS)  # does not clobber the top level's
    return p


class UsageError(Exception):
    """A mistake in how qcheck was called: reported in one line, exit status 2."""


def _import_modules(specs: list[str]) -> tuple[str, ...]:
    """Import each --recipes module; returns the recipe names they registered."""
    from qcheck.recipes import get_recipe, import_recipes, recipe_names

    names: list[str] = []
    for spec in specs:
        try:
            names += import_recipes(spec)
        except Exception as e:  # noqa: BLE001 - whatever a user's module raises is a usage error here
            if spec in recipe_names() and not spec.endswith(".py"):
                raise UsageError(f"--recipes takes a module (a dotted name or a .py path); {spec!r} is a recipe: "
                                 f"select it with --recipe {spec}") from None
            raise UsageError(f"--recipes {spec}: {_describe(e, spec)}") from None
    for name in names:
        get_recipe(name)
    return tuple(dict.fromkeys(names))


def _describe(e: BaseException, spec: str) -> str:
    """``Type: message`` and, when the error is in the user's file, where in it."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, SyntaxError) or str(e).startswith("recipe module"):
        return text if not isinstance(e, SyntaxError) else f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).name == Path(spec).name]
    return f"{text} ({frames[-1].filename}, line {frames[-1].lineno})" if frames else text


def _selected(args: argparse.Namespace, module_recipes: tuple[str, ...]) -> tuple[str, ...] | None:
    """The recipes a command runs: --recipe, else the --recipes modules' recipes, else all (None)."""
    if getattr(args, "recipes", None):
        return tuple(args.recipes)
    return module_recipes or None


def _golden(args: argparse.Namespace, module_recipes: tuple[str, ...]) -> int:
    from qcheck.recipes import recipe_names
    from qcheck.suite import golden
    from qcheck.suite._declared_cells import check_golden_case

    names = tuple(args.names) or module_recipes or None
    if args.golden_command == "check":
        user = golden.user_root(args.golden_dir, must_exist=True)
        found = golden.collect(user, names)
        failed = []
        progress = Progress(len(found.cases))
        for case, root in found.cases:
            progress.start(case.id)
            try:
                outcome = check_golden_case(case, root)
            except (AssertionError, ValueError) as e:
                failed.append(str(e))
                progress.close()
                print(f"FAIL {case.id}")
            else:
                progress.close()
                print(f"ok   {case.id}" if outcome == "match" else f"ok   {case.id}: {outcome.splitlines()[0]}")
            progress.advance(case.id)
        progress.close()
        _report_others(found)
        for text in failed:
            print(f"\n{text}", file=sys.stderr)
        return 1 if failed else 0
    user = golden.user_root(args.golden_dir)
    if names is None:  # update: every recipe whose cases can be written from here
        names = tuple(n for n in recipe_names() if golden.writable_here(n))
    for name in names:
        if not golden.writable_here(name):
            raise UsageError(
                f"{name} is one of qcheck's own recipes: its golden cases ship with qcheck "
                f"({golden.builtin_root()}) and are rewritten only from qcheck's own checkout")
    chosen = golden.golden_cases(names)
    try:
        with Progress(len(chosen)) as progress:
            lines = golden.write_cases(chosen, user, overwrite=args.golden_command == "update", progress=progress)
    except FileExistsError as e:
        print(f"qcheck: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        raise UsageError(f"cannot write golden cases: {e}") from None
    for line in lines:
        print(line)
    print(golden.summarize(lines))
    return 0


def _report_others(found) -> None:
    for path, recipe in found.unloaded:
        print(f"note: {path} is a case of recipe {recipe!r}, which this run did not load: not checked")
    for e in found.strays:
        print(f"note: {e}: not checked")


def _coverage(args: argparse.Namespace, module_recipes: tuple[str, ...]) -> int:
    from qcheck._coverage import coverage, format_coverage
    from qcheck.suite import cases as cases_mod

    as_tuple = lambda xs: tuple(xs) if xs else None  # noqa: E731
    for case in cases_mod.cases(_selected(args, module_recipes), models=as_tuple(args.models),
                                paths=as_tuple(args.paths)):
        records = coverage(cases_mod.layer(case), cases_mod.layer_input(case.variant.model),
                           errors=not args.no_errors)
        print(f"{case.id}: {sum(r.quantized for r in records)} of {len(records)} matmuls quantized")
        print("  " + format_coverage(records).replace("\n", "\n  ") + "\n")
    return 0


def _rng(args: argparse.Namespace, module_recipes: tuple[str, ...]) -> int:
    import json

    from qcheck._choices import require_choice
    from qcheck.layers.moe import MODELS
    from qcheck.recipes import ApplyRngs, get_recipe
    from qcheck.suite.invariants import rng_entry_params

    if any(n < 1 for n in args.layers):
        raise UsageError(f"--layers must be positive integers, got {args.layers}")
    require_choice("model", args.model, tuple(MODELS))
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


def _matrix(args: argparse.Namespace, module_recipes: tuple[str, ...]) -> int:
    from qcheck.suite import golden, invariants, matrix
    from qcheck.suite.cases import cases

    env = invariants.RunEnv(golden.user_root(args.golden_dir, must_exist=True))
    as_tuple = lambda xs: tuple(xs) if xs else None  # noqa: E731
    recipes = _selected(args, module_recipes)
    selected = cases(recipes, models=as_tuple(args.models), paths=as_tuple(args.paths))
    with_paths = (recipes is None or "none" in recipes) and args.paths is None and not args.json
    jobs = matrix.default_jobs() if args.jobs == "auto" else args.jobs
    tasks = len(selected) + (4 if with_paths else 0)
    with matrix.worker_pool(min(jobs, tasks), tuple(args.recipe_modules or ())) as pool:
        with Progress(len(selected), enabled=not args.json) as progress:
            rows = matrix.run_matrix(recipes, models=as_tuple(args.models), paths=as_tuple(args.paths),
                                     executor=pool, env=env, progress=progress)
        print(matrix.to_json(rows) if args.json else matrix.format_table(rows), flush=True)
        failed = [r.case.id for r in rows if not r.ok]
        if with_paths:
            failed += paths_agree_failures(as_tuple(args.models), executor=pool)
    if failed:
        print(f"\n{len(failed)} cases failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    if not args.json:
        declared = [c.status for r in rows for c in r.cells.values() if c.status in ("unsupported", "known")]
        refused, known = declared.count("unsupported"), declared.count("known")
        as_declared = (f" ({refused} cell{'s' * (refused != 1)} not supported and {known} known "
                       f"defect{'s' * (known != 1)}, as their recipes declare)") if declared else ""
        print(f"\nall {len(rows)} cases pass{as_declared}")
    return 0


def paths_agree_failures(models: tuple[str, ...] | None, executor=None) -> list[str]:
    """Print the dense == sparse rows for ``none``; returns the labels that failed."""
    from qcheck.layers.moe import MODELS
    from qcheck.suite.matrix import run_paths_agree

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
    from qcheck.suite import _process

    args = _parser().parse_args(argv)
    _process.setup(own=True)  # before the recipe modules or anything else starts JAX
    commands = {"rng": _rng, "golden": _golden, "coverage": _coverage}
    try:
        module_recipes = _import_modules(args.recipe_modules or [])
        return commands.get(args.command, _matrix)(args, module_recipes)
    except (UsageError, ValueError, ImportError) as e:  # bad names list the valid ones; bad files are named
        print(f"qcheck: error: {e}", file=sys.stderr)
        return 2
