"""GPU training time: nn.LayerNorm vs torch's and normfold's RMSNorm vs CBWC + normfold RMSNorm, the
norm_comparison experiment's width phase on CUDA (issue 18: training at RMSNorm's cost at width ≥ 384).

    bash benchmarks/gpu_train.sh             # one CUDA GPU, 90 s budget: widths 384 and 1024, bf16 and fp32
    bash benchmarks/gpu_train.sh --dry-run   # the same code path on the CPU, the norms on the Triton kernels

Runs ``experiments/norm_comparison.py --width-only --device cuda`` (5 paired seeds, variants in lockstep, each
step timed between two CUDA synchronizations, 95% t-intervals over seeds) and writes
``norm_comparison_width_cuda.md`` / ``.csv`` to ``$OUT`` when set, else to ``experiments/results/``. The dry run
routes every norm call whose dtypes the kernels take to normfold's Triton backend under Triton's interpreter, so
every variant's training steps through the Triton kernels (forward, backward, the fused residual add; CBWC too)
have run before a GPU session spends its minutes on them. On CUDA not every call gets there: a plain eager call of
at most 8M elements that torch's fused norm computes to the contract runs ``F.rms_norm`` / ``F.layer_norm``
(``normfold.ops._library._NATIVE_EAGER_MAX_ELEMENTS``), so the fp32 rows at width 384 time torch's kernels behind
normfold's dispatch; bf16 (autocast, which never takes that route) and width 1024 × 32 × 512 tokens (16M elements)
time the Triton kernels. Extra arguments go to
``norm_comparison.py`` (e.g. ``--widths 768``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# width 384 at the experiment's batch (16 × 128: on a GPU mostly kernel-launch time), then width 1024 at 32 × 512
# tokens, where the GPU's work, the norms' memory traffic among it, sets the step time; bf16 (what GPU training
# runs) before fp32. The budget keeps `make gpu-check` inside a session's device minutes.
GPU_ARGS = ["--width-only", "--device", "cuda", "--widths", "384,1024x32x512", "--precision", "bf16,fp32",
            "--budget-s", "90"]
# the quick setup, one seed, one timed step: the Triton interpreter runs a kernel in seconds, not microseconds
DRY_RUN_ARGS = ["--width-only", "--quick", "--device", "cpu", "--widths", "64,64x2x16", "--precision", "fp32",
                "--seeds", "1", "--wide-steps", "1", "--budget-s", "90"]


def route_norms_to_triton() -> None:
    """Send every CPU norm call the Triton kernels take to ``normfold.ops._triton`` (interpreted), as CUDA calls
    above the native route's size are sent; the eager C++ shortcut, which would answer first, is switched off."""
    import normfold.ops._triton as backend
    from normfold.ops import _library, functional

    original = _library.select_backend

    def select(x, residual=None):
        if x.dtype in backend.launch.KERNEL_DTYPES and (residual is None or residual.dtype == x.dtype):
            route_norms_to_triton.calls += 1
            return backend
        return original(x, residual)

    route_norms_to_triton.calls = 0
    _library.select_backend = select
    functional._eager_cpu_shortcut = False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(ROOT / "experiments"))
    import norm_comparison  # noqa: E402 (the experiments folder is not a package)

    if dry_run:
        route_norms_to_triton()
    out = os.environ.get("OUT") or str(ROOT / "experiments" / "results")
    norm_comparison.main((DRY_RUN_ARGS if dry_run else GPU_ARGS) + ["--out", out] + argv)
    if dry_run:
        print(f"gpu_train: dry run done, {route_norms_to_triton.calls} norm calls on the Triton kernels", flush=True)
        if not route_norms_to_triton.calls:
            print("gpu_train: no norm call reached the Triton kernels: the dry run checked nothing", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
