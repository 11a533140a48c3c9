"""Supervised warm start: teach the tiny Qwen3-VL the interface (and, with `sft.demos: solver`, the solver's route).

    python -m services.trainer.sft --config configs/tiny-cpu.yaml     (what `make sft` runs)

Trajectories are formatted exactly as RL rollouts are (multi-turn, one image per turn, the same
memory guard), one training sample per turn. Training mazes come from their own seed stream
(env.sft_seed_start, disjoint from GRPO's) and never include a held-out maze (by content). The work is
fixed: every batch the config implies runs, on any machine, in an order that depends only on the seed.
At the end the 64 held-out mazes are played greedily and `eval/summary.json` lands in the checkpoint.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from shared.config import ConfigError, RunConfig, changed_settings, command_line, config_from_args, sft_settings
from shared.episodes import EpisodeSettings, explore_episode, solver_episode
from shared.evaluation import describe, evaluate
from shared.maze.core import Maze
from shared.maze.dataset import EvalSet, MazeStream, excluded_from_training
from shared.models.inference import LocalEngine
from shared.models.loading import load_model
from shared.models.tiny import ensure_tiny_model
from shared.models.training import TrainingSample, collate, reply_sample, token_logprobs
from shared.storage.files import staged_dir
from shared.storage.manifest import is_complete
from shared.storage.volume import SharedVolume

logger = logging.getLogger(__name__)


def demo_conversation(maze: Maze, cfg: RunConfig) -> list[dict]:
    """Returns the demonstration on `maze` that `sft.demos` names, through the rollouts' turn protocol: the optimal
    solver's, or an explorer's (its junction choices drawn from a stream of the run's seed and the maze's)."""
    settings = EpisodeSettings.from_config(cfg)
    if cfg.sft.demos == "solver":
        return solver_episode(maze, settings).messages
    return explore_episode(maze, settings, random.Random(f"{cfg.seed}/{maze.seed}")).messages


def turn_samples(processor, messages: list[dict], cfg: RunConfig, keep: float, rng: random.Random) -> list[TrainingSample]:
    """Returns one sample per assistant turn: the context a rollout engine builds before that turn (memory guard
    applied to the turns before the reply, never counting the reply itself), then the reply; loss on the reply."""
    samples = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or (keep < 1.0 and rng.random() > keep):
            continue
        reply = "".join(part["text"] for part in message["content"] if part["type"] == "text")
        samples.append(reply_sample(processor, messages[:index], reply, cfg.model.max_images_in_context,
                                    cfg.model.max_turns_in_context))
    return samples


def length_bucketed(samples: list, batch_size: int, rng: random.Random, window: int = 50) -> list[list]:
    """Returns shuffled batches of similar-length samples (less padding), in random order."""
    order = samples[:]
    rng.shuffle(order)
    batches = []
    for start in range(0, len(order), batch_size * window):
        group = sorted(order[start : start + batch_size * window], key=lambda s: len(s.input_ids))
        batches.extend(group[i : i + batch_size] for i in range(0, len(group), batch_size))
    rng.shuffle(batches)
    return batches


def run_sft(cfg: RunConfig, force: bool = False, log=logger.info) -> Path:
    """Trains (or finds) the SFT warm-start under models/<model.path>; returns its folder."""
    volume = SharedVolume(cfg.shared_path())
    out_dir = volume.model(cfg.model.path)
    if is_complete(out_dir) and not force:
        check_built_with(out_dir, cfg)
        log(f"sft: {out_dir} is complete, skipping (use --force to retrain)")
        return out_dir
    base_dir = ensure_tiny_model(cfg, log=log)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model, processor = load_model(base_dir, cfg.model.dtype)
    eval_set = EvalSet.held_out(cfg.env)
    eval_set.save(volume.dataset(cfg.env.eval_env))

    started = time.perf_counter()
    samples, stream = demo_samples(cfg, processor, rng)
    log(f"sft: {len(samples)} turn samples from {cfg.sft.num_mazes} mazes, seeds {stream.seed_range()} "
        f"({stream.rejected} candidates rejected as held-out mazes) in {time.perf_counter() - started:.0f}s")
    done_batches = train_on(model, processor, samples, cfg.sft, rng)
    train_s = time.perf_counter() - started
    model.eval()

    with staged_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        engine = LocalEngine.for_model(cfg, model, processor, name=cfg.model.path)
        summary, _ = evaluate(engine, eval_set, EpisodeSettings.from_config(cfg), tmp / "eval",
                              model=cfg.model.path, adapter=None,
                              extra={"sft_samples": len(samples), "sft_batches": done_batches, "sft_train_s": round(train_s, 1),
                                     "sft_seeds": stream.seed_range(), "sft_seed_rejected": stream.rejected,
                                     "sft_settings": sft_settings(cfg)})
    log("sft eval: " + describe(summary))
    return out_dir


def demo_samples(cfg: RunConfig, processor, rng: random.Random) -> tuple[list[TrainingSample], MazeStream]:
    """Returns the turn samples of the demonstrations on sft.num_mazes fresh mazes (never a held-out one), and the
    stream they came from (its seed range and rejections are recorded)."""
    stream = MazeStream.for_sft(cfg.env, excluded_from_training(cfg.env))
    try:
        mazes = stream.take(cfg.sft.num_mazes)
    except ValueError as exc:
        raise ConfigError(f"config error: {exc}") from None
    samples: list[TrainingSample] = []
    for maze in tqdm(mazes, desc="sft data", unit="maze", leave=False):
        samples.extend(turn_samples(processor, demo_conversation(maze, cfg), cfg, cfg.sft.train_fraction_of_turns, rng))
    return samples, stream


def train_on(model, processor, samples: list[TrainingSample], sft, rng: random.Random) -> int:
    """Fits the model to the samples' replies (cross-entropy on reply tokens, one-cycle schedule, sft.epochs passes
    over length-bucketed batches); returns the number of batches."""
    model.train()
    if not sft.train_vision:  # as in LLaVA-style SFT: the encoder stays as built, the language model learns to read it
        for name, param in model.named_parameters():
            if ".visual." in f".{name}":
                param.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=sft.lr, weight_decay=0.01)
    total_batches = sft.epochs * ((len(samples) + sft.batch_size - 1) // sft.batch_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=sft.lr, total_steps=total_batches, pct_start=0.05)
    bar = tqdm(total=total_batches, desc="sft", unit="batch")
    done_batches, accuracy = 0, 0.0
    for _ in range(sft.epochs):
        for chunk in length_bucketed(samples, sft.batch_size, rng):
            batch = collate(processor, chunk)
            logp, _ = token_logprobs(model, batch)
            mask = batch["response_mask"]
            loss = -(logp * mask).sum() / mask.sum()
            # A turn counts as right when every reply token was the model's most likely one (p > 0.5 suffices).
            turn_ok = ((logp > -0.693) | (mask == 0)).all(dim=1).float().mean().item()
            accuracy = turn_ok if done_batches == 0 else 0.95 * accuracy + 0.05 * turn_ok
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            done_batches += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", turn_acc=f"{accuracy:.2f}")
    bar.close()
    return done_batches


def check_built_with(out_dir: Path, cfg: RunConfig) -> None:
    """Raises ConfigError when the warm start in out_dir was built with other SFT settings than cfg's."""
    summary = out_dir / "eval" / "summary.json"
    recorded = json.loads(summary.read_text()).get("sft_settings") if summary.is_file() else None
    if recorded is None:
        return  # not built by this SFT (an HF checkpoint, or one from before settings were recorded)
    changes = changed_settings(recorded, sft_settings(cfg))
    if changes:
        raise ConfigError(f"config error: the warm start {out_dir} was built with other settings: {', '.join(changes)}; "
                          f"set model.path=<new name> to build one with these, or retrain it in place with "
                          f"`python -m services.trainer.sft --force`")


def ensure_sft(cfg: RunConfig, log=logger.info) -> Path:
    """Returns the policy's base checkpoint, building tiny model + SFT first when the profile says so."""
    out_dir = SharedVolume(cfg.shared_path()).model(cfg.model.path)
    if cfg.model.bootstrap == "none":
        return out_dir
    if is_complete(out_dir):
        check_built_with(out_dir, cfg)
        return out_dir
    ours = (out_dir / "manifest.json").is_file()  # a model this bootstrap wrote (now corrupt): rebuilt in place
    if out_dir.exists() and not ours and (not out_dir.is_dir() or any(out_dir.iterdir())):
        # Not ours to overwrite: the bootstrap builds the model only where nothing is.
        raise ConfigError(f"config error: model.path = {cfg.model.path!r} ({out_dir}) exists but is not a complete "
                          "model (no verified manifest.json); point model.path at a new folder to build the tiny SFT "
                          "model there, or set model.bootstrap=none to train from an HF checkpoint folder")
    return run_sft(cfg, log=log)


def main(argv: list[str] | None = None) -> None:
    parser = command_line("python -m services.trainer.sft", __doc__)
    parser.add_argument("--force", action="store_true", help="retrain even if a complete checkpoint exists")
    args = parser.parse_args(argv)
    run_sft(config_from_args(args), force=args.force)


if __name__ == "__main__":
    main()
