"""bench/packed_kernel_resources.py: the one-row packed kernel, compiled for sm_90 on the CPU
machine, loads its steps ahead only where the loop asks for stages.

The kernel's speed on a GPU hangs on bytes in flight (docs/benchmarks.md): a launch option
that silently stops being pipelined (as `num_stages` on a plain `range` never was) shows
here as a way with no asynchronous copies in its PTX.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.requirements import require

ROOT = Path(__file__).resolve().parents[2]


def test_stages_and_descriptors_put_the_loads_in_flight():
    require("triton")
    report = subprocess.run([sys.executable, "bench/packed_kernel_resources.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [line.strip("| ").split(" | ") for line in report.splitlines()
            if line.startswith("| ") and not line.startswith("| way")]
    assert len(rows) == 17, report
    for way, _outputs, _inputs, _warps, stages, registers, _shared, warps, copies in rows:
        assert int(registers) <= 255 and int(warps) >= 1, report
        if way == "descriptor loads" or int(stages) > 1:
            assert int(copies) > 0, f"{way} at {stages} stages waits in registers\n{report}"
        else:
            assert int(copies) == 0, report
