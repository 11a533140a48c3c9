"""vLLM as the rollout engine: a Ray actor in .venv-vllm, the adapter re-read from lora_sync/ at each step,
greedy replies equal to the in-process engine's; and a GRPO run that rolls out through it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_no_inductor_kernels

from shared.episodes import EpisodeSettings, run_episodes
from shared.maze import generate
from shared.models.inference import LocalEngine

REPO = Path(__file__).resolve().parent.parent
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(not VLLM_PY.exists(), reason="needs .venv-vllm: build it with `make vllm-env`")


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray

    with pytest.MonkeyPatch.context() as patch:  # the actor inherits it: where TorchInductor would write kernels
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, _node_ip_address="127.0.0.1")
        yield
        ray.shutdown()


def test_vllm_engine_follows_lora_sync_and_matches_the_in_process_engine(ray_local, tiny_cfg, tiny_model_dir,
                                                                         exported_run, tmp_path):
    import ray

    from shared.models.vllm_engine import VllmEngine

    volume, run_id = exported_run
    exports = {step: volume.export(run_id, step) for step in (2, 4)}
    lora_sync = tmp_path / "lora_sync"
    cfg = tiny_cfg.model_copy(update={"lora": tiny_cfg.lora.model_copy(update={"rank": 4, "alpha": 8})})  # the exports'
    engine = VllmEngine(cfg, tiny_model_dir, num_cpus=0)
    # vLLM pads every adapter to its max_lora_rank (one of a few values): the smallest that holds the run's rank, not
    # the server's 32, since its CPU LoRA kernels cost in proportion to it.
    padded = engine.actor.__ray_call__.remote(lambda generator: generator.llm.llm_engine.vllm_config.lora_config.max_lora_rank)
    assert ray.get(padded) == 8
    mazes = [generate("maze_2d/easy", seed) for seed in range(6)]
    settings = EpisodeSettings(max_turns=4, cell_px=tiny_cfg.env.cell_px, temperature=0.0, max_new_tokens=8)
    first_logprobs = {}
    for step in (2, 4):  # the learner rewrites lora_sync/ in place; the engine is told the new step
        shutil.rmtree(lora_sync, ignore_errors=True)
        shutil.copytree(exports[step], lora_sync)
        engine.load_adapter(lora_sync, step)
        remote = run_episodes(engine, mazes, settings)
        local = run_episodes(LocalEngine.from_config(cfg, tiny_model_dir, exports[step]), mazes, settings)
        assert not [e.error for e in remote if e.error], [e.error for e in remote][:1]
        assert [[t.text for t in e.turns] for e in remote] == [[t.text for t in e.turns] for e in local]
        assert [e.solved for e in remote] == [e.solved for e in local]
        completion = engine.generate([[{"role": "user", "content": [{"type": "text", "text": "9x9 maze"}]}]], 0.0, 4)[0]
        assert completion.token_ids and len(completion.logprobs) == len(completion.token_ids)
        first_logprobs[step] = completion.logprobs[0]
    assert first_logprobs[2] != pytest.approx(first_logprobs[4], abs=1e-4), "the step-4 adapter was not loaded"
    assert_no_inductor_kernels(os.environ["TORCHINDUCTOR_CACHE_DIR"])

    # Sampling: each request with its own seed (seed + index), so 8 copies of one prompt at T=1 are 8 draws,
    # and the same seeds draw the same replies again.
    prompt = run_episodes(engine, mazes[:1], EpisodeSettings(max_turns=1, cell_px=tiny_cfg.env.cell_px)
                          )[0].messages[:1]
    sampled = engine.generate([prompt] * 8, 1.0, 8, seed=5)
    assert len({tuple(c.token_ids) for c in sampled}) > 1, [c.text for c in sampled]
    assert [c.token_ids for c in engine.generate([prompt] * 8, 1.0, 8, seed=5)] == [c.token_ids for c in sampled]
    assert [c.token_ids for c in engine.generate([prompt] * 2, 1.0, 8, seed=[5 + 3, 5 + 6])] == \
        [sampled[3].token_ids, sampled[6].token_ids], "a request's draw depends on its own seed only"


def test_a_grpo_run_rolls_out_through_vllm(warm_start_7x7, tmp_path):
    # The 2-step run the trainer tests use, from the transfer test's warm start (pinned in tests/fixtures) on its 7x7
    # mazes: it answers in format, so a group's sampled episodes earn different rewards (MINIMAL's 12-maze warm start
    # answers none). Four held-out mazes, not its 64: the greedy scores are the transfer test's subject, not this one's.
    from conftest import TRANSFER
    from test_trainer import MINIMAL

    shutil.copytree(warm_start_7x7, tmp_path / "models")
    env = {**os.environ, "SHARED_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "services.trainer", *MINIMAL, *TRANSFER, "env.eval_seeds=0-3", "run_id=vllm-rollout",
                           "rollout.engine=vllm", "schedule.total_steps=2", "rollout.n_samples_per_prompt=4", "rollout.vllm_kv_cache_bytes=268435456"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "vllm-rollout" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/errors"] == 0 for m in metrics), metrics
    assert all(m["throughput/rollout_tokens_per_s"] > 0 for m in metrics)
    # Sampled rollouts differ within a maze's group, so the steps train: not one group of identical replies.
    assert all(m["train/parse_failures"] < m["train/samples"] for m in metrics), metrics  # it answers moves
    assert all(m["train/active_samples"] > 0 for m in metrics) and sum(m["policy/updates"] for m in metrics) > 0, metrics
