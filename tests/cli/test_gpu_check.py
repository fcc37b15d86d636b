"""scripts/gpu-check's modes, on a machine without a GPU: GPU_CHECK_DRY=1 prints each step's
command instead of running it, so the steps a call would take (and the targets it would build)
are checked here. Several modes in one call share the build and run each step once."""
import os
import re
import subprocess
import tarfile

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
    assert "dlm-py-tests" in steps  # the engine's C++ and Python tests run directly, not through ctest
    assert "dlm-gemm-tests" in steps  # the weight-streaming GEMM's test binary whole, not only its sanitizer cases
    assert "sparsa_cli" in build[0].split()
    r, steps, build = dry(tmp_path)
    assert r.returncode == 0, r.stderr
    assert build == [""]  # every target
    assert {"tests", "cuda-tests", "ladder", "bench", "dlm-bench"} <= set(steps)
    # The engine's three GEMM choices each have their block-step rows.
    assert {"dlm-gemm", "dlm-streaming", "dlm-tuned"} <= set(steps)


@pytest.mark.parametrize("args", [["--bogus"], ["--flash", "--nope"]])
def test_an_unknown_mode_is_a_usage_error(tmp_path, args):
    r, steps, _ = dry(tmp_path, *args)
    assert r.returncode == 2 and "usage: scripts/gpu-check" in r.stderr and steps == []


def stamp():
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "tree-stamp")], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_targets_of_the_modes(tmp_path):
    env = dict(os.environ, GPU_CHECK_TARGETS="1")
    r = subprocess.run(["bash", SCRIPT, "--masks", "--eval"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    targets = r.stdout.split()
    assert targets == sorted(set(targets)) and {"test_cuda_attention", "_sparsa", "sparsa_cli"} <= set(targets)
    r = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == ""  # the full call builds everything


def test_prebuild_finds_each_target_by_its_link_rule(tmp_path):
    """scripts/gpu-prebuild packs the file each target links, found by the target's link rule in
    build.ninja (lines of the shapes CMake's Ninja generator writes): a target whose file has
    another name (sparsa_cli links tools/sparsa), a Python module, a test with its extra outputs, a
    static library; a target without a rule or a prefix of another's name is not matched."""
    (tmp_path / "build.ninja").write_text(
        "build tools/sparsa: CXX_EXECUTABLE_LINKER__sparsa_cli_Release tools/a.o | libsparsa.a\n"
        "build python/sparsa/_sparsa.cpython-312-x86_64-linux-gnu.so: CXX_MODULE_LIBRARY_LINKER___sparsa_Release a.o\n"
        "build tests/test_cuda_attention tests/test_cuda_attention[1]_tests.cmake | "
        "${cmake_ninja_workdir}tests/test_cuda_attention[1]_tests.cmake: CXX_EXECUTABLE_LINKER__test_cuda_attention_Release"
        " tests/t.o\n"
        "build libsparsa.a: CXX_STATIC_LIBRARY_LINKER__sparsa_Release src/a.o\n"
        "build src/a.o: CXX_COMPILER__sparsa_unscanned_Release ../src/a.cpp\n")
    script = os.path.join(ROOT, "scripts", "gpu-prebuild")

    def target_file(target):
        return subprocess.run(["bash", script, "--target-file", str(tmp_path), target], capture_output=True,
                              text=True, timeout=60)

    for target, path in (("sparsa_cli", "tools/sparsa"),
                         ("_sparsa", "python/sparsa/_sparsa.cpython-312-x86_64-linux-gnu.so"),
                         ("test_cuda_attention", "tests/test_cuda_attention"), ("sparsa", "libsparsa.a")):
        r = target_file(target)
        assert r.returncode == 0 and r.stdout.strip() == path, (target, r.stdout, r.stderr)
    for target in ("test_cuda", "nosuch"):
        r = target_file(target)
        assert r.returncode != 0 and f"target {target}" in r.stderr, (target, r.stderr)


def test_a_prebuilt_build_of_this_tree_replaces_the_build(tmp_path):
    """scripts/gpu-prebuild's pack (PREBUILT) is copied instead of building only when its stamp is
    this tree's and it holds every target of the call's modes."""
    pack = tmp_path / "pack"
    pack.mkdir()
    env_t = dict(os.environ, GPU_CHECK_TARGETS="1")
    targets = subprocess.run(["bash", SCRIPT, "--masks"], cwd=ROOT, env=env_t, capture_output=True, text=True,
                             check=True).stdout
    (pack / "TARGETS").write_text(targets)
    (pack / "STAMP").write_text(stamp() + "\n")
    (pack / "files.tar.xz").write_bytes(b"")

    def call(*modes):
        env = dict(os.environ, GPU_CHECK_DRY="1", OUT=str(tmp_path / "out"), PREBUILT=str(pack))
        return subprocess.run(["bash", SCRIPT, *modes], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)

    r = call("--masks")
    assert r.returncode == 0, r.stderr
    assert f"DRY unpack {pack}/files.tar.xz into build-gpu/" in r.stdout and "DRY cmake" not in r.stdout
    r = call("--masks", "--dlm-tests")  # a target the pack lacks: built as before
    assert "lacks the target" in r.stdout and "DRY cmake --build" in r.stdout and "DRY unpack" not in r.stdout
    (pack / "STAMP").write_text("0" * 64 + "\n")  # another tree's
    r = call("--masks")
    assert "built from another tree" in r.stdout and "DRY cmake --build" in r.stdout and "DRY unpack" not in r.stdout
    r = call()  # the full call never takes a pack (ctest runs over the whole build)
    assert "DRY unpack" not in r.stdout and "use-prebuilt" not in r.stdout


def test_the_stamp_follows_the_sources(tmp_path):
    first = stamp()
    assert len(first) == 64 and first == stamp()
    # A tree of its own: the stamp changes with a source's content or name, not with caches.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "tree-stamp").write_bytes(open(os.path.join(ROOT, "scripts", "tree-stamp"), "rb").read())
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.cpp").write_text("int a;\n")

    def of_tmp():
        return subprocess.run(["bash", str(tmp_path / "scripts" / "tree-stamp")], capture_output=True, text=True,
                              check=True).stdout.strip()

    a = of_tmp()
    (tmp_path / "src" / "__pycache__").mkdir()
    (tmp_path / "src" / "__pycache__" / "x.pyc").write_text("cache")
    (tmp_path / "src" / "build-x").mkdir()
    (tmp_path / "src" / "build-x" / "o.o").write_text("object")
    (tmp_path / "src" / "NOTES.md").write_text("no build reads Markdown or PNG files\n")
    (tmp_path / "src" / "plot.png").write_bytes(b"\x89PNG")
    assert of_tmp() == a
    (tmp_path / "src" / "a.cpp").write_text("int b;\n")
    b = of_tmp()
    (tmp_path / "src" / "a.cpp").rename(tmp_path / "src" / "c.cpp")
    assert len({a, b, of_tmp()}) == 3


@pytest.mark.parametrize("runs_here", [True, False])
def test_a_carried_binary_that_does_not_run_here_is_built_instead(tmp_path, runs_here):
    """use-prebuilt copies the pack, then runs each test binary (--gtest_list_tests): one that does
    not run (another machine's C library, say) takes the copied files back, keeps the rest of
    build-gpu (the call's logs), and tells the caller to build."""
    for name in ("use-prebuilt", "tree-stamp"):
        (tmp_path / "scripts").mkdir(exist_ok=True)
        (tmp_path / "scripts" / name).write_bytes(open(os.path.join(ROOT, "scripts", name), "rb").read())
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.cpp").write_text("int a;\n")
    stage, pack = tmp_path / "stage", tmp_path / "pack"
    (stage / "tests").mkdir(parents=True)
    pack.mkdir()
    binary = stage / "tests" / "test_x"
    binary.write_text("#!/bin/sh\nexit %d\n" % (0 if runs_here else 3))
    binary.chmod(0o755)
    with tarfile.open(pack / "files.tar.xz", "w:xz") as t:
        t.add(stage, arcname=".")
    (pack / "TARGETS").write_text("test_x\n")
    (pack / "STAMP").write_text(subprocess.run(["bash", str(tmp_path / "scripts" / "tree-stamp")], capture_output=True,
                                               text=True, check=True).stdout)
    (tmp_path / "build-gpu" / "out").mkdir(parents=True)
    (tmp_path / "build-gpu" / "out" / "build.log").write_text("the call's log\n")
    env = dict(os.environ, PREBUILT=str(pack))
    env.pop("GPU_CHECK_DRY", None)
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "use-prebuilt"), "test_x"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == (0 if runs_here else 1), r.stderr
    assert (tmp_path / "build-gpu" / "tests" / "test_x").exists() == runs_here
    assert (tmp_path / "build-gpu" / "out" / "build.log").read_text() == "the call's log\n"
    if not runs_here:
        assert "does not run here" in r.stderr and "building instead" in r.stderr


def test_skipped_steps_are_left_out_and_said(tmp_path):
    env = dict(os.environ, GPU_CHECK_DRY="1", OUT=str(tmp_path / "out"), GPU_CHECK_SKIP="ba-att-bench masks-bench")
    r = subprocess.run(["bash", SCRIPT, "--masks", "--ba-att", "--eval"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"^== ([\w-]+): ", r.stdout, re.M)
    assert "ba-att-bench" not in steps and "masks-bench" not in steps
    assert re.search(r"^ba-att-bench +skipped \(GPU_CHECK_SKIP\)$", r.stdout, re.M)
    # XAttention's device tests and sanitizers run once for --ba-att and --eval together.
    for s in ("xattention-tests", "xattention-memcheck", "xattention-racecheck", "eval", "ba-att-tests"):
        assert steps.count(s) == 1, (s, steps)
    # The tail shows the logs the call has; a skipped benchmark's is said to be absent, not an error.
    assert "(bench.log: none, its step did not run)" in r.stdout and "can't read" not in r.stderr, r.stderr
    assert r.stdout.rstrip().endswith("gpu-check: all green")
