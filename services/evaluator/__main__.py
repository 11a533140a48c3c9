"""python -m services.evaluator: the 64 held-out mazes against a checkpoint, an adapter or an endpoint.

    make eval RUN=tiny-cpu                                  # the run's latest LoRA export, in-process
    python -m services.evaluator --model DIR [--adapter EXPORT_DIR | --adapter S3_ADAPTER_ID]
    python -m services.evaluator --base-url http://127.0.0.1:8000 --model-name tiny-qwen3vl-sft:ADAPTER
    python -m services.evaluator --compare EVAL_DIR_A EVAL_DIR_B --out DIR
    python -m services.evaluator --watch RUN_ID [--base-url URL]   # evaluate each new export as it lands
    python -m services.evaluator play [--seed 7]            # play against the server (make play)

Writes summary.json, episodes.jsonl, gifs/ and report.html to runs/<run>/evals/<name>/ or --out.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

from services.evaluator.report import write_comparison, write_gifs, write_report
from shared.config import CommandLineParser, RunConfig, add_config_arguments, config_from_args, reveal, subcommand
from shared.episodes import EpisodeSettings
from shared.evaluation import describe, evaluate
from shared.evaluation.plots import plot_solve_rate
from shared.evaluation.skyrl import skyrl_eval_metrics
from shared.machine import host_info, machine_info
from shared.maze.dataset import EvalSet, parse_seeds
from shared.models import ModelLoadError, check_adapter_dir, check_model_dir
from shared.storage.files import append_jsonl, atomic_write_json, read_jsonl, writable_folder
from shared.storage.ids import check_run_id
from shared.storage.manifest import sha256_file
from shared.storage.volume import SharedVolume
from shared.storage.volume import complete_exports as storage_complete_exports

log = logging.getLogger(__name__)


def resolve_adapter(cfg: RunConfig, adapter: str | None) -> Path | None:
    """Returns a local adapter folder: an export folder as is, or an S3 adapter id fetched into the cache."""
    if not adapter:
        return None
    path = Path(adapter)
    if path.exists():
        return path
    from shared.storage.adapters import AdapterStore

    return AdapterStore.from_config(cfg).fetch(adapter)


def identity(model_dir: Path, adapter_dir: Path | None) -> dict:
    """Returns hashes that pin down exactly what was evaluated."""
    ident = {"model_sha256": sha256_file(model_dir / "model.safetensors") if (model_dir / "model.safetensors").exists() else None}
    if adapter_dir:
        ident["adapter_sha256"] = sha256_file(adapter_dir / "adapter_model.safetensors")
    return ident


def finish(out: Path, summary: dict, gifs: bool, cell_px: int) -> None:
    if gifs:
        write_gifs(out, cell_px)
    write_report(out)
    log.info(describe(summary))
    log.info(f"report: {out / 'report.html'}")


def exit_on_errors(summaries: list[dict], out: Path | str) -> None:
    """Exits non-zero with one line when any maze could not be scored (its engine failed): the score is not real."""
    errors = sum(s.get("errors", 0) for s in summaries)
    if errors:
        total = sum(s["total"] for s in summaries)
        first = next((s["first_error"] for s in summaries if s.get("first_error")), "")
        sys.exit(f"error: {errors} of {total} mazes could not be scored (the engine failed{': ' + first if first else ''}; "
                 f"see the `error` field in {Path(out) / 'episodes.jsonl'}): the solve rate above is not a measurement")


def turn_budget(value: str) -> int:
    """argparse type: a positive number of turns (the config's env.max_turns range, 1..200)."""
    try:
        turns = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of turns (e.g. 15)") from None
    if not 1 <= turns <= 200:
        raise argparse.ArgumentTypeError(f"{turns} turns is out of range: use 1..200 (e.g. 15)")
    return turns


def sample_count(value: str) -> int:
    """argparse type: episodes per maze (1..64)."""
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of samples (e.g. 8)") from None
    if not 1 <= count <= 64:
        raise argparse.ArgumentTypeError(f"{count} samples per maze is out of range: use 1..64 (e.g. 8)")
    return count


def run_id_arg(value: str) -> str:
    """argparse type: a run id or evaluation name (a plain folder name, never a path)."""
    try:
        return check_run_id(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def eval_folder(value: str) -> Path:
    """argparse type: an evaluation folder (one holding summary.json and episodes.jsonl)."""
    path = Path(value)
    if not (path / "summary.json").is_file() or not (path / "episodes.jsonl").is_file():
        raise argparse.ArgumentTypeError(f"{value} is not an evaluation folder (no summary.json + episodes.jsonl there); "
                                         "pass folders the evaluator wrote, e.g. runs/<run>/evals/<name>")
    return path


def eval_local(cfg: RunConfig, eval_set: EvalSet, model_dir: Path, adapter_dir: Path | None, out: Path, gifs=True,
               settings: EpisodeSettings | None = None, samples: int = 1) -> dict:
    check_model_dir(model_dir)  # before torch's import: a wrong path answers at once
    if adapter_dir:
        check_adapter_dir(adapter_dir)
    from shared.models.inference import LocalEngine  # torch: imported once a model is to be run

    engine = LocalEngine.from_config(cfg, model_dir, adapter_dir)
    summary, _ = evaluate(engine, eval_set, settings or EpisodeSettings.from_config(cfg), out, model=str(model_dir),
                          adapter=str(adapter_dir) if adapter_dir else None, extra=identity(model_dir, adapter_dir),
                          samples=samples, seed=cfg.seed, progress="eval" if len(eval_set.seeds) * samples > 64 else None)
    finish(out, summary, gifs and samples == 1, cfg.env.cell_px)
    return summary


def eval_endpoint(cfg: RunConfig, eval_set: EvalSet, engine, base_url: str, out: Path, gifs=True,
                  settings: EpisodeSettings | None = None, samples: int = 1) -> dict:
    """Plays eval_set through an endpoint engine into `out` (summary, episodes, report); returns the summary."""
    summary, _ = evaluate(engine, eval_set, settings or EpisodeSettings.from_config(cfg), out, model=engine.name,
                          adapter=engine.adapter, extra={"base_url": base_url}, samples=samples, seed=cfg.seed,
                          machine=endpoint_machine(base_url))
    finish(out, summary, gifs and samples == 1, cfg.env.cell_px)
    return summary


def endpoint_machine(base_url: str) -> dict:
    """What a summary of play through an endpoint knows of its machine: the replies came from the server at base_url
    (its CPU or GPU decides their numbers); this client, without torch, only drew the mazes and parsed the replies."""
    return {"replies_from": base_url, "client": host_info()}


def endpoint_engine(cfg: RunConfig, base_url: str, model_name: str | None, deadline_s: float = 120.0):
    """Returns an OpenAI-endpoint engine with SERVER_API_KEY, the profile's context limits and a request deadline."""
    from shared.models.endpoint import OpenAIEngine

    return OpenAIEngine(base_url, model_name or cfg.model.base_model_id, api_key=reveal(cfg.server.api_key),
                        max_images_in_context=cfg.model.max_images_in_context,
                        max_turns_in_context=cfg.model.max_turns_in_context, deadline_s=deadline_s)


def finite_number(what: str, low: float, high: float, example: str, low_excluded: bool = False):
    """Returns an argparse type: a finite float in [low, high] ((low, high] with `low_excluded`), named `what`."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number (e.g. {example})") from None
        inside = math.isfinite(number) and (low < number if low_excluded else low <= number) and number <= high
        if not inside:
            raise argparse.ArgumentTypeError(f"{value!r} is not {what} (e.g. {example})")
        return number

    return parse


positive_seconds = finite_number("a positive, finite number of seconds", 0, math.inf, "120", low_excluded=True)
temperature_arg = finite_number("a temperature: a finite number in 0..10, 0 for greedy", 0, 10, "0.7")


def complete_exports(volume: SharedVolume, run_id: str) -> list[tuple[int, Path]]:
    return storage_complete_exports(volume, run_id, warn=log.warning)


def watch(cfg: RunConfig, eval_set: EvalSet, run_id: str, once: bool, poll_s: float, base_url: str | None = None,
          deadline_s: float = 120.0) -> None:
    """Evaluates each complete export of a run once; keeps history.jsonl and solve_rate_vs_step.png.

    In-process by default; with `base_url`, through that endpoint (a vLLM server on a GPU: an 8B model in minutes,
    where CPU takes hours), asking for each export by the id the exporter gives it, `<base>:<run>-step<N>`; an
    export the endpoint does not list yet is left for a later pass. On a SkyRL run, each history row also carries
    `skyrl_solve_rate`: SkyRL's own eval of that step (`eval/all/environment/solved` from its eval dumps), printed
    beside ours.
    """
    volume = SharedVolume(cfg.shared_path())
    model_dir = volume.model(cfg.model.path)
    history_path = volume.run(run_id) / "evals" / "watch" / "history.jsonl"
    listing = endpoint_engine(cfg, base_url, None, deadline_s) if base_url else None
    while True:
        done = {int(r["step"]) for r in read_jsonl(history_path)}
        skyrl_evals = skyrl_eval_metrics(volume.run(run_id))  # once a pass: SkyRL's eval dumps, if any
        served = listing.served_models() if listing else set()
        for step, policy in complete_exports(volume, run_id):
            if step in done:
                continue
            out = volume.eval(run_id, f"watch_step_{step}")
            if base_url:
                name = f"{cfg.model.base_model_id}:{run_id}-step{step}"
                if name not in served:
                    log.warning(f"step {step}: {base_url} does not serve {name} yet (the exporter publishes it: "
                                f"python -m services.exporter --run {run_id}); left for a later pass")
                    continue
                summary = eval_endpoint(cfg, eval_set, endpoint_engine(cfg, base_url, name, deadline_s), base_url, out,
                                        gifs=False)
            else:
                summary = eval_local(cfg, eval_set, model_dir, policy, out, gifs=False)
            if summary["errors"]:  # not a measurement: left out of the history, tried again next pass
                log.warning(f"step {step}: {summary['errors']} mazes could not be scored; will retry")
                if once:
                    exit_on_errors([summary], out)
                continue
            row = {"step": step, **summary}
            skyrl = skyrl_evals.get(step)
            if skyrl is not None:
                row["skyrl_solve_rate"], row["skyrl_pass_at_1"] = skyrl["solve_rate"], skyrl["pass_at_1"]
                passed = f"{skyrl['pass_at_1']:.1%}" if skyrl["pass_at_1"] is not None else "not logged"
                log.info(f"step {step}: SkyRL's in-loop eval solved {skyrl['solve_rate']:.1%} (eval/all/environment/solved); "
                         f"its pass_at_1 (reward above 0, AWS's kind of number) {passed}")
            append_jsonl(history_path, row)
        history = sorted(read_jsonl(history_path), key=lambda r: r["step"])
        if history:
            plot_solve_rate(history_path.parent / "solve_rate_vs_step.png", [r["step"] for r in history],
                            [r["solve_rate"] for r in history], history[0]["oracle_solved"] / history[0]["total"], run_id)
        if once:
            return
        time.sleep(poll_s)


def play(argv: list[str]) -> None:
    """Plays maze episodes against the server (the evaluator's endpoint mode); one seed writes its GIF."""
    parser = CommandLineParser(prog="python -m services.evaluator play",
                                     description="Play full maze episodes against an OpenAI-compatible server.")
    add_config_arguments(parser)
    parser.add_argument("--base-url", default=None,
                        help="the server (default: server.url, from SERVER_URL, else http://127.0.0.1:<server.port>)")
    parser.add_argument("--model-name", default=None, help="base or base:adapter (default: the profile's base model)")
    parser.add_argument("--seed", type=int, default=None, help="play this one maze and write its GIF")
    parser.add_argument("--out", default="play", help="folder for the GIF / results")
    parser.add_argument("--request-deadline", type=positive_seconds, default=120.0, metavar="SECONDS",
                        help="the most one request (its retries included) may take (default 120)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    engine = endpoint_engine(cfg, args.base_url or cfg.server.url or f"http://127.0.0.1:{cfg.server.port}",
                             args.model_name, args.request_deadline)
    try:
        engine.check()
    except ConnectionError as exc:
        sys.exit(f"error: {exc}")
    seeds = [args.seed] if args.seed is not None else parse_seeds(cfg.env.eval_seeds)
    eval_set = EvalSet(cfg.env.eval_env, seeds, cfg.env.max_turns)
    out = Path(args.out)
    summary, episodes = evaluate(engine, eval_set, EpisodeSettings.from_config(cfg), out, model=engine.name,
                                 adapter=engine.adapter, machine=endpoint_machine(engine.base_url))
    if args.seed is not None:
        write_gifs(out, cfg.env.cell_px)
        episode = episodes[0]
        for turn in episode.turns:
            log.info(f"  {turn.text!r:28} -> {turn.feedback} at {turn.position}")
        log.info(f"seed {args.seed}: {'solved' if episode.solved else 'not solved'} in {len(episode.turns)} turns; "
                 f"GIF: {out / 'gifs' / f'seed_{args.seed}.gif'}")
    else:
        write_report(out)
        log.info(describe(summary))
    exit_on_errors([summary], out)


def diagnose_command(argv: list[str]) -> None:
    """Measures where a policy's greedy play has headroom (one flip, step back, junction accuracy)."""
    from services.evaluator.diagnose import describe_diagnosis, diagnose

    parser = CommandLineParser(prog="python -m services.evaluator diagnose",
                               description="Measure a policy's headroom before training: the share of greedy failures "
                                           "one changed decision or one step back rescues, and its teacher-forced "
                                           "accuracy at junctions along the solver's path. Writes diagnosis.json.")
    add_config_arguments(parser)
    parser.add_argument("--model", default=None, help="model folder (default: the profile's model.path)")
    parser.add_argument("--adapter", default=None, help="LoRA export folder, or an adapter id in $S3_URI/adapters/")
    parser.add_argument("--seeds", default="extended", help="eval seeds: A-B, A,B,C, or 'extended' (the default: "
                        "the profile's extended held-out set)")
    parser.add_argument("--out", default="diagnosis", help="output folder (default: diagnosis/)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    eval_set = eval_set_from(cfg, args.seeds, None)
    model_dir = Path(args.model) if args.model else SharedVolume(cfg.shared_path()).model(cfg.model.path)
    from shared.models.inference import LocalEngine

    try:
        engine = LocalEngine.from_config(cfg, model_dir, resolve_adapter(cfg, args.adapter))
    except (ModelLoadError, FileNotFoundError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    result = {"model": str(model_dir), "adapter": args.adapter,
              **diagnose(engine, eval_set, EpisodeSettings.from_config(cfg)), "machine": machine_info()}
    out = Path(args.out)
    atomic_write_json(out / "diagnosis.json", result)
    log.info(describe_diagnosis(result))
    log.info(f"wrote {out / 'diagnosis.json'}")


def eval_set_from(cfg: RunConfig, seeds_arg: str | None, max_turns: int | None) -> EvalSet:
    """Returns the eval set a --seeds argument names ('extended': the profile's extended set); exits on a bad one."""
    if seeds_arg == "extended":
        if not cfg.env.extended_eval_seeds:
            sys.exit("error: --seeds extended: this profile sets no env.extended_eval_seeds")
        seeds_arg = cfg.env.extended_eval_seeds
    try:
        seeds = parse_seeds(seeds_arg or cfg.env.eval_seeds)
    except ValueError as exc:
        sys.exit(f"error: --seeds: {exc}")
    if not seeds:
        sys.exit(f"error: --seeds {seeds_arg!r} names no seeds: use A-B (e.g. 0-63) or A,B,C")
    return EvalSet(cfg.env.eval_env, seeds, max_turns or cfg.env.max_turns)


def main(argv: list[str] | None = None) -> None:
    command, argv = subcommand(argv, ("play", "diagnose"), "evaluate")
    if command == "play":
        return play(argv)
    if command == "diagnose":
        return diagnose_command(argv)
    args = evaluate_parser().parse_args(argv)
    cfg = config_from_args(args)
    eval_set = eval_set_from(cfg, args.seeds, args.max_turns)
    settings = settings_from(cfg, args.samples, args.temperature)
    if args.compare:
        out = Path(args.out or ".")
        try:
            path, line = write_comparison(args.compare[0], args.compare[1], out)
            log.info(f"{line}\nwrote {path}")
        except (OSError, ValueError, KeyError) as exc:
            sys.exit(f"error: cannot compare {args.compare[0]} and {args.compare[1]} into {out}: {exc}")
        return
    if args.watch:
        try:
            watch(cfg, eval_set, args.watch, args.once, args.poll, args.base_url, args.request_deadline)
        except ConnectionError as exc:
            sys.exit(f"error: {exc}")
        return
    try:
        summary, out = (evaluate_endpoint(cfg, args, eval_set, settings) if args.base_url
                        else evaluate_model(cfg, args, eval_set, settings))
        exit_on_errors([summary], out)
    except (ModelLoadError, ConnectionError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    except OSError as exc:  # the volume: read-only, full, or not ours to write
        sys.exit(f"error: cannot write {exc.filename or 'SHARED_DIR'} ({exc.strerror or exc}): SHARED_DIR "
                 f"({cfg.shared_path()}) must be a folder this user can write, with free space")


def settings_from(cfg: RunConfig, samples: int, temperature: float | None) -> EpisodeSettings:
    """Returns how episodes are played (--samples, --temperature over the profile's eval rule); exits on a bad pair."""
    settings = (EpisodeSettings.for_eval(cfg, samples) if temperature is None
                else EpisodeSettings.from_config(cfg, temperature=temperature))
    if samples > 1 and settings.temperature <= 0:
        sys.exit(f"error: --samples {samples} needs --temperature above 0 (greedy play repeats itself)")
    if settings.temperature < 0:
        sys.exit(f"error: --temperature {settings.temperature} is negative: use 0 (greedy) or more")
    return settings


def evaluate_endpoint(cfg: RunConfig, args, eval_set: EvalSet, settings: EpisodeSettings) -> tuple[dict, Path]:
    """Plays the eval set against an OpenAI-compatible endpoint (--base-url); returns (summary, output folder)."""
    name = args.name or f"endpoint_{(args.model_name or cfg.model.base_model_id).replace(':', '_')}"
    out = writable_folder(args.out or SharedVolume(cfg.shared_path()).eval(args.run or "endpoint", name))
    engine = endpoint_engine(cfg, args.base_url, args.model_name, args.request_deadline)
    engine.check()
    return eval_endpoint(cfg, eval_set, engine, args.base_url, out, gifs=not args.no_gifs, settings=settings,
                         samples=args.samples), out


def evaluate_model(cfg: RunConfig, args, eval_set: EvalSet, settings: EpisodeSettings) -> tuple[dict, Path]:
    """Plays the eval set in this process: --model (or the profile's), with --adapter or the run's latest export."""
    volume = SharedVolume(cfg.shared_path())
    model_dir = Path(args.model) if args.model else volume.model(cfg.model.path)
    adapter = args.adapter
    if args.run and not adapter and not args.model:
        exports = complete_exports(volume, args.run)
        if not exports:
            sys.exit(f"run {args.run} has no complete export under {volume.exports(args.run)}; train first (make train)")
        step, adapter = exports[-1]
        log.info(f"evaluating {args.run} export at step {step}")
    adapter_dir = resolve_adapter(cfg, str(adapter) if adapter else None)
    name = args.name or (f"eval_{Path(adapter_dir).parent.name if adapter_dir else model_dir.name}")
    out = writable_folder(args.out or volume.eval(args.run or "adhoc", name))  # before the model loads and plays
    return eval_local(cfg, eval_set, model_dir, adapter_dir, out, gifs=not args.no_gifs, settings=settings,
                      samples=args.samples), out


def evaluate_parser() -> argparse.ArgumentParser:
    """Returns the parser of the default command (evaluate, compare or watch)."""
    parser = CommandLineParser(prog="python -m services.evaluator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--run", default=None, type=run_id_arg,
                        help="run id: evaluate its latest export; output under runs/<run>/evals/")
    parser.add_argument("--name", default=None, type=run_id_arg, help="evaluation name (folder under runs/<run>/evals/)")
    parser.add_argument("--out", default=None, help="output folder (instead of runs/<run>/evals/<name>)")
    parser.add_argument("--model", default=None, help="model folder (default: the profile's model.path)")
    parser.add_argument("--adapter", default=None, help="LoRA export folder, or an adapter id in $S3_URI/adapters/")
    parser.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000; "
                        "with --watch, each export is asked for as <base>:<run>-step<N> (the exporter's ids)")
    parser.add_argument("--request-deadline", type=positive_seconds, default=120.0, metavar="SECONDS",
                        help="with --base-url: the most one request (its retries included) may take (default 120)")
    parser.add_argument("--model-name", default=None, help="model name for --base-url (base or base:adapter)")
    parser.add_argument("--seeds", default=None, help="eval seeds: A-B, A,B,C, or 'extended' for the "
                        "profile's extended held-out set (default: the profile's eval_seeds, 0-63)")
    parser.add_argument("--max-turns", type=turn_budget, default=None, help="turn budget per maze (1..200)")
    parser.add_argument("--no-gifs", action="store_true", help="skip the per-episode GIFs")
    parser.add_argument("--samples", type=sample_count, default=1,
                        help="episodes per maze (default 1, greedy); more plays each maze that many times at "
                             "--temperature and reports mean@k and pass@k (no GIFs)")
    parser.add_argument("--temperature", type=temperature_arg, default=None,
                        help="sampling temperature (default: rollout.eval_temperature, 0 = greedy; with --samples > 1, "
                             "rollout.temperature)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), type=eval_folder,
                        help="two evaluation folders to set side by side")
    parser.add_argument("--watch", metavar="RUN_ID", type=run_id_arg, help="evaluate every new complete export of a run")
    parser.add_argument("--once", action="store_true", help="with --watch: one pass, then exit")
    parser.add_argument("--poll", type=float, default=30.0, help="with --watch: seconds between passes")
    return parser

if __name__ == "__main__":
    main()
