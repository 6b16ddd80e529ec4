"""dmi.store.location.place_files (the Ray merge's chunk placement): a hard link on one file system,
a copy across file systems, the file system's own copy between memory:// stores (as between two
s3:// ones, tests/test_ray_data.py), an absent source file left absent."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from dmi.store.location import open_location, place_files


def test_one_file_system_links_and_leaves_the_source(tmp_path):
    (tmp_path / "part.zarr/a/c/0").mkdir(parents=True)
    (tmp_path / "part.zarr/a/c/0/0").write_bytes(b"chunk-0")
    done = place_files(open_location(tmp_path), open_location(tmp_path / "out.zarr"),
                       [("part.zarr/a/c/0/0", "a/c/3/0"), ("part.zarr/a/c/1/0", "a/c/4/0")])
    assert done == {"linked": 1, "server_copied": 0, "copied": 0, "absent": 1}
    src, dst = tmp_path / "part.zarr/a/c/0/0", tmp_path / "out.zarr/a/c/3/0"
    assert dst.read_bytes() == b"chunk-0" and dst.stat().st_ino == src.stat().st_ino
    assert not (tmp_path / "out.zarr/a/c/4/0").exists()
    dst.unlink()                                 # the part keeps its file
    assert src.read_bytes() == b"chunk-0"


def test_another_file_system_copies(tmp_path):
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system (/dev/shm) beside the temp directory")
    (tmp_path / "c").mkdir()
    (tmp_path / "c/0").write_bytes(b"x" * 1000)
    with tempfile.TemporaryDirectory(dir=other) as d:
        done = place_files(open_location(tmp_path), open_location(Path(d) / "out.zarr"), [("c/0", "c/7")])
        assert done["copied"] == 1 and done["linked"] == 0
        out = Path(d) / "out.zarr/c/7"
        assert out.read_bytes() == b"x" * 1000 and out.stat().st_ino != (tmp_path / "c/0").stat().st_ino
        assert not [n for n in os.listdir(out.parent) if n.startswith(".")]      # no temp file left


def test_object_stores_copy_inside_the_file_system():
    src, dst = open_location("memory://place-src/part.zarr"), open_location("memory://place-dst/out.zarr")
    src.write("c/0/0", b"abc")
    done = place_files(src, dst, [("c/0/0", "c/2/0"), ("c/9/0", "c/3/0")])
    assert done == {"linked": 0, "server_copied": 1, "copied": 0, "absent": 1}
    assert dst.read("c/2/0") == b"abc" and dst.read("c/3/0") is None
