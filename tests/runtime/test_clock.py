"""The device-aware clock: on a fake device (a CPU target whose `sync` is recorded) every timestamp a row's figures
come from (prefill_s, decode_s, verify_s, wall_s, the peers' first token, the cost curve) is read after a sync that
follows the last piece of device work: what makes the figures right on a GPU, where a forward returns at launch."""

import time

import pytest
import torch

from pipeline.eval.runner import HFPeers, Runner
from pipeline.payload import gold_payload
from pipeline.runtime import METHODS, Ready, generate
from pipeline.runtime.budget import CostCurve
from pipeline.runtime.clock import SYNC, Clock, clock_of
from pipeline.testing import tiny_target


class Recorder:
    """An event log: 'work' after every decoder layer and before every KV gather, 'sync' at every device wait,
    'read' at every perf_counter."""

    def __init__(self, target, monkeypatch):
        self.events: list[str] = []
        self.target = target
        target.clock = Clock("cpu", sync=lambda: self.events.append("sync"))
        hooks = [layer.register_forward_hook(lambda *a: self.events.append("work"))
                 for layer in target.model.model.layers]
        self.hooks = hooks
        plain_keep, plain_perf = target.keep, time.perf_counter

        def keep(tree_len, nodes):
            if [0] + list(nodes) != list(range(len(nodes) + 1)):
                self.events.append("work")  # the gather runs on the device
            return plain_keep(tree_len, nodes)

        def perf_counter():
            self.events.append("read")
            return plain_perf()

        monkeypatch.setattr(target, "keep", keep)
        monkeypatch.setattr(time, "perf_counter", perf_counter)

    def unsynced_reads(self) -> list[int]:
        """Indexes of reads that come after device work with no sync in between."""
        bad, dirty = [], False
        for i, e in enumerate(self.events):
            if e == "work":
                dirty = True
            elif e == "sync":
                dirty = False
            elif dirty:
                bad.append(i)
        return bad

    def close(self):
        for h in self.hooks:
            h.remove()


@pytest.fixture
def target(tok):
    return tiny_target("qwen2", tok)


def test_clock_waits_only_where_the_device_is_asynchronous():
    assert SYNC["cpu"] is None and SYNC["cuda"] is not None
    cpu = Clock("cpu")
    cpu.now()
    assert cpu.syncs == 0
    calls = []
    fake = Clock("cpu", sync=lambda: calls.append(1))
    a = fake.now()
    fake.sync()
    assert len(calls) == fake.syncs == 2 and isinstance(a, float)
    with pytest.raises(ValueError, match="no synchronize rule for device xla"):
        Clock(torch.device("xla"))


def test_clock_of_falls_back_to_the_device(target):
    assert clock_of(target) is target.clock
    assert clock_of(object()).device.type == "cpu"


@pytest.mark.parametrize("method", METHODS)
def test_every_boundary_of_generate_is_read_after_a_sync(target, requests, monkeypatch, method):
    ar = generate(target, requests[0], "ar", max_new_tokens=12)
    rec = Recorder(target, monkeypatch)
    res = generate(target, requests[0], method, sidecar=Ready(gold_payload(requests[0])), oracle=ar,
                   max_new_tokens=12, tree_budget="fixed")
    rec.close()
    assert res.token_ids == ar.token_ids
    assert rec.events.count("work") > 0 and rec.events.count("sync") >= res.stats.forwards + 1
    assert rec.unsynced_reads() == [], rec.events


def test_a_sync_that_is_missing_is_caught(target, requests, monkeypatch):
    """The check itself can fail: with verify's sync removed (and `tolist` not waiting on a fake device), reads follow
    unsynced work."""
    rec = Recorder(target, monkeypatch)
    monkeypatch.setattr(target, "verify", lambda tree: target.logits(tree).argmax(-1).tolist())
    generate(target, requests[0], "ar", max_new_tokens=4)
    rec.close()
    assert rec.unsynced_reads()


def test_cost_curve_and_peers_read_after_a_sync(target, requests, monkeypatch):
    rec = Recorder(target, monkeypatch)
    CostCurve.measure(target, past=32, reps=1, sizes=(1, 2))
    peers = HFPeers(target, pld_tokens=3)
    out = peers.generate(requests[0], "hf-pld", 6)
    rec.close()
    assert out["new_tokens"] > 0
    # transformers' own generate reads no clock between its forwards; the peers' first-token and end stamps sync
    assert rec.unsynced_reads() == [], rec.events


def test_runner_rows_read_after_a_sync(target, requests, monkeypatch):
    runner = Runner(target, ["ar", "pld", "toolspec"], max_new_tokens=6, tree_budget="fixed")
    rec = Recorder(target, monkeypatch)
    rows = runner.run("fixture", requests[0])
    rec.close()
    runner.close()
    assert {r["method"] for r in rows} == {"ar", "pld", "toolspec"}
    assert rec.unsynced_reads() == [], rec.events
