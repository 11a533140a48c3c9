"""The maze_2d environment: generation, rules, pictures, action parsing, datasets and the skyrl-gym env."""

from shared.maze.actions import episode_reward, format_action, parse_action, turn_is_well_formatted
from shared.maze.core import (
    Maze,
    MazeState,
    env_size,
    generate,
    optimal_action_count,
    solve,
)
from shared.maze.dataset import EvalSet, MazeStream, parse_seeds
from shared.maze.prompt import FEEDBACK_INVALID, FEEDBACK_OK, FEEDBACK_WALL
from shared.maze.render import data_uri, render_rgb, render_text

__all__ = [
    "FEEDBACK_INVALID",
    "FEEDBACK_OK",
    "FEEDBACK_WALL",
    "EvalSet",
    "Maze",
    "MazeState",
    "MazeStream",
    "data_uri",
    "env_size",
    "episode_reward",
    "format_action",
    "generate",
    "optimal_action_count",
    "parse_action",
    "parse_seeds",
    "render_rgb",
    "render_text",
    "solve",
    "turn_is_well_formatted",
]
