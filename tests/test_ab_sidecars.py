"""scripts/ab_sidecars.py: the run order, the rows a later run starts from, the table's sums, and the eval commands
it runs (with the eval itself replaced: the real one needs the target model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import ab_sidecars  # noqa: E402

from pipeline.io import InputError, read_jsonl  # noqa: E402


def row(request: str, variant: str, wall: float, digest: str = "d", **extra) -> dict:
    return {"key": f"t|b|{request}|{variant}", "request_id": request, "variant": variant, "wall_s": wall,
            "prefill_s": wall / 2, "decode_s": wall / 2, "forwards": 10, "token_digest": digest,
            "measured": {"wall_s": wall, "cpu_s": 2 * wall, "machine_cpu_s": 2 * wall}, **extra}


def write_run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def adapter(folder: Path, base: str) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    return str(folder)


def test_rounds_alternate_the_order():
    assert ab_sidecars.schedule(["a", "b"], 3) == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]


def test_the_table_counts_common_requests_hint_share_outputs_and_busy_rows(tmp_path):
    first = write_run(tmp_path / "one", [
        row("r1", "ar", 10, "x"), row("r2", "ar", 10, "y"), row("r1", "toolspec", 6, "x"),
        row("r2", "toolspec", 6, "y"),
        row("r1", "ooo@adaptive", 4, "x", sidecar_cpu_s=1.0, draft_tokens=10, hint_tokens_accepted=4),
        row("r2", "ooo@adaptive", 4, "other", sidecar_cpu_s=1.0, draft_tokens=10, hint_tokens_accepted=1)])
    busy = row("r1", "ooo@adaptive", 8, "x", sidecar_cpu_s=2.0, draft_tokens=10, hint_tokens_accepted=5)
    busy["measured"]["machine_cpu_s"] += 8  # another process used a core beside it
    second = write_run(tmp_path / "two", [r for r in read_jsonl(first / "rows.jsonl") if r["variant"] != "ooo@adaptive"]
                       + [busy])  # r2 unfinished: left out of both runs
    runs = {d.name: ab_sidecars.load_rows(d) for d in (first, second)}
    lines, common = ab_sidecars.run_table(runs)
    assert common == 1
    by = {(x["run"], x["variant"]): x for x in lines}
    assert set(by) == {("one", "ar"), ("one", "toolspec"), ("one", "ooo@adaptive"), ("two", "ooo@adaptive")}
    assert by[("one", "ooo@adaptive")]["hint_share"] == 0.4 and by[("two", "ooo@adaptive")]["hint_share"] == 0.5
    assert by[("one", "ooo@adaptive")]["busy"] == 0 and by[("two", "ooo@adaptive")]["busy"] == 1
    assert by[("two", "ooo@adaptive")]["wave_cpu_s"] == 2.0 and by[("one", "toolspec")]["wave_cpu_s"] is None
    text = ab_sidecars.markdown(lines, common)
    assert "over one's: two 2.000" in text and "one 1.500x, two 0.750x" in text  # ooo over the first; toolspec / ooo
    assert by[("one", "ooo@adaptive")]["same_as_ar"] == 1  # r2 (another output than ar's) is not common


def test_a_later_run_starts_from_the_first_runs_rows_without_a_sidecar(tmp_path):
    first = write_run(tmp_path / "one", [row("r1", "ar", 10), row("r1", "toolspec", 6), row("r1", "ooo@adaptive", 4)])
    assert ab_sidecars.seed_rows(first, tmp_path / "two") == 2
    assert [r["variant"] for r in read_jsonl(tmp_path / "two" / "rows.jsonl")] == ["ar", "toolspec"]
    assert ab_sidecars.seed_rows(first, first) == 0  # a run with rows resumes as it is


def test_bad_sidecar_arguments_are_clear_errors(tmp_path):
    a = adapter(tmp_path / "a", "base/a")
    with pytest.raises(InputError, match="LABEL=ADAPTER_FOLDER"):
        ab_sidecars.parse_sidecars([a])
    with pytest.raises(InputError, match="at least two"):
        ab_sidecars.parse_sidecars([f"x={a}"])
    with pytest.raises(InputError, match="given twice"):
        ab_sidecars.parse_sidecars([f"x={a}", f"x={a}"])
    with pytest.raises(InputError, match="adapter_config.json"):
        ab_sidecars.parse_sidecars([f"x={a}", f"y={tmp_path / 'nothing'}"])
    with pytest.raises(InputError, match="not an eval.key=value"):
        ab_sidecars.parse_sidecars([f"x={a},slot_tools=1", f"y={a}"])
    assert ab_sidecars.parse_sidecars([f"x={a},eval.sidecar.slot_tools=1", f"y={a}"]) == {
        "x": (Path(a), ["eval.sidecar.slot_tools=1"]), "y": (Path(a), [])}
    assert ab_sidecars.main(["--sidecar", f"x={a}"]) == 2  # no --name


def test_runs_each_sidecar_per_round_and_prints_the_table(tmp_path, monkeypatch, capsys):
    a, b = adapter(tmp_path / "a", "base/small"), adapter(tmp_path / "b", "base/big")
    results = tmp_path / "results"
    monkeypatch.setattr(ab_sidecars, "RESULTS", results)
    commands = []

    def fake_eval(cmd, check):  # what the eval would write: the first run measures every method
        commands.append(cmd)
        run = next(c for c in cmd if c.startswith("eval.run=")).split("=", 1)[1]
        rows = ab_sidecars.load_rows(results / run) or [row("r1", "ar", 10), row("r1", "toolspec", 6)]
        wall = 4 if "eval.sidecar.model=base/small" in cmd else 5
        write_run(results / run, rows + [row("r1", "ooo@adaptive", wall, sidecar_cpu_s=1.0, draft_tokens=4)])

    monkeypatch.setattr(ab_sidecars.subprocess, "run", fake_eval)
    big = f"big={b},eval.sidecar.slot_tools=1"
    assert ab_sidecars.main(["--name", "t", "--sidecar", f"small={a}", "--sidecar", big, "eval.split=test"]) == 0
    runs = [next(c for c in cmd if c.startswith("eval.run=")) for cmd in commands]
    assert runs == ["eval.run=sidecar-t-small", "eval.run=sidecar-t-big", "eval.run=sidecar-t-big-r2",
                    "eval.run=sidecar-t-small-r2"]
    for cmd, run in zip(commands, runs):
        assert "eval.split=test" in cmd and f"eval.sidecar.adapter={a if 'small' in run else b}" in cmd
        assert ("eval.sidecar.slot_tools=1" in cmd) == ("big" in run)  # a sidecar's own override, its runs only
    out = capsys.readouterr().out
    assert "2 rows without a sidecar copied from" in out and "sidecar-t-big 1.250" in out
    assert "| sidecar-t-small-r2 | ooo@adaptive | 1 | 4.0 |" in out


def test_copy_from_seeds_every_run_and_says_when_its_rows_were_measured(tmp_path, monkeypatch, capsys):
    a, b = adapter(tmp_path / "a", "base/small"), adapter(tmp_path / "b", "base/big")
    earlier = write_run(tmp_path / "earlier", [row("r1", "ar", 10), row("r1", "toolspec", 6)])
    (earlier / "manifest.json").write_text(json.dumps({"created": "2026-12-06T05:45:51Z"}))
    results = tmp_path / "results"
    monkeypatch.setattr(ab_sidecars, "RESULTS", results)

    def fake_eval(cmd, check):
        run = next(c for c in cmd if c.startswith("eval.run=")).split("=", 1)[1]
        assert [r["variant"] for r in ab_sidecars.load_rows(results / run)] == ["ar", "toolspec"]  # seeded first
        write_run(results / run, ab_sidecars.load_rows(results / run) + [row("r1", "ooo@adaptive", 4)])

    monkeypatch.setattr(ab_sidecars.subprocess, "run", fake_eval)
    args = ["--name", "t", "--rounds", "1", "--sidecar", f"small={a}", "--sidecar", f"big={b}", "--copy-from",
            str(earlier)]
    assert ab_sidecars.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("2 rows without a sidecar copied from") == 2
    assert "measured by" in out and "(created 2026-12-06T05:45:51Z), not in this window" in out
