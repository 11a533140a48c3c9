"""Our maze env played by SkyRL's own VLM generator and scored by SkyRL's own eval, on CPU.

SkyRL's `evaluate()` drives `SkyRLVLMGymGenerator.generate()` over our val data; the inference engine is
scripted (the one part that needs a GPU): it renders each conversation with the tiny model's chat template,
as vLLM's render endpoint would, and answers with fixed replies. Two mazes get a perfect player, two a player
that keeps walking into a wall with well-formatted replies.
"""

import asyncio
import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from skyrl.train.dataset import PromptDataset
from skyrl.train.evaluate import evaluate
from skyrl.train.generators.skyrl_vlm_generator import SkyRLVLMGymGenerator
from skyrl.train.utils.trainer_utils import build_dataloader
from transformers import AutoTokenizer

from services.trainer.skyrl_backend import skyrl_config
from shared.config import load_config
from shared.evaluation.skyrl import SKYRL_SOLVE_RATE_METRIC, skyrl_solve_rates
from shared.maze import generate, solve
from shared.maze.actions import format_action
from shared.maze.core import MazeState
from shared.maze.render import render_rgb
from shared.maze.skyrl_env import register_env
from shared.storage.volume import SharedVolume

REPO = Path(__file__).resolve().parents[2]
SEEDS = [0, 1, 2, 3]
SOLVERS = {0, 2}  # dataset rows played perfectly; the others bump into a wall every turn
MAX_TURNS = 40  # every easy maze is solvable within 40 turns, so the solvers always finish


def tagged(action) -> str:
    return f"<observation>a maze</observation><justification>the path</justification><action>{format_action(action)}</action>"


def wall_direction(maze) -> int:
    for direction in range(4):
        episode = MazeState(maze, 2)
        episode.step(("move", direction))
        if episode.position == maze.agent:
            return direction
    raise AssertionError("the start has no wall next to it")


class ScriptedEngine:
    """The inference-engine surface SkyRL's VLM generator calls, with a fixed reply per trajectory and turn."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.model_name = "tiny"
        self.rendered: list[list[dict]] = []  # every conversation the generator rendered, in order
        self.turns: dict[str, int] = {}

    async def render_chat_completion(self, request: dict) -> dict:
        messages = request["json"]["messages"]
        self.rendered.append(json.loads(json.dumps(messages)))
        token_ids = self.tokenizer.apply_chat_template(_text_only(messages), add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
        return {"token_ids": token_ids, "features": None}

    async def generate(self, engine_input, model=None) -> dict:
        session = engine_input["session_ids"][0]
        turn = self.turns.get(session, 0)
        self.turns[session] = turn + 1
        script = self.scripts[session]
        reply = script[min(turn, len(script) - 1)]
        ids = self.tokenizer.encode(reply + self.tokenizer.eos_token, add_special_tokens=False)
        return {"responses": [reply], "response_ids": [ids], "stop_reasons": ["stop"], "response_logprobs": None}

    async def finish_session(self, session_id: str) -> None:
        pass


def _text_only(messages: list[dict]) -> list[dict]:
    """Messages with each picture as the template's image placeholder (vLLM expands it; token counts don't matter here)."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if part.get("type") == "image_url" else part for part in content]
        out.append({**message, "content": content})
    return out


def _picture(message: dict) -> np.ndarray:
    url = next(part["image_url"]["url"] for part in message["content"] if part.get("type") == "image_url")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


@pytest.fixture(scope="module")
def skyrl_eval(tmp_path_factory, tiny_model_dir):
    shared = tmp_path_factory.mktemp("shared")
    cfg = load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml",
                      [f"storage.shared_dir={shared}", f"env.eval_seeds={SEEDS[0]}-{SEEDS[-1]}",
                       f"env.max_turns={MAX_TURNS}", "schedule.total_steps=1"], environ={})
    skyrl_cfg = skyrl_config(cfg)
    register_env()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    scripts = {}
    for row, seed in enumerate(SEEDS):
        maze = generate(cfg.env.eval_env, seed)
        if row in SOLVERS:
            scripts[f"{row}_0"] = [tagged(("move", d)) for d in solve(maze)] + [tagged(("stop", "stop"))]
        else:
            scripts[f"{row}_0"] = [tagged(("move", wall_direction(maze)))]
    engine = ScriptedEngine(tokenizer, scripts)
    generator = SkyRLVLMGymGenerator(skyrl_cfg.generator, skyrl_cfg.environment.skyrl_gym, engine, tokenizer)
    dataset = PromptDataset(skyrl_cfg.data.val_data, tokenizer, skyrl_cfg.trainer.max_prompt_length, num_workers=1)
    skyrl_cfg.data.dataloader.num_workers = 0
    metrics = asyncio.run(evaluate(build_dataloader(skyrl_cfg, dataset, is_train=False), generator, skyrl_cfg,
                                   global_step=10, tokenizer=tokenizer))
    return cfg, skyrl_cfg, engine, metrics


def test_turn_limit_and_episode_ends(skyrl_eval):
    cfg, _, engine, _ = skyrl_eval
    for row, seed in enumerate(SEEDS):
        expected = len(solve(generate(cfg.env.eval_env, seed))) + 1 if row in SOLVERS else MAX_TURNS
        assert engine.turns[f"{row}_0"] == expected, (row, seed)


def test_observations_are_our_pictures_of_each_position(skyrl_eval):
    cfg, _, engine, _ = skyrl_eval
    solver_seed = SEEDS[0]
    maze = generate(cfg.env.eval_env, solver_seed)
    start = render_rgb(maze, cfg.env.cell_px)
    # That maze's renders (trajectories run concurrently, in no fixed order); the longest is its last: every turn.
    conversations = [c for c in engine.rendered if np.array_equal(_picture(c[0]), start)]
    assert conversations, "the solver's maze was never rendered"
    longest = max(conversations, key=len)
    episode = MazeState(maze, MAX_TURNS)
    users = [m for m in longest if m["role"] == "user"]
    assert np.array_equal(_picture(users[0]), start)
    for move, message in zip(solve(maze), users[1:], strict=False):
        episode.step(("move", move))
        assert np.array_equal(_picture(message), render_rgb(episode.view(), cfg.env.cell_px))
    assert [m["role"] for m in longest[:3]] == ["user", "assistant", "user"]


def test_rewards_and_the_metric_that_is_the_solve_rate(skyrl_eval):
    _, skyrl_cfg, _, metrics = skyrl_eval
    # task_format: a solved, well-formatted episode scores 0.8 + 0.2; an unsolved one still scores 0.2 for format.
    assert metrics["eval/all/avg_score"] == pytest.approx((1.0 + 0.2 + 1.0 + 0.2) / 4)
    # So SkyRL's pass@1 (reward > 0) counts all four, and the env's solved metric is the solve rate.
    assert metrics["eval/all/pass_at_1"] == 1.0
    assert metrics[SKYRL_SOLVE_RATE_METRIC] == 0.5
    assert metrics["eval/all/environment/turns"] == pytest.approx(
        sum(len(solve(generate("maze_2d/easy", s))) + 1 for s in (0, 2)) / 4 + MAX_TURNS / 2)


def test_our_reader_takes_the_solve_rate_from_skyrls_eval_dump(skyrl_eval):
    cfg, skyrl_cfg, _, metrics = skyrl_eval
    run = SharedVolume(cfg.shared_path()).run(cfg.run_id)
    dump = run / "exports" / "dumped_evals" / "global_step_10_evals" / "aggregated_results.jsonl"
    assert dump.exists() and Path(skyrl_cfg.trainer.export_path) == run / "exports"
    assert skyrl_solve_rates(run) == {10: 0.5}
