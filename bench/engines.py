"""GTPOTrainer for 2 steps under DDP and under DeepSpeed ZeRO-3 (configs/zero3.yaml) on this machine's first device,
one process each, on a random-weight model of a named shape: seconds a step, peak memory, the losses.

    python -m bench.engines --device cuda --shape llama-1b      # a lent GPU (docs/trl.md records it)
    python -m bench.engines --device cpu --shape tiny           # its dry run (the engine forced, as the tests do)
    python -m bench.engines --entropy_pass                      # the <H>_i pass's memory, the loop's way and TRL's

Each run is `accelerate launch --num_processes 1` of this file's worker; one JSON line a run on stdout and in
--out. Needs TRL, and for ZeRO-3 DeepSpeed (requirements-engines.txt).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def force_engine():
    """Make accelerate take the launched engine on a CPU. accelerate enables DeepSpeed and FSDP on accelerator
    devices only, so this gives it a GPU-like distributed type with the CPU as its device and gloo as the backend
    (DeepSpeed with DS_ACCELERATOR=cpu); tests/test_engines.py runs every engine so."""
    import accelerate.state as state
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    state.PartialState._prepare_backend = lambda self, cpu=False, sagemaker_dp=False, backend=None: (
        "gloo", state.DistributedType.MULTI_GPU)


def worker(engine, model_dir, device, tokens):
    """2 GTPO steps of 1 prompt x G = 8, `tokens` new tokens each, LoRA 16: one JSON line."""
    import torch
    sys.path.insert(0, HERE)
    if device == "cpu" and engine != "ddp":
        force_engine()
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from gtpo_trl import GTPOConfig, GTPOTrainer
    from machinery.models import load_tokenizer
    cuda = device == "cuda"
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    args = GTPOConfig(output_dir=tempfile.mkdtemp(), num_generations=8, per_device_train_batch_size=8,
                      max_completion_length=tokens, max_steps=2, bf16=cuda, use_cpu=device == "cpu" and engine == "ddp",
                      report_to="none", save_strategy="no", seed=0, disable_tqdm=True, logging_steps=1,
                      generation_kwargs={"min_new_tokens": tokens}, entropy_filter="off")
    reward = lambda completions, **_: [float(len(c) % 3) for c in completions]   # noqa: E731
    trainer = GTPOTrainer(model=model, processing_class=load_tokenizer(model_dir), reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "one two three four"}] * 4),
                          peft_config=LoraConfig(r=16, target_modules="all-linear"), callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    print("RESULT " + json.dumps({"engine": str(trainer.accelerator.distributed_type).split(".")[-1],
                                  "step_s": [b - a for a, b in zip([start] + ends, ends)], "peak_gb": peak,
                                  "loss": [r["loss"] for r in trainer.state.log_history if "loss" in r]}), flush=True)


def entropy_pass_peaks(tokens=96):
    """The live-tensor peak (bytes, the profiler's memory timeline) of <H>_i's no-grad pass on the TRL example's
    shape (the embedded model, fp32, 8 completions of `tokens` after its one-shot prompt), two ways: the loop's
    chunked pass with each prompt once (speedups.logprobs.sequence_logprobs) and TRL's own forward in chunks of 8 rows
    (what GTPOTrainer runs). -> {way: bytes}."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline
    import gtpo_trl
    from speedups.logprobs import sequence_logprobs
    trainer = gtpo_trl.example_trainer(max_steps=1, max_completion_length=tokens, disable_tqdm=True)
    enc = trainer.processing_class([trainer.train_dataset[0]["prompt"]], return_tensors="pt")
    g = torch.Generator().manual_seed(0)
    out = {"prompt_ids": enc["input_ids"].repeat(8, 1), "prompt_mask": enc["attention_mask"].repeat(8, 1),
           "completion_ids": torch.randint(100, 10000, (8, tokens), generator=g),
           "completion_mask": torch.ones(8, tokens, dtype=torch.long)}
    ways = {"loop's pass, each prompt once": lambda: sequence_logprobs(
                trainer.model, out["prompt_ids"][:1], out["prompt_mask"][:1], out["completion_ids"],
                out["completion_mask"], prompt_index=torch.zeros(8, dtype=torch.long)),
            "TRL's forward (GTPOTrainer)": lambda: trainer._mean_entropy(out)}
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    ways["the loss's pass, with its gradient (TRL's, for comparison)"] = lambda: (
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, tokens, compute_entropy=True)[0].sum()
        .backward())
    peaks = {}
    for way, run in ways.items():
        grad = torch.enable_grad() if "gradient" in way else torch.no_grad()
        with grad, profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                           with_stack=True) as prof:
            run()
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
        totals = [sum(s) for s in sizes]
        peaks[way] = max(totals) - totals[0]
    return peaks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="llama-1b", help="memory.SHAPES alias, or tiny")
    p.add_argument("--tokens", type=int, default=128, help="forced new tokens per completion")
    p.add_argument("--engines", nargs="+", default=["ddp", "zero3"], choices=["ddp", "zero3"])
    p.add_argument("--out", default="bench-engines.json")
    p.add_argument("--entropy_pass", action="store_true", help="instead: the <H>_i pass's memory, two ways, on CPU")
    a = p.parse_args(argv)
    if a.entropy_pass:
        for way, peak in entropy_pass_peaks().items():
            print(f"{way}: {peak / 1e6:.1f} MB live-tensor peak")
        return
    from bench.gpu import random_model_dir
    model_dir = random_model_dir(a.shape, a.device)
    results = {}
    for engine in a.engines:
        config = [] if engine == "ddp" else ["--config_file", os.path.join(HERE, "configs", f"{engine}.yaml")]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *config, "--num_processes", "1",
               "--mixed_precision", "no", __file__, engine, model_dir, a.device, str(a.tokens)]
        t = time.perf_counter()
        path = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))     # a carried site too
        r = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        results[engine] = {**(json.loads(lines[-1][7:]) if lines else {"error": r.stderr[-2000:]}),
                           "wall_s": time.perf_counter() - t, "returncode": r.returncode}
        print(engine, json.dumps(results[engine])[:600], flush=True)
    with open(a.out, "w") as f:
        json.dump({"shape": a.shape, "device": a.device, "tokens": a.tokens, "runs": results}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 5 and not sys.argv[1].startswith("-"):
        worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
