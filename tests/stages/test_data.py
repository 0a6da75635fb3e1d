"""The data stage's own rules on fake sources: splits, gold validation, contamination filter, errors, atomicity."""

import json
import types
from dataclasses import replace

import pytest

from pipeline.io import InputError
from pipeline.sources import SourceResult
from pipeline.stages import data as data_stage


def tool(name, props, required=()):
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": list(required)}}}


def request(rid, bench, subset, tools, gold):
    return {"id": rid, "benchmark": bench, "subset": subset, "messages": [{"role": "user", "content": rid}],
            "tools": tools, "gold": gold}


WEATHER = tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"])
SEARCH = tool("Search", {"q": {"type": "string"}})
OTHER = tool("translate", {"text": {"type": "string"}, "lang": {"type": "string", "enum": ["en", "fr"]}})


def fake_sources(monkeypatch, tmp_path, results: dict):
    for name in results:
        (tmp_path / "raw" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "raw" / name / "x.json").write_text("{}")

    def load_source(name):
        return types.SimpleNamespace(BENCHMARK=name, load=lambda root, n=name: results[n]())

    monkeypatch.setattr(data_stage, "load_source", load_source)
    return data_stage.Config(raw_root=str(tmp_path / "raw"), out=str(tmp_path / "out"), sources=list(results),
                             eval_subsets={"evalb": ["test_a"]})


def test_hash_split_is_deterministic_and_proportional():
    ids = [f"bench/x/{i}" for i in range(4000)]
    splits = [data_stage.hash_split(i, 0.1) for i in ids]
    assert splits == [data_stage.hash_split(i, 0.1) for i in ids]
    assert 300 < splits.count("dev") < 500


def test_gold_reasons():
    ok = request("a", "b", "s", [WEATHER], [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}])
    assert data_stage.gold_error_reasons(ok) == []
    bad_type = request("a", "b", "s", [WEATHER], [{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}])
    assert data_stage.gold_error_reasons(bad_type) == ["schema_type"]
    missing = request("a", "b", "s", [WEATHER], [{"name": "get_weather", "arguments": {"days": 3}}])
    assert data_stage.gold_error_reasons(missing) == ["schema_required"]
    unknown = request("a", "b", "s", [WEATHER], [{"name": "nope", "arguments": {}}])
    assert data_stage.gold_error_reasons(unknown) == ["unknown_tool"]
    enum = request("a", "b", "s", [OTHER], [{"name": "translate", "arguments": {"text": "hi", "lang": "de"}}])
    assert data_stage.gold_error_reasons(enum) == ["schema_enum"]


def test_run_splits_filters_and_reports(monkeypatch, tmp_path):
    def evalb():
        return SourceResult(requests=[
            request("evalb/test_a/0", "evalb", "test_a", [WEATHER], [{"name": "get_weather", "arguments": {"city": "X"}}]),
            request("evalb/train_b/0", "evalb", "train_b", [OTHER],
                    [{"name": "translate", "arguments": {"text": "hi", "lang": "de"}}]),  # invalid gold: kept, counted
        ])

    def trainb():
        res = SourceResult(requests=[request(f"trainb/s/{i}", "trainb", "s", [OTHER, SEARCH],
                                             [{"name": "Search", "arguments": {"q": str(i)}}]) for i in range(30)])
        # offers a tool named like an evaluation tool (case-insensitive): must be removed
        res.requests.append(request("trainb/s/leak", "trainb", "s", [tool("GET_WEATHER", {})],
                                    [{"name": "GET_WEATHER", "arguments": {}}]))
        res.reject("f.json", "7", "not_json", "bad line")
        return res

    cfg = fake_sources(monkeypatch, tmp_path, {"evalb": evalb, "trainb": trainb})
    stats = data_stage.run(cfg)
    out = tmp_path / "out"
    test_rows = [json.loads(x) for x in (out / "evalb" / "test.jsonl").read_text().splitlines()]
    assert [r["id"] for r in test_rows] == ["evalb/test_a/0"] and test_rows[0]["split"] == "test"
    train = [json.loads(x) for x in (out / "trainb" / "train.jsonl").read_text().splitlines()]
    dev_path = out / "trainb" / "dev.jsonl"
    dev = [json.loads(x) for x in dev_path.read_text().splitlines()] if dev_path.exists() else []
    ids = {r["id"] for r in train + dev}
    assert "trainb/s/leak" not in ids and len(ids) == 30
    removed = sum(s.get("removed_by_contamination", 0) for s in stats["benchmarks"]["trainb"].values())
    assert removed == 1
    assert sum(n["gold_names_eval_tool"] for n in stats["removed_by_contamination"]["trainb"].values()) == 1
    assert stats["contamination_examples"]["trainb"][0].startswith("trainb/s/leak (gold_names_eval_tool)")
    evalb_train = stats["benchmarks"]["evalb"]
    invalid = sum(s["requests_with_invalid_gold"] for s in evalb_train.values())
    assert invalid == 1
    assert stats["rejects"]["trainb"] == {"not_json": 1}
    assert (out / "trainb" / "rejected.jsonl").exists()
    assert "| benchmark" in stats["table"] and "removed: gold_names_eval_tool" in stats["table"]
    assert stats["no_training_data"] == {}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "data" and manifest["inputs"]
    # a second run with the same inputs is a no-op
    assert data_stage.run(cfg)["table"] == stats["table"]


def test_bad_schema_names_record_and_leaves_no_output(monkeypatch, tmp_path):
    bad = tool("broken", {"x": {"type": "strnig"}})

    def src():
        return SourceResult(requests=[request("s/0", "s", "a", [bad], [])])

    cfg = fake_sources(monkeypatch, tmp_path, {"s": src})
    with pytest.raises(InputError, match=r"record s/0.*broken"):
        data_stage.run(cfg)
    assert not (tmp_path / "out" / "stats.json").exists()


def test_duplicate_ids_rejected(monkeypatch, tmp_path):
    def src():
        r = request("s/0", "s", "a", [SEARCH], [])
        return SourceResult(requests=[r, dict(r)])

    cfg = fake_sources(monkeypatch, tmp_path, {"s": src})
    with pytest.raises(InputError, match="duplicate request ids"):
        data_stage.run(cfg)


def test_missing_raw_root_without_fetch(tmp_path):
    cfg = data_stage.Config(raw_root=str(tmp_path / "nope"), fetch=False)
    with pytest.raises(InputError, match="raw benchmark folder not found"):
        data_stage.run(cfg)


def test_unknown_recipe_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  dev_fractoin: 0.2\n")
    with pytest.raises(InputError, match="dev_fractoin"):
        data_stage.resolve(recipe)
    with pytest.raises(SystemExit, match="2"):
        data_stage.main(["--recipe", str(recipe)])  # the command line: `error: ...`, exit status 2


def _mixed_sources():
    def evalb():
        return SourceResult(requests=[request("evalb/test_a/0", "evalb", "test_a", [WEATHER, SEARCH],
                                              [{"name": "get_weather", "arguments": {"city": "X"}}])])

    def trainb():
        # 20 requests call Search (an evaluation tool), 20 only offer it and call translate, 20 are clean
        reqs = [request(f"trainb/s/{i}", "trainb", "s", [SEARCH, OTHER], [{"name": "Search", "arguments": {"q": "x"}}])
                for i in range(20)]
        reqs += [request(f"trainb/s/{i}", "trainb", "s", [SEARCH, OTHER],
                         [{"name": "translate", "arguments": {"text": "x", "lang": "en"}}]) for i in range(20, 40)]
        reqs += [request(f"trainb/s/{i}", "trainb", "s", [OTHER],
                         [{"name": "translate", "arguments": {"text": "x", "lang": "en"}}]) for i in range(40, 60)]
        return SourceResult(requests=reqs)

    return {"evalb": evalb, "trainb": trainb}


def _train_dev_ids(out):
    return {json.loads(x)["id"] for split in ("train", "dev") if (out / "trainb" / f"{split}.jsonl").exists()
            for x in (out / "trainb" / f"{split}.jsonl").read_text().splitlines()}


def _removed(stats, bench, rule):
    return sum(by_rule.get(rule, 0) for by_rule in stats["removed_by_contamination"][bench].values())


def test_contamination_rules_counted_one_by_one(monkeypatch, tmp_path):
    cfg = fake_sources(monkeypatch, tmp_path, _mixed_sources())
    # the paper's rule (default): only a gold call naming an evaluation tool removes the request
    stats = data_stage.run(cfg)
    assert _removed(stats, "trainb", "gold_names_eval_tool") == 20
    assert _train_dev_ids(tmp_path / "out") == {f"trainb/s/{i}" for i in range(20, 60)}
    per_split = sum(s["removed_by_rule"]["gold_names_eval_tool"] for s in stats["benchmarks"]["trainb"].values())
    assert per_split == 20 and stats["contamination_rules"] == ["gold_names_eval_tool"]
    # both rules: the second counts only what the first left
    stats = data_stage.run(replace(cfg, contamination_rules=["gold_names_eval_tool", "offers_eval_tool"], force=True))
    assert _removed(stats, "trainb", "gold_names_eval_tool") == 20 and _removed(stats, "trainb", "offers_eval_tool") == 20
    assert _train_dev_ids(tmp_path / "out") == {f"trainb/s/{i}" for i in range(40, 60)}
    assert "removed: offers_eval_tool" in stats["table"]
    # the filter off: nothing removed, no rule columns
    stats = data_stage.run(replace(cfg, contamination_filter=False, force=True))
    assert stats["contamination_rules"] == [] and len(_train_dev_ids(tmp_path / "out")) == 60
    assert "removed:" not in stats["table"]


def test_unknown_contamination_rule(monkeypatch, tmp_path):
    cfg = fake_sources(monkeypatch, tmp_path, _mixed_sources())
    with pytest.raises(InputError, match=r"contamination_rules: unknown rule\(s\) \['gold_only'\]"):
        data_stage.run(replace(cfg, contamination_rules=["gold_only"]))


def test_benchmark_without_training_data_is_reported(monkeypatch, tmp_path):
    sources = _mixed_sources()
    cfg = fake_sources(monkeypatch, tmp_path, sources)
    why = {"evalb": "evalb ships evaluation sets only"}
    monkeypatch.setattr(data_stage, "load_source", lambda name: types.SimpleNamespace(
        BENCHMARK=name, load=lambda root: sources[name](), **({"NO_TRAINING_DATA": why[name]} if name in why else {})))
    stats = data_stage.run(cfg)
    assert stats["no_training_data"] == {"evalb": "evalb ships evaluation sets only"}
    saved = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert saved["no_training_data"] == stats["no_training_data"]
    # a source that says nothing still gets a generic note
    monkeypatch.setattr(data_stage, "load_source", lambda name: types.SimpleNamespace(
        BENCHMARK=name, load=lambda root: sources[name]()))
    stats = data_stage.run(replace(cfg, force=True))
    assert stats["no_training_data"] == {"evalb": "the source yields no train/dev requests"}


def test_toolalpaca_says_it_has_no_training_data():
    from pipeline.sources import toolalpaca

    assert "train_data.json" in toolalpaca.NO_TRAINING_DATA
