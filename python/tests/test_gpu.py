"""GPU tests (marker ``gpu``: skipped only where ``torch.cuda.is_available()`` is False).

Everything here is compared with plain PyTorch in float64 on the GPU (chain_ref), by
relative error ``||got - ref|| / ||ref||``. Inputs are not steered away from kinks here
(LeakyReLU, Hardtanh, row max): at these sizes some values always sit within float32's
rounding of a kink, and the host refines those (docs/NUMERICS.md: kink refinement), so the
gradients are held to the exact function's at each precision's tolerance.
"""

import random
import time
import warnings

import pytest
import torch
import torch.nn as nn

import fused_linear
from chain_ref import SPEC_PRESETS, make_case, out_shape, random_chain, reference_grads, rel_err, small_preset
from fused_linear import FusedLinear

pytestmark = pytest.mark.gpu

# fp16: bf16's bound scaled by 2^-3, for fp16's three more bits of mantissa.
TOL = {"fp32": 1e-4, "tf32x3": 1e-4, "tf32": 5e-3, "bf16": 2e-2, "fp16": 2.5e-3}
CUDA = "cuda"


def gpu_case(shape, ops, seed):
    """Seeded float32 inputs on the GPU and an output gradient: ((x, weight, bias, params), dy)."""
    (x, weight, bias), params = make_case(shape, ops, seed, torch.float32, device=CUDA)
    n = shape[-1]
    g = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(out_shape(tuple(shape[:-2]), ops, n), generator=g).to(CUDA)
    return (x, weight, bias, params), dy


def check_against_float64(shape, ops, precision, seed):
    (x, weight, bias, params), dy = gpu_case(shape, ops, seed)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias, *params)]
    y = fused_linear.fused_linear(leaves[0], leaves[1], leaves[2], ops, leaves[3:], precision=precision)
    assert y.device.type == "cuda" and y.dtype == torch.float32
    grads = torch.autograd.grad(y, leaves, dy)
    torch.cuda.synchronize()
    y_ref, grads_ref = reference_grads(x, weight, bias, ops, params, dy)
    names = ["y", "x", "weight", "bias"] + [f"params[{i}]" for i in range(len(params))]
    errs = {}
    for name, got, ref in zip(names, [y, *grads], [y_ref, *grads_ref]):
        assert torch.isfinite(got).all(), f"{name}: non-finite values ({ops} at {shape}, {precision})"
        errs[name] = rel_err(got, ref)
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e < TOL[precision]}
    assert not bad, f"{ops} at {shape}, {precision}: relative error above {TOL[precision]:g}: {bad}"


# ---------------------------------------------------------------- parity

# (batch..., in, out): odd shapes, tiny to large.
GPU_SHAPES = [
    (1, 5, 16),
    (7, 64, 96),
    (130, 1000, 1000),
    (1001, 1024, 4096),
    (7, 1024, 16),
    (130, 5, 4096),
    (1001, 64, 96),
    (1, 1000, 1000),
    (130, 64, 4096),
    (1001, 5, 1000),
    (7, 1000, 96),
    (1, 1024, 4096),
    (130, 1024, 96),
    (1001, 1000, 16),
    (2, 65, 64, 96),  # a 3-D batch: 130 rows
]
RANDOM_CASES = [
    (s, random_chain(random.Random(1000 + i), s[-1])) for i, s in enumerate(GPU_SHAPES + GPU_SHAPES[:5])
]
# The presets at a small size: 512 features in groups of 16, AvgPool(16) for M4.
PRESET_CASES = [
    ((64, 256, 512), small_preset(SPEC_PRESETS[m], 512, group_size=16, pool=16)) for m in sorted(SPEC_PRESETS)
]
# Odd sizes for the presets too: groups of 24 channels, k not a multiple of 4.
PRESET_CASES += [
    ((33, 77, 96), small_preset(SPEC_PRESETS[m], 96, group_size=24, pool=16)) for m in ("M1", "M5")
]

CASES = [(s, o, p) for s, o in PRESET_CASES + RANDOM_CASES for p in ("fp32", "tf32x3")]
# TF32 and bf16 on the presets and every fourth random chain.
CASES += [(s, o, p) for s, o in PRESET_CASES + RANDOM_CASES[::4] for p in ("tf32", "bf16")]


@pytest.mark.parametrize(
    "shape,ops,precision", CASES, ids=[f"{p}-{'x'.join(map(str, s))}-{o}" for s, o, p in CASES]
)
def test_parity_float64(shape, ops, precision):
    check_against_float64(shape, ops, precision, seed=sum(shape) + len(ops))


# A batch of 2048 at k = 2048: the tensor-core backward runs dW on the TMA kernel on a side
# stream, over transposes and tensor maps allocated through PyTorch; each must outlive the
# side stream's work (a buffer freed early is handed out again at once). Twice each, so the
# second call runs on memory the first one freed.
TMA_CASES = [
    ((2048, 2048, 2048), small_preset(SPEC_PRESETS[m], 2048, group_size=32, pool=16), p)
    for m in sorted(SPEC_PRESETS)
    for p in ("tf32x3", "tf32", "bf16")
]


@pytest.mark.parametrize(
    "shape,ops,precision", TMA_CASES, ids=[f"{p}-{'x'.join(map(str, s))}-{o}" for s, o, p in TMA_CASES]
)
def test_parity_float64_tensor_core_backward(shape, ops, precision):
    for attempt in range(2):
        check_against_float64(shape, ops, precision, seed=attempt + len(ops))


def test_module_on_gpu_matches_cpu():
    torch.manual_seed(3)
    ops = "groupnorm(8),swish,mul,swish"
    cpu = FusedLinear(40, 96, ops)
    gpu = FusedLinear(40, 96, ops, device=CUDA)
    gpu.load_state_dict(cpu.state_dict())
    assert all(p.device.type == "cuda" for p in gpu.parameters())
    x = torch.randn(17, 40)
    torch.testing.assert_close(gpu(x.to(CUDA)).cpu(), cpu(x), rtol=1e-4, atol=1e-5)
    moved = FusedLinear(40, 96, ops).cuda()
    assert all(p.device.type == "cuda" for p in moved.parameters())
    assert moved(x.to(CUDA)).device.type == "cuda"


# ---------------------------------------------------------------- small batches

# 1..48 rows of TF32, bf16 and fp16 models run the tensor-core small-batch kernel
# (gemv_tc_*; 3xTF32 the FP32 one, gemv_f32, up to 8), 49 the tile GEMMs; k = 520 is
# not whole rounds of its warps' k units. The first chain runs on its 32-column slabs
# (groups of 32), the second needs whole rows (groups of 512: the kernel stores z, then
# the row-wise epilogue).
SMALL_ROWS = [1, 3, 8, 9, 16, 33, 48, 49]
SMALL_CHAINS = ["groupnorm(32),swish,mul,swish", "swish,bias,groupnorm(2)"]


@pytest.mark.parametrize("ops", SMALL_CHAINS)
@pytest.mark.parametrize("rows", SMALL_ROWS)
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_small_batches_match_float64(precision, rows, ops):
    check_against_float64((rows, 520, 1024), ops, precision, seed=rows + len(ops))


@pytest.mark.parametrize("ops", SMALL_CHAINS)
@pytest.mark.parametrize("rows", SMALL_ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_small_batches_of_a_16_bit_model_match_float64(dtype, rows, ops):
    (x, weight, bias, params), dy = gpu_case((rows, 520, 1024), ops, seed=rows + len(ops))
    half = [t.to(dtype) for t in (x, weight, bias, *params, dy)]
    leaves = [t.clone().requires_grad_(True) for t in half[:-1]]
    y = fused_linear.fused_linear(leaves[0], leaves[1], leaves[2], ops, leaves[3:])
    assert y.dtype == dtype
    grads = torch.autograd.grad(y, leaves, half[-1])
    y64, grads64 = reference_grads(*half[:3], ops, half[3:-1], half[-1])
    names = ["y", "x", "weight", "bias", *(f"param{i}" for i in range(len(params)))]
    tol = TOL["bf16" if dtype == torch.bfloat16 else "fp16"]
    for name, got, ref in zip(names, [y, *grads], [y64, *grads64]):
        assert torch.isfinite(got.float()).all(), f"{name}: non-finite values ({ops}, {rows} rows)"
        err = rel_err(got, ref)
        assert err < tol, f"{dtype} {ops}, {rows} rows: {name} relative error {err:.2e}"


# ---------------------------------------------------------------- errors


def test_misaligned_memory():
    n, k, f = 8, 64, 96
    weight, bias = torch.randn(f, k, device=CUDA), torch.randn(f, device=CUDA)
    params = [torch.ones(f, device=CUDA), torch.zeros(f, device=CUDA), torch.randn(f, device=CUDA)]
    ops = "groupnorm(8),swish,mul,swish"
    x = torch.empty(n * k + 1, device=CUDA)[1:].view(n, k)  # contiguous, 4 bytes off
    x.normal_()
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    with pytest.raises(ValueError, match="aligned"):
        fused_linear.fused_linear(x, weight, bias, ops, params)
    w = torch.empty(f * k + 1, device=CUDA)[1:].view(f, k)
    w.normal_()
    with pytest.raises(ValueError, match="aligned"):
        fused_linear.fused_linear(x.clone(), w, bias, ops, params)


def test_two_devices():
    ops = "groupnorm(8),swish,mul,swish"
    x = torch.randn(8, 64, device=CUDA)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    params = [torch.ones(96), torch.zeros(96), torch.randn(96)]
    with pytest.raises(RuntimeError, match="device"):
        fused_linear.fused_linear(x, weight, bias, ops, params)
    # Everything on the GPU but one chain parameter.
    gpu_params = [p.to(CUDA) for p in params[:2]] + [params[2]]
    with pytest.raises(RuntimeError, match="device"):
        fused_linear.fused_linear(x, weight.to(CUDA), bias.to(CUDA), ops, gpu_params)


# float16 is served (its own kernels: test_fp16.py); float64 has no kernels.
@pytest.mark.parametrize("dtype", [torch.float64])
def test_gpu_dtypes_other_than_float32_and_half(dtype):
    ops = "swish,mul"
    x = torch.randn(8, 64, device=CUDA, dtype=dtype)
    weight, bias = torch.randn(96, 64, device=CUDA, dtype=dtype), torch.randn(96, device=CUDA, dtype=dtype)
    with pytest.raises(TypeError, match=r"\bx\b"):
        fused_linear.fused_linear(x, weight, bias, ops, [torch.randn(96, device=CUDA, dtype=dtype)])


# ---------------------------------------------------------------- CUDA graphs

GRAPH_CASES = [
    ("groupnorm(8),swish,mul,swish", "fp32"),
    ("bias,hardtanh(-1,1),mish,groupnorm(8)", "tf32"),  # kinks: the refinement scan runs too
    ("avgpool(4),gelu,scale(2),max", "tf32x3"),
]


# Small, and with k >= 1024, where the tensor-core GEMMs run on the TMA kernel (whose
# tensor maps a kernel writes: a graph's replays must read the maps they wrote).
GRAPH_SIZES = pytest.mark.parametrize("size", [(48, 96, 128), (256, 1024, 512)], ids=["small", "tma"])


@pytest.mark.filterwarnings("error:The AccumulateGrad node's stream does not match")
@pytest.mark.parametrize("ops,precision", GRAPH_CASES)
@GRAPH_SIZES
def test_cuda_graph_capture_and_replay(ops, precision, size):
    torch.manual_seed(0)
    batch, k, f = size
    model = FusedLinear(k, f, ops, precision=precision, device=CUDA)
    params = list(model.parameters())
    static_x = torch.randn(batch, k, device=CUDA, requires_grad=True)
    static_dy = torch.randn(out_shape((batch,), ops, f), device=CUDA)

    def step():
        y = model(static_x)
        y.backward(static_dy)
        return y

    def clear_grads():
        for t in [static_x, *params]:
            t.grad = None

    # Warm up on a side stream (as the PyTorch docs show), then capture on that stream (so
    # that autograd's AccumulateGrad nodes, made in the warm-up, are on the capture's stream).
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            clear_grads()
            step()
    torch.cuda.current_stream().wait_stream(s)
    clear_grads()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        # Detached, so that no autograd graph (and no AccumulateGrad node of the capture's
        # stream) outlives the capture into the eager runs below.
        static_y = step().detach()

    previous = None
    for replay in range(2):
        data = torch.randn(batch, k, device=CUDA)
        with torch.no_grad():
            static_x.copy_(data)
        g.replay()
        torch.cuda.synchronize()
        got = [static_y.clone(), static_x.grad.clone()] + [p.grad.clone() for p in params]
        # Eager, same data and parameters (autograd.grad leaves the captured .grad alone).
        xe = data.clone().requires_grad_(True)
        ye = model(xe)
        want = [ye.detach()] + list(torch.autograd.grad(ye, [xe, *params], static_dy))
        names = ["y", "x.grad"] + [f"{n}.grad" for n, _ in model.named_parameters()]
        for name, a, b in zip(names, got, want):
            assert torch.isfinite(a).all(), f"replay {replay}: {name} not finite"
            torch.testing.assert_close(
                a, b, rtol=1e-6, atol=1e-6, msg=lambda m, name=name, r=replay: f"replay {r}, {name}: {m}"
            )
        if previous is not None:  # the replay computed anew, not the capture's numbers again
            assert not torch.equal(got[0], previous[0])
        previous = got


@pytest.mark.parametrize("ops,precision", GRAPH_CASES)
@GRAPH_SIZES
def test_cuda_graph_inference(ops, precision, size):
    """Forward alone under torch.no_grad (the inference op), captured and replayed."""
    torch.manual_seed(0)
    batch, k, f = size
    model = FusedLinear(k, f, ops, precision=precision, device=CUDA)
    static_x = torch.randn(batch, k, device=CUDA)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(s):
            for _ in range(3):
                model(static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            static_y = model(static_x)
        for _ in range(2):
            data = torch.randn(batch, k, device=CUDA)
            static_x.copy_(data)
            g.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(static_y, model(data), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- torch.compile and opcheck


class Net(nn.Module):
    def __init__(self, precision):
        super().__init__()
        self.a = FusedLinear(64, 128, "groupnorm(8),swish,mul,swish", precision=precision, device=CUDA)
        self.mid = nn.Linear(128, 96, device=CUDA)
        self.b = FusedLinear(
            96, 160, "bias,hardtanh(-1,1),mish,groupnorm(10)", precision=precision, device=CUDA
        )
        self.head = FusedLinear(160, 64, "avgpool(4),gelu,scale(2),max", precision=precision, device=CUDA)

    def forward(self, x):
        return self.head(self.b(torch.tanh(self.mid(self.a(x))))) * 0.5


@pytest.mark.parametrize("precision", ["fp32", "tf32x3"])
def test_compile_inductor_matches_eager(precision):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(precision)
    compiled = torch.compile(model, fullgraph=True)
    names = ["x"] + [n for n, _ in model.named_parameters()]
    for batch in (33, 130):
        x = torch.randn(batch, 64, device=CUDA)
        results = []
        for m in (model, compiled):
            xx = x.clone().requires_grad_(True)
            y = m(xx)
            dy = torch.linspace(-1, 1, y.numel(), device=CUDA).reshape(y.shape)
            results.append((y.detach(), torch.autograd.grad(y, [xx, *model.parameters()], dy)))
        (y_e, g_e), (y_c, g_c) = results
        assert y_c.shape == (batch,)
        torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-5)
        for name, a, b in zip(names, g_c, g_e):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        with torch.no_grad():  # the inference op's path, compiled
            torch.testing.assert_close(compiled(x), y_e, rtol=1e-5, atol=1e-5)


OPCHECK_SAMPLES = [
    ((33, 77, 96), "groupnorm(4),swish,mul,swish", "fp32"),
    ((7, 64, 128), "bias,hardtanh(-1,1),mish,groupnorm(8)", "tf32x3"),
    ((5, 40, 64), "avgpool(16),gelu,scale(2),max", "fp32"),
    ((6, 32, 48), "swish,bias,leakyrelu(0.2),mul", "tf32"),
]


@pytest.mark.parametrize("shape,ops,precision", OPCHECK_SAMPLES)
def test_opcheck_cuda(shape, ops, precision):
    # See test_opcheck_compile.py for what each check means and where it applies.
    all_utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    no_grad = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    (x, weight, bias, params), dy = gpu_case(shape, ops, seed=5)
    fwd = torch.ops.fused_linear.forward.default
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias, *params)]
    torch.library.opcheck(
        fwd, (leaves[0], leaves[1], leaves[2], leaves[3:], ops, precision), test_utils=all_utils
    )
    torch.library.opcheck(fwd, (x, weight, bias, params, ops, precision), test_utils=no_grad)
    y, z = torch.ops.fused_linear.forward(x, weight, bias, params, ops, precision)
    assert y.shape == dy.shape
    bwd = torch.ops.fused_linear.backward.default
    torch.library.opcheck(bwd, (x, weight, bias, params, z, dy, ops, precision), test_utils=no_grad)
    inf = torch.ops.fused_linear.inference.default
    torch.library.opcheck(inf, (x, weight, bias, params, ops, precision), test_utils=no_grad)
    y_inf = torch.ops.fused_linear.inference(x, weight, bias, params, ops, precision)
    torch.testing.assert_close(y_inf, y, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- streams and synchronisation


def sleep_cycles(ms):
    """Cycles of torch.cuda._sleep that keep the GPU busy for at least about ``ms``
    milliseconds: timed three times, the fastest taken, since a GPU coming out of idle
    runs the first at a lower clock (one calibration at half the clock gave half the sleep)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    fastest = float("inf")
    for _ in range(3):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        fastest = min(fastest, start.elapsed_time(end))
    return int(cycles * ms / fastest)


STREAM_CASES = [("groupnorm(8),swish,mul,swish", "fp32"), ("bias,hardtanh(-1,1),mish,groupnorm(8)", "tf32")]


@pytest.mark.parametrize("ops,precision", STREAM_CASES)
def test_runs_on_the_current_stream(ops, precision):
    """Work on a side stream: the input is written there after a long sleep kernel, so an op
    that ran on another stream (the default one, or its own without waiting on the current
    one) would read the input before it is written and give other numbers."""
    torch.manual_seed(0)
    model = FusedLinear(256, 512, ops, precision=precision, device=CUDA)
    params = list(model.parameters())
    x = torch.randn(130, 256, device=CUDA)
    dy = torch.randn(130, 512, device=CUDA)

    def run(inp):
        inp = inp.requires_grad_(True)
        y = model(inp)
        return [y.detach()] + list(torch.autograd.grad(y, [inp, *params], dy))

    want = run(x.clone())
    torch.cuda.synchronize()
    cycles = sleep_cycles(200)

    side = torch.cuda.Stream()
    x_side = torch.zeros_like(x)  # zeros until the side stream's copy lands
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        x_side.copy_(x)
        got = run(x_side)
        assert torch.cuda.current_stream() == side
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    names = ["y", "x.grad"] + [f"{n}.grad" for n, _ in model.named_parameters()]
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("ops,precision", STREAM_CASES + [("avgpool(4),gelu,scale(2),max", "bf16")])
def test_no_host_synchronisation(ops, precision):
    """Forward and backward (and the no-grad inference path) queue their work and return
    without waiting for the GPU.

    Two checks:
    - ``torch.cuda.set_sync_debug_mode("error")`` raises on the implicit synchronisation of
      PyTorch ops (``.item()``, ``.cpu()``, ``.tolist()``, nonzero, ...), e.g. in the
      package's Python code. PyTorch's own autograd makes none in a plain same-stream
      backward. It sees neither an explicit ``torch.cuda.synchronize()`` (checked: not
      flagged) nor what the Rust host does through the CUDA driver itself
      (cuStreamSynchronize, a blocking cuMemcpyDtoH, ...).
    - So also: a sleep kernel of ~300 ms is queued first on the same stream; if forward and
      backward return to the host well before it can have finished, nothing in them waited
      for the GPU, whatever API it used (a stand-in op that called torch.cuda.synchronize()
      or cudaDeviceSynchronize through ctypes failed here with 303 ms).
    """
    torch.manual_seed(0)
    model = FusedLinear(256, 512, ops, precision=precision, device=CUDA)
    params = list(model.parameters())
    x = torch.randn(130, 256, device=CUDA, requires_grad=True)
    dy = torch.randn(out_shape((130,), ops, 512), device=CUDA)

    def run():
        y = model(x)
        with torch.no_grad():  # the inference op too
            y_inference = model(x)
        return [y, y_inference] + list(torch.autograd.grad(y, [x, *params], dy))

    want = [t.clone() for t in run()]  # warm-up: lazy loading and allocations happen here
    torch.cuda.synchronize()
    sleep_ms = 300
    cycles = sleep_cycles(sleep_ms)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    with warnings.catch_warnings():  # "a prototype feature": said once, not an error here
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    total_ms = (time.perf_counter() - t0) * 1e3
    assert total_ms > 0.8 * sleep_ms, f"the sleep kernel did not hold the GPU ({total_ms:.0f} ms)"
    assert host_ms < 0.5 * sleep_ms, (
        f"forward+backward took {host_ms:.0f} ms on the host behind a {sleep_ms} ms GPU sleep: "
        "it waited for the GPU"
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "precision,dtype", [("fp32", torch.float32), ("tf32x3", torch.float32), (None, torch.bfloat16)]
)
def test_input_without_grad_skips_dx_and_keeps_parameter_gradients(precision, dtype):
    """An input that needs no gradient (a first layer's data): the GPU backward skips the
    dX GEMM; every parameter's gradient is the one a gradient-tracking input gets."""
    torch.manual_seed(5)
    block = FusedLinear(256, 128, "groupnorm(8),swish", precision=precision).to(CUDA, dtype)
    x = torch.randn(64, 256, device=CUDA, dtype=dtype)
    dy = torch.randn(64, 128, device=CUDA, dtype=dtype)
    grads = []
    for needs in (True, False):
        block.zero_grad()
        xin = x.clone().requires_grad_(needs)
        block(xin).backward(dy)
        assert (xin.grad is not None) == needs
        grads.append([p.grad.clone() for p in block.parameters()])
    for (name, _), full, part in zip(block.named_parameters(), *grads):
        assert torch.equal(full, part), f"{name}: the gradient changed without dx"


@pytest.mark.parametrize("precision,dtype", [("tf32", torch.float32), (None, torch.bfloat16)])
def test_outputs_and_gradients_outlive_later_calls(precision, dtype):
    """Buffers the native calls drop are kept for their next calls on the stream (and
    small tables by content): an output or gradient handed to PyTorch must never be
    one of them. Two blocks' training steps, interleaved and all kept alive, then each
    step again: every kept tensor still holds its own step's values."""
    torch.manual_seed(11)
    blocks = [
        FusedLinear(1024, 512, "groupnorm(16),swish,mul,swish", precision=precision).to(CUDA, dtype),
        FusedLinear(256, 1024, "bias,gelu,max", precision=precision).to(CUDA, dtype),
    ]
    kept = []
    for step in range(6):
        block = blocks[step % 2]
        x = torch.randn(64 + 8 * step, block.in_features, device=CUDA, dtype=dtype, requires_grad=True)
        y = block(x)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, [x, *block.parameters()], dy)
        kept.append((block, x.detach(), dy, [y.detach(), *grads]))
    for step, (block, x, dy, got) in enumerate(kept):
        x = x.clone().requires_grad_(True)
        y = block(x)
        want = [y.detach(), *torch.autograd.grad(y, [x, *block.parameters()], dy)]
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {step}, output {i}: changed by later calls"


def test_release_buffers_gives_back_what_the_calls_keep():
    """The spare buffers and tables a stream keeps are PyTorch allocations, and
    release_buffers() frees them; the calls after it are unchanged."""
    torch.manual_seed(12)
    block = FusedLinear(1024, 256, "groupnorm(8),swish,mul,swish").to(CUDA, torch.bfloat16)
    x = torch.randn(48, 1024, device=CUDA, dtype=torch.bfloat16)
    with torch.no_grad():
        want = block(x)
    for _ in range(3):
        xg = x.clone().requires_grad_(True)
        block(xg).backward(torch.ones_like(want))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    fused_linear.release_buffers()
    assert torch.cuda.memory_allocated() < held
    with torch.no_grad():
        assert torch.equal(block(x), want)


def test_kernels_load_from_the_cubin():
    """The wheel was built with ptxas (as CI's and the device runs' are): the GPU loads the
    cubin, not the PTX the driver would spend up to a minute compiling."""
    assert fused_linear.kernel_image() == "cubin", "wheel built without PTXAS: the kernels load from PTX"
    assert fused_linear.kernel_image(torch.device(CUDA, torch.cuda.current_device())) == "cubin"
