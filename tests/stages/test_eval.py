"""The eval stage end to end on tiny models: every method's row, identity with ar, resume without duplicates."""

import json
import shutil
from pathlib import Path

import pytest

from pipeline.io import read_jsonl
from pipeline.stages import eval as eval_stage
from pipeline.testing import make_tiny_model_dir

FIXTURES = Path(__file__).parents[1] / "fixtures" / "requests.jsonl"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    make_tiny_model_dir(root / "tiny-qwen2", "qwen2")
    make_tiny_model_dir(root / "tiny-llama", "llama", seed=1)
    (root / "requests" / "fixture").mkdir(parents=True)
    shutil.copy(FIXTURES, root / "requests" / "fixture" / "test.jsonl")
    return root


def recipe(root, methods, run="r"):
    text = {"eval": {"run": run, "out": str(root / "results"), "requests_root": str(root / "requests"),
                     "benchmarks": {"fixture": 2},
                     "targets": [{"name": "tiny", "path": str(root / "tiny-qwen2"), "dtype": "float64"}],  # exact: the budget picks trees by timing
                     "methods": methods, "schedules": ["adaptive", "colocated"], "max_new_tokens": 12,
                     "sidecar": {"model": str(root / "tiny-qwen2"), "dtype": "float32", "max_value_tokens": 4, "timeout_s": 120},
                     "assistant": {"path": str(root / "tiny-llama")},
                     "drop_busy_rows": False}}  # a test's timings are not the point: keep rows a busy machine flags
    path = root / f"{run}-{len(methods)}.yaml"
    path.write_text(json.dumps(text))  # JSON is YAML
    return path


def test_eval_all_methods_then_resume(setup):
    root = setup
    eval_stage.main(["--recipe", str(recipe(root, ["ar", "pld", "toolspec", "hf-pld", "hf-assisted"]))])
    run_dir = root / "results" / "r"
    rows = read_jsonl(run_dir / "rows.jsonl")
    assert len(rows) == 2 * 5
    by = {(r["request_id"], r["method"]): r for r in rows}
    for (rid, method), r in by.items():
        assert r["token_digest"] == by[(rid, "ar")]["token_digest"], (rid, method)
        assert r["new_tokens"] >= 1 and r["wall_s"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    methods = summary["cells"][0]["methods"]
    assert set(methods) == {"ar", "pld", "toolspec", "hf-pld", "hf-assisted"}
    assert all(m["identical_to_ar"] == 1.0 for m in methods.values())
    assert (run_dir / "summary.md").exists() and (run_dir / "speedup.png").exists()

    # resume: add the sidecar methods; finished rows are kept, nothing is duplicated
    eval_stage.main(["--recipe", str(recipe(root, ["ar", "pld", "toolspec", "hf-pld", "hf-assisted", "ooo",
                                                   "ooo-oracle"]))])
    rows2 = read_jsonl(run_dir / "rows.jsonl")
    # ooo once per schedule (adaptive, colocated): 8 variants per request
    assert len(rows2) == 2 * 8 and len({r["key"] for r in rows2}) == len(rows2)
    assert [r for r in rows2 if r["key"] in {x["key"] for x in rows}] == rows
    by = {(r["request_id"], r["variant"]): r for r in rows2}
    for rid in {r["request_id"] for r in rows2}:
        for v in ("ooo@adaptive", "ooo@colocated", "ooo-oracle"):
            assert by[(rid, v)]["token_digest"] == by[(rid, "ar")]["token_digest"]
        assert by[(rid, "ooo@adaptive")]["schedule"] == "adaptive" and by[(rid, "ar")]["schedule"] == "all-cores"
        row = by[(rid, "ooo@adaptive")]
        if row["hint_ready_s"] is not None:  # the wave answered before the decode ended: its CPU time is charged
            assert row["sidecar_cpu_s"] is not None
    # every baseline ran with all the cores this process may use
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert all(r["threads"] == cores for r in rows2)
    assert all(set(r.get("target_threads") or [cores]) == {cores} for r in rows2 if r["schedule"] == "all-cores")

    # every sidecar row names its sidecar; a row made with another adapter is measured again, the rest stay
    ident = json.loads((run_dir / "manifest.json").read_text())["sidecar"]
    assert all(r["sidecar"] == ident for r in rows2 if r["method"] == "ooo")
    assert all("sidecar" not in r for r in rows2 if r["method"] != "ooo")
    stale = next(r for r in rows2 if r["variant"] == "ooo@adaptive")
    lines = [json.dumps({**r, "sidecar": {**ident, "adapter_sha256": "0" * 64}}) if r is stale else json.dumps(r)
             for r in rows2]
    (run_dir / "rows.jsonl").write_text("\n".join(lines) + "\n")
    eval_stage.main(["--recipe", str(recipe(root, ["ar", "pld", "toolspec", "hf-pld", "hf-assisted", "ooo",
                                                   "ooo-oracle"]))])
    rows3 = {r["key"]: r for r in read_jsonl(run_dir / "rows.jsonl")}
    assert len(rows3) == len(rows2) and rows3[stale["key"]]["sidecar"] == ident
    assert rows3[stale["key"]]["wall_s"] != stale["wall_s"]  # measured again
    assert all(rows3[r["key"]] == r for r in rows2 if r is not stale)


def test_a_sidecar_row_is_stale_when_its_adapter_changed():
    ident = {"model": "m", "adapter": "a", "adapter_sha256": "1" * 64}
    ooo = {"method": "ooo", "sidecar": dict(ident)}
    assert not eval_stage.stale_sidecar_row(ooo, ident)
    assert eval_stage.stale_sidecar_row({**ooo, "sidecar": {**ident, "adapter_sha256": "2" * 64}}, ident)
    assert eval_stage.stale_sidecar_row({**ooo, "sidecar": {**ident, "model": "other"}}, ident)
    assert eval_stage.stale_sidecar_row({"method": "ooo"}, ident)  # unrecorded: measured again
    merged = {**ident, "merged": True}  # the adapter folded into the base weights: another model, measured again
    assert eval_stage.stale_sidecar_row(ooo, merged)
    assert not eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": merged}, merged)
    newer = {**merged, "wave": 2}  # the wave's code changed: measured again
    assert eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": merged}, newer)
    assert not eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": newer}, newer)
    banned = {**newer, "required_values": True}  # required parameters may not answer null: measured again
    assert eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": newer}, banned)
    assert not eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": banned}, banned)
    cached = {**banned, "prefix_cache": 8192}  # waves from the sidecar's prefix cache: measured again
    assert eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": banned}, cached)
    assert not eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": {**banned, "prefix_cache": 0}}, banned)
    int8 = {**banned, "quantize": "int8"}  # the wave's linears in int8: another wave, measured again
    assert eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": banned}, int8)
    assert eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": int8}, banned)
    assert not eval_stage.stale_sidecar_row({"method": "ooo", "sidecar": int8}, int8)
    assert not eval_stage.stale_sidecar_row({"method": "ar"}, ident)
    assert not eval_stage.stale_sidecar_row({"method": "ooo-oracle"}, ident)  # its hint is ar's text, no sidecar
    assert not eval_stage.stale_sidecar_row({"method": "ooo"}, None)  # a run without ooo keeps every row
    # an adaptive row prefilled beside the wave in other chunks: measured again (unrecorded = whole chunks)
    adaptive = {"method": "ooo", "schedule": "adaptive", "sidecar": newer}
    assert eval_stage.stale_sidecar_row(adaptive, newer, 64)
    assert not eval_stage.stale_sidecar_row({**adaptive, "wave_chunk": 64}, newer, 64)
    assert eval_stage.stale_sidecar_row({**adaptive, "wave_chunk": 64}, newer, 32)
    assert not eval_stage.stale_sidecar_row(adaptive, newer, None)
    assert not eval_stage.stale_sidecar_row({**adaptive, "schedule": "sequential"}, newer, 64)
    assert eval_stage.wave_chunk(256, 64) == 64
    assert eval_stage.wave_chunk(32, 64) == 32
    assert eval_stage.wave_chunk(None, 64) is None
    # the core given back between layers (unrecorded: between chunks only), and whole chunks beside the wave
    switched = {**adaptive, "wave_chunk": 256, "layer_switch": True}
    assert not eval_stage.stale_sidecar_row(switched, newer, 256, layer_switch=True)
    assert eval_stage.stale_sidecar_row({**adaptive, "wave_chunk": 256}, newer, 256, layer_switch=True)
    assert eval_stage.stale_sidecar_row(switched, newer, 256)
    assert eval_stage.wave_chunk(256, 64, layer_switch=True) == 256


def test_prefill_once_per_request_and_threads(setup):
    """Variants doing the same prefill work share one measured prefill per request (restored KV, charged seconds);
    `ooo` prefills itself beside its wave (under `deferred` it shares the prefill: its wave starts after it), and so
    do the transformers peers (without the prefix cache); a peer that would draft with
    the target itself is not run; output unchanged."""
    root = setup
    path = recipe(root, ["ar", "pld", "toolspec", "ooo", "ooo-oracle", "hf-pld", "hf-assisted"], run="once")
    text = json.loads(path.read_text())
    text["eval"]["assistant"]["path"] = text["eval"]["targets"][0]["path"]  # assisted would draft with the target
    text["eval"]["schedules"] = ["adaptive", "deferred"]
    path.write_text(json.dumps(text))
    eval_stage.main(["--recipe", str(path)])
    rows = read_jsonl(root / "results" / "once" / "rows.jsonl")
    assert "hf-assisted" not in {r["method"] for r in rows}
    for rid in {r["request_id"] for r in rows}:
        mine = [r for r in rows if r["request_id"] == rid]
        shared = [r for r in mine if r["schedule"] == "all-cores" and not r["method"].startswith("hf-")]
        ooo = {r["schedule"]: r for r in mine if r["method"] == "ooo"}
        same = shared + [ooo["deferred"]]  # ooo@deferred's wave starts after the prefill: the baselines' prefill
        assert len(shared) == 4 and sum(not r["prefill_reused"] for r in same) == 1
        peer = [r for r in mine if r["method"] == "hf-pld"]  # transformers' peers prefill the whole prompt themselves
        assert len(peer) == 1 and peer[0]["prefix_cache"] is False and not peer[0]["prefill_reused"]
        assert len({r["prefill_s"] for r in same}) == 1 and len({r["prefill_cpu_s"] for r in same}) == 1
        assert len({r["cached_tokens"] for r in same}) == 1
        assert not ooo["adaptive"]["prefill_reused"]  # its wave computes beside its prefill
        assert len({r["token_digest"] for r in mine}) == 1
        for r in mine:  # the charged prefill is inside the row's end-to-end time
            assert r["wall_s"] >= r["prefill_s"] + r["decode_s"] - 1e-6
            assert {"cpu_s", "machine_cpu_s", "load_start", "steal_s"} <= set(r["measured"])
            assert r["machine"]["cpu"] and r["machine"]["dtype"] == "float64"
    manifest = json.loads((root / "results" / "once" / "manifest.json").read_text())
    assert manifest["sidecar"]["model"].endswith("tiny-qwen2") and "git_commit" in manifest


def test_oracle_follows_ar_and_each_schedule_has_its_own_sidecar(setup):
    from pipeline.eval.runner import Runner
    from pipeline.runtime import Target

    root = setup
    target = Target.load(root / "tiny-qwen2", dtype="float64")
    runner = Runner(target, ["ar", "toolspec", "ooo", "ooo-oracle"], schedules=["adaptive", "split"],
                    sidecar={"wave": lambda req: None})
    try:
        assert set(runner.sidecars) == {"adaptive", "split"}
        assert runner.sidecar_for("adaptive") is not runner.sidecar_for("split")
        orders = [runner.order(f"r{i}") for i in range(20)]
        for order in orders:
            assert order.index(("ar", "all-cores")) < order.index(("ooo-oracle", "all-cores"))
        assert len({tuple(o) for o in orders}) > 1  # still shuffled
    finally:
        runner.close()


def test_eval_bad_method_and_missing_requests(setup, tmp_path):
    root = setup
    with pytest.raises(SystemExit):
        eval_stage.main(["--recipe", str(recipe(root, ["ar", "magic"], run="bad"))])
    r = recipe(root, ["ar"], run="missing")
    r.write_text(r.read_text().replace('"fixture": 2', '"nope": 2'))
    with pytest.raises(SystemExit):
        eval_stage.main(["--recipe", str(r)])


def test_a_missing_sidecar_adapter_stops_the_run_before_any_row(setup, capsys):
    root = setup
    path = recipe(root, ["ar", "ooo"], run="no-adapter")
    text = json.loads(path.read_text())
    text["eval"]["sidecar"]["adapter"] = str(root / "no-such-adapter")
    path.write_text(json.dumps(text))
    with pytest.raises(SystemExit):
        eval_stage.main(["--recipe", str(path)])
    err = capsys.readouterr().err
    assert err.count("no-such-adapter/adapter_config.json not found") == 1 and "make train" in err
    assert not (root / "results" / "no-adapter" / "rows.jsonl").exists()


def test_each_target_is_released_before_the_next_loads(setup, monkeypatch):
    """Weak references to the first target, its model, runner, peers and prefix cache are dead when the second
    target loads (14B then 32B on one GPU must not hold both)."""
    import weakref

    from pipeline.runtime import Target

    root, refs, alive_at_load = setup, [], []
    plain_load, plain_runner, plain_peers = Target.load.__func__, eval_stage.Runner, eval_stage.HFPeers

    def load(cls, *a, **kw):
        alive_at_load.append([name for name, r in refs if r() is not None])
        t = plain_load(cls, *a, **kw)
        refs.extend([("target", weakref.ref(t)), ("model", weakref.ref(t.model)),
                     ("prefix_cache", weakref.ref(t.prefix_cache))])
        return t

    def runner(*a, **kw):
        r = plain_runner(*a, **kw)
        refs.append(("runner", weakref.ref(r)))
        return r

    def peers(*a, **kw):
        p = plain_peers(*a, **kw)
        refs.append(("peers", weakref.ref(p)))
        return p

    monkeypatch.setattr(Target, "load", classmethod(load))
    monkeypatch.setattr(eval_stage, "Runner", runner)
    monkeypatch.setattr(eval_stage, "HFPeers", peers)
    path = recipe(root, ["ar", "pld", "hf-pld"], run="release")
    text = json.loads(path.read_text())
    text["eval"]["targets"].append({"name": "tiny2", "path": str(root / "tiny-llama"), "dtype": "float64"})
    text["eval"]["benchmarks"] = {"fixture": 1}
    path.write_text(json.dumps(text))
    eval_stage.main(["--recipe", str(path)])
    assert len(alive_at_load) == 2 and alive_at_load[0] == []
    assert {name for name, _ in refs} == {"target", "model", "prefix_cache", "runner", "peers"}
    assert alive_at_load[1] == [], f"still referenced when the next target loaded: {alive_at_load[1]}"


def test_ooo_fails_the_run_when_its_sidecar_cannot_load(setup):
    """A sidecar whose model cannot load on its device stops the run with the device and the worker's error: never
    `ooo` rows measured without a hint."""
    from pipeline.runtime.sidecar_client import SidecarLoadError

    root = setup
    broken = root / "broken-sidecar"
    shutil.copytree(root / "tiny-qwen2", broken, dirs_exist_ok=True)
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    path = recipe(root, ["ar", "ooo"], run="broken-sidecar")
    text = json.loads(path.read_text())
    text["eval"]["sidecar"]["model"] = str(broken)
    text["eval"]["schedules"] = ["adaptive"]
    path.write_text(json.dumps(text))
    with pytest.raises(SidecarLoadError, match=r"could not load on device cpu: .*no-such-architecture"):
        eval_stage.main(["--recipe", str(path)])
    rows = root / "results" / "broken-sidecar" / "rows.jsonl"
    assert not rows.exists() or not [r for r in read_jsonl(rows) if r["method"] == "ooo"]


def test_git_commit_is_dirty_only_outside_the_runs_own_folder(tmp_path, monkeypatch):
    import subprocess

    from pipeline.stages.eval import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    run = tmp_path / "eval" / "results" / "r"
    run.mkdir(parents=True)
    (run / "rows.jsonl").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "init")
    monkeypatch.chdir(tmp_path)
    head = git_commit(Path("eval/results/r"))
    assert head and not head.endswith("+dirty")
    (run / "rows.jsonl").rename(run / "rows.jsonl.partial")  # what a running eval does to its committed rows
    assert git_commit(Path("eval/results/r")) == head
    assert git_commit() == head + "+dirty"
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(Path("eval/results/r")) == head + "+dirty"
