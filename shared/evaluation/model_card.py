"""The README.md every LoRA export carries (and its S3 copy): a Hugging Face model card for the adapter.

Front matter as the Hub reads it (`base_model`, `library_name: peft`, license, tags), then what a reader needs to
trust or reproduce the adapter: the base model and the identity of its files, what it was trained on, the held-out
result with its 95% interval and the ceiling no agent can pass, and the config and command that produced it.
"""

from __future__ import annotations

from shared.evaluation.statistics import wilson_interval

CARD = "README.md"
MARKER = "maze_grpo_card: 1"  # in the front matter: told apart from the template PEFT's save_pretrained writes


def held_out_lines(evaluation: dict | None) -> list[str]:
    """Returns the results section's lines for one eval summary (None: not scored)."""
    if not evaluation or not evaluation.get("total"):
        return ["Not scored yet: `python -m services.evaluator --adapter <this folder>` plays the 64 held-out mazes."]
    solved, total = int(evaluation["solved"]), int(evaluation["total"])
    low, high = wilson_interval(solved, total)
    where = f"{evaluation.get('env', '?')} seeds {evaluation.get('seeds', '?')}, {evaluation.get('max_turns', '?')} turns"
    ceiling = evaluation.get("oracle_solved")
    lines = ["| mazes | greedy solved | solve rate [95% CI] | ceiling (optimal solver) |",
             "| --- | --- | --- | --- |",
             f"| {where} | {solved}/{total} | {100 * solved / total:.1f}% [{100 * low:.1f}-{100 * high:.1f}] | "
             f"{'n/a' if ceiling is None else f'{ceiling}/{total}'} |"]
    if evaluation.get("source"):
        lines.append(f"\nScored by {evaluation['source']}.")
    lines.append("\nThe ceiling counts the mazes the optimal solver finishes within the turn budget: no agent solves "
                 "more. Mazes never seen in training (by content).")
    return lines


def model_card(*, base_model: str, title: str, trained: list[str], evaluation: dict | None,
               base_files: str | None = None, command: str | None = None, config_yaml: str | None = None) -> str:
    """Returns the card's text. `trained` holds one line each on what the adapter was trained on and how."""
    parts = [
        "---",
        f"base_model: {base_model}",
        "library_name: peft",
        "license: apache-2.0",
        "pipeline_tag: image-text-to-text",
        "tags: [lora, grpo, reinforcement-learning, maze, maze-grpo]",
        MARKER,
        "---",
        "",
        f"# {title}",
        "",
        f"A LoRA adapter for `{base_model}`, post-trained with GRPO to solve 2D mazes it sees as images (maze-grpo). "
        "Serve it beside its base model (`make export`, then `make serve`), or load it with PEFT's "
        "`PeftModel.from_pretrained(base_model, this_folder)`.",
        "",
        "## Base model",
        "",
        f"- `{base_model}`" + (f": {base_files}" if base_files else ""),
        "",
        "## Training",
        "",
        *[f"- {line}" for line in trained],
        "",
        "## Held-out results",
        "",
        *held_out_lines(evaluation),
    ]
    if command or config_yaml:
        parts += ["", "## How it was made", ""]
        if command:
            parts += ["```bash", command, "```", ""]
        if config_yaml:
            parts += ["The run's config (every setting, defaults included):", "", "```yaml", config_yaml.rstrip(), "```"]
    return "\n".join(parts) + "\n"


def is_ours(text: str) -> bool:
    """Whether a README.md is this project's card (not PEFT's template or one a user wrote)."""
    return text.startswith("---\n") and MARKER in text.split("\n---", 1)[0]
