"""`sparsa plan --method llsa` and `sparsa run --method llsa`."""
import json
import subprocess

import numpy as np


def test_plan_llsa_prints_levels_and_dumps_the_fine_index(sparsa_bin, tmp_path):
    r = subprocess.run([sparsa_bin, "plan", "--method", "llsa", "-P", "topk=4", "-P", "block=16", "--length", "1024",
                        "--json", str(tmp_path / "p.json"), "--svg", str(tmp_path / "m.svg")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "level lengths: 1024 64" in r.stdout and "picks are fine key blocks" in r.stdout
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["method"] == "llsa" and d["llsa"]["levels"] == 1 and d["llsa"]["level_len"] == [1024, 64]
    indices = np.array(d["indices"])
    assert indices.shape == (1, 8, 64, 4)  # top-4 fine key blocks for every query block
    assert ((indices >= 0) & (indices < 64)).all()
    assert (np.diff(indices, axis=-1) > 0).all()  # ascending, distinct
    assert "<svg" in (tmp_path / "m.svg").read_text()


def test_plan_llsa_rejects_bad_parameters(sparsa_bin):
    for args, message in ((["-P", "block=1"], "block"), (["-P", "levels=0"], "levels"), (["-P", "topk=x"], "topk")):
        r = subprocess.run([sparsa_bin, "plan", "--method", "llsa", "--length", "256", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("sparsa: error: params: " + message), last
