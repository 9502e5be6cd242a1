import os
import tempfile

import pytest
import torch

from dmattn_cute.jit import CACHE_ENV


def pytest_configure(config: pytest.Config) -> None:
    # Tests compile into a cache of their own, so every run proves its kernels compile; set
    # DMATTN_CUTE_CACHE_DIR to reuse a cache across runs.
    os.environ.setdefault(CACHE_ENV, tempfile.mkdtemp(prefix="dmattn_cute_test_cache_"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
