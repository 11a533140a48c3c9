"""python -m services.exporter: stage a run's LoRA exports in S3, where Ray Serve LLM loads them.

    make export RUN=tiny-cpu                   # every complete export -> $S3_URI/adapters/<run>-step<N>/
    python -m services.exporter --run RUN --alias maze-grpo --pick best|latest
    python -m services.exporter --run RUN --watch      # export new steps as they appear
    python -m services.exporter list                   # adapters in S3: id, run, step, solve rate, size, age
    python -m services.exporter s3-up | s3-down        # the local S3-compatible endpoint (make s3-up/s3-down)
    python -m services.exporter adopt --run RUN        # seal the exports of a SkyRL run made outside services.trainer

With neither AWS_ENDPOINT_URL nor S3_URI set, a local S3-compatible server is started on loopback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from shared.config import CommandLineParser, add_config_arguments, config_from_args, subcommand
from shared.storage.ids import check_adapter_id

log = logging.getLogger(__name__)

COMMANDS = ("export", "list", "s3-up", "s3-down", "adopt")


def print_table(rows: list[dict]) -> None:
    if not rows:
        print("no adapters")
        return
    print(f"{'adapter_id':<36} {'run':<16} {'step':>5} {'solve_rate':>10} {'size':>10} {'age':>8}")
    for r in rows:
        rate = f"{100 * r['solve_rate']:.1f}%" if r["solve_rate"] is not None else "-"
        age = f"{r['age_s'] // 3600}h{r['age_s'] % 3600 // 60:02d}m" if r["age_s"] >= 3600 else f"{r['age_s'] // 60}m{r['age_s'] % 60:02d}s"
        name = r["adapter_id"] + (f" -> {r['alias_of']}" if r.get("alias_of") else "")
        print(f"{name:<36} {r['run'] or '-':<16} {r['step'] if r['step'] is not None else '-':>5} {rate:>10} {r['size']:>10} {age:>8}")


def adopt(cfg, run_id: str, settle_s: float) -> None:
    """Seals (writes the manifest of) each settled export SkyRL left without one, so readers can use it."""
    from shared.storage.skyrl_exports import adopt_settled_exports
    from shared.storage.volume import SharedVolume

    volume = SharedVolume(cfg.shared_path())
    sealed, settling = adopt_settled_exports(volume, run_id, settle_s)
    for step in sealed:
        log.info(f"sealed {volume.export(run_id, step)}")
    for step in settling:
        log.info(f"not yet: {volume.export(run_id, step)} changed in the last {settle_s:g} s (still being written?); "
              "run adopt again later")
    if not sealed and not settling:
        log.info(f"nothing to adopt: every export of {run_id} with its adapter files already has a manifest")


def main(argv: list[str] | None = None) -> None:
    command, argv = subcommand(argv, COMMANDS, "export")
    parser = exporter_parser(command)
    args = parser.parse_args(argv)
    if stray := next((word for word in args.overrides if "=" not in word), None):
        parser.error(f"unknown command {stray!r}: a command comes first, one of {', '.join(COMMANDS)}")
    for flag, value in (("--run", args.run), ("--alias", args.alias)):
        try:
            value is None or check_adapter_id(value, f"{flag} value")
        except ValueError as exc:
            parser.error(str(exc))
    cfg = config_from_args(args)
    if command == "adopt":
        return adopt(cfg, args.run or cfg.run_id, args.settle)
    if command in ("s3-up", "s3-down"):
        return local_s3_command(command, cfg)
    export_command(command, cfg, args)


def exporter_parser(command: str) -> argparse.ArgumentParser:
    """Returns the parser of `python -m services.exporter [COMMAND]`."""
    parser = CommandLineParser(prog="python -m services.exporter" + ("" if command == "export" else f" {command}"),
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--run", default=None, help="run id whose exports to stage (default: the profile's run_id)")
    parser.add_argument("--alias", default=None, help="also publish the chosen step under this adapter id")
    parser.add_argument("--pick", choices=["best", "latest"], default="best", help="which step the alias points at")
    parser.add_argument("--watch", action="store_true", help="keep exporting new steps as they appear")
    parser.add_argument("--poll", type=float, default=30.0, help="seconds between --watch passes")
    parser.add_argument("--settle", type=float, default=60.0, help="adopt: seconds an export's files must be unchanged")
    return parser


def local_s3_command(command: str, cfg) -> None:
    """s3-up / s3-down: starts or stops the local S3-compatible endpoint on loopback."""
    from shared.storage import local_s3

    if command == "s3-up":
        state = local_s3.up(cfg.shared_path())
        log.info(f"local S3 endpoint up: AWS_ENDPOINT_URL={state['endpoint_url']} S3_URI={state['s3_uri']}")
        return
    try:
        stopped = local_s3.down(cfg.shared_path())
    except RuntimeError as exc:
        sys.exit(f"error: {exc}")
    log.info("local S3 endpoint stopped" if stopped else "no local S3 endpoint was running")


def export_command(command: str, cfg, args) -> None:
    """export (once, or with --watch as new steps appear) or list: the run's exports and the adapters in S3."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    from services.exporter.export import Exporter, adapter_table
    from shared.storage import local_s3
    from shared.storage.adapters import AdapterStore

    try:
        cfg = local_s3.resolve_s3(cfg)
        store = AdapterStore.from_config(cfg)
        if command == "list":
            print_table(adapter_table(store))
            return
        run_id = args.run or cfg.run_id
        exporter = Exporter(cfg, store)
        while True:
            results = exporter.export_run(run_id, args.alias, args.pick)
            if not args.watch:
                if not results:
                    sys.exit(f"run {run_id} has no complete, valid export under {exporter.volume.exports(run_id)}")
                return
            time.sleep(args.poll)
    except (BotoCoreError, ClientError, S3UploadFailedError) as exc:
        sys.exit(f"error: S3 at {cfg.storage.aws_endpoint_url or 'AWS'} ({cfg.storage.s3_uri}) failed after retries: {exc}")
    except ValueError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
