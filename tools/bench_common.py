"""Timing, inputs and byte counts shared by the measurement scripts in tools/.

Every GPU time is a median: ``bench`` is ``triton.testing.do_bench`` (host included),
``bench_graph`` replays the call captured in a CUDA graph (the kernels alone). The copy ceiling
is a device-to-device copy timed in the same process as what it judges. ``same_bytes_copy_us``
times, in the same harness as the kernels, a plain elementwise kernel that moves a shape's
bytes: at small shapes it is the better yardstick, because the ten captured calls reuse inputs
that stay in the L2 cache.

Bytes counted (the minimum a fused kernel must move, used for every implementation alike):
  forward  = x + gate + out (2 B each per element) + rstd (4 B per row)
  backward = x + gate + dy + dx + dgate (2 B each per element) + rstd (4 B per row)
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import json
import os
import platform
import sys

import torch
import triton
import triton.language as tl

from core.testing.inputs import make_grad_inputs

EPS = 1e-6
DTYPE = torch.bfloat16
DEVICE = "cuda"
GIB = 1 << 30


def log(*args) -> None:
    print(*args, flush=True)


def _is_positive_int(text: str) -> bool:
    return text.isdigit() and int(text) > 0


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """'1x4096x32x128' -> (1, 4096, 32, 128): batch, sequence, heads, head dim."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(_is_positive_int(p) for p in parts):
        raise ValueError(f"shape {text!r}: expected BxSxHxD with four positive integers")
    return tuple(int(p) for p in parts)


def parse_blocks(text: str) -> tuple[tuple[int, int], ...]:
    """'8x1,16x2' -> ((8, 1), (16, 2)) for ``--blocks``: (rows per block, warps) pairs, both
    powers of two; anything else is an error."""
    pairs = [p.strip().lower().split("x") for p in text.split(",")]
    if not all(len(pair) == 2 and all(_is_positive_int(n) and int(n) & (int(n) - 1) == 0
                                      for n in pair) for pair in pairs):
        raise ValueError(f"--blocks {text!r}: expected comma-separated ROWSxWARPS pairs of "
                         "powers of two")
    return tuple((int(rows), int(warps)) for rows, warps in pairs)


def parse_positive_ints(option: str, text: str) -> tuple[int, ...]:
    """'4,8,16' -> (4, 8, 16) for a command-line ``option``; anything but comma-separated
    positive integers is an error."""
    parts = [p.strip() for p in text.split(",")]
    if not all(_is_positive_int(p) for p in parts):
        raise ValueError(f"{option} {text!r}: expected comma-separated positive integers")
    return tuple(int(p) for p in parts)


def shape_label(shape, variant: str = "plain") -> str:
    return "x".join(str(n) for n in shape) + ("" if variant == "plain" else f" {variant}")


def bytes_moved(shape) -> dict:
    """Bytes a fused kernel must move for a [B, S, H, D] bf16 input: forward, backward (both
    with the fp32 rstd per row) and the inference entry (no rstd)."""
    b, s, h, d = shape
    n, rows = b * s * h * d, b * s * h
    return {"fwd": 3 * n * 2 + 4 * rows, "bwd": 5 * n * 2 + 4 * rows, "infer": 3 * n * 2}


def gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def pct_of_ceiling(nbytes: int, us: float, ceiling_gbps: float) -> float:
    return 100 * gbps(nbytes, us) / ceiling_gbps


def make_inputs(shape, variant: str = "plain", seed: int = 0, device=None, dtype=DTYPE):
    """x, gate, weight (leaves requiring grad), dy and the leaves, on ``device`` (default: this
    module's DEVICE): the GPU tests' ``make_grad_inputs``, one definition for both. Of the
    benchmark's variants only "strided_gate" changes the inputs ("sbhd" is the output layout)."""
    inputs = "strided_gate" if variant == "strided_gate" else "plain"
    return make_grad_inputs(shape, inputs, dtype, seed, device or DEVICE)


def bench(fn, rep: int = 100) -> float:
    """Median time of ``fn()`` in us (triton.testing.do_bench). Each call follows do_bench's L2
    flush, a ~60 us kernel behind which a short call's host work hides: this is not a host cost
    (tools/host_cost.py measures that)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def capture(fn, calls: int = 1, warmup: int = 3):
    """Warm ``fn`` up on a side stream (as CUDA-graph capture requires), then capture ``calls``
    back-to-back calls in one graph; returns the graph and the last call's outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            outputs = fn()
    return graph, outputs


def bench_graph(fn, calls: int = 10, rep: int = 50) -> float:
    """GPU time of one call in us with the host out of the picture: ``calls`` back-to-back
    calls captured in one CUDA graph and replayed."""
    graph, _ = capture(fn, calls)
    us = bench(graph.replay, rep=rep) / calls
    del graph
    return us


@triton.jit
def _same_bytes_copy(a, b, c, summed, copied, N, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    """Forward's bytes: read a, b, write a + b. BACKWARD's: also read c and write it to copied."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    first = tl.load(a + offsets, mask=mask)
    total = (first.to(tl.float32) + tl.load(b + offsets, mask=mask).to(tl.float32)).to(first.dtype)
    if BACKWARD:
        tl.store(copied + offsets, tl.load(c + offsets, mask=mask), mask=mask)
    tl.store(summed + offsets, total, mask=mask)


SAME_BYTES_BLOCK, SAME_BYTES_WARPS = 2048, 8  # the forward's block: 8 elements per thread


def same_bytes_copy(tensors: tuple, backward: bool, new_outputs: bool = False) -> tuple:
    """One launch of the copy kernel on five flat tensors of one size (a, b, c, summed, copied):
    the forward's element bytes (2 read, 1 written) or the backward's (3 read, 2 written).
    Returns what it wrote: ``(summed, copied)``, copied None for the forward. ``new_outputs``:
    into tensors allocated for this call, as every implementation timed allocates its results
    (a graph of captured calls keeps one call's outputs while the next runs, so the calls cycle
    through two sets, which at some sizes no longer fit the L2 with the inputs), instead of the
    last two of ``tensors``."""
    a, b, c, summed, copied = tensors
    if new_outputs:
        summed = torch.empty_like(a)
        copied = torch.empty_like(c) if backward else summed
    n = a.numel()
    _same_bytes_copy[(triton.cdiv(n, SAME_BYTES_BLOCK),)](a, b, c, summed, copied, n,
                                                          BACKWARD=backward,
                                                          BLOCK=SAME_BYTES_BLOCK,
                                                          num_warps=SAME_BYTES_WARPS)
    return summed, copied if backward else None


def same_bytes_tensors(shape, device=None) -> tuple:
    """The five flat bf16 tensors ``same_bytes_copy`` takes, of a [B, S, H, D] shape's size."""
    n = shape[0] * shape[1] * shape[2] * shape[3]
    return tuple(torch.randn(n, device=device or DEVICE, dtype=DTYPE) for _ in range(5))


def same_bytes_copy_us(shape) -> dict:
    """GPU time (``bench_graph``) of a kernel that moves a [B, S, H, D] bf16 shape's element bytes
    of each phase with no arithmetic but one add (rstd's 4 bytes per row aside), into outputs it
    allocates per call as the implementations do: what a kernel can reach at this size in this
    harness."""
    tensors = same_bytes_tensors(shape)
    return {phase: bench_graph(lambda backward=backward: same_bytes_copy(tensors, backward,
                                                                         new_outputs=True))
            for phase, backward in (("fwd", False), ("bwd", True))}


def copy_ceiling() -> dict:
    """Device-to-device copy of 2 GiB of bf16 each way (far past the L2): us and GB/s counting
    bytes read + written."""
    n = GIB
    src = torch.randn(n, device=DEVICE, dtype=DTYPE)
    dst = torch.empty_like(src)
    us = bench(functools.partial(dst.copy_, src), rep=200)  # no closure: del frees the tensors
    result = {"us": us, "GBps": gbps(2 * n * src.element_size(), us)}
    del src, dst
    torch.cuda.empty_cache()
    return result


def load_fla_rms_norm_gated():
    """FLA's gated RMSNorm and fla-core's version, or (None, None) when fla-core is absent."""
    try:
        import fla
        from fla.modules.fused_norm_gate import rms_norm_gated
    except ImportError as e:
        log(f"fla-core not importable ({e}); FLA peer skipped")
        return None, None
    return rms_norm_gated, getattr(fla, "__version__", "?")


MEGATRON_MAIN_MODULE = "megatron.core.fusions.fused_gated_norm"
MEGATRON_MAIN_FLAG = "--megatron-fused-gated-norm"
_MEGATRON_MAIN_FILE_MODULE = "_benchmark_megatron_main_fused_gated_norm"


def load_megatron_main_fused_gated_norm(path: str | None = None):
    """Megatron-LM main's ``fused_gated_norm(x, gate, weight, eps, zero_centered=False,
    gate_activation="silu")`` and where it came from: ``(fn, source)``, or ``(None, why)`` when
    it is absent. ``path`` (``--megatron-fused-gated-norm``): a .py file defining it, loaded
    under a private module name; it takes precedence over the installed module. Without a
    path: the installed ``megatron.core.fusions.fused_gated_norm``, absent from megatron-core
    releases up to 0.19. A path that does not name an existing .py file, a file that fails to
    load, or one that defines no callable ``fused_gated_norm`` is a ValueError."""
    if path is not None:
        return _load_fused_gated_norm_file(path), f"file {os.path.abspath(path)}"
    hint = f"{MEGATRON_MAIN_FLAG} FILE.py times Megatron-LM main's file"
    try:
        module = importlib.import_module(MEGATRON_MAIN_MODULE)
    except ImportError as e:
        if getattr(e, "name", None) == MEGATRON_MAIN_MODULE:
            return None, f"{_megatron_version()} has no {MEGATRON_MAIN_MODULE}; {hint}"
        return None, f"{MEGATRON_MAIN_MODULE} not importable ({e}); {hint}"
    fn = getattr(module, "fused_gated_norm", None)
    if not callable(fn):
        return None, f"{MEGATRON_MAIN_MODULE} defines no callable fused_gated_norm"
    return fn, f"module {MEGATRON_MAIN_MODULE} ({_megatron_version()})"


def _megatron_version() -> str:
    try:
        from megatron.core import __version__
    except ImportError:
        return "the installed megatron"
    return f"megatron-core {__version__}"


def _load_fused_gated_norm_file(path: str):
    """``fused_gated_norm`` of the .py file at ``path`` (ValueError naming the flag otherwise)."""
    rule = "must name an existing .py file that defines a callable fused_gated_norm"
    if not os.path.isfile(path) or not path.endswith(".py"):
        what = ("a folder" if os.path.isdir(path) else
                "not a .py file" if os.path.isfile(path) else "no such file")
        raise ValueError(f"{MEGATRON_MAIN_FLAG} {path!r}: {what}; the path {rule}")
    spec = importlib.util.spec_from_file_location(_MEGATRON_MAIN_FILE_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MEGATRON_MAIN_FILE_MODULE] = module  # as an import would: found by its name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[_MEGATRON_MAIN_FILE_MODULE]
        raise ValueError(f"{MEGATRON_MAIN_FLAG} {path!r}: loading it raised "
                         f"{type(e).__name__}: {e}; the path {rule}") from e
    fn = getattr(module, "fused_gated_norm", None)
    if not callable(fn):
        del sys.modules[_MEGATRON_MAIN_FILE_MODULE]
        found = "not callable" if hasattr(module, "fused_gated_norm") else "not defined"
        raise ValueError(f"{MEGATRON_MAIN_FLAG} {path!r}: fused_gated_norm is {found} there; "
                         f"the path {rule}")
    return fn


def environment(**extra) -> dict:
    """GPU, versions and date recorded with every result."""
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "date": datetime.date.today().isoformat(), **extra}


def write_json(results: dict, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    return path


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")


def measure_and_write(argv, doc: str, key: str, measure) -> dict:
    """The command line of a script that takes one measurement: ``--out DIR`` (default
    out/benchmark); writes ``DIR/<key>.json`` with the environment and ``measure()``."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", default="out/benchmark", help=f"folder for {key}.json")
    args = parser.parse_args(argv)
    require_cuda(f"{key}.py")
    results = {"env": environment(), key: measure()}
    log(json.dumps(results, indent=1))
    log(f"wrote {write_json(results, args.out, f'{key}.json')}")
    return results
