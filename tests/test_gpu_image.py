"""The trainer GPU image's dependencies resolve: pip resolves docker/gpu-requirements.txt exactly as
docker/Dockerfile.gpu installs it, for Python 3.12 on manylinux x86_64, and any conflict fails the test."""

import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "docker" / "gpu-requirements.txt"
GLIBC_MINOR = 35  # the GPU bases (Ubuntu 22.04) have glibc 2.35: wheels up to manylinux_2_35 install there
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
# What SkyRL's build takes from its own wheel indexes (Dockerfile.gpu's GPU_WHEEL_INDEXES), which this machine
# cannot reach: the resolver gets each as a wheel holding only its metadata, with the dependencies the real
# package declares (flash-attn's and causal-conv1d's setup.py in their sources on the package index; FlashInfer's
# prebuilt kernel wheels declare none). Versions: the pins in gpu-requirements.txt and in skyrl[fsdp]'s metadata.
FROM_SKYRL_INDEXES = {
    "flash-attn": ["torch", "einops"],
    "causal-conv1d": ["torch", "packaging", "ninja"],
    "flashinfer-jit-cache": [],
    "flashinfer-cubin": [],
}
FLASHINFER_KERNELS = "0.6.18.post1"  # skyrl[fsdp]==0.4.0's pin for both FlashInfer kernel wheels
# On the package index as sources only (pure Python; the toolkit at the trainer extra's pin): pip builds them
# inside the image, this test beforehand.
SOURCE_ONLY = ["func_timeout"]


def metadata_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                       + "".join(f"Requires-Dist: {r}\n" for r in requires))
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def pip(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)


def requirement_lines() -> list[str]:
    return [line.strip() for line in REQUIREMENTS.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_dockerfile_installs_exactly_the_resolved_requirements():
    dockerfile = (REPO / "docker" / "Dockerfile.gpu").read_text()
    trainer = dockerfile.split("AS trainer", 1)[1].split("\nFROM ", 1)[0]
    assert "-r docker/gpu-requirements.txt" in trainer and "--extra-index-url" in trainer
    assert re.findall(r"^RUN pip install", trainer, flags=re.M) == ["RUN pip install"], "one install, the resolved one"
    indexes = re.search(r'ARG GPU_WHEEL_INDEXES="([^"]+)"', dockerfile).group(1).split()
    assert any("astral" in i for i in indexes) and any("flashinfer" in i for i in indexes)
    assert requirement_lines()[0] == ".[trainer,gpu]"


@pytest.mark.slow
def test_trainer_image_dependencies_resolve_for_python_312(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    proc = pip("wheel", "-q", "--no-deps", "-w", str(links), str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    project_wheel = next(links.glob("maze_grpo-*.whl"))
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    toolkit = next(r for r in pins["trainer"] if r.startswith("toolkit-for-ray-on-sagemaker-ai"))
    for source in [toolkit, *SOURCE_ONLY]:
        proc = pip("wheel", "-q", "--no-deps", "-w", str(links), source, timeout=300)
        assert proc.returncode == 0, f"{source}: {proc.stderr[-1000:]}"

    requirements = []
    for line in requirement_lines():
        if line.startswith(".["):
            requirements.append(f"maze-grpo{line[1:]} @ {project_wheel.as_uri()}")
            continue
        name, version = line.split("==")
        metadata_wheel(links, name, version, FROM_SKYRL_INDEXES[name])
        requirements.append(line)
    for kernels in ("flashinfer-jit-cache", "flashinfer-cubin"):
        metadata_wheel(links, kernels, FLASHINFER_KERNELS, FROM_SKYRL_INDEXES[kernels])

    report = tmp_path / "report.json"
    args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--find-links", str(links)]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    proc = pip(*args, *requirements, timeout=1200)
    errors = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("WARNING: Location"))
    assert proc.returncode == 0, f"the trainer GPU image's dependencies do not resolve:\n{errors[-4000:]}"

    installed = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                 for item in json.loads(report.read_text())["install"]}
    transformers_pin = next(r for r in pins["models"] if r.startswith("transformers==")).split("==")[1]
    assert installed["transformers"] == transformers_pin, "one transformers for CPU and GPU images"
    skyrl_pin = next(r for r in pins["gpu"] if r.startswith("skyrl")).split("==")[1]
    assert installed["skyrl"] == skyrl_pin
    assert installed["torch"].startswith("2.13.") and installed["vllm"] and installed["ray"] == "2.57.0"
    assert installed["flash-attn"] == "2.8.3+cu.13.0.torch.2.13"
