"""Build flash-attn 2's CUDA extension from its source package for chosen head dims and dtypes only, on a GPU machine.

flash-attn publishes no wheel on PyPI, and its full build (72 kernel files for every head dim of 32..256, fp16 and
bf16, forward, split-KV forward and backward, causal or not) takes longer than one run on the GPU machine. Tests of
``ring_kernels``' ``flash_attn`` backend need a few head dims and dtypes, so this builds exactly those:

    python scripts/build_flash_attn.py --sdist flash_attn-2.8.3.tar.gz --build-dir .fa-build \\
        --head-dims 64,128 --dtypes bf16,fp16 --arch 90 --jobs 16
    export PYTHONPATH=$(python scripts/build_flash_attn.py --build-dir .fa-build --print-path):$PYTHONPATH

What it changes in a copy of the sources, nothing else: the kernel files compiled (the chosen head dims and
dtypes), and flash_api.cpp's two dispatch switches (``HEADDIM_SWITCH``, ``FP16_SWITCH`` in ``static_switch.h``),
which then dispatch to the built kernels only and raise a ``RuntimeError`` naming the build for any other head dim
or dtype (a head dim is served by the kernel of its size class, as in the full build: 80 by the 96 kernel, 112 by
128, and so on). Compiled with torch's JIT extension builder (ninja, ``MAX_JOBS`` jobs) and the nvcc flags of
flash-attn's own setup.py, for one GPU architecture. An interrupted build resumes where it stopped (ninja keeps
what it compiled in ``--build-dir``). The Python package is flash-attn's own, imported from the unpacked sources.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tarfile
from pathlib import Path

__all__ = ["main", "kernel_files", "dispatch_switches"]

HEAD_DIM_CLASSES = (32, 64, 96, 128, 192, 256)  # flash-attn 2's kernels, one per head-dim size class
DTYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
# flash-attn's setup.py flags for nvcc (its commented-out feature switches left out).
NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
              "--expt-extended-lambda", "--use_fast_math", "--threads", "4"]


def kernel_files(head_dims: list[int], dtypes: list[str]) -> list[str]:
    """The kernel sources (relative to csrc/flash_attn/src) of the chosen head-dim classes and dtypes."""
    files = []
    for kind in ("fwd", "fwd_split", "bwd"):
        for dim in head_dims:
            for dtype in dtypes:
                for causal in ("", "_causal"):
                    files.append(f"flash_{kind}_hdim{dim}_{dtype}{causal}_sm80.cu")
    return files


def dispatch_switches(head_dims: list[int], dtypes: list[str]) -> str:
    """``FP16_SWITCH`` and ``HEADDIM_SWITCH`` for the chosen classes: the built kernels, else a RuntimeError."""
    built = f"head dims {','.join(map(str, head_dims))}, dtypes {','.join(dtypes)}"
    refuse = (f'TORCH_CHECK(false, "this flash-attn was built for {built} only '
              f'(scripts/build_flash_attn.py); rebuild with this case");')
    lines = ["#define FP16_SWITCH(COND, ...) \\", "  [&] { \\"]
    for dtype, cond in (("fp16", "(COND)"), ("bf16", "!(COND)")):
        if dtype in dtypes:
            lines += [f"    if ({cond}) {{ \\", f"      using elem_type = {DTYPES[dtype]}; \\",
                      "      return __VA_ARGS__(); \\", "    } \\"]
    lines += [f"    {refuse} \\", "  }()", "", "#define HEADDIM_SWITCH(HEADDIM, ...) \\", "  [&] { \\"]
    lower = 0
    for dim in HEAD_DIM_CLASSES:
        if dim in head_dims:
            lines += [f"    if ((HEADDIM) > {lower} && (HEADDIM) <= {dim}) {{ \\",
                      f"      constexpr static int kHeadDim = {dim}; \\", "      return __VA_ARGS__(); \\", "    } \\"]
        lower = dim
    lines += [f"    {refuse} \\", "  }()", ""]
    return "\n".join(lines)


_SWITCHES = re.compile(r"#define FP16_SWITCH\(COND, \.\.\.\).*?\}\(\)\s*#define HEADDIM_SWITCH\(HEADDIM, \.\.\.\)"
                       r".*?\}\(\)\n", re.S)


def _unpack(sdist: Path, build_dir: Path) -> Path:
    """The sources unpacked once into ``build_dir``; returns the package root (holds flash_attn/ and csrc/)."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        root = build_dir / top
        if not (root / "csrc" / "flash_attn" / "flash_api.cpp").exists():
            members = [m for m in tar.getmembers() if m.name.startswith((f"{top}/flash_attn/", f"{top}/csrc/flash_attn/",
                                                                         f"{top}/csrc/cutlass/include/"))]
            tar.extractall(build_dir, members=members, filter="data")
    return root


def _patch_switches(root: Path, head_dims: list[int], dtypes: list[str]) -> None:
    """Rewrite static_switch.h's two dispatch switches from flash-attn's original (kept beside it as .orig)."""
    header = root / "csrc" / "flash_attn" / "src" / "static_switch.h"
    original = header.with_suffix(".h.orig")
    if not original.exists():
        original.write_text(header.read_text())
    text = original.read_text()
    if not _SWITCHES.search(text):
        raise SystemExit(f"{header}: FP16_SWITCH / HEADDIM_SWITCH not found as expected; this flash-attn release "
                         "is not one this script knows (2.8.x)")
    patched = _SWITCHES.sub("", text) + "\n// scripts/build_flash_attn.py: the built kernels only\n" + \
        dispatch_switches(head_dims, dtypes)
    if header.read_text() != patched:  # rewritten only when it changes: its time stamp drives ninja's rebuilds
        header.write_text(patched)


def build(sdist: Path, build_dir: Path, head_dims: list[int], dtypes: list[str], arch: str, jobs: int):
    """Compile and import ``flash_attn_2_cuda`` from ``build_dir``; returns the module."""
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    root = _unpack(sdist, build_dir)
    _patch_switches(root, head_dims, dtypes)
    src = root / "csrc" / "flash_attn"
    sources = [str(src / "flash_api.cpp")] + [str(src / "src" / name) for name in kernel_files(head_dims, dtypes)]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise SystemExit(f"kernel sources missing from {sdist}: {missing}")
    os.environ["MAX_JOBS"] = str(jobs)
    objects = build_dir / "objects"
    objects.mkdir(exist_ok=True)
    return load(name="flash_attn_2_cuda", sources=sources, build_directory=str(objects), verbose=True,
                extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=NVCC_FLAGS + ["-gencode", f"arch=compute_{arch},code=sm_{arch}"],
                extra_include_paths=[str(src), str(src / "src"), str(root / "csrc" / "cutlass" / "include")])


def python_path(build_dir: Path) -> str:
    """The PYTHONPATH entries that import this build: flash-attn's package root, then the extension's folder."""
    roots = sorted(p for p in build_dir.glob("flash_attn-*") if (p / "flash_attn").is_dir())
    if not roots:
        raise SystemExit(f"no unpacked flash-attn under {build_dir}; build first")
    return os.pathsep.join([str(roots[-1].resolve()), str((build_dir / "objects").resolve())])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help="flash_attn-2.8.x.tar.gz")
    parser.add_argument("--build-dir", type=Path, required=True)
    parser.add_argument("--head-dims", default="128", help="head-dim classes to build, of 32,64,96,128,192,256")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--arch", default="90", help="one CUDA architecture (90: H100/H200)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--print-path", action="store_true", help="print the PYTHONPATH entries of a finished build")
    args = parser.parse_args(argv)
    if args.print_path:
        print(python_path(args.build_dir))
        return 0
    head_dims = sorted({int(d) for d in args.head_dims.split(",")})
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in head_dims if d not in HEAD_DIM_CLASSES] + [d for d in dtypes if d not in DTYPES]
    if bad or not head_dims or not dtypes:
        parser.error(f"--head-dims from {HEAD_DIM_CLASSES}, --dtypes from {sorted(DTYPES)}; got {bad or 'none'}")
    if args.sdist is None or not args.sdist.exists():
        parser.error(f"--sdist: flash-attn's source package is needed, got {args.sdist}")
    build(args.sdist, args.build_dir, head_dims, dtypes, args.arch, args.jobs)
    print(python_path(args.build_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
