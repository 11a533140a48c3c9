"""python -m services.trainer: GRPO post-training of a VLM on visual mazes (what `make train` runs).

    python -m services.trainer --config configs/tiny-cpu.yaml [key.path=value ...]

Backends: `local` (Ray actors + transformers + peft, CPU or GPU; the default) and `skyrl` (SkyRL with
vLLM and FSDP on a GPU cluster). RAY_ADDRESS picks a cluster; without it Ray starts in-process.
The tiny model and its SFT warm-start are built first when the profile bootstraps them.
"""

from __future__ import annotations

import argparse
import sys

from shared.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="run profile (default: configs/tiny-cpu.yaml)")
    parser.add_argument("--backend", choices=["local", "skyrl"], default=None, help="override the profile's backend")
    parser.add_argument("overrides", nargs="*", help="key.path=value config overrides, e.g. schedule.total_steps=5")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + ([f"backend={args.backend}"] if args.backend else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        sys.exit(str(exc))
    if cfg.backend == "skyrl":
        sys.exit("the skyrl backend is not implemented yet (issue #6); use backend=local")
    from services.trainer.grpo import Trainer

    Trainer(cfg).run()


if __name__ == "__main__":
    main()
