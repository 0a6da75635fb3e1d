"""Suite-wide: measured cost curves go to a temporary folder, never to the user's ~/.cache (tests calibrate tiny
models whose curves must not be mistaken for a real one's); `load_script` imports a file of scripts/ as a module."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"


@pytest.fixture(autouse=True, scope="session")
def _cost_curves_in_a_temp_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("OOO_COST_DIR", str(tmp_path_factory.mktemp("cost-curves")))
    yield
    mp.undo()


@pytest.fixture
def load_script():
    """`load_script("bench_prefill")`: scripts/bench_prefill.py as a module (scripts/ is not a package)."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load
