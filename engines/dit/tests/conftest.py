import sys
from pathlib import Path

# `engines.dit` from this checkout (its __init__ finds sparsa: installed, or <repository>/build/python).
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
