"""The LoRA adapters SkyRL's own writers produce load with PEFT and with our readers.

SkyRL's model wrapper builds the PEFT policy from the tiny Qwen3-VL with the LoRA settings our overrides give
it; then SkyRL's checkpoint writer (`FSDPStrategy._save_lora_adapters`: ckpts/global_step_N/policy/lora_adapter)
and its engine-sync writer (`FSDPPolicyWorkerBase._save_lora_adapters_and_sync`: lora_sync/) write them, in a
one-process gloo group. SkyRL writes `list(target_modules)` into adapter_config.json, so a regex string (what we
used to pass) arrives as single characters and PEFT refuses the adapter.
"""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper
from skyrl.train.config import FSDPConfig

from services.trainer.skyrl_backend import skyrl_config, skyrl_overrides
from shared.config import load_config
from shared.models.inference import LocalEngine
from shared.models.loading import attach_adapter, load_model

REPO = Path(__file__).resolve().parents[2]
OLD_REGEX = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


pytestmark = pytest.mark.usefixtures("one_process_group")


class EngineClient:
    """Where SkyRL's sync writer sends the load request after writing the files (vLLM on a GPU cluster)."""

    def __init__(self):
        self.requests = []

    async def update_named_weights(self, request):
        self.requests.append(request)


def skyrl_policy(model_dir: Path, target_modules):
    """Returns SkyRL's PEFT policy for the tiny model, with non-zero adapter weights (as after some training)."""
    wrapper = HFModelWrapper(str(model_dir), use_flash_attention_2=False, bf16=False, lora_rank=4, lora_alpha=8,
                             target_modules=target_modules)
    with torch.no_grad():
        for name, param in wrapper.model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    return wrapper


def write_both(wrapper, folder: Path) -> tuple[Path, Path]:
    ckpt = folder / "ckpts" / "global_step_20" / "policy"
    FSDPStrategy._save_lora_adapters(FSDPStrategy(fsdp_config=FSDPConfig()), wrapper.model, str(ckpt))
    sync = folder / "lora_sync"
    client = EngineClient()
    host = SimpleNamespace(model=wrapper, _is_multimodal_lm_only=False)
    asyncio.run(FSDPPolicyWorkerBase._save_lora_adapters_and_sync(host, wrapper.model, str(sync), client))
    assert [r.lora_path for r in client.requests] == [str(sync)]
    return ckpt / "lora_adapter", sync


def test_adapters_from_skyrls_writers_load_with_peft_and_our_readers(tmp_path, tiny_model_dir):
    cfg = load_config(REPO / "configs/qwen3vl-8b-hyperpod.yaml", [f"storage.shared_dir={tmp_path}"], environ={})
    targets = skyrl_overrides(cfg, tmp_path / "t", tmp_path / "v")["trainer.policy.model.lora.target_modules"]
    wrapper = skyrl_policy(tiny_model_dir, targets)
    lora_layers = [n for n, _ in wrapper.model.named_modules() if n.endswith("lora_A")]
    assert lora_layers and all(".language_model." in n for n in lora_layers), "the vision tower stays untouched"

    prompt = [{"role": "user", "content": "which way?"}]
    for adapter in write_both(wrapper, tmp_path):
        written = json.loads((adapter / "adapter_config.json").read_text())
        assert sorted(written["target_modules"]) == sorted(cfg.lora.target_modules)
        base, processor = load_model(tiny_model_dir)
        peft_model = PeftModel.from_pretrained(base, str(adapter))
        loaded = {n: p for n, p in peft_model.named_parameters() if "lora_B" in n}
        assert len(loaded) == len(lora_layers) and all(torch.all(p == 0.01) for p in loaded.values())
        # Our reader (what the evaluator and the trainer's resume use), then one greedy reply through our engine.
        ours = attach_adapter(load_model(tiny_model_dir)[0], adapter)
        reply = LocalEngine(ours, processor, max_images_in_context=1).generate([prompt], max_new_tokens=3)[0]
        assert reply.error is None and reply.token_ids


def test_a_regex_target_arrives_as_characters_and_peft_refuses_it(tmp_path, tiny_model_dir):
    wrapper = skyrl_policy(tiny_model_dir, OLD_REGEX)
    ckpt_adapter, _ = write_both(wrapper, tmp_path)
    written = json.loads((ckpt_adapter / "adapter_config.json").read_text())
    assert written["target_modules"] == list(OLD_REGEX)
    with pytest.raises(Exception):  # noqa: B017 - whichever error PEFT raises, the adapter does not load
        PeftModel.from_pretrained(load_model(tiny_model_dir)[0], str(ckpt_adapter))


class StrategyDispatch:
    """SkyRL's WorkerDispatch reduced to one process: `save_hf_model` goes to the FSDP strategy's own writer,
    as SkyRL's policy worker does (`Worker.save_hf_model` -> `strategy.save_hf_model`) on each GPU."""

    def __init__(self, wrapper):
        self.wrapper = wrapper

    def save_hf_model(self, model: str, export_dir: str, tokenizer) -> None:
        assert model == "policy"
        FSDPStrategy(fsdp_config=FSDPConfig()).save_hf_model(self.wrapper, export_dir, tokenizer)


def skyrl_trainer(trainer_class, cfg, wrapper, step: int):
    """SkyRL's trainer with what its `save_models` reads: the run's SkyRL config, the step and the dispatch."""
    trainer = object.__new__(trainer_class)
    trainer.cfg = skyrl_config(cfg)
    trainer.global_step, trainer.tokenizer, trainer.dispatch = step, None, StrategyDispatch(wrapper)
    return trainer


def test_the_skyrl_backend_seals_each_export_skyrl_writes(tmp_path, tiny_model_dir, monkeypatch):
    """SkyRL's own `save_models` writes exports/global_step_N/policy/ with no manifest; the trainer the skyrl backend
    runs seals it right away, so the evaluator and exporter take it. SkyRL's plain trainer leaves it unsealed: the
    readers skip it, writing nothing, and name the command that adopts it."""
    from skyrl.train.trainer import RayPPOTrainer

    from services.trainer.skyrl_backend import sealing_experiment
    from shared.storage.manifest import MANIFEST, verify_manifest
    from shared.storage.volume import SharedVolume, complete_exports

    cfg = load_config(REPO / "configs/tiny-cpu.yaml", [f"storage.shared_dir={tmp_path}", "backend=skyrl",
                      "cluster.num_workers=1", "cluster.num_engines=2", "algorithm.micro_batch_size=8",
                      "algorithm.advantage_estimator=grpo"], environ={})
    volume = SharedVolume(tmp_path)
    experiment = sealing_experiment()
    # The experiment the backend runs builds this trainer where SkyRL's BasePPOExp builds its own.
    built = {}
    monkeypatch.setattr(RayPPOTrainer, "__init__", lambda self, **kwargs: built.update(kwargs))
    made = experiment.get_trainer(object.__new__(experiment), **{name: name for name in (
        "cfg", "tracker", "tokenizer", "train_dataset", "eval_dataset", "inference_engine_client", "generator",
        "colocate_pg")})
    assert type(made) is experiment.trainer_class and issubclass(made.__class__, RayPPOTrainer)
    assert built == {name: name for name in built} and len(built) == 8
    monkeypatch.undo()

    wrapper = skyrl_policy(tiny_model_dir, cfg.lora.target_modules)
    skyrl_trainer(experiment.trainer_class, cfg, wrapper, 20).save_models()
    skyrl_trainer(RayPPOTrainer, cfg, wrapper, 40).save_models()

    sealed = volume.export(cfg.run_id, 20)
    manifest = verify_manifest(sealed)
    assert set(manifest["files"]) == {p.name for p in sealed.iterdir() if p.name != MANIFEST}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(manifest["files"])
    unsealed = volume.export(cfg.run_id, 40)
    assert (unsealed / "adapter_model.safetensors").is_file() and not (unsealed / MANIFEST).exists()

    warnings = []
    assert complete_exports(volume, cfg.run_id, warn=warnings.append) == [(20, sealed)]
    assert not (unsealed / MANIFEST).exists(), "reading the volume wrote nothing"
    assert len(warnings) == 1 and "services.exporter adopt --run tiny-cpu" in warnings[0]
    # The sealed export is what the evaluator loads: one greedy reply through our engine with SkyRL's adapter.
    base, processor = load_model(tiny_model_dir)
    reply = LocalEngine(attach_adapter(base, sealed), processor, max_images_in_context=1).generate(
        [[{"role": "user", "content": "which way?"}]], max_new_tokens=3)[0]
    assert reply.error is None and reply.token_ids
