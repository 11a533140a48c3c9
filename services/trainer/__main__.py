"""python -m services.trainer: GRPO post-training of a VLM on visual mazes (what `make train` runs).

    python -m services.trainer --config configs/tiny-cpu.yaml [key.path=value ...]
    python -m services.trainer --backend skyrl --config configs/qwen3vl-8b-hyperpod.yaml [--dry-run | --preflight]
    python -m services.trainer submit --config ... [--force | --dry-run]   # a Ray job on RAY_ADDRESS (make submit)

Backends: `local` (Ray actors + transformers + peft, CPU or GPU; the default) and `skyrl` (SkyRL with
vLLM and FSDP on a GPU cluster). RAY_ADDRESS picks a cluster; without it Ray starts in-process.
The tiny model and its SFT warm-start are built first when the profile bootstraps them.
"""

from __future__ import annotations

import errno
import logging
import shlex
import sys
from pathlib import Path

from shared.config import DEFAULT_CONFIG, SECRET_KEYS, ConfigError, command_line, config_from_args, subcommand

log = logging.getLogger(__name__)


def submit_dry_run(cfg, config_path: str, overrides: list[str], forward: tuple[str, ...]) -> None:
    """`submit --dry-run`: prints where the job would go and what it would run (for a skyrl profile, SkyRL's
    overrides too); submits nothing and writes nothing outside a temp folder."""
    from services.trainer import skyrl_backend
    from services.trainer.submit import PreflightError, job_spec, submission_address

    try:
        address = submission_address(cfg)
    except (SystemExit, PreflightError) as exc:
        address = f"(none: {exc})"
    entrypoint, runtime_env = job_spec(cfg, config_path, overrides, forward=forward)
    print(f"# would submit to {address}: {entrypoint}")
    print(f"# with the working dir {runtime_env['working_dir']} and the variables "
          f"{', '.join(sorted(runtime_env['env_vars'])) or '(none)'}; nothing was submitted")
    if cfg.backend == "skyrl":
        try:
            skyrl_backend.dry_run(cfg, config_path)
        except skyrl_backend.SkyRLRejected as exc:
            sys.exit(f"error: {exc}")


def main(argv: list[str] | None = None) -> None:
    argv_given = argv
    argv = sys.argv[1:] if argv is None else argv
    which, arguments = subcommand(argv, ("submit",), "train")
    submitting = which == "submit"
    args = trainer_parser(submitting).parse_intermixed_args(arguments)
    backend = [f"backend={args.backend}"] if args.backend else []
    cfg = config_from_args(args, backend)
    overrides = list(args.overrides) + backend
    if submitting:
        return submit_job(cfg, args, overrides)
    from services.trainer import skyrl_backend  # SkyRL itself is imported only when a skyrl run starts

    if (args.dry_run or args.preflight) and cfg.backend != "skyrl":
        sys.exit("--dry-run and --preflight apply to the skyrl backend (they check SkyRL's config); the local backend just runs")
    if args.dry_run:
        try:
            skyrl_backend.dry_run(cfg, args.config)
        except skyrl_backend.SkyRLRejected as exc:
            sys.exit(f"error: {exc}")
        return
    if argv_given is None and cfg.backend == "local" and not cfg.cluster.ray_address:
        from shared.local_ray import enter_loopback

        enter_loopback()  # the in-process Ray listens on loopback only (re-runs this command once)
    train(cfg, args, argv)


def trainer_parser(submitting: bool):
    """Returns the parser of `python -m services.trainer` (or of its submit command)."""
    parser = command_line("python -m services.trainer" + (" submit" if submitting else ""), __doc__)
    parser.add_argument("--backend", choices=["local", "skyrl"], default=None, help="override the profile's backend")
    parser.add_argument("--dry-run", action="store_true",
                        help="skyrl: print SkyRL's overrides (validated by SkyRL where it is installed) and the command, run nothing; "
                             "with submit: print the job it would submit, submit nothing")
    parser.add_argument("--preflight", action="store_true",
                        help="skyrl: run the set-up up to the GPU work (SkyRL config, Ray runtime env, env in a worker), then exit")
    parser.add_argument("--allow-changed-settings", action="store_true",
                        help="continue a run whose checkpoint was trained with other settings (and score again its "
                             "evals that were played under other settings) instead of stopping")
    if submitting:
        parser.add_argument("--force", action="store_true", help="submit even if the HyperPod preflight finds a mismatch")
        parser.add_argument("--no-follow", action="store_true", help="return after submitting instead of streaming logs")
        parser.add_argument("--timeout", type=float, default=None, help="stop following after this many seconds")
        parser.add_argument("--record-dir", default=None,
                            help="where this machine records the job (<dir>/<run_id>.json; default: ~/.local/state/maze-grpo/jobs/)")
        parser.add_argument("--forward-env", action="append", default=[], metavar="NAME",
                            help="also send this shell's NAME to the job (e.g. SHARED_DIR; by default the job uses the "
                                 "cluster's own storage); repeatable")
    return parser


def submit_job(cfg, args, overrides: list[str]) -> None:
    """`submit`: sends the run to RAY_ADDRESS as a Ray job (or, with --dry-run, prints what it would send)."""
    config_path = args.config or str(DEFAULT_CONFIG)
    if args.dry_run:
        return submit_dry_run(cfg, config_path, overrides, tuple(args.forward_env))
    from services.trainer.submit import RECORD_DIR, PreflightError, submit

    try:
        record = submit(cfg, config_path, overrides, force=args.force, follow=not args.no_follow,
                        timeout_s=args.timeout, preflight=args.preflight,
                        record_dir=Path(args.record_dir) if args.record_dir else RECORD_DIR,
                        forward=tuple(args.forward_env))
    except PreflightError as exc:
        sys.exit(f"error: {exc}")
    if record.get("status") not in (None, "SUCCEEDED"):
        sys.exit(1)


def train(cfg, args, argv: list[str]) -> None:
    """Runs the training (or the skyrl preflight) under the run's lock, every line also in the run's train.log;
    exits with one line on an error the user can act on."""
    from services.trainer import skyrl_backend
    from services.trainer.run_lock import RunLock, RunLocked
    from shared.logs import log_to_file, stop_logging_to
    from shared.models import ModelLoadError, check_model_dir
    from shared.storage.files import DamagedFile
    from shared.storage.volume import SharedVolume

    run_dir = SharedVolume(cfg.shared_path()).run(cfg.run_id)
    try:
        with RunLock(run_dir, warn=log.warning):
            file_log = log_to_file(run_dir / "train.log")  # every line of the run, with its time
            if args.preflight:
                skyrl_backend.preflight(cfg)
            elif cfg.backend == "skyrl":
                skyrl_backend.run(cfg)
            else:
                if cfg.model.bootstrap == "none":  # the model is the user's folder: checked before torch's import
                    check_model_dir(SharedVolume(cfg.shared_path()).model(cfg.model.path))
                from services.trainer.algorithm import TrainingStopped
                from services.trainer.grpo import Trainer

                try:
                    command = shlex.join(["python", "-m", "services.trainer", *masked(argv)])
                    Trainer(cfg, allow_changed_settings=args.allow_changed_settings, command=command).run()
                except TrainingStopped as exc:
                    log.error(str(exc))  # on the terminal and in train.log
                    sys.exit(1)
            stop_logging_to(file_log)
    except ConfigError as exc:
        sys.exit(str(exc))  # already one line that starts "config error:"
    except (RunLocked, ModelLoadError, skyrl_backend.SkyRLRejected, DamagedFile) as exc:
        sys.exit(f"error: {exc}")
    except OSError as exc:  # the volume itself: read-only, full, or not ours to write
        sys.exit(f"error: {volume_error(exc, cfg)}")


def masked(argv: list[str]) -> list[str]:
    """Returns the arguments with the value of every secret override (an API key, a token) masked, as the model card
    that records the command is published."""
    return [f"{arg.split('=', 1)[0]}=***" if arg.split("=", 1)[0].strip() in SECRET_KEYS else arg for arg in argv]


def volume_error(exc: OSError, cfg) -> str:
    """Returns one line for an OSError from the shared volume, saying what it means for the run's files."""
    where = f"{exc.filename}" if exc.filename else f"SHARED_DIR ({cfg.shared_path()})"
    if exc.errno == errno.ENOSPC:
        return (f"the disk is full (writing {where}); nothing is lost: every file is written to a temporary name and "
                "renamed, so the last complete checkpoint and export are intact. Free some space and run the same "
                "command again to resume")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (f"cannot write {where} ({exc.strerror}): SHARED_DIR must be a folder this user can write; point "
                "SHARED_DIR (storage.shared_dir) at one")
    return f"{exc.strerror or exc} ({where})"


if __name__ == "__main__":
    main()
