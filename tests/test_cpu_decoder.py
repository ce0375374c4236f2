"""speedups/cpu_decoder.py: the packed decode step computes what the model's own forward computes (LoRA active,
left padding, q/k/v biases, blocked and unblocked weights), packs the adapters as they are at each
rollout without touching the model, and the CPU sampling path that uses it draws what `generate` draws."""
import pytest
import torch

from conftest import assert_draws_match
from machinery.models import load_tokenizer
from rollout import eos_ids, rollout
from speedups import cpu_decoder
from speedups.cpu_rollout import prefill_shared
from speedups.logprobs import positions


def _qwen2(tiny_model_dir):
    """A 2-layer random Qwen2 (q, k, v biases) whose K/V projections have 8 outputs: not a multiple
    of 16, so they stay unblocked, with LoRA on q, k and down."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512)
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8,
                                                             target_modules=["q_proj", "k_proj", "down_proj"]))
    for n, p in model.named_parameters():
        if "lora_B" in n or n.endswith("proj.base_layer.bias") or n.endswith("proj.bias"):
            torch.nn.init.normal_(p, std=0.1)
    return model.eval()


def _decode_logits(model, step, steps=4):
    """Next-token logits over `steps` greedy decode steps after two left-padded prompts (G = 3 rows
    each), from step(ids (N, 1), positions (N, 1), mask (N, S), cache) -> (N, V)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=g)
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    cache = prefill_shared(model, ids, attn, 3, steps)
    x, seen = ids.repeat_interleave(3, 0)[:, -1:], attn.repeat_interleave(3, 0)
    pos, out = positions(seen)[:, -1:], []
    for _ in range(steps):
        out.append(step(x, pos, seen, cache))
        x, pos = out[-1].argmax(-1, keepdim=True), pos + 1
        seen = torch.cat([seen, seen.new_ones(len(seen), 1)], 1)
    return torch.stack(out, 1)                                                     # (N, steps, V)


def _model_step(model):
    return lambda x, pos, seen, cache: model(input_ids=x, attention_mask=seen, position_ids=pos, cache=cache,
                                             use_cache=True).logits[:, -1]


def _packed_step(model):
    dec = cpu_decoder.Decoder(model)
    return lambda x, pos, seen, cache: dec.step(x[:, 0], pos[:, 0], seen.bool(), cache)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_step_equals_the_model_forward_and_leaves_it_untouched(tiny_lm, tiny_model_dir, arch):
    model = tiny_lm(lora=True).eval() if arch == "llama" else _qwen2(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        want = _decode_logits(model, _model_step(model))
        got = _decode_logits(model, _packed_step(model))
    blocked = [p.blocked for layer in cpu_decoder.Decoder(model).layers for p in layer.products]
    assert all(blocked) if arch == "llama" else (not all(blocked) and any(blocked))   # both layouts tested
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_packed_weights_are_the_current_adapters(tiny_lm):
    """Packed again after the adapters changed, and with them disabled: each time the model as it is."""
    model = tiny_lm(lora=True).eval()
    with torch.no_grad():
        first = _decode_logits(model, _packed_step(model))
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p) * 0.2)
        want = _decode_logits(model, _model_step(model))
        got = _decode_logits(model, _packed_step(model))
    assert not torch.allclose(got, first, atol=1e-3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with model.disable_adapter(), torch.no_grad():                # adapters off: the base model's own
        torch.testing.assert_close(_decode_logits(model, _packed_step(model)),
                                   _decode_logits(model, _model_step(model)), atol=1e-5, rtol=1e-5)


def test_supports_only_what_it_describes(tiny_lm, tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    assert cpu_decoder.supports(tiny_lm()) and cpu_decoder.supports(tiny_lm(lora=True))
    dora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                          LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert not cpu_decoder.supports(dora)                          # a LoRA variant lora_factors leaves out
    window = tiny_lm()
    window.config.model_type = "mistral"
    assert not cpu_decoder.supports(window)


def test_greedy_sampling_draws_what_generate_draws(tiny_lm, tiny_model_dir):
    """The CPU path (packed decoder) at temperature 0+: the same tokens as `generate` over G copies."""
    model, tok = tiny_lm(lora=True).eval(), load_tokenizer(tiny_model_dir)
    prompts = ["a short prompt", "a somewhat longer prompt with more words in it"]
    ro = rollout(model, tok, prompts, 3, 12, temperature=1e-6, min_new_tokens=12, path="shared")
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        want = model.generate(input_ids=enc["input_ids"].repeat_interleave(3, 0),
                              attention_mask=enc["attention_mask"].repeat_interleave(3, 0), do_sample=False,
                              max_new_tokens=12, min_new_tokens=12, pad_token_id=tok.pad_token_id)
    assert torch.equal(ro.completion_ids, want[:, enc["input_ids"].shape[1]:])


@pytest.mark.slow
def test_sampling_draws_from_the_distribution_generate_draws_from(small_vocab_lm):
    """Temperature 1 and top-p 0.9 through the packed decoder (a peaked distribution, conftest.small_vocab_lm):
    over 2,000 rows the first token's frequencies match the exact nucleus probabilities and `generate`'s
    within 5 binomial standard errors, and the mean per-token log-prob of 6 drawn tokens under the model
    matches generate's draws within 5 standard errors."""
    from speedups import cpu_rollout
    model = small_vocab_lm
    ids, eos, pad, n = torch.tensor([[5, 17]]), [2], 0, 2000
    attn = torch.ones_like(ids)
    torch.manual_seed(0)
    with torch.no_grad():
        ours = cpu_rollout.sample(model, ids, attn, n, 6, 6, eos, pad, 1.0, 0.9)
    torch.manual_seed(1)
    with torch.no_grad():
        theirs = model.generate(input_ids=ids.repeat(n, 1), attention_mask=attn.repeat(n, 1), do_sample=True,
                                temperature=1.0, top_p=0.9, top_k=0, max_new_tokens=6, min_new_tokens=6,
                                eos_token_id=eos, pad_token_id=pad)[:, ids.shape[1]:]
    assert_draws_match(model, ids, ours, theirs, 0.9)
