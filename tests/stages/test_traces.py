"""The traces stage: gold and transformers backends on tiny local models, resume, failures, config errors, vLLM."""

import importlib.util
import json
from pathlib import Path

import pytest

from pipeline.io import InputError, read_json, read_jsonl
from pipeline.stages import traces
from pipeline.testing import make_tiny_model_dir, make_tokenizer

FIXTURE_REQUESTS = Path(__file__).parents[1] / "fixtures" / "requests.jsonl"
ROW_KEYS = {"id", "teacher", "backend", "text", "prompt_tokens", "completion_tokens", "finish_reason", "latency_s",
            "error"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


def make_data(root: Path, requests: list[dict] | None = None, split: str = "train") -> Path:
    reqs = requests if requests is not None else read_jsonl(FIXTURE_REQUESTS)
    path = root / "requests" / "fixture" / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return root


def recipe(tmp_path: Path, model, backend="gold", **traces_kw) -> Path:
    import yaml

    path = tmp_path / "teacher.yaml"
    path.write_text(yaml.safe_dump({"teacher": "t", "data_dir": str(tmp_path), "splits": ["train"],
                                    "traces": {"backend": backend, "model": str(model), **traces_kw}}))
    return path


def out_rows(tmp_path: Path, split="train") -> list[dict]:
    return read_jsonl(tmp_path / "traces" / "t" / f"{split}.jsonl")


def test_gold_backend_renders_the_templates_assistant_turn(tmp_path, tokenizer_dir):
    make_data(tmp_path)
    report = traces.main(["--recipe", str(recipe(tmp_path, tokenizer_dir))])
    rows = {r["id"]: r for r in out_rows(tmp_path)}
    assert report["train"]["written"] == 4 and report["train"]["errors"] == 0
    assert set(rows) == {f"fixture/{i}" for i in range(4)} and all(set(r) == ROW_KEYS for r in rows.values())
    assert rows["fixture/3"]["text"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
    assert all(r["backend"] == "gold" and r["finish_reason"] == "gold" and r["prompt_tokens"] > 100
               for r in rows.values())
    manifest = read_json(tmp_path / "traces" / "t" / "manifest.json")
    assert manifest["gold"] is True and manifest["stage"] == "traces"
    assert list(manifest["inputs"]) == [str(tmp_path / "requests" / "fixture" / "train.jsonl")]
    assert manifest["config"]["resolved"]["backend"] == "gold"


def test_transformers_backend_tiny_model_end_to_end(tmp_path, tiny_dir):
    make_data(tmp_path, read_jsonl(FIXTURE_REQUESTS)[:3])
    path = recipe(tmp_path, tiny_dir, backend="transformers", batch_size=2, max_new_tokens=5, dtype="float32",
                  threads=1)
    report = traces.main(["--recipe", str(path)])
    rows = out_rows(tmp_path)
    assert sorted(r["id"] for r in rows) == ["fixture/0", "fixture/1", "fixture/2"]
    assert all(r["error"] is None and r["backend"] == "transformers" for r in rows)
    # random weights never emit end-of-turn: each answer runs to max_new_tokens
    assert all(r["completion_tokens"] == 5 and r["finish_reason"] == "length" for r in rows)
    assert report["train"]["completion_tokens"] == 15 and report["train"]["completion_tokens_per_s"] > 0
    # longest prompts first, so the two longest share the first batch (same latency)
    by_len = sorted(rows, key=lambda r: -r["prompt_tokens"])
    assert by_len[0]["latency_s"] == by_len[1]["latency_s"]


def test_batched_left_padded_generation_equals_one_by_one(tmp_path, tiny_dir):
    reqs = read_jsonl(FIXTURE_REQUESTS)[:2]
    cfg = traces.Config(teacher="t", model=str(tiny_dir), backend="transformers", max_new_tokens=6,
                              dtype="float32", threads=1)
    backend = traces.load_backend(cfg)
    prepared = [(r, backend.prepare(r)) for r in reqs]
    batched = backend.run(prepared)
    alone = [backend.run([p])[0] for p in prepared]
    assert [r["text"] for r in batched] == [r["text"] for r in alone]


def test_resume_after_interrupted_run_no_duplicates_nothing_lost(tmp_path, tokenizer_dir, monkeypatch):
    make_data(tmp_path)
    path = recipe(tmp_path, tokenizer_dir, batch_size=1)
    calls = {"n": 0}
    real_run = traces.GoldBackend.run

    def dying_run(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed mid-run
        return real_run(self, batch)

    monkeypatch.setattr(traces.GoldBackend, "run", dying_run)
    with pytest.raises(KeyboardInterrupt):
        traces.main(["--recipe", str(path)])
    # a stopped run leaves what it wrote where the stage writes it (committable), and a manifest that says so
    out = tmp_path / "traces" / "t"
    assert len(read_jsonl(out / "train.jsonl")) == 2 and not (out / "train.jsonl.partial").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["progress"]["train"]["done"] == 2
    assert set(manifest["files"]) == {"train.jsonl", "dev.jsonl"} & {p.name for p in out.iterdir()}
    partial = out / "train.jsonl.partial"  # what a hard kill (SIGKILL) leaves: the partial file, a torn last line
    (out / "train.jsonl").rename(partial)
    with open(partial, "a") as f:
        f.write('{"id": "fixture/9", "text": "torn')  # a line cut by the kill
    monkeypatch.setattr(traces.GoldBackend, "run", real_run)
    report = traces.main(["--recipe", str(path)])
    assert report["train"]["already_done"] == 2 and report["train"]["written"] == 2
    ids = [r["id"] for r in out_rows(tmp_path)]
    assert sorted(ids) == [f"fixture/{i}" for i in range(4)]
    # a finished run is reopened, not redone
    assert traces.main(["--recipe", str(path)])["train"]["written"] == 0
    assert len(out_rows(tmp_path)) == 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and len(manifest["runs"]) == 3


def test_a_crash_loses_at_most_one_vllm_chunk_and_the_rerun_completes(tmp_path, tokenizer_dir, monkeypatch):
    """The vllm path submits `vllm_chunk` prompts per generate and writes their rows before the next chunk: killed in
    the second chunk, the first chunk's rows are on disk; the rerun writes only the rest."""
    make_data(tmp_path)

    class ChunkedGold(traces.GoldBackend):  # the vllm batching rule (make_batches) over the gold backend's rows
        chunks: list[int] = []

        def run(self, batch):
            self.chunks.append(len(batch))
            if len(self.chunks) == 2 and self.die:
                raise KeyboardInterrupt  # killed mid-chunk
            return super().run(batch)

    monkeypatch.setattr(traces, "VllmBackend", ChunkedGold)
    ChunkedGold.die = True
    path = recipe(tmp_path, tokenizer_dir, backend="vllm", vllm_chunk=3)
    with pytest.raises(KeyboardInterrupt):
        traces.main(["--recipe", str(path)])
    assert ChunkedGold.chunks == [3, 1] and len(out_rows(tmp_path)) == 3
    ChunkedGold.die, ChunkedGold.chunks = False, []
    report = traces.main(["--recipe", str(path)])
    assert report["train"]["already_done"] == 3 and report["train"]["written"] == 1 and ChunkedGold.chunks == [1]
    assert sorted(r["id"] for r in out_rows(tmp_path)) == [f"fixture/{i}" for i in range(4)]


def test_failing_requests_are_recorded_and_the_stage_goes_on(tmp_path, tokenizer_dir):
    reqs = read_jsonl(FIXTURE_REQUESTS)
    reqs[1]["gold"] = []                                              # gold backend cannot render it: fails at run
    reqs[2]["messages"] = reqs[2]["messages"] * 40                    # prompt longer than max_model_len: fails early
    make_data(tmp_path, reqs)
    report = traces.main(["--recipe", str(recipe(tmp_path, tokenizer_dir, batch_size=4, max_model_len=1000))])
    rows = {r["id"]: r for r in out_rows(tmp_path)}
    assert report["train"]["written"] == 4 and report["train"]["errors"] == 2
    assert rows["fixture/1"]["error"] == "ValueError: request has no gold call"
    assert "exceeds max_model_len 1000" in rows["fixture/2"]["error"] and rows["fixture/2"]["finish_reason"] == "error"
    assert rows["fixture/0"]["error"] is None and rows["fixture/3"]["error"] is None
    # a rerun tries the failed request again (once, no duplicate row); a refused prompt stays refused
    again = traces.main(["--recipe", str(recipe(tmp_path, tokenizer_dir, batch_size=4, max_model_len=1000))])
    assert again["train"]["already_done"] == 3 and again["train"]["written"] == 1
    assert sorted(r["id"] for r in out_rows(tmp_path)) == [f"fixture/{i}" for i in range(4)]


def test_template_that_ignores_tools_is_an_error_per_request(tmp_path):
    tok = make_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(tmp_path / "plain")
    make_data(tmp_path, read_jsonl(FIXTURE_REQUESTS)[:2])
    report = traces.main(["--recipe", str(recipe(tmp_path, tmp_path / "plain"))])
    assert report["train"]["errors"] == 2
    assert all("ignores tools=" in r["error"] for r in out_rows(tmp_path))


def test_batches_respect_size_token_cap_and_sort_windows(tmp_path, tokenizer_dir, monkeypatch):
    cfg = traces.Config(teacher="t", model="m", batch_size=3, max_batch_tokens=100)
    items = [({"id": str(n)}, [0] * n) for n in (60, 40, 30, 20, 20, 20, 10)]
    sizes = [[len(ids) for _, ids in b] for b in traces.make_batches(items, cfg)]
    assert sizes == [[60], [40, 30], [20, 20, 20], [10]]  # 60+40 pads to 120 > 100; 40x3 = 120 too; 3 at most
    cfg.backend = "vllm"
    assert len(traces.make_batches(items, cfg)) == 1       # vllm: up to a chunk (256 by default) in one generate call
    assert [len(b) for b in traces.make_batches(items * 100, cfg)] == [256, 256, 188]
    cfg.vllm_chunk = 0
    assert len(traces.make_batches(items * 100, cfg)) == 1  # 0: the whole split at once

    # sort windows: each window of the sampled order is run (sorted by length) before the next one starts
    reqs = read_jsonl(FIXTURE_REQUESTS)
    make_data(tmp_path, reqs)
    order = []
    real_run = traces.GoldBackend.run
    monkeypatch.setattr(traces.GoldBackend, "run", lambda self, b: order.append([r["id"] for r, _ in b]) or
                        real_run(self, b))
    traces.main(["--recipe", str(recipe(tmp_path, tokenizer_dir, batch_size=1, sort_window=2))])
    # the split is read in a seeded shuffle (limit=None too), so a stopped run is a fair sample
    files = traces.request_files(tmp_path, "all", "train")
    sampled = [r["id"] for r in traces.split_requests(files, None, seed=0)]
    assert sampled != sorted(sampled)
    assert sorted(order[0] + order[1]) == sorted(sampled[:2])
    assert sorted(order[2] + order[3]) == sorted(sampled[2:])
    lengths = {r["id"]: len(json.dumps(r)) for r in reqs}
    assert lengths[order[0][0]] >= lengths[order[1][0]]               # the longer prompt of the window first


def test_limit_is_a_seeded_sample_that_grows_by_extension(tmp_path):
    reqs = [dict(read_jsonl(FIXTURE_REQUESTS)[0], id=f"r/{i}") for i in range(30)]
    make_data(tmp_path, reqs)
    files = traces.request_files(tmp_path, "all", "train")
    small = [r["id"] for r in traces.split_requests(files, limit=5, seed=0)]
    large = [r["id"] for r in traces.split_requests(files, limit=12, seed=0)]
    assert large[:5] == small and small != [f"r/{i}" for i in range(5)]


def test_bad_inputs_name_file_line_and_expectation(tmp_path, tokenizer_dir):
    reqs = read_jsonl(FIXTURE_REQUESTS)
    make_data(tmp_path, reqs + [reqs[0]])
    with pytest.raises(InputError, match=r"train.jsonl:5 \(record fixture/0\): duplicate id"):
        traces.run(traces.resolve(str(recipe(tmp_path, tokenizer_dir))))
    with pytest.raises(InputError, match="unknown key.*batchsize.*expected one of"):
        traces.run(traces.resolve(str(recipe(tmp_path, tokenizer_dir)), ["traces.batchsize=2"]))
    with pytest.raises(InputError, match="no request files for split 'dev'"):
        traces.run(traces.resolve(str(recipe(tmp_path, tokenizer_dir)), ["splits=[dev]"]))
    make_data(tmp_path)
    with pytest.raises(InputError, match=r"traces.model='.*no-such-model': no such model folder"):
        traces.run(traces.resolve(str(recipe(tmp_path, tmp_path / "no-such-model"))))


def test_vllm_batches_whole_chunks_whatever_the_sort_window(tmp_path, tokenizer_dir, monkeypatch):
    """sort_window sorts prompts for the transformers backend's padding; it must not cap vLLM's batch."""
    make_data(tmp_path)
    sizes = []

    class Recording(traces.GoldBackend):
        def run(self, batch):
            sizes.append(len(batch))
            return super().run(batch)

    monkeypatch.setattr(traces, "VllmBackend", Recording)
    traces.main(["--recipe", str(recipe(tmp_path, tokenizer_dir, backend="vllm", vllm_chunk=3, sort_window=2))])
    assert sizes == [3, 1]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm is not importable in this environment (it lives in .venv-vllm: make vllm-setup)")
def test_vllm_backend_tiny_model(tmp_path):
    # vLLM's CPU attention kernels need head_dim >= 32: 128 hidden / 2 heads
    model = make_tiny_model_dir(tmp_path / "tiny-vllm", "qwen2", hidden=128, heads=2, kv_heads=1)
    make_data(tmp_path, read_jsonl(FIXTURE_REQUESTS)[:2])
    path = recipe(tmp_path, model, backend="vllm", max_new_tokens=4, dtype="float32", max_model_len=2048,
                  vllm_kwargs={"enforce_eager": True}, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    traces.main(["--recipe", str(path)])
    rows = out_rows(tmp_path)
    assert sorted(r["id"] for r in rows) == ["fixture/0", "fixture/1"]
    assert all(r["error"] is None and r["completion_tokens"] == 4 and r["backend"] == "vllm" for r in rows)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "recipes" / "teacher").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_teacher_recipe_resolves_and_says_how_to_run_it(path):
    from pipeline.stages import labels

    text = path.read_text()
    assert text.startswith("# Run as:"), f"{path} should open with the command that runs it"
    cfg = traces.resolve(path)
    labels.resolve(path)
    assert cfg.teacher and cfg.model and cfg.backend in traces.BACKENDS


def test_a_dead_engine_stops_the_stage_and_keeps_the_rows_before_it(tmp_path, tokenizer_dir, monkeypatch, capsys):
    """An engine that dies in the second chunk: exit status 2 with the engine's error, the first chunk's rows kept,
    no error rows for the requests it never ran, the manifest incomplete; the rerun writes only the rest."""
    make_data(tmp_path)

    class EngineDeadError(Exception):  # the name vLLM's engine raises (vllm.v1.engine.exceptions)
        pass

    class DyingGold(traces.GoldBackend):
        calls = 0

        def run(self, batch):
            DyingGold.calls += 1
            if DyingGold.calls == 2 and self.die:
                raise EngineDeadError("EngineCore encountered an issue. See stack trace for the root cause.")
            return super().run(batch)

    monkeypatch.setattr(traces, "VllmBackend", DyingGold)
    DyingGold.die = True
    path = recipe(tmp_path, tokenizer_dir, backend="vllm", vllm_chunk=3)
    with pytest.raises(SystemExit) as stop:
        traces.main(["--recipe", str(path)])
    assert stop.value.code == 2 and "died or hung (EngineDeadError: EngineCore" in capsys.readouterr().err
    rows = out_rows(tmp_path)
    assert len(rows) == 3 and all(r["error"] is None for r in rows)
    manifest = read_json(tmp_path / "traces" / "t" / "manifest.json")
    assert manifest["complete"] is False and manifest["progress"]["train"] == {"requested": 4, "done": 3}
    DyingGold.die = False
    assert traces.main(["--recipe", str(path)])["train"]["written"] == 1 and len(out_rows(tmp_path)) == 4


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm is not importable in this environment (it lives in .venv-vllm: make vllm-setup)")
def test_vllm_engine_killed_mid_run_stops_the_stage(tmp_path, capsys, monkeypatch):
    """The real engine on vLLM's CPU build, its core process killed after the first chunk: the stage exits 2 naming
    the engine's error, the first chunk's rows stay, and none of the later requests is written as an error row."""
    import os
    import signal

    import psutil

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the stage's own CPU settings, not the environment's
    model = make_tiny_model_dir(tmp_path / "tiny-vllm", "qwen2", hidden=128, heads=2, kv_heads=1)
    make_data(tmp_path, read_jsonl(FIXTURE_REQUESTS))
    path = recipe(tmp_path, model, backend="vllm", max_new_tokens=4, dtype="float32", max_model_len=2048,
                  vllm_chunk=2, vllm_kwargs={"enforce_eager": True})
    real_run = traces.VllmBackend.run

    def run_then_kill(self, batch):
        rows = real_run(self, batch)
        for child in psutil.Process().children(recursive=True):  # the engine core process(es)
            os.kill(child.pid, signal.SIGKILL)
        return rows

    traces.VllmBackend.run = run_then_kill
    try:
        with pytest.raises(SystemExit) as stop:
            traces.main(["--recipe", str(path)])
    finally:
        traces.VllmBackend.run = real_run
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "died or hung" in err, err[-2000:]
    assert "kv_cache_gib" in err and "threads_bind" in err  # the CPU settings are printed at start
    rows = out_rows(tmp_path)
    assert len(rows) == 2 and all(r["error"] is None and r["completion_tokens"] == 4 for r in rows)
    manifest = read_json(tmp_path / "traces" / "t" / "manifest.json")
    assert manifest["complete"] is False and manifest["engine_settings"]["platform"] == "cpu"
