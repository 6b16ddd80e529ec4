"""perf/common/pyspy.py's reader of ``py-spy record --format raw`` output (no py-spy needed)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

from common import pyspy  # noqa: E402

SERVER = ('process 1008:"/opt/python3 -m vllm.entrypoints.openai.api_server --port 45639 --compilation-config '
          '{"cudagraph_capture_sizes": [1, 2, 4]}";')
CORE = 'process 1071:"VLLM::EngineCore";'


def test_samples_of_a_server_whose_command_line_holds_quotes_are_read(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join([
        SERVER + CORE + "thread (1071): MainThread;run (core.py:10);step (core.py:20) 7",
        SERVER + CORE + "thread (1071): MainThread;run (core.py:10) 2",
        SERVER + 'thread (1008): MainThread;serve (api.py:5) 3',
        'thread (42): dmi-zarr_3;write (exporter.py:9) 4',
        'thread (43): dmi-zarr_4;write (exporter.py:9) 1',
    ]) + "\n")
    got = pyspy.load(raw)
    core = got["VLLM::EngineCore: MainThread"]
    assert core[("run (core.py:10)", "step (core.py:20)")] == 7 and sum(core.values()) == 9
    server = [k for k in got if k.endswith(": MainThread") and not k.startswith("VLLM")]
    assert len(server) == 1 and sum(got[server[0]].values()) == 3 and "#" in server[0]   # pids masked
    assert sum(got["dmi-zarr"].values()) == 5                                            # a pool counts as one
