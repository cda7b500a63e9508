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
