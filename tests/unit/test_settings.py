from __future__ import annotations

import pytest

from llamamesh.settings import Settings

pytestmark = pytest.mark.timeout(10)


def test_env_maps_one_to_one_to_fields() -> None:
    s = Settings.from_env({
        "LLAMAMESH_REDIS_URL": "redis://h:1/0",
        "LLAMAMESH_WORKER_MAX_INFLIGHT": "7",
        "LLAMAMESH_WORKER_FAKE_STEP_S": "0.5",
        "LLAMAMESH_GATEWAY_MODELS": "a=gpu, b=cpu",
        "UNRELATED": "x",
    })
    assert s.redis.url == "redis://h:1/0"
    assert s.worker.max_inflight == 7 and s.worker.fake_step_s == 0.5
    assert [(m.id, m.pool, m.default) for m in s.gateway.model_table()] == [("a", "gpu", True), ("b", "cpu", False)]


def test_round_trip_through_the_environment() -> None:
    s = Settings.from_env({}).with_overrides(worker={"engine": "fake", "threads": 3}, gateway={"port": None})
    assert Settings.from_env(s.to_env()) == s
    assert s.gateway.port == 50051


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match="LLAMAMESH_WORKER_MAX_INFLIGHT"):
        Settings.from_env({"LLAMAMESH_WORKER_MAX_INFLIGHT": "many"})
    with pytest.raises(ValueError, match="LLAMAMESH_GATEWAY_MODELS"):
        Settings.from_env({"LLAMAMESH_GATEWAY_MODELS": "nopool"}).gateway.model_table()


def test_threads_default_leaves_a_core_free() -> None:
    assert Settings.from_env({}).worker.torch_threads() >= 1
    assert Settings.from_env({"LLAMAMESH_WORKER_THREADS": "4"}).worker.torch_threads() == 4


def test_vllm_section_reads_its_env_vars() -> None:
    s = Settings.from_env({
        "LLAMAMESH_VLLM_TOKENIZER": "/tok",
        "LLAMAMESH_VLLM_DTYPE": "bfloat16",
        "LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE": "2",
        "LLAMAMESH_VLLM_MAX_MODEL_LEN": "8192",
        "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION": "0.85",
        "LLAMAMESH_VLLM_BLOCK_SIZE": "32",
        "LLAMAMESH_VLLM_ENABLE_PREFIX_CACHING": "false",
        "LLAMAMESH_VLLM_QUANTIZATION": "fp8",
        "LLAMAMESH_VLLM_LOAD_FORMAT": "dummy",
        "LLAMAMESH_VLLM_ENFORCE_EAGER": "true",
        "LLAMAMESH_VLLM_MAX_NUM_SEQS": "512",
        "LLAMAMESH_VLLM_MAX_NUM_BATCHED_TOKENS": "16384",
        "LLAMAMESH_VLLM_SWAP_SPACE": "4",
        "LLAMAMESH_VLLM_SEED": "7",
        "LLAMAMESH_VLLM_EXTRA_ARGS": '{"kv_cache_dtype": "fp8"}',
    })
    v = s.vllm
    assert (v.tokenizer, v.dtype, v.tensor_parallel_size, v.max_model_len) == ("/tok", "bfloat16", 2, 8192)
    assert (v.gpu_memory_utilization, v.block_size, v.enable_prefix_caching) == (0.85, 32, "false")
    assert (v.quantization, v.load_format, v.enforce_eager) == ("fp8", "dummy", True)
    assert (v.max_num_seqs, v.max_num_batched_tokens, v.swap_space, v.seed) == (512, 16384, 4.0, 7)
    assert v.extra_args == '{"kv_cache_dtype": "fp8"}'
    assert Settings.from_env(s.to_env()) == s


def test_vllm_defaults_mean_vllms_own() -> None:
    v = Settings.from_env({}).vllm
    assert (v.tensor_parallel_size, v.max_model_len, v.gpu_memory_utilization, v.max_num_seqs) == (0, 0, 0.0, 0)
    assert (v.tokenizer, v.dtype, v.enable_prefix_caching, v.extra_args) == ("", "", "", "")
    assert v.enforce_eager is False
    with pytest.raises(ValueError, match="LLAMAMESH_VLLM_MAX_NUM_SEQS"):
        Settings.from_env({"LLAMAMESH_VLLM_MAX_NUM_SEQS": "lots"})


def test_trtllm_section_reads_its_env_vars() -> None:
    s = Settings.from_env({
        "LLAMAMESH_TRTLLM_BACKEND": "tensorrt",
        "LLAMAMESH_TRTLLM_MAX_NUM_TOKENS": "4096",
        "LLAMAMESH_TRTLLM_FREE_GPU_MEMORY_FRACTION": "0.85",
        "LLAMAMESH_TRTLLM_ENABLE_BLOCK_REUSE": "false",
        "LLAMAMESH_TRTLLM_TRUST_REMOTE_CODE": "true",
    })
    t = s.trtllm
    assert (t.backend, t.max_num_tokens, t.free_gpu_memory_fraction) == ("tensorrt", 4096, 0.85)
    assert (t.enable_block_reuse, t.trust_remote_code) == ("false", True)
    assert Settings.from_env(s.to_env()) == s
    d = Settings.from_env({}).trtllm
    assert (d.backend, d.tensor_parallel_size, d.max_seq_len, d.free_gpu_memory_fraction) == ("pytorch", 0, 0, 0.0)
    with pytest.raises(ValueError, match="LLAMAMESH_TRTLLM_MAX_BATCH_SIZE"):
        Settings.from_env({"LLAMAMESH_TRTLLM_MAX_BATCH_SIZE": "lots"})


def test_normalize_rules_come_from_their_env_var() -> None:
    rules = '[{"name": "html-ids", "pattern": "id=\\"[a-z0-9-]+\\"", "replacement": "id=\\"REDACTED\\""}]'
    s = Settings.from_env({"LLAMAMESH_GATEWAY_NORMALIZE_RULES": rules})
    assert s.gateway.normalize_rules == rules
    assert Settings.from_env(s.to_env()) == s
    assert Settings.from_env({}).gateway.normalize_rules == ""
