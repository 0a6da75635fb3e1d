"""scripts/agent_turns.py: second-turn requests from an eval run's ar rows (the agent-turn eval's input)."""

import json
import subprocess
import sys
from pathlib import Path

from pipeline.io import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = read_jsonl(ROOT / "tests/fixtures/requests.jsonl")


def test_second_turns_carry_the_targets_answer_and_a_new_message(tmp_path):
    root = tmp_path / "requests"
    (root / "fixture").mkdir(parents=True)
    (root / "fixture" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    rows = tmp_path / "rows.jsonl"
    answered = REQUESTS[:3]
    rows.write_text("".join(json.dumps({"target": "t", "method": "ar", "request_id": r["id"], "text": f"call {i}"}) + "\n"
                            for i, r in enumerate(answered))
                    + json.dumps({"target": "other", "method": "ar", "request_id": REQUESTS[3]["id"], "text": "x"}) + "\n")
    out = tmp_path / "turns"
    subprocess.run([sys.executable, str(ROOT / "scripts/agent_turns.py"), "--rows", str(rows), "--target", "t",
                    "--requests-root", str(root), "--per-benchmark", "2", "--out", str(out)], check=True, cwd=ROOT)
    first, second = read_jsonl(out / "fixture/test.jsonl"), read_jsonl(out / "fixture-turn2/test.jsonl")
    assert len(first) == 2 and {r["id"] for r in first} <= {r["id"] for r in answered}  # only requests with an answer
    for one, two in zip(first, second):
        assert two["id"] == one["id"] + "/turn2" and two["tools"] == one["tools"]
        assert two["messages"][:len(one["messages"])] == one["messages"]  # turn 1 is the prefix of turn 2
        answer = f"call {[r['id'] for r in answered].index(one['id'])}"
        assert two["messages"][len(one["messages"])] == {"role": "assistant", "content": answer}
        assert two["messages"][-1]["role"] == "user"
    assert (out / "manifest.json").is_file()
