"""The eval report is recomputed from rows: speedups, accepted lengths, identity with ar, accuracy, flags."""

import json

import pytest

from pipeline.eval.report import bootstrap_ratio, render, summarize, to_markdown

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


def test_the_claim_is_judged_cell_by_cell_by_each_interval():
    def at(bench, method, rid, wall, variant=None, digest=None):
        r = row(method, rid, wall, wall / 2, 20, 10, digest or rid, variant=variant or method)
        return {**r, "key": f"t|{bench}|{rid}|{r['variant']}", "benchmark": bench}

    rows = []
    for bench, adaptive, deferred, sequential in (("b1", [4, 4, 4], [4, 6, 5], [12, 12, 12]),
                                                  ("b2", [6, 6, 6], [4.5, 4.5, 4.5], [4, 4, 4])):
        for i, rid in enumerate(("r1", "r2", "r3")):
            rows += [at(bench, "ar", rid, 10.0), at(bench, "toolspec", rid, 5.0),
                     at(bench, "ooo", rid, adaptive[i], "ooo@adaptive"),
                     at(bench, "ooo", rid, deferred[i], "ooo@deferred"),
                     at(bench, "ooo", rid, sequential[i], "ooo@sequential", digest="x" if rid == "r1" else None),
                     at(bench, "ooo-oracle", rid, 2.0)]
    judged = summarize(rows, n_boot=300)["claim"]["t"]
    adaptive, deferred, sequential = (judged["variants"][v] for v in ("ooo@adaptive", "ooo@deferred", "ooo@sequential"))
    assert "ooo-oracle" not in judged["variants"]  # an upper bound is not judged
    assert adaptive["cells"]["b1"]["vs_toolspec"] == "faster" and adaptive["cells"]["b2"]["vs_toolspec"] == "slower"
    assert adaptive["vs_toolspec"] == {"faster": 1, "level": 0, "slower": 1} and adaptive["slower_than_toolspec"] == ["b2"]
    assert adaptive["vs_ar"] == {"faster": 2, "level": 0, "slower": 0} and adaptive["slower_than_ar"] == []
    assert deferred["cells"]["b1"]["vs_toolspec"] == "level"  # 1.25x, 0.83x, 1.0x: the interval holds 1
    assert deferred["vs_toolspec"] == {"faster": 1, "level": 1, "slower": 0}
    assert sequential["slower_than_ar"] == ["b1"] and sequential["identical_to_ar"] == pytest.approx(2 / 3, abs=1e-3)
    # means over the benchmarks vs toolspec: adaptive (1.25 + 0.83) / 2, deferred (1.0 + 1.11) / 2: deferred is best
    assert adaptive["mean_vs_toolspec_e2e"] == pytest.approx((5 / 4 + 5 / 6) / 2, abs=1e-3)
    assert judged["best"] == "ooo@deferred"
    md = to_markdown(summarize(rows, n_boot=300))
    assert "## The claim, cell by cell" in md
    line = {ln.split(" | ")[1]: ln for ln in md.splitlines() if ln.startswith("| t | ") and ln.count(" | ") == 7}
    assert line["**ooo@deferred** (best)"].endswith("| 1 / 1 / 0 | none | 2 / 0 / 0 | none | 100% |")
    assert line["ooo@adaptive"] == "| t | ooo@adaptive | 1.04x | 1 / 0 / 1 | b2 | 2 / 0 / 0 | none | 100% |"
    assert line["ooo@sequential"].endswith("| 1 / 0 / 1 | b1 | 1 / 0 / 1 | b1 | 67% |")


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
    assert "GPU" not in md  # a CPU machine's header names no GPU

    machine["gpu"] = {"model": "NVIDIA H100 80GB HBM3", "count": 1, "memory_gib": 79.2, "capability": "9.0",
                      "driver": "550.54.15", "cuda": "12.8"}
    (tmp_path / "manifest.json").write_text(json.dumps({"machine": machine}))
    render(tmp_path, n_boot=20)
    md = (tmp_path / "summary.md").read_text()
    assert "GPU NVIDIA H100 80GB HBM3 (driver 550.54.15, CUDA 12.8)" in md


def test_gpu_info_records_model_driver_and_cuda_and_nothing_on_a_cpu():
    from types import SimpleNamespace

    import torch

    from pipeline.hardware import gpu_info, gpu_line, machine

    class FakeCuda:
        def __init__(self, available):
            self.available = available

        def is_available(self):
            return self.available

        def get_device_properties(self, i):
            return SimpleNamespace(total_memory=80 * 2**30)

        def get_device_capability(self, i):
            return (9, 0)

        def get_device_name(self, i):
            return "NVIDIA H100"

        def device_count(self):
            return 8

    assert gpu_info(FakeCuda(False)) is None
    info = gpu_info(FakeCuda(True), driver=lambda: "550.54.15")
    assert info == {"model": "NVIDIA H100", "count": 8, "memory_gib": 80.0, "capability": "9.0",
                    "driver": "550.54.15", "cuda": torch.version.cuda}
    assert gpu_line(info).startswith("GPU 8 x NVIDIA H100 (driver 550.54.15, CUDA ")
    assert gpu_line("Old GPU name") == "GPU Old GPU name" and gpu_line(None) == ""
    if not torch.cuda.is_available():
        assert "gpu" not in machine("float32")


def test_report_names_the_sidecars_wave_settings(tmp_path):
    """The sidecar line says how the wave ran (weight format, staged tools), which the rows' identity records."""
    with open(tmp_path / "rows.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    ident = {"model": "m", "adapter": "a", "adapter_sha256": "ab" * 32, "merged": True, "wave": 4, "slot_tools": 2,
             "prefix_cache": 0, "prepack": False, "quantize": "int8"}
    (tmp_path / "manifest.json").write_text(json.dumps({"sidecar": ident}))
    render(tmp_path, n_boot=20)
    md = (tmp_path / "summary.md").read_text()
    assert ("merged into the base weights); wave revision 4, int8 linear layers (down_proj kept out), slots of the "
            "top 2 tools; git commit") in md
    (tmp_path / "manifest.json").write_text(json.dumps({"sidecar": {**ident, "quantize": None, "prepack": True,
                                                                    "slot_tools": None, "prefix_cache": 8192}}))
    render(tmp_path, n_boot=20)
    md = (tmp_path / "summary.md").read_text()
    assert "wave revision 4, prepacked weights, prefix cache of 8192 tokens; git commit" in md
    (tmp_path / "manifest.json").write_text(json.dumps({"sidecar": {"model": "m", "adapter": None}}))  # older runs
    render(tmp_path, n_boot=20)
    assert "(adapter_model.safetensors sha256 -); git commit" in (tmp_path / "summary.md").read_text()


def test_busy_rows_are_flagged_left_out_and_counted(tmp_path):
    from pipeline.eval.report import busy

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


def test_target_formats_line_counts_the_hint_opening_matches():
    from pipeline.eval.report import target_formats

    base = {"method": "ar", "target": "t", "family": "llama3", "vocab_size": 6008, "call_format": "'' parameters"}
    rows = [dict(base, hint_opening_match=True), dict(base, hint_opening_match=False),
            dict(base, hint_opening_match=None), {"method": "ar", "target": "old"}, dict(base, method="ooo")]
    assert target_formats(rows) == {"t": {"family": "llama3", "vocab_size": 6008, "call_format": "'' parameters",
                                          "matched": 1, "n": 2}}
