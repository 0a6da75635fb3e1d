"""The raw benchmark files, pinned to their public sources, downloaded into a cache and checked by sha256.

Run as: python -m pipeline.sources.fetch [--dest data/raw-cache] [--base-url URL] [--sources api_bank ...]
(`make data` does this by itself when `data.raw_root` is not a folder; a local raw folder always wins.)

MANIFEST pins every file a converter reads: the repository and commit it comes from, its path there, its size and
the sha256 of the copy in ../shared/data (each pin was checked against the repository's git blob at that commit).
BFCL's files are the ones the `bfcl-eval` wheel ships; the same bytes are in the gorilla repository at the commit
below. Files land in `<dest>/<source>/<path>`, the layout of ../shared/data, so the converters read the cache as a
raw folder.

A download goes to a hidden `.<name>.part` beside its target and is renamed into place only after its sha256
matched, so a target file is always complete and verified. A dropped connection is retried (`retries` times, with
backoff), resuming with an HTTP Range request where the server allows it. A sha256 mismatch, an HTTP 4xx answer or
running out of retries deletes the part file and raises FetchError naming the file, the URL and, for a mismatch,
the expected and received digests. Files already in the cache are re-hashed on every run; one that no longer
matches is downloaded again.

The base URL (default: GitHub's raw file host; a mirror serves `/<owner>/<repo>/<commit>/<path>`) comes from the
`base_url` argument (recipe key `data.fetch_base_url`), else the environment variable OOO_SPEC_RAW_BASE_URL.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from tqdm import tqdm

from ..io import InputError, sha256_file

DEFAULT_BASE_URL = "https://raw.githubusercontent.com"
BASE_URL_ENV = "OOO_SPEC_RAW_BASE_URL"
CHUNK = 1 << 16


class FetchError(InputError):
    """A raw file could not be downloaded or did not match its pinned sha256."""


@dataclass(frozen=True)
class RawFile:
    source: str     # folder under the raw root (a SOURCE_MODULES name)
    path: str       # path under that folder, as the converter reads it
    repo: str       # GitHub owner/name
    commit: str
    repo_path: str  # path inside the repository at that commit
    size: int
    sha256: str

    @property
    def url_path(self) -> str:
        return f"{self.repo}/{self.commit}/{self.repo_path}"


def _pins(source: str, repo: str, commit: str, repo_dir: str, files: dict[str, tuple[int, str]]) -> list[RawFile]:
    return [RawFile(source, path, repo, commit, f"{repo_dir}/{path}", size, sha) for path, (size, sha) in files.items()]


_BFCL_CATEGORIES = {  # category file: (question size, sha256), (possible answer size, sha256)
    "simple_python": ((283274, "82dd63ba502eb2520c6b5d1d9a5c4b590e03ff261565175561f6228a367d1991"),
                      (63627, "90cd5bc653690ee8e459b5b3f3fc9458606f7f3fcbf795bb51b7dc581f8c86dc")),
    "multiple": ((316583, "aef168155ebd74b7ac2401198b201343bc7d16d7a3d7e0d4e6d8ee82c6969b2a"),
                 (32254, "244e00ce9395df948bcafc7bee64e8f9c87ef70887587d83cae45b13699f3047")),
    "parallel": ((171896, "19f51a82eff42e5d62541aa500115a056eb78f437c2ba1f10415fd7c8e5dda84"),
                 (66005, "8a6aa19c1adddc6a5a2f7e40f9dbf30cc7e95815e7b830c90589ab318229e0f0")),
    "parallel_multiple": ((347080, "8863ea8433239f55c5f016154cf0830853c89f693c6ea270396a2fa121960579"),
                          (74602, "5ebf24f458c1f16300c05505d83d6f0a1b68b79be273a033febd0d4f840507e3")),
    "live_simple": ((260140, "1af2ac87dca47556db7b7e37e51e28b459a38b594e3c7b3c792b4903598ca0c4"),
                    (46972, "fec9cfa9744a936f9126981e85a2023da1e63e273eafebc81923a1162fad70ce")),
    "live_multiple": ((3891277, "fd8ccfad4d911420d0e3341dbe2fff77d1d341da934248b9bb2bda24ab3a10c8"),
                      (199668, "97e90d59c5bd76c55a2920ce93e5566e9046307d3f558578f085f9d3a56c3084")),
    "simple_java": ((86619, "13d2303a125b08754f0e41995b9273b5005fa8ed8ebfaa24ef53b4d83c4b5c6e"),
                    (16407, "78f25616084044fa05bbfcee68e03f6ececb222bdd5cb3b7783a675fb3366e35")),
    "simple_javascript": ((47063, "329e67fedf79a6243d93dbda4b388d12bd2d31f1f2163d92cb6ef676d1764f44"),
                          (7881, "e2f9f2e51d88e0c8056ffbf1a3dd3d02eb032532d2b5d98c9cc9003385bdd56b")),
}

MANIFEST: list[RawFile] = [
    # API-Bank test data: later removed from the repository ("move dataset to hf hub"), so pinned before that
    *_pins("api_bank", "AlibabaResearch/DAMO-ConvAI", "5d5a2d40b2e6b6998a06961cc43ad0a8c069b153", "api-bank", {
        "test-data/level-1-api.json": (868804, "0d3155c5495399836b5b1f1cc4eb6d5d50efa16b2734af50a016a158e9dd79bb"),
        "test-data/level-2-api.json": (228723, "c61966448d9d5cf98334f39b44c0db1fe5a9c6c84a1f53e652f4aacdbbfc5da0"),
    }),
    # API-Bank training data, commit "add training data" (2023-11-17)
    *_pins("api_bank", "AlibabaResearch/DAMO-ConvAI", "1d76900822d9ecfcd6e9eb0ca64a073cb892b735", "api-bank", {
        "training-data/lv3-api-train.json": (1188021,
                                             "f9223633cb0ea4f26182aa3bca48590dff26e6b620163377d2b3059e7660413f"),
    }),
    *_pins("toolalpaca", "tangqiaoyu/ToolAlpaca", "189069998d64a7baf1b4a1c3c4b2e75eb9d05532", "data", {
        "eval_simulated.json": (213761, "17085ffefae0a0e15c1d2d564263063932d692011edf27ce8ae3d3803432ba08"),
        "eval_real.json": (149690, "86d1392c786060e00dd6feaa963d8a87660e3042380b0abbd8ccad2b931e2778"),
    }),
    # the files of the bfcl-eval 2026.3.23 wheel, at the gorilla commit of the same day
    *_pins("bfcl", "ShishirPatil/gorilla", "6ea57973c7a6097fd7c5915698c54c17c5b1b6c8",
           "berkeley-function-call-leaderboard/bfcl_eval/data",
           {f"{folder}BFCL_v4_{cat}.json": pin for cat, pins in _BFCL_CATEGORIES.items()
            for folder, pin in zip(("", "possible_answer/"), pins)}),
    *_pins("seal_tools", "fairyshine/Seal-Tools", "ce753ecd60ed08dd376984035de531ab8421f1c6", "Seal-Tools_Dataset", {
        "tool.jsonl": (2574022, "35e34aaec1f0793c2b5a5dff734cb925837988f59ed0fe4f410d67f3d8375f5c"),
        "test_in_domain.jsonl": (511226, "330020288948e711846417c2fca9a5980ef0f1adc01ad74dc38cc9ff7142811f"),
        "test_out_domain.jsonl": (542260, "c2a86a3d3a5270f578e07f39a0973310cbcaec3b8d72166d7be38d21c9720be6"),
        "dataset_for_finetune/test_in_domain.json": (3185666,
                                                     "75d51adc3521c6dce1b0f19628446a5e49d30e7a36425fada7809b0f5a4e4d7a"),
        "dataset_for_finetune/test_out_domain.json": (2990899,
                                                      "adcdde6eac7cdeb5fe10ea3c77a89fbc55a8dca7fc8c2a23dc17222cb4f4f2f4"),
    }),
]


def resolve_base_url(explicit: str | None = None) -> str:
    """The explicit base URL, else $OOO_SPEC_RAW_BASE_URL, else GitHub's raw file host."""
    return (explicit or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).rstrip("/")


def _transfer(url: str, part: Path, size: int, timeout: float, bar: tqdm) -> None:
    """Fetch `url` into `part`, continuing after the bytes it already holds when the server honours Range."""
    have = part.stat().st_size if part.exists() else 0
    if have >= size:
        return  # complete (or too long: the sha256 check says which)
    headers = {"Range": f"bytes={have}-"} if have else {}
    with urlopen(Request(url, headers=headers), timeout=timeout) as resp:
        if have and resp.status != 206:  # the server sent the whole file: start over
            bar.update(-have)
            have = 0
        with open(part, "ab" if have else "wb") as f:
            while chunk := resp.read(CHUNK):
                f.write(chunk)
                bar.update(len(chunk))
    got = part.stat().st_size
    if got < size:
        raise http.client.IncompleteRead(b"", size - got)


def download(pin: RawFile, target: Path, url: str, bar: tqdm, retries: int = 3, backoff: float = 1.0,
             timeout: float = 60.0) -> None:
    """Download one pinned file to `target` via a `.part` file; rename only after the sha256 matched."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.part")
    error = None
    for attempt in range(retries + 1):
        if attempt:
            bar.write(f"{pin.source}/{pin.path}: {error}; retry {attempt}/{retries} (resuming)")
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            _transfer(url, part, pin.size, timeout, bar)
            break
        except HTTPError as e:
            if e.code < 500:
                part.unlink(missing_ok=True)
                raise FetchError(f"{target}: {url} answered HTTP {e.code} {e.reason}") from None
            error = e
        except (URLError, OSError, http.client.HTTPException) as e:
            error = e
    else:
        part.unlink(missing_ok=True)
        raise FetchError(f"{target}: download from {url} failed after {retries + 1} attempts ({error!r}); "
                         f"nothing was kept")
    got, received = sha256_file(part), part.stat().st_size
    if got != pin.sha256:
        part.unlink()
        raise FetchError(f"{target}: sha256 mismatch for {url}: expected {pin.sha256} ({pin.size} bytes), got {got} "
                         f"({received} bytes); the download was discarded")
    os.replace(part, target)


def fetch(dest: str | os.PathLike, sources: list[str], base_url: str | None = None, retries: int = 3,
          backoff: float = 1.0, timeout: float = 60.0) -> Path:
    """Make `<dest>/<source>/...` hold every pinned file of `sources`, verified; returns `dest`."""
    dest = Path(dest)
    missing = [s for s in sources if not any(p.source == s for p in MANIFEST)]
    if missing:
        raise FetchError(f"no pinned raw files for source(s) {missing} in pipeline/sources/fetch.py MANIFEST")
    root = resolve_base_url(base_url)
    todo = []
    for pin in (p for p in MANIFEST if p.source in sources):
        target = dest / pin.source / pin.path
        if target.is_file():
            got = sha256_file(target)
            if got == pin.sha256:
                continue
            print(f"{target}: sha256 {got} is not the pinned {pin.sha256}; downloading it again", file=sys.stderr)
            target.unlink()
        todo.append(pin)
    if todo:
        print(f"downloading {len(todo)} raw files from {root} into {dest}", file=sys.stderr)
    with tqdm(total=sum(p.size for p in todo), unit="B", unit_scale=True, desc="raw data", disable=not todo) as bar:
        for pin in todo:
            bar.set_postfix_str(f"{pin.source}/{pin.path}")
            download(pin, dest / pin.source / pin.path, f"{root}/{pin.url_path}", bar, retries, backoff, timeout)
    return dest


def main(argv: list[str] | None = None) -> Path:
    from . import SOURCE_MODULES

    ap = argparse.ArgumentParser(prog="python -m pipeline.sources.fetch", description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default="data/raw-cache", help="cache folder (default: data/raw-cache)")
    ap.add_argument("--base-url", default=None, help=f"mirror base URL (default: ${BASE_URL_ENV} or {DEFAULT_BASE_URL})")
    ap.add_argument("--sources", nargs="+", default=list(SOURCE_MODULES), choices=SOURCE_MODULES)
    ap.add_argument("--retries", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        dest = fetch(args.dest, args.sources, args.base_url, args.retries)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{dest}: every pinned file present and verified")
    return dest


if __name__ == "__main__":
    main()
