"""Naming a model: a folder without config.json that holds one GGUF file (what KServe's storage initializer
downloads from a GGUF repository to /mnt/models) is that file."""

from __future__ import annotations

import pytest

from inferd.errors import ModelLoadError
from inferd.models import loader


def test_a_folder_holding_one_gguf_file_is_that_file(tmp_path, monkeypatch):
    converted = []
    monkeypatch.setattr(loader, "convert_gguf", lambda path: converted.append(path) or tmp_path / "converted")
    (tmp_path / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF")
    (tmp_path / "README.md").write_text("a model card")
    assert loader.resolve_model(str(tmp_path)) == tmp_path / "converted"
    assert converted == [tmp_path / "gemma-3-270m-q4_k_m.gguf"]


def test_a_folder_of_several_gguf_files_or_none_names_what_to_do(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        loader.resolve_model(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json and no .gguf file"):
        loader.resolve_model(str(empty))


def test_replicas_starting_together_convert_a_gguf_once(tmp_path, monkeypatch):
    """Two processes (here threads, each with its own lock file handle) asking for the same GGUF at once: one
    converts, the other waits for it and takes its folder; neither trips over the other's temporary folder."""
    import threading
    import time

    monkeypatch.setenv("INFERD_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def slow_convert(src, out):
        calls.append(src)
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir()
        time.sleep(0.5)
        (tmp / "model.safetensors").write_bytes(b"")
        (tmp / loader.FORMATS_FILE).write_text("{}")
        tmp.rename(out)

    monkeypatch.setattr(loader, "_convert", slow_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(loader.convert_gguf(gguf))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1]
    assert (got[0] / "model.safetensors").exists()
