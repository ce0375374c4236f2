"""GTPOTrainer on vision-language models (skipped without TRL): tiny random models of the families TRL's GRPO tests
train, built offline -- a config from transformers, a processor assembled from the embedded tokenizer and the
family's image-processor class, images drawn here. <H>_i sees the images (TRL's forward with what its loss forward
gets), and with GTPO's parts off the losses and gradients are GRPOTrainer's."""
import functools

import pytest
import torch

pytest.importorskip("trl", reason="needs TRL, an optional extra: pip install -r requirements-trl.txt")
pytest.importorskip("PIL", reason="images need Pillow")

from PIL import Image                                                  # noqa: E402
from trl import GRPOConfig, GRPOTrainer                                # noqa: E402

import gtpo                                                            # noqa: E402
from gtpo_trl import GTPOConfig
from gtpo_trl.trainer import MULTIMODAL, GTPOTrainer               # noqa: E402
from machinery.models import embedded_model_dir                                  # noqa: E402

G = 4
BASE = dict(num_generations=G, per_device_train_batch_size=2 * G, max_completion_length=6, max_steps=2,
            learning_rate=0.05, loss_type="grpo", logging_steps=1, bf16=False, use_cpu=True, report_to="none",
            save_strategy="no", disable_tqdm=True, seed=0, temperature=1.5)
OFF = dict(entropy_filter="off", ent_gamma=0.0)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _template(image):
    """A chat template that writes `image` where a message holds an image."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image +
            "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _gemma3(tok_kw):
    """Gemma-3: SigLIP tower, 4 soft tokens an image, bidirectional attention over them (token_type_ids)."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    tok = AutoTokenizer.from_pretrained(embedded_model_dir(), extra_special_tokens={
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
                                tokenizer=tok, chat_template=_template("<start_of_image>"), image_seq_length=4)
    cfg = Gemma3Config(text_config=dict(vocab_size=len(tok), head_dim=8, **TEXT, **tok_kw(tok)),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=28, patch_size=7),
                       mm_tokens_per_image=4, image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
                       eoi_token_index=tok.eoi_token_id)
    return Gemma3ForConditionalGeneration(cfg), processor


def _llava_next(tok_kw):
    """LLaVA-NeXT: CLIP tower, an image split in tiles by its size (image_sizes), a newline token per row."""
    from transformers import AutoTokenizer, LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    tok = AutoTokenizer.from_pretrained(embedded_model_dir(), extra_special_tokens={"image_token": "<image>"})
    grid = [[28, 28], [28, 56], [56, 28]]
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=grid)
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tok, chat_template=_template("<image>"),
                                   patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    cfg = LlavaNextConfig(text_config=dict(model_type="llama", vocab_size=len(tok), **TEXT, **tok_kw(tok)),
                          vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                                             projection_dim=32),
                          image_token_index=tok.image_token_id, image_grid_pinpoints=grid, vision_feature_layer=-1)
    return LlavaNextForConditionalGeneration(cfg), processor


def _idefics3(tok_kw):
    """Idefics3, SmolVLM's architecture: SigLIP tower, an image split in tiles plus a global view, a mask of each
    tile's real pixels (pixel_attention_mask)."""
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    tok = AutoTokenizer.from_pretrained(embedded_model_dir(), extra_special_tokens={
        "image_token": "<image>", "fake_image_token": "<fake_token_around_image>", "global_image_token": "<global-img>"})
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>"] + [
        f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28},
                                       do_image_splitting=True)
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=_template("<image>"))
    cfg = Idefics3Config(text_config=dict(model_type="llama", vocab_size=len(tok), **TEXT, **tok_kw(tok)),
                         vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=28, patch_size=7),
                         scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))
    return Idefics3ForConditionalGeneration(cfg), processor


def _images_only(processor_cls):
    """A Qwen-VL processor class without its video part: transformers builds that part only with torchvision, which
    the project does not install (the registry's wheel links the CUDA build of torch), and images never use it."""
    class ImagesOnly(processor_cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # ProcessorMixin takes its parts from this signature, so the video processor is dropped where it
            # pairs the parent's arguments with them
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
    return ImagesOnly


def _qwen_vl(model_cls, config_cls, processor_cls, vision, patch=14, rope=None):
    """Qwen-VL: patches merged 2 x 2, as many image tokens as the image's size gives (image_grid_thw), positions in
    3 parts (M-RoPE) that the model derives from the image's grid."""
    def build(tok_kw):
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        tok = AutoTokenizer.from_pretrained(embedded_model_dir(), extra_special_tokens={
            "image_token": "<|image_pad|>", "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"})
        images = Qwen2VLImageProcessorPil(min_pixels=(2 * patch) ** 2, max_pixels=(4 * patch) ** 2, patch_size=patch,
                                          merge_size=2, temporal_patch_size=2)
        processor = _images_only(processor_cls)(image_processor=images, tokenizer=tok,
                                                chat_template=_template("<|vision_start|><|image_pad|><|vision_end|>"))
        cfg = config_cls(text_config=dict(vocab_size=len(tok), **TEXT, **tok_kw(tok),
                                          **(rope or {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}})),
                         vision_config=dict(patch_size=patch, spatial_merge_size=2, temporal_patch_size=2, num_heads=2,
                                            **vision),
                         image_token_id=tok.image_token_id, vision_start_token_id=tok.vision_start_token_id,
                         video_token_id=tok.eos_token_id)
        return model_cls(cfg), processor
    return build


def _qwen2_vl(tok_kw):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    return _qwen_vl(Qwen2VLForConditionalGeneration, Qwen2VLConfig, Qwen2VLProcessor,
                    dict(depth=1, embed_dim=32, hidden_size=32, mlp_ratio=2))(tok_kw)


def _qwen2_5_vl(tok_kw):
    """Qwen2.5-VL: as Qwen2-VL, with windowed attention in the vision tower but for the blocks named full."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    return _qwen_vl(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, Qwen2_5_VLProcessor,
                    dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, window_size=56,
                         fullatt_block_indexes=[1]))(tok_kw)


def _qwen3_vl(tok_kw):
    """Qwen3-VL: patches of 16, learned position embeddings in the tower, features of inner tower blocks added to
    the first layers' hidden states at the image tokens (deepstack), M-RoPE's parts interleaved."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    return _qwen_vl(Qwen3VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLProcessor,
                    dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_position_embeddings=16,
                         deepstack_visual_indexes=[0]), patch=16,
                    rope={"head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "mrope_section": [1, 1, 2], "mrope_interleaved": True}})(tok_kw)


FAMILIES = {"gemma3": _gemma3, "llava_next": _llava_next, "idefics3": _idefics3, "qwen2_vl": _qwen2_vl,
            "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl}
IMAGES_ONLY = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}   # model_type -> processor


def _processor(folder):
    """The saved processor, a Qwen-VL one without its video part (_images_only)."""
    import transformers
    from transformers import AutoConfig, AutoProcessor
    name = IMAGES_ONLY.get(AutoConfig.from_pretrained(folder).model_type)
    return _images_only(getattr(transformers, name)).from_pretrained(folder) if name else AutoProcessor.from_pretrained(folder)


@functools.lru_cache
def _saved(family, folder):
    """The family's tiny model and processor saved in a folder (seed 0), its language-model head made peaked so that
    token entropies differ from one position to the next."""
    torch.manual_seed(0)
    model, processor = FAMILIES[family](lambda tok: dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                         pad_token_id=tok.pad_token_id))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _dataset(n=8):
    """Prompts of one image and a question; each image a colour of its own, sizes that differ (tiles differ)."""
    from datasets import Dataset
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}],
             "image": Image.new("RGB", (28 + 12 * (i % 3), 28 + 6 * (i % 2)), (30 * i % 256, 200 - 20 * i, 90))}
            for i in range(n)]
    return Dataset.from_list(rows)


def _length(completions, **_):
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


def _train(folder, method, cls=None, **kw):
    """2 optimizer steps -> ([logged row per step], [{parameter: gradient} per step], the trainer)."""
    from transformers import AutoModelForImageTextToText, TrainerCallback
    steps = []

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    config, trainer = {"grpo": (GRPOConfig, GRPOTrainer), "gtpo": (GTPOConfig, GTPOTrainer)}[method]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    t = (cls or trainer)(model=model, processing_class=_processor(folder), reward_funcs=[_length],
                         args=config(output_dir=f"/tmp/gtpo-vlm-{method}", **{**BASE, **kw}), callbacks=[Grads()],
                         train_dataset=_dataset())
    t.train()
    return [r for r in t.state.log_history if "loss" in r], steps, t


@pytest.fixture(params=sorted(FAMILIES))
def vlm_dir(request, tmp_path_factory):
    return _saved(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.mark.slow
def test_entropy_sees_the_images_as_trls_loss_does(vlm_dir, monkeypatch):
    """<H>_i of a batch with images sees the images: the first batch's pass for <H>_ini (entropy_filter "auto") equals
    the mean, over each completion's tokens, of the entropies TRL's loss forward computes for it, and the next
    batch's, taken from that loss forward, differs from the text-only value (the prompt-once pass on the same tokens
    without the images); Eq. 5's conflict spans are sought in the completions alone, where no image is."""
    seen = {}
    spans = gtpo.batch_conflict_weights

    def spans_of(ids, *args):
        seen.setdefault("span_ids", ids.clone())
        return spans(ids, *args)
    monkeypatch.setattr(gtpo, "batch_conflict_weights", spans_of)

    class Recording(GTPOTrainer):
        def _mean_entropy(self, out, own=None):
            h = super()._mean_entropy(out, own)
            seen.setdefault("out", dict(out)), seen.setdefault("h", h)
            return h

        def _compute_loss(self, model, inputs):
            seen.setdefault("loss_inputs", dict(inputs))
            return super()._compute_loss(model, inputs)

        def _get_per_token_logps_and_entropies(self, *args, **kw):
            logps, entropy, aux = super()._get_per_token_logps_and_entropies(*args, **kw)
            if "out" in seen and kw.get("compute_entropy") and torch.is_grad_enabled():
                seen.setdefault("loss_entropy", entropy.detach())
            return logps, entropy, aux

        def _shape_in_loss(self, entropies):
            super()._shape_in_loss(entropies)
            inputs, own = self._in_loss[1], self._in_loss[2]
            with torch.no_grad():
                text_only = gtpo.masked_mean(self._prompt_once_entropy(inputs), own, dim=1)
            seen.setdefault("deferred", (gtpo.masked_mean(entropies.detach().float(), own, dim=1), text_only))

    _, _, t = _train(vlm_dir, "gtpo", cls=Recording, max_steps=2, entropy_filter="auto", ent_gamma=0.0)
    out, h = seen["out"], seen["h"]
    assert set(MULTIMODAL) & set(out) >= {"pixel_values"}
    loss_in = seen["loss_inputs"]                                       # the same rows, which TRL shuffles
    rows = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    order = [next(j for j in range(len(rows)) if torch.equal(rows[j], row))
             for row in torch.cat([loss_in["prompt_ids"], loss_in["completion_ids"]], 1)]
    assert sorted(order) == list(range(len(rows)))
    from_loss = gtpo.masked_mean(seen["loss_entropy"], loss_in["completion_mask"], dim=1)    # (n,)
    torch.testing.assert_close(h[order], from_loss, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        text_only = gtpo.masked_mean(t._prompt_once_entropy(out), out["completion_mask"], dim=1)
    assert (h - text_only).abs().max() > 1e-3, (h, text_only)
    with_images, without = seen["deferred"]                             # the second batch: from the loss forward
    assert (with_images - without).abs().max() > 1e-3, (with_images, without)
    assert torch.equal(seen["span_ids"], out["completion_ids"])


@pytest.mark.slow
def test_gtpo_parts_off_give_grpos_losses_and_gradients(vlm_dir):
    """lambda = 1 (no conflict sampled), delta_i off and gamma 0: GRPOTrainer's logged losses and gradients at each
    of 2 steps; with GTPO's defaults (the released -gamma <H>_i, from the images' forward) the gradients move."""
    off, grpo = _train(vlm_dir, "gtpo", **OFF), _train(vlm_dir, "grpo")
    assert [r["gtpo/conflict_frac"] for r in off[0]] == [0.0, 0.0]
    assert [r["reward_std"] for r in off[0]] == [r["reward_std"] for r in grpo[0]] and off[0][0]["reward_std"] > 0
    assert [r["loss"] for r in off[0]] == pytest.approx([r["loss"] for r in grpo[0]], rel=1e-5, abs=1e-7)
    assert len(off[1]) == len(grpo[1]) == 2
    for a, b in zip(off[1], grpo[1]):
        assert a.keys() == b.keys() and a
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    on = _train(vlm_dir, "gtpo", entropy_filter="off")
    assert any(not torch.equal(x[n], y[n]) for x, y in zip(on[1], grpo[1]) for n in x)
