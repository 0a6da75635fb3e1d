"""scripts/gpu_check.py in its CPU mode (what CI runs so the GPU script cannot rot): one table, every method equal to
`ar` in float32 and bf16, the projection labelled as one, and neither trl nor vllm imported on its path."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode_prints_one_table_without_trl_or_vllm(tmp_path):
    out = tmp_path / "gc.json"
    code = ("import runpy, sys; sys.argv = ['gpu_check.py', '--device', 'cpu', '--quick', '--requests', '2', "
            f"'--new-tokens', '12', '--json', {str(out)!r}]; runpy.run_path('scripts/gpu_check.py', "
            "run_name='__main__'); bad = [m for m in ('trl', 'vllm') if m in sys.modules]; "
            "assert not bad, f'imported {bad}'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("| check ") == 1  # one table
    res = json.loads(out.read_text())
    rows = {r[0]: r[2] for r in res["rows"]}
    assert rows["lossless float32"] == "8/8 equal ar" and rows["lossless bfloat16"].endswith("/8 equal ar")
    assert "DID NOT FALL" not in rows["LoRA bf16"]
    assert len(res["curve"]["seconds"]) == 4 and all(s > 0 for s in res["curve"]["seconds"])
    proj = [r for r in res["rows"] if r[0].startswith("PROJECTION")]
    assert proj and all("projected, not measured" in r[2] for r in proj)
    assert "PROJECTION toolspec" in rows and res["projection"]["toolspec"] > 1.0
