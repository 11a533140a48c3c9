"""Hard-links a venv's files to identical ones in another venv, so both share one copy on disk.

    python envs/link_duplicates.py .venv-skyrl .venv      (what `make skyrl-env` runs after installing)

torch's CUDA libraries (nvidia-*, about 3 GB) and triton are the same wheels in the Python 3.11 and 3.12 venvs;
as uv does from its cache, this links them instead of keeping two copies. Only regular files with the same path
below site-packages, the same size and the same bytes are linked; anything else is left alone. Re-running it
links nothing new. Both venvs must be on one filesystem (else it says so and changes nothing).
"""

from __future__ import annotations

import filecmp
import os
import sys
from pathlib import Path

from shared.config import command_line

SHARED_TREES = ("nvidia", "triton")  # the big, Python-version-independent parts of torch's wheels


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    if not found:
        raise SystemExit(f"error: {venv} has no lib/python3.*/site-packages: is it a venv?")
    return found[0]


def link_duplicates(target: Path, source: Path, trees=SHARED_TREES) -> tuple[int, int]:
    """Replaces files under target/<tree> by hard links to identical files under source/<tree>.

    Both must be on one filesystem. Returns (files linked, bytes saved)."""
    linked = saved = 0
    for tree in trees:
        for path in (target / tree).rglob("*"):
            twin = source / path.relative_to(target)
            if path.is_symlink() or not path.is_file() or twin.is_symlink() or not twin.is_file():
                continue
            mine, theirs = path.stat(), twin.stat()
            if mine.st_ino == theirs.st_ino or mine.st_size != theirs.st_size:
                continue
            if not filecmp.cmp(path, twin, shallow=False):
                continue
            staged = path.with_name(path.name + ".link-tmp")
            os.link(twin, staged)
            os.replace(staged, path)  # atomic: the file is never missing
            linked += 1
            saved += mine.st_size
    return linked, saved


def main(argv=None) -> None:
    parser = command_line("python envs/link_duplicates.py", __doc__, config=False)
    parser.add_argument("target", type=Path, help="the venv whose copies become links (e.g. .venv-skyrl)")
    parser.add_argument("source", type=Path, help="the venv that keeps its files (e.g. .venv)")
    args = parser.parse_args(argv)
    target, source = site_packages(args.target), site_packages(args.source)
    if target.stat().st_dev != source.stat().st_dev:
        print(f"note: {args.target} and {args.source} are on different filesystems: nothing linked")
        return
    linked, saved = link_duplicates(target, source)
    print(f"{args.target}: {linked} files linked to {args.source}'s copies ({saved / 1e9:.1f} GB saved)")


if __name__ == "__main__":
    sys.exit(main())
