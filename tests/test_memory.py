"""speedups/memory.py: the estimate against the tensor memory of real steps measured on CPU, the paper's
models with the defaults, the two GPU measurements, and the micro-batch it picks."""
import dataclasses

import pytest
from speedups.memory import (CPU_CHECKS, Settings, activation_rates, cpu_check, estimate, fit, measured_peak,
                             model_config, table)


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
@pytest.mark.parametrize("name", list(CPU_CHECKS))
def test_estimate_is_within_20_percent_of_the_peak_measured_on_cpu(name):
    config, s = cpu_check(name)
    est, measured = estimate(config, s)["step"], measured_peak(config, s)
    assert 0.8 <= est / measured <= 1.2, (est, measured)


@pytest.mark.parametrize("name, rank", [("llama-1b", 64), ("qwen2.5-3b", 0)])    # qwen2.5-3b ties its head
def test_parameter_counts_from_two_layers_equal_the_whole_models(name, rank):
    from transformers import AutoConfig

    from speedups.memory import SHAPES, _key, _layer_counts, param_counts
    kw = {**SHAPES[name], "num_hidden_layers": 5}      # a few layers: the whole model is built to compare
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    assert param_counts(_key(config), rank) == _layer_counts(config, None, rank)


def test_the_paper_models_with_the_defaults_fit_one_a100_40gb():
    llama = estimate(model_config("llama-8b"), Settings())           # G 12, 250 + 1,500 tokens, 4-bit, r 128
    qwen = estimate(model_config("qwen2.5-3b"), Settings(lora_rank=64))
    assert llama["card"] <= 40e9 and qwen["card"] <= 20e9
    assert llama["gradient"] > llama["sampling"] > llama["weights"] > 4e9      # 8B in NF4 is ~4.5 GB + head


def test_consistent_with_the_two_gpu_measurements():
    """H100 runs before autocast (fp32 activations, no checkpointing): the 1B shape at micro-batches
    of 4 and 256 tokens peaked at 6.32 GB; the 8B shape at micro-batches of 4 and 1,500 tokens ran out
    of memory with 77.4 GB allocated. fp32 weights stand in for that precision."""
    before = dict(dtype_bytes=4, autocast=False, gradient_checkpointing=False, micro_batch_size=4)
    one_b = estimate(model_config("llama-1b"), Settings(lora_rank=64, completion_tokens=256, share_prompt=True,
                                                         **before))
    assert abs(one_b["peak"] / 6.32e9 - 1) <= 0.2
    assert estimate(model_config("llama-8b"), Settings(**before))["peak"] > 77.4e9


def test_fit_picks_the_largest_micro_batch_that_fits():
    config, s = model_config("llama-8b"), Settings(batch_size=2)      # the authors' command: 24 completions
    m, est = fit(config, s, 30e9)
    assert 1 <= m < 24 and est["card"] <= 30e9
    assert estimate(config, dataclasses.replace(s, micro_batch_size=m + 1))["card"] > 30e9
    assert fit(config, s, 5e9)[0] is None                           # not even one: the caller explains


def test_bf16_autocast_and_checkpointing_each_lower_the_step():
    config = model_config("llama-8b")
    assert activation_rates(config, Settings())[0] < 0.8 * activation_rates(config, Settings(dtype_bytes=4,
                                                                                              autocast=False))[0]
    on, off = (estimate(config, Settings(gradient_checkpointing=c))["gradient"] for c in (True, False))
    assert on < off / 4


def test_table_rows_and_the_defaults_line():
    lines = table("qwen2.5-3b", Settings(lora_rank=64), 40e9, micro_batches=(1, 12))
    on, off = lines[3], lines[4]
    assert on.startswith("| checkpointing on |") and off.startswith("| checkpointing off |")
    assert float(on.split("|")[2]) < float(on.split("|")[3]) < float(off.split("|")[3])
    assert lines[-4].startswith("sampler: ") and lines[-2].startswith("sampler, 2 ranks: ")
    assert lines[-3].startswith("qwen2.5-3b defaults: ") and "micro-batches of 12 of 12" in lines[-3]
    assert lines[-1].startswith("qwen2.5-3b defaults, 2 ranks (per GPU): ") and "ranks 0.5" in lines[-1]
    assert "h_ini" in lines[-3] and "ranks" not in lines[-3]


def test_ranks_the_merged_sampler_and_h_ini_are_counted():
    """DDP's buckets hold the gradients through sampling too; the merged sampler's copy is kept through
    the gradient pass; <H>_ini's stage is a stage of its own; the card adds the context and NCCL."""
    config = model_config("llama-8b")
    one, two = estimate(config, Settings()), estimate(config, Settings(world_size=2))
    assert one["ranks"] == 0 and two["ranks"] > 1e9 and two["sampling"] - one["sampling"] == two["ranks"]
    assert two["gradient"] == one["gradient"]                        # bucket views: no second gradient copy
    assert two["card"] - one["card"] == pytest.approx(0.5e9 + 0.05 * (two["peak"] - one["peak"]))
    merged = estimate(config, Settings(sampler="merged"))
    assert merged["sampler"] > 10e9 and merged["gradient"] - one["gradient"] == merged["sampler"]
    assert one["sampling"] < one["h_ini"] < one["gradient"] and one["peak"] == one["step"] == one["gradient"]


def test_plan_turns_checkpointing_off_when_a_whole_group_fits_without_it():
    from speedups.memory import plan
    config = model_config("qwen2.5-3b")
    s = Settings(lora_rank=64, generation_size=8, completion_tokens=512)
    ckpt, m, est = plan(config, s, 80e9)
    assert (ckpt, m) == (False, 8) and est["card"] <= 80e9
    ckpt, m, est = plan(config, Settings(lora_rank=64), 40e9)             # G 12 x 1,500 tokens
    off, _ = fit(config, dataclasses.replace(Settings(lora_rank=64), gradient_checkpointing=False), 40e9)
    assert ckpt and (off is None or off < 12) and m >= 1 and est["card"] <= 40e9
    assert plan(config, dataclasses.replace(s, micro_batch_size=2), 80e9)[:2] == (False, 2)


def test_the_sampler_choice_follows_the_budget():
    """--rollout auto on CUDA: llama-8b with the defaults takes the merged copy with 80 GB and `generate` with
    16 GB, where the copy (14 GB of bf16 Linear layers) leaves no room; `bench --parts memory` prints it."""
    from speedups.memory import GB, choose_sampler
    config = model_config("llama-8b")
    sampler, _, m, est, why = choose_sampler(config, Settings(), 80e9)
    assert sampler == "merged" and m == 12 and est["sampler"] > 13e9 and est["card"] <= 80e9 and "80.0 GB" in why
    sampler, _, m, est, why = choose_sampler(config, Settings(), 16e9)
    assert sampler == "generate" and m is not None and est["sampler"] == 0 and est["card"] <= 16 * GB
    assert "sampler: merged (" in table("llama-8b", Settings(), 80e9)[-4]
    assert "sampler: generate (" in table("llama-8b", Settings(), 16e9)[-4]


def test_the_merged_copy_keeps_headroom_for_its_first_step_on_40_and_80_gb():
    """The paper's 8B defaults: the merged copy only where the step, its first use included (`first`), fits 90 %
    of the budget -- at 40 GB on one and on each of two ranks it is taken with smaller micro-batches and the
    card stays within 36 GB; at 80 GB with one micro-batch of 12; at 16 GB `generate`."""
    import dataclasses
    from speedups.memory import GB, HEADROOM, Settings, choose_sampler, model_config
    config = model_config("llama-8b")
    for world in (1, 2):
        s = Settings(world_size=world)
        sampler, ckpt, m, est, why = choose_sampler(config, s, 40e9)
        assert sampler == "merged" and est["card"] <= HEADROOM * 40e9 <= 36 * GB and m < 12
        assert est["first"] > 0 and est["peak"] == max(est["h_ini"], est["step"]) + est["first"]
        assert "of 36.0 GB (90% of the 40.0 GB budget)" in why
        sampler, _, m, est, _ = choose_sampler(config, s, 80e9)
        assert sampler == "merged" and m == 12 and est["card"] <= 72 * GB
        assert choose_sampler(config, s, 16e9)[0] == "generate"
    from speedups.memory import estimate
    assert estimate(config, dataclasses.replace(Settings(), sampler="generate"))["first"] == 0
