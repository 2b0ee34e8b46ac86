"""The folder layout and pyproject.toml's import names agree (DESIGN.md: the layout is the architecture).

Each top-level component folder is `kubemoe.<name>` twice over: pyproject.toml's package-dir builds the
wheel from it, and a committed relative link `kubemoe/<name> -> ../<folder>` lets a source checkout, the
editable install, type checkers and editors see one ordinary package tree.
"""

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_each_mapped_folder_has_its_link_inside_kubemoe():
    mapped = {name.removeprefix("kubemoe."): folder
              for name, folder in PYPROJECT["package-dir"].items() if name != "kubemoe"}
    links = {p.name: os.readlink(p) for p in (ROOT / "kubemoe").iterdir() if p.is_symlink()}
    # Relative links, so that every clone (and the Dockerfile's COPY of kubemoe/ beside the folders) works.
    assert links == {name: f"../{folder}" for name, folder in mapped.items()}, (
        "kubemoe/<name> must be a link to ../<folder> for each [tool.setuptools.package-dir] entry")
    for name, folder in mapped.items():
        assert (ROOT / "kubemoe" / name).resolve() == ROOT / folder


def test_every_python_folder_is_a_listed_package():
    # setuptools copies only the listed packages into the wheel: a new subfolder left out would be missing.
    found = set()
    for folder, dirs, files in os.walk(ROOT / "kubemoe", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if any(f.endswith(".py") for f in files):
            found.add(".".join(Path(folder).relative_to(ROOT).parts))
    assert found == set(PYPROJECT["packages"])
