"""The golden store: where each case's file lives, its JSON format, provenance, and atomic writes.

The cases of the recipes qcheck ships live in the package (:func:`builtin_root`),
so they travel with every install; a user's recipes keep theirs in the user's
project (``./golden`` by default, ``--golden-dir`` or ``$QCHECK_GOLDEN_DIR`` to
move it). :func:`root_for` says which.

A file holds a case's values (:mod:`qcheck.suite.golden.record`) as JSON:
arrays as raw little-endian bits plus the dtype's name (.npz does not
round-trip ml_dtypes' types), the tolerance floats are compared with, the
provenance of whoever wrote it, and a digest of all that. :func:`read_case`
names the file and what is wrong with it for anything it cannot trust;
:func:`write_files` writes several files all or none.
"""

from __future__ import annotations

import dataclasses
import datetime
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

from qcheck.recipes import get_recipe, is_builtin, recipe_names, recipe_source
from qcheck.referees import FORMS
from qcheck.suite import _process
from qcheck.suite import _toolchain
from qcheck.suite import cases as cases_mod
from qcheck.suite.cases import SEED, Case, Variant

__all__ = [
    "CANONICAL_EQN",
    "DEFAULT_TOLERANCE",
    "ENV",
    "GRAD_SAMPLE",
    "SCHEMA",
    "Collected",
    "GoldenCase",
    "GoldenError",
    "GoldenFileError",
    "Stored",
    "add_command",
    "builtin_root",
    "check_writable",
    "collect",
    "decode_array",
    "digest",
    "encode_array",
    "golden_cases",
    "golden_dir",
    "grad_sample",
    "provenance",
    "read_case",
    "render",
    "root_for",
    "to_record",
    "toolchain_file",
    "update_command",
    "user_root",
    "writable_here",
    "write_files",
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
#: The einsum whose operand codes a case records (:func:`qcheck.suite.golden.record.canonical_operands`).
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

    def form_file(self, root: Path, form: str) -> Path:
        """The file of the case's values as a toolchain computing its divisions in ``form`` gives them, where they
        differ from the main file's (:data:`qcheck.referees.FORMS`: jax 0.12.1 keeps ``x / scale`` a division)."""
        return Path(root) / self.recipe / f"{self.variant.id}@{form.replace(' ', '-')}.json"


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
    package = Path(__file__).resolve().parents[2]  # qcheck/suite/golden/store.py -> qcheck
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
    forms = {f.replace(" ", "-") for f in FORMS}
    for path in sorted(Path(user).glob("*/*.json")) if Path(user).is_dir() else ():
        variants = [v.id for v in cases_mod.VARIANTS]
        stem, _, form = path.stem.partition("@")
        if stem not in variants or (form and form not in forms):
            strays.append(GoldenFileError(
                path, f"is not named after a case: expected <recipe>/<variant>.json (or <variant>@<form>.json, "
                f"form one of {', '.join(sorted(forms))}) with variant one of {', '.join(variants)}"))
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
        "xla_form": _toolchain.division_form(),
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


def digest(record: dict[str, Any]) -> str:
    """``sha256:<hex>`` of ``record`` without its digest: what a file written by qcheck carries."""
    body = {k: v for k, v in record.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _summary(a: np.ndarray) -> dict[str, float]:
    a = a.astype(np.float64)
    return {"norm": float(np.linalg.norm(a)), "mean": float(a.mean()), "absmax": float(np.abs(a).max())}


def to_record(case: GoldenCase, values: dict[str, Any], *, tolerance=None) -> dict[str, Any]:
    """The JSON object for ``case`` holding ``values`` (from :func:`qcheck.suite.golden.record.measure`)."""
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
    record["digest"] = digest(record)
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


def read_case(case: GoldenCase, root: Path, path: Path | None = None) -> Stored:
    """Parse and validate ``case``'s file (or its form's, ``path``); any problem is a :class:`GoldenFileError`
    naming the file."""
    path = case.file(root) if path is None else Path(path)
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
    if record["digest"] != digest(record):
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


def toolchain_file(case: GoldenCase, root: Path) -> Path:
    """The file this toolchain's run of ``case`` is held to: its form's (:meth:`GoldenCase.form_file`) where one was
    written, else the main file."""
    form = case.form_file(root, _toolchain.division_form())
    return form if form.exists() else case.file(root)


def update_command(recipe: str, root: Path) -> str:
    """The exact command that rewrites ``recipe``'s cases in ``root``."""
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


def render(record: dict[str, Any]) -> str:
    """The file's text for ``record``: one hex row per line, shapes on one line."""
    text = json.dumps(record, indent=1)
    return _INT_LIST.sub(lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text) + "\n"


def write_files(files: list[tuple[Path, str]]) -> None:
    """Write every ``(path, text)``, each atomically, and all or none.

    A failure part way (a full disk, a read-only file) restores whatever had
    been written already, so a recipe never ends up half-recorded.
    """
    done: list[tuple[Path, bytes | None]] = []
    try:
        for path, text in files:
            done.append((path, path.read_bytes() if path.exists() else None))
            _atomic_write(path, text)
    except BaseException:
        for path, old in reversed(done):
            if old is None:
                path.unlink(missing_ok=True)
            else:
                _atomic_write_bytes(path, old)
        raise


def check_writable(directory: Path) -> None:
    """A golden directory we can create files in (made if missing), else a one-line GoldenError."""
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise GoldenError(f"golden directory {directory}: {existing} is not a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise GoldenError(f"golden directory {directory} is not writable ({existing}: permission denied)")
