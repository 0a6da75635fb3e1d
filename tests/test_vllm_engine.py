"""vLLM engine settings per machine (a CPU gets an explicit KV cache and every core; a recipe's own settings win) and
the dead-engine rule (an engine that died or hung is told from one request's failure)."""

from pipeline.vllm_engine import GIB, KV_CACHE_GIB, cpu_settings, core_list, engine_dead


def test_a_cpu_engine_gets_a_bounded_kv_cache_and_every_core():
    kwargs, env, chosen = cpu_settings({"enforce_eager": True}, {}, ram=22 * GIB, cores=[0, 1], environ={})
    assert kwargs == {"enforce_eager": True, "kv_cache_memory_bytes": KV_CACHE_GIB * GIB}
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"} and chosen["threads_bind"] == "0-1"
    small = cpu_settings({}, {}, ram=8 * GIB, cores=[0], environ={})[0]
    assert small["kv_cache_memory_bytes"] == 2 * GIB  # a quarter of what is available on a small machine


def test_the_recipe_or_the_environment_wins():
    kwargs, env, chosen = cpu_settings({"gpu_memory_utilization": 0.3}, {"VLLM_CPU_OMP_THREADS_BIND": "1"},
                                       ram=22 * GIB, cores=[0, 1], environ={})
    assert kwargs == {"gpu_memory_utilization": 0.3} and env == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert "gpu_memory_utilization=0.3" in chosen["memory"]
    kwargs, env, _ = cpu_settings({}, {}, ram=22 * GIB, cores=[0, 1],
                                  environ={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert kwargs == {} and env == {}


def test_core_lists_use_vllms_syntax():
    assert core_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and core_list([3]) == "3"


def test_a_dead_engine_is_told_from_a_failing_request():
    class EngineDeadError(Exception):
        pass

    assert engine_dead(EngineDeadError("EngineCore encountered an issue"))
    try:
        try:
            raise TimeoutError("RPC call to execute_model timed out.")
        except TimeoutError as inner:
            raise RuntimeError("generate failed") from inner
    except RuntimeError as e:
        assert engine_dead(e)
    assert not engine_dead(ValueError("prompt of 5000 tokens exceeds max_model_len"))
