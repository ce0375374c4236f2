"""Shared fixtures: a tiny random-weight Llama with the embedded model's tokenizer."""
import pytest
import torch

from models import embedded_model_dir, load_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama with the embedded model's tokenizer, saved as a local folder."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = load_tokenizer(embedded_model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    d = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)
