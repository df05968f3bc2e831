"""Shared test settings: `gpu` tests skip without CUDA; `one_thread` for tiny-model tests."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads; one thread keeps a busy 2-core box steady.
    A test module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
