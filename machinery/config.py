"""Every setting of a run in one place: the Config dataclass, its command line and its checks.

Each default is written once, beside its meaning: the paper's values (Listing 1, App. 16.2) in
the fields, the objective's in gtpo.Objective (Config.objective; its flags are made from it), the
embedded demo model's own values in PROFILES. `python train.py --help` lists the flags by group,
the paper's recipe and the objective first; a misspelt flag or field fails.
"""
import argparse
import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

import gtpo
from gtpo import AT_LEAST_0, FINITE_AT_LEAST_0
from machinery.data import HUB, TASKS, check_data_dir, is_local, load_task, task_name
from machinery.flags import AT_LEAST_1, BETA, FRACTION, POSITIVE, STEPS, Parser, checked
from machinery.models import ALIASES
from machinery.runs import LOGGERS, ConfigError, read_json
from rollout import PATHS

GROUPS = {"recipe": "the paper's recipe (Listing 1)", "objective": "the objective (Eq. 1, 5-8)",
          "run": "the run: data, output, resume, logging",
          "eval": "held-out evaluation during the run (eval.py's sampling and scoring)",
          "memory": "memory and speed (the same update, computed differently)",
          "cpu": "CPU sampling path (--rollout shared; speedups/cpu_rollout.py)"}
BETAS = {"gtpo": (0.999999, 0.999999), "grpo": (0.9, 0.95), "sft": (0.9, 0.95)}   # Adam (Listing 1)
# SmolLM2-135M is not in the paper. It never writes the tag format on its own, so the demo shows it
# one worked example in the prompt (one_shot) and warms up with SFT. Its RL phase is 20 steps with Adam's usual
# betas and a cosine that quiets the late steps, where a constant rate drifts (docs/training.md). The objective is
# the default one: no test declared before its runs found another form better for the demo. Every step's group is
# logged: most have no reward spread, and `eval.py --render` draws one that has.
PROFILES = {"smollm2-135m": dict(lr=3e-4, lr_scheduler="cosine", generation_size=8, max_prompt_length=512,
                                 max_completion_length=96, warmup_ratio=0.0, save_steps=20, ent_ini_prompts=4,
                                 one_shot=True, sft_warmup_steps=8, sft_warmup_lr=1e-3, max_steps=28,
                                 micro_batch_size=4, sft_micro_batch_size=4, adam_beta1=0.9, adam_beta2=0.95,
                                 sample_every=1, eval_steps=0)}

OBJECTIVE = [f.name for f in dataclasses.fields(gtpo.Objective)]      # its settings, flags of their own



def flag(default, help, group="recipe", check=None, unrecorded=dataclasses.MISSING, **kw):
    """A Config field with its command-line help and, with check, the range its value must lie in; group None
    keeps it off the command line. unrecorded: what a run whose config.json predates the flag ran."""
    meta = {"help": help, "group": group, "check": check, **kw}
    if unrecorded is not dataclasses.MISSING:
        meta["unrecorded"] = unrecorded
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class Config:
    # ---- the paper's recipe (Listing 1)
    method: str = flag("gtpo", "set by --use_gtpo (default), --use_grpo or --use_sft", group=None)
    model: str = flag("smollm2-135m", "alias (llama-8b, qwen2.5-3b, smollm2-135m), local folder or Hub id")
    dataset: str = flag("arithmetic", f"{', '.join(TASKS)} (built-in), or a .jsonl path (README: its fields)")
    task: str = flag("auto", "how answers are compared: auto = the dataset's own (a .jsonl file: numbers where the "
                     "reference is one, LaTeX with math-verify otherwise), numeric, or latex",
                     choices=["auto", "numeric", "latex"])
    batch_size: int = flag(1, "PROMPTS per optimizer step; each gets --generation_size completions", check=AT_LEAST_1)
    generation_size: int = flag(12, "G, completions per prompt", check=AT_LEAST_1)
    epochs: int = flag(1, "passes over the training prompts", check=AT_LEAST_1)
    max_steps: int = flag(-1, "optimizer steps, -1 = --epochs decide", check=STEPS)
    max_prompt_length: int = flag(4000, "longer prompts are dropped (and counted)", check=AT_LEAST_1)
    max_completion_length: int = flag(1500, "max new tokens per completion", check=AT_LEAST_1)
    temperature: float = flag(1.0, "sampling temperature; log-probs and entropies are of softmax(logits / T), "
                              "the distribution sampled", check=POSITIVE)
    one_shot: bool = flag(False, "show one worked example (tag format) before the question")
    one_shot_from: str = flag(None, "the dataset whose first train record is that example (not trained on when it "
                              "is the training set) [default: the training dataset if built-in; a .jsonl dataset "
                              "must name one]", type=str, metavar="DATASET")
    optimizer: str = flag("adamw_8bit", "adamw_8bit = bitsandbytes 8-bit AdamW, paged on CUDA (Listing 1's "
                          "paged_adamw_8bit); adam = the same, as the authors' README spells it; adamw_torch = "
                          "torch.optim.AdamW", choices=["adamw_8bit", "adam", "adamw_torch"])
    lr: float = flag(1e-6, "learning rate", check=POSITIVE)
    adam_beta1: float = flag(None, "Adam beta1 [default: GTPO 0.999999, GRPO/SFT 0.9; demo 0.9]", type=float,
                             check=BETA)
    adam_beta2: float = flag(None, "Adam beta2 [default: GTPO 0.999999, GRPO/SFT 0.95; demo 0.95]", type=float,
                             check=BETA)
    weight_decay: float = flag(0.1, "AdamW weight decay", check=FINITE_AT_LEAST_0)
    warmup_ratio: float = flag(0.005, "linear warm-up fraction of the schedule", check=FRACTION)
    lr_scheduler: str = flag("cosine", "after the warm-up: cosine decay to 0 (Listing 1) or constant",
                             choices=["cosine", "constant"])
    max_grad_norm: float = flag(0.1, "gradient clipping norm", check=POSITIVE)
    lora_rank: int = flag(None, "LoRA rank on q,k,v,o,gate,up,down; 0 = full fine-tuning "
                          "[default: Llama 128, Qwen and others 64, demo 32]", type=int, check=AT_LEAST_0)
    load_in_4bit: bool = flag(None, "4-bit NF4 base weights [default: on with CUDA; off on CPU, where it "
                              "works but is slow]", type=bool)
    dtype: str = flag("auto", "weights and 4-bit compute dtype (auto = bf16 on a CUDA GPU that has it, else fp32)",
                      choices=["auto", "float32", "bfloat16"])
    seed: int = flag(3407, "random seed")
    sft_warmup_steps: int = flag(0, "SFT steps (batch_size x G worked solutions each) before RL; its last "
                                 "is saved as checkpoint-N, RL's start", check=AT_LEAST_0)
    sft_warmup_lr: float = flag(None, "the SFT warm-up's learning rate, constant; it runs with SFT's Adam betas, and "
                                "RL then starts a fresh optimizer and its own schedule [default: --lr]", type=float,
                                check=POSITIVE, unrecorded=None)
    ent_ini_prompts: int = flag(100, "training prompts used to measure <H>_ini (Sec. 6), which Eq. 6's auto filter "
                                "reads", check=AT_LEAST_1)
    # ---- the objective: every setting is a field of gtpo.Objective, declared there (its flag, help and checks too)
    objective: gtpo.Objective = flag(gtpo.DEFAULT, "the objective's settings (gtpo.Objective)", group=None)
    released_code: bool = flag(False, "every released-code behaviour at once: " + ", ".join(
        f"--{k} {v}" if not isinstance(v, bool) else f"--{'' if v else 'no-'}{k}" for k, v in gtpo.RELEASED.items())
        + " (flags given beside it win)", group="objective", unrecorded=False)
    # ---- the run
    data_dir: str = flag(None, "folder with <dataset>/<split>.jsonl [default: $GTPO_DATA_DIR, then the Hub]",
                         group="run", type=str)
    output_dir: str = flag(None, "metrics, samples and checkpoints [default: runs/<method>-<model>-<dataset>]",
                           group="run", type=str)
    overwrite: bool = flag(False, "reuse an output_dir that holds another run: once this run has loaded, the old "
                           "one moves whole to <output_dir>.replaced, deleted at this run's first checkpoint",
                           group="run")
    resume: bool = flag(False, "continue from the last checkpoint in output_dir, with every setting its config.json "
                        "records (a flag given beside it is a change: see --allow_changes)", group="run")
    allow_changes: str = flag("", "with --resume: recipe or objective settings that may differ from the run's "
                              "(comma-separated, e.g. lr,max_steps); recorded in config.json", group="run",
                              metavar="NAME,...")
    init_from: str = flag(None, "start from another run's final/ or checkpoint-N/ weights (e.g. SFT, then RL); "
                          "same --lora_rank", group="run", type=str, metavar="DIR")
    device: str = flag(None, "cuda, cuda:1 or cpu [default: cuda if available]", group="run", type=str)
    save_steps: int = flag(500, "checkpoint every N steps", group="run", check=AT_LEAST_1)
    sample_every: int = flag(10, "write the first group's completions to samples.jsonl every N steps", group="run",
                             check=AT_LEAST_0)
    report_to: str = flag("none", "also log every row to these, comma-separated: wandb, tensorboard (events in "
                          "<output_dir>/runs), trackio (each an optional package, TRL's names) or none", group="run",
                          metavar="NAME,...")
    # ---- held-out evaluation during the run (machinery/heldout.py: eval.py's own sampling and scoring)
    eval_steps: int = flag(None, "evaluate the policy on held-out problems at RL's start, every N steps and at the last "
                           "step; 0 = never [default: --save_steps where the dataset has --eval_split; never for a "
                           ".jsonl file without --eval_dataset]", group="eval", type=int, check=AT_LEAST_0)
    eval_limit: int = flag(64, "held-out problems per evaluation: the first N of the split", group="eval",
                           check=AT_LEAST_1)
    eval_n_samples: int = flag(4, "completions per held-out problem (pass@k for k = 1, 2, 4, ... up to it)",
                               group="eval", check=AT_LEAST_1)
    eval_split: str = flag("test", "the held-out split of --eval_dataset (arithmetic: test, hard, reworded)",
                           group="eval")
    eval_dataset: str = flag(None, "the held-out problems' dataset [default: the training dataset; a .jsonl training "
                             "file needs one of its own]", group="eval", type=str, metavar="DATASET")
    save_best: bool = flag(False, "keep the adapter of the step with the highest held-out pass@1 in <output_dir>/best",
                           group="eval")
    print_config: bool = flag(False, "print every setting, its value and where it came from (flag, --released_code, "
                              "profile, default, setup), then exit without loading anything", group="run")
    # ---- memory and speed
    rollout: str = flag("auto", "sampler: generate (model.generate through the policy), merged (generate through a "
                        "bf16 copy with LoRA merged, static KV cache, compiled on CUDA), shared (CPU: prompt "
                        "pre-filled once per group, own decode loop) [default auto: shared on CPU; on CUDA merged "
                        "when the memory plan finds the step fits with it, else generate]", group="memory",
                        choices=list(PATHS))
    micro_batch_size: int = flag(None, "completions per forward/backward, 0 = all [default: on CUDA the largest whose "
                                 "estimated peak (speedups/memory.py) fits --memory_budget_gb; on CPU all]", group="memory",
                                 type=int, check=AT_LEAST_0)
    memory_budget_gb: float = flag(None, "GPU memory the run may use, CUDA context included [default: the "
                                   "device's total]", group="memory", type=float, check=POSITIVE)
    sft_micro_batch_size: int = flag(0, "worked solutions per forward/backward in SFT steps, 0 = as "
                                     "--micro_batch_size", group="memory", check=AT_LEAST_0)
    logprob_chunk: int = flag(256, "completion tokens per LM-head chunk for log-probs/entropy (0 = full (N, L, V) "
                              "logits)", group="memory", check=AT_LEAST_0)
    tf32: bool = flag(True, "CUDA: the LM head's fp32 GEMMs in TF32 (10-bit mantissa inputs, fp32 accumulate; "
                      "the log-softmax stays fp32); --no-tf32 = full fp32", group="memory")
    share_prompt: bool = flag(True, "gradient pass: each prompt computed once per group, and in SFT steps the "
                              "prompts' common opening (system prompt, one-shot example) once per pass "
                              "(off with checkpointing)", group="memory")
    gradient_checkpointing: bool = flag(None, "keep only each layer's input, recompute the rest in backward "
                                        "[default: on CUDA decided by the memory estimate -- off when a whole group "
                                        "fits one micro-batch without it; off on CPU]", group="memory", type=bool)
    merge_lora: bool = flag(True, "sample with LoRA merged into copies of the base weights", group="cpu")
    heap_mmap_mb: float = flag(0.0, "glibc: freed blocks above this size (MB) go back to the OS at once (lower "
                               "peak RSS, slower steps); 0 = glibc's default", group="cpu", check=FINITE_AT_LEAST_0)
    # ---- set by the program, not by a flag
    min_new_tokens: int = flag(0, "EOS barred before this many tokens (the benchmarks force lengths)", group=None)
    h_ini: float = flag(None, "<H>_ini measured at setup (Sec. 6), which Eq. 6's auto filter reads", group=None)
    sources: dict = flag(None, "where each setting came from: flag, --released_code, profile, default, setup, plan, "
                         "resume (parse_args; config.json records it)", group=None)

    @property
    def reward_task(self):
        """The task rewards.reward compares answers by: --task, or with "auto" the dataset's name."""
        return task_name(self.dataset) if self.task == "auto" else self.task

    @property
    def warmup_steps(self):
        """The SFT warm-up's steps as run: --sft_warmup_steps before GTPO or GRPO; none in an SFT run (all SFT)."""
        return self.sft_warmup_steps if self.method != "sft" else 0

    @property
    def filter_mode(self):
        """delta_i's mode as run (Eq. 6; gtpo.Objective.filter_mode): "auto" reads <H>_ini (Config.h_ini)."""
        return self.objective.filter_mode(self.method, self.h_ini)


def record(cfg):
    """The run's settings as one flat dict (config.json, --resume, wandb): Config's fields, the objective's
    among them."""
    flat = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "objective"}
    return {**flat, **dataclasses.asdict(cfg.objective)}


def unrecorded():
    """What a run whose config.json lacks a setting ran, for each setting that declares it (the objective's
    all do): runs.prepare_output_dir reads a missing identity setting as this, or refuses it."""
    declared = {f.name: f.metadata["unrecorded"] for f in dataclasses.fields(Config) if "unrecorded" in f.metadata}
    return {**declared, **gtpo.UNRECORDED}


def settings():
    """Every command-line setting as (name, default, its flag's metadata), in --help's order: Config's fields,
    and gtpo.Objective's where Config.objective stands."""
    for f in dataclasses.fields(Config):
        if f.name == "objective":
            for s in dataclasses.fields(gtpo.Objective):
                meta = {"help": s.metadata["help"], "group": "objective", "check": s.metadata["check"]}
                yield s.name, s.default, {**meta, **({"choices": list(s.metadata["choices"])}
                                                     if s.metadata["choices"] else {})}
        elif f.metadata.get("group"):
            yield f.name, f.default, {k: v for k, v in f.metadata.items() if k != "unrecorded"}


def identity_keys():
    """The settings that make a run's experiment: the method, every recipe and objective setting, and
    the starting weights. --resume refuses a run whose values differ (runs.prepare_output_dir) unless
    --allow_changes names them."""
    return ["method", "init_from"] + [n for n, _, meta in settings() if meta["group"] in ("recipe", "objective")]


def default_help(name, default, help):
    """' [default ...]' for --help; the demo profile's value where it differs from the paper's (also where the
    help names its own default, which the profile then overrides)."""
    demo = PROFILES["smollm2-135m"].get(name, default)
    if "[default" in help and name in PROFILES["smollm2-135m"]:
        return f" [smollm2-135m (demo profile): {demo}]"
    if default is None or "[default" in help or isinstance(default, bool) and demo == default:
        return ""
    if demo != default:
        return f" [default {demo} with smollm2-135m (demo profile), else {default} (paper)]"
    return f" [default {default}]"


def build_parser(description=None):
    """The command line, generated from the settings' declarations (settings()), grouped as GROUPS; every
    default is argparse.SUPPRESS so that parse_args knows which flags were given."""
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
               argument_default=argparse.SUPPRESS)
    groups = {k: p.add_argument_group(title) for k, title in GROUPS.items()}
    m = groups["recipe"].add_mutually_exclusive_group()
    for method, what in (("gtpo", "train with GTPO (default)"), ("grpo", "train with the GRPO baseline (Eq. 1)"),
                         ("sft", "supervised fine-tuning on the worked solutions")):
        m.add_argument(f"--use_{method}", dest="method", action="store_const", const=method, help=what)
    for name, default, meta in settings():
        meta = dict(meta)
        group, help, check = meta.pop("group"), meta.pop("help"), meta.pop("check")
        if isinstance(default, bool) or meta.get("type") is bool:
            meta.pop("type", None)
            switch = default is False and name not in PROFILES["smollm2-135m"]
            meta["action"] = "store_true" if switch else argparse.BooleanOptionalAction
        elif "type" not in meta:
            meta["type"] = type(default)
        if check:
            meta["type"] = checked(meta["type"], check)
        groups[group].add_argument(f"--{name}", help=help + default_help(name, default, help), **meta)
    return p


def objective(values):
    """gtpo.Objective(**values), its refusal said as a ConfigError (one line, exit code 2)."""
    try:
        return gtpo.Objective(**values)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def parse_args(argv=None, description=None):
    """Command line -> a checked Config: flags given > on --resume the run's own settings (recorded_run) >
    --released_code's settings > the model's profile > the paper's defaults. A flag the method never reads is
    said once, on stderr (rank 0 under torchrun)."""
    given = vars(build_parser(description).parse_args(argv))
    run = recorded_run(given) if given.get("resume") else {}
    chosen = {**run, **given}
    profile = PROFILES.get(chosen.get("model", Config.model), {})
    released = gtpo.RELEASED if chosen.get("released_code") else {}
    layers = {**profile, **released, **chosen}
    cfg = Config(**{k: v for k, v in layers.items() if k not in OBJECTIVE},
                 objective=objective({k: v for k, v in layers.items() if k in OBJECTIVE}))
    before = record(cfg)
    cfg = finish(cfg)
    unused = [f"--{name}" for name in unused_flags(cfg) if name in given]
    if unused and os.environ.get("RANK", "0") == "0":
        print(f"note: {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with --use_{cfg.method}",
              file=sys.stderr)
    now = record(cfg)
    cfg.sources = {n: "flag" if n in given else "resume (the run's config.json)" if n in run
                   else "--released_code" if n in released else f"profile ({cfg.model})" if n in profile
                   else "setup (device, model, method)" if now[n] != before[n] else "default"
                   for n in ["method", *(name for name, _, _ in settings())]}
    return cfg


# what one command says for itself: never read back from a run's config.json
PER_INVOCATION = ("output_dir", "resume", "overwrite", "allow_changes", "print_config")


def recorded_run(given):
    """--resume: the run's settings as its config.json records them (the method, and every setting a flag gives
    but PER_INVOCATION's), so that `--resume --output_dir RUN` alone continues it. A setting the run predates
    reads as its declared unrecorded value (unrecorded()); one undeclared is left out, its default stands, and
    runs.prepare_output_dir refuses it if it is part of the run's identity. {} when config.json cannot be read:
    prepare_output_dir then says what is wrong."""
    out = given.get("output_dir") or default_output_dir(*(given.get(k, getattr(Config, k))
                                                          for k in ("method", "model", "dataset")))
    try:
        old = read_json(os.path.join(out, "config.json"))
    except (OSError, ValueError):
        return {}
    declared = unrecorded()
    names = [n for n in ["method", *(name for name, _, _ in settings())] if n not in PER_INVOCATION]
    return {n: old[n] if n in old else declared[n] for n in names if n in old or n in declared}


def default_output_dir(method, model, dataset):
    return os.path.join("runs", f"{method}-{os.path.basename(model)}-{task_name(dataset)}")


def config_table(cfg):
    """--print_config: every setting, its value and where it came from (Config.sources), grouped as --help."""
    flat, lines = record(cfg), []
    for key, title in GROUPS.items():
        names = ["method"] * (key == "recipe") + [n for n, _, meta in settings() if meta["group"] == key]
        width = max(map(len, names))
        lines += [f"# {title}"] + [f"{n:<{width}}  {flat[n]!r:<24}  {cfg.sources.get(n, '')}" for n in names]
    return "\n".join(lines)


def unused_flags(cfg):
    """The settings this run's method never reads: the objective's (gtpo.Objective.unread), and <H>_ini's
    prompts but for GTPO's auto filter (Eq. 6); SFT reads none of them."""
    unused = cfg.objective.unread(cfg.method) + ["released_code"] * (cfg.method == "sft")
    return unused + ["ent_ini_prompts"] * (cfg.method != "gtpo" or cfg.objective.entropy_filter != "auto")


def finish(cfg):
    """Fill the defaults that depend on the device, model or method, and refuse what cannot work."""
    cfg.device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.load_in_4bit is None:                        # Listing 1 on a GPU; on CPU only when asked
        cfg.load_in_4bit = cfg.device.startswith("cuda")
    if cfg.lora_rank is None:
        cfg.lora_rank = ALIASES.get(cfg.model, (None, 64))[1]      # Listing 1: Llama 128, Qwen 64
    if cfg.load_in_4bit and cfg.lora_rank == 0:
        raise ConfigError("full fine-tuning (--lora_rank 0) cannot train 4-bit weights; use LoRA or --no-load_in_4bit")
    if cfg.optimizer == "adam":                         # the authors' README: `--optimizer adam`
        cfg.optimizer = "adamw_8bit"
    b1, b2 = BETAS[cfg.method]
    cfg.adam_beta1 = b1 if cfg.adam_beta1 is None else cfg.adam_beta1
    cfg.adam_beta2 = b2 if cfg.adam_beta2 is None else cfg.adam_beta2
    if cfg.method != "sft" and cfg.generation_size < 2:
        raise ConfigError(f"--generation_size {cfg.generation_size}: GRPO and GTPO compare completions within "
                          f"a group and need G >= 2 (the paper uses 8 or 12); for one sample per prompt use --use_sft")
    if cfg.method != "sft" and 0 < cfg.max_steps <= cfg.sft_warmup_steps:
        raise ConfigError(f"--max_steps {cfg.max_steps} counts every optimizer step, and the first "
                          f"--sft_warmup_steps {cfg.sft_warmup_steps} are SFT: this run would take no {cfg.method.upper()} "
                          f"step. Raise --max_steps above {cfg.sft_warmup_steps}, or lower --sft_warmup_steps "
                          f"(0 for a short RL-only test run)")
    if HUB.keys() & {cfg.dataset, cfg.one_shot_from}:  # the datasets that read it; before the model loads
        check_data_dir(cfg.data_dir)
    for name in (cfg.dataset, cfg.one_shot_from):
        if name and is_local(name) and not os.path.isfile(name):
            raise ConfigError(f"dataset file {name!r} does not exist; give a path to a .jsonl file (README: its "
                              f"fields) or one of {', '.join(TASKS)}")
    if cfg.one_shot and cfg.one_shot_from is None and is_local(cfg.dataset):
        raise ConfigError(f"--one_shot with your own file {cfg.dataset!r}: say which worked example the prompt shows: "
                          f"--one_shot_from {cfg.dataset} (its first record, then not trained on), --one_shot_from "
                          f"gsm8k (a built-in dataset's), or --no-one_shot")
    loggers = [n for n in cfg.report_to.split(",") if n not in ("", "none")]
    unknown = [n for n in loggers if n not in LOGGERS]
    if unknown:
        raise ConfigError(f"--report_to {cfg.report_to}: {unknown[0]!r} is none of {', '.join(LOGGERS)} (or none)")
    for name in loggers:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"--report_to {name}: the {name} package is not installed; pip install {name}, or "
                              f"leave {name} out of --report_to")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in --output_dir and --overwrite replaces it: give one of them")
    unknown = {k for k in cfg.allow_changes.split(",") if k} - set(identity_keys())
    if unknown:
        raise ConfigError(f"--allow_changes {cfg.allow_changes!r}: {', '.join(sorted(unknown))} not among the run's "
                          f"identity ({', '.join(identity_keys())}); other settings may change on --resume freely")
    cuda = cfg.device.startswith("cuda")
    if cfg.gradient_checkpointing is None and not cuda:  # on CUDA the memory plan decides by the estimate
        cfg.gradient_checkpointing = False
    if cfg.micro_batch_size is None and not cuda:       # on CUDA the memory plan picks it
        cfg.micro_batch_size = 0
    if cfg.gradient_checkpointing:
        cfg.share_prompt = False                        # checkpointed layers cannot keep a KV cache
    if cfg.output_dir is None:
        cfg.output_dir = default_output_dir(cfg.method, cfg.model, cfg.dataset)
    return cfg


def check_device(device):
    """A CUDA device asked for where torch has none: refused before anything loads (config decisions for a
    CUDA device can still be computed on any host, as the tests and `bench --parts memory` do)."""
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch is the CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"--device {device}: {why} (torch {torch.__version__}); use --device cpu, or install "
                          f"the CUDA build of torch (README, On a GPU)")


def training_records(cfg, log=print):
    """The training records of cfg.dataset, checked before the model loads (a bad data file fails here)."""
    records = load_task(cfg.dataset, "train", cfg.data_dir)
    check_solutions(cfg, records, log)
    return records


def check_solutions(cfg, records, log):
    """Say when the SFT steps (the warm-up, or --use_sft) or the one-shot example would show records without a
    worked `solution` -- an empty <reasoning></reasoning>, which the sampled completions then copy."""
    def empty(record):
        return not (record.get("solution") or "").strip()
    missing = sum(map(empty, records)) if cfg.method == "sft" or cfg.sft_warmup_steps > 0 else 0
    if missing:
        what = "--use_sft" if cfg.method == "sft" else f"the SFT warm-up (--sft_warmup_steps {cfg.sft_warmup_steps})"
        log(f"warning: {missing} of {len(records)} records of {cfg.dataset} have no `solution` (the worked reasoning): "
            f"{what} trains on an empty <reasoning></reasoning> for them. Add a `solution` field to the records"
            + (", or pass --sft_warmup_steps 0" if cfg.method != "sft" else ""))
    if cfg.one_shot:
        source = cfg.one_shot_from or cfg.dataset
        if empty(records[0] if source == cfg.dataset else load_task(source, "train", cfg.data_dir)[0]):
            log(f"warning: the one-shot example, the first train record of {source}, has no `solution`: every prompt "
                f"shows an empty <reasoning></reasoning>. Give that record a `solution`, or pass --one_shot_from gsm8k "
                f"(a built-in example) or --no-one_shot")
