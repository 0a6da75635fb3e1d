"""Suite-wide: measured cost curves go to a temporary folder, never to the user's ~/.cache (tests calibrate tiny
models whose curves must not be mistaken for a real one's)."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _cost_curves_in_a_temp_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("OOO_COST_DIR", str(tmp_path_factory.mktemp("cost-curves")))
    yield
    mp.undo()
