"""Every Python file of the repository compiles, and none reads a local before assigning it.

Much of the Python here runs only on a GPU (the benchmarks in bench/cuda, the device halves of the
engines' scripts), which CI does not have, so a mistake there shows up only in a device run. One
did: a local of bench_llsa.main named like the module's function inputs() made every call of it an
UnboundLocalError. pyflakes finds that class statically (UndefinedLocal). Its other reports are
left out: its "undefined name" counts a closure's use of a variable the enclosing loop deletes
afterwards, which these benchmarks do on purpose to free device memory between sizes."""
import os

import pyflakes.api
import pyflakes.messages
import pyflakes.reporter

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__"}


def python_files():
    for here, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(here, ROOT)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(("build", ".")))
        if rel.split(os.sep)[0].startswith(("build", ".")) and rel != ".":
            continue
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(here, f)


class Collect(pyflakes.reporter.Reporter):
    def __init__(self):
        self.problems = []

    def unexpectedError(self, filename, msg):
        self.problems.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.problems.append(f"{filename}:{lineno}: syntax error: {msg}")

    def flake(self, message):
        if isinstance(message, pyflakes.messages.UndefinedLocal):
            self.problems.append(str(message))


def check(paths):
    reporter = Collect()
    for path in paths:
        pyflakes.api.checkPath(path, reporter)
    return reporter.problems


def test_the_repository_has_python_files_to_check():
    files = list(python_files())
    names = {os.path.relpath(f, ROOT) for f in files}
    assert os.path.join("bench", "cuda", "bench_llsa.py") in names
    assert len(files) >= 40, len(files)


def test_no_python_file_reads_a_local_before_assigning_it():
    problems = check(python_files())
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_shadowed_function_and_a_syntax_error(tmp_path):
    shadow = tmp_path / "shadow.py"
    shadow.write_text("def inputs():\n    return 1\n\n\ndef main():\n    x = inputs()\n    inputs = 2\n"
                      "    return x + inputs\n")
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    fine = tmp_path / "fine.py"
    fine.write_text("def f():\n    q = 1\n\n    def g():\n        return q\n    del q\n    return g\n")
    problems = check([str(shadow), str(broken), str(fine)])
    assert len(problems) == 2, problems
    assert "inputs" in problems[0] and "referenced before assignment" in problems[0]
    assert "syntax error" in problems[1]
