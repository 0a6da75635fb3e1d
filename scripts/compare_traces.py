"""Compare traces backends on the same requests: completion tokens/s from each run's manifest, texts side by side.

Run as: python scripts/compare_traces.py data/traces/cmp-runtime data/traces/cmp-transformers data/traces/cmp-vllm
        [--split train]

Each folder is a traces output (`make traces ... teacher=<name>`), all over the same requests (same seed and limit).
Prints per backend: requests, completion tokens, wall seconds, completion tokens per second (from the manifest's run
figures, which time the whole split, prefill included), and for every other backend how many texts are identical to
the first folder's, with the first differing request shown (character position and both texts around it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.io import read_json  # noqa: E402


def texts(folder: Path, split: str) -> dict[str, str]:
    path = folder / f"{split}.jsonl"
    if not path.is_file():
        path = path.with_name(path.name + ".partial")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["id"]: r["text"] for r in rows if not r.get("error")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--split", default="train")
    args = ap.parse_args()
    ref_name, ref = args.folders[0].name, texts(args.folders[0], args.split)
    print("| backend | requests | completion tokens | wall s | completion tok/s | identical to " + ref_name + " |")
    print("|---|---|---|---|---|---|")
    notes = []
    for folder in args.folders:
        manifest = read_json(folder / "manifest.json")
        run = manifest.get("run", {}).get(args.split, {})
        mine = texts(folder, args.split)
        common = sorted(set(mine) & set(ref))
        same = [i for i in common if mine[i] == ref[i]]
        print(f"| {manifest.get('backend', folder.name)} | {run.get('written', len(mine))} | "
              f"{run.get('completion_tokens')} | {run.get('wall_s')} | {run.get('completion_tokens_per_s')} | "
              f"{len(same)}/{len(common)} |")
        for i in common:
            if mine[i] != ref[i]:
                at = next((k for k, (a, b) in enumerate(zip(mine[i], ref[i])) if a != b), min(len(mine[i]), len(ref[i])))
                notes.append(f"- {folder.name} / {i}: differs at character {at}: "
                             f"{mine[i][max(0, at - 20):at + 20]!r} vs {ref[i][max(0, at - 20):at + 20]!r}")
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
