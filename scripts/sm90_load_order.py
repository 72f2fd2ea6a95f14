"""The order in which a decode kernel issues its global loads before the predecessor wait, compiled for sm_90 here
(no GPU needed: Triton's compiler with its bundled ``ptxas`` and ``nvdisasm``).

Usage (repo root, triton installed)::

    python scripts/sm90_load_order.py entry        # the norm-fused GDN entry projection (35B-A3B shape, conv)
    python scripts/sm90_load_order.py attention-entry
    python scripts/sm90_load_order.py moe          # the persistent MoE block

Compiles the kernel as the JIT specialises it at its 35B-A3B launch (pointers and the sizes the JIT sees as
multiples of 16 carry ``tt.divisibility``: without it the loads come out as 2-byte ones), prints the registers and
spills ``ptxas`` reports, then every global load of the SASS up to ``ACQBULK`` (``griddepcontrol.wait``) as its
base register and offset. Round 13 found the entry projection's two 2 KB halves of a weight row issued apart
(``[R46] ... [R46+0x800]`` several loads later) in one form and back to back in another, 0.03–0.08 ms of the step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SIZES_OF_16 = {"hidden_stride", "pending_stride", "width", "out_features", "conv_channels", "cache_slot_stride",
               "num_experts", "hidden", "inner", "shared_inner", "act_stride"}


def _entry(conv: bool) -> tuple:
    from ninfer.kernels.triton.norm_gemv import _add_norm_gemv_kernel

    pointers = {"slots_ptr": "*i64"}
    constants = dict(TOKENS=1, ROWS=8, BLOCK_K=2048, WHOLE_ROW=True, HAS_PENDING=True, KEEP_NORMED=False, CONV=conv,
                     WINDOW=3, PDL=True)
    return _add_norm_gemv_kernel, pointers, constants, dict(num_warps=4, num_stages=2)


def _moe() -> tuple:
    from ninfer.kernels.triton.moe_persistent import _persistent_moe_kernel

    pointers = {"logits_ptr": "*fp32", "counter_ptr": "*i32", "trace_ptr": "*i64"}
    constants = dict(TOP_K=8, TOP_K_PAD=8, BLOCK_E=256, NARROW_KEYS=True, ROUTER_ROWS=1, BLOCK_H=2048,
                     GATE_UP_ROWS=4, DOWN_ROWS=8, DOWN_AHEAD=1, BLOCK_I=512, NORM=True, HAS_PENDING=True, PHASE=-1,
                     PDL=True, TRACE=False)
    return _persistent_moe_kernel, pointers, constants, dict(num_warps=8, num_stages=3, maxnreg=128)


KERNELS = {"entry": lambda: _entry(True), "attention-entry": lambda: _entry(False), "moe": _moe}


def compile_sass(kernel, pointers: dict, constants: dict, options: dict) -> tuple[str, str]:
    """``(ptxas report, SASS)`` of ``kernel`` for sm_90a (other pointers bf16, other scalars i32, ``eps`` fp32)."""
    signature, attributes = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
        if name.endswith("_ptr") or name in SIZES_OF_16:
            attributes[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attributes)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx, "w") as handle:
            handle.write(compiled.asm["ptx"])
        registers = ["--maxrregcount", str(options["maxnreg"])] if "maxnreg" in options else []
        report = subprocess.run([os.path.join(NVIDIA_BIN, "ptxas"), "-arch=sm_90a", "-v", *registers, ptx, "-o",
                                 cubin], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(NVIDIA_BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    return report, sass


def loads_before_wait(sass: str) -> list[str]:
    """The global loads up to the first ``ACQBULK``: ``WIDTH [base+offset]`` each, in issue order."""
    loads = []
    for line in sass.splitlines():
        if "ACQBULK" in line:
            break
        match = re.search(r"LDG\.E(\.\w+)*\s.*?\[(R\d+)\.64([^\]]*)\]", line)
        if match:
            width = re.search(r"LDG(\.\w+)+", line).group(0)
            loads.append(f"{width} [{match.group(2)}{match.group(3)}]")
    return loads


def main(name: str = "entry") -> int:
    if name not in KERNELS:
        print(f"unknown kernel {name!r}; one of {', '.join(KERNELS)}", file=sys.stderr)
        return 2
    report, sass = compile_sass(*KERNELS[name]())
    print(" ".join(line.strip() for line in report.splitlines() if "registers" in line or "spill" in line))
    for index, load in enumerate(loads_before_wait(sass)):
        print(f"{index:3d} {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
