"""The codecs depend on the core, never the reverse (issue 15)."""

import ast
import pathlib

import deepreduce

CORE = pathlib.Path(deepreduce.__file__).parent
#: The package's entry point registers the built-in codecs and re-exports their base
#: classes; the registry checks a codec's base class when asked for one.
ALLOWED = {"__init__.py", "registry.py"}


def imported_modules(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_core_modules_do_not_import_the_codecs():
    offenders = {str(path.relative_to(CORE)): module
                 for path in CORE.rglob("*.py") if path.name not in ALLOWED
                 for module in imported_modules(path)
                 if module.startswith("deepreduce.codecs")}
    assert offenders == {}
