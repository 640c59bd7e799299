"""The checkpoint writer hashes and starts writeback behind the serializer: the manifest's
hashes must still be those of the bytes on disk, whatever the write sizes, and a failing
save must end (not hang on the helper thread) and leave no checkpoint."""

import hashlib
import json
import threading

import torch
import xxhash

from trainwatch.rank.checkpoint import writer
from trainwatch.checkpoint_format.manifest import read_manifest, verify
from trainwatch.rank.checkpoint.writeback import start_writeback
from trainwatch.rank.checkpoint.writer import Payload, write_checkpoint


def _payload(step, model):
    return Payload(step, {"model": model}, [{"data": {"position": step}}])


def _xxh3_128(path):
    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


def test_hashes_span_many_windows_and_match_the_files(tmp_path):
    # 3.5 windows of weights plus small records: the hash crosses window edges and a tail
    size = int(writer.HASH_WINDOW * 3.5) // 4
    model = {"w": torch.arange(size, dtype=torch.float32), "b": torch.ones(3)}
    written = write_checkpoint(tmp_path, _payload(7, model))
    manifest = read_manifest(written.path)
    assert manifest["files"]["model.pt"]["bytes"] > writer.HASH_WINDOW * 3
    for name, entry in manifest["files"].items():
        assert set(entry) == {"xxh3_128", "bytes"}
        assert entry["xxh3_128"] == _xxh3_128(written.path / name)
    assert verify(written.path).ok
    assert torch.equal(torch.load(written.path / "model.pt")["w"], model["w"])


def test_a_manifest_written_with_sha256_still_verifies_and_catches_damage(tmp_path):
    """Checkpoints saved before manifests moved to xxh3-128 record sha256: they stay valid,
    and a flipped byte in one is still found."""
    written = write_checkpoint(tmp_path, _payload(3, {"w": torch.arange(1000.0)}))
    path = written.path / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, entry in manifest["files"].items():
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((written.path / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))
    assert verify(written.path).ok
    mirrored = writer.copy_checkpoint(written.path, tmp_path / "mirror")
    assert verify(mirrored.path).ok
    model = written.path / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    assert verify(written.path).problems == ["model.pt: sha256 mismatch (content changed or corrupt)"]


def test_short_writes_are_continued_not_lost(tmp_path, monkeypatch):
    """write(2) may take fewer bytes than asked (2 GiB cap, signals); torch.save does not
    check, so the writer must finish each buffer itself."""
    real_open = open

    class Short:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            return self.fh.write(memoryview(data)[:4096])

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    def short_open(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        return Short(fh) if mode == "xb" else fh

    monkeypatch.setattr(writer, "open", short_open, raising=False)
    model = {"w": torch.randn(300_000)}
    written = write_checkpoint(tmp_path, _payload(3, model))
    assert verify(written.path).ok
    assert torch.equal(torch.load(written.path / "model.pt")["w"], model["w"])


def test_a_state_that_cannot_be_saved_fails_fast_and_leaves_no_checkpoint(tmp_path):
    result = {}

    def save():
        try:
            write_checkpoint(tmp_path, _payload(5, {"w": torch.ones(4), "f": lambda: 0}))
        except Exception as exc:  # the pickling error, whatever its class
            result["error"] = exc

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "write_checkpoint hung after torch.save failed"
    assert "error" in result
    assert not (tmp_path / "step-5").exists()


def test_writeback_is_started_on_linux_and_refuses_nothing_sensible(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    with open(path, "rb+") as fh:
        assert start_writeback(fh.fileno(), 0, 8192) is True
        assert start_writeback(fh.fileno(), 0, 0) is False
    assert start_writeback(-1, 0, 10) is False  # EBADF: reported, not raised
