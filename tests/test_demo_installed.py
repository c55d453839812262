"""`nemo-dcr demo` as a user runs it: from a wheel of the project installed into a fresh
virtualenv, in a directory outside the checkout, with no PYTHONPATH. Every documented
variant (README: `nemo-dcr demo`, `--transport relay`, `--transport s3`) must exit 0 and
report every refit bit-exact, so the demo needs nothing that ships only with the source
tree (tests/, examples/).

The fresh virtualenv gets the heavy dependencies (torch, megatron-core, transformers, moto)
from this interpreter's site-packages through a .pth file. Python processes .pth files only
in its own site directories, not in one a .pth file adds, so the checkout's editable-install
finder stays inactive there: `import nemo_dcr` can only find the installed wheel."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank
REPO = Path(__file__).resolve().parents[1]
# Small enough to keep the three runs short; the transports and the refit loop are the demo's own.
SIZES = ["--steps", "2", "--tp", "2", "--dp", "1", "--layers", "2", "--hidden", "64", "--receivers", "2", "--dump"]
RECEIVERS = ("rx0", "rx1")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _sources(dest: Path) -> Path:
    """What `pip wheel` reads from the checkout, copied, so the build writes nothing into it
    (setuptools leaves build/ and *.egg-info beside the sources)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    dest.mkdir()
    shutil.copy2(REPO / "pyproject.toml", dest)
    shutil.copy2(REPO / pyproject["project"]["readme"], dest)
    for directory in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(REPO / directory, dest / directory, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtualenv holding the project's wheel (and its `nemo-dcr` console script)."""
    base = tmp_path_factory.mktemp("installed")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-w", str(base / "dist"), str(_sources(base / "src"))])
    (wheel,) = (base / "dist").glob("nemo_dcr-*.whl")
    root = base / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = sysconfig.get_paths()
    (site / "deps-from-test-env.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(
        (ours["purelib"], ours["platlib"]))))
    # pip (importable through the .pth) installs into the interpreter that runs it; --ignore-installed:
    # the checkout's editable install is visible there and must be neither uninstalled nor reused.
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          "--disable-pip-version-check", "--no-warn-script-location", str(wheel)], cwd=base)
    return root


def _user_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    return {**env, "PATH": os.pathsep.join([str(venv / "bin"), env.get("PATH", "/usr/bin:/bin")]),
            "VIRTUAL_ENV": str(venv), "OMP_NUM_THREADS": "1"}


def test_the_package_comes_from_the_wheel(venv, tmp_path):
    code = ("import importlib.util, nemo_dcr, nemo_dcr.demo.trainer, nemo_dcr.converters, nemo_dcr.transports\n"
            "print(nemo_dcr.__file__, nemo_dcr.converters.__file__, nemo_dcr.transports.__file__)\n"
            "print(importlib.util.find_spec('tests'), importlib.util.find_spec('examples'))")
    out = _run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=_user_env(venv)).stdout.split("\n")
    for module_file in out[0].split():
        assert Path(module_file).resolve().is_relative_to(venv.resolve()), out
        assert not Path(module_file).resolve().is_relative_to(REPO), out
    assert out[1] == "None None", out  # nothing of the checkout is importable there
    script = shutil.which("nemo-dcr", path=str(venv / "bin"))
    assert script and Path(script).read_text().startswith(f"#!{venv / 'bin' / 'python'}"), script


@pytest.mark.parametrize("transport", [
    pytest.param([], id="local"),
    pytest.param(["--transport", "relay"], id="relay"),
    pytest.param(["--transport", "s3"], id="s3"),
])
@pytest.mark.timeout(420)
def test_every_documented_demo_runs_from_the_installed_package(venv, tmp_path, transport):
    proc = subprocess.run(["nemo-dcr", "demo", *transport, *SIZES], cwd=tmp_path, env=_user_env(venv),
                          capture_output=True, text=True, timeout=360)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    steps = re.findall(r"^step (\d+) \|.*\| bit-exact: (\w+) \((\d+) receivers\)", proc.stdout, re.M)
    assert steps == [("1", "yes", "2"), ("2", "yes", "2")], out[-4000:]
    assert "2/2 refits committed, bit-exact on every receiver: yes" in proc.stdout, out[-4000:]
    for rx in RECEIVERS:
        assert re.search(rf"final state of {rx} \(its dump, every element\) vs the producers' committed "
                         r"version 2: identical", proc.stdout), out[-4000:]
    (results,) = (tmp_path / "runs").glob("demo-*/results.jsonl")  # the default work dir: under the cwd
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["step"], r["committed"], r["bit_exact"], r["version"]) for r in rows] == [
        (1, True, True, 1), (2, True, True, 2)], rows
    assert all(r["digest_checked_receivers"] == len(RECEIVERS) for r in rows), rows
