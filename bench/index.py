"""bench/README.md's index as data: one row a script, what its tiny mode runs in.

The README's table is the one list of the benchmarks; the tests read it here to run every
script's tiny mode (`python -m bench.NAME --tiny`) in the venv its row names, and to find a
script the table leaves out. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
TINY_VENVS = ("rollout", "trainer")  # where `make test` runs the tiny modes (its two pytest runs)
# A row of the table: | [name](file) | measures | section | needs | tiny |
ROW = re.compile(r"^\| \[(?P<file>[\w.]+)\]\((?P=file)\) \|(?P<cells>.*)\|$")
PROGRAM = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)


@dataclass(frozen=True)
class Script:
    file: str  # its file in bench/, e.g. "spool_roundtrip.py"
    measures: str
    section: str  # the docs/BENCHMARKS.md section its figures feed
    needs: str  # what a real run needs: a venv, TRL's venv, a GPU
    tiny: str  # the venv its tiny mode runs in (TINY_VENVS), or "none: why"

    @property
    def module(self) -> str:
        return "bench." + self.file.removesuffix(".py")


def scripts(readme: Path = README) -> list[Script]:
    """The rows of the index table, in order."""
    found = []
    for line in readme.read_text().splitlines():
        row = ROW.match(line.strip())
        if row:
            cells = [cell.strip() for cell in row["cells"].split("|")]
            if len(cells) != 4:
                raise ValueError(f"{readme}: a row of the index needs 5 cells: {line}")
            found.append(Script(row["file"], *cells))
    return found


def script_files(directory: Path = HERE) -> list[str]:
    """The scripts of bench/: every module run as a program, and the shell tools."""
    return sorted(
        path.name
        for path in directory.iterdir()
        if path.suffix == ".sh" or (path.suffix == ".py" and PROGRAM.search(path.read_text()))
    )
