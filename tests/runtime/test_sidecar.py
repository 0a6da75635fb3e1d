"""The sidecar client with fake waves: ready, slow, stuck, crashing, raising and garbage-returning waves.
Polling never blocks; every failure becomes `pending.error` and the next request still works."""

import os
import time

import pytest

from pipeline.runtime.sidecar_client import Sidecar, SidecarLoadError, load_factory

PAYLOAD = {"tool_index": 0, "arguments": {"city": "Paris"}}


def wave(request):
    kind = request["kind"]
    if kind == "sleep":
        time.sleep(request["s"])
    elif kind == "crash":
        os._exit(3)
    elif kind == "raise":
        raise RuntimeError("boom")
    elif kind == "set":
        return {1, 2}  # not JSON
    elif kind == "none":
        return None
    elif kind == "text":
        return "tool 0 please"
    return PAYLOAD


def make_wave(answer):
    return lambda request: {"tool_index": 0, "arguments": {"answer": answer}}


def _wait(pending, limit=20.0):
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        if pending.poll() is not None or pending.error:
            return pending.poll()
        time.sleep(0.01)
    raise AssertionError("sidecar never answered")


def test_ready_payload_arrives_and_polling_never_blocks():
    with Sidecar(wave) as sc:
        p = sc.start({"kind": "sleep", "s": 0.5})
        t0 = time.perf_counter()
        assert p.poll() is None
        assert time.perf_counter() - t0 < 0.05  # a poll is a non-blocking queue read
        assert _wait(p) == PAYLOAD and p.error is None and p.done_s >= 0.5


@pytest.mark.parametrize("kind,why", [("crash", "died (exit code 3)"), ("raise", "RuntimeError('boom')"),
                                      ("set", "not JSON serializable"), ("none", "returned null")])
def test_failures_become_errors_and_the_next_request_works(kind, why):
    with Sidecar(wave) as sc:
        p = sc.start({"kind": kind})
        assert _wait(p) is None and why in p.error
        assert _wait(sc.start({"kind": "ok"})) == PAYLOAD  # a dead worker is restarted


def test_non_object_payload_is_passed_on_for_validation():
    with Sidecar(wave) as sc:
        assert _wait(sc.start({"kind": "text"})) == "tool 0 please"  # HintDrafter rejects it (test_drafters)


def test_stuck_wave_times_out_and_is_stopped():
    with Sidecar(wave, timeout_s=0.3) as sc:
        p = sc.start({"kind": "sleep", "s": 60})
        assert _wait(p) is None and "timed out" in p.error
        assert not sc.alive()  # the stuck worker was killed, so it cannot delay the next request
        assert _wait(sc.start({"kind": "ok"})) == PAYLOAD


def test_factory_builds_the_wave_inside_the_worker():
    with Sidecar(factory=f"{__name__}:make_wave", factory_kwargs={"answer": 42}) as sc:
        assert _wait(sc.start({}))["arguments"] == {"answer": 42}
    with Sidecar(factory="pipeline.no_such_module:x") as sc:
        p = sc.start({})
        assert _wait(p) is None and "died" in p.error
    with pytest.raises(ValueError, match="module:function"):
        load_factory("no_colon")
    with pytest.raises(ValueError, match="exactly one"):
        Sidecar()


def test_wait_loaded_names_the_device_and_the_workers_error():
    with Sidecar(factory=f"{__name__}:make_wave", factory_kwargs={"answer": 1}) as sc:
        sc.wait_loaded(60)
        assert sc.loaded and sc.alive()
    with Sidecar(factory="pipeline.no_such_module:x", factory_kwargs={"device": "cuda:1"}) as sc:
        with pytest.raises(SidecarLoadError, match=r"could not load on device cuda:1: .*No module named"):
            sc.wait_loaded(60)
        assert not sc.alive()
    with Sidecar(wave) as sc:  # a wave callable: loaded at once, on the CPU
        sc.wait_loaded(60)
        assert sc.device() == "cpu"


def test_a_crash_looping_worker_backs_off():
    """The first quick death restarts at once; the next ones wait 1, 2, 4 ... s, failing requests at once meanwhile."""
    with Sidecar(wave) as sc:
        assert _wait(sc.start({"kind": "crash"})) is None
        assert _wait(sc.start({"kind": "crash"})) is None and sc.restarts == 1  # restarted at once, died again
        down = sc.start({"kind": "ok"})
        assert down.error and down.error.startswith("sidecar down (restarting in") and sc.status() == "down"
        time.sleep(1.1)
        assert _wait(sc.start({"kind": "ok"})) == PAYLOAD and sc.restarts == 2 and sc.status() == "up"
