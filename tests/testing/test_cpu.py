"""The CPU shims of core.testing.cpu that stand in for what megatron runs on a GPU: FLA's
convolution and chunked gated delta rule (against FLA's own convolution in the Triton
interpreter and an independent recurrent rule), and the training shims' CUDA literals and
calls."""

import importlib

import pytest
import torch

from core.testing.cpu import torch_causal_conv1d, torch_chunk_gated_delta_rule
from core.testing.gdn import recurrent_gated_delta_rule

pytestmark = pytest.mark.cpu_shims


@pytest.mark.parametrize("packed", [False, True], ids=["one_sequence", "packed"])
def test_causal_conv1d_stand_in_equals_flas(packed):
    from fla.modules.convolution import causal_conv1d

    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 20, 8, generator=gen), torch.randn(8, 4, generator=gen)
    bias = torch.randn(8, generator=gen)
    cu_seqlens = torch.tensor([0, 7, 20], dtype=torch.int32) if packed else None
    kwargs = dict(x=x, weight=weight, bias=bias, activation="silu", cu_seqlens=cu_seqlens)
    expected, got = causal_conv1d(**kwargs)[0], torch_causal_conv1d(**kwargs)[0]
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_chunk_rule_stand_in_runs_each_packed_sequence_on_its_own():
    """Against the recurrent rule on each sequence alone: a state leaking across the boundary of
    two packed sequences would change the second one."""
    gen = torch.Generator().manual_seed(0)
    t, h, dk, dv = 70, 2, 16, 8
    q, v = torch.randn(1, t, h, dk, generator=gen), torch.randn(1, t, h, dv, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, t, h, dk, generator=gen), dim=-1)
    g, beta = -torch.rand(1, t, h, generator=gen), torch.rand(1, t, h, generator=gen)
    got = torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 30, t]))[0]
    expected = torch.cat([recurrent_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e],
                                                     beta[:, s:e])[0]
                          for s, e in ((0, 30), (30, t))], dim=1)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    whole = torch_chunk_gated_delta_rule(q, k, v, g, beta)[0]
    assert not torch.allclose(whole[:, 30:], expected[:, 30:])


def test_training_modules_allocate_cuda_literals_on_the_cpu():
    optimizer_module = importlib.import_module("megatron.core.optimizer.optimizer")
    assert optimizer_module.torch.zeros(2, device="cuda").device == torch.device("cpu")
    assert torch.zeros(2).device == torch.device("cpu")  # the real torch elsewhere


def test_all_to_all_dispatcher_gets_its_token_splits_as_numbers():
    """megatron's all-to-all dispatcher: its side stream is a no-op stand-in, and its host copy
    of the token splits (as_numpy) gives NumPy values, as the copy of a CUDA tensor would."""
    import numpy

    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    stream = dispatcher.torch.cuda.Stream()
    stream.wait_stream(dispatcher.torch.cuda.current_stream())
    stream.record_event().synchronize()
    splits = torch.tensor([3, 1])
    copied = dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True, record_stream=True)
    assert isinstance(copied, numpy.ndarray) and copied.tolist() == [3, 1]
    assert dispatcher.maybe_move_tensor_to_cpu(splits) is splits
    assert dispatcher.maybe_move_tensor_to_cpu(None, as_numpy=True) is None


def test_embedding_setup_keeps_tensors_on_the_cpu_and_only_there():
    """LanguageModule.setup_embeddings_and_output_layer runs with Tensor.cuda() returning the
    tensor itself; Tensor.cuda is megatron's own again after it, also when it raises."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from core.testing.cpu import _tensors_stay_on_the_cpu

    assert LanguageModule.setup_embeddings_and_output_layer.__wrapped__  # the shim is installed
    cuda, x = torch.Tensor.cuda, torch.ones(2)
    assert _tensors_stay_on_the_cpu(lambda t: t.cuda())(x) is x
    assert torch.Tensor.cuda is cuda

    def raises(t):
        t.cuda()
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        _tensors_stay_on_the_cpu(raises)(x)
    assert torch.Tensor.cuda is cuda


@pytest.mark.usefixtures("model_parallel_tp1")
def test_torch_fsdp2_wrapper_builds_its_mesh_on_the_cpu():
    from megatron.core import parallel_state
    from megatron.core.distributed import torch_fully_sharded_data_parallel as torch_fsdp2

    mesh = torch_fsdp2.DeviceMesh.from_group(parallel_state.get_data_parallel_group(), "cuda")
    assert mesh.device_type == "cpu"


@pytest.mark.usefixtures("model_parallel_tp1")
def test_parallel_state_with_the_sizes_asked_for_is_kept_and_reseeded():
    """Megatron's destroy_model_parallel leaves its gloo groups alive: init_model_parallel_sizes
    keeps a parallel_state that already has the sizes (the same group objects), reseeds its RNG
    tracker, and initialises where there is none."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from core.testing.cpu import init_model_parallel_sizes, parallel_sizes

    group = ps.get_tensor_model_parallel_group()
    assert parallel_sizes() == (1, 1, 1, 1, 1, None)
    with get_cuda_rng_tracker().fork():
        first = torch.rand(4)
    init_model_parallel_sizes(tp=1)
    assert ps.get_tensor_model_parallel_group() is group
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), first)  # reseeded
    init_model_parallel_sizes(tp=1, etp=1, ep=1)
    assert ps.get_tensor_model_parallel_group() is group
    ps.destroy_model_parallel()
    assert parallel_sizes() is None
    init_model_parallel_sizes(tp=1)
    assert parallel_sizes() == (1, 1, 1, 1, 1, None)
    assert ps.get_tensor_model_parallel_group() is not group


@pytest.mark.usefixtures("model_parallel_tp1")
def test_a_new_initialisation_destroys_the_groups_of_the_one_before():
    from megatron.core import parallel_state as ps

    from core.testing.cpu import init_model_parallel_sizes

    ps.destroy_model_parallel()
    init_model_parallel_sizes(tp=1)  # groups made here, whatever initialised megatron before
    group = ps.get_tensor_model_parallel_group()
    groups = torch.distributed.distributed_c10d._world.pg_map
    count = len(groups)
    ps.destroy_model_parallel()
    init_model_parallel_sizes(tp=1)
    assert ps.get_tensor_model_parallel_group() is not group
    assert group not in groups and len(groups) == count  # destroyed, not kept beside the new ones


class _Cycle:
    def __init__(self):
        self.me = self


def test_a_repeat_install_freezes_nothing():
    """conftest installed the shims: installing them again leaves the collector as it is, so
    cyclic garbage made since is still collected."""
    import gc
    import weakref

    from core.testing.cpu import install_cpu_shims

    garbage = _Cycle()
    alive = weakref.ref(garbage)
    del garbage
    install_cpu_shims(training=True)
    gc.collect()
    assert alive() is None


# A fresh process: the first block runs with the collector paused and what is alive after it is
# frozen; a second block changes nothing; what is alive at exit is frozen before the
# interpreter's collections.
FREEZES = r"""
import atexit, gc, weakref
made = []
# registered before the shims' handler, so it runs after it (atexit runs handlers last-first)
atexit.register(lambda: print("FROZEN_AT_EXIT",
                              not any(obj is made[0] for obj in gc.get_objects())))
from core.testing.cpu import _collector_paused_then_frozen

class Cycle:
    def __init__(self):
        self.me = self

with _collector_paused_then_frozen():
    paused = not gc.isenabled()
    kept = Cycle()
print("PAUSED", paused, "ENABLED_AFTER", gc.isenabled())
print("FROZEN", not any(obj is kept for obj in gc.get_objects()))
garbage = Cycle()
alive = weakref.ref(garbage)
del garbage
with _collector_paused_then_frozen():
    paused_again = not gc.isenabled()
gc.collect()
print("PAUSED_AGAIN", paused_again, "COLLECTED", alive() is None)
made.append([[]])  # made after the freeze: walked by the collector until exit
print("TRACKED", any(obj is made[0] for obj in gc.get_objects()))
"""


def test_the_first_install_freezes_what_is_alive_and_exit_freezes_the_rest():
    import subprocess
    import sys

    root = __file__.rsplit("/tests/", 1)[0]
    proc = subprocess.run([sys.executable, "-c", FREEZES], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["PAUSED", "True", "ENABLED_AFTER", "True", "FROZEN", "True",
                                   "PAUSED_AGAIN", "False", "COLLECTED", "True", "TRACKED", "True",
                                   "FROZEN_AT_EXIT", "True"]
