"""Build the C kernel library: ``python3 -m sparseinfer.cpu.build`` (``install.sh`` runs it).

One shared library, ``libsicpu.so`` beside this file: ``kernels.c`` compiled once per variant
(AVX2+FMA+F16C; the same with AVX-VNNI; the same in 128-bit registers; AVX-512 F/BW/VL + VNNI)
and ``pool.c`` for baseline x86-64, which picks a variant at run time from what the CPU
reports. A compiler too old for ``-mavxvnni`` (GCC < 11, Clang < 12) builds that variant as
plain AVX2. The sources' hash is compiled in, so an import can tell a library
built from older sources (``sparseinfer.cpu`` then asks for a rebuild).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
LIB = HERE / "libsicpu.so"
SOURCES = ("qgemv.h", "kernels.c", "pool.c")
COMMON = ["-O3", "-fPIC", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-fno-math-errno", "-pthread"]
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512vnni"],
    # AVX2 with AVX-VNNI (Intel from Alder Lake: no AVX-512): vpdpbusd in 256-bit registers
    "avx2_vnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    # AVX2 for 128-bit vector units (AMD Zen/Zen+): blocks worked in 128-bit registers
    "avx2_128": ["-mavx2", "-mfma", "-mf16c", "-DSI_NARROW=1"],
}
BUILD_COMMAND = "python3 -m sparseinfer.cpu.build"


class BuildError(RuntimeError):
    pass


def source_hash() -> str:
    """Hash of the C sources and flags this library is built from."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    h.update(repr((COMMON, ISA_FLAGS)).encode())
    return h.hexdigest()[:16]


def find_compiler() -> str:
    """The C compiler to use: $CC if set, else the first of cc, gcc, clang on PATH."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise BuildError(f"no C compiler found (looked for {', '.join(names)} on PATH): install one, "
                     f"e.g. `apt-get install gcc` (Debian/Ubuntu) or `dnf install gcc`, then run "
                     f"`{BUILD_COMMAND}` (or ./install.sh) again")


def _accepts(cc: str, flag: str, tmp: str) -> bool:
    """Whether compiler ``cc`` takes ``flag``."""
    src = os.path.join(tmp, "probe.c")
    Path(src).write_text("int si_probe;\n")
    proc = subprocess.run([cc, flag, "-c", src, "-o", src + ".o"], capture_output=True)
    return proc.returncode == 0


def _run(cmd: list[str]) -> None:
    log.info("%s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"C build failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stderr.strip()}")


def other_machine() -> str | None:
    """Why this machine cannot run the C kernels at all (another CPU architecture), or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the C kernels are x86-64 code, this CPU is {platform.machine()}"
    return None


def build(out: Path = LIB) -> Path:
    """Compile the library to ``out`` (atomically replaced); returns its path."""
    why = other_machine()
    if why:
        raise BuildError(why)
    cc = find_compiler()
    digest = source_hash()
    with tempfile.TemporaryDirectory() as tmp:
        objs = []
        for isa, flags in ISA_FLAGS.items():
            if "-mavxvnni" in flags and not _accepts(cc, "-mavxvnni", tmp):
                log.warning("%s does not take -mavxvnni: the avx2_vnni kernels are plain AVX2", cc)
                flags = [f for f in flags if f != "-mavxvnni"]
            obj = os.path.join(tmp, f"kernels_{isa}.o")
            _run([cc, *COMMON, *flags, f"-DSI_ISA={isa}", "-c", str(HERE / "kernels.c"),
                  "-o", obj])
            objs.append(obj)
        pool_obj = os.path.join(tmp, "pool.o")
        _run([cc, *COMMON, f'-DSI_SOURCE_HASH="{digest}"', "-c", str(HERE / "pool.c"),
              "-o", pool_obj])
        tmp_lib = os.path.join(tmp, out.name)
        _run([cc, "-shared", "-pthread", "-o", tmp_lib, pool_obj, *objs, "-lm"])
        shutil.copyfile(tmp_lib, str(out) + ".tmp")
        os.replace(str(out) + ".tmp", out)
    log.info("built %s (sources %s)", out, digest)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=BUILD_COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", type=Path, default=LIB, help=f"output (default {LIB})")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(args.out)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
