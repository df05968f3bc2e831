"""Shared test settings: `gpu` tests skip without CUDA; `one_thread` for tiny-model tests;
`artifacts` for files a test leaves for people to look at (their paths end the session's report)."""

from pathlib import Path

import pytest
import torch

ARTIFACTS = Path(__file__).resolve().parent.parent / "build" / "test-artifacts"
_written: list[Path] = []


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


@pytest.fixture
def artifacts():
    """``artifacts(name)``: a path under build/test-artifacts/ to write a file for people to see."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    def path(name: str) -> Path:
        _written.append(ARTIFACTS / name)
        return ARTIFACTS / name

    return path


def pytest_terminal_summary(terminalreporter):
    written = [p for p in _written if p.exists()]
    if written:
        terminalreporter.section("artifacts")
        for p in written:
            terminalreporter.write_line(str(p))
