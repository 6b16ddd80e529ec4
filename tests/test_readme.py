"""The README's Python examples run as they are (on the built-in tiny model they name)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "<!-- tests/test_readme.py runs the next block"


def readme_blocks() -> list[str]:
    """The ```python blocks that follow a marker line, in order."""
    text = README.read_text()
    return re.findall(re.escape(MARK) + r"[^\n]*-->\n```python\n(.*?)\n```", text, flags=re.S)


def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    blocks = readme_blocks()
    assert len(blocks) == 2, "the README's tested examples: the store run, then the in-memory run"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "8 steps" in out
    assert (tmp_path / "out.zarr" / "zarr.json").is_file()
    tree = namespace["tree"]          # the second block's: in memory
    assert tree.attrs["dmi_status"] == "closed" and namespace["run"].in_memory
    assert set(tree["layers/resid_post"].dataset.request.values.tolist()) == {"fox", "paris"}
