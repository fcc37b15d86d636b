"""A pixel diffusion transformer trained with full attention or sparsa's LLSA (docs/dit.md).

PyTorch is a training-time dependency of this engine only. sparsa is imported from the installed
package, or else from the extension a plain CMake build puts in <repository>/build/python.
"""
import sys
from pathlib import Path

try:
    import sparsa  # noqa: F401
except ModuleNotFoundError:
    _built = Path(__file__).resolve().parents[2] / "build" / "python"
    if not (_built / "sparsa").is_dir():
        raise ModuleNotFoundError("engines.dit needs the sparsa Python package: pip install . or bash scripts/build "
                                  "(which puts it in build/python)", name="sparsa") from None
    sys.path.insert(0, str(_built))
    import sparsa  # noqa: F401
