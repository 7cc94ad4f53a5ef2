"""The benchmark tools that reach into the library: benchmarks/l1_cycles.c compiles its own
kernels.c (it still builds against today's source, for each 256-bit ISA this CPU runs, and prints
a figure for every panel type, and the gate pass where the build has one); benchmarks/
ab_kernels.py calls two builds' packers through ctypes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparseinfer import cpu
from sparseinfer.cpu import build

ROOT = Path(__file__).resolve().parents[2]
TYPES = ["Q4_0x16", "Q4_1x16", "Q5_0x16", "Q5_1x16", "Q8_0x16", "Q4_Kx16", "Q5_Kx16", "Q6_Kx16",
         "Q6_Kx16b", "Q5_Kx16b"]


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "avx2_128"])
def test_l1_cycles_builds_and_reports_every_type(isa, tmp_path):
    if build.other_machine() or isa not in cpu.available_isas():
        pytest.skip(f"this CPU does not run {isa}")
    try:
        cc = build.find_compiler()
    except build.BuildError as e:
        pytest.skip(str(e))
    exe = tmp_path / "l1c"
    # -O1: the figures are not checked here, and it builds in half -O2's time (15 s against 30)
    subprocess.run([cc, "-O1", "-std=gnu11", "-fno-math-errno", *build.ISA_FLAGS[isa],
                    f"-DSI_ISA={isa}", "-DCALLS=50", "-DROUNDS=1",
                    f"-I{ROOT / 'src/sparseinfer/cpu'}", str(ROOT / "benchmarks/l1_cycles.c"),
                    "-o", str(exe), "-lm"], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out.startswith(f"# ISA {isa}, clock ")
    names = TYPES + ([] if isa == "avx2_128" else ["q4 gates"])
    for name in names:
        m = re.search(rf"^{re.escape(name)}\s.*?([0-9.]+) cycles a block column$", out, re.M)
        assert m and float(m.group(1)) > 0, (name, out)


@pytest.mark.slow
def test_ab_kernels_pack_runs_and_the_builds_agree():
    """benchmarks/ab_kernels.py --pack: the loader's repacking timed with two kernel variants of
    this build (packing does not depend on the ISA: the outputs must be equal)."""
    if build.other_machine() or not {"avx2", "avx2_128"} <= set(cpu.available_isas()):
        pytest.skip("this CPU does not run avx2 and avx2_128")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/ab_kernels.py"), "--same",
                          "--isa", "avx2", "--new-isa", "avx2_128", "--pack", "Q5_0x16",
                          "Q6_Kx16b", "--rounds", "2", "--per-block", "1"],
                         check=True, capture_output=True, text=True).stdout
    for head in ("Q5_0 rows -> Q5_0x16 panels", "Q6_K rows -> Q6_Kx16b panels"):
        assert len(re.findall(rf"^{re.escape(head)}, .*; outputs equal$", out, re.M)) == 2, out
    assert "new / old speed at p50" in out
