"""CPU numerics of ``fused_linear.fused_linear``: gradcheck in float64, and forward and
gradients in float32 / float64 against the plain float64 reference (chain_ref.reference).

Kinks (LeakyReLU at 0, Hardtanh at its bounds, a row max's arg-max switching) make
finite differences and rounding-sensitive comparisons flaky: a value within gradcheck's
eps (1e-6) of a kink, or within float32's rounding of it, gives a derivative from the
other side. Rather than loosening tolerances, the inputs are drawn (seeded, so the same
on every run) until every kinked op's input is at least MARGIN, relative to its scale,
from the kink (chain_ref.make_case / kink_margin); the kinked chains then get the
same exact checks as the smooth ones.
"""

import random
import zlib

import pytest
import torch

import fused_linear
from chain_ref import (
    SPEC_PRESETS,
    make_case,
    parse_chain,
    random_chain,
    reference,
    reference_grads,
    rel_err,
    small_preset,
)

MARGIN = 1e-4  # relative distance of every kinked op's input from its kink
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def test_presets_are_the_spec_models():
    assert tuple(fused_linear.PRECISIONS) == ("fp32", "tf32x3", "tf32", "bf16", "fp16", "fp8", "fp8_gw_bf16")
    assert sorted(fused_linear.PRESETS) == ["M1", "M2", "M3", "M4", "M5"]
    for name, text in SPEC_PRESETS.items():
        assert parse_chain(fused_linear.PRESETS[name]) == parse_chain(text), name


# ---------------------------------------------------------------- gradcheck


def _gradcheck(shape, ops, seed):
    (x, weight, bias), params = make_case(shape, ops, seed, torch.float64, min_margin=MARGIN)
    inputs = [t.clone().requires_grad_(True) for t in (x, weight, bias, *params)]

    def f(x, weight, bias, *params):
        return fused_linear.fused_linear(x, weight, bias, ops, list(params))

    # Every input (x, weight, bias and each chain parameter) requires grad, so gradcheck
    # compares the analytic Jacobian with finite differences for all of them.
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(SPEC_PRESETS))
def test_gradcheck_presets(name):
    # Full-size presets shrunk to 16 features: groups of 4 channels, AvgPool(4) for M4.
    ops = small_preset(fused_linear.PRESETS[name], 16)
    _gradcheck((3, 5, 16), ops, seed=10 + int(name[1]))


# (ops, out features)
GRADCHECK_CHAINS = [
    ("leakyrelu(0.2),hardtanh(-0.5,0.7),mish,max", 12),  # kinks only
    ("groupnorm(2,1e-3),scale(-1.5),bias,leakyrelu,mul,groupnorm(4)", 16),
    ("avgpool(3),swish,bias,max", 16),  # an AvgPool kernel that does not divide the features
    ("gelu,bias,bias,mul,mul,groupnorm(8),groupnorm(2),double", 16),  # repeated parameters
    ("hardtanh,leakyrelu(0),avgpool(2),gelu,max", 10),  # LeakyReLU(0): a ReLU
] + [(random_chain(random.Random(100 + i), 12), 12) for i in range(4)]


@pytest.mark.parametrize("ops,out", GRADCHECK_CHAINS, ids=[c for c, _ in GRADCHECK_CHAINS])
def test_gradcheck_chains(ops, out):
    _gradcheck((4, 3, out), ops, seed=zlib.crc32(ops.encode()) % 1000)


# ---------------------------------------------------------------- parity with the reference

# (batch, in, out): odd and tiny shapes, a 3-D batch.
SHAPES = [(1, 5, 12), (3, 33, 40), (17, 5, 40), (3, 64, 12), (17, 33, 64), (2, 3, 7, 24)]
PARITY = [(s, small_preset(SPEC_PRESETS[m], s[-1])) for m, s in zip(sorted(SPEC_PRESETS), SHAPES)]
PARITY += [
    (SHAPES[i % len(SHAPES)], random_chain(random.Random(i), SHAPES[i % len(SHAPES)][-1])) for i in range(14)
]


def _check_parity(shape, ops, dtype, seed):
    (x, weight, bias), params = make_case(shape, ops, seed, dtype, min_margin=MARGIN)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias, *params)]
    y = fused_linear.fused_linear(leaves[0], leaves[1], leaves[2], ops, leaves[3:])
    assert y.dtype == dtype
    g = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=g)
    y_ref, grads_ref = reference_grads(x, weight, bias, ops, params, dy)
    grads = torch.autograd.grad(y, leaves, dy.to(dtype))
    names = ["y", "x", "weight", "bias"] + [f"params[{i}]" for i in range(len(params))]
    errs = {n: rel_err(a, b) for n, a, b in zip(names, [y] + list(grads), [y_ref] + grads_ref)}
    bad = {n: e for n, e in errs.items() if not e < TOL[dtype]}
    assert not bad, f"{ops} at {shape} in {dtype}: relative errors above {TOL[dtype]:g}: {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape,ops", PARITY, ids=[f"{'x'.join(map(str, s))}-{o}" for s, o in PARITY])
def test_parity_with_reference(shape, ops, dtype):
    _check_parity(shape, ops, dtype, seed=sum(shape) * 7 + len(ops))


def test_reference_matches_plain_module(plain_block):
    """The test's own reference agrees with the plain nn.Module built from the same chain."""
    ops = "bias,groupnorm(4),swish,mul,bias,leakyrelu(0.2),avgpool(3),max"
    m = plain_block(6, 16, ops).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    want = reference(x, m.lin.weight, m.lin.bias, ops, m.chain_params())
    torch.testing.assert_close(m(x), want, rtol=1e-14, atol=1e-14)
    assert want.shape == (5,)
