"""The Triton kernels compile for a real GPU (sm_90, H100/H200) without one: Triton lowers them
to PTX and its bundled ptxas assembles the cubin. The interpreter tests run the kernels' math;
this catches what only the compiler sees (types of loop-carried values, layouts, register
allocation). Runs in a subprocess because TRITON_INTERPRET, set for the other tests, makes
``@triton.jit`` build interpreter functions at import.

``python tests/ops/test_triton_compile.py`` prints registers and spills per launch plan (from
``ptxas -v``), the numbers behind the warp tables in ``normfold/ops/_triton/launch.py``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# (kernel, hidden size, data dtype, flags): one-block and looped forward, backward and row sums,
# RMS and LN with every option, half and full precision.
VARIANTS = [
    ("fwd", 4096, "bf16", dict(IS_RMS=True, HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False)),
    ("fwd", 1024, "fp16", dict(IS_RMS=False, HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=True)),
    ("fwd", 32768, "bf16", dict(IS_RMS=False, HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=True)),
    ("fwd", 32768, "fp32", dict(IS_RMS=True, HAS_RESIDUAL=False, HAS_WEIGHT=False, HAS_BIAS=False)),
    ("bwd", 256, "bf16", dict(IS_RMS=False, HAS_DS=True, HAS_WEIGHT=True, HAS_BIAS=True)),
    ("bwd", 8192, "fp32", dict(IS_RMS=True, HAS_DS=False, HAS_WEIGHT=True, HAS_BIAS=False)),
    ("bwd", 32768, "bf16", dict(IS_RMS=False, HAS_DS=True, HAS_WEIGHT=True, HAS_BIAS=True)),
    ("bwd", 131072, "fp16", dict(IS_RMS=True, HAS_DS=False, HAS_WEIGHT=False, HAS_BIAS=False)),
    ("row_sums", 32768, "bf16", dict(IS_RMS=False, HAS_WEIGHT=True)),
    ("row_sums", 131072, "fp16", dict(IS_RMS=True, HAS_WEIGHT=False)),
]
FP32_POINTERS = {"MEAN", "RSTD", "SUM_G_XHAT", "SUM_G", "DW_PARTIAL", "DB_PARTIAL"}
FLOAT_SCALARS = {"eps", "offset"}
INT_SCALARS = {"M", "N", "rows_per_program"}


def compile_variant(kind: str, hidden: int, dtype: str, flags: dict):
    """Compile one kernel for sm_90; returns (launch plan, compiled kernel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from normfold.ops._triton import kernels, launch

    backward = kind != "fwd"
    plan = launch.plan_launch(hidden, launch.BWD_MAX_BLOCK if backward else launch.FWD_MAX_BLOCK, backward=backward)
    kernel = {"fwd": kernels.norm_fwd_kernel, "bwd": kernels.norm_bwd_kernel,
              "row_sums": kernels.norm_bwd_row_sums_kernel}[kind]
    constexprs = dict(flags, BLOCK_N=plan.block_n)
    if kind == "fwd":
        constexprs.update(LOOPED=plan.looped, BLOCK_M=plan.block_m)
    if kind == "bwd":
        constexprs.update(ROW_SUMS_GIVEN=plan.looped, BLOCK_M=plan.block_m)
    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        elif name in INT_SCALARS:
            signature[name] = "i32"
        else:  # every other argument is a pointer
            signature[name] = "*fp32" if name in FP32_POINTERS else f"*{dtype}"
    assert set(constexprs) == {k for k, v in signature.items() if v == "constexpr"}, (kind, constexprs)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": plan.num_warps})
    return plan, compiled


def ptxas_usage(compiled) -> tuple[int, int]:
    """(registers a thread, spill-store bytes) reported by ``ptxas -v`` for the kernel's PTX."""
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True).stderr
    regs, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    return int(regs.group(1)), int(spills.group(1))


def main(report_registers: bool) -> int:
    for kind, hidden, dtype, flags in VARIANTS:
        plan, compiled = compile_variant(kind, hidden, dtype, flags)
        assert compiled.asm.get("cubin"), f"{kind} {hidden} {dtype}: no cubin"
        line = f"ok {kind} N={hidden} {dtype} {plan}"
        if report_registers:
            regs, spills = ptxas_usage(compiled)
            line += f" registers={regs} spill_bytes={spills}"
        print(line, flush=True)
    return 0


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's notice; keeps its default
    done = subprocess.run([sys.executable, __file__, "--quiet"], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr and "No such file" in done.stderr:
        pytest.skip("this Triton build ships no ptxas")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok ") == len(VARIANTS)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main(report_registers="--quiet" not in sys.argv))
