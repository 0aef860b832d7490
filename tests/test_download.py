"""Downloads go through a loopback HTTP server: verified by sha256, moved atomically, nothing left on mismatch."""

from __future__ import annotations

import functools
import hashlib
import http.server
import logging
import threading
import zipfile

import pytest

from fedrec_flwr.data import download as dl
from fedrec_flwr.data import load_interactions, load_item_titles
from fedrec_flwr.errors import DataError

AMAZON_ROWS = b"A1,B001,5.0,1000\r\nA1,B002,3.0,2000\r\nA2,B001,4.0,1500\r\n"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass


@pytest.fixture
def server(tmp_path):
    """(base URL, served folder) of an http.server on 127.0.0.1, port chosen by the OS; stopped afterwards."""
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_single_file_download_lands_in_cache(server, tmp_path, monkeypatch):
    base, root = server
    (root / "ratings.dat").write_bytes(AMAZON_ROWS)
    monkeypatch.setitem(dl.URLS, "amazon-video", f"{base}/ratings.dat")
    monkeypatch.setitem(dl.SHA256, "amazon-video", {"ratings.dat": _sha(AMAZON_ROWS)})
    cache = tmp_path / "cache"
    inter = load_interactions("amazon-video", cache_dir=cache)
    target = cache / "raw" / "amazon-video" / "ratings.dat"
    assert target.read_bytes() == AMAZON_ROWS
    assert sorted(p.name for p in target.parent.iterdir()) == ["ratings.dat"]  # no temp file left
    assert len(inter.frame) == 3 and set(inter.frame["user"]) == {"A1", "A2"}
    (root / "ratings.dat").unlink()  # a second load must not download again
    assert len(load_interactions("amazon-video", cache_dir=cache).frame) == 3


def test_wrong_checksum_raises_and_leaves_nothing(server, tmp_path, monkeypatch):
    base, root = server
    (root / "ratings.dat").write_bytes(AMAZON_ROWS)
    url = f"{base}/ratings.dat"
    monkeypatch.setitem(dl.URLS, "amazon-video", url)
    monkeypatch.setitem(dl.SHA256, "amazon-video", {"ratings.dat": "0" * 64})
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as info:
        load_interactions("amazon-video", cache_dir=cache)
    message = str(info.value)
    assert url in message and "0" * 64 in message and _sha(AMAZON_ROWS) in message
    folder = cache / "raw" / "amazon-video"
    assert not folder.exists() or list(folder.iterdir()) == []


def test_zip_download_extracts_and_verifies_each_member(server, tmp_path, monkeypatch):
    base, root = server
    files = {
        "u.data": b"1\t10\t4\t100\n1\t11\t3\t200\n2\t10\t5\t150\n",
        "u.user": b"1|24|M|technician|85711\n2|53|F|other|94043\n",
        "u.item": "10|Caf\u00e9 (1995)|01-Jan-1995||x\n11|B (1995)|01-Jan-1995||y\n".encode("latin-1"),
    }
    with zipfile.ZipFile(root / "ml-100k.zip", "w") as zf:
        for name, data in files.items():
            zf.writestr(f"ml-100k/{name}", data)
        zf.writestr("ml-100k/README", b"readme")
    monkeypatch.setitem(dl.URLS, "ml-100k", f"{base}/ml-100k.zip")
    monkeypatch.setitem(dl.SHA256, "ml-100k", {name: _sha(data) for name, data in files.items()})
    cache = tmp_path / "cache"
    inter = load_interactions("ml-100k", cache_dir=cache)
    folder = cache / "raw" / "ml-100k"
    assert sorted(p.name for p in folder.iterdir()) == ["u.data", "u.item", "u.user"]
    assert len(inter.frame) == 3 and inter.attributes.loc["2", "gender"] == "F"
    assert load_item_titles(cache_dir=cache, download=False).loc["10"] == "Caf\u00e9 (1995)"


def test_zip_member_mismatch_writes_nothing(server, tmp_path, monkeypatch):
    base, root = server
    with zipfile.ZipFile(root / "f.zip", "w") as zf:
        zf.writestr("ratings.txt", b"1 1 2\n")
    monkeypatch.setitem(dl.URLS, "filmtrust", f"{base}/f.zip")
    monkeypatch.setitem(dl.SHA256, "filmtrust", {"ratings.txt": "f" * 64})
    with pytest.raises(DataError, match=r"checksum mismatch for ratings\.txt from http://127\.0\.0\.1"):
        load_interactions("filmtrust", cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "raw" / "filmtrust").iterdir()) == []


def test_http_error_is_a_data_error(server, tmp_path, monkeypatch):
    base, _ = server
    monkeypatch.setitem(dl.URLS, "amazon-video", f"{base}/missing.dat")
    with pytest.raises(DataError, match=r"download from .*missing\.dat failed"):
        load_interactions("amazon-video", cache_dir=tmp_path / "cache")


def test_no_download_when_disabled(tmp_path):
    with pytest.raises(DataError, match="download=False"):
        load_interactions("amazon-video", cache_dir=tmp_path / "cache", download=False)


def test_data_dir_with_other_checksum_is_used_with_a_warning(tmp_path, caplog):
    folder = tmp_path / "amazon-video"
    folder.mkdir()
    (folder / "ratings.dat").write_bytes(AMAZON_ROWS)
    with caplog.at_level(logging.WARNING, logger="fedrec_flwr.data"):
        inter = load_interactions("amazon-video", tmp_path)  # parent folder of the dataset folder
    assert len(inter.frame) == 3
    assert any("not the pinned" in r.getMessage() for r in caplog.records)
