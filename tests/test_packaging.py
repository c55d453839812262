"""What `pip install .` ships: every package of the source tree, so an entry point never
names a module that only an editable install has."""

from __future__ import annotations

import tomllib

from tests.support.launch import REPO


def test_every_package_directory_is_listed_in_pyproject():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, roots = set(tool["packages"]), tool["package-dir"]
    found = set()
    for package, directory in roots.items():
        base = REPO / directory
        for init in base.rglob("__init__.py"):
            parts = init.parent.relative_to(base).parts
            found.add(".".join((package, *parts)))
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages with no directory"
