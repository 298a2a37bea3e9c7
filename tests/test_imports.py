"""core/ and sim/ (and the CLI built on them) must not load torch or megatron."""

import subprocess
import sys


def test_core_sim_cli_load_no_torch():
    code = (
        "import sys, megatron_prt.core, megatron_prt.sim.simulate, megatron_prt.sim.render, "
        "megatron_prt.cli\n"
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
