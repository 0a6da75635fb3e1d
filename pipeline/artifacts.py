"""Release artifacts: the small, expensive outputs tracked in git where their stage writes them.

Run as: python -m pipeline.artifacts check            (what tests/test_artifacts.py asserts)
        python -m pipeline.artifacts seal <folder>    (record its files' sha256 in <folder>/manifest.json)

The chain needs more CPU-hours than one session, and everything git ignores dies with the machine, so these outputs
are committed (whitelisted in .gitignore): the target's traces (`data/traces/<teacher>/`), the CPU sidecar adapter
(`checkpoints/sidecar/<recipe>/`, with its `sidecar_eval/`), a target fine-tuned here (`checkpoints/target/<recipe>/`:
its adapter), the eval rows and reports (`eval/results/<run>/`).
Every stage that writes one *seals* it when it stops (finished or not): the folder's
manifest.json gains `files`, the sha256 and size of each file in it (a subfolder with a manifest of its own is sealed
on its own). `check` fails when a tracked artifact file is not in its nearest manifest, or its bytes changed since,
or the artifacts pass the size budget.
"""

from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys
from pathlib import Path

from .io import read_json, sha256_file, write_json

ROOTS = ("data/traces", "checkpoints/sidecar", "checkpoints/target", "eval/results")
BUDGET_MB = 35.0  # the whole tracked tree stays under 40 MB (4.7 MB of it code, docs and fixtures): the sidecar's
# adapter folder is ~20 MB (its tokenizer is the base's: not committed), the Gemma target's adapter 3.7 MB, the full eval
# run ~5 MB, the vLLM run 0.9 MB; past this, an old run leaves the tree (docs/experiments.md names its commit)
SKIP = ("manifest.json", "*.partial", "checkpoint-*", ".*", "training_args.bin")  # never sealed: in flight,
# resumable or pickled trainer state, hidden files


def _skipped(path: Path, folder: Path) -> bool:
    return any(fnmatch.fnmatch(part, pat) for part in path.relative_to(folder).parts for pat in SKIP)


def sealed_files(folder: Path) -> list[Path]:
    """The files `seal(folder)` records: every file below it except SKIP and subfolders with their own manifest."""
    own = {p.parent for p in folder.rglob("manifest.json") if p.parent != folder}
    return sorted(p for p in folder.rglob("*") if p.is_file() and not _skipped(p, folder)
                  and not any(d == p.parent or d in p.parents for d in own))


def seal(folder: str | Path) -> Path:
    """Record the sha256 and size of the folder's files in its manifest.json (created if absent)."""
    folder = Path(folder)
    path = folder / "manifest.json"
    manifest = read_json(path) if path.is_file() else {"stage": "artifact"}
    manifest["files"] = {p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                         for p in sealed_files(folder)}
    write_json(path, manifest)
    return path


def tracked(root: Path = Path(".")) -> list[Path] | None:
    """Artifact files git tracks (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *ROOTS], cwd=root, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [Path(p) for p in out.stdout.decode().split("\0") if p]


def problems(root: Path = Path("."), files: list[Path] | None = None, budget_mb: float = BUDGET_MB) -> list[str]:
    """What is wrong with the artifacts (an empty list when nothing is)."""
    root = Path(root)
    files = tracked(root) if files is None else files
    if files is None:
        return []
    out, total, manifests = [], 0, {}
    for rel in files:
        path = root / rel
        if not path.is_file():
            continue  # deleted in the work tree, not yet committed
        total += path.stat().st_size
        if path.name == "manifest.json" or _skipped(path, root) or Path(rel).parent.as_posix() in ROOTS:
            continue  # a root's own README is documentation, not an artifact
        folder = next((d for d in path.parents if (d / "manifest.json").is_file()), None)
        if folder is None or root.resolve() not in [folder.resolve(), *folder.resolve().parents]:
            out.append(f"{rel}: no manifest.json in its folder or above (seal it: python -m pipeline.artifacts seal)")
            continue
        entry = manifests.setdefault(folder, read_json(folder / "manifest.json").get("files") or {})
        key = path.relative_to(folder).as_posix()
        if key not in entry:
            out.append(f"{rel}: not listed in {folder / 'manifest.json'} (files)")
        elif entry[key]["sha256"] != sha256_file(path):
            out.append(f"{rel}: sha256 differs from {folder / 'manifest.json'}; reseal after the stage that wrote it")
    if total > budget_mb * 1e6:
        out.append(f"tracked artifacts take {total / 1e6:.1f} MB, over the {budget_mb:.0f} MB budget")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.artifacts", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="every tracked artifact is sealed and within the size budget")
    s = sub.add_parser("seal", help="record a folder's files in its manifest.json")
    s.add_argument("folders", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "seal":
        for f in args.folders:
            print(seal(f))
        return 0
    bad = problems()
    for line in bad:
        print(line, file=sys.stderr)
    total = sum((Path(p).stat().st_size for p in tracked() or [] if Path(p).is_file()), 0)
    print(f"{len(tracked() or [])} tracked artifact files, {total / 1e6:.1f} MB (budget {BUDGET_MB:.0f} MB): "
          f"{'ok' if not bad else f'{len(bad)} problem(s)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
