"""core/ and sim/ (and the CLI built on them) must not load torch or megatron; every package
imports only itself and the layers below it; the entry points in benchmarks/ and scripts/
use megatron_prt's public modules only."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
# Each package may import itself and those before it, never those after it.
LAYERS = ("core", "sim", "tune", "runtime", "megatron", "bench", "cli")


def test_core_sim_cli_load_no_torch():
    code = (
        "import sys, megatron_prt.core, megatron_prt.sim.simulate, megatron_prt.sim.render, "
        "megatron_prt.sim.analytic, megatron_prt.cli\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'megatron.'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_sources_import_only_stdlib():
    import ast
    import pathlib

    allowed_roots = set(sys.stdlib_module_names) | {"megatron_prt"}
    root = pathlib.Path(__file__).parents[1] / "megatron_prt"
    for sub in ("core", "sim", "tune", "cli"):
        for path in (root / sub).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    # matplotlib is imported lazily, only for PNG output
                    assert top in allowed_roots or top == "matplotlib", f"{path}: imports {name}"


def test_only_the_megatron_package_imports_megatron():
    import ast
    import pathlib

    root = pathlib.Path(__file__).parents[1] / "megatron_prt"
    for path in root.rglob("*.py"):
        if path.parent.name == "megatron":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] == "megatron" for n in names), f"{path} imports {names}"


def _imports(path: pathlib.Path, package: list[str]):
    """(module, imported names) of every import statement in ``path``, function-level ones
    included, relative ones made absolute (``package``: the dotted parts of its package)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            yield module, tuple(alias.name for alias in node.names)


def _packages_named(module: str, names: tuple[str, ...]) -> list[str]:
    """The megatron_prt subpackages an import reaches (``from megatron_prt import core``
    names them as imported names)."""
    parts = module.split(".")
    if parts[0] != "megatron_prt":
        return []
    return [parts[1]] if len(parts) > 1 else list(names)


def test_every_package_is_a_layer():
    packages = {p.name for p in (ROOT / "megatron_prt").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS), f"place new packages in LAYERS: {packages ^ set(LAYERS)}"


def test_each_package_imports_only_itself_and_the_layers_below():
    """core < sim < tune < runtime < megatron < bench < cli, function-level imports too (a
    lazy import upwards is still a cycle between the packages)."""
    bad = []
    for path in sorted((ROOT / "megatron_prt").rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 3:  # megatron_prt/__init__.py, __main__.py: the program's entry
            continue
        here = LAYERS.index(rel[1])
        for module, names in _imports(path, list(rel[:-1])):
            for there in _packages_named(module, names):
                if there in LAYERS and LAYERS.index(there) > here:
                    bad.append(f"{'/'.join(rel)}: {rel[1]} imports {module} ({there} is above)")
    assert not bad, "\n".join(bad)


def test_entry_points_use_public_modules_only():
    """benchmarks/ and scripts/ are thin: they import megatron_prt's public modules and names
    (nothing starting with ``_``) and leave megatron to megatron_prt.megatron."""
    bad = []
    for folder in ("benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module, names in _imports(path, [folder]):
                top = module.split(".")[0]
                private = [p for p in (*module.split("."), *names) if p.startswith("_")]
                if top == "megatron" or (top == "megatron_prt" and private):
                    bad.append(f"{folder}/{path.name}: imports {module} {names}")
    assert not bad, "\n".join(bad)
