"""Shared fixtures."""

import pytest

from verl_cppack.packing import pack_copies


@pytest.fixture(params=["per-position index", "block copies"], scope="module")
def both_pack_paths(request):
    """Run a module's tests with both ways ``pack`` copies: row by row, and windows of rows (``core.blocks``).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("both_pack_paths")``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pack_copies, "MIN_BLOCK_COPY_POSITIONS", 0 if request.param == "block copies" else 2**62)
        yield request.param
