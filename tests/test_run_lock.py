"""One trainer per run (a second one stops naming the first; a dead one's lock is taken over with a warning),
the trainer's Ray listening on loopback only, and Ray's processes ending with a SIGKILLed trainer."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.bootstrap=none", "run_id=dup", "schedule.total_steps=1000", "schedule.eval_before_train=false",
         "rollout.train_batch_size=2", "algorithm.mini_batch_size=1",
         "rollout.n_samples_per_prompt=2", "env.max_turns=2", "env.reward=task_progress", "env.eval_seeds=0-1", "env.extended_eval_seeds=null",
         "rollout.max_new_tokens=7", "lora.rank=4", "lora.alpha=8", "schedule.ckpt_interval=1000",
         "schedule.hf_save_interval=1000", "schedule.eval_interval=0"]


def _trainer(shared: Path, *overrides, wait=True):
    cmd = [sys.executable, "-m", "services.trainer", *SMALL, *overrides]
    env = {**os.environ, "SHARED_DIR": str(shared), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    if wait:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_for(condition, timeout_s: float, what: str, proc=None):
    deadline = time.time() + timeout_s
    while not condition():
        assert proc is None or proc.poll() is None, f"the trainer exited ({proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_run_lock_loopback_ray_and_no_orphans(tmp_path, tiny_model_dir, loopback_only):
    first = _trainer(tmp_path, f"model.path={tiny_model_dir}", "seed=0", wait=False)
    try:
        run = tmp_path / "runs" / "dup"
        _wait_for(lambda: (run / "trainer.lock").exists(), 120, "the run lock", first)

        # A second trainer on the live run stops at once, naming the holder; the run is left alone.
        second = _trainer(tmp_path, f"model.path={tiny_model_dir}", "seed=1")
        assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr[-2000:]
        line = second.stderr.strip().splitlines()[-1]
        assert f"pid {first.pid}" in line and socket.gethostname() in line and "started" in line, line

        # Once the first has trained a step, its Ray (GCS, raylet, workers, agents) is up: all on loopback.
        _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip(), 400,
                  "the first training step", first)
        names = {p.name() for p in psutil.Process(first.pid).children(recursive=True)}
        assert {"raylet", "gcs_server"} <= names, names
        assert len(loopback_only(first.pid)) >= 4
        assert yaml.safe_load((run / "run.yaml").read_text())["seed"] == 0, "the second trainer wrote run.yaml"

        # SIGKILL the trainer alone: its Ray processes (agents included) must not outlive it.
        ray_processes = [p for p in psutil.Process(first.pid).children(recursive=True)]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        _wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ray_processes), 60,
                  "Ray's processes to end after the trainer was killed")
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)

    # The dead trainer's lock is stale: the next trainer takes it over with a warning (then stops: no model here).
    empty = tmp_path / "empty-model"
    empty.mkdir()
    third = _trainer(tmp_path, f"model.path={empty}")
    assert "taking over a stale run lock" in third.stderr and f"pid {first.pid}" in third.stderr, third.stderr[-2000:]
    assert "no model at" in third.stderr
    assert not (run / "trainer.lock").exists(), "the lock is released on exit"
