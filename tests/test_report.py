"""The eval report is recomputed from rows: speedups, accepted lengths, identity with ar, accuracy, flags."""

import json

import pytest

from pipeline.report import bootstrap_ratio, render, summarize, to_markdown

GOLD = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
RIGHT = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
WRONG = '{"name": "get_weather", "arguments": {"city": "Rome"}}'


def row(method, rid, wall, decode, new, fwd, digest, text=RIGHT, **kw):
    return {"key": f"t|b|{rid}|{method}", "target": "t", "benchmark": "b", "request_id": rid, "method": method,
            "placement": "split", "text": text, "token_digest": digest, "new_tokens": new, "forwards": fwd,
            "accepted_lengths": [new // fwd] * fwd, "prefill_s": wall - decode, "decode_s": decode, "wall_s": wall,
            "gold": GOLD, "gold_accept": None, **kw}


ROWS = [
    row("ar", "r1", 10.0, 8.0, 40, 40, "a1", first_value_s=4.0),
    row("ar", "r2", 6.0, 5.0, 20, 20, "a2", text=WRONG, first_value_s=3.0),
    row("ooo", "r1", 4.0, 2.0, 40, 8, "a1", hint_ready_s=1.0, hint_tokens_accepted=20, payload_bytes=40),
    row("ooo", "r2", 2.0, 1.0, 20, 4, "a2", hint_ready_s=2.0, hint_tokens_accepted=10, payload_bytes=60),
    row("hf-pld", "r1", 8.0, 6.0, 40, 20, "a1"),
    row("hf-pld", "r2", 8.0, 7.0, 21, 20, "DIFFERENT"),
]


def test_summary_numbers_are_recomputed():
    s = summarize(ROWS, n_boot=200)
    cell = s["cells"][0]
    ooo = cell["methods"]["ooo"]
    assert ooo["speedup"] == pytest.approx(16 / 6, abs=1e-3)  # ratio of summed wall times, not a mean of ratios
    assert ooo["decode_speedup"] == pytest.approx(13 / 3, abs=1e-3)
    assert ooo["mean_accepted"] == pytest.approx(60 / 12, abs=1e-3)
    assert ooo["identical_to_ar"] == 1.0
    assert ooo["hint_ready_s_median"] == pytest.approx(1.5)
    assert ooo["first_value_s_median"] == pytest.approx(3.5)
    assert ooo["hint_accepted_share"] == pytest.approx(30 / 60, abs=1e-3)
    assert ooo["payload_bytes_mean"] == pytest.approx(50)
    lo, hi = ooo["e2e_all"]["ci"]
    assert lo <= ooo["speedup"] <= hi
    assert ooo["hint_outcomes"] == {"used": 1.0}
    assert cell["call_accuracy"] == 0.5 and cell["call_accuracy_n"] == 2
    assert s["mean_over_cells"]["ar"] == 1.0


def test_peer_that_differs_from_ar_is_flagged():
    s = summarize(ROWS, n_boot=50)
    pld = s["cells"][0]["methods"]["hf-pld"]
    assert pld["identical_to_ar"] == 0.5 and pld["differs_from_ar"] == [{"request_id": "r2", "first_token": None}]
    # over identical rows only, r2 (which differs) is left out: r1 alone
    assert pld["decode_identical"]["ratio"] == pytest.approx(8 / 6, abs=1e-3) and pld["decode_identical"]["n"] == 1
    md = to_markdown(s)
    assert "Outputs that differ from ar" in md and "hf-pld: 1 request(s): r2" in md


def test_upper_bound_kept_out_of_the_mean_and_hint_outcomes_counted():
    rows = ROWS + [
        row("ooo-oracle", "r1", 1.0, 0.5, 40, 2, "a1", variant="ooo-oracle", hint_ready_s=0.0, hint_tokens_accepted=38),
        row("ooo", "r1", 5.0, 3.0, 40, 10, "a1", variant="ooo@split", schedule="split",
            hint_error="arguments do not fit the schema of f: 'x' is not of type 'integer'", payload_bytes=30),
        row("ooo", "r2", 3.0, 2.0, 20, 6, "a2", variant="ooo@split", schedule="split", hint_ready_s=None),
        row("toolspec", "r1", 5.0, 3.0, 40, 10, "a1"), row("toolspec", "r2", 3.0, 2.0, 20, 6, "a2"),
    ]
    s = summarize(rows, n_boot=50)
    assert "ooo-oracle" not in s["mean_over_cells"] and s["upper_bounds"]["ooo-oracle"] == pytest.approx(10.0)
    split = s["cells"][0]["methods"]["ooo@split"]
    assert split["hint_outcomes"] == {"late": 0.5, "rejected": 0.5} and split["schedule"] == "split"
    assert split["vs_toolspec_decode"]["ratio"] == pytest.approx(1.0)
    # the wave answered before ar began its first value: never for split here, for both requests of ooo
    assert split["hint_before_first_value"] == 0.0 and s["cells"][0]["methods"]["ooo"]["hint_before_first_value"] == 1.0
    assert s["cells"][0]["methods"]["ooo"]["vs_toolspec_decode"]["ratio"] == pytest.approx(5 / 3, abs=1e-3)
    md = to_markdown(s)
    assert "ooo-oracle *(upper bound)*" in md and "arguments do not fit the schema" in md


def test_per_target_means_are_over_that_targets_benchmarks_only():
    def moved(rows, target, bench, scale):  # the same rows on another cell, ooo's times scaled
        return [{**r, "key": f"{target}|{bench}|{r['request_id']}|{r['method']}", "target": target, "benchmark": bench,
                 **({"wall_s": r["wall_s"] * scale, "decode_s": r["decode_s"] * scale} if r["method"] == "ooo" else {})}
                for r in rows]
    base = [r for r in ROWS if r["method"] in ("ar", "ooo")] + [row("toolspec", "r1", 5.0, 3.0, 40, 10, "a1"),
                                                                row("toolspec", "r2", 3.0, 2.0, 20, 6, "a2")]
    s = summarize(moved(base, "t", "b1", 1.0) + moved(base, "t", "b2", 2.0) + moved(base, "u", "b1", 4.0), n_boot=20)
    t, u = s["per_target"]["t"]["ooo"], s["per_target"]["u"]["ooo"]
    assert t["cells"] == 2 and u["cells"] == 1
    assert t["e2e"] == pytest.approx((16 / 6 + 16 / 12) / 2, abs=1e-3)  # unweighted over t's two benchmarks
    assert u["e2e"] == pytest.approx(16 / 24, abs=1e-3)                  # u's one cell, not mixed with t's
    assert t["vs_toolspec_e2e"] == pytest.approx((8 / 6 + 8 / 12) / 2, abs=1e-3)
    assert t["hint_before_first_value"] == 1.0 and t["identical_to_ar"] == 1.0
    # a free wave: toolspec's prefill (5-3, 3-2) + ooo's decode (2, 1) on b1 -> 8 / 6; on b2 ooo's decode doubles
    assert t["vs_toolspec_e2e_free_wave"] == pytest.approx((8 / 6 + 8 / 9) / 2, abs=1e-3)
    assert "vs_toolspec_e2e" not in s["per_target"]["t"]["ar"]
    md = to_markdown(s)
    assert "## Mean over benchmarks, per target" in md and "| u | ooo | 1 | 0.67x |" in md


def test_bootstrap_interval_brackets_ratio():
    lo, hi = bootstrap_ratio([1, 2, 3, 4], [1, 1, 1, 1], n=500)
    assert lo <= 2.5 <= hi and lo < hi


def test_render_writes_all_outputs(tmp_path):
    with open(tmp_path / "rows.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    render(tmp_path, n_boot=50)
    for name in ("summary.md", "summary.csv", "summary.json", "speedup.png", "accepted_length.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "ooo" in (tmp_path / "summary.csv").read_text()


def test_report_names_the_machine_from_the_manifest(tmp_path):
    with open(tmp_path / "rows.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    machine = {"cpu": {"model": "Test CPU 9000", "flags": ["avx2", "avx512f"], "cores": 2},
               "torch_cpu_capability": "AVX512", "torch": "2.13.0+cpu", "threads": 2, "dtype": "float32"}
    (tmp_path / "manifest.json").write_text(json.dumps({"machine": machine, "cost_curves": {
        "t": {"sizes": [1, 2], "seconds": [0.3, 0.4], "meta": {}}}}))
    render(tmp_path, n_boot=20)
    md = (tmp_path / "summary.md").read_text()
    assert "Test CPU 9000, 2 cores, flags avx2 avx512f" in md and "dtype float32, 2 threads" in md
    assert "| t | 0.300 | 0.400 |" in md


def test_busy_rows_are_flagged_left_out_and_counted(tmp_path):
    from pipeline.report import busy

    quiet = {"wall_s": 10.0, "cpu_s": 19.0, "machine_cpu_s": 19.5, "steal_s": 0.0, "load_start": 2.0, "load_end": 2.1}
    shared = {**quiet, "machine_cpu_s": 19.0 + 8.0}          # another job took 0.8 of a core
    stolen = {**quiet, "steal_s": 3.0}
    wave = {**quiet, "machine_cpu_s": 19.0 + 9.5}             # ... but this one is the row's own sidecar wave
    assert busy({"measured": quiet}) is None
    assert "0.80 cores" in busy({"measured": shared})
    assert "steal" in busy({"measured": stolen})
    assert busy({"measured": wave, "sidecar_cpu_s": 9.5}) is None
    assert busy({}) is None  # rows from before the readings: not judged
    rows = [dict(r, threads=2, measured=quiet, machine={"cpu": "EPYC", "flags": ["avx512_bf16"], "dtype": "bf16",
                                                        "torch": "2.13"}) for r in ROWS]
    rows[3] = dict(rows[3], measured=shared)  # ooo r2 shared the machine: out of the table
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = render(tmp_path, n_boot=50)
    assert s["busy_rows"]["busy"] == 1 and s["busy_rows"]["per_variant"] == {"ooo": 1}
    assert s["cells"][0]["methods"]["ooo"]["requests"] == 1
    assert s["cells"][0]["methods"]["ooo"]["speedup"] == pytest.approx(10 / 4, abs=1e-3)
    assert s["with_busy_rows"]["mean_over_cells"]["ooo"] == pytest.approx(16 / 6, abs=1e-3)
    assert s["busy_rows"]["utilization"]["ar"] == pytest.approx(0.95)
    md = (tmp_path / "summary.md").read_text()
    assert "Busy rows: 1" in md and "EPYC / avx512_bf16 / bf16 / torch 2.13 (6 rows)" in md and "Prefill:" in md


def test_means_over_different_cells_say_so():
    """A target whose `ooo` rows are missing: the mean over cells counts each variant's cells and says the means are
    not comparable; with every variant in every cell it says nothing."""
    other = [dict(r, key=r["key"].replace("t|", "u|", 1), target="u") for r in ROWS if r["method"] != "ooo"]
    s = summarize(ROWS + other, n_boot=20)
    assert s["cells_per_variant"] == {"ar": 2, "ooo": 1, "hf-pld": 2}
    md = to_markdown(s)
    assert "not comparable" in md and "| ooo | 1 |" in md
    assert "not comparable" not in to_markdown(summarize(ROWS, n_boot=20))
