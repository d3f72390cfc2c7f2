"""docs/adding-a-kernel.md points at real things: every repository path it names exists, every function it names
"in" a file is defined there, and the modules and commands it runs are there to run."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding-a-kernel.md"
TEXT = DOC.read_text(encoding="utf-8")
_PATH = re.compile(r"`((?:\.ci|bench|csrc|docs|fastprompt|kernels|scripts|tests)/[\w./-]*|setup\.py|CMakeLists\.txt)`")
_NAMED_IN = re.compile(r"`(\w+)`(?:\s+and\s+`\w+`)?\s+in\s+`([\w/.-]+\.py)`")


def test_every_path_exists():
    paths = sorted(set(_PATH.findall(TEXT)))
    assert len(paths) >= 20
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_named_function_is_in_its_file():
    pairs = _NAMED_IN.findall(TEXT)
    assert len(pairs) >= 5
    for name, path in pairs:
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^\s*(?:def|class)\s+{name}\b|^{name}\s*=", source, re.M), (name, path)


def test_every_link_resolves():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", TEXT):
        assert (DOC.parent / target).exists(), target


def test_the_commands_it_runs_exist():
    assert "python -m fastprompt.kernels.aot fastprompt.kernels.contrastive_loss --cc 80 90" in TEXT
    assert (ROOT / "kernels" / "aot.py").exists() and (ROOT / "kernels" / "contrastive_loss.py").exists()
    for script in ("scripts/lint_imports.py", "scripts/gpu_check.sh", "scripts/test.sh",
                   "bench/bench_contrastive_loss.py"):
        assert script in TEXT and (ROOT / script).exists(), script
