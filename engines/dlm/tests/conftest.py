# pytest configuration of the DLM engine tests: `--sparsa PATH` (or $SPARSA_BIN) names the
# binary under test. CTest passes the built target's path.
import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--sparsa", default=os.environ.get("SPARSA_BIN"), help="path to the sparsa binary")


@pytest.fixture(scope="session")
def sparsa_bin(request):
    path = request.config.getoption("--sparsa")
    if not path:
        pytest.fail("no sparsa binary: pass --sparsa PATH or set SPARSA_BIN")
    if not os.access(path, os.X_OK):
        pytest.fail(f"sparsa binary {path!r} is not executable")
    return os.path.abspath(path)
