"""trtspec's folders in layers, and no import cycles between its modules; lazy (function-level) imports included:
they only hide an upward import or a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trtspec"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``package`` (a package's __init__.py is the package)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_package(modules: dict[str, Path], name: str) -> bool:
    return modules[name].name == "__init__.py"


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    """module -> {imported trtspec module: line numbers}, from every import statement in the module's source.

    ``import a.b`` is an edge to a.b; ``from a import b`` to a.b if that is a module, else to a; relative
    imports are resolved against the importing module's package. No implicit edges to parent packages.
    """
    root = PACKAGE.name
    graph: dict[str, dict[str, list[int]]] = {}

    def nearest_module(name: str) -> str | None:  # the longest prefix of a dotted name that is one of ours
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return ".".join(parts[:end])
        return None

    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        package = name if _is_package(modules, name) else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [nearest_module(alias.name) for alias in node.names if alias.name.split(".")[0] == root]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != root:
                    continue
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else nearest_module(base))
            for target in targets:
                if target is not None:
                    edges.setdefault(target, []).append(node.lineno)
    return graph


def _strongly_connected(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, {})))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def find_cycles(graph: dict[str, dict[str, list[int]]], limit: int = 200) -> list[list[str]]:
    """The elementary cycles, each as [a, b, ..., a] starting from its smallest module (at most ``limit``)."""
    cycles = []
    for component in _strongly_connected(graph):
        members = set(component)
        if len(component) == 1 and component[0] not in graph.get(component[0], {}):
            continue
        for start in component:  # cycles through start and only members after it: each cycle found once
            allowed = {m for m in members if m >= start}
            path, stack = [start], [iter(sorted(t for t in graph[start] if t in allowed))]
            while stack and len(cycles) < limit:
                child = next(stack[-1], None)
                if child is None:
                    stack.pop()
                    path.pop()
                elif child == start:
                    cycles.append([*path, start])
                elif child not in path:
                    path.append(child)
                    stack.append(iter(sorted(t for t in graph[child] if t in allowed)))
    return sorted(cycles)


def describe(cycle: list[str], graph: dict[str, dict[str, list[int]]], modules: dict[str, Path]) -> str:
    """``a -> b -> a`` and, per edge, where the import is (file:line)."""
    where = []
    for a, b in zip(cycle, cycle[1:]):
        lines = ",".join(str(n) for n in sorted(set(graph[a][b])))
        where.append(f"    {a} -> {b}: {modules[a].relative_to(PACKAGE.parent)}:{lines}")
    return " -> ".join(cycle) + "\n" + "\n".join(where)


def test_the_import_graph_sees_lazy_relative_and_package_imports():
    modules = module_files()
    graph = import_graph(modules)
    # a package's __init__ is its own node, with no implicit edge to or from its submodules
    assert "trtspec.engines" in graph and "trtspec.engines.base" in graph["trtspec.engines"]
    # a lazy import inside load_engine, resolved relative to the package
    assert "trtspec.engines.onnxruntime" in graph["trtspec.engines"]
    # `from ..errors import X` is an edge to the module errors, `from ..engine_contract import f` to engine_contract
    assert {"trtspec.errors", "trtspec.engine_contract"} <= set(graph["trtspec.engines.tensorrt"])


def test_engines_do_not_import_the_builder():
    """The builder writes plans for the engines and may import them; the engines never import the builder."""
    graph = import_graph(module_files())
    wrong = {m: sorted(t for t in graph[m] if t.startswith("trtspec.builder")) for m in graph
             if m.startswith("trtspec.engines")}
    assert not {m: t for m, t in wrong.items() if t}


def test_the_builder_takes_the_artifact_contract_from_engine_contract_not_from_the_engines():
    """What a built artifact promises its loader (MatMulNBits' accuracy level, Q/DQ fusion, the TensorRT plan's
    profile lookup) lives in engine_contract.py, and the onnxruntime session settings in ort_session.py; the builder
    imports from engines/ only what opens TensorRT itself, never a constant."""
    import ast

    modules = module_files()
    imported = {}
    for name, path in modules.items():
        if not name.startswith("trtspec.builder"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "engines" in node.module.split("."):
                imported.setdefault(name, set()).update(a.name for a in node.names)
    everything = set().union(*imported.values())
    assert everything <= {"compute_capability", "import_tensorrt"}, everything
    graph = import_graph(modules)
    assert "trtspec.engine_contract" in graph["trtspec.builder.onnxruntime"]
    assert "trtspec.engine_contract" in graph["trtspec.engines.onnxruntime"]


def test_the_runtime_imports_nothing_from_heads_or_distillation():
    """Training and exporting drafts (heads/, distill/) use the runtime to measure them; the runtime runs every
    drafter from runtime/drafters/ and never imports the training side."""
    graph = import_graph(module_files())
    wrong = {m: sorted(t for t in graph[m] if t.startswith(("trtspec.heads", "trtspec.distill"))) for m in graph
             if m.startswith("trtspec.runtime")}
    assert not {m: t for m, t in wrong.items() if t}


def test_find_cycles_reports_each_elementary_cycle_once():
    graph = {"a": {"b": [1]}, "b": {"a": [2], "c": [3]}, "c": {"a": [4]}, "d": {"d": [5]}, "e": {"a": [6]}}
    assert find_cycles(graph) == [["a", "b", "a"], ["a", "b", "c", "a"], ["d", "d"]]


def test_no_import_cycles_between_trtspec_modules():
    modules = module_files()
    graph = import_graph(modules)
    cycles = find_cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s) between trtspec modules:\n" + "\n".join(
        describe(c, graph, modules) for c in cycles)


# Bottom to top: a module may import from its own layer and the layers below it, never from one above. A layer is a
# folder of trtspec/ or a module at its top; the first layer is the small modules every stage shares.
LAYERS = (
    ("errors", "engine_contract", "manifest", "progress", "onnx_graph", "int4_packing", "ort_session", "testing"),
    ("kernels",),
    ("exporter",),  # HF model / GGUF file -> step graph
    ("quantization",),  # step graph -> step graph with Q/DQ
    ("engines",),  # the engine protocol and its backends: run an artifact
    ("torch_backend",),  # trtspec.compile: the step contract as a compiled torch module
    ("builder",),  # step graph -> engine artifact (the torch backend's: an AOTInductor package of that module)
    ("runtime",),  # engines -> speculative decoding
    ("heads",),  # draft heads: their layouts and export
    ("training",),
    ("distill",),  # training drafts, measured through the runtime
    ("server",),  # the OpenAI-compatible front over the runtime
    ("bench",),  # `trtspec bench`
    ("trtspec",),  # the package itself: the Python API, one function a command
    ("cli",),
    ("__main__",),
)


def layer_of(module: str) -> str:
    """trtspec.runtime.drafters.suffix -> runtime; trtspec.errors -> errors; trtspec (the package) -> trtspec."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(graph: dict[str, dict[str, list[int]]], modules: dict[str, Path],
                     layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """'file:line: a (layer i) imports b (layer j), above it' for each upward import, and each import between two
    layers that import each other (whatever their order), one line per import statement."""
    rank = {name: i for i, members in enumerate(layers) for name in members}
    between: dict[tuple[str, str], list[tuple[str, str, int]]] = {}
    for a, targets in graph.items():
        for b, lines in targets.items():
            la, lb = layer_of(a), layer_of(b)
            if la != lb:
                between.setdefault((la, lb), []).extend((a, b, n) for n in sorted(set(lines)))
    found = []
    for (la, lb), imports in sorted(between.items()):
        for a, b, line in imports:
            where = f"{modules[a].relative_to(PACKAGE.parent)}:{line}"
            if la not in rank or lb not in rank:
                unknown = la if la not in rank else lb
                found.append(f"{where}: {a} imports {b}; layer {unknown!r} is not in LAYERS: add it where it belongs")
            elif rank[lb] > rank[la]:
                found.append(f"{where}: {a} (layer {la}) imports {b} (layer {lb}, above it)")
            elif (lb, la) in between:
                found.append(f"{where}: {a} (layer {la}) imports {b} (layer {lb}), and {lb} imports {la}")
    return found


def test_layer_violations_name_the_file_the_line_and_both_layers():
    graph = {"trtspec.runtime.generator": {"trtspec.server.prompts": [116], "trtspec.errors": [3]},
             "trtspec.server.app": {"trtspec.runtime.generator": [7]},
             "trtspec.exporter.gguf": {"trtspec.quantization.int4_packing": [35]},
             "trtspec.quantization.quantize": {"trtspec.exporter.contract": [17]}}
    modules = {name: PACKAGE.parent / (name.replace(".", "/") + ".py")
               for name in [*graph, "trtspec.server.prompts", "trtspec.errors", "trtspec.exporter.contract",
                            "trtspec.quantization.int4_packing"]}
    assert layer_violations(graph, modules) == [
        "trtspec/exporter/gguf.py:35: trtspec.exporter.gguf (layer exporter) imports "
        "trtspec.quantization.int4_packing (layer quantization, above it)",
        "trtspec/quantization/quantize.py:17: trtspec.quantization.quantize (layer quantization) imports "
        "trtspec.exporter.contract (layer exporter), and exporter imports quantization",
        "trtspec/runtime/generator.py:116: trtspec.runtime.generator (layer runtime) imports trtspec.server.prompts "
        "(layer server, above it)",
        "trtspec/server/app.py:7: trtspec.server.app (layer server) imports trtspec.runtime.generator (layer runtime), "
        "and runtime imports server",
    ]


def test_every_layer_of_trtspec_is_declared_once():
    declared = [name for members in LAYERS for name in members]
    assert len(declared) == len(set(declared))
    assert {layer_of(m) for m in module_files()} == set(declared)


def test_trtspec_imports_only_downward_between_its_layers():
    modules = module_files()
    found = layer_violations(import_graph(modules), modules)
    assert not found, f"{len(found)} import(s) against the layer order (tests/test_imports.py: LAYERS):\n" + "\n".join(found)


def test_every_runtime_module_and_drafter_has_a_test_file_named_for_it():
    """A module's tests are found by its name: tests/test_<module>.py for each runtime module and each drafter."""
    tests = Path(__file__).resolve().parent
    missing = [f"{module.relative_to(PACKAGE.parent)} -> tests/test_{module.stem}.py"
               for folder in (PACKAGE / "runtime", PACKAGE / "runtime" / "drafters")
               for module in sorted(folder.glob("*.py"))
               if module.stem not in ("__init__", "base") and not (tests / f"test_{module.stem}.py").exists()]
    assert not missing, "modules without a test file named for them:\n" + "\n".join(missing)
