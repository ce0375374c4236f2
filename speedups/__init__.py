"""Speed and memory: the same update as the plain path, computed faster or in less memory, each where it is tested
and pays (tests hold each equal to the plain computation).

    logprobs.py        the gradient pass: log pi and entropy per token with the LM head in chunks, the prompt
                       computed once per group (PolicyPass, for DDP)
    cpu_rollout.py     the CPU sampler: prompts pre-filled once, a decode loop of our own (same distribution as
                       `generate`, other random draws)
    cpu_decoder.py     its decode step for Llama / Qwen2 (packed weights)
    merged_rollout.py  the GPU sampler: a kept bf16 copy with LoRA merged, its decode loop
    memory.py          a run's GPU memory, estimated without a GPU: which sampler, checkpointing and micro-batch fit
    memory_plan.py     what a CUDA run decides from that estimate before step 1, and says
"""
