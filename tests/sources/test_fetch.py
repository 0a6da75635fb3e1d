"""Pinned raw files: the manifest against the local copy, downloads from a loopback mirror (never the internet),
`make data` from the mirror equal to `make data` from the local folder, corrupted and interrupted downloads."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.sources import SOURCE_MODULES, fetch, raw_data_root
from pipeline.sources.fetch import FetchError, RawFile
from pipeline.stages import data as data_stage

RAW = raw_data_root()
needs_data = pytest.mark.skipif(not all((RAW / p.source / p.path).is_file() for p in fetch.MANIFEST),
                                reason=f"raw benchmark files not found under {RAW}")


class Mirror(BaseHTTPRequestHandler):
    """Serves `files` ({URL path: bytes or a Path}) with Range support; `faults` ({URL path: [fault, ...]}) are
    used up one per request: "drop" (send half of the body, then close), "corrupt" (flip a byte), "no_range"."""

    files: dict = {}
    faults: dict = {}
    log: list = []

    def do_GET(self):
        path = self.path.lstrip("/")
        self.log.append((path, self.headers.get("Range")))
        body = self.files.get(path)
        if body is None:
            self.send_error(404, "not in the mirror")
            return
        body = body.read_bytes() if isinstance(body, Path) else body
        fault = self.faults[path].pop(0) if self.faults.get(path) else None
        if fault == "corrupt":
            body = body[:10] + bytes([body[10] ^ 1]) + body[11:]
        start = 0
        rng = self.headers.get("Range")
        if rng and fault != "no_range":
            start = int(rng.removeprefix("bytes=").rstrip("-"))
        part = body[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        if fault == "drop":
            self.wfile.write(part[:len(part) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(part)

    def log_message(self, *args):
        pass


@pytest.fixture
def mirror(monkeypatch):
    """A loopback HTTP server; yields (base URL, handler class) and clears proxies so nothing leaves the machine."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    handler = type("TestMirror", (Mirror,), {"files": {}, "faults": {}, "log": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def synthetic_pins(monkeypatch, handler, contents: dict[str, bytes]) -> list[RawFile]:
    """A manifest of small made-up files for source `api_bank`, served by `handler`."""
    pins = [RawFile("api_bank", name, "owner/repo", "c0ffee", f"dir/{name}", len(body),
                    hashlib.sha256(body).hexdigest()) for name, body in contents.items()]
    for pin, body in zip(pins, contents.values()):
        handler.files[pin.url_path] = body
    monkeypatch.setattr(fetch, "MANIFEST", pins)
    return pins


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


BODY = bytes(range(256)) * 400  # 100 KiB: several read chunks, so a drop really cuts the file


# ---- the manifest ----

@needs_data
def test_manifest_pins_the_local_copy():
    from pipeline.io import sha256_file

    for pin in fetch.MANIFEST:
        local = RAW / pin.source / pin.path
        assert (local.stat().st_size, sha256_file(local)) == (pin.size, pin.sha256), pin.path
        assert len(pin.commit) == 40 and pin.repo.count("/") == 1
    assert len({(p.source, p.path) for p in fetch.MANIFEST}) == len(fetch.MANIFEST)
    assert {p.source for p in fetch.MANIFEST} == set(SOURCE_MODULES)


def test_base_url_precedence(monkeypatch):
    monkeypatch.delenv(fetch.BASE_URL_ENV, raising=False)
    assert fetch.resolve_base_url() == fetch.DEFAULT_BASE_URL
    monkeypatch.setenv(fetch.BASE_URL_ENV, "http://127.0.0.1:9/mirror/")
    assert fetch.resolve_base_url() == "http://127.0.0.1:9/mirror"
    assert fetch.resolve_base_url("http://127.0.0.1:8") == "http://127.0.0.1:8"


# ---- make data from the mirror ----

@needs_data
def test_make_data_from_mirror_equals_local_folder(mirror, monkeypatch, tmp_path):
    url, handler = mirror
    handler.files.update({pin.url_path: RAW / pin.source / pin.path for pin in fetch.MANIFEST})
    monkeypatch.setenv(fetch.BASE_URL_ENV, url)  # the environment variable path; the recipe key is tested below
    common = ["data.limit_per_subset=25"]
    local = data_stage.main([f"data.raw_root={RAW}", f"data.out={tmp_path / 'local'}", *common])
    cache = tmp_path / "cache"
    fetched = data_stage.main([f"data.raw_root={tmp_path / 'absent'}", f"data.raw_cache={cache}",
                               f"data.out={tmp_path / 'fetched'}", *common])
    assert fetched == local
    assert {path for path, _ in handler.log} == {pin.url_path for pin in fetch.MANIFEST}
    assert leftovers(cache) == sorted(f"{p.source}/{p.path}" for p in fetch.MANIFEST)  # no .part files
    for bench, splits in local["benchmarks"].items():
        for split in splits:
            rel = Path(bench) / f"{split}.jsonl"
            assert (tmp_path / "fetched" / rel).read_text() == (tmp_path / "local" / rel).read_text(), rel
    for rejected in (tmp_path / "local").glob("*/rejected.jsonl"):
        strip = lambda text, root: text.replace(json.dumps(str(root))[1:-1], "<raw>")
        assert (strip((tmp_path / "fetched" / rejected.parent.name / "rejected.jsonl").read_text(), cache)
                == strip(rejected.read_text(), RAW))
    # a second run finds every file in the cache, verified: nothing is downloaded again
    handler.log.clear()
    monkeypatch.delenv(fetch.BASE_URL_ENV)
    again = data_stage.main([f"data.raw_root={tmp_path / 'absent'}", f"data.raw_cache={cache}",
                             f"data.out={tmp_path / 'fetched'}", f"data.fetch_base_url={url}", *common, "--force"])
    assert again == local and handler.log == []


def test_local_raw_root_wins(monkeypatch, tmp_path):
    (tmp_path / "raw").mkdir()
    monkeypatch.setattr(fetch, "fetch", lambda *a, **k: pytest.fail("fetched although raw_root exists"))
    cfg = data_stage.Config(raw_root=str(tmp_path / "raw"))
    assert data_stage.resolve_raw_root(cfg) == tmp_path / "raw"


def test_data_stage_reports_a_failed_fetch(mirror, monkeypatch, tmp_path, capsys):
    url, handler = mirror
    synthetic_pins(monkeypatch, handler, {"a.json": BODY})
    handler.faults["owner/repo/c0ffee/dir/a.json"] = ["corrupt"]
    with pytest.raises(SystemExit) as e:
        data_stage.main([f"data.raw_root={tmp_path / 'absent'}", f"data.raw_cache={tmp_path / 'cache'}",
                         f"data.fetch_base_url={url}", "data.sources=[api_bank]", f"data.out={tmp_path / 'out'}"])
    assert e.value.code == 2
    assert "sha256 mismatch" in capsys.readouterr().err and not (tmp_path / "out").exists()


# ---- one file at a time ----

def test_download_verifies_and_is_atomic(mirror, monkeypatch, tmp_path):
    url, handler = mirror
    synthetic_pins(monkeypatch, handler, {"a.json": BODY, "sub/b.jsonl": b'{"x": 1}\n'})
    assert fetch.fetch(tmp_path, ["api_bank"], url, backoff=0) == tmp_path
    assert (tmp_path / "api_bank" / "a.json").read_bytes() == BODY
    assert leftovers(tmp_path) == ["api_bank/a.json", "api_bank/sub/b.jsonl"]


def test_corrupted_download_leaves_nothing(mirror, monkeypatch, tmp_path):
    url, handler = mirror
    (pin,) = synthetic_pins(monkeypatch, handler, {"a.json": BODY})
    handler.faults[pin.url_path] = ["corrupt"]
    with pytest.raises(FetchError) as e:
        fetch.fetch(tmp_path, ["api_bank"], url, backoff=0)
    bad = BODY[:10] + bytes([BODY[10] ^ 1]) + BODY[11:]
    msg = str(e.value)
    assert str(tmp_path / "api_bank" / "a.json") in msg and f"{url}/{pin.url_path}" in msg
    assert f"expected {pin.sha256}" in msg and f"got {hashlib.sha256(bad).hexdigest()}" in msg
    assert leftovers(tmp_path) == []
    # the mirror is healthy again: the next run downloads the file
    fetch.fetch(tmp_path, ["api_bank"], url, backoff=0)
    assert (tmp_path / "api_bank" / "a.json").read_bytes() == BODY


@pytest.mark.parametrize("faults, requests", [(["drop", "drop"], 3), (["drop", "no_range"], 2)],
                         ids=["resumes", "server_ignores_range"])
def test_interrupted_download_is_retried(mirror, monkeypatch, tmp_path, faults, requests):
    url, handler = mirror
    (pin,) = synthetic_pins(monkeypatch, handler, {"a.json": BODY})
    handler.faults[pin.url_path] = list(faults)
    fetch.fetch(tmp_path, ["api_bank"], url, retries=3, backoff=0)
    assert (tmp_path / "api_bank" / "a.json").read_bytes() == BODY
    ranges = [r for _, r in handler.log]
    assert ranges[0] is None and len(ranges) == requests  # every retry asks for the rest of the file only
    assert all(r is not None and r.startswith("bytes=") and int(r[6:-1]) > 0 for r in ranges[1:])
    assert leftovers(tmp_path) == ["api_bank/a.json"]


def test_download_that_keeps_failing_leaves_no_partial_file(mirror, monkeypatch, tmp_path):
    url, handler = mirror
    (pin,) = synthetic_pins(monkeypatch, handler, {"a.json": BODY})
    handler.faults[pin.url_path] = ["drop"] * 3
    with pytest.raises(FetchError, match=r"a\.json: download from .* failed after 3 attempts .*nothing was kept"):
        fetch.fetch(tmp_path, ["api_bank"], url, retries=2, backoff=0)
    assert leftovers(tmp_path) == []


def test_missing_file_on_the_mirror(mirror, monkeypatch, tmp_path):
    url, handler = mirror
    (pin,) = synthetic_pins(monkeypatch, handler, {"a.json": BODY})
    handler.files.clear()
    with pytest.raises(FetchError, match=r"a\.json: .*/owner/repo/c0ffee/dir/a\.json answered HTTP 404"):
        fetch.fetch(tmp_path, ["api_bank"], url, backoff=0)
    assert leftovers(tmp_path) == [] and len(handler.log) == 1  # a 4xx answer is not retried


def test_changed_cache_file_is_downloaded_again(mirror, monkeypatch, tmp_path):
    url, handler = mirror
    synthetic_pins(monkeypatch, handler, {"a.json": BODY})
    fetch.fetch(tmp_path, ["api_bank"], url, backoff=0)
    assert len(handler.log) == 1
    (tmp_path / "api_bank" / "a.json").write_bytes(b"edited")
    fetch.fetch(tmp_path, ["api_bank"], url, backoff=0)
    assert (tmp_path / "api_bank" / "a.json").read_bytes() == BODY and len(handler.log) == 2


def test_source_without_pins(tmp_path):
    with pytest.raises(FetchError, match=r"no pinned raw files for source\(s\) \['nope'\]"):
        fetch.fetch(tmp_path, ["nope"])
