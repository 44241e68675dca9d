"""``fused_linear.FusedLinear`` on the CPU: parameter names, state dicts, initialisation,
``from_module``, batched inputs and dtype conversion."""

import copy
import math

import pytest
import torch

import fused_linear
from chain_ref import out_shape, param_specs, reference, reference_grads, rel_err
from fused_linear import FusedLinear

M1 = "groupnorm(4),swish,mul,swish"
REPEATS = "bias,swish,bias,groupnorm(4),mul,groupnorm(2),leakyrelu(0.2),mul"


def chain_params(block, ops, out_features):
    """The block's chain parameters in chain order (the functional op's ``params``)."""
    p = dict(block.named_parameters())
    return [p[name] for name, _ in param_specs(ops, out_features)]


@pytest.mark.parametrize(
    "ops,names",
    [
        (M1, ["lin.weight", "lin.bias", "gn.weight", "gn.bias", "w"]),
        ("swish,bias,groupnorm(4)", ["lin.weight", "lin.bias", "bias", "gn.weight", "gn.bias"]),
        ("groupnorm(8),leakyrelu(0.01),scale(2)", ["lin.weight", "lin.bias", "gn.weight", "gn.bias"]),
        ("avgpool(4),gelu,scale(2),max", ["lin.weight", "lin.bias"]),
        (
            REPEATS,
            [
                "lin.weight",
                "lin.bias",
                "bias",
                "bias2",
                "gn.weight",
                "gn.bias",
                "w",
                "gn2.weight",
                "gn2.bias",
                "w2",
            ],
        ),
    ],
)
def test_parameter_names_as_pytorch_modules(ops, names, plain_block):
    block = FusedLinear(8, 16, ops)
    got = dict(block.named_parameters())
    assert sorted(got) == sorted(names)
    assert sorted(block.state_dict()) == sorted(names)
    plain = plain_block(8, 16, ops)
    assert sorted(dict(plain.named_parameters())) == sorted(names)  # the helper agrees
    for name, p in plain.named_parameters():
        assert got[name].shape == p.shape, name
        assert got[name].dtype == torch.float32 and got[name].requires_grad, name


def test_load_state_dict_from_plain_module(plain_block):
    plain = plain_block(8, 16, REPEATS)
    block = FusedLinear(8, 16, REPEATS)
    result = block.load_state_dict(plain.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, p in block.state_dict().items():
        assert torch.equal(p, plain.state_dict()[name]), name
    x = torch.randn(5, 8)
    rel = rel_err(block(x), plain.double()(x.double()))
    assert rel < 1e-5, rel
    # A plain module whose keys do not match is refused in strict mode, as PyTorch does.
    bad = plain_block(8, 16, "swish,bias,groupnorm(4)").state_dict()
    with pytest.raises(RuntimeError):
        block.load_state_dict(bad, strict=True)


def test_initialisation_as_pytorch():
    torch.manual_seed(1)
    fan_in, out = 400, 600
    block = FusedLinear(fan_in, out, "bias,groupnorm(10),mul")
    p = dict(block.named_parameters())
    bound = 1 / math.sqrt(fan_in)
    for name in ("lin.weight", "lin.bias"):  # U(-1/sqrt(in), 1/sqrt(in))
        t = p[name].detach().double()
        assert t.abs().max() <= bound, name
        assert t.max() > 0.95 * bound and t.min() < -0.95 * bound, name
        assert abs(t.mean()) < 0.1 * bound, name
        assert abs(t.std() / (bound / math.sqrt(3)) - 1) < 0.1, name
    w = p["lin.weight"].detach().double()
    assert abs(w.std() / (bound / math.sqrt(3)) - 1) < 0.02  # 240 000 samples
    assert torch.equal(p["gn.weight"].detach(), torch.ones(out))
    assert torch.equal(p["gn.bias"].detach(), torch.zeros(out))
    for name in ("w", "bias"):  # randn
        t = p[name].detach().double()
        assert abs(t.mean()) < 0.2 and abs(t.std() - 1) < 0.15, name
        assert t.min() < -1.5 and t.max() > 1.5, name  # not uniform in [-1, 1]


def test_initialisation_follows_torch_manual_seed():
    torch.manual_seed(123)
    a = FusedLinear(16, 24, M1)
    torch.manual_seed(123)
    b = FusedLinear(16, 24, M1)
    c = FusedLinear(16, 24, M1)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    assert not torch.equal(a.lin.weight, c.lin.weight)


@pytest.mark.parametrize(
    "ops", [M1, "bias,hardtanh(-1,1),mish,groupnorm(4)", "avgpool(3),gelu,double,max", REPEATS]
)
def test_from_module_gives_equal_outputs(ops, plain_block):
    plain = plain_block(12, 16, ops)
    block = FusedLinear.from_module(plain, ops)
    assert isinstance(block, FusedLinear)
    for name, t in plain.state_dict().items():
        assert torch.equal(block.state_dict()[name], t), name
    x = torch.randn(7, 12, requires_grad=True)
    y, y_plain = block(x), plain(x)
    assert y.shape == y_plain.shape
    # Equal up to float32 rounding (compared as norms: a GroupNorm over a group whose values
    # nearly agree amplifies single elements' rounding), and as close to float64 as PyTorch.
    assert rel_err(y, y_plain) < 1e-5
    plain64 = copy.deepcopy(plain).double()
    x64 = x.detach().double().requires_grad_(True)
    y64 = plain64(x64)
    assert rel_err(y, y64) < 1e-5
    # Training through the block moves its own parameters, with the plain module's gradients.
    dy = torch.randn(y.shape, dtype=torch.float64)
    y.backward(dy.float())
    y64.backward(dy)
    assert rel_err(x.grad, x64.grad) < 1e-5
    grads = dict(block.named_parameters())
    for name, p in plain64.named_parameters():
        assert grads[name].grad is not None, name
        assert rel_err(grads[name].grad, p.grad) < 1e-5, name


@pytest.mark.parametrize("ops", [M1, "avgpool(3),gelu,scale(2),max"])
def test_batched_leading_dims(ops):
    block = FusedLinear(6, 16, ops)
    x = torch.randn(3, 5, 6, requires_grad=True)
    y = block(x)
    assert y.shape == out_shape((3, 5), ops, 16)
    params = chain_params(block, ops, 16)
    dy = torch.randn(y.shape, dtype=torch.float64)
    y_ref, g_ref = reference_grads(x, block.lin.weight, block.lin.bias, ops, params, dy)
    assert rel_err(y, y_ref) < 1e-5
    (dx,) = torch.autograd.grad(y, [x], dy.float())
    assert dx.shape == x.shape
    assert rel_err(dx, g_ref[0]) < 1e-5
    # Same as running the flattened batch.
    torch.testing.assert_close(y.reshape(15, *y.shape[2:]), block(x.reshape(15, 6)), rtol=0, atol=0)


def test_to_float64():
    block = FusedLinear(5, 12, M1)
    block64 = block.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in block64.parameters())
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = block64(x)
    assert y.dtype == torch.float64
    p = dict(block64.named_parameters())
    params = chain_params(block64, M1, 12)
    dy = torch.randn(y.shape, dtype=torch.float64)
    y_ref, g_ref = reference_grads(x, p["lin.weight"], p["lin.bias"], M1, params, dy)
    assert rel_err(y, y_ref) < 1e-10
    grads = torch.autograd.grad(y, [x, p["lin.weight"], p["lin.bias"], *params], dy)
    for g, r in zip(grads, g_ref):
        assert rel_err(g, r) < 1e-10
    # And back to float32.
    block32 = block64.float()
    assert block32(x.detach().float()).dtype == torch.float32


def test_module_and_functional_agree():
    block = FusedLinear(9, 16, REPEATS, precision="fp32")
    p = dict(block.named_parameters())
    params = chain_params(block, REPEATS, 16)
    assert [n for n, _ in param_specs(REPEATS, 16)] == [
        "bias",
        "bias2",
        "gn.weight",
        "gn.bias",
        "w",
        "gn2.weight",
        "gn2.bias",
        "w2",
    ]
    x = torch.randn(4, 9)
    want = fused_linear.fused_linear(x, p["lin.weight"], p["lin.bias"], REPEATS, params, precision="fp32")
    torch.testing.assert_close(block(x), want, rtol=0, atol=0)
    ref = reference(x, p["lin.weight"], p["lin.bias"], REPEATS, params)
    assert rel_err(want, ref) < 1e-5


def test_precision_has_no_effect_on_cpu():
    """The GPU's operand roundings are not emulated on the CPU (FP32 there); FP8 is
    (test_fp8.py)."""
    x = torch.randn(6, 9)
    outs = []
    for precision in [p for p in fused_linear.PRECISIONS if not p.startswith("fp8")]:
        torch.manual_seed(4)
        block = FusedLinear(9, 16, M1, precision=precision)
        xx = x.clone().requires_grad_(True)
        y = block(xx)
        y.backward(torch.ones_like(y))
        outs.append([y.detach(), xx.grad] + [p.grad for p in block.parameters()])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_one_dimensional_x():
    """x of shape (in,) is a batch of no dimensions, as for nn.Linear: y is (F,) (or () after max)."""
    for ops, shape in ((M1, (16,)), ("avgpool(4),gelu,max", ())):
        block = FusedLinear(5, 16, ops).double()
        x = torch.randn(5, dtype=torch.float64)
        y = block(x)
        assert y.shape == shape
        want = reference(x, block.lin.weight, block.lin.bias, ops, chain_params(block, ops, 16))
        assert rel_err(y, want) < 1e-10


def test_save_and_load_name_the_block(tmp_path):
    """FusedLinear.save writes the parameters under their names and dtypes with the chain
    and precision in the file's metadata; FusedLinear.load builds the same block from it
    alone; a plain safetensors file (no metadata) is refused with a way out."""
    import json
    import struct

    from fused_linear import files

    torch.manual_seed(0)
    block = FusedLinear(32, 256, "groupnorm(16),swish,mul,swish", precision="tf32x3")
    path = tmp_path / "block.safetensors"
    block.save(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0
    assert header["__metadata__"] == {
        "fused_linear.chain": "groupnorm(16,1e-5),swish,mul,swish",
        "fused_linear.precision": "tf32x3",
    }
    assert header["lin.weight"]["dtype"] == "F32" and header["lin.weight"]["shape"] == [256, 32]
    loaded = FusedLinear.load(path)
    assert loaded.ops == "groupnorm(16,1e-5),swish,mul,swish" and loaded.effective_precision == "tf32x3"
    for (name, a), (_, b) in zip(block.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    x = torch.randn(4, 32)
    torch.testing.assert_close(loaded(x), block(x), rtol=0, atol=0)

    # A bf16 model keeps its dtypes, a float32 GroupNorm among them, and its own precision.
    bf16 = FusedLinear(32, 64, "bias,groupnorm(4)").to(torch.bfloat16)
    bf16.gn.float()
    bf16.save(tmp_path / "bf16.safetensors")
    back = FusedLinear.load(tmp_path / "bf16.safetensors")
    assert back.precision is None and back.effective_precision == "bf16"
    assert back.lin.weight.dtype == torch.bfloat16 and back.gn.weight.dtype == torch.float32
    assert torch.equal(back.lin.weight, bf16.lin.weight)

    files.write(tmp_path / "plain.safetensors", dict(block.state_dict()), {})
    with pytest.raises(ValueError, match="no `fused_linear.chain`"):
        FusedLinear.load(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="not a safetensors file"):
        FusedLinear.load(tmp_path / "junk.safetensors")


def test_the_registry_reaches_python():
    """`_native.ops()` is the op registry (names, arguments, parameters, kinks, saturation)
    and `_native.parse_chain` its parser: every op and alias parses to its canonical kind
    with every argument written out."""
    from fused_linear import _native

    registry = {op["name"]: op for op in _native.ops()}
    assert {"bias", "mul", "scale", "swish", "tanh", "groupnorm", "avgpool", "max"} <= set(registry)
    kinked = {n for n, op in registry.items() if op["kink"]}
    assert kinked == {"leakyrelu", "hardtanh", "max", "min", "maxpool"}
    assert {n for n, op in registry.items() if op["saturates"]} == {"tanh", "sigmoid", "hardtanh"}
    assert registry["groupnorm"]["params"] == ["gn.weight", "gn.bias"] and registry["mul"]["params"] == ["w"]
    for name, op in registry.items():
        args = ",".join("2" if default is None else str(default) for _, default in op["args"])
        for spelled in (f"{n}({args})" if op["args"] else n for n in [name, *op["aliases"]]):
            ((kind, parsed),) = _native.parse_chain(spelled)
            assert kind == name, spelled
            assert len(parsed) == len(op["args"]), spelled
    assert _native.parse_chain("silu,double,leakyrelu,gn(4)") == [
        ("swish", []),
        ("scale", [2.0]),
        ("leakyrelu", [0.01]),
        ("groupnorm", [4.0, 1e-05]),
    ]
    with pytest.raises(ValueError, match="ops"):
        _native.parse_chain("swish,nope")


def test_release_buffers_is_harmless_on_the_cpu():
    """Nothing is kept for CPU calls: release_buffers() frees nothing and the block runs
    as before (the GPU side is tested in test_gpu.py)."""
    torch.manual_seed(3)
    block = FusedLinear(16, 32, M1)
    x = torch.randn(5, 16)
    y = block(x)
    fused_linear.release_buffers()
    assert torch.equal(block(x), y)
