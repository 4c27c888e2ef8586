"""The layers import one way: each module only from its own layer or those below (issue 44);
the codecs depend on the core, never the reverse (issue 15); the collectives (issue 30) and
the exchange (issue 51) know no framework."""

import ast
import pathlib

import pytest

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


#: The frameworks deepreduce integrates with; the collectives (issue 30) and the exchange
#: with its settings (issue 51) know none of them.
FRAMEWORKS = ("horovod", "tensorflow", "torch", "keras", "jax")
FRAMEWORK_FREE = ("collectives", "exchange", "config.py")

#: Methods of a framework's tensors that numpy arrays lack: code that calls them works on
#: the framework's tensors itself, without importing it. The exchange hands such tensors
#: to its selector instead (deepreduce.torch.device.DeviceSelector for torch's). Any
#: other method whose name ends in one underscore is one of torch's in-place operations.
TENSOR_METHODS = {"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "numel",
                  "clone", "detach", "cpu", "cuda", "to", "half", "bfloat16", "dim",
                  "element_size", "is_floating_point", "is_contiguous", "data_ptr",
                  "pin_memory", "contiguous", "record_stream", "untyped_storage", "numpy"}


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


def tensor_method_calls(path: pathlib.Path):
    """``(line, method)`` of every call in ``path`` of a method that only a framework's
    tensors have (:data:`TENSOR_METHODS`, or an in-place ``name_``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method in TENSOR_METHODS or (method.endswith("_") and not method.endswith("__")
                                            and not method.startswith("_")):
                yield node.lineno, method


def framework_uses(paths) -> list:
    """Where ``paths`` import a framework or call a method of its tensors."""
    offenders = []
    for path in paths:
        offenders += [f"{path.relative_to(CORE)}:{line} imports {module}"
                      for line, module in framework_imports(path)
                      if module.split(".")[0] in FRAMEWORKS]
        offenders += [f"{path.relative_to(CORE)}:{line} calls .{method}()"
                      for line, method in sorted(tensor_method_calls(path))]
    return offenders


@pytest.mark.parametrize("part", FRAMEWORK_FREE)
def test_the_framework_free_layers_use_no_framework(part):
    paths = sorted((CORE / part).rglob("*.py")) if (CORE / part).is_dir() else [CORE / part]
    assert paths and framework_uses(paths) == []


def test_the_framework_check_sees_a_tensor_handled_in_place(monkeypatch):
    # what exchange/summing.py did before issue 51, in a module of the collectives
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: (
        "import numpy as np\n"
        "def f(first, out, size):\n"
        "    whole = first.new_empty(size)\n"
        "    out.reshape(-1).copy_(whole[:size])\n"
        "    return np.zeros(size).reshape(-1), whole.numel(), out.__add__(1)\n"))
    module = CORE / "collectives" / "block.py"
    assert framework_uses([module]) == ["collectives/block.py:3 calls .new_empty()",
                                        "collectives/block.py:4 calls .copy_()",
                                        "collectives/block.py:5 calls .numel()"]


def test_the_framework_check_sees_imports_anywhere(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import numpy\n"
                      "def f():\n    import horovod.tensorflow as hvd\n"
                      "def g():\n    from torch import distributed\n"
                      "def h():\n    return importlib.import_module('tensorflow')\n"
                      "def i():\n    return __import__('torch.distributed')\n")
    found = [module for _, module in framework_imports(module)]
    assert found == ["numpy", "horovod.tensorflow", "torch", "tensorflow", "torch.distributed"]


#: The layers, bottom first: a module may import from its own layer and those below.
#: A module belongs to the longest prefix that names it.
LAYERS = [
    # the data model and its kernels: errors, sparse tensors, bit packing, the spec
    # grammar, the sums of sparse parts
    ("deepreduce.errors", "deepreduce.sparse", "deepreduce.bits", "deepreduce.spec",
     "deepreduce.sums", "deepreduce._varint", "deepreduce._topkscan", "deepreduce._sparsesum"),
    # what turns a tensor into streams: the sparsifiers, the codecs and their registry
    ("deepreduce.sparsifiers", "deepreduce.registry", "deepreduce.codecs"),
    # the wire format: the payload container, the pipeline, the bundle
    ("deepreduce.container", "deepreduce.pipeline", "deepreduce.bundle"),
    # the collectives over a transport, free of frameworks
    ("deepreduce.collectives",),
    # the exchange of one step's gradients, and its settings
    ("deepreduce.exchange", "deepreduce.config"),
    # the integrations, the command line, the public entry point
    ("deepreduce.horovod", "deepreduce.torch", "deepreduce.cli", "deepreduce.testing",
     "deepreduce"),
]
def layer_of(module: str) -> int | None:
    """The layer of the dotted ``module`` (None: not deepreduce's)."""
    best = None
    for layer, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and \
                    (best is None or len(prefix) > len(best[1])):
                best = (layer, prefix)
    return None if best is None else best[0]


def module_name(path: pathlib.Path) -> str:
    if CODECS in path.parents or path.parent == CODECS:
        parts = ("deepreduce", "codecs", *path.relative_to(CODECS).with_suffix("").parts)
    else:
        parts = ("deepreduce", *path.relative_to(CORE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_imports(paths) -> list:
    offenders = []
    for path in paths:
        name = module_name(path)
        own = layer_of(name)
        for line, module in deepreduce_imports(path):
            theirs = layer_of(module)
            if own is not None and theirs is not None and theirs > own:
                offenders.append(f"{name}:{line} imports {module}")
    return offenders


def test_every_module_has_a_layer():
    paths = sorted({*CORE.rglob("*.py"), *CODECS.rglob("*.py")})
    assert [module_name(path) for path in paths if layer_of(module_name(path)) is None] == []


def test_the_layers_import_one_way():
    assert upward_imports(sorted({*CORE.rglob("*.py"), *CODECS.rglob("*.py")})) == []


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    # a module of the wire format that imports the exchange, inside a function
    module = CORE / "bundle.py"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: (
        "import numpy\nfrom deepreduce.sums import sum_into\n"
        "def f():\n    from deepreduce import exchange\n"
        "def g():\n    import deepreduce.collectives.frames\n"))
    assert upward_imports([module]) == [
        "deepreduce.bundle:4 imports deepreduce.exchange",
        "deepreduce.bundle:6 imports deepreduce.collectives.frames"]


#: The codecs' own layers (issue 44): the helpers of both families at the top of codecs/
#: (base, _murmur, _deflate, _zstd) below the families index/ and values/, which never
#: import each other; the package's __init__ registers both. Of the core, a codec imports
#: only the modules below the codecs (the bits, the errors, the registry and its spec).
CODEC_FAMILIES = ("deepreduce.codecs.index", "deepreduce.codecs.values")
CORE_BELOW_THE_CODECS = ("deepreduce.bits", "deepreduce.errors", "deepreduce.registry",
                         "deepreduce.spec")


def deepreduce_imports(path: pathlib.Path):
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
        for line, module in deepreduce_imports(path):
            other = family_of(module)
            if other is not None and other != own:
                offenders.append(f"{relative}:{line} imports {module}")
            elif module.startswith("deepreduce") and not module.startswith(
                    ("deepreduce.codecs.", *CORE_BELOW_THE_CODECS)):
                offenders.append(f"{relative}:{line} imports {module}")
    assert offenders == []


#: The exchange's own layers (issue 44), bottom first: a module of deepreduce/exchange/
#: imports only modules of the layers below its own, so the three strategies never
#: import each other; the package's __init__ re-exports the facade, above them all.
EXCHANGE_LAYERS = [
    # the parts a step uses: error feedback, the stats, the codec threads, the
    # per-tensor selection, the hierarchical topology, the gathering's sums
    ("memory", "stats", "parallel", "selection", "topology", "summing"),
    # the one strategy interface, the gathering's encoding and decoding sides, the
    # hierarchical's layout of the shards
    ("strategy", "encoding", "decoding", "shards"),
    # the strategies
    ("gathering", "reducing", "hierarchical"),
    # the facade, which picks a strategy from the settings
    ("gradient_exchange",),
    # the frame every integration shares around the facade (settings, agreement,
    # checkpoints), main's deepreduce/exchange/integration.py of issue 51
    ("integration",),
]


def exchange_layer(name: str) -> int | None:
    """The layer of the exchange module ``name`` (``deepreduce.exchange.<name>``)."""
    return next((layer for layer, names in enumerate(EXCHANGE_LAYERS) if name in names), None)


def exchange_imports_not_below(paths) -> list:
    """Every import, by a module of the exchange among ``paths``, of an exchange module
    that is not in a layer below its own (the package itself included)."""
    offenders = []
    for path in paths:
        own = exchange_layer(path.stem)
        for line, module in sorted(deepreduce_imports(path)):
            if module.split(".")[:2] != ["deepreduce", "exchange"]:
                continue
            theirs = exchange_layer(module.split(".")[2]) if module.count(".") >= 2 else None
            if theirs is None or theirs >= own:
                offenders.append(f"exchange/{path.name}:{line} imports {module}")
    return offenders


EXCHANGE_MODULES = sorted(path for path in (CORE / "exchange").glob("*.py")
                          if path.name != "__init__.py")


def test_every_exchange_module_has_a_layer():
    assert [path.name for path in EXCHANGE_MODULES if exchange_layer(path.stem) is None] == []


def test_the_exchange_modules_import_one_way():
    assert exchange_imports_not_below(EXCHANGE_MODULES) == []


def test_the_exchange_check_sees_a_strategy_importing_another(monkeypatch):
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: (
        "from deepreduce.exchange.strategy import Step\n"
        "def f():\n    from deepreduce.exchange.gathering import GatheringExchange\n"
        "from deepreduce.exchange import GradientExchange\n"))
    assert exchange_imports_not_below([CORE / "exchange" / "hierarchical.py"]) == [
        "exchange/hierarchical.py:3 imports deepreduce.exchange.gathering.GatheringExchange",
        "exchange/hierarchical.py:4 imports deepreduce.exchange.GradientExchange"]


def test_no_exchange_module_shares_a_name_with_a_collective():
    # (two allgather.py, two hierarchical.py told two different things apart by their
    # folder alone until issue 51)
    collectives = {path.stem for path in (CORE / "collectives").glob("*.py")}
    assert [path.name for path in EXCHANGE_MODULES if path.stem in collectives] == []
