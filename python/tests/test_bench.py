"""``python -m fused_linear.bench`` without a GPU: the CPU smoke run writes its JSON and
markdown, the plain peer computes the block FusedLinear computes (same state_dict), the
helpers keep scaled-down chains valid, and bad arguments are argparse errors (exit 2).

One ``gpu`` test runs every protocol, both modes, fp32 and bf16, with ``torch.compile``, at
one small size, and checks that every cell got a time."""

import io
import json
import re
from pathlib import Path

import pytest
import torch

import fused_linear
from chain_ref import reference, rel_err
from fused_linear import FusedLinear, bench

SMOKE = ["--device", "cpu", "--no-compile", "--iters", "2", "--warmup", "1", "--no-progress"]


def _run(tmp_path, *extra):
    """Runs bench.main on the CPU; returns (exit status, the JSON, the markdown)."""
    js, md = tmp_path / "bench.json", tmp_path / "bench.md"
    status = bench.main([*SMOKE, "--json", str(js), "--markdown", str(md), *extra])
    return status, json.loads(js.read_text()), md.read_text()


def test_cpu_smoke_run(tmp_path, capsys):
    status, result, md = _run(tmp_path, "--models", "M1,M4", "--rows", "1,8", "--features", "64x64")
    assert status == 0
    rows = result["rows"]
    for impl in ("ours", "eager"):
        for protocol, unit in (("host", "us"), ("stream", "ms")):
            cells = [r for r in rows if r["impl"] == impl and r["protocol"] == protocol]
            # M1 and M4 (one shape each) and the sweep at rows 1 and 8, fwd and fwdbwd each.
            assert len(cells) == 4 * 2, (impl, protocol)
            for r in cells:
                assert r["error"] is None, r
                assert r["unit"] == unit and r["value"] > 0, r
    assert {r["impl"] for r in rows} == {"ours", "eager"}  # --no-compile
    assert {r["config"] for r in rows} == {"fp32"}
    assert {r["mode"] for r in rows} == {"fwd", "fwdbwd"}
    assert {(r["model"], r["rows"], r["in"], r["out"]) for r in rows} == {
        ("M1", 8, 128, 256),
        ("M4", 8, 128, 256),
        ("sweep", 1, 64, 64),
        ("sweep", 8, 64, 64),
    }
    expected_keys = {"config", "mode", "chain", "model", "rows", "in", "out", "impl", "protocol", "value"}
    assert expected_keys | {"unit", "error"} <= set(rows[0])

    meta = result["meta"]
    assert meta["torch"] == torch.__version__
    assert meta["fused_linear"] == fused_linear.__version__
    assert meta["compile"]["enabled"] is False
    assert set(meta["protocols"]) == {"stream", "host"}

    # Ours against eager, once per shape: the CPU backend is FP32, as is eager.
    assert len(result["correctness"]) == 4
    for c in result["correctness"]:
        assert c["error"] is None, c
        assert c["rel_err_y"] < 1e-5 and c["rel_err_dx"] < 1e-4 and c["rel_err_dw"] < 1e-4, c

    # One table per (protocol, config, mode), each with a header, a rule and a line per shape.
    separators = [line for line in md.splitlines() if re.fullmatch(r"\|(-{3,}:?\|)+", line)]
    assert len(separators) >= 4
    assert "| model | rows | in | out | eager us | ours us | x best | rel err y |" in md
    assert "## Summary" in md
    out = capsys.readouterr().out
    assert "## Summary" in out and out.rstrip().splitlines()[-1].startswith("| host | fp32 | fwdbwd |")


def test_cpu_notes_unsupported_configs_and_protocols(tmp_path):
    status, result, md = _run(
        tmp_path, "--models", "M2", "--rows", "1", "--configs", "fp32,bf16", "--protocols", "graph,host"
    )
    assert status == 0
    assert {r["config"] for r in result["rows"]} == {"fp32"}
    assert {r["protocol"] for r in result["rows"]} == {"host"}
    notes = " ".join(result["meta"]["notes"])
    assert "bf16" in notes and "graph" in notes
    assert "Note:" in md


def peer_pair(ops: str, in_features: int, out_features: int, batch: int):
    """FusedLinear and its peer with the same weights, each run forward and backward on
    the same input and output gradient (checked to agree); returns both, their outputs and
    the input."""
    fused = bench.randomize_affine(FusedLinear(in_features, out_features, ops))
    plain = bench.PlainBlock(in_features, out_features, ops)
    plain.load_state_dict(fused.state_dict())  # the same names and buffers, strictly
    x = torch.randn(batch, in_features)
    x_ours, x_plain = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ours, y_plain = fused(x_ours), plain(x_plain)
    assert y_plain.shape == y_ours.shape
    assert rel_err(y_plain, y_ours) < 1e-5
    dy = torch.randn_like(y_ours)
    y_ours.backward(dy)
    y_plain.backward(dy)
    assert rel_err(x_plain.grad, x_ours.grad) < 1e-4
    assert rel_err(plain.lin.weight.grad, fused.lin.weight.grad) < 1e-4
    return fused, y_plain, x


@pytest.mark.parametrize("model", sorted(fused_linear.PRESETS))
def test_plain_peer_matches_fused_linear(model):
    """The peer computes the block FusedLinear computes (its own ops, the same weights)."""
    ops = bench.scale_chain(fused_linear.PRESETS[model], 8192 if model != "M2" else 4096, 256)
    fused, y_plain, x = peer_pair(ops, 128, 256, 16)
    # And against the float64 reference of the tests (written apart from either).
    params = [
        dict(fused.named_parameters())[name] for name, _, _ in fused_linear._native.describe(128, 256, ops)[4]
    ]
    expected = reference(x, fused.lin.weight, fused.lin.bias, ops, params)
    assert rel_err(y_plain, expected) < 1e-5


def test_plain_peer_every_op_and_repeated_names():
    """Every op kind, the aliases (double, silu), defaults and repeated parameters (bias2)."""
    ops = "bias,hardtanh(-2,2),double,silu,tanh,leakyrelu(0.2),gn(4, 1e-3),mish,gelu,scale(0.5),mul,bias"
    ops += ",groupnorm(2),avgpool(4),max"
    fused = bench.randomize_affine(FusedLinear(32, 64, ops))
    plain = bench.PlainBlock(32, 64, ops)
    assert sorted(plain.state_dict()) == sorted(fused.state_dict())
    assert {"bias", "bias2", "w", "gn.weight", "gn2.bias"} <= set(plain.state_dict())
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(8, 32)
    y = plain(x)
    assert y.shape == (8,)
    assert rel_err(y, fused(x)) < 1e-5
    # Leading dimensions flatten into the batch, as FusedLinear's do.
    assert plain(x.view(2, 4, 32)).shape == (2, 4)


@pytest.mark.parametrize(
    "ops",
    [
        "swish,batchnorm,layernorm,rmsnorm,softmax,gelu",
        "sigmoid,scale(2),residual",
        "mish,maxpool(2),mean,tanh",
        "sum,max,logsumexp,gelu",
        "bias,min,swish",
        "layernorm(1e-3),mul,logsumexp",
    ],
)
def test_plain_peer_takes_every_registry_op(ops):
    """The norms, reductions, softmax, MaxPool and the residual, forward and gradients:
    a peer of another function would make every ratio and error of the benchmark wrong."""
    peer_pair(ops, 16, 32, 9)


def test_plain_peer_covers_the_registry():
    names = {op["name"] for op in fused_linear._native.ops()}
    assert names <= bench._PLAIN_OPS, names - bench._PLAIN_OPS


def test_scale_chain_keeps_groups_and_pool_valid():
    for model, ops in fused_linear.PRESETS.items():
        seed_rows, seed_in, seed_out = bench.SEED_SIZES[model]
        for out in (256, 64, 48):
            scaled = bench.scale_chain(ops, seed_out, out, seed_in)
            if "avgpool(16)" in scaled and out % 16:
                continue  # the pool itself needs a multiple of 16: not the helper's to change
            canonical = fused_linear._native.describe(64, out, scaled)[3]  # valid, or raises
            for op in canonical:
                kind, args = bench.parse_op(op)
                if kind == "groupnorm":
                    assert out % int(args[0]) == 0 and out // int(args[0]) >= bench.MIN_CHANNELS_PER_GROUP


def test_sweep_chain_has_32_channels_per_group():
    assert bench.sweep_chain(bench.DEFAULT_SWEEP_CHAIN, 4096) == "groupnorm(128),swish,mul,swish"
    assert bench.sweep_chain(bench.DEFAULT_SWEEP_CHAIN, 16) == "groupnorm(1),swish,mul,swish"


def test_progress_without_a_terminal_prints_a_line_per_case():
    stream = io.StringIO()
    progress = bench.Progress(3, bar=False, stream=stream)
    for label in ("a", "b"):
        progress.begin(label)
        progress.advance()
    progress.begin("c")
    progress.advance(note="skipped")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in stream.getvalue()
    assert (
        lines[0].startswith("[1/3]")
        and lines[-1].startswith("[3/3]")
        and " c: " in lines[-1]
        and lines[-1].endswith(" s | skipped")
    )


def test_progress_bar_redraws_one_line():
    stream = io.StringIO()
    progress = bench.Progress(2, bar=True, stream=stream)
    progress.begin("first")
    progress.status("fwd eager host")
    progress.advance()
    progress.close()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.count("\r") == 3 and "eta" in text


def test_markdown_ratio_is_the_faster_peer_over_ours():
    assert bench._ratio({"eager": 3.0, "compile": 2.0, "ours": 1.0}) == 2.0
    assert bench._ratio({"eager": 3.0, "ours": 1.5}) == 2.0
    assert bench._ratio({"eager": None, "compile": None, "ours": 1.0}) is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--configs", "fp16"],
        ["--modes", "backward"],
        ["--protocols", "wallclock"],
        ["--models", "M9"],
        ["--shapes", "huge"],
        ["--rows", "0"],
        ["--rows", "a,b"],
        ["--features", "64by64"],
        ["--iters", "0"],
        ["--warmup", "-1"],
        ["--compile-mode", "fastest"],
        ["--sweep-chain", "groupnorm({nope}),swish"],
        ["--sweep-chain", "groupnorm(3),swish"],  # 3 groups cannot divide 64 channels
        ["--kernelbench", "/nonexistent/folder"],
        ["--configs", "bf16"],  # nothing left to run on the CPU
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--device", "cpu", "--no-progress", "--json", "", "--markdown", "", *argv])
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_an_argument_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit) as info:
        bench.main(["--json", "", "--markdown", ""])
    assert info.value.code == 2
    assert "--device cpu" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_every_protocol_with_compile(tmp_path):
    js = tmp_path / "bench.json"
    argv = ["--shapes", "sweep", "--rows", "64", "--features", "1024x1024", "--configs", "fp32,bf16"]
    argv += ["--iters", "3", "--warmup", "1", "--no-progress", "--json", str(js), "--markdown", ""]
    assert bench.main(argv) == 0
    result = json.loads(js.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 4 * 3  # configs x modes x protocols x implementations
    assert [r for r in rows if r["error"] is not None] == []
    assert all(r["value"] > 0 for r in rows)
    for c in result["correctness"]:
        limit = 2e-2 if c["config"] == "bf16" else 1e-4
        assert c["rel_err_y"] < limit and c["rel_err_dx"] < limit, c


def test_torchao_peers_belong_to_the_fp8_config_only():
    runner = bench.Bench.__new__(bench.Bench)  # (only its implementation list is needed)
    runner.impls = list(bench.IMPLS)
    assert set(bench.TORCHAO_IMPLS) <= set(bench.IMPLS)
    assert [i for i in runner._impls_for("bf16") if i in bench.TORCHAO_IMPLS] == []
    assert runner._impls_for("fp8") == list(bench.IMPLS)


@pytest.mark.gpu
def test_gpu_fp8_config_runs_with_its_peers(tmp_path):
    js = tmp_path / "bench.json"
    argv = ["--shapes", "sweep", "--rows", "64", "--features", "1024x1024", "--configs", "fp8"]
    argv += ["--protocols", "graph", "--iters", "3", "--warmup", "1", "--no-progress", "--json", str(js)]
    assert bench.main(argv + ["--markdown", ""]) == 0
    rows = json.loads(js.read_text())["rows"]
    impls = {r["impl"] for r in rows}
    assert {"eager", "compile", "ours"} <= impls
    assert (bench._torchao() is not None) == bool(impls & set(bench.TORCHAO_IMPLS))
    assert [r for r in rows if r["error"] is not None] == []


KERNELBENCH = Path(__file__).resolve().parents[2] / "examples" / "kernelbench"
#: The five with a hand-written ModelNew and five that only fuse() runs: a bare matmul weight
#: (#14), a training-mode BatchNorm (#33), two Linears (#45), a Dropout (#66), a zero output
#: (#80). All 36 are python/tests/test_kernelbench36.py's.
KERNELBENCH_SUBSET = (88, 37, 62, 98, 94, 14, 33, 45, 66, 80)


def kernelbench_subset(tmp_path: Path) -> Path:
    """A folder with KERNELBENCH_SUBSET's problem files (the whole folder costs minutes here)."""
    if not KERNELBENCH.is_dir():
        pytest.skip("examples/kernelbench is not in this checkout")
    folder = tmp_path / "kernelbench"
    folder.mkdir()
    for pid in KERNELBENCH_SUBSET:
        (path,) = KERNELBENCH.glob(f"p{pid:03d}_*.py")
        (folder / path.name).write_text(path.read_text())
    return folder


def test_cpu_kernelbench_problems(tmp_path):
    """--kernelbench: each problem's ModelNew, or fuse(Model) where it has none, against its
    Model (same seed, same weights)."""
    folder = kernelbench_subset(tmp_path)
    status, result, md = _run(
        tmp_path, "--kernelbench", str(folder), "--models", "M1", "--rows", "1", "--protocols", "host"
    )
    assert status == 0
    models = {r["model"] for r in result["rows"]}
    assert {"KB88(M1)", "KB37(M2)", "KB62(M3)", "KB98(M4)", "KB94(M5)", "KB14", "KB66"} <= models
    assert [r for r in result["rows"] if r["error"] is not None] == []
    for c in result["correctness"]:
        assert c["error"] is None and c["rel_err_y"] < 1e-5, c
    assert "| KB98(M4) |" in md
    chains = {r["model"]: r["chain"] for r in result["rows"]}
    assert chains["KB14"] == "scale(0.5),sum,scale(1.5)" and chains["KB66"] == "(nothing fused)", chains


def test_kernelbench_fused_mode(tmp_path):
    """--kernelbench DIR --fuse times fuse(Model) of every problem file (ModelNew not needed),
    the fused chain in the chain column, ours equal to eager."""
    import json

    from fused_linear import bench

    out = tmp_path / "fz.json"
    folder = kernelbench_subset(tmp_path)
    argv = ["--device", "cpu", "--no-compile", "--iters", "2", "--warmup", "1", "--no-progress"]
    argv += ["--kernelbench", str(folder), "--fuse", "--shapes", "tiny", "--json", str(out), "--markdown", ""]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    checks = [c for c in result["correctness"] if c["model"].startswith("KB")]
    assert len(checks) == len(KERNELBENCH_SUBSET)
    for c in checks:
        assert c["error"] is None and c["rel_err_y"] < 1e-5 and c["rel_err_dx"] < 1e-5, c
    chains = {row["chain"] for row in result["rows"] if row["model"].startswith("KB")}
    assert "groupnorm(16,1e-05),leakyrelu(0.01),scale(2.0)" in chains, chains
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--fuse"])
    assert e.value.code == 2


def test_kernelbench_problem_filter(tmp_path):
    """--problems picks problem files by number; --kernelbench alone times no presets; a
    number with no file, or --problems / --shapes none without --kernelbench, is refused."""
    import json

    from fused_linear import bench

    out = tmp_path / "p.json"
    folder = kernelbench_subset(tmp_path)
    argv = ["--device", "cpu", "--no-compile", "--iters", "1", "--warmup", "0", "--no-progress", "--fuse"]
    argv += ["--kernelbench", str(folder), "--problems", "14", "--json", str(out), "--markdown", ""]
    assert bench.main(argv) == 0
    assert {row["model"] for row in json.loads(out.read_text())["rows"]} == {"KB14"}
    for bad in (
        ["--kernelbench", str(folder), "--problems", "999"],
        ["--problems", "14"],
        ["--shapes", "none"],
    ):
        with pytest.raises(SystemExit) as e:
            bench.main(["--device", "cpu", "--no-compile", *bad])
        assert e.value.code == 2, bad


def test_sigterm_writes_what_was_measured(tmp_path):
    """A run stopped by SIGTERM (`timeout`, a scheduler) writes its partial results and
    exits 130, as Ctrl-C does."""
    import json
    import signal
    import subprocess
    import sys

    out = tmp_path / "partial.json"
    argv = [sys.executable, "-m", "fused_linear.bench", "--device", "cpu", "--no-compile", "--no-progress"]
    argv += ["--shapes", "tiny", "--iters", "400", "--warmup", "1", "--json", str(out), "--markdown", ""]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    # The first finished case's line (warnings, e.g. torch's without numpy, may come first).
    seen = []
    while not (seen and seen[-1].startswith("[1/")):
        line = proc.stderr.readline()
        assert line, f"the run ended before its first case: {seen}"
        seen.append(line)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    result = json.loads(out.read_text())
    assert "interrupted: the results are partial" in result["meta"]["notes"]
    assert result["rows"], "the finished case's measurements"
