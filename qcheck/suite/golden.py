"""Golden cases: what pins a recipe's numerics on a fixed seed, one JSON file per recipe × variant.

Where they live: the cases of the recipes qcheck ships are inside the package
(:func:`builtin_root`), so they travel with every install; a user's recipes
keep theirs in the user's project (``./golden`` by default, ``--golden-dir`` or
``$QCHECK_GOLDEN_DIR`` to move it). :func:`root_for` says which.

A case holds the layer output, what one call site fed its matmul on a
canonical einsum (the operands and the codes and scales on the way, traced from
the site; raw bits plus the ml_dtypes name, since .npz does not round-trip
those types), the relative norm against ``none``, the train step's entry
parameters and gradients (a sample of each leaf, with its norm), the tolerance floats are compared with, the provenance of whoever
wrote it, and a digest of all that. Files are written only by
``python -m qcheck golden add/update`` or ``pytest --update-golden``, atomically;
a file that fails to parse, has another schema or does not match its digest is
reported by name and never silently replaced by a check.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from qcheck.suite import cases as cases_mod
from qcheck import checks
from qcheck.suite import _process
from qcheck.layers import step
from qcheck.suite._operands import site_operands
from qcheck.suite.cases import SEED, Case, Variant
from qcheck.recipes import get_recipe, is_builtin, recipe_names, recipe_source

__all__ = [
    "DEFAULT_TOLERANCE",
    "ENV",
    "SCHEMA",
    "GoldenCase",
    "GoldenFileError",
    "Collected",
    "GoldenError",
    "add_command",
    "builtin_root",
    "check_case",
    "collect",
    "golden_cases",
    "golden_dir",
    "root_for",
    "user_root",
    "writable_here",
    "write_cases",
    "measure",
    "read_case",
    "summarize",
    "write_case",
]

SCHEMA = "qcheck.golden/2"
#: Environment variable naming the golden directory (``--golden-dir`` wins over it).
ENV = "QCHECK_GOLDEN_DIR"
#: Floats compare elementwise, |got − golden| <= atol + rtol·|golden|; codes and
#: entry parameters compare exactly. Measured: jax 0.10.2 and 0.12.0.1 on CPU give
#: identical codes and Gemma outputs, and Mixtral outputs up to 3.6e-7 apart
#: (about 1100 of 2048 values move by an ulp or two); a 2^-12 relative drift fails.
#: Gradients (a sample of each leaf, and each leaf's norm) take the output's
#: relative tolerance; their absolute one is scaled to their size (elements
#: 1e-6 to 5e-2 on the table, so 1e-6 x the largest). Not measured across jax
#: versions yet: the first update on another version says how far they move.
DEFAULT_TOLERANCE = {"output": {"rtol": 1e-5, "atol": 1e-6}, "rel_norm": {"atol": 1e-6},
                     "grads": {"rtol": 1e-5, "atol": 5e-8}}
#: At most this many elements of each gradient leaf are stored: every k-th of
#: the flattened leaf, so every expert and row is sampled; the norm and absmax
#: of the whole leaf are stored beside them.
GRAD_SAMPLE = 1024
#: The einsum whose operand codes a case records (see :func:`canonical_operands`).
CANONICAL_EQN = "tm,mh->th"
_ROW_BYTES = 32  # one hex line of a stored array: a diff shows which rows moved
_KEYS = ("schema", "digest", "case", "provenance", "tolerance", "rel_norm", "entry_params",
         "output_summary", "codes", "output", "grads_summary", "grads")


class GoldenError(ValueError):
    """A golden directory or command that cannot be used as asked (a usage error: one line, no traceback)."""


class GoldenFileError(ValueError):
    """A golden file that cannot be trusted: unreadable, truncated, another schema, or edited by hand."""

    def __init__(self, path: Path, problem: str):
        self.path = path
        super().__init__(f"golden file {path}: {problem}")


@dataclasses.dataclass(frozen=True, order=True)
class GoldenCase:
    """One golden case: a recipe on a variant of the case table (model, path, token dropping)."""

    recipe: str
    model: str
    path: str
    dropping: bool = False

    @property
    def variant(self) -> Variant:
        return Variant(self.model, self.path, self.dropping)

    @property
    def id(self) -> str:
        return f"{self.recipe}-{self.variant.id}"

    @property
    def case(self) -> Case:
        return Case(self.recipe, self.variant)

    def file(self, root: Path) -> Path:
        return Path(root) / self.recipe / f"{self.variant.id}.json"


def golden_cases(recipes: tuple[str, ...] | None = None) -> list[GoldenCase]:
    """The cases every registered recipe (or each of ``recipes``) must have."""
    names = recipe_names() if recipes is None else tuple(get_recipe(r).name for r in recipes)
    return [GoldenCase(r, v.model, v.path, v.dropping) for r in names for v in cases_mod.VARIANTS
            if v.path in get_recipe(r).expect.paths]


def golden_dir(explicit: str | os.PathLike | None = None, *, default: str | os.PathLike) -> Path:
    """The golden directory: ``explicit`` (a flag), else ``$QCHECK_GOLDEN_DIR``, else ``default``."""
    return Path(explicit or os.environ.get(ENV) or default)


def user_root(explicit: str | os.PathLike | None = None, *, default: str | os.PathLike = "golden",
              must_exist: bool = False) -> Path:
    """The user's golden directory, for the recipes qcheck does not ship: :func:`golden_dir` of ``default``.

    ``must_exist``: a directory named explicitly (flag or environment) that is
    missing or not a directory is a :class:`GoldenError`.
    """
    root = golden_dir(explicit, default=default)
    named = explicit or os.environ.get(ENV)
    if must_exist and named and not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        source = "--golden-dir" if explicit else f"${ENV}"
        raise GoldenError(f"golden directory {root} ({source}) {what}")
    return root


def builtin_root() -> Path:
    """Where the golden cases of the recipes qcheck ships live.

    In the repository they are its top-level ``golden/``; the wheel carries that
    directory as ``qcheck/_golden`` (pyproject.toml's package-dir).
    """
    package = Path(__file__).resolve().parents[1]
    installed = package / "_golden"
    return installed if installed.is_dir() else package.parent / "golden"


def root_for(recipe: str, user: Path) -> Path:
    """The directory holding ``recipe``'s cases: the package's for qcheck's own recipes, else ``user``."""
    return builtin_root() if is_builtin(recipe) else Path(user)


def writable_here(recipe: str, project: Path | None = None) -> bool:
    """Whether ``recipe``'s cases may be written from ``project`` (default: the working directory).

    A user's recipes always; qcheck's own only from qcheck's checkout, where
    the package's golden directory lies inside the project, never into an
    installed qcheck: recording qcheck's reference on another machine would
    erase the comparison it exists for.
    """
    if not is_builtin(recipe):
        return True
    return Path(project or Path.cwd()).resolve() in builtin_root().parents


@dataclasses.dataclass(frozen=True)
class Collected:
    """What a golden directory holds for this run's recipes."""

    cases: list[tuple[GoldenCase, Path]]  #: each case this run checks, with the directory it lives in
    unloaded: list[tuple[Path, str]]  #: files of recipes this run did not load: reported, not checked
    strays: list[GoldenFileError]  #: files no recipe could own: reported, not checked


def collect(user: Path, recipes: tuple[str, ...] | None = None) -> Collected:
    """The cases of ``recipes`` (default: every registered one), and what else lies in ``user``.

    A file under ``user`` for a recipe this run did not load is listed in
    ``unloaded`` (another run may load it); a file that is not named
    ``<recipe>/<variant>.json`` (``mixtral-dense``, ``mixtral-dense-drop``, ...) is listed in ``strays``.
    """
    chosen = golden_cases(recipes)
    cases = [(c, root_for(c.recipe, user)) for c in chosen]
    loaded = set(recipe_names())
    unloaded, strays = [], []
    for path in sorted(Path(user).glob("*/*.json")) if Path(user).is_dir() else ():
        variants = [v.id for v in cases_mod.VARIANTS]
        if path.stem not in variants:
            strays.append(GoldenFileError(
                path, f"is not named after a case: expected <recipe>/<variant>.json with variant one of "
                f"{', '.join(variants)}"))
        elif path.parent.name not in loaded:
            unloaded.append((path, path.parent.name))
    return Collected(cases, unloaded, strays)


def add_command(recipe: str, root: Path) -> str:
    """The exact command that writes ``recipe``'s cases into ``root``."""
    parts = ["qcheck", "golden", "add", recipe]
    if (source := recipe_source(recipe)) is not None:
        parts += ["--recipes", source]
    if Path(root).resolve() not in (golden_dir(default="golden").resolve(), builtin_root()):
        parts += ["--golden-dir", str(root)]
    return shlex.join(parts)


# -- measuring ----------------------------------------------------------------


def canonical_operands(model: str) -> tuple[np.ndarray, np.ndarray]:
    """The canonical einsum's operands on ``model``: ``[4, emb]`` tokens, ``[emb, 32]`` weights.

    Four tokens of the layer input against the first 32 columns of expert 0's
    first input projection (the same weights for every recipe and path).
    """
    x = np.asarray(cases_mod.layer_input(model))[0, :4]
    w = np.asarray(cases_mod.layer(Case("none", Variant(model, "dense", False))).wi_0[...])[0, :, :32]
    return x, w


@functools.cache
def operand_codes(recipe_name: str, model: str) -> dict[str, np.ndarray]:
    """What the recipe's fresh ``wi_0`` site fed its matmul on the canonical einsum's operands.

    Taken from the site itself (:func:`qcheck.suite._operands.site_operands`),
    not recomputed from the recipe's declared formats: ``lhs``/``rhs`` are the
    operands the matmul received, bitwise (codes times scales), and
    ``<side>.<dtype>`` the narrow values (codes, block scales) computed on the
    way, so a plug-in that quantizes otherwise than it declares, or declares
    nothing, records what it does.
    """
    lhs, rhs = canonical_operands(model)
    site = cases_mod.layer(Case(recipe_name, Variant(model, "dense", False))).get_einsum("wi_0")
    return site_operands(site, CANONICAL_EQN, lhs, rhs)


@functools.cache
def train_step_entry_params(case: Case) -> dict[str, int]:
    """Entry parameters of the case's jitted train step, read off its lowering.

    Lowers the same jitted function the suite runs, so a step already traced is not traced again.
    """
    graphdef, params, meta, rest = step.split_for_step(cases_mod.layer(case))
    lowered = step.lower_train_step(graphdef, params, meta, rest, cases_mod.layer_input(case.variant.model))
    return checks.lowered_entry_params(lowered)


def measure(case: GoldenCase) -> dict[str, Any]:
    """The values a golden case pins, measured now: output, codes, rel_norm, entry params, gradients.

    Where the recipe cannot train on the variant
    (:func:`qcheck.suite.invariants.train_step_runs`) there is no train step:
    its entry parameters and gradients are recorded as empty.
    """
    from qcheck.suite.invariants import grad_leaves, train_step_runs

    recipe = get_recipe(case.recipe)
    output = cases_mod.layer_output(case.case)
    rel = checks.rel_norm(output, cases_mod.layer_output(case.case.reference)) if recipe.quantized else 0.0
    trains = train_step_runs(recipe, case.variant)
    return {
        "rel_norm": rel,
        "entry_params": train_step_entry_params(case.case) if trains else {},
        "output": output,
        "codes": operand_codes(case.recipe, case.model),
        "grads": grad_leaves(cases_mod.layer_step(case.case).grads) if trains else {},
    }


def grad_sample(g: np.ndarray) -> tuple[int, np.ndarray]:
    """``(stride, every stride-th element of the flattened leaf)``, at most :data:`GRAD_SAMPLE` of them."""
    g = np.asarray(g).reshape(-1)
    stride = max(1, -(-g.size // GRAD_SAMPLE))
    return stride, g[::stride]


def provenance() -> dict[str, Any]:
    """Where and with what a case was written (or a check run)."""
    import flax
    import jaxlib

    backend = _process.default_platform()  # where the cases' numerics ran
    device = jax.devices(backend)[0]
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "numpy": np.__version__,
        "backend": backend,
        "device_kind": device.device_kind,
        "seed": SEED,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


# -- the file format -----------------------------------------------------------


def _dtype(name: str) -> np.dtype:
    # ml_dtypes' types are not known to numpy by name.
    try:
        return np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """``{"dtype", "shape", "bits"}``: the raw little-endian bytes in hex lines of 32 bytes."""
    a = np.asarray(a)  # not ascontiguousarray: it turns a scalar into shape (1,)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    hexed = a.tobytes(order="C").hex()
    step_ = 2 * _ROW_BYTES
    return {"dtype": a.dtype.name, "shape": list(a.shape),
            "bits": [hexed[i:i + step_] for i in range(0, len(hexed), step_)]}


def decode_array(d: Any, where: str) -> np.ndarray:
    """Inverse of :func:`encode_array`; a ValueError naming ``where`` on anything malformed."""
    if not isinstance(d, dict) or set(d) != {"dtype", "shape", "bits"}:
        raise ValueError(f"{where}: expected an object with keys dtype, shape, bits")
    try:
        dtype = _dtype(d["dtype"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    shape = d["shape"]
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(d["bits"], list) and all(isinstance(r, str) for r in d["bits"])):
        raise ValueError(f"{where}: bits must be a list of hex strings")
    try:
        raw = bytes.fromhex("".join(d["bits"]))
    except ValueError:
        raise ValueError(f"{where}: bits are not valid hex") from None
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != need:
        raise ValueError(
            f"{where}: bits hold {len(raw)} bytes, but shape {tuple(shape)} of {dtype.name} needs {need} (truncated?)")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _digest(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _summary(a: np.ndarray) -> dict[str, float]:
    a = a.astype(np.float64)
    return {"norm": float(np.linalg.norm(a)), "mean": float(a.mean()), "absmax": float(np.abs(a).max())}


def to_record(case: GoldenCase, values: dict[str, Any], *, tolerance=None) -> dict[str, Any]:
    """The JSON object for ``case`` holding ``values`` (from :func:`measure`)."""
    record = {
        "schema": SCHEMA,
        "digest": "",
        "case": {"recipe": case.recipe, "model": case.model, "path": case.path, "dropping": case.dropping,
                 "seed": SEED, "batch": cases_mod.BATCH, "seq": cases_mod.SEQ, "einsum": CANONICAL_EQN},
        "provenance": provenance(),
        "tolerance": tolerance or DEFAULT_TOLERANCE,
        "rel_norm": float(values["rel_norm"]),
        "entry_params": dict(values["entry_params"]),
        "output_summary": _summary(values["output"]),
        "codes": {k: encode_array(v) for k, v in sorted(values["codes"].items())},
        "output": encode_array(values["output"]),
        "grads_summary": {k: {"shape": list(np.shape(g)), "stride": grad_sample(g)[0], **_summary(np.asarray(g))}
                          for k, g in sorted(values["grads"].items())},
        "grads": {k: encode_array(grad_sample(g)[1]) for k, g in sorted(values["grads"].items())},
    }
    record["digest"] = _digest(record)
    return record


@dataclasses.dataclass(frozen=True)
class Stored:
    """A golden file, parsed and validated."""

    path: Path
    record: dict[str, Any]
    output: np.ndarray
    codes: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]  #: the stored sample of each gradient leaf

    @property
    def tolerance(self) -> dict[str, Any]:
        return self.record["tolerance"]


def read_case(case: GoldenCase, root: Path) -> Stored:
    """Parse and validate ``case``'s file; any problem is a :class:`GoldenFileError` naming the file."""
    path = case.file(root)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise GoldenFileError(path, f"cannot be read: {e}") from None
    if not text.strip():
        raise GoldenFileError(path, "is empty")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise GoldenFileError(path, f"is not valid JSON (truncated or corrupted?): {e}") from None
    if not isinstance(record, dict):
        raise GoldenFileError(path, f"holds a JSON {type(record).__name__}, not a golden case object")
    if record.get("schema") != SCHEMA:
        raise GoldenFileError(
            path, f"has schema {record.get('schema')!r}, expected {SCHEMA!r}; rewrite it with "
            f"`{update_command(case.recipe, root)}`")
    if missing := [k for k in _KEYS if k not in record]:
        raise GoldenFileError(path, f"is missing keys: {', '.join(missing)}")
    if extra := sorted(set(record) - set(_KEYS)):
        raise GoldenFileError(path, f"has unknown keys: {', '.join(extra)}")
    if record["digest"] != _digest(record):
        raise GoldenFileError(
            path, "does not match its digest: it was edited by hand or corrupted. Golden files are "
            f"written only by qcheck; to change it, run `{update_command(case.recipe, root)}`")
    for key, kind in (("case", dict), ("provenance", dict), ("tolerance", dict), ("entry_params", dict),
                      ("codes", dict), ("grads", dict), ("grads_summary", dict), ("rel_norm", (int, float))):
        if not isinstance(record[key], kind) or isinstance(record[key], bool):
            raise GoldenFileError(path, f"has a {type(record[key]).__name__} under {key!r}, where the schema "
                                  f"wants {'a number' if key == 'rel_norm' else 'an object'}")
    if not all(isinstance(n, int) for n in record["entry_params"].values()):
        raise GoldenFileError(path, "has entry_params that are not all integers")
    stated = {k: record["case"].get(k) for k in ("recipe", "model", "path", "dropping")}
    if stated != dataclasses.asdict(case):
        raise GoldenFileError(path, f"holds case {stated}, but its name says {dataclasses.asdict(case)}")
    try:
        output = decode_array(record["output"], "output")
        codes = {k: decode_array(v, f"codes[{k!r}]") for k, v in record["codes"].items()}
        grads = {k: decode_array(v, f"grads[{k!r}]") for k, v in record["grads"].items()}
        if set(grads) != set(record["grads_summary"]):
            raise ValueError(f"grads has leaves {sorted(grads)}, grads_summary {sorted(record['grads_summary'])}")
        tol = record["tolerance"]
        for key, fields in (("output", ("rtol", "atol")), ("rel_norm", ("atol",)), ("grads", ("rtol", "atol"))):
            for f in fields:
                if not isinstance(tol.get(key, {}).get(f), (int, float)):
                    raise ValueError(f"tolerance.{key}.{f} must be a number")
    except (ValueError, AttributeError) as e:
        raise GoldenFileError(path, str(e)) from None
    return Stored(path, record, output, codes, grads)


def update_command(recipe: str, root: Path) -> str:
    return add_command(recipe, root).replace(" golden add ", " golden update ", 1)


def _atomic_write(path: Path, text: str) -> None:
    _atomic_write_bytes(path, text.encode())


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a golden file is an ordinary file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_INT_LIST = re.compile(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]")


def _render(record: dict[str, Any]) -> str:
    # One hex row per line; shapes on one line.
    text = json.dumps(record, indent=1)
    return _INT_LIST.sub(lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text) + "\n"


# -- comparing and writing ------------------------------------------------------


def differences(stored: Stored, values: dict[str, Any]) -> list[str]:
    """What differs between a stored case and measured ``values``, one line per key; empty if it matches."""
    tol, out = stored.tolerance, []
    got, want = np.asarray(values["output"]), stored.output
    if got.shape != want.shape or got.dtype != want.dtype:
        out.append(f"output: got shape {got.shape} {got.dtype}, golden {want.shape} {want.dtype}")
    else:
        rtol, atol = tol["output"]["rtol"], tol["output"]["atol"]
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        bad = ~(diff <= atol + rtol * np.abs(want.astype(np.float64)))
        if bad.any():
            i = np.unravel_index(np.argmax(np.where(bad, diff, -1)), diff.shape)
            i = tuple(int(j) for j in i)
            out.append(
                f"output: {int(bad.sum())} of {bad.size} values outside rtol {rtol}, atol {atol}; "
                f"worst at {i}: got {got[i]!r}, golden {want[i]!r} (|diff| {diff[i]:.3g})")
    rel, golden_rel = float(values["rel_norm"]), float(stored.record["rel_norm"])
    if not abs(rel - golden_rel) <= tol["rel_norm"]["atol"]:
        out.append(f"rel_norm: got {rel:.6g}, golden {golden_rel:.6g} (atol {tol['rel_norm']['atol']})")
    if dict(values["entry_params"]) != stored.record["entry_params"]:
        out.append(f"entry_params: got {dict(values['entry_params'])}, golden {stored.record['entry_params']}")
    out += _grad_differences(stored, values["grads"])
    codes = values["codes"]
    if set(codes) != set(stored.codes):
        out.append(f"codes: got keys {sorted(codes)}, golden {sorted(stored.codes)}")
    for k in sorted(set(codes) & set(stored.codes)):
        g, w = np.asarray(codes[k]), stored.codes[k]
        if g.shape != w.shape or g.dtype != w.dtype:
            out.append(f"codes[{k!r}]: got shape {g.shape} {g.dtype.name}, golden {w.shape} {w.dtype.name}")
            continue
        # Bytes per element, flattened: a view cannot change the itemsize of a 0-d array.
        gb = g.reshape(-1).view(np.uint8).reshape(g.size, -1)
        wb = w.reshape(-1).view(np.uint8).reshape(w.size, -1)
        mismatch = np.any(gb != wb, axis=-1)
        if mismatch.any():
            j = int(np.argmax(mismatch))
            i = tuple(int(n) for n in np.unravel_index(j, g.shape))
            out.append(
                f"codes[{k!r}]: {int(mismatch.sum())} of {mismatch.size} differ, first at {i}: "
                f"got {g[i]!r} (0x{gb[j].tobytes()[::-1].hex()}), golden {w[i]!r} (0x{wb[j].tobytes()[::-1].hex()})")
    return out


def _outside(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> tuple[np.ndarray, np.ndarray]:
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return ~(diff <= atol + rtol * np.abs(want.astype(np.float64))), diff


def _grad_differences(stored: Stored, grads: dict[str, np.ndarray]) -> list[str]:
    """Each gradient leaf's sample, elementwise, and its norm, within the ``grads`` tolerance."""
    rtol, atol = stored.tolerance["grads"]["rtol"], stored.tolerance["grads"]["atol"]
    if set(grads) != set(stored.grads):
        return [f"grads: got leaves {sorted(grads)}, golden {sorted(stored.grads)}"]
    out = []
    for k in sorted(grads):
        stride, got = grad_sample(grads[k])
        want, summary = stored.grads[k], stored.record["grads_summary"][k]
        if got.shape != want.shape or got.dtype != want.dtype or stride != summary.get("stride"):
            out.append(f"grads[{k!r}]: got a sample of {got.shape} {got.dtype} (stride {stride}), golden "
                       f"{want.shape} {want.dtype} (stride {summary.get('stride')})")
            continue
        bad, diff = _outside(got, want, rtol, atol)
        if bad.any():
            i = int(np.argmax(np.where(bad, diff, -1)))
            out.append(f"grads[{k!r}]: {int(bad.sum())} of {bad.size} sampled values outside rtol {rtol}, atol "
                       f"{atol}; worst at element {i * stride}: got {got[i]!r}, golden {want[i]!r} "
                       f"(|diff| {diff[i]:.3g})")
        norm = float(np.linalg.norm(np.asarray(grads[k], np.float64)))
        if not abs(norm - summary["norm"]) <= rtol * abs(summary["norm"]):
            out.append(f"grads[{k!r}]: norm {norm:.9g}, golden {summary['norm']:.9g} (rtol {rtol})")
    return out


def _bitwise_same(stored: Stored, values: dict[str, Any]) -> bool:
    fresh = to_record(GoldenCase(**{k: stored.record["case"][k] for k in ("recipe", "model", "path", "dropping")}),
                      values, tolerance=stored.tolerance)
    keys = ("rel_norm", "entry_params", "codes", "output", "grads_summary", "grads")
    return all(fresh[k] == stored.record[k] for k in keys)


def _moved_within_tolerance(stored: Stored, values: dict[str, Any]) -> str:
    got, want = np.asarray(values["output"], np.float64), stored.output.astype(np.float64)
    moved = int(np.sum(got != want))
    rel = abs(float(values["rel_norm"]) - float(stored.record["rel_norm"]))
    return (f"within tolerance: output {moved} of {got.size} values moved, max |diff| "
            f"{float(np.max(np.abs(got - want))):.2g}; rel_norm moved {rel:.2g}")


def _provenance_line(p: dict[str, Any]) -> str:
    return (f"jax {p.get('jax')}, jaxlib {p.get('jaxlib')}, flax {p.get('flax')}, ml_dtypes {p.get('ml_dtypes')}, "
            f"numpy {p.get('numpy')}, backend {p.get('backend')} ({p.get('device_kind')}), "
            f"seed {p.get('seed')}, {p.get('date')}")


def check_case(case: GoldenCase, root: Path) -> None:
    """Assert the case's current numerics match its golden file.

    A missing file fails with the exact command that creates it; an unusable
    file raises :class:`GoldenFileError`; a mismatch says which key, how far,
    and both sides' provenance.
    """
    __tracebackhide__ = True
    path = case.file(root)
    if case.recipe not in recipe_names():
        raise AssertionError(
            f"golden case {case.id} ({path}) is for recipe {case.recipe!r}, which is not registered "
            f"(registered: {', '.join(recipe_names())}); name its module with --qcheck-recipes / "
            "--recipes, or install the package that provides it")
    if not path.exists():
        if Path(root).resolve() == builtin_root():
            raise AssertionError(
                f"golden case {case.id} has no file ({path}): it ships with qcheck, so this installation "
                "is incomplete; reinstall qcheck")
        raise AssertionError(
            f"golden case {case.id} has no file ({path}); create the recipe's cases with:\n"
            f"  {add_command(case.recipe, root)}")
    stored = read_case(case, root)
    problems = differences(stored, measure(case))
    if problems:
        raise AssertionError(
            f"golden case {case.id} does not match {path}:\n  " + "\n  ".join(problems)
            + f"\ngolden written with: {_provenance_line(stored.record['provenance'])}"
            + f"\nthis run:            {_provenance_line(provenance())}"
            + f"\nif the change is intended: `{update_command(case.recipe, root)}` or `pytest --update-golden`")


_OUTCOMES = ("new", "changed", "replaced", "unchanged")


def summarize(lines: list[str]) -> str:
    """``"2 new, 1 changed, 0 replaced, 25 unchanged"`` for the lines :func:`write_case` returned."""
    counts = {k: sum(f": {k}" in line for line in lines) for k in _OUTCOMES}
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def write_cases(cases: list[GoldenCase], user: Path, *, overwrite: bool) -> list[str]:
    """Measure every case, then write all of their files or none; returns a summary line per case.

    Each case goes to :func:`root_for` its recipe. Without ``overwrite`` an
    existing file is a FileExistsError before anything is measured. Nothing is
    written until every case is measured, and a failure while writing restores
    whatever had been written already, so a recipe never ends up half-recorded.
    """
    targets = [(c, root_for(c.recipe, user)) for c in cases]
    if not overwrite and (taken := [str(c.file(r)) for c, r in targets if c.file(r).exists()]):
        raise FileExistsError(
            f"golden files exist, nothing written: {', '.join(taken)}; rewrite them with "
            f"`{update_command(cases[0].recipe, targets[0][1])}`")
    for directory in {r for _, r in targets}:
        _check_writable(directory)
    planned = [(c.file(r), *_plan(c, r, overwrite=overwrite)) for c, r in targets]
    done: list[tuple[Path, bytes | None]] = []
    try:
        for path, text, _ in planned:
            if text is not None:
                done.append((path, path.read_bytes() if path.exists() else None))
                _atomic_write(path, text)
    except BaseException:
        for path, old in reversed(done):
            if old is None:
                path.unlink(missing_ok=True)
            else:
                _atomic_write_bytes(path, old)
        raise
    return [line for _, _, line in planned]


def _check_writable(directory: Path) -> None:
    """A golden directory we can create files in (made if missing), else a one-line GoldenError."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise GoldenError(f"golden directory {directory}: {existing} is not a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise GoldenError(f"golden directory {directory} is not writable ({existing}: permission denied)")


def _plan(case: GoldenCase, root: Path, *, overwrite: bool) -> tuple[str | None, str]:
    """What writing ``case`` would do: the file's new text (None: leave it) and the summary line."""
    path = case.file(root)
    values = measure(case)
    if path.exists():
        if not overwrite:
            raise FileExistsError(
                f"golden file {path} exists; rewrite it with `{update_command(case.recipe, root)}` "
                "or `pytest --update-golden`")
        try:
            stored = read_case(case, root)
        except GoldenFileError as e:
            return _render(to_record(case, values)), f"{path}: replaced an unusable file ({e})"
        if _bitwise_same(stored, values):
            return None, f"{path}: unchanged"
        what = differences(stored, values) or [_moved_within_tolerance(stored, values)]
        return (_render(to_record(case, values, tolerance=stored.tolerance)),
                f"{path}: changed: " + "; ".join(what))
    return _render(to_record(case, values)), f"{path}: new"


def write_case(case: GoldenCase, root: Path, *, overwrite: bool) -> str:
    """Measure ``case`` and write its file atomically; returns a one-line summary of what changed.

    Without ``overwrite`` an existing file is a FileExistsError. With it, a file
    whose values are bitwise unchanged is left alone (its provenance too).
    """
    get_recipe(case.recipe)
    text, line = _plan(case, root, overwrite=overwrite)
    if text is not None:
        _atomic_write(case.file(root), text)
    return line
