"""The client's modules import only from layers below their own.

Every ``import`` of the package is read from the source (``ast``, nothing
imported), wherever it sits: at the top, inside a function, or under
``if TYPE_CHECKING:`` (a cycle a type checker follows is still a cycle a
reader follows). A module may import from a strictly lower layer only, so
the imports form no cycle; a module missing from the table fails too, so a
new one gets a place in it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "polyak"

#: Lowest first. A module imports only from the layers above it in this list.
LAYERS: list[tuple[str, set[str]]] = [
    # Leaves: import nothing of polyak.
    (
        "leaves",
        {
            "_version",
            "errors",
            "sysmetrics",
            "_push.stats",
            "_progress",
            "integrations._metrics",
            # Evaluations to TensorBoard and W&B (writers known by their methods).
            "trackers",
        },
    ),
    # The contract's values and the safetensors format; how a front end
    # calls the server without letting its faults stop the training.
    ("formats", {"contract", "wire", "integrations._server"}),
    # Typed views of the server's answers (over the contract's enums).
    ("views", {"views"}),
    # What a rank holds (torch); the way to the server (HTTP).
    ("torch and HTTP", {"shards", "_transport"}),
    # A download by ranges over several connections, checked block by block.
    ("ranged fetch", {"_ranged"}),
    # Downloads; a pusher's queue, its layout, its copy of the server's
    # mirror (deltas, the codec).
    (
        "downloads and push state",
        {"downloads", "_push", "_push.queue", "_push.layout", "_push.mirror"},
    ),
    # What a body becomes on the wire (over the mirror copy).
    ("push encodings", {"_push.encoding"}),
    # A pusher's threads.
    ("push threads", {"_push.copier", "_push.sender"}),
    ("pusher", {"pusher"}),
    # Evaluations over a run (the worker, the post-hoc sweep): they take a
    # run by what it does, and the client offers the sweep as a method.
    ("evaluations", {"evals"}),
    ("client", {"client"}),
    (
        "front ends",
        {
            "cli",
            "integrations",
            "integrations.accelerate",
            "integrations.lightning",
            "integrations.transformers",
        },
    ),
    # The drop-ins' run: a pusher and the read-back (over the client).
    ("drop-in core", {"compat._remote"}),
    # One drop-in per original class.
    (
        "drop-ins",
        {
            # The package offers `run_of` (over the core).
            "compat",
            "compat.swa_utils",
            "compat.ema_pytorch",
            "compat.timm",
            "compat.diffusers",
            "compat.trl",
        },
    ),
    # Lightning's callbacks over the AveragedModel drop-in.
    ("drop-in callbacks", {"compat.lightning"}),
    ("package", {"__init__", "__main__"}),
]


def layer_of() -> dict[str, int]:
    return {module: i for i, (_, modules) in enumerate(LAYERS) for module in modules}


def module_name(path: Path) -> str:
    """``client``, ``_push.queue``, ``integrations`` (its ``__init__``),
    ``__init__`` (the package's)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def package_of(module: str, path_is_init: bool) -> list[str]:
    """The package a module's relative imports start from."""
    if module == "__init__":
        return []
    parts = module.split(".")
    return parts if path_is_init else parts[:-1]


def imported(source: str, module: str, is_init: bool, known: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` of every polyak module ``source`` imports."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "polyak" or alias.name.startswith("polyak."):
                    out.append((node.lineno, alias.name.removeprefix("polyak").lstrip(".")))
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if node.module is None or not (
                node.module == "polyak" or node.module.startswith("polyak.")
            ):
                continue
            base = [p for p in node.module.split(".")[1:]]
        else:
            pkg = package_of(module, is_init)
            base = pkg[: len(pkg) - (node.level - 1)] + (
                node.module.split(".") if node.module else []
            )
        for alias in node.names:
            # ``from . import downloads`` names a module; ``from . import
            # __version__`` names an attribute of the package itself.
            candidate = ".".join([*base, alias.name])
            target = candidate if candidate in known else ".".join(base)
            out.append((node.lineno, target))
    return [(line, target or "__init__") for line, target in out]


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import of ``sources`` (``{module: (source, is_init)}``) that
    does not go to a strictly lower layer."""
    layers = layer_of()
    known = set(sources) | set(layers)
    found = [f"{m}: not in the LAYERS table" for m in sources if m not in layers]
    for module, (source, is_init) in sources.items():
        for line, target in imported(source, module, is_init, known):
            if target not in layers:
                found.append(f"{module}:{line} imports {target}, which is not in the LAYERS table")
            elif module in layers and layers[target] >= layers[module]:
                found.append(
                    f"{module}:{line} imports {target}: layer `{LAYERS[layers[target]][0]}` "
                    f"is not below `{LAYERS[layers[module]][0]}`"
                )
    return found


def package_sources() -> dict[str, tuple[str, bool]]:
    return {
        module_name(p): (p.read_text(), p.name == "__init__.py")
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def support_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import of the tests' support package (``polyak_testing``, which
    is never installed for users) in ``sources``."""
    found = []
    for module, (source, _) in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name == "polyak_testing" or name.startswith("polyak_testing."):
                    found.append(f"{module}:{node.lineno} imports {name}")
    return found


def test_the_package_imports_nothing_of_the_test_support():
    """``polyak`` runs without ``polyak_testing``: no module imports it,
    wherever the import sits (the check finds one put in a function)."""
    sources = package_sources()
    assert support_imports(sources) == []
    source, is_init = sources["client"]
    sources["client"] = (
        f"def f():\n    from polyak_testing import PolyakServer\n{source}",
        is_init,
    )
    assert support_imports(sources) == ["client:2 imports polyak_testing"]
    sources["client"] = (f"import polyak_testing.refs\n{source}", is_init)
    assert support_imports(sources) == ["client:1 imports polyak_testing.refs"]


def test_every_import_goes_down():
    sources = package_sources()
    assert set(sources) == set(layer_of()), "the table and the package's modules differ"
    assert violations(sources) == []


@pytest.mark.parametrize(
    ("module", "line", "why"),
    [
        ("wire", "from .client import Client", "wire:1 imports client"),
        ("pusher", "from .client import Run", "pusher:1 imports client"),
        ("downloads", "from . import __version__", "downloads:1 imports __init__"),
        ("_push.queue", "from .sender import Sender", "_push.queue:1 imports _push.sender"),
        ("_push.sender", "from ..pusher import Pusher", "_push.sender:1 imports pusher"),
        ("_transport", "import polyak.downloads", "_transport:1 imports downloads"),
        ("client", "from .client import Run", "client:1 imports client"),
    ],
)
def test_an_upward_import_is_found(module, line, why):
    """The check fails on an import from the same or a higher layer, at
    the top of a module or anywhere else in it."""
    sources = package_sources()
    source, is_init = sources[module]
    sources[module] = (f"{line}\n{source}", is_init)
    found = violations(sources)
    assert len(found) == 1 and found[0].startswith(why), found
    nested = f"def f():\n    if True:\n        {line}\n"
    sources[module] = (nested + source, is_init)
    assert violations(sources)[0].startswith(why.replace(":1 ", ":3 "))
