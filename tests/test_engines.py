"""GTPOTrainer under the engines TRL users launch it with -- DeepSpeed ZeRO-2 and ZeRO-3, FSDP1 and FSDP2, each
from its accelerate config in configs/ -- on 2 CPU processes (gloo), against the same run under DDP: each step's
loss and LoRA gradients (gathered the engine's way before the optimizer steps), the second step with one process's
completions all one token long (slow tier; the DeepSpeed cases skip without deepspeed, an optional extra: pip
install -r requirements-engines.txt).

accelerate enables DeepSpeed and FSDP on accelerator devices only: launched on a CPU with these configs it would
run plain DDP and test nothing. So the worker forces the engine (bench.engines.force_engine): it gives accelerate
a GPU-like distributed type with the CPU as its device (ACCELERATE_TORCH_DEVICE=cpu) and gloo as the backend
(DeepSpeed with DS_ACCELERATOR=cpu), and records which engine accelerate then chose; the test asserts it."""
import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = {"zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp1": "FSDP", "fsdp2": "FSDP"}
WRAPPERS = ("module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")   # the engines' name prefixes


def full_grads(model, engine):
    """{LoRA parameter name: its whole gradient} on every process, gathered the engine's way."""
    lora = lambda named: [(n, p) for n, p in named if "lora_" in n]   # noqa: E731
    if engine.startswith("zero"):
        from deepspeed.utils import safe_get_full_grad
        grads = {n: safe_get_full_grad(p) for n, p in lora(model.named_parameters())}
    elif engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        with FSDP.summon_full_params(model, with_grads=True):
            grads = {n: p.grad.clone() for n, p in lora(model.named_parameters())}
    elif engine == "fsdp2":
        grads = {n: p.grad.full_tensor() for n, p in lora(model.named_parameters())}
    else:
        grads = {n: p.grad.clone() for n, p in lora(model.named_parameters())}
    for prefix in WRAPPERS:
        grads = {n.replace(prefix, ""): g for n, g in grads.items()}
    return grads


def worker(engine, model_dir, out):
    """Two GTPO steps of 2 prompts x G = 8 on the tiny model with LoRA, a group split 4 + 4 over the processes;
    before step 2 process 1 samples one token per completion. Process 0 saves each step's LoRA gradients
    (grads-<step>.pt), the losses and the engine accelerate ran."""
    sys.path.insert(0, HERE)
    if engine != "ddp":
        from bench.engines import force_engine
        force_engine()
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from gtpo_trl import GTPOConfig, GTPOTrainer
    from machinery.models import load_tokenizer

    def record():
        """This step's whole LoRA gradients, before the optimizer moves the weights, to grads-<step>.pt."""
        grads = full_grads(trainer.model_wrapped if engine == "fsdp1" else trainer.model, engine)
        if trainer.accelerator.is_main_process:
            torch.save(grads, os.path.join(out, f"grads-{trainer.state.global_step + 1}.pt"))

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1 and trainer.accelerator.process_index == 1:
                trainer.generation_config.max_new_tokens = 1

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if not engine.startswith("zero"):
                record()

    if engine.startswith("zero"):                       # accelerate's backward runs DeepSpeed's step itself
        from deepspeed.runtime.engine import DeepSpeedEngine
        step = DeepSpeedEngine.step
        DeepSpeedEngine.step = lambda self, *a, **k: (record(), step(self, *a, **k))[1]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GTPOConfig(output_dir=out, num_generations=8, per_device_train_batch_size=4, max_completion_length=6,
                      max_steps=2, learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=0.0, bf16=False,
                      use_cpu=engine == "ddp", report_to="none", save_strategy="no", top_k=2, seed=0, disable_tqdm=True,
                      logging_steps=1, entropy_filter="off")
    reward = lambda completions, **_: [float(ord(c[-1]) % 2) if c else 0.0 for c in completions]   # noqa: E731
    trainer = GTPOTrainer(model=model, processing_class=load_tokenizer(model_dir), reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "one two three"}, {"prompt": "four five"}] * 4),
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                          callbacks=[Watch()])
    trainer.train()
    if trainer.accelerator.is_main_process:
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump({"engine": str(trainer.accelerator.distributed_type).split(".")[-1],
                       "loss": [r["loss"] for r in trainer.state.log_history if "loss" in r]}, f)
    trainer.accelerator.end_training()                  # tear the group down: gloo's threads can abort at exit


def launch(engine, model_dir, out):
    """The worker on 2 processes: `accelerate launch --config_file configs/<engine>.yaml`, or torchrun for DDP."""
    from conftest import ENV, free_port
    port = str(free_port())
    if engine == "ddp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(HERE, "configs", f"{engine}.yaml"), "--num_processes", "2", "--mixed_precision", "no",
               "--main_process_port", port]
    r = subprocess.run(cmd + [__file__, engine, model_dir, out], cwd=HERE, capture_output=True, text=True,
                       env={**ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE}, timeout=900)
    if r.returncode:                                    # the whole tail: a child's own error precedes the summary
        pytest.fail(f"{engine}: exit {r.returncode}\n{r.stderr[-6000:]}", pytrace=False)
    with open(os.path.join(out, "run.json")) as f:
        return json.load(f)


def gradients(out):
    """The LoRA gradients of step 1 and step 2 ({name: tensor} each), as the worker saved them."""
    return [torch.load(os.path.join(out, f"grads-{n}.pt"), map_location="cpu") for n in (1, 2)]


@pytest.fixture(scope="module")
def ddp(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("trl", reason="needs TRL, an optional extra: pip install -r requirements-trl.txt")
    out = str(tmp_path_factory.mktemp("ddp"))
    return launch("ddp", tiny_model_dir, out), gradients(out)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_gives_ddps_losses_and_gradients(engine, ddp, tiny_model_dir, tmp_path):
    """Each step's loss within 1e-6 and each LoRA gradient within 1e-5 of DDP's, step 2 with process 1's
    completions one token long (every process makes the same model calls whatever its lengths: ZeRO-3 and FSDP
    gather parameters collectively in each)."""
    if ENGINES[engine] == "DEEPSPEED":
        pytest.importorskip("deepspeed", reason="needs DeepSpeed, an optional extra: pip install -r "
                                                "requirements-engines.txt")
    (ref, want), out = ddp, str(tmp_path)
    run = launch(engine, tiny_model_dir, out)
    assert run["engine"] == ENGINES[engine]                              # forced: not DDP in disguise
    assert len(run["loss"]) == 2 and run["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    for step, (got, ddp_grads) in enumerate(zip(gradients(out), want), 1):
        assert got.keys() == ddp_grads.keys() and len(got) == 8          # q, v: A and B in both layers
        assert any(g.abs().sum() > 0 for g in ddp_grads.values())
        for name, g in ddp_grads.items():
            torch.testing.assert_close(got[name], g, atol=1e-5, rtol=0, msg=f"{engine} step {step} {name}")


@pytest.mark.slow
def test_train_py_on_two_torchrun_nodes_ends_bit_identical(tmp_path, tiny_args):
    """train.py across two torchrun nodes, as on two machines (--nnodes 2 --nproc_per_node 1, a c10d rendezvous,
    here on localhost): one GTPO step, both ranks' weights bit-identical (train.save_final checks and says so).
    c10d numbers the ranks itself, so whichever node arrives first holds rank 0 and writes the run."""
    from conftest import ENV, free_port
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend",
           "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id", "gtpo-two-nodes",
           os.path.join(HERE, "train.py"),
           *tiny_args(tmp_path / "run", max_steps=1, generation_size=2, max_completion_length=4,
                      optimizer="adamw_torch")]
    nodes = [subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**ENV, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    outs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    said = [out for out, _ in outs if "trainable weights bit-identical on all 2 ranks" in out]
    assert len(said) == 1 and (tmp_path / "run" / "final").is_dir()   # rank 0 alone writes and says so


@pytest.mark.slow
def test_the_engine_benchmark_dry_run(tmp_path):
    """`python -m bench.engines --device cpu`: GTPOTrainer under no engine and under ZeRO-3 (forced), one process
    each, 2 steps: both run, ZeRO-3 is the engine accelerate took, and the first step's loss is the same."""
    pytest.importorskip("deepspeed", reason="needs DeepSpeed, an optional extra: pip install -r "
                                            "requirements-engines.txt")
    from conftest import ENV
    out = tmp_path / "bench-engines.json"
    r = subprocess.run([sys.executable, "-m", "bench.engines", "--device", "cpu", "--shape", "tiny", "--tokens", "4",
                        "--out", str(out)], cwd=HERE, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [runs[e]["returncode"] for e in ("ddp", "zero3")] == [0, 0] and runs["zero3"]["engine"] == "DEEPSPEED"
    assert len(runs["ddp"]["step_s"]) == 2
    assert runs["zero3"]["loss"][0] == pytest.approx(runs["ddp"]["loss"][0], abs=1e-6)


if __name__ == "__main__":
    worker(*sys.argv[1:4])
