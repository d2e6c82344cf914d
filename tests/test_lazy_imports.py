"""``import kvcake`` and the command line's parser load no torch or transformers (they took about
6 s of a ``kvcake --help``), and the packages' public names still resolve, from the one table
each package keeps (``kvcake.lazy.lazy_exports``) that its ``TYPE_CHECKING`` imports repeat."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvcake

SRC = Path(kvcake.__file__).parent
PACKAGES = ("kvcake", "kvcake.bench", "kvcake.eval", "kvcake.calibration")


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON value."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


HEAVY = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'accelerate'))"


def test_the_parser_and_the_help_load_no_torch():
    heavy = _fresh(
        "import contextlib, io, json, sys\n"
        "import kvcake, kvcake.cli\n"
        "parser = kvcake.cli.build_parser()\n"
        "for argv in (['--help'], ['generate', '--help'], ['bench', 'decode', '--help'], ['eval', '--help'],\n"
        "             ['calibrate', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        parser.parse_args(argv)\n"
        f"print(json.dumps({HEAVY}))"
    )
    assert heavy == []


def test_a_name_is_imported_when_first_read():
    seen = _fresh(
        "import json, sys\n"
        "import kvcake\n"
        f"before = {HEAVY}\n"
        "cache = kvcake.KVCakeCache\n"
        "print(json.dumps([before, cache.__module__, 'KVCakeCache' in vars(kvcake), 'torch' in sys.modules]))"
    )
    assert seen == [[], "kvcake.cache", True, True]


def test_a_submodule_reads_as_an_attribute_as_before():
    assert _fresh("import json, kvcake\nprint(json.dumps(kvcake.budget.__name__))") == "kvcake.budget"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def _type_checking_imports(tree: ast.Module, package: str) -> dict[str, str]:
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    found = {}
    for node in block.body:
        module = "." * node.level + (node.module or "")
        for alias in node.names:
            found[alias.asname or alias.name] = module if alias.asname is None else f"{module}:{alias.name}"
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_the_table_and_the_type_checking_imports_agree(package):
    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text())
    table = next(
        n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_EXPORTS"
    )
    exports = ast.literal_eval(table.value)
    assert _type_checking_imports(tree, package) == exports
    assert set(exports) | {"__version__"} >= set(module.__all__)
