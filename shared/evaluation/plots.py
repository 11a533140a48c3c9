"""The solve-rate-per-step picture every run and `--watch` draws (PNG)."""

from __future__ import annotations

from pathlib import Path


def plot_solve_rate(path: Path, steps: list[int], rates: list[float], ceiling: float, title: str,
                    extended: list[dict] | None = None, training: dict | None = None) -> None:
    """Writes the held-out solve rate per step, with the oracle ceiling, as a PNG.

    `extended` (a list of {"label", "points": [(step, solved, total, ci_low, ci_high)], "ceiling"}) adds a larger
    set's scores with their 95% intervals beside the curve (greedy, mean@k); `training` ({"label", "steps",
    "rates"}) draws the success on the training mazes per step in a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if training else 1, figsize=(11 if training else 6, 3.8), dpi=120, squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [100 * r for r in rates], marker="o", label="held-out solve rate (greedy)")
    ax.axhline(100 * ceiling, color="grey", linestyle="--", label=f"oracle ceiling ({100 * ceiling:.1f}%)")
    for series, (colour, marker) in zip(extended or [], [("tab:orange", "s"), ("tab:green", "D"), ("tab:red", "^")]):
        xs = [p[0] for p in series["points"]]
        ys = [100 * p[1] / p[2] for p in series["points"]]
        errors = [[y - 100 * p[3] for y, p in zip(ys, series["points"])],
                  [100 * p[4] - y for y, p in zip(ys, series["points"])]]
        ax.errorbar(xs, ys, yerr=errors, fmt=marker, color=colour, capsize=4, label=f"{series['label']} (95% CI)")
    if extended:
        ax.axhline(100 * extended[0]["ceiling"], color="tab:orange", linestyle=":", alpha=0.6,
                   label=f"its ceiling ({100 * extended[0]['ceiling']:.1f}%)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("solved (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=7, framealpha=0.9)  # above the scores, which sit below the ceilings
    if training:
        right = axes[0][1]
        window = max(1, len(training["rates"]) // 20)
        right.plot(training["steps"], [100 * r for r in training["rates"]], color="tab:purple",
                   alpha=0.35 if window > 1 else 1.0, label="per step")
        if window > 1:  # a short run is drawn step by step
            smooth = [100 * sum(training["rates"][max(0, i - window + 1): i + 1]) / len(training["rates"][max(0, i - window + 1): i + 1])
                      for i in range(len(training["rates"]))]
            right.plot(training["steps"], smooth, color="tab:purple", label=f"moving mean of {window}")
        right.set_xlabel("GRPO step")
        right.set_ylabel("solved (%)")
        right.set_ylim(0, 100)
        right.set_title(training["label"])
        right.grid(alpha=0.3)
        right.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
