"""Two teachers' traces of the same requests, side by side: identical texts, identical parsed calls, and where they part.

Run as: python scripts/compare_traces.py data/traces/qwen2.5-coder-1.5b-vllm data/traces/qwen2.5-coder-1.5b \
            [--splits dev test] [--out data/traces/qwen2.5-coder-1.5b-vllm/comparison.json]

For every request both folders hold (by id): whether the texts are equal, whether their parsed calls are (the one
call parser, `pipeline/parsers.py`; values by `scoring.values_equal`), and for a difference the first character where
the texts part, the context there, both finish reasons and a kind: `text-vs-call` (one answers with a call, the
other with text), `call-values` (calls differ), `same-calls` (texts differ, calls equal: spacing or the text around
the call), `text` (both answer with text), `length` (either hit its token cap). Also each side's throughput as its
manifest recorded it (completion tokens per second of the runs that wrote the rows).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.io import read_json, read_jsonl, write_json  # noqa: E402
from pipeline.parsers import parse_calls  # noqa: E402
from pipeline.scoring import values_equal  # noqa: E402


def calls_of(text: str) -> list[dict]:
    return [{"name": c["name"], "arguments": c.get("arguments")} for c in parse_calls(text, lenient=True).calls]


def same_calls(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x["name"] == y["name"] and values_equal(x["arguments"], y["arguments"])
                                    for x, y in zip(a, b))


def kind(ra: dict, rb: dict, ca: list, cb: list) -> str:
    if "length" in (ra.get("finish_reason"), rb.get("finish_reason")):
        return "length"
    if bool(ca) != bool(cb):
        return "text-vs-call"
    if not ca:
        return "text"
    return "same-calls" if same_calls(ca, cb) else "call-values"


def first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def throughput(folder: Path, split: str) -> dict | None:
    """Completion tokens per second over the manifest's runs that wrote rows of `split`."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return None
    runs = [r.get("report", {}).get(split) for r in read_json(manifest).get("runs") or []]
    runs = [r for r in runs if r and r.get("written")]
    if not runs:
        return None
    tokens, wall, n = (sum(r[k] for r in runs) for k in ("completion_tokens", "wall_s", "written"))
    return {"requests": n, "completion_tokens": tokens, "wall_s": round(wall, 1),
            "requests_per_s": round(n / wall, 3), "tokens_per_s": round(tokens / wall, 2)}


def compare(a: Path, b: Path, splits: list[str]) -> dict:
    out = {"a": str(a), "b": str(b), "splits": {}}
    for split in splits:
        if not (a / f"{split}.jsonl").is_file() or not (b / f"{split}.jsonl").is_file():
            continue
        rows_a = {r["id"]: r for r in read_jsonl(a / f"{split}.jsonl") if not r.get("error")}
        rows_b = {r["id"]: r for r in read_jsonl(b / f"{split}.jsonl") if not r.get("error")}
        both = sorted(set(rows_a) & set(rows_b))
        diffs, same_text, same_call = [], 0, 0
        for rid in both:
            ra, rb = rows_a[rid], rows_b[rid]
            ca, cb = calls_of(ra["text"]), calls_of(rb["text"])
            same_text += ra["text"] == rb["text"]
            same_call += same_calls(ca, cb)
            if ra["text"] != rb["text"]:
                at = first_difference(ra["text"], rb["text"])
                diffs.append({"id": rid, "kind": kind(ra, rb, ca, cb), "at_char": at,
                              "context": ra["text"][max(0, at - 40):at], "a": ra["text"][at:at + 40],
                              "b": rb["text"][at:at + 40], "finish": [ra.get("finish_reason"), rb.get("finish_reason")],
                              "tokens": [ra.get("completion_tokens"), rb.get("completion_tokens")]})
        kinds: dict[str, int] = {}
        for d in diffs:
            kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
        out["splits"][split] = {"requests": len(both), "only_a": len(set(rows_a) - set(rows_b)),
                                "only_b": len(set(rows_b) - set(rows_a)),
                                "identical_text": same_text, "identical_calls": same_call,
                                "identical_text_share": round(same_text / len(both), 4) if both else None,
                                "identical_calls_share": round(same_call / len(both), 4) if both else None,
                                "difference_kinds": kinds, "throughput_a": throughput(a, split),
                                "throughput_b": throughput(b, split), "differences": diffs}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--splits", nargs="*", default=["dev", "test", "train"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = compare(args.a, args.b, args.splits)
    for split, s in result["splits"].items():
        print(f"{split}: {s['requests']} requests in both; identical text {s['identical_text']} "
              f"({s['identical_text_share']:.1%}), identical calls {s['identical_calls']} "
              f"({s['identical_calls_share']:.1%}); differences {s['difference_kinds']}")
        print(f"   throughput {args.a.name}: {s['throughput_a']}\n   throughput {args.b.name}: {s['throughput_b']}")
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
