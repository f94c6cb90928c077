"""check_layer's first call against the compile floor a user knows (a benchmark, never a test).

    python bench/check_layer_floor.py                                    # every cell, 3 rounds
    python bench/check_layer_floor.py --ref 048c55d --rounds 3           # and the old code beside the new
    python bench/check_layer_floor.py --cells maxtext/int8/dense,mixtral/fp8/dense --json bench/floor.local.json
    python bench/check_layer_floor.py --sizes 128,512,1024 --ref 8deeb9f --rounds 2   # the layer grown
    python bench/check_layer_floor.py --sizes 1024 --rounds 1 --phases                # where its time goes

The floor: the first call of ``nnx.jit(nnx.value_and_grad(loss))`` on the
layer plus the same on its unquantized twin (``loss``: the mean square of the
compared output), each in a fresh process. ``check_layer``'s first call on the
same pair, in a fresh process of its own, is held to it as a ratio. Nothing
else is timed: imports and building the cells happen before the clock starts.

Each round runs every cell's sides (floor, the working tree's check_layer and,
with ``--ref``, REF's in a temporary git worktree) one after the other, each in
a fresh process, the order rotated from round to round; a round's ratio is
check / floor of that round. This machine's speed drifts by a third within an
hour, so the ratios are the result and the seconds stand beside them.

Cold on both sides: no persistent compilation cache (``CI=true``,
``JAX_ENABLE_COMPILATION_CACHE=false``, ``QCHECK_XLA_CACHE`` and
``JAX_COMPILATION_CACHE_DIR`` unset), JAX's defaults otherwise. XLA compilations
and jaxpr traces are counted by bench/compile_counter.py (installed as
``sitecustomize.py`` on PYTHONPATH, as bench/compare.py does), not by the code
under test: those inside the timed call, and the whole process's.

Cells: qcheck's own layers, ``MODEL/RECIPE/PATH`` (``qcheck.build_moe`` and its
``none`` twin with copied weights, ``skip=`` qcheck's full-precision router and
combine), and MaxText 0.2.5's ``RoutedMoE``, ``maxtext/QUANTIZATION/PATH``
(tests/maxtext_cells.py, ``output=0``, the combine spared, ``declared=True``),
run in MaxText's environment (``--maxtext-python``, through .ci/maxtext.sh).

Sizes: ``--sizes`` grows one of qcheck's cells (``--model``, the fp8 Mixtral
layer by default) to each embedding width, as a real layer is shaped (mlp =
2 x emb, tokens = emb: x of shape (2, emb / 2, emb)), the cells
``MODEL/RECIPE/PATH@EMB``. Each process reports its peak resident memory
(``ru_maxrss``: the floor's includes jax and the layer, as the check's does),
and a check's verdict (a failed check is timed as one). ``--phases`` wraps
check_layer's phases with timers (cProfile would clash with the walk's own
``sys.setprofile``), each waited for, and records each one's time and the
peak memory at its end: the table of docs/performance.md.

Stdlib only: this process imports neither qcheck nor jax; the children do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_CELLS = ("mixtral/fp8/dense", "gemma/int8/sparse", "maxtext/int8/dense", "maxtext/fp8/dense")
COMPILE_DIR_ENV = "QCHECK_BENCH_COMPILE_DIR"
_DROPPED_ENV = ("QCHECK_XLA_CACHE", "QCHECK_RUN_XLA_CACHE", "JAX_COMPILATION_CACHE_DIR", "PYTHONHOME",
                "VIRTUAL_ENV", "PYTEST_ADDOPTS")
_RESULT = "CHECK_LAYER_FLOOR_RESULT "
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_JAXPR_TRACE = "/jax/core/compile/jaxpr_trace_duration"


# -------------------------------------------------------------- the child


def _cell(name: str):
    """(layer, twin, x, loss of the output, check_layer's keyword arguments) for a cell name."""
    import jax.numpy as jnp
    import numpy as np

    import qcheck

    name, _, emb = name.partition("@")
    source, recipe, path = name.split("/")
    if emb:
        return _sized_cell(source, recipe, path, int(emb))
    if source == "maxtext":
        from tests import maxtext_cells

        layer, twin = maxtext_cells.cell(recipe, path == "sparse")
        return (layer, twin, maxtext_cells.inputs(), lambda out: jnp.mean(jnp.square(out[0])),
                {"output": 0, "skip": qcheck.skip_modules("weight_sum"), "declared": True})
    from qcheck.layers.moe import UNQUANTIZED_BY_DESIGN

    layer = qcheck.build_moe(source, recipe, path=path)
    twin = qcheck.copy_params_into(layer, qcheck.build_moe(source, "none", path=path))
    x = np.random.default_rng(0).normal(size=(2, 32, 32)).astype(np.float32)  # tests.helpers.CHECK_LAYER_X
    return (layer, twin, x, lambda out: jnp.mean(jnp.square(out)),
            {"skip": qcheck.skip_functions(*UNQUANTIZED_BY_DESIGN)})


def _sized_cell(model: str, recipe: str, path: str, emb: int):
    """qcheck's layer grown toward a real one: ``MODEL/RECIPE/PATH@EMB``, mlp = 2 x emb, tokens = emb."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import qcheck
    from qcheck.layers.moe import MODELS, UNQUANTIZED_BY_DESIGN, MoE
    from qcheck.recipes import get_recipe

    config = dataclasses.replace(MODELS[model], emb=emb, mlp=2 * emb)

    def build(r):
        return MoE(config, get_recipe(r), path=path, rngs=nnx.Rngs(0), seed=0)

    layer = build(recipe)
    twin = qcheck.copy_params_into(layer, build("none"))
    x = np.random.default_rng(0).normal(size=(2, emb // 2, emb)).astype(np.float32)
    return (layer, twin, x, lambda out: jnp.mean(jnp.square(out)),
            {"skip": qcheck.skip_functions(*UNQUANTIZED_BY_DESIGN)})


# Phases of check_layer's first call, timed inclusive by wrappers (cProfile would clash with the walk's own
# sys.setprofile): (label, module, function). Nested ones are part of the one above them.
PHASES = (
    ("trace the steps", "qcheck.checks._layer", "trace_step"),
    ("trace the walks", "qcheck.checks._layer", "_walks"),
    ("compile + run the steps", "qcheck.checks._layer", "run_step"),
    ("stored weights", "qcheck.checks._layer", "_hold_stored"),
    ("verdict", "qcheck.checks._layer", "_verdict"),
    ("    edge reruns", "qcheck.checks._layer:_Checked", "rerun"),
    ("    host copies of walk values", "qcheck._coverage._map", "_evidence"),
    ("    referee codes", "qcheck._coverage._declaration", "_reference_codes"),
    ("    code comparisons", "qcheck._coverage._declaration", "_bits_equal"),
)


def _install_phases() -> dict:
    """Wrap each phase's function with a timer that also notes the process's peak RSS at its end."""
    import importlib
    import resource

    spent: dict = {}

    import jax

    def wrap(label, fn):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                # Waited for, so that a run's time is its own and not the next host copy's.
                return jax.block_until_ready(fn(*a, **k))
            finally:
                rec = spent.setdefault(label, {"s": 0.0, "calls": 0})
                rec["s"] += time.perf_counter() - start
                rec["calls"] += 1
                rec["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
        return timed

    for label, where, name in PHASES:
        module, _, cls = where.partition(":")
        target = importlib.import_module(module)
        target = getattr(target, cls) if cls else target
        fn = getattr(target, name, None)
        if fn is None:  # another tree (the ref) without this function: not timed there
            continue
        timed = wrap(label, fn)
        setattr(target, name, timed)
        if not cls:  # and where another module imported it by name
            for m in list(sys.modules.values()):
                if getattr(m, "__name__", "").startswith("qcheck.") and getattr(m, name, None) is fn:
                    setattr(m, name, timed)
    layer = importlib.import_module("qcheck.checks._layer")  # each sub-check of the verdict, by its row's name
    layer.SUB_CHECKS = tuple((name, wrap(f"  sub-check {name}", fn)) for name, fn in layer.SUB_CHECKS)
    return spent


def _counts() -> dict[str, int]:
    counter = sys.modules.get("sitecustomize")
    found = getattr(counter, "_counts", None)
    if found is None:
        return {}
    return {"compiles": found[_BACKEND_COMPILE], "traces": found[_JAXPR_TRACE]}


def child(side: str, cell: str, phases: bool = False) -> None:
    import resource

    import jax
    from flax import nnx

    import qcheck

    layer, twin, x, loss_of, kwargs = _cell(cell)
    spent = _install_phases() if phases and side != "floor" else {}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    jax.block_until_ready(nnx.state(layer))
    before = _counts()
    start = time.perf_counter()
    if side == "floor":
        def loss(module, x):
            return loss_of(module(x))

        for module in (layer, twin):
            jax.block_until_ready(nnx.jit(nnx.value_and_grad(loss))(module, x))
    else:
        try:
            qcheck.check_layer(layer, twin, x, **kwargs)
            verdict = "pass"
        except AssertionError as e:  # a verdict, timed as one
            verdict = "fail: " + " | ".join(ln.strip() for ln in str(e).splitlines()[:6])
    seconds = time.perf_counter() - start
    after = _counts()
    print(_RESULT + json.dumps({
        "seconds": round(seconds, 3), **{k: after[k] - before[k] for k in after},
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "rss_before_gb": round(rss_before, 3), **({"verdict": verdict} if side != "floor" else {}),
        **({"phases": {k: {**v, "s": round(v["s"], 3)} for k, v in spent.items()}} if spent else {}),
        "qcheck": str(Path(qcheck.__file__).parent.parent), "python": platform.python_version(), "jax": jax.__version__,
        "cache_dir": jax.config.jax_compilation_cache_dir,
        "cache_enabled": getattr(jax.config, "jax_enable_compilation_cache", None)}), flush=True)


# -------------------------------------------------------------- the driver


def _env(tree: Path, site: Path, counts: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    # The tree first: its qcheck and its tests (maxtext_cells) over the environment's editable install.
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(tree)])
    env[COMPILE_DIR_ENV] = str(counts)
    env.update(CI="true", JAX_ENABLE_COMPILATION_CACHE="false", JAX_PLATFORMS="cpu")
    return env


def run_one(side: str, cell: str, tree: Path, python: str, maxtext_python: str, site: Path,
            phases: bool = False) -> dict:
    """One fresh process: ``side`` (floor, new, ref) on ``cell``, with ``tree``'s qcheck."""
    # This tree's script drives every side (the ref's may not know --phases or sized cells).
    command = [python, str(HERE / "check_layer_floor.py"), "--child", "floor" if side == "floor" else "check", cell,
               *(["--phases"] if phases else [])]
    if cell.startswith("maxtext/"):
        command = ["bash", str(ROOT / ".ci" / "maxtext.sh"), "run", maxtext_python, maxtext_python, *command[1:]]
    record: dict = {"side": side, "cell": cell, "tree": str(tree)}
    with tempfile.TemporaryDirectory(prefix="qcheck-floor-counts-") as counts:
        start = time.perf_counter()
        done = subprocess.run(command, cwd=tree, env=_env(tree, site, Path(counts)), capture_output=True, text=True)
        record["process_s"] = round(time.perf_counter() - start, 2)
        tallies = [json.loads(p.read_text()) for p in Path(counts).glob("*.json")]
    record["process_compiles"] = sum(t["compiles"] for t in tallies) if tallies else None
    result = next((ln[len(_RESULT):] for ln in done.stdout.splitlines() if ln.startswith(_RESULT)), None)
    if done.returncode != 0 or result is None:
        record["error"] = f"exit {done.returncode}: " + (done.stderr.strip()[-1500:] or done.stdout.strip()[-1500:])
        return record
    record.update(json.loads(result))
    if Path(record["qcheck"]).resolve() != tree.resolve():
        record["error"] = f"imported qcheck from {record['qcheck']}, not from {tree}"
    return record


def _progress(r: dict, rnd: int) -> str:
    if "error" in r:
        return f"[floor] round {rnd} {r['cell']:20} {r['side']:5}: FAILED {r['error'][-300:]}"
    return (f"[floor] round {rnd} {r['cell']:20} {r['side']:5}: {r['seconds']:7.2f} s, {r.get('compiles')} compiles, "
            f"{r.get('traces')} traces in the call ({r['process_compiles']} in the process, {r['process_s']} s)")


def summarize(records: list[dict], cell: str, sides: list[str]) -> dict:
    """A cell's row: per side the median seconds and compiles, per check side the per-round ratios to the floor."""
    rounds = sorted({r["round"] for r in records if r["cell"] == cell})
    by = {(r["side"], r["round"]): r for r in records if r["cell"] == cell and "error" not in r}
    row: dict = {"cell": cell, "rounds": len(rounds)}
    for side in sides:
        ok = [by[side, n] for n in rounds if (side, n) in by]
        row[side] = {"median_s": round(statistics.median(r["seconds"] for r in ok), 2) if ok else None,
                     "compiles": sorted({r.get("compiles") for r in ok}, key=str),
                     "traces": sorted({r.get("traces") for r in ok}, key=str),
                     "peak_rss_gb": (round(statistics.median(r["peak_rss_gb"] for r in ok), 2)
                                     if ok and all("peak_rss_gb" in r for r in ok) else None),
                     "verdicts": sorted({r.get("verdict", "")[:60] for r in ok if r.get("verdict")}),
                     "failed": len(rounds) - len(ok)}
        if side != "floor":
            ratios = [round(by[side, n]["seconds"] / by["floor", n]["seconds"], 3) for n in rounds
                      if (side, n) in by and ("floor", n) in by]
            row[side]["ratios"] = ratios
            row[side]["median_ratio"] = round(statistics.median(ratios), 3) if ratios else None
    return row


def table(rows: list[dict], sides: list[str]) -> str:
    head = ["cell", "floor s"]
    for side in sides[1:]:
        head += [f"{side} / floor", "per round", f"{side} s"]
    head += [f"compiles {'/'.join(sides)}", f"traces {'/'.join(sides)}", f"peak GB {'/'.join(sides)}"]
    lines = [head]
    for row in rows:
        cells = [row["cell"], f"{row['floor']['median_s']}"]
        for side in sides[1:]:
            s = row[side]
            cells += [f"{s['median_ratio']}", " ".join(f"{r:.2f}" for r in s["ratios"]) or "-", f"{s['median_s']}"]
        for figure in ("compiles", "traces"):
            cells.append(" / ".join(",".join(map(str, row[side][figure])) or "-" for side in sides))
        cells.append(" / ".join(str(row[side].get("peak_rss_gb")) for side in sides))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", nargs=2, metavar=("SIDE", "CELL"), help=argparse.SUPPRESS)
    p.add_argument("--cells", default=",".join(DEFAULT_CELLS), help=f"comma-separated (default: {','.join(DEFAULT_CELLS)})")
    p.add_argument("--sizes", help="comma-separated embedding widths: qcheck's fp8 Mixtral layer grown to each "
                                   "(mlp = 2 x emb, tokens = emb), the cells MODEL/RECIPE/PATH@EMB, in place of --cells")
    p.add_argument("--model", default="mixtral/fp8/dense", help="the cell --sizes grows (default: mixtral/fp8/dense)")
    p.add_argument("--phases", action="store_true", help="time check_layer's phases (wrappers; a little slower)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every side per cell (default: 3)")
    p.add_argument("--ref", help="also time check_layer at this commit (a temporary git worktree)")
    p.add_argument("--python", default=sys.executable, help="interpreter of qcheck's own cells (default: this one)")
    p.add_argument("--maxtext-python", default="/work/venvmt/bin/python", help="MaxText's environment's interpreter")
    p.add_argument("--json", type=Path, help="write the runs, the table, the machine here")
    args = p.parse_args(argv)
    if args.child:
        child(*args.child, phases=args.phases)
        return 0

    sys.path.insert(0, str(HERE))
    from compare import machine  # stdlib only

    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    if args.sizes:
        cells = [f"{args.model}@{int(n)}" for n in args.sizes.split(",") if n.strip()]
    sides = ["floor", *(["ref"] if args.ref else []), "new"]
    scratch = Path(tempfile.mkdtemp(prefix="qcheck-floor-"))
    site = scratch / "site"
    site.mkdir()
    shutil.copy(HERE / "compile_counter.py", site / "sitecustomize.py")
    trees = {"floor": ROOT, "new": ROOT}
    records: list[dict] = []
    ref_sha = None
    try:
        if args.ref:
            ref_sha = subprocess.run(["git", "rev-parse", "--verify", f"{args.ref}^{{commit}}"], cwd=ROOT, check=True,
                                     capture_output=True, text=True).stdout.strip()
            trees["ref"] = scratch / "ref"
            subprocess.run(["git", "worktree", "add", "--detach", str(trees["ref"]), ref_sha], cwd=ROOT, check=True,
                           capture_output=True)
        for rnd in range(1, args.rounds + 1):
            order = sides[(rnd - 1) % len(sides):] + sides[:(rnd - 1) % len(sides)]
            for cell in cells:
                for side in order:
                    r = run_one(side, cell, trees[side], args.python, args.maxtext_python, site, args.phases)
                    r["round"] = rnd
                    records.append(r)
                    print(_progress(r, rnd), flush=True)
    finally:
        if "ref" in trees:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees["ref"])], cwd=ROOT, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)

    rows = [summarize(records, cell, sides) for cell in cells]
    where = machine()
    print(f"\ncheck_layer's first call / the floor (both layers' first nnx.jit(nnx.value_and_grad) call), "
          f"{args.rounds} round(s), median of per-round ratios; {where['cpu_model']}, {where['nproc']} cores"
          + (f"; ref = {args.ref} ({ref_sha[:12]})" if ref_sha else ""))
    print(table(rows, sides))
    if args.json:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        args.json.write_text(json.dumps({"machine": where, "head": head, "ref": ref_sha, "rounds": args.rounds,
                                         "summary": rows, "runs": records}, indent=1) + "\n")
    return 0 if all(row[s]["failed"] == 0 for row in rows for s in sides) else 1


if __name__ == "__main__":
    sys.exit(main())
