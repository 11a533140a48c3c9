"""The trainer GPU image's dependencies resolve: uv resolves docker/gpu-requirements.txt with the flags
docker/Dockerfile.gpu installs it with, for Python 3.12 on manylinux x86_64, and any conflict fails the test."""

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile.gpu"
REQUIREMENTS = REPO / "docker" / "gpu-requirements.txt"
PLATFORM = "x86_64-manylinux_2_35"  # the GPU bases (Ubuntu 22.04) have glibc 2.35
# What SkyRL's build takes from its own wheel indexes (the Dockerfile's GPU_WHEEL_INDEXES), which this machine
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


def metadata_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                       + "".join(f"Requires-Dist: {r}\n" for r in requires))
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def trainer_stage() -> str:
    return DOCKERFILE.read_text().split("AS trainer", 1)[1].split("\nFROM ", 1)[0]


def test_dockerfile_installs_exactly_the_resolved_requirements():
    stage = trainer_stage()
    install = re.search(r"uv pip install (.*?)-r docker/gpu-requirements.txt", stage, flags=re.S)
    assert install and "--index-strategy unsafe-best-match" in install.group(1) and "--extra-index-url" in install.group(1)
    assert stage.count("pip install") == 2, "uv itself, then the one resolved install"
    uv_version = re.search(r"ARG UV_VERSION=(\S+)", DOCKERFILE.read_text()).group(1)
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert f"uv=={uv_version}" in dev, "the test resolves with the image's uv"
    cpu_images = re.search(r"ARG UV_VERSION=(\S+)", (REPO / "docker" / "Dockerfile").read_text()).group(1)
    assert cpu_images == uv_version, "the CPU images, the GPU image and the venvs install with one uv"
    indexes = re.search(r'ARG GPU_WHEEL_INDEXES="([^"]+)"', DOCKERFILE.read_text()).group(1).split()
    assert any("astral" in i for i in indexes) and any("flashinfer" in i for i in indexes)


@pytest.mark.slow
def test_trainer_image_dependencies_resolve_for_python_312(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    lines = [line.strip() for line in REQUIREMENTS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0] == ".[trainer,gpu]"
    for line in lines[1:]:
        name, version = line.split("==")
        metadata_wheel(links, name, version, FROM_SKYRL_INDEXES[name])
    for kernels in ("flashinfer-jit-cache", "flashinfer-cubin"):
        metadata_wheel(links, kernels, FLASHINFER_KERNELS, FROM_SKYRL_INDEXES[kernels])

    lock = tmp_path / "gpu-lock.txt"
    uv = Path(sys.executable).parent / "uv"
    proc = subprocess.run([str(uv), "pip", "compile", "--no-config", "--quiet", "--index-strategy", "unsafe-best-match",
                           "--find-links", str(links), "--python-version", "3.12", "--python-platform", PLATFORM,
                           str(REQUIREMENTS.relative_to(REPO)), "-o", str(lock)],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"the trainer GPU image's dependencies do not resolve:\n{proc.stderr[-4000:]}"

    resolved = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", lock.read_text(), flags=re.M))
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    transformers_pin = next(r for r in pins["models"] if r.startswith("transformers==")).split("==")[1]
    assert resolved["transformers"] == transformers_pin, "one transformers for the CPU and GPU images"
    skyrl_pin = next(r for r in pins["gpu"] if r.startswith("skyrl")).split("==")[1]
    assert resolved["skyrl"] == skyrl_pin and resolved["ray"] == "2.57.0"
    assert resolved["torch"].startswith("2.13.") and "vllm" in resolved
    assert resolved["flash-attn"] == "2.8.3+cu.13.0.torch.2.13"
