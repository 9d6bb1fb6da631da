"""Without a GPU, every Triton kernel runs through the interpreter (set before triton loads) and
megatron runs on core.testing.cpu's shims, layer and training level, with the torch stand-ins
of FLA's GDN kernels: installed here for the whole run. Where a GPU is visible nothing is patched.
Tests marked ``gpu`` need a CUDA GPU; without one they are collected and skipped. Tests marked
``cpu_shims`` build megatron's layers on the CPU shims of core.testing in the test process, and
tests marked ``interpreter`` run kernels on CPU tensors there; where a GPU is visible both are
skipped (``CUDA_VISIBLE_DEVICES=`` runs them there). Tests marked ``interpreter_backward`` run
the backward kernel in the interpreter (here or in CPU subprocesses): skipped, with the reason,
where the installed Triton's interpreter cannot run its row loop."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Installed once, before any test module is imported, so that a test sees the same
    # megatron whichever other tests were collected (the shims patch modules process-wide).
    from core.testing.cpu import install_cpu_fla_stand_ins, install_cpu_shims

    install_cpu_shims(training=True)
    install_cpu_fla_stand_ins()


def pytest_collection_modifyitems(config, items):
    cpu_only = ("needs a process that sees no GPU: `CUDA_VISIBLE_DEVICES= python -m pytest tests` "
                "(tests/README.md)")
    if HAS_CUDA:
        skips = {"cpu_shims": "runs megatron's layers on the CPU shims (Triton interpreter, gloo), "
                              "which " + cpu_only,
                 "interpreter": "runs kernels on CPU tensors (Triton interpreter), which "
                                + cpu_only}
    else:
        skips = {"gpu": "needs a CUDA GPU (gpu marker): run `python -m pytest -m gpu tests` on a "
                        "machine with one (tests/README.md)"}
    if any(item.get_closest_marker("interpreter_backward") for item in items):
        from core.fusions.fused_gated_norm import interpreter_loop_problem

        if interpreter_loop_problem():
            skips["interpreter_backward"] = interpreter_loop_problem()
    for item in items:
        for marker, reason in skips.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def model_parallel_tp1():
    """megatron's parallel_state at TP 1 over a one-process gloo group (core.testing.cpu), for the
    modules that build megatron's layers in the test process."""
    from core.testing.cpu import init_cpu_model_parallel

    init_cpu_model_parallel(tp_size=1)


@pytest.fixture(autouse=True)
def _same_random_draws_every_run():
    """Each test starts from the same torch RNG state: a draw it makes without its own generator
    repeats from run to run, whichever tests ran before it."""
    torch.manual_seed(0)
