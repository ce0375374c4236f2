"""The life of a training run, apart from the algorithm: its folder, config, metrics log,
checkpoints and --resume (weights, optimizer, scheduler, RNG of every rank), data-parallel ranks
(torchrun) and the stop signal. train.py calls these; nothing here knows GTPO from GRPO.
"""
import glob
import json
import os
import random
import shutil
import sys
import tempfile

import torch

from machinery.data import read_jsonl, write_text


class ConfigError(ValueError):
    """A flag or run folder that cannot work; the message says how to fix it."""


class SaveError(OSError):
    """A checkpoint or final save that failed (full disk, ...); what was saved before is intact."""


# -----------------------------------------------------------------------------
# the run folder

NOT_RECORDED = "(not recorded)"      # a setting the run's config.json predates, with no declared value


def prepare_output_dir(out, config, resume, overwrite, identity=(), allowed=(), unrecorded=None):
    """Refuse to mix two runs in one folder; writes nothing (--overwrite's old run is set aside later, by
    set_aside, once the new run has loaded). On --resume, the settings in `identity` must equal the
    run's (config.json) but for those in `allowed`; `unrecorded` gives the value a setting had in a
    run whose config.json predates it, and a setting neither recorded nor declared there is refused as
    one that differs. Returns {key: (the run's value, this one)} of the allowed changes, for config.json."""
    cfg_path = os.path.join(out, "config.json")
    if resume and not os.path.exists(cfg_path):
        raise ConfigError(f"--resume: no run in {out} (no config.json); start without --resume")
    if resume:
        try:
            old = {**(unrecorded or {}), **read_json(cfg_path)}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{cfg_path} is unreadable ({e}); it was not written by this version's atomic "
                              f"writer. Restore it, or start afresh with --overwrite or another --output_dir") from None
        diff = {k: (old.get(k, NOT_RECORDED), config[k]) for k in identity if old.get(k, NOT_RECORDED) != config[k]}
        refused = {k: v for k, v in diff.items() if k not in allowed}
        if refused:
            raise ConfigError(f"--resume: {out} holds a run with other settings ("
                              + ", ".join(f"{k}: {'not recorded' if a is NOT_RECORDED else repr(a)} there vs "
                                          f"{b!r} now" for k, (a, b) in refused.items())
                              + "), which would continue it as another experiment under the same name; use "
                              f"the same flags, another --output_dir, or --allow_changes {','.join(refused)}")
        return diff
    if os.path.exists(cfg_path) and not overwrite:
        raise ConfigError(f"{out} already holds a run: pass --resume to continue it, "
                          f"--overwrite to replace it, or another --output_dir")
    check_writable(out)
    return {}


def write_config(out, settings, resume=False, changes=None, step=0):
    """config.json in `out`: the run's `settings` and each resume that changed an identity setting
    (--allow_changes, prepare_output_dir's `changes`): at which step, from what to what."""
    path = os.path.join(out, "config.json")
    os.makedirs(out, exist_ok=True)                     # the run folder appears once the run has started
    history = read_json(path).get("changes_on_resume", []) if resume and os.path.exists(path) else []
    if changes:
        history = history + [{"at_step": step, **{k: {"was": a, "now": b} for k, (a, b) in changes.items()}}]
    write_json(path, {**settings, "changes_on_resume": history})


def is_training_run(folder):
    """A training run's folder: its config.json (a run's settings), a checkpoint-N/ or final/."""
    if os.path.isdir(os.path.join(folder, "final")) or saved_checkpoints(folder):
        return True
    try:
        return "method" in read_json(os.path.join(folder, "config.json"))
    except (OSError, ValueError):
        return False


def check_writable(out):
    """Refuse a run folder that cannot be written (under a file, a read-only place), before anything loads."""
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"--output_dir {out!r}: {parent} is a file, not a folder; choose another --output_dir")
    try:
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix=".write-probe-")
    except OSError as e:
        raise ConfigError(f"--output_dir {out!r}: cannot write in {parent} ({e.strerror}); choose another "
                          f"--output_dir") from None
    probe.close()


def set_aside(out):
    """--overwrite, once the new run has loaded everything it needs: the old run, whole, moves to
    <out>.replaced (or .replaced-2, ...: a name in use is never reused) and the new run starts in an empty
    folder. Returns that path, or None if out holds no run. release_aside deletes it once the new run has
    saved its first checkpoint: a failure or Ctrl-C before that leaves both runs whole, never one folder
    holding parts of two."""
    if not os.path.exists(os.path.join(out, "config.json")):
        return None
    aside, k = f"{os.path.normpath(out)}.replaced", 2
    while os.path.exists(aside):
        aside, k = f"{os.path.normpath(out)}.replaced-{k}", k + 1
    os.rename(out, aside)
    return aside


def release_aside(aside, log=print):
    """The old run set aside by --overwrite, deleted now that the new run has a checkpoint; -> None."""
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
        log(f"--overwrite: removed the replaced run ({aside})")
    return None


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2))


class MetricsLog:
    """metrics.jsonl (one row per step, flushed) and samples.jsonl, and the same rows to each logger --report_to
    names (open_logger); only rank 0 writes. first_step: the step a resumed run continues after (TensorBoard
    drops what it logged later)."""

    def __init__(self, out, enabled, report_to="none", config=None, first_step=0):
        self.out = out
        self.f = open(os.path.join(out, "metrics.jsonl"), "a") if enabled else None
        names = [n for n in report_to.split(",") if n not in ("", "none")]
        self.loggers = [open_logger(n, out, config, first_step) for n in names] if enabled else []

    def write(self, row, step=None):
        if self.f:
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()
        for log, _ in self.loggers:
            log(row, step)

    def samples(self, rows):
        if self.f:
            with open(os.path.join(self.out, "samples.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)

    def close(self):
        if self.f:
            self.f.close()
            self.f = None
        for _, close in self.loggers:
            close()
        self.loggers = []


LOGGERS = ("wandb", "tensorboard", "trackio")         # --report_to's names, TRL's; each an optional package


def open_logger(name, out, config, first_step=0):
    """(log(row, step), close()) of one --report_to logger: Weights & Biases (project gtpo), TensorBoard (event
    files in <out>/runs) or Trackio (project gtpo, the run named after its folder; a local store unless set up
    otherwise). TensorBoard and Trackio take the rows' numbers; wandb the whole row."""
    def numbers(row):
        return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if name == "wandb":
        import wandb
        wandb.init(project="gtpo", config=config, resume="allow")
        return (lambda row, step: wandb.log(row, step=step)), wandb.finish
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(out, "runs"), purge_step=first_step + 1 if first_step else None)

        def log(row, step):
            for k, v in numbers(row).items():
                writer.add_scalar(k, v, step)
            writer.flush()
        return log, writer.close
    import trackio
    trackio.init(project="gtpo", name=os.path.basename(os.path.abspath(out)), config=config, resume="allow")
    return (lambda row, step: trackio.log(numbers(row), step=step)), trackio.finish


def truncate_log(path, step, log=print):
    """Drop rows of an append-only log written after the checkpoint we resume from, so no step
    appears twice. A torn last line (a kill mid-write) is dropped with a notice; a malformed line
    before it is corruption and stops with file:line (DataError)."""
    if os.path.exists(path):
        rows = [obj for _, obj in read_jsonl(path, log_torn=log) if obj.get("step", 0) <= step]
        write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


# -----------------------------------------------------------------------------
# checkpoints

def saved_checkpoints(out, config=None):
    """{step: folder} of out's checkpoint-N folders, by step; config (the run's config.json): only the
    scheduled ones, steps that are multiples of save_steps or max_steps, without those a stop signal
    saved mid-way, so that runs compare at the same steps."""
    ckpts = {int(d.rsplit("-", 1)[-1]): d for d in glob.glob(os.path.join(out, "checkpoint-*"))
             if d.rsplit("-", 1)[-1].isdigit()}
    planned = (lambda n: n % config["save_steps"] == 0 or n == config["max_steps"]) if config else (lambda n: True)
    return {n: ckpts[n] for n in sorted(ckpts) if planned(n)}


def last_checkpoint(out):
    return max(saved_checkpoints(out).items(), default=(None, None))[1]


def save_folder(path, write):
    """write(tmp) fills a temporary folder, which is then renamed to `path`: a kill mid-save leaves
    the old folder (or none), never a partial one. An OSError (full disk, ...) removes the partial
    folder and raises SaveError; nothing saved before is touched."""
    tmp = path + ".tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        ckpt = last_checkpoint(os.path.dirname(path))
        raise SaveError(f"could not save {path} ({e.strerror or e}); "
                        + (f"{ckpt} is intact: free space, then rerun with --resume" if ckpt else
                           "no checkpoint was written yet")) from None
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def save_weights(model, folder):
    """The adapter (PEFT format, from the trainable tensors alone) or the full model. A LoRA model's
    full state_dict() is never taken: bitsandbytes' CPU backend converts repacked 4-bit layers back
    in place when it is, which would change the base a run continues with."""
    if hasattr(model, "peft_config"):
        model.save_pretrained(folder, state_dict={n: p.detach() for n, p in model.named_parameters()
                                                  if p.requires_grad}, selected_adapters=["default"])
    else:
        model.save_pretrained(folder)


def save_checkpoint(path, model, tokenizer, optimizer, scheduler, state):
    """Adapter (PEFT format) or full model + optimizer, scheduler and `state` (step, RNG of every
    rank, config, <H>_ini) in trainer_state.pt, saved through save_folder."""
    def write(tmp):
        save_weights(model, tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), **state},
                   os.path.join(tmp, "trainer_state.pt"))
    save_folder(path, write)


def load_weights(model, path):
    from safetensors.torch import load_file
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict
        loaded = set_peft_model_state_dict(model, load_file(os.path.join(path, "adapter_model.safetensors")))
        if loaded.unexpected_keys:                      # strict=False would load nothing, silently
            raise RuntimeError(f"adapter weights for another model: {loaded.unexpected_keys[:2]}")
    else:                                               # one file, or shards listed in an index
        index = os.path.join(path, "model.safetensors.index.json")
        files = sorted(set(read_json(index)["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
        for f in files:
            model.load_state_dict(load_file(os.path.join(path, f)), strict=False)


def load_start_weights(model, path):
    """--init_from: another run's final/ or checkpoint-N/ weights as the starting point (SFT, then RL).
    Refused with a fix when the folder holds no weights of this kind or they do not fit the model."""
    lora = hasattr(model, "peft_config")
    want = "adapter_model.safetensors" if lora else "config.json"
    if not os.path.isfile(os.path.join(path, want)):
        raise ConfigError(f"--init_from {path!r} holds no {want}: give a run's final/ or checkpoint-N/ folder "
                          f"trained with {'LoRA' if lora else 'full fine-tuning'} (the same --lora_rank)")
    try:
        load_weights(model, path)
    except RuntimeError as e:                           # shapes differ: another model or LoRA rank
        raise ConfigError(f"--init_from {path!r} does not fit this model ({str(e).splitlines()[0][:160]} ...); "
                          f"use a run of the same --model and --lora_rank") from None


def rng_state(device):
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            **({"cuda": torch.cuda.get_rng_state(device)} if device.startswith("cuda") else {})}


def repage(optimizer):
    """A paged bitsandbytes optimizer's state back in paged (CUDA managed) memory after
    load_state_dict, which puts it in ordinary device memory beside the parameter."""
    if not getattr(optimizer, "is_paged", False):
        return
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.is_cuda and v.shape == p.shape:     # state1/state2, not absmax
                buf = optimizer.get_state_buffer(p, dtype=v.dtype)
                buf.copy_(v)
                st[k] = buf


def resume(out, model, optimizer, scheduler, dist, log=print):
    """Restore the last checkpoint of `out`: weights, optimizer, scheduler, this rank's RNG.
    Returns its state dict (step, h_ini, config, ...). A run killed before its first checkpoint
    starts again from step 0 (its logs emptied)."""
    ckpt = last_checkpoint(out)
    state = {"step": 0, "checkpoint": None}
    if ckpt is None:
        log(f"--resume: {out} has no checkpoint yet; starting from step 0")
    else:
        state = restore(ckpt, model, optimizer, scheduler, dist)
        log(f"resumed from {ckpt} at step {state['step']}")
    if dist.main:
        for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):
            truncate_log(os.path.join(out, name), state["step"], log)
    return state


def restore(ckpt, model, optimizer, scheduler, dist):
    """Weights, optimizer, scheduler and this rank's RNG from checkpoint folder `ckpt`."""
    load_weights(model, ckpt)
    # to CPU first: RNG states must be CPU tensors, and the optimizer moves its state to each
    # parameter's own device (without a map, every rank's tensors land where rank 0 saved them)
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location="cpu", weights_only=False)
    if state.get("world_size", 1) != dist.world:
        raise ConfigError(f"--resume: {ckpt} was written by {state.get('world_size', 1)} processes, this run "
                          f"has {dist.world}; resume with the same --nproc_per_node")
    optimizer.load_state_dict(state["optimizer"])
    repage(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"][dist.rank] if isinstance(state["rng"], list) else state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and dist.device.startswith("cuda"):
        torch.cuda.set_rng_state(rng["cuda"], dist.device)
    return {**state, "checkpoint": ckpt}


# -----------------------------------------------------------------------------
# ranks and signals

class Dist:
    """torch.distributed for `torchrun --nproc_per_node K train.py ...` (NCCL on GPUs, gloo on CPU);
    a no-op with one process. Each rank rolls out its own prompts; DDP averages the gradients."""

    def __init__(self, device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = device
        if self.world > 1:
            import torch.distributed as dist
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if device.startswith("cuda"):
                self.device = f"cuda:{local}"
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
            self.dist = dist

    @property
    def main(self):
        return self.rank == 0

    def wrap(self, model):
        return model if self.world == 1 else ddp(model, self.device)

    def mean(self, values):
        """Average a dict of floats over ranks; every rank must give the same keys (checked: a
        mismatch would otherwise pair one rank's value with another's, or hang the collective)."""
        if self.world == 1:
            return values
        keys = sorted(values)
        every = self.gather(keys)
        if any(k != keys for k in every):
            raise RuntimeError(f"ranks report different metrics: {[sorted(set(k) ^ set(keys)) for k in every]}")
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return dict(zip(keys, (t / self.world).tolist()))

    def gather(self, obj):
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def barrier(self):
        if self.world > 1:
            self.dist.barrier()

    def close(self):
        if self.world > 1 and self.dist.is_initialized():
            self.dist.destroy_process_group()


def ddp(model, device):
    """DistributedDataParallel whose gradients are views into its all-reduce buckets: without
    gradient_as_bucket_view every gradient exists twice (the .grad tensors and the buckets)."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, device_ids=[device] if str(device).startswith("cuda") else None,
                                   gradient_as_bucket_view=True)


def weights_fingerprint(params):
    """Two exact integer checksums of the raw bits of the trainable weights (ranks must agree)."""
    total, mixed = 0, 0
    for j, p in enumerate(params):
        bits = p.detach().contiguous().view(torch.int16 if p.element_size() == 2 else torch.int32).flatten().long()
        total += bits.sum().item()
        mixed += (bits * (torch.arange(bits.numel(), device=bits.device) % 8191 + j)).sum().item()
    return total, mixed


class StopFlag:
    """SIGTERM / first Ctrl-C: finish the current step, save a checkpoint, exit 0."""

    def __init__(self):
        import signal
        import threading
        self.signal, self.old = None, {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, self._handler)

    def restore(self):
        import signal
        for sig, handler in self.old.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        import signal
        if self.signal is not None:                 # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        print(f"\n{self.signal}: finishing this step, then saving a checkpoint (send it again to stop now)",
              file=sys.stderr)
