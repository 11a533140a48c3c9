"""python -m services.server: serve the base model and its LoRA adapters (from S3), OpenAI-compatible.

    make serve                                   # Ray Serve + transformers + peft (the main venv)
    make serve-vllm                              # Ray Serve LLM (vLLM) on CPU, from .venv-vllm
    python -m services.server --engine vllm --config configs/qwen3vl-8b-hyperpod.yaml   # the same app on GPUs
    python -m services.server --engine vllm --dry-run --config ...                     # print the validated config

Routes: GET /v1/models, POST /v1/chat/completions (model = <base> or <base>:<adapter_id>); the transformers
server also has GET /healthz. Without SERVER_API_KEY the server binds to 127.0.0.1 only; with it, requests
need `Authorization: Bearer`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import yaml

from shared.config import command_line, config_from_args, reveal

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = command_line("python -m services.server", __doc__)
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                        help="vllm: Ray Serve LLM (server.accelerator picks gpu or cpu); transformers: the peft deployment")
    parser.add_argument("--gpu", action="store_true", help="same as --engine vllm (kept for old scripts)")
    parser.add_argument("--dry-run", action="store_true", help="print the (validated) config and exit")
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1; 0.0.0.0 needs SERVER_API_KEY)")
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = config_from_args(args, [f"server.port={args.port}"] if args.port else [])

    api_key = reveal(cfg.server.api_key)
    host = args.host or cfg.server.host
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning(f"no SERVER_API_KEY set, so binding to 127.0.0.1 instead of {host}")
        host = "127.0.0.1"

    if args.gpu or args.engine == "vllm":
        serve_vllm(cfg, host, api_key, args.dry_run)
        return

    if argv is None and not args.dry_run:  # run as a command: Ray's servers on loopback (re-runs this command once)
        from shared.local_ray import enter_loopback

        enter_loopback(keep_port=cfg.server.port if host not in ("127.0.0.1", "localhost", "::1") else None)
    if not cfg.storage.s3_uri:
        from shared.storage.local_s3 import resolve_s3

        cfg = resolve_s3(cfg)
    from shared.storage.volume import SharedVolume

    model_dir = SharedVolume(cfg.shared_path()).model(cfg.model.path)
    if args.dry_run:
        print(yaml.safe_dump({"host": host, "port": cfg.server.port, "model": str(model_dir),
                              "base_model_id": cfg.model.base_model_id, "adapters": f"{cfg.storage.s3_uri}/adapters",
                              "auth": bool(api_key)}, sort_keys=False))
        return
    check_model(model_dir)
    url = start_cpu_server(cfg, str(model_dir), host, api_key)
    log.info(f"serving {cfg.model.base_model_id} (+ adapters from {cfg.storage.s3_uri}/adapters) on {url}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def check_model(model_dir: Path) -> None:
    """Exits with one line unless model_dir holds a config and weight files whose headers read: a damaged model is
    named in a second instead of after the engine's start-up (minutes for vLLM under Ray Serve)."""
    from shared.storage.files import DamagedFile, safetensors_header

    if not (model_dir / "config.json").exists():
        sys.exit(f"error: no model at {model_dir}; build it with `make sft` (or set model.path)")
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        sys.exit(f"error: the model at {model_dir} has no .safetensors weights; rebuild it with `make sft` (or set "
                 "model.path)")
    for path in weights:
        try:
            safetensors_header(path)
        except DamagedFile as exc:
            sys.exit(f"error: the model at {model_dir} cannot be loaded: {exc}; rebuild it with `make sft` (or set "
                     "model.path)")


def serve_vllm(cfg, host: str, api_key: str | None, dry_run: bool) -> None:
    """Validates and (unless dry_run) runs the Ray Serve LLM app until interrupted."""
    from shared.storage.volume import SharedVolume

    if not dry_run:
        check_model(SharedVolume(cfg.shared_path()).model(cfg.model.path))
    from services.server.llm import EngineStartError, run, serve_config, validate

    try:
        config = serve_config(cfg)
        validate(config)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if dry_run:
        print(yaml.safe_dump(config, sort_keys=False))
        return
    try:
        url = run(cfg, host, api_key)
    except EngineStartError as exc:
        sys.exit(f"error: {exc}")
    log.info(f"serving {cfg.model.base_model_id} (+ adapters from {cfg.storage.s3_uri}/adapters) with vLLM "
             f"({cfg.server.accelerator}) on {url}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def start_cpu_server(cfg, model_dir: str, host: str = "127.0.0.1", api_key: str | None = None) -> str:
    """Starts Ray (if needed) and the CPU deployment; returns the base URL once it answers /healthz."""
    import ray
    from ray import serve

    from services.server.app import MazeServer
    from shared.local_ray import init_local_ray
    from shared.net import wait_for_http

    if not ray.is_initialized():
        init_local_ray(log_to_driver=False, configure_logging=False,
                       runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "HF_"))}})
    serve.start(http_options={"host": host, "port": cfg.server.port})
    deployment = MazeServer.options(num_replicas=cfg.server.num_replicas)
    serve.run(deployment.bind(cfg.model_dump(mode="json"), model_dir, api_key), name="maze", route_prefix="/")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{cfg.server.port}"
    wait_for_http(f"{url}/healthz", timeout_s=120)
    return url


if __name__ == "__main__":
    main()
