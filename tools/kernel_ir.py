"""Compile the fused kernels for an sm_90 GPU (H100/H200) on any machine, no GPU needed, and
report what the GPU would run: for the gated norm the layout of the row reduction and the SASS
size, for the pre-recurrence region registers, spills, shared memory, programs per SM and the
SASS size of each loop.

    python tools/kernel_ir.py --dim 128 --bt 16 --warps 8 [--bt 8 --warps 2] [--unaligned]
    python tools/kernel_ir.py --kernel bwd --dim 128 --bt 8 --warps 4 --dump /tmp/ir
    python tools/kernel_ir.py --kernel pre_gdr_bwd --value-heads 32 --bt 4 --warps 1 \
                              [--stages 1] [--bt 4 --warps 2 --stages 2]

Each ``--bt``/``--warps`` pair is one launch configuration; the arguments are exactly the ones
``forward_impl`` / ``backward_impl`` pass (their launch is recorded, not run). ``row_layout`` is
the reduction operand's layout along the row (sizePerThread, threadsPerWarp, warpsPerCTA of the
last axis): it decides the order of a row's fp32 sum of squares, so two configurations with the
same row layout give every row the same bits (docs/design.md, Launch choices).
``exp2_instructions``: the PTX ``ex2`` forms the gate activation compiles to. ``--unaligned``
offsets every [B, S, H, D] tensor by one element (no 16-byte alignment); ``--dw-sum-as-usual``
launches the backward's dW sum as usual (``backward_impl(dw_sum_pdl=False)``) instead of early.
``pre_gdr_fwd`` / ``pre_gdr_bwd``: the region's kernels at Qwen3-Next's per-rank sizes with
``--value-heads`` (bf16, B = 1, the bshd view of an sbhd in_proj output) under ``launch_for``'s
launch at S = 4096, with the given tokens per program (forward) or per loop step (backward) as
``--bt``, warps, and loop stages (``--stages``, backward); ``programs_per_sm`` is what an H100 /
H200 SM holds at once (registers, shared memory, warp and program limits). Uses Triton
internals (``create_function_from_signature``, ``ASTSource``) as of Triton 3.7; prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Run as a script: compile, never interpret (before triton is imported). Imported (by
# tests/fusions/test_gated_norm_compile.py), it leaves the environment as it is.
if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton._utils import find_paths_if, get_iterable_path  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import core.fusions.fused_gated_norm as fgn  # noqa: E402
import core.fusions.fused_pre_gated_delta_rule as region  # noqa: E402
import core.fusions.gated_norm_kernels as kernels  # noqa: E402
import core.fusions.gated_norm_launch as launch_rules  # noqa: E402
import core.fusions.gated_norm_plans as plans  # noqa: E402
import core.fusions.gated_norm_validation as validation  # noqa: E402
from core.testing.h200 import h200_device_rules  # noqa: E402
from tools.pre_gdr_benchmark import DK, DV, WIDTH, region_inputs  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Recorder:
    """Stands in for a @triton.jit kernel inside a DirectLauncher: keeps the launch arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


@contextlib.contextmanager
def recording(launcher):
    """While open, ``launcher`` (a DirectLauncher) runs nothing and appends the ``(args,
    kwargs)`` of each kernel launch to the yielded list; nothing it compiled before is used."""
    kernel, compiled = launcher.kernel, launcher.compiled
    launcher.kernel, launcher.compiled = _Recorder(), {}
    try:
        yield launcher.kernel.launches
    finally:
        launcher.kernel, launcher.compiled = kernel, compiled


@contextlib.contextmanager
def h200_launch_rules():
    """While open, forward_impl / backward_impl take the launch parameters an H200 gets (132
    SMs, its DRAM bandwidth, sm_90: pipelining and programmatic dependent launch) for tensors on
    any device."""
    gpu = torch.device("cuda", 0)
    saved = (plans.forward_launch, plans.backward_launch, dict(plans._launch_plans))
    plans.forward_launch = lambda dim, device: launch_rules.forward_launch(dim, gpu)
    plans.backward_launch = lambda dim, device: launch_rules.backward_launch(dim, gpu)
    plans._launch_plans.clear()
    try:
        with h200_device_rules():
            yield
    finally:
        plans.forward_launch, plans.backward_launch, kept = saved
        plans._launch_plans.clear()
        plans._launch_plans.update(kept)


def sm90_binder(kernel, do_not_specialize=kernels.PER_STEP_ARGS):
    """Triton's own argument binder for ``kernel`` (a @triton.jit function; the gated norm's
    kernels leave ``do_not_specialize`` unspecialised) and an sm_90 target: ``binder(*args,
    **kwargs) -> (bound, specialization, options)``, the specialisation and options being the
    compiled-kernel cache key. Built from the kernel's Python source, so it works with the
    interpreter on too; returns (binder, jit, backend)."""
    jit = JITFunction(getattr(kernel, "fn", kernel), do_not_specialize=do_not_specialize)
    if isinstance(jit.fn, JITFunction):
        jit = jit.fn
    backend = make_backend(SM90)
    return create_function_from_signature(jit.signature, jit.params, backend), jit, backend


def _tensor(shape, dtype, unaligned):
    numel = 1
    for s in shape:
        numel *= s
    flat = torch.zeros(numel + unaligned, dtype=dtype)
    return flat[unaligned:].view(shape)


KERNELS = {"fwd": "gated_norm_fwd", "bwd": "gated_norm_bwd", "dw_sum": "gated_norm_dw_sum"}


def launch_arguments(kernel: str, dim: int, dtype: torch.dtype, bt: int, warps: int,
                     unaligned: bool = False, dw_sum_pdl: bool | None = None) -> tuple[tuple, dict]:
    """The arguments forward_impl (kernel "fwd") or backward_impl ("bwd", and "dw_sum", its
    second launch; ``dw_sum_pdl`` as backward_impl takes it) passes to that kernel for a
    [2, 64, 4, dim] input with this block, under the H200's launch rules."""
    shape = (2, 64, 4, dim)
    x, gate, dy = (_tensor(shape, dtype, int(unaligned)) for _ in range(3))
    weight = torch.ones(dim, dtype=dtype)
    with h200_launch_rules(), _cpu_tensors_pass_validation():
        return _recorded_launch(kernel, x, gate, weight, dy, bt, warps, unaligned, dw_sum_pdl)


@contextlib.contextmanager
def _cpu_tensors_pass_validation():
    """The launches are recorded from CPU tensors, never run: while open, the wrappers' input
    checks take CPU tensors, as under the interpreter (the kernels compile for sm_90 all the
    same)."""
    saved = validation.INTERPRETED
    validation.INTERPRETED = True
    try:
        yield
    finally:
        validation.INTERPRETED = saved


def _recorded_launch(kernel, x, gate, weight, dy, bt, warps, unaligned, dw_sum_pdl):
    shape, dtype = x.shape, x.dtype
    if kernel == "fwd":
        with recording(plans.launch_forward) as launches:
            fgn.forward_impl(x, gate, weight, 1e-6, bt=bt, warps=warps,
                             out=_tensor(shape, dtype, int(unaligned)))
        return launches[0]
    rstd = torch.ones(shape[:3])
    with recording(plans.launch_backward) as main, recording(plans.launch_dw_sum) as dw_sum:
        fgn.backward_impl(x, gate, weight, rstd, dy, bt=bt, warps=warps, dw_sum_pdl=dw_sum_pdl)
    return (dw_sum if kernel == "dw_sum" else main)[0]


def compile_sm90(kernel, args: tuple, kwargs: dict):
    """What JITFunction.run compiles for these arguments, for an sm_90 target (``kernel``: a
    name of KERNELS, or a region kernel)."""
    if isinstance(kernel, str):
        binder, jit, backend = sm90_binder(getattr(kernels, KERNELS[kernel]))
    else:
        binder, jit, backend = sm90_binder(kernel, do_not_specialize=())
    bound, specialization, options = binder(*args, **kwargs)
    kinds = [s[0] for s in specialization]
    constexprs = {path: get_iterable_path(list(bound.values()), path)
                  for path in find_paths_if(kinds, lambda _, v: v == "constexpr")}
    attrs = [s[1] for s in specialization]
    attrs = {path: backend.parse_attr(get_iterable_path(attrs, path))
             for path in find_paths_if(attrs, lambda _, v: isinstance(v, str))}
    source = ASTSource(jit, dict(zip([p.name for p in jit.params], kinds)), constexprs, attrs)
    return triton.compile(source, target=SM90, options=dict(options))


def row_layouts(ttgir: str) -> list[dict]:
    """Per ``tt.reduce`` along axis 1: the operand's layout along the row."""
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*)\}>", ttgir, re.M))
    found = []
    reduce_operand_layout = (r'"tt\.reduce".*?<\{axis = 1 : i32\}>.*?\}\) : '
                             r'\(tensor<[^,]*, (#\w+)>')
    for layout in re.findall(reduce_operand_layout, ttgir, re.S):
        fields = dict(re.findall(r"(\w+) = \[([\d, ]*)\]", layouts[layout]))
        found.append({k: int(fields[k].split(",")[-1]) for k in
                      ("sizePerThread", "threadsPerWarp", "warpsPerCTA")})
    return found


def _cuobjdump(cubin: bytes, option: str) -> str:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump), option, f.name], check=True,
                              capture_output=True, text=True).stdout


SASS_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(\S.*?);", re.M)  # address, text


def sass_instructions(cubin: bytes) -> int:
    return len(SASS_INSTRUCTION.findall(_cuobjdump(cubin, "-sass")))


def describe(kernel: str, dim: int, dtype: str, bt: int, warps: int, unaligned: bool,
             dump: str | None = None, dw_sum_pdl: bool | None = None) -> dict:
    compiled = compile_sm90(kernel, *launch_arguments(kernel, dim, DTYPES[dtype], bt, warps,
                                                      unaligned, dw_sum_pdl))
    if dump:
        suffix = "_unaligned" if unaligned else ""
        base = Path(dump) / f"{kernel}_d{dim}_{dtype}_bt{bt}_w{warps}{suffix}"
        base.parent.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            base.with_suffix(f".{ext}").write_text(compiled.asm[ext])
    return {"kernel": kernel, "dim": dim, "dtype": dtype, "bt": bt, "warps": warps,
            "unaligned": unaligned, "row_layout": row_layouts(compiled.asm["ttgir"]),
            "sass_instructions": sass_instructions(compiled.asm["cubin"]),
            "launch_pdl": bool(compiled.metadata.launch_pdl),
            "waits_before_loading": before_loading(compiled.asm["ptx"], "griddepcontrol.wait"),
            "launches_dependents": "griddepcontrol.launch_dependents" in compiled.asm["ptx"],
            "launches_dependents_before_loading": before_loading(
                compiled.asm["ptx"], "griddepcontrol.launch_dependents"),
            "exp2_instructions": sorted(set(re.findall(r"ex2\.approx[.\w]*", compiled.asm["ptx"])))}


def before_loading(ptx: str, instruction: str) -> bool:
    """Whether ``instruction`` comes before the kernel's first load from global memory:
    griddepcontrol.wait must, in a kernel launched with programmatic dependent launch;
    griddepcontrol.launch_dependents there lets the next kernel launch as soon as the program
    starts."""
    found = ptx.find(instruction)
    load = min((i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0), default=-1)
    return found >= 0 and (load < 0 or found < load)


# ----------------------------------------------------------------------------------------------
# The pre-recurrence region's kernels
# ----------------------------------------------------------------------------------------------

REGION_KERNELS = ("pre_gdr_fwd", "pre_gdr_bwd")
REGION_SEQ = 256  # tokens of the recorded launch (the kernels do not specialise on the count)
# An sm_90 SM (CUDA's occupancy rules): registers per sub-partition (4 per SM), allocated per
# warp in units of 256; shared memory, 1 KB of it reserved per program; programs; warps.
SUB_PARTITION_REGISTERS, SM_SHARED, SHARED_RESERVED, SM_PROGRAMS, SM_WARPS = (
    16384, 233472, 1024, 32, 64)


def region_shape(value_heads: int):
    """The region's sizes at Qwen3-Next's per-rank head dims and conv width (the benchmark's)."""
    return region.RegionShape(value_heads // 2, value_heads, DK, DV, WIDTH)


def region_launch_arguments(kernel: str, value_heads: int, launch) -> tuple[tuple, dict]:
    """The arguments forward_impl (``pre_gdr_fwd``) or backward_impl (``pre_gdr_bwd``) passes
    at these sizes under ``launch`` (a ``Launch``), recorded from CPU tensors, never run."""
    qkvzba, weight, a_log, dt_bias = region_inputs(1, REGION_SEQ, value_heads, device="cpu")
    inputs = (qkvzba, weight, None, a_log, dt_bias, region_shape(value_heads))
    saved = (region.launch_for, region.pre_gdr_fwd, region.pre_gdr_bwd, region.pre_gdr_bwd_sums)
    recorder = _Recorder()
    region.launch_for = lambda *_: launch
    region.pre_gdr_fwd = region.pre_gdr_bwd = recorder
    region.pre_gdr_bwd_sums = _Recorder()
    try:
        if kernel == "pre_gdr_fwd":
            region.forward_impl(*inputs)
        else:
            q = torch.zeros(1, REGION_SEQ, value_heads, DK, dtype=torch.bfloat16)
            g = torch.zeros(1, REGION_SEQ, value_heads)
            region.backward_impl(*inputs, q, q, q, g, g.to(torch.bfloat16))
    finally:
        (region.launch_for, region.pre_gdr_fwd, region.pre_gdr_bwd,
         region.pre_gdr_bwd_sums) = saved
    return recorder.launches[0]


def resource_usage(cubin: bytes) -> dict:
    """Registers and stack (spill) bytes per thread of the cubin's kernel."""
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1))}


def loop_instructions(sass: str) -> list[int]:
    """The SASS instruction count of each loop body (a branch back to a lower address), in code
    order: the region's backward has its q/k head's token loop first, then its v head's."""
    instructions = [(int(a, 16), text) for a, text in SASS_INSTRUCTION.findall(sass)]
    loops = []
    for end, text in instructions:
        branch = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < end:
            start = int(branch.group(1), 16)
            loops.append(sum(start <= a <= end for a, _ in instructions))
    return loops


def programs_per_sm(registers: int, warps: int, shared_bytes: int) -> int:
    """Programs of ``warps`` warps an sm_90 SM holds at once."""
    warp_registers = -(-registers * 32 // 256) * 256
    by_registers = 4 * (SUB_PARTITION_REGISTERS // warp_registers) // warps
    by_shared = SM_SHARED // (shared_bytes + SHARED_RESERVED)
    return min(by_registers, by_shared, SM_PROGRAMS, SM_WARPS // warps)


def describe_region(kernel: str, value_heads: int, bt: int, warps: int, stages: int = 1,
                    dump: str | None = None) -> dict:
    """The compiled ``kernel`` at ``value_heads`` under launch_for's launch at S = 4096 with
    ``bt`` tokens per program (forward) or per loop step (backward), ``warps`` and ``stages``;
    ``dump``: a folder for its TTGIR, PTX and SASS."""
    launch = region.launch_for(region_shape(value_heads), 4096)
    if kernel == "pre_gdr_fwd":
        launch = launch._replace(forward_tokens=bt, forward_warps=warps)
    else:
        launch = launch._replace(backward_rows=bt, backward_warps=warps, backward_stages=stages)
    compiled = compile_sm90(getattr(region, kernel),
                            *region_launch_arguments(kernel, value_heads, launch))
    usage = resource_usage(compiled.asm["cubin"])
    shared = compiled.metadata.shared
    sass = _cuobjdump(compiled.asm["cubin"], "-sass")
    if dump:
        base = Path(dump) / f"{kernel}_hv{value_heads}_bt{bt}_w{warps}_s{stages}"
        base.parent.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            base.with_suffix(f".{ext}").write_text(compiled.asm[ext])
        base.with_suffix(".sass").write_text(sass)
    return {"kernel": kernel, "value_heads": value_heads, "bt": bt, "warps": warps,
            "stages": stages, **usage, "shared_bytes": shared,
            "programs_per_sm": programs_per_sm(usage["registers"], warps, shared),
            "sass_instructions": len(SASS_INSTRUCTION.findall(sass)),
            "loop_instructions": loop_instructions(sass)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=tuple(KERNELS) + REGION_KERNELS, default="fwd",
                        help="dw_sum: the backward's dW sum, for the backward block --bt/--warps")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--bt", type=int, action="append", required=True,
                        help="rows per block (pre_gdr_bwd: tokens per loop step)")
    parser.add_argument("--warps", type=int, action="append", required=True)
    parser.add_argument("--stages", type=int, action="append",
                        help="pre_gdr_bwd: loop stages, one per --bt (default: 1 each)")
    parser.add_argument("--value-heads", type=int, default=32,
                        help="pre_gdr_*: value heads per rank, even")
    parser.add_argument("--unaligned", action="store_true")
    parser.add_argument("--dw-sum-as-usual", action="store_true",
                        help="the backward's dW sum launched as usual, not early (programmatic "
                             "dependent launch)")
    parser.add_argument("--dump", help="folder for the TTGIR and PTX (pre_gdr_*: and SASS) of "
                                       "each configuration")
    args = parser.parse_args(argv)
    stages = args.stages or [1] * len(args.bt)
    if len(args.bt) != len(args.warps) or len(stages) != len(args.bt):
        parser.error("give one --warps (and --stages, if any) per --bt")
    if not 1 <= args.dim <= launch_rules.MAX_HEAD_DIM:
        parser.error(f"--dim must be in [1, {launch_rules.MAX_HEAD_DIM}], got {args.dim}")
    powers = [("--warps", args.warps)]
    if args.kernel != "pre_gdr_bwd":  # its tokens per step are any count
        powers.append(("--bt", args.bt))
    for name, values in powers:
        if any(v < 1 or v & (v - 1) for v in values):
            parser.error(f"{name} must be powers of two, got {values}")
    if args.kernel in REGION_KERNELS:
        if args.value_heads < 2 or args.value_heads % 2 or min(args.bt + stages) < 1:
            parser.error("--value-heads must be even and positive, --bt and --stages positive")
        reports = [describe_region(args.kernel, args.value_heads, bt, warps, st, args.dump)
                   for bt, warps, st in zip(args.bt, args.warps, stages)]
    else:
        reports = [describe(args.kernel, args.dim, args.dtype, bt, warps, args.unaligned,
                            args.dump, False if args.dw_sum_as_usual else None)
                   for bt, warps in zip(args.bt, args.warps)]
    print(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
