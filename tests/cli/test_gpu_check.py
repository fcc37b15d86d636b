"""scripts/gpu-check's modes, on a machine without a GPU: GPU_CHECK_DRY=1 prints each step's
command instead of running it, so the steps a call would take (and the targets it would build)
are checked here. Several modes in one call share the build and run each step once."""
import os
import re
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "scripts", "gpu-check")


def dry(tmp_path, *modes):
    env = dict(os.environ, GPU_CHECK_DRY="1", OUT=str(tmp_path / "out"))
    r = subprocess.run(["bash", SCRIPT, *modes], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    steps = re.findall(r"^== ([\w-]+): ", r.stdout, re.M)
    build = re.findall(r"^DRY cmake --build build-gpu --parallel \d+ ?(.*)$", r.stdout, re.M)
    return r, steps, build


def test_two_modes_share_the_build_and_run_each_step_once(tmp_path):
    r, steps, build = dry(tmp_path, "--flash", "--masks")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("gpu-check: all green")
    assert steps.count("build") == 1 and steps.count("cuda-tests") == 1
    assert steps.count("memcheck") == 1 and steps.count("masks-racecheck") == 1
    for s in ("masks-bench", "mask-logic-tests", "bench", "ba-att-schedule2"):  # one mode's steps each
        assert s in steps, (s, steps)
    targets = build[0].split()
    assert targets[0] == "--target" and targets[1:] == sorted(set(targets[1:]))
    assert {"test_cuda_attention", "sparsa_bench_shim", "test_cuda_mask_logic", "_sparsa"} <= set(targets[1:])


def test_one_mode_and_the_full_call(tmp_path):
    r, steps, build = dry(tmp_path, "--dlm-tests")
    assert r.returncode == 0, r.stderr
    assert "dlm-tests" in steps and "cuda-tests" not in steps and "bench" not in steps
    assert "sparsa_cli" in build[0].split()
    r, steps, build = dry(tmp_path)
    assert r.returncode == 0, r.stderr
    assert build == [""]  # every target
    assert {"tests", "cuda-tests", "ladder", "bench", "dlm-bench"} <= set(steps)


@pytest.mark.parametrize("args", [["--bogus"], ["--flash", "--nope"]])
def test_an_unknown_mode_is_a_usage_error(tmp_path, args):
    r, steps, _ = dry(tmp_path, *args)
    assert r.returncode == 2 and "usage: scripts/gpu-check" in r.stderr and steps == []
