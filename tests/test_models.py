"""Model I/O: the tiny Qwen3-VL, its processor, chat template, masks and logprobs."""

import hashlib

import pytest
import torch
from PIL import Image

from shared.config import load_config
from shared.maze import generate, render_rgb
from shared.maze.prompt import task_prompt
from shared.models.chat import assistant_turn, limit_images, text_ids, user_turn
from shared.models.inference import LocalEngine
from shared.models.loading import ModelLoadError, load_model
from shared.models.tiny import build_tiny_model
from shared.models.training import collate, encode_turn, token_logprobs
from shared.storage.manifest import sha256_file

CELL_PX = load_config().env.cell_px  # the profile's cell size: one merged vision token per cell


def _conversation(n_turns=3, cell_px=CELL_PX):
    maze = generate("maze_2d/easy", 7)
    img = Image.fromarray(render_rgb(maze, cell_px))
    messages = [user_turn(task_prompt(maze), img)]
    for i in range(n_turns):
        messages.append(assistant_turn(f"('move', {i % 4})"))
        messages.append(user_turn("Cannot move into a wall.", img))
    return messages


def test_loader_round_trip(tiny, tiny_model_dir):
    model, processor = tiny
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    for token in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"):
        assert processor.tokenizer.tokenize(token) == [token]
    assert (tiny_model_dir / "manifest.json").exists()


def test_one_merged_token_per_maze_cell(tiny):
    _, processor = tiny
    for env_id, cells in (("maze_2d/easy", 81), ("maze_2d/hard", 121)):
        img = Image.fromarray(render_rgb(generate(env_id, 0), CELL_PX))
        grid = processor.image_processor(images=[img], return_tensors="pt")["image_grid_thw"][0]
        assert int(grid.prod()) // processor.image_processor.merge_size**2 == cells


def test_template_placeholders_match_image_grid(tiny):
    _, processor = tiny
    messages = _conversation(3)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
    enc = processor(text=[text], images=images, return_tensors="pt")
    n_image_tokens = int((enc["input_ids"] == processor.image_token_id).sum())
    merged = processor.image_processor.merge_size**2
    assert n_image_tokens == int(enc["image_grid_thw"].prod(dim=1).sum()) // merged == 4 * 81
    assert enc["input_ids"][0].tolist() == text_ids(processor, text, images)


def test_memory_guard_keeps_last_k_images_and_all_text(tiny):
    messages = _conversation(5)
    limited = limit_images(messages, 2)
    kept = [p for m in limited for p in m["content"] if p["type"] == "image"]
    texts = [p["text"] for m in limited for p in m["content"] if p["type"] == "text"]
    assert len(kept) == 2 and kept[-1] is messages[-1]["content"][1]
    assert texts == [p["text"] for m in messages for p in m["content"] if p["type"] == "text"]


def test_forward_logprobs_match_generate_scores(tiny):
    model, processor = tiny
    engine = LocalEngine(model, processor, max_images_in_context=1)
    conversations = [_conversation(1), _conversation(2)]
    completions = engine.generate(conversations, temperature=0.7, max_new_tokens=6, seed=3)
    samples = [encode_turn(engine, c, comp) for c, comp in zip(conversations, completions)]
    batch = collate(processor, samples)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch, temperature=0.7)
    for row, (sample, comp) in enumerate(zip(samples, completions)):
        positions = [i for i, m in enumerate(sample.response_mask) if m]
        forward = logprobs[row, positions]
        assert forward.shape[0] == len(comp.logprobs) > 0
        assert torch.allclose(forward, torch.tensor(comp.logprobs), atol=1e-4), (forward, comp.logprobs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replies_never_contain_vision_placeholders(tiny, temperature):
    # Found by a T=1.0 GRPO run: a sampled <|image_pad|> in a reply broke the learner's batch.
    model, processor = tiny
    engine = LocalEngine(model, processor, max_images_in_context=1)
    favoured = processor.image_token_id
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: out.index_fill(-1, torch.tensor([favoured]), 50.0))
    try:
        completions = engine.generate([_conversation(1), _conversation(2)], temperature=temperature, max_new_tokens=4, seed=0)
    finally:
        hook.remove()
    assert engine.suppress_ids and favoured in engine.suppress_ids
    for completion in completions:
        assert not set(completion.token_ids) & set(engine.suppress_ids), completion.token_ids
    # the replies replay through training without an image/feature mismatch
    samples = [encode_turn(engine, c, comp) for c, comp in zip([_conversation(1), _conversation(2)], completions)]
    with torch.no_grad():
        token_logprobs(model, collate(processor, samples), temperature=1.0)


def test_tiny_model_is_deterministic(tmp_path, tiny_model_dir):
    cfg = load_config(None, [f"storage.shared_dir={tmp_path}"], environ={})
    again = build_tiny_model(cfg, tmp_path / "again")
    weights = "model.safetensors"
    assert sha256_file(again / weights) == sha256_file(tiny_model_dir / weights)
    other = build_tiny_model(cfg, tmp_path / "other", seed=cfg.seed + 1)
    assert sha256_file(other / weights) != sha256_file(again / weights)


def test_missing_or_corrupt_model_fails_clearly(tmp_path, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="make tiny-model"):
        load_model(tmp_path / "nothing")
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    with open(broken / "model.safetensors", "r+b") as handle:
        handle.seek(200)
        handle.write(b"\x00garbage\x00")
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(broken)


def test_greedy_generation_is_batch_invariant(tiny):
    model, processor = tiny
    engine = LocalEngine(model, processor, max_images_in_context=1)
    convs = [_conversation(1), _conversation(3)]
    together = engine.generate(convs, temperature=0.0, max_new_tokens=5)
    alone = [engine.generate([c], temperature=0.0, max_new_tokens=5)[0] for c in convs]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    digest = hashlib.sha256(str([c.token_ids for c in together]).encode()).hexdigest()
    assert digest == hashlib.sha256(str([c.token_ids for c in engine.generate(convs, 0.0, 5)]).encode()).hexdigest()


def test_vision_tower_starts_out_seeing_neighbours(tiny):
    """The first vision block's heads 0-3 look one cell right/up/left/down; outputs are centred."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    from shared.models.tiny import NEIGHBOURS

    model, processor = tiny
    visual = model.model.visual
    attn = visual.blocks[0].attn
    rotary = visual.rot_pos_emb(torch.tensor([[1, 9, 9]]))
    emb = torch.cat((rotary, rotary), dim=-1)
    bias = attn.qkv.bias.view(3, attn.num_heads, attn.head_dim)
    query, key = bias[0].expand(81, -1, -1), bias[1].expand(81, -1, -1)
    query, key = apply_rotary_pos_emb_vision(query, key, emb.cos(), emb.sin())
    weights = torch.einsum("qhd,khd->hqk", query, key).mul(attn.head_dim**-0.5).softmax(-1)
    centre = 4 * 9 + 4
    for head, (d_row, d_col) in enumerate(NEIGHBOURS):
        assert int(weights[head, centre].argmax()) == (4 + d_row) * 9 + 4 + d_col
        assert float(weights[head, centre].max()) > 0.9

    images = [Image.fromarray(render_rgb(generate("maze_2d/easy", s), CELL_PX)) for s in range(100, 108)]
    inputs = processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    features = torch.cat(list(features))
    deviation = (features - features.mean(0)).norm(dim=-1).mean()
    assert features.mean(0).norm() < 0.5 * deviation  # no shared component drowning the cells


def test_shared_decoder_gives_transformers_generate_replies(tiny):
    """The default decoder (one prefill per distinct context, a plain decode loop) against `model.generate`."""
    model, processor = tiny
    fast = LocalEngine(model, processor, max_images_in_context=1)
    reference = LocalEngine(model, processor, max_images_in_context=1, decoder="transformers")
    convs = [_conversation(1), _conversation(2), _conversation(1), _conversation(3)]  # one context twice
    greedy = [fast.generate(convs, 0.0, 6), reference.generate(convs, 0.0, 6)]
    assert [c.token_ids for c in greedy[0]] == [c.token_ids for c in greedy[1]]
    assert [c.text for c in greedy[0]] == [c.text for c in greedy[1]]
    for ours, theirs in zip(*greedy):
        assert torch.allclose(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-4)
    # Whole greedy episodes, replies fed back turn by turn: the same play.
    from shared.episodes import EpisodeSettings, run_episodes

    settings = EpisodeSettings(max_turns=4, cell_px=CELL_PX, max_new_tokens=8)
    mazes = [generate("maze_2d/easy", seed) for seed in range(4)]
    plays = [[[t.text for t in e.turns] for e in run_episodes(engine, mazes, settings)] for engine in (fast, reference)]
    assert plays[0] == plays[1]


def test_scored_replies_are_the_training_forwards_log_probabilities(tiny):
    """`score_replies` (the decision probes' teacher-forced score, one forward over every candidate's tokens) against
    the sum of the reply tokens' log-probabilities the training forward gives the same context + reply + end of turn,
    for replies of different lengths and a context asked twice."""
    from shared.models.training import reply_sample

    model, processor = tiny
    engine = LocalEngine(model, processor, max_images_in_context=1)
    convs = [_conversation(1), _conversation(2), _conversation(1)]
    candidates = [["('move', 0)", "stop", "('move', 3) and then some more words"]] * len(convs)
    scores = engine.score_replies(convs, candidates)
    for conversation, options, got in zip(convs, candidates, scores):
        samples = [reply_sample(processor, conversation, reply, engine.max_images, engine.context_turns)
                   for reply in options]
        batch = collate(processor, samples)
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, batch)
        expected = (logprobs * batch["response_mask"]).sum(dim=1)
        assert torch.allclose(torch.tensor(got), expected, atol=1e-4), (got, expected)
    assert scores[0] == scores[2]


def test_shared_decoder_computes_each_distinct_state_once(tiny):
    model, processor = tiny
    engine = LocalEngine(model, processor, max_images_in_context=1)
    widths = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _m, _args, kwargs: widths.append(tuple(kwargs["inputs_embeds"].shape[:2])), with_kwargs=True)
    try:
        convs = [_conversation(1)] * 6 + [_conversation(2)] * 2  # a GRPO group's first turns: 2 distinct contexts
        sampled = engine.generate(convs, temperature=1.0, max_new_tokens=5, seed=11)
    finally:
        hook.remove()
    assert widths[0][0] == 1, "the task prompt every context starts with: once"
    assert widths[1][0] == 2, "then one prefill row per distinct context"
    # Then one decode row per distinct state: (context, reply so far) of the episodes still writing.
    states = {(0 if i < 6 else 1, tuple(c.token_ids[:1])) for i, c in enumerate(sampled) if len(c.token_ids) > 1}
    assert widths[2] == (len(states), 1)
    assert all(rows <= 8 and length == 1 for rows, length in widths[2:])
    # The six copies are sampled independently (the untrained model's replies are near uniform), reproducibly.
    assert len({tuple(c.token_ids) for c in sampled[:6]}) > 1
    again = engine.generate(convs, temperature=1.0, max_new_tokens=5, seed=11)
    assert [c.token_ids for c in again] == [c.token_ids for c in sampled]


def test_shared_decoder_sees_changed_vision_weights(tiny):
    """Cached picture features are dropped when a vision weight changes (as an optimizer step or a loaded
    adapter would change it): the replies then follow the new weights, as `model.generate`'s do."""
    model, processor = tiny
    fast = LocalEngine(model, processor, max_images_in_context=1)
    reference = LocalEngine(model, processor, max_images_in_context=1, decoder="transformers")
    convs = [_conversation(1), _conversation(2)]
    before = [c.token_ids for c in fast.generate(convs, 0.0, 6)]
    assert fast.shared._features, "the pictures' features were cached"
    weight = model.model.visual.merger.linear_fc2.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-3.0)  # in place, as optimizer.step() and load_state_dict() write
        after = [c.token_ids for c in fast.generate(convs, 0.0, 6)]
        assert after == [c.token_ids for c in reference.generate(convs, 0.0, 6)]
        assert after != before, "the changed vision tower changes the replies"
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert [c.token_ids for c in fast.generate(convs, 0.0, 6)] == before


def test_shared_decoder_caches_no_vision_features_under_a_vision_lora(tiny):
    """A LoRA on the vision tower can be disabled or switched without writing a weight: nothing is cached."""
    from peft import LoraConfig, get_peft_model

    from shared.models.loading import lora_target_regex

    model, processor = tiny
    wrapped = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                                               target_modules=lora_target_regex(["qkv", "q_proj"], False)))
    try:
        wrapped.eval()
        fast = LocalEngine(wrapped, processor, max_images_in_context=1)
        reference = LocalEngine(wrapped, processor, max_images_in_context=1, decoder="transformers")
        convs = [_conversation(1), _conversation(2)]
        on = [c.token_ids for c in fast.generate(convs, 0.0, 6)]
        with wrapped.disable_adapter():
            off = [c.token_ids for c in fast.generate(convs, 0.0, 6)]
            assert off == [c.token_ids for c in reference.generate(convs, 0.0, 6)]
        assert on == [c.token_ids for c in reference.generate(convs, 0.0, 6)]
        assert not fast.shared._features
    finally:
        wrapped.unload()  # the session's tiny model goes back as it was


def test_shared_decoder_cache_limit_never_drops_a_picture_in_use(tiny, monkeypatch):
    """Found by a 512-maze eval: a full feature cache evicted pictures the same call was about to use."""
    from shared.models import shared_decoder as decoder_module

    monkeypatch.setattr(decoder_module, "PIXEL_CACHE_IMAGES", 2)
    model, processor = tiny
    fast = LocalEngine(model, processor, max_images_in_context=1)
    reference = LocalEngine(model, processor, max_images_in_context=1, decoder="transformers")

    def first_turn(seed):
        maze = generate("maze_2d/easy", seed)
        return [user_turn(task_prompt(maze), Image.fromarray(render_rgb(maze, CELL_PX)))]

    fast.generate([first_turn(1), first_turn(2)], 0.0, 4)  # pictures 1 and 2 cached
    convs = [first_turn(1), first_turn(3), first_turn(4)]  # 1 is the oldest entry: a hit that must survive
    assert [c.token_ids for c in fast.generate(convs, 0.0, 4)] == [c.token_ids for c in reference.generate(convs, 0.0, 4)]
    assert len(fast.shared._features) == 2


def test_unseeded_sampling_leaves_the_process_random_state_alone(tiny):
    model, processor = tiny
    engine = LocalEngine(model, processor, max_images_in_context=1)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    engine.generate([_conversation(1)] * 2, temperature=1.0, max_new_tokens=3)
    assert torch.equal(torch.rand(3), expected), "sampling without a seed re-seeded torch's global generator"


def test_each_row_samples_from_its_own_seed(tiny):
    model, processor = tiny
    engine = LocalEngine(model, processor, max_images_in_context=1)
    convs = [_conversation(1), _conversation(2), _conversation(1), _conversation(3)]
    batch = engine.generate(convs, temperature=1.0, max_new_tokens=5, seed=[7, 8, 7, 9])
    assert batch[0].token_ids == batch[2].token_ids, "two rows with one seed and one context draw alike"
    alone = engine.generate([convs[1]], temperature=1.0, max_new_tokens=5, seed=[8])[0]
    assert alone.token_ids == batch[1].token_ids, "a row's draw does not depend on the rows beside it"
    assert [c.token_ids for c in engine.generate(convs, 1.0, 5, seed=7)] == \
        [c.token_ids for c in engine.generate(convs, 1.0, 5, seed=[7, 8, 9, 10])], "an int seed means seed + index"


def test_nucleus_keeps_the_smallest_set_holding_top_p():
    from shared.models.shared_decoder import nucleus

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]])
    assert torch.allclose(nucleus(probs, 0.8), torch.tensor([[0.5, 0.3, 0.0, 0.0], [0.9, 0.0, 0.0, 0.0]]))
    assert torch.equal(nucleus(probs, 1.0), probs)


def test_only_an_engine_that_scores_replies_runs_the_decision_probes(tiny):
    """The probes (shared.branching) read replies teacher-forced: the in-process engine is a ScoringEngine and scores
    all five actions; an HTTP engine is not, and is refused in one line before any request."""
    from shared.branching import ACTIONS, action_scores
    from shared.episodes import EpisodeSettings
    from shared.models.contract import ScoringEngine
    from shared.models.endpoint import OpenAIEngine

    model, processor = tiny
    local, http = LocalEngine(model, processor, max_images_in_context=1), OpenAIEngine("http://127.0.0.1:9", "m")
    assert isinstance(local, ScoringEngine) and not isinstance(http, ScoringEngine)
    maze = generate("maze_2d/easy", 1)
    scores = action_scores(local, [_conversation(1)], [maze], EpisodeSettings())
    assert len(scores) == 1 and len(scores[0]) == len(ACTIONS) and all(s < 0 for s in scores[0])
    with pytest.raises(TypeError, match="^OpenAIEngine cannot score given replies"):
        action_scores(http, [_conversation(1)], [maze], EpisodeSettings())
