"""envs/link_duplicates.py: identical files become one copy on disk; anything else is left alone."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("link_duplicates", ROOT / "envs" / "link_duplicates.py")
link_duplicates = importlib.util.module_from_spec(spec)
spec.loader.exec_module(link_duplicates)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_links_identical_files_and_leaves_the_rest(tmp_path):
    target, source = tmp_path / "a" / "site-packages", tmp_path / "b" / "site-packages"
    same = write(target / "nvidia" / "lib" / "libx.so", b"x" * 1000)
    write(source / "nvidia" / "lib" / "libx.so", b"x" * 1000)
    differs = write(target / "nvidia" / "lib" / "liby.so", b"y" * 1000)
    write(source / "nvidia" / "lib" / "liby.so", b"z" * 1000)  # same size, other bytes
    alone = write(target / "triton" / "only-here.py", b"print()")
    outside = write(target / "torch" / "libz.so", b"w" * 10)
    write(source / "torch" / "libz.so", b"w" * 10)  # identical, but torch is not a shared tree

    linked, saved = link_duplicates.link_duplicates(target, source)

    assert (linked, saved) == (1, 1000)
    assert same.stat().st_ino == (source / "nvidia" / "lib" / "libx.so").stat().st_ino
    assert same.read_bytes() == b"x" * 1000
    assert differs.read_bytes() == b"y" * 1000 and differs.stat().st_nlink == 1
    assert alone.read_bytes() == b"print()"
    assert outside.stat().st_nlink == 1
    assert link_duplicates.link_duplicates(target, source) == (0, 0)  # a re-run links nothing new
