"""The GPU engines' own knobs, forwarded verbatim by their adapters: vLLM and TensorRT-LLM."""

from __future__ import annotations

from dataclasses import dataclass

from llamamesh.settings.schema import FRACTION, Range, Section, setting


@dataclass(frozen=True)
class VllmSettings(Section, section="vllm"):
    """The vllm engine's knobs, forwarded verbatim to vLLM's ``AsyncEngineArgs`` by
    ``workers/engines/vllm_args.py`` (nothing else reads them). The model is ``LLAMAMESH_WORKER_MODEL_PATH``
    (a folder or a Hugging Face id). Zero / empty means "vLLM's own default".

    Keep vLLM saturated: with this engine set ``LLAMAMESH_WORKER_MAX_INFLIGHT`` at least as high as
    ``max_num_seqs`` (vLLM's default under ``vllm serve`` is 1024 on an H100/H200, 256 on smaller GPUs),
    e.g. 512 and 512; the engine logs ``vllm_underfed`` at start when it is lower.
    """

    tokenizer: str = ""
    """Tokenizer folder or id. Empty: the model's."""

    dtype: str = ""
    """auto, bfloat16, float16, float32. Empty: auto."""

    tensor_parallel_size: int = setting(0, Range(0))
    """GPUs to shard the model over. 0: every GPU visible to the worker."""

    max_model_len: int = setting(0, Range(0))
    """Longest sequence (prompt + completion) in tokens. 0: the model's own."""

    gpu_memory_utilization: float = setting(0.0, FRACTION)
    """Fraction of each GPU's memory vLLM may use, in (0, 1]. 0: vLLM's default (0.92)."""

    block_size: int = setting(0, Range(0))
    """Tokens per KV-cache block. 0: vLLM's choice."""

    enable_prefix_caching: bool | None = None
    """Prefix caching on (true) or off (false); empty: vLLM's default (on)."""

    quantization: str = ""
    """awq, gptq, fp8, ... Empty: what the model's config says (or none)."""

    load_format: str = ""
    """auto, safetensors, pt, dummy (random weights), ... Empty: auto."""

    enforce_eager: bool = False
    """Run without CUDA graphs / torch.compile (faster start, slower steps)."""

    max_num_seqs: int = setting(0, Range(0))
    """Sequences in one engine step. 0: vLLM's default for the GPU."""

    max_num_batched_tokens: int = setting(0, Range(0))
    """Tokens in one engine step. 0: chosen from what the worker serves: 32768 (twice offline ``LLM``'s budget on an
    H100/H200) for a batch worker (LLAMAMESH_BATCH_MAX_SHARE = 1: batch items may take every slot), else vLLM's
    server default for the GPU (8192 on an H100/H200), whose shorter steps keep interactive tokens flowing."""

    scheduling_policy: str = "priority"
    """vLLM's scheduler: priority (the default here) admits waiting requests by priority (higher
    GenerateRequest.priority first; every batch item after every interactive request), first come first served
    within one priority, and preempts the lowest first when memory runs out; fcfs is vLLM's own default
    (priorities are then not passed)."""

    swap_space: float = setting(0.0, Range(0))
    """GiB of CPU swap per GPU. vLLM 0.26 has no such argument (the V1 engine recomputes preempted requests); any
    non-zero value is refused at start."""

    seed: int = 0
    """Engine seed. 0: vLLM's default (which is 0)."""

    enable_lora: bool = False
    """LoRA: serve adapters (on whenever LLAMAMESH_WORKER_ADAPTERS lists one; set it to load adapters only at run
    time, through AdminService)."""

    max_loras: int = setting(0, Range(0))
    """LoRA: how many adapters share a step. 0: vLLM's default."""

    max_lora_rank: int = setting(0, Range(0))
    """LoRA: the highest adapter rank. 0: vLLM's default (16)."""

    extra_args: str = ""
    """JSON object of any other AsyncEngineArgs fields, e.g. '{"kv_cache_dtype": "fp8"}'."""

    frontends: int = setting(1, Range(1))
    """Worker processes sharing the engine, as ``vllm serve --api-server-count``: each runs its own AsyncLLM client
    (output processing, detokenisation), its own leasing and event publishing, and takes max_inflight / frontends
    of the jobs. 1: one process, the engine core in a child of it."""


@dataclass(frozen=True)
class TrtllmSettings(Section, section="trtllm"):
    """The trtllm engine's knobs, forwarded verbatim to TensorRT-LLM's ``LLM(...)`` (its ``TorchLlmArgs``,
    or ``TrtLlmArgs`` for an engine directory) by ``workers/engines/trtllm_args.py`` (nothing else reads them).
    The model is ``LLAMAMESH_WORKER_MODEL_PATH``. Zero / empty means "TensorRT-LLM's own default".
    """

    backend: str = "pytorch"
    """pytorch: a Hugging Face checkpoint folder or id (TensorRT-LLM's default LLM); tensorrt: a directory of
    TensorRT engines built by trtllm-build."""

    tokenizer: str = ""
    """Tokenizer folder or id. Empty: the model's (an engine directory may need one)."""

    dtype: str = ""
    """auto, bfloat16, float16, float32. Empty: auto."""

    tensor_parallel_size: int = setting(0, Range(0))
    """GPUs to shard the model over. 0: every GPU visible to the worker (pytorch), the engine's own (tensorrt)."""

    max_seq_len: int = setting(0, Range(0))
    """Longest sequence (prompt + completion) in tokens. 0: the model's (or the engine's) own."""

    max_batch_size: int = setting(0, Range(0))
    """Requests in one engine step. 0: TensorRT-LLM's default (2048)."""

    max_num_tokens: int = setting(0, Range(0))
    """Tokens in one engine step. 0: TensorRT-LLM's default (8192)."""

    enable_chunked_prefill: bool | None = None
    """Prefill long prompts in chunks of at most max_num_tokens (without it TensorRT-LLM refuses a longer prompt): true
    or false; empty: on for the pytorch backend, the engine's own for tensorrt (it must be built with paged context
    attention)."""

    free_gpu_memory_fraction: float = setting(0.0, FRACTION)
    """KvCacheConfig: fraction of free GPU memory (after the weights) for the KV cache, in (0, 1]. 0: TensorRT-LLM's
    default (0.9)."""

    enable_block_reuse: bool | None = None
    """KvCacheConfig: reuse KV blocks across requests (prefix caching): true or false; empty: TensorRT-LLM's default
    (on)."""

    trust_remote_code: bool = False
    """Run the model's own code from its Hugging Face folder."""

    enable_lora: bool = False
    """LoRA (the pytorch backend's LoraConfig): serve adapters (on whenever LLAMAMESH_WORKER_ADAPTERS lists one; set
    it to load adapters only at run time)."""

    max_loras: int = setting(0, Range(0))
    """LoRA: how many adapters sit on the GPU at once. 0: TensorRT-LLM's default."""

    max_cpu_loras: int = setting(0, Range(0))
    """LoRA: how many adapters sit in CPU memory at once. 0: TensorRT-LLM's default."""

    max_lora_rank: int = setting(0, Range(0))
    """LoRA: the highest adapter rank. 0: TensorRT-LLM's default."""

    lora_target_modules: str = ""
    """LoRA: the modules adapters may target, comma-separated (e.g. attn_q,attn_k,attn_v). Empty: what the worker's own
    adapter targets, which needs exactly one in LLAMAMESH_WORKER_ADAPTERS (else the worker refuses to start)."""
