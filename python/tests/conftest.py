"""pytest setup for the fused_linear suite.

- The ``gpu`` marker: such tests are skipped when, and only when, PyTorch sees no CUDA
  device (``torch.cuda.is_available()`` is False). On a GPU machine they all run.
- ``plain_block``: a factory for plain-PyTorch reference modules (``chain_ref.PlainBlock``).
- ``chain_ref`` (this folder) holds the float64 reference and the random chains; this file
  puts the folder on ``sys.path`` so the test modules import it under any import mode.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chain_ref  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (skipped when torch.cuda.is_available() is False)"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state (module initialisation draws from it)."""
    torch.manual_seed(0)


@pytest.fixture
def plain_block():
    """``plain_block(in, out, ops, randomize=True, device=None, dtype=None)``: a plain PyTorch
    ``Linear`` + chain module named as FusedLinear names its parameters; with ``randomize``
    the GroupNorm affine parameters are drawn from randn so that they matter."""

    def make(in_features, out_features, ops, randomize=True, device=None, dtype=None):
        m = chain_ref.PlainBlock(in_features, out_features, ops, device=device, dtype=dtype)
        return m.randomize_affine() if randomize else m

    return make
