"""An older jax than qcheck supports gets one line at first use, not an AttributeError inside the walk.

The environment is faked as pip leaves it when another package pins an old
jax (jax 0.8.2, flax 0.12.2; EasyDeL 0.3.0's jax 0.9.2 and flax 0.12.3 are where
qcheck's window starts, the easydel stage of .ci/run): distribution metadata
ahead of the real ones on the path, read by ``importlib.metadata`` as pip's.
The control: the same runs with the real, supported versions pass.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qcheck._versions import DISTRIBUTION

FIRST_USES = {
    "a public name": "import qcheck; qcheck.coverage",
    "qcheck.checks": "import qcheck.checks",
    "qcheck.formats": "import qcheck.formats",
}


def _fake_metadata(root: Path, versions: dict[str, str]) -> None:
    for dist, version in versions.items():
        info = root / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def _run(code: str, path: Path | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def old_jax(tmp_path_factory) -> Path:
    try:
        importlib.metadata.requires(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("qcheck runs uninstalled: the supported versions come from its installed metadata")
    root = tmp_path_factory.mktemp("easydel_env")
    _fake_metadata(root, {"jax": "0.8.2", "flax": "0.12.2"})
    return root


@pytest.mark.parametrize("use", FIRST_USES)
def test_an_older_jax_gets_one_line_naming_installed_and_supported_versions(old_jax, use):
    result = _run(FIRST_USES[use], old_jax)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last == ("ImportError: qcheck supports jax>=0.9.2 and flax>=0.12.3; this environment has jax 0.8.2 and "
                    "flax 0.12.2: pip install -U 'jax>=0.9.2' 'flax>=0.12.3'"), result.stderr
    assert "AttributeError" not in result.stderr


def test_the_command_line_says_it_in_one_line(old_jax):
    result = _run("import sys; from qcheck.suite.cli import main; sys.exit(main([]))", old_jax)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith("qcheck: error: qcheck supports jax>=0.9.2"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_supported_versions_installed_here_pass():
    assert _run(" ; ".join(FIRST_USES.values()), None).returncode == 0


def test_importing_qcheck_alone_checks_nothing(old_jax):
    # pytest imports the plugin, and with it qcheck, in every session of a user's environment.
    assert _run("import qcheck, qcheck.suite.plugin", old_jax).returncode == 0
