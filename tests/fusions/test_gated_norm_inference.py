"""The inference entry point (vLLM's contract) against the one-rounding torch reference."""

from __future__ import annotations

import pytest
import torch

import core.fusions.gated_norm_validation as validation
import core.fusions.gated_norm_inference as mod
from core.fusions import fused_gdn_gated_rms_norm
from core.fusions.gated_norm_launch import MAX_HEAD_DIM
from core.fusions.gated_norm_reference import inference_gated_norm, ulp_distance
from tests.gated_norm_checks import RecordOps, assert_bitwise_or_within_ulps
from tests.gated_norm_inputs import DEVICE, EPS, make_inputs

TOKENS, HEADS, DIM = 5, 3, 96  # DIM not a power of two: masked columns


def make(tokens, heads, dim, dtype, layout, weight_dtype=None, seed=0):
    """x, z, weight, out for a layout:
    contiguous: three separate tensors;
    packed: x and z are column slices of one packed projection at odd offsets (token-strided);
    inplace: out is x; inplace_packed: out is x, and x and z are interleaved slices of one buffer.
    """
    x, z, weight = make_inputs((tokens, heads, dim), dtype, weight_dtype, seed)
    x, z = x.flatten(1), z.flatten(1)
    width = heads * dim
    if layout in ("packed", "inplace_packed"):  # odd offsets, 7 elements of slack
        proj = torch.zeros(tokens, 2 * width + 7, dtype=dtype, device=DEVICE)
        proj[:, 3:3 + width], proj[:, width + 5:2 * width + 5] = x, z
        x, z = proj[:, 3:3 + width], proj[:, width + 5:2 * width + 5]
    out = x if layout.startswith("inplace") else torch.full_like(x, float("nan"))
    return x, z, weight, out


def run(x, z, weight, out, heads, dim, norm_before_gate=True, activation="swish"):
    # before out (x itself, in place) is overwritten
    ref = inference_gated_norm(x, z, weight, EPS, dim, norm_before_gate, activation)
    fused_gdn_gated_rms_norm(x, z, weight, out, EPS, heads, dim, norm_before_gate, activation)
    return ref


@pytest.mark.parametrize("layout", ["contiguous", "packed", "inplace", "inplace_packed"])
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_one_rounding_reference(dtype, norm_before_gate, activation, layout):
    x, z, weight, out = make(TOKENS, HEADS, DIM, dtype, layout)
    z_before = z.clone()
    ref = run(x, z, weight, out, HEADS, DIM, norm_before_gate, activation)
    assert_bitwise_or_within_ulps(out, ref)
    assert torch.equal(z, z_before)  # the gate (and the rest of a packed buffer) is untouched


def test_out_is_z():
    """Writing over the gate slice of a packed projection is also an exact alias, allowed."""
    x, z, weight, _ = make(TOKENS, HEADS, DIM, torch.bfloat16, "packed")
    assert_bitwise_or_within_ulps(z, run(x, z, weight, z, HEADS, DIM))


def test_silu_is_swish():
    x, z, weight, _ = make(TOKENS, HEADS, DIM, torch.bfloat16, "contiguous")
    outs = [torch.empty_like(x) for _ in range(2)]
    for out, name in zip(outs, ("silu", "swish")):
        fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM, activation=name)
    assert torch.equal(*outs)


@pytest.mark.parametrize("heads,dim", [(1, 40), (2, 200), (4, 256), (2, 1)])
def test_head_dims(heads, dim):
    x, z, weight, out = make(3, heads, dim, torch.bfloat16, "packed", seed=dim)
    for norm_before_gate in (True, False):
        assert_bitwise_or_within_ulps(out, run(x, z, weight, out, heads, dim, norm_before_gate))


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_fp32_weight_with_bf16_activations(norm_before_gate):
    x, z, weight, out = make(TOKENS, HEADS, DIM, torch.bfloat16, "contiguous",
                             weight_dtype=torch.float32)
    assert_bitwise_or_within_ulps(out, run(x, z, weight, out, HEADS, DIM, norm_before_gate))


def test_differs_from_two_rounding_training_path():
    """One rounding is not the training path's two roundings: they agree on most bf16 elements,
    not all (docs/inference.md)."""
    from core.fusions.fused_gated_norm import fused_gated_norm

    x, z, weight, out = make(32, HEADS, DIM, torch.bfloat16, "contiguous")
    fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM)
    split = lambda t: t.unflatten(-1, (HEADS, DIM)).unsqueeze(0)  # noqa: E731
    with torch.no_grad():
        train = fused_gated_norm(split(x), split(z), weight, EPS).flatten(-2)[0]
    agree = (out == train).float().mean().item()
    assert 0.5 < agree < 1.0
    assert ulp_distance(out, train).max().item() <= 2


def test_empty_input_does_not_launch(monkeypatch):
    def no_launch(*args):
        raise AssertionError("launched on empty input")

    monkeypatch.setattr(mod.launch_forward, "launch", no_launch)
    x, z, weight, out = make(0, HEADS, DIM, torch.bfloat16, "packed")
    assert fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM) is None


def test_no_grad_with_requires_grad_inputs_and_grad_mode_rejected():
    x, z, weight, out = make(TOKENS, HEADS, DIM, torch.float32, "contiguous")
    for name, t in (("x", x), ("z", z), ("out", out), ("weight", weight)):
        t.requires_grad_()
        with pytest.raises(ValueError, match=f"fused_gdn_gated_rms_norm: {name} requires grad with "
                                             "grad mode enabled, and this entry has no autograd"):
            fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM)
        if name != "weight":
            t.requires_grad_(False)
    with torch.no_grad():
        ref = run(x, z, weight, out, HEADS, DIM)
    assert_bitwise_or_within_ulps(out, ref)
    with torch.inference_mode():
        fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM)


def test_writing_into_out_counts_as_in_place():
    """out = x under no_grad, where autograd saved x: the entry bumps x's version, so the graph
    refuses to backward rather than use the overwritten values (as after torch's in-place ops).
    Inference tensors have no version, and the call takes them."""
    a = torch.randn(TOKENS, HEADS * DIM, device=DEVICE, requires_grad=True)
    x = a.exp()  # exp saves its output for the backward
    z, weight = torch.randn_like(x), torch.ones(DIM, device=DEVICE)
    version = x._version
    with torch.no_grad():
        fused_gdn_gated_rms_norm(x, z, weight, x, EPS, HEADS, DIM)
    assert x._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        x.sum().backward()
    with torch.inference_mode():
        x, z, weight, out = make(TOKENS, HEADS, DIM, torch.bfloat16, "contiguous")
        fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM)
        assert out.is_inference()


def test_host_path_runs_no_tensor_op(monkeypatch):
    """The whole entry up to its launch, validation included, runs no tensor op (hence no
    device sync, no allocation, no copy)."""
    launches = []
    monkeypatch.setattr(mod.launch_forward, "launch", lambda *args: launches.append(args))
    x, z, weight, out = make(TOKENS, HEADS, DIM, torch.bfloat16, "inplace_packed")
    with RecordOps() as rec:
        fused_gdn_gated_rms_norm(x, z, weight, out, EPS, HEADS, DIM)
    assert rec.ops == []
    assert len(launches) == 1 and launches[0][1] == (x, z, weight, out, None)


def test_a_repeated_call_reuses_its_prepared_launch(monkeypatch):
    """A call that repeats everything that decides its launch (a decode step) takes the launch
    prepared before; anything else among them (the token count, eps, a token stride, the
    activation, the gate order) gets its own. The table is bounded."""
    monkeypatch.setattr(mod, "_launches", {})
    prepared = []
    launch = mod.launch_forward.launch
    monkeypatch.setattr(mod.launch_forward, "launch",
                        lambda grid, tensors, args: (prepared.append(args),
                                                     launch(grid, tensors, args)))
    x, z, weight, out = make(8, HEADS, DIM, torch.bfloat16, "packed")
    with torch.no_grad():
        calls = [(x, z, EPS, "swish", True), (x, z, EPS, "swish", True), (x[:4], z[:4], EPS,
                 "swish", True), (x, z, 1e-5, "swish", True), (x.clone(), z, EPS, "swish", True),
                 (x, z, EPS, "sigmoid", True), (x, z, EPS, "swish", False)]
        for xc, zc, eps, activation, norm_before_gate in calls:
            fused_gdn_gated_rms_norm(xc, zc, weight, out[:xc.shape[0]], eps, HEADS, DIM,
                                     norm_before_gate, activation)
    assert prepared[0] is prepared[1]
    assert len({id(p) for p in prepared}) == len(calls) - 1 == len(mod._launches)
    monkeypatch.setattr(mod, "MAX_LAUNCHES", 2)
    with torch.no_grad():
        for tokens in range(1, 6):
            fused_gdn_gated_rms_norm(x[:tokens], z[:tokens], weight, out[:tokens], EPS, HEADS, DIM)
            assert len(mod._launches) <= 2


# ----------------------------------------------------------------------------------------------
# Bad input: every rule raises before any launch, naming the argument
# ----------------------------------------------------------------------------------------------


def _good():
    x, z, weight, out = make(4, 2, 8, torch.bfloat16, "contiguous")
    return dict(x=x, z=z, weight=weight, out=out, eps=EPS, num_v_heads=2, head_v_dim=8)


def _packed_pair():
    buf = torch.zeros(4, 40, dtype=torch.bfloat16, device=DEVICE)
    return buf[:, :16], buf[:, 8:24]  # overlapping column ranges of one buffer


BAD = {
    "x not tensor": (lambda a: a | {"x": a["x"].tolist()}, TypeError, "x must be a torch.Tensor"),
    "z not tensor": (lambda a: a | {"z": None}, TypeError, "z must be a torch.Tensor"),
    "x sparse csr": (lambda a: a | {"x": a["x"].to_sparse_csr()}, TypeError,
                     "x must be a dense \\(strided\\) tensor, got layout torch.sparse_csr"),
    "x rank 3": (lambda a: a | {"x": a["x"].view(4, 2, 8)}, ValueError, "x must have shape"),
    "x width": (lambda a: a | {"num_v_heads": 1}, ValueError, "x must have shape"),
    "z shape": (lambda a: a | {"z": a["z"][:3]}, ValueError, "z must have x's shape"),
    "out shape": (lambda a: a | {"out": a["out"][:, :8]}, ValueError, "out must have x's shape"),
    "weight shape": (lambda a: a | {"weight": a["weight"][:4]}, ValueError,
                     r"weight must have shape \(8,\)"),
    "weight 2-d": (lambda a: a | {"weight": a["weight"].view(1, 8)}, ValueError,
                   "weight must have shape"),
    "x dtype": (lambda a: a | {k: a[k].double() for k in ("x", "z", "out")}, TypeError, "x dtype"),
    "z dtype": (lambda a: a | {"z": a["z"].half()}, TypeError, "z dtype must equal"),
    "out dtype": (lambda a: a | {"out": a["out"].float()}, TypeError, "out dtype must equal"),
    "weight dtype": (lambda a: a | {"weight": a["weight"].half()}, TypeError, "weight dtype"),
    "device": (lambda a: a | {"weight": a["weight"].to("meta")}, ValueError, "one device"),
    "z negative view": (lambda a: a | {"z": torch._neg_view(a["z"])}, ValueError,
                        r"z is a negative view .*z.resolve_neg\(\)"),
    # The device rule comes before the overlap rules (meta tensors all have address 0).
    "all meta": (lambda a: a | {k: a[k].to("meta") for k in ("x", "z", "weight", "out")},
                 ValueError, "x must be a (CPU|CUDA) tensor .*TRITON_INTERPRET=1.*got device meta"),
    "x stride": (lambda a: a | {"x": a["x"].t().contiguous().t()}, ValueError,
                 "x must have last-dim stride 1"),
    "z stride": (lambda a: a | {"z": torch.zeros_like(a["z"]).repeat(1, 2)[:, ::2]}, ValueError,
                 "z must have last-dim stride 1"),
    "out stride": (lambda a: a | {"out": a["out"].t().contiguous().t()}, ValueError,
                   "out must have last-dim"),
    "weight stride": (lambda a: a | {"weight": a["weight"].repeat(2)[::2]}, ValueError,
                      "weight must be contiguous"),
    "out rows overlap": (lambda a: a | {"out": a["out"][:1].expand(4, 16)}, ValueError,
                         "out rows must not overlap"),
    "out partial x": (lambda a: a | dict(zip(("x", "out"), _packed_pair())), ValueError,
                      "partially overlaps x"),
    "out partial z": (lambda a: a | dict(zip(("z", "out"), _packed_pair())), ValueError,
                      "partially overlaps z"),
    "out shifted x": (lambda a: _shifted(a), ValueError, "partially overlaps x"),
    "out over weight": (lambda a: _out_over_weight(a), ValueError, "out must not overlap weight"),
    # Expanded (memoryless) views with 2**27 tokens * 16 heads = 2**31 rows.
    "rows 2**31": (lambda a: a | {k: a[k][:1].expand(2**27, 16) for k in ("x", "z", "out")}
                   | {"num_v_heads": 16, "head_v_dim": 1, "weight": a["weight"][:1]},
                   ValueError, r"num_tokens \* num_v_heads must be <= 2147418112"),
    "heads type": (lambda a: a | {"num_v_heads": 2.0}, TypeError, "num_v_heads must be an int"),
    "heads bool": (lambda a: a | {"num_v_heads": True}, TypeError, "num_v_heads must be an int"),
    "dim zero": (lambda a: a | {"head_v_dim": 0}, ValueError, "head_v_dim must be > 0"),
    "dim max": (lambda a: a | {"head_v_dim": MAX_HEAD_DIM + 1}, ValueError,
                "head_v_dim must be <="),
    "eps zero": (lambda a: a | {"eps": 0.0}, ValueError, "eps must be finite and > 0"),
    "eps nan": (lambda a: a | {"eps": float("nan")}, ValueError, "eps must be finite and > 0"),
    "eps inf": (lambda a: a | {"eps": float("inf")}, ValueError, "eps must be finite and > 0"),
    "eps tensor": (lambda a: a | {"eps": torch.tensor(1e-6)}, TypeError,
                   "eps must be a Python float or int"),
    "eps str": (lambda a: a | {"eps": "1e-6"}, TypeError, "eps must be a Python float or int"),
    "eps fp32 overflow": (lambda a: a | {"eps": 1e39}, ValueError, "eps must be finite and > 0"),
    "activation": (lambda a: a | {"activation": "gelu"}, ValueError, "activation must be one of"),
    "activation list": (lambda a: a | {"activation": ["silu"]}, TypeError,
                        "activation must be a str"),
    **{f"norm_before_gate {value!r}": (lambda a, value=value: a | {"norm_before_gate": value},
                                       TypeError, "norm_before_gate must be a bool")
       for value in ("yes", "False", None, 0, 1, 0.5)},
}


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(validation, "INTERPRETED", False)
    monkeypatch.setattr(mod.launch_forward, "launch", None)  # not reached
    args = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in _good().items()}
    with torch.no_grad(), pytest.raises(ValueError,
                                        match="x must be a CUDA tensor .*got device cpu"):
        mod.fused_gdn_gated_rms_norm(**args)


def _shifted(a):
    """out = x shifted by one head: same shape and strides, different start (partial alias)."""
    buf = torch.zeros(4 * 16 + 8, dtype=torch.bfloat16, device=DEVICE)
    return a | {"x": buf[:64].view(4, 16), "out": buf[8:].view(4, 16)}


def _out_over_weight(a):
    buf = torch.zeros(64, dtype=torch.bfloat16, device=DEVICE)
    return a | {"out": buf.view(4, 16), "weight": buf[8:16]}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case, monkeypatch):
    make_args, exc, message = BAD[case]

    def no_launch(*args):
        raise AssertionError("launched on bad input")

    monkeypatch.setattr(mod.launch_forward, "launch", no_launch)
    with pytest.raises(exc, match=message):
        fused_gdn_gated_rms_norm(**make_args(_good()))


