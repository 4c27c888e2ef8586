"""The codecs depend on the core, never the reverse (issue 15)."""

import ast
import pathlib

import deepreduce
import deepreduce.codecs

CORE = pathlib.Path(deepreduce.__file__).parent
#: where a wheel installed the codecs (deepreduce/codecs/, inside CORE); in a checkout codecs/
CODECS = pathlib.Path(deepreduce.codecs.__file__).parent
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
                 and CODECS not in path.parents
                 for module in imported_modules(path)
                 if module.startswith("deepreduce.codecs")}
    assert offenders == {}


#: The frameworks deepreduce integrates with; the collectives know none of them (issue 30).
FRAMEWORKS = ("horovod", "tensorflow", "torch", "keras", "jax")


def framework_imports(path: pathlib.Path):
    """Every module ``path`` imports anywhere (inside functions too), by statement or by
    ``importlib.import_module(...)`` / ``__import__(...)`` of a constant name."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.Call) and node.args:
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else \
                getattr(function, "id", None)
            argument = node.args[0]
            if name in ("import_module", "__import__") and isinstance(argument, ast.Constant):
                yield node.lineno, str(argument.value)


def test_the_collectives_import_no_framework():
    offenders = [f"{path.relative_to(CORE)}:{line} imports {module}"
                 for path in sorted((CORE / "collectives").rglob("*.py"))
                 for line, module in framework_imports(path)
                 if module.split(".")[0] in FRAMEWORKS]
    assert offenders == []


def test_the_framework_check_sees_imports_anywhere(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import numpy\n"
                      "def f():\n    import horovod.tensorflow as hvd\n"
                      "def g():\n    from torch import distributed\n"
                      "def h():\n    return importlib.import_module('tensorflow')\n"
                      "def i():\n    return __import__('torch.distributed')\n")
    found = [module for _, module in framework_imports(module)]
    assert found == ["numpy", "horovod.tensorflow", "torch", "tensorflow", "torch.distributed"]


#: The codecs' own layers (issue 44): the helpers of both families at the top of codecs/
#: (base, _murmur, _deflate, _zstd) below the families index/ and values/, which never
#: import each other; the package's __init__ registers both. Of the core, a codec imports
#: only the modules below the codecs (the bits, the errors, the registry and its spec).
CODEC_FAMILIES = ("deepreduce.codecs.index", "deepreduce.codecs.values")
CORE_BELOW_THE_CODECS = ("deepreduce.bits", "deepreduce.errors", "deepreduce.registry",
                         "deepreduce.spec")


def codec_imports(path: pathlib.Path):
    """``(line, module)`` of every deepreduce name ``path`` imports (``from deepreduce.x
    import y`` names ``deepreduce.x.y``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)


def family_of(module: str):
    return next((family for family in CODEC_FAMILIES
                 if module == family or module.startswith(family + ".")), None)


def test_the_codec_families_share_helpers_and_never_import_each_other():
    offenders = []
    for path in sorted(CODECS.rglob("*.py")):
        relative = path.relative_to(CODECS)
        if relative == pathlib.Path("__init__.py"):
            continue
        name = "deepreduce.codecs." + ".".join(relative.with_suffix("").parts)
        own = family_of(name.removesuffix(".__init__"))
        for line, module in codec_imports(path):
            other = family_of(module)
            if other is not None and other != own:
                offenders.append(f"{relative}:{line} imports {module}")
            elif module.startswith("deepreduce") and not module.startswith(
                    ("deepreduce.codecs.", *CORE_BELOW_THE_CODECS)):
                offenders.append(f"{relative}:{line} imports {module}")
    assert offenders == []
