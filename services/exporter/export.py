"""Staging LoRA exports in S3 in Ray Serve LLM's layout: `<S3_URI>/adapters/<adapter_id>/`.

For each complete export (`runs/<id>/exports/global_step_N/policy/` with a verified manifest) this
validates the adapter, uploads what S3 does not already hold (checksums compared), and writes the
adapter's manifest.json last. Readers trust only a manifest, so a crash mid-upload leaves nothing
they would use, and the next run finishes the job.
"""

from __future__ import annotations

import calendar
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from boto3.s3.transfer import TransferConfig

from shared.evaluation.model_card import CARD, is_ours, model_card
from shared.evaluation.skyrl import skyrl_eval_metrics
from shared.storage.adapters import AdapterNotFound, AdapterStore
from shared.storage.files import DamagedFile, atomic_write_text, safetensors_header
from shared.storage.ids import check_adapter_id
from shared.storage.manifest import MANIFEST, model_identity, sha256_file
from shared.storage.volume import ADAPTER_FILES, SharedVolume, complete_exports

logger = logging.getLogger(__name__)

TRANSFER = TransferConfig(multipart_threshold=8 * 1024 * 1024, multipart_chunksize=8 * 1024 * 1024, max_concurrency=4)


class InvalidAdapter(ValueError):
    """An export that must not be served, with the reason."""


@dataclass
class ExportResult:
    adapter_id: str
    step: int
    uploaded: list[str]
    skipped: bool


def read_safetensors_header(path: Path) -> dict:
    """Returns the JSON header of a safetensors file; InvalidAdapter if it is not one."""
    try:
        return safetensors_header(path)
    except DamagedFile as exc:
        raise InvalidAdapter(str(exc)) from None


def same_base_model(recorded: str | None, cfg) -> bool:
    """Returns True when an adapter's `base_model_name_or_path` names this run's base model: its id, its
    `model.path` as configured or as resolved on the volume (what PEFT writes when SkyRL or the trainer loads it),
    or another folder holding the same files (the same manifest or weights)."""
    if not recorded:
        return False
    base_dir = SharedVolume(cfg.shared_path()).model(cfg.model.path)
    if recorded in {cfg.model.base_model_id, cfg.model.path, str(base_dir)}:
        return True
    other = Path(recorded)
    if not other.is_dir() or not base_dir.is_dir():
        return False
    try:
        if other.samefile(base_dir):
            return True
    except OSError:
        return False
    mine = model_identity(base_dir)
    return mine is not None and model_identity(other) == mine


def validate_adapter(folder: Path, cfg) -> dict:
    """Returns the adapter config after checking it is a LoRA adapter for the run's base model within the
    server's max rank."""
    max_lora_rank = cfg.server.max_lora_rank
    for name in ADAPTER_FILES:
        path = folder / name
        # A link would upload whatever it points at, inside the run or not: exports hold their files themselves.
        if path.is_symlink() or not path.resolve().is_relative_to(folder.resolve()):
            raise InvalidAdapter(f"{path} is a symbolic link (to {path.resolve()}): an export must hold its own "
                                 "files; refused, nothing uploaded")
        if not path.is_file():
            raise InvalidAdapter(f"{folder} lacks {name}")
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidAdapter(f"{folder}/adapter_config.json does not parse: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{folder}/adapter_config.json is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise InvalidAdapter(f"{folder}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    if not same_base_model(config.get("base_model_name_or_path"), cfg):
        raise InvalidAdapter(
            f"{folder}: adapter is for base model {config.get('base_model_name_or_path')!r}, but the run's base is "
            f"{cfg.model.base_model_id!r} (model.path {cfg.model.path!r}): export it with the profile it was trained with")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidAdapter(f"{folder}/adapter_config.json: r = {str(rank)[:40]!r} is not a LoRA rank (a whole "
                             "number >= 1)")
    if rank > max_lora_rank:
        raise InvalidAdapter(f"{folder}: LoRA rank {rank} exceeds the server's max_lora_rank {max_lora_rank}")
    header = read_safetensors_header(folder / "adapter_model.safetensors")
    if not header:
        raise InvalidAdapter(f"{folder}/adapter_model.safetensors holds no tensors")
    strays = [name for name in header if "lora_" not in name]
    if strays:
        raise InvalidAdapter(f"{folder}/adapter_model.safetensors has non-LoRA tensors, e.g. {strays[0]}")
    return config


class Exporter:
    def __init__(self, cfg, store: AdapterStore, log=logger.info):
        self.cfg, self.store, self.log = cfg, store, log
        self.volume = SharedVolume(cfg.shared_path())

    def complete_exports(self, run_id: str) -> list[tuple[int, Path]]:
        return complete_exports(self.volume, run_id, warn=logger.warning)

    def eval_summary(self, run_id: str, step: int, skyrl_evals: dict[int, dict] | None = None) -> dict | None:
        """Returns the held-out eval of a step: the local trainer's (evals/global_step_N), else the evaluator's watch
        (evals/watch_step_N), else SkyRL's own (exports/dumped_evals/, a SkyRL run's, read once per run by the caller
        as `skyrl_evals`); None when there is none."""
        for name in (f"global_step_{step}", f"watch_step_{step}"):
            path = self.volume.eval(run_id, name) / "summary.json"
            if path.exists():
                return {**json.loads(path.read_text()), "source": f"evals/{name}"}
        if skyrl_evals is None:
            skyrl_evals = skyrl_eval_metrics(self.volume.run(run_id))
        skyrl = skyrl_evals.get(step)
        if skyrl:
            return {**skyrl, "source": f"SkyRL's eval (exports/dumped_evals/global_step_{step}_evals)"}
        return None

    def _remote_sha(self, key: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            head = self.store.client.head_object(Bucket=self.store.bucket, Key=key)
        except ClientError:
            return None
        return head.get("Metadata", {}).get("sha256")

    def card(self, folder: Path, meta: dict, scratch: Path) -> Path:
        """Returns the model card to publish with an export: its own when the trainer wrote one, else (a SkyRL run's
        export, which holds PEFT's template or none) one written into `scratch` from what the exporter knows."""
        own = folder / CARD
        if own.is_file() and not own.is_symlink() and is_ours(own.read_text(errors="replace")):
            return own
        run_id, step = meta.get("run_id", "?"), meta.get("step", "?")
        trained = [f"step {step} of run `{run_id}`, an adapter trained on `{meta.get('trained_on', '?')}` (LoRA rank "
                   f"{meta.get('rank', '?')}); the run's config is on its volume (runs/{run_id}/)"]
        path = scratch / CARD
        atomic_write_text(path, model_card(base_model=meta.get("base_model") or self.cfg.model.base_model_id,
                                           title=f"{run_id}, step {step}", trained=trained, evaluation=meta.get("eval")))
        return path

    def publish(self, adapter_id: str, folder: Path, meta: dict) -> ExportResult:
        """Uploads folder's adapter files and its model card under adapter_id, manifest last; skips what already
        matches."""
        check_adapter_id(adapter_id)
        with tempfile.TemporaryDirectory(prefix="maze-grpo-card-") as scratch:
            sources = {name: folder / name for name in ADAPTER_FILES} | {CARD: self.card(folder, meta, Path(scratch))}
            return self._publish(adapter_id, sources, meta)

    def _publish(self, adapter_id: str, sources: dict[str, Path], meta: dict) -> ExportResult:
        files = {name: {"sha256": sha256_file(path), "size": path.stat().st_size} for name, path in sources.items()}
        try:
            current = self.store.manifest(adapter_id)
        except AdapterNotFound:
            current = None
        if current and current.get("files") == files:
            return ExportResult(adapter_id, meta.get("step", -1), [], skipped=True)
        if current:
            # The id is being re-pointed (an alias): take the old manifest down first, so no reader can
            # pair it with new files; readers see "not found" until the new manifest lands.
            self.store.client.delete_object(Bucket=self.store.bucket, Key=self.store.key(adapter_id, MANIFEST))
        uploaded = []
        for name, info in files.items():
            key = self.store.key(adapter_id, name)
            if self._remote_sha(key) == info["sha256"]:
                continue
            self.store.client.upload_file(str(sources[name]), self.store.bucket, key,
                                          ExtraArgs={"Metadata": {"sha256": info["sha256"]}}, Config=TRANSFER)
            uploaded.append(name)
        manifest = {**meta, "adapter_id": adapter_id, "files": files,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.store.client.put_object(Bucket=self.store.bucket, Key=self.store.key(adapter_id, MANIFEST),
                                     Body=json.dumps(manifest, indent=2).encode(), ContentType="application/json")
        return ExportResult(adapter_id, meta.get("step", -1), uploaded, skipped=False)

    def export_run(self, run_id: str, alias: str | None = None, pick: str = "best") -> list[ExportResult]:
        """Exports every complete, valid step of a run; optionally re-points an alias. Returns what happened.

        `pick="best"` with no held-out eval of any export raises ValueError before anything is uploaded."""
        valid = []
        skyrl_evals = skyrl_eval_metrics(self.volume.run(run_id))
        for step, folder in self.complete_exports(run_id):
            try:
                config = validate_adapter(folder, self.cfg)
            except InvalidAdapter as exc:
                self.log(f"error: rejected {folder}: {exc}")
                continue
            meta = {"run_id": run_id, "step": step, "base_model": self.cfg.model.base_model_id,
                    "trained_on": config["base_model_name_or_path"],
                    "rank": config.get("r"), "eval": self.eval_summary(run_id, step, skyrl_evals)}
            valid.append((step, folder, meta))
        chosen = self.choose(run_id, valid, pick) if alias and valid else None
        results = []
        for step, folder, meta in valid:
            result = self.publish(f"{run_id}-step{step}", folder, meta)
            results.append(result)
            state = "unchanged" if result.skipped else f"uploaded {', '.join(result.uploaded) or 'manifest only'}"
            self.log(f"{result.adapter_id}: {state}")
        if chosen:
            step, folder, meta = chosen
            result = self.publish(alias, folder, {**meta, "alias_of": f"{run_id}-step{step}"})
            results.append(result)
            how = pick if pick == "latest" else f"best: held-out {100 * meta['eval']['solve_rate']:.1f}%, {meta['eval']['source']}"
            self.log(f"{alias} -> {run_id}-step{step} ({how}){' unchanged' if result.skipped else ''}")
        return results

    @staticmethod
    def choose(run_id: str, exported: list, pick: str):
        """Returns the export an alias points at: the latest, or the best held-out solve rate among those scored (on a
        tie the later step); raises ValueError when `best` finds no export scored."""
        if pick == "latest":
            return exported[-1]
        scored = [e for e in exported if e[2].get("eval")]
        if not scored:
            steps = ", ".join(str(e[0]) for e in exported)
            raise ValueError(
                f"--pick best: none of run {run_id}'s exports (steps {steps}) has a held-out eval (the trainer's "
                f"evals/global_step_N, the evaluator's evals/watch_step_N or SkyRL's exports/dumped_evals); score them "
                f"with `python -m services.evaluator --watch {run_id} --once`, or point the alias with --pick latest")
        return max(scored, key=lambda e: (e[2]["eval"]["solve_rate"], e[0]))


def adapter_table(store: AdapterStore) -> list[dict]:
    """Returns one row per complete adapter: id, run, step, eval solve rate, size, age."""
    rows = []
    now = time.time()
    for adapter_id in store.list():
        manifest = store.manifest(adapter_id)
        # The manifest's time is UTC: timegm reads it as UTC whatever the local zone and its daylight saving.
        created = calendar.timegm(time.strptime(manifest.get("created", "1970-01-01T00:00:00Z"), "%Y-%m-%dT%H:%M:%SZ"))
        evaluation = manifest.get("eval") or {}
        rows.append({
            "adapter_id": adapter_id,
            "run": manifest.get("run_id"),
            "step": manifest.get("step"),
            "solve_rate": evaluation.get("solve_rate"),
            "size": sum(f["size"] for f in manifest["files"].values()),
            "age_s": max(0, int(now - created)),
            "alias_of": manifest.get("alias_of"),
        })
    return rows
