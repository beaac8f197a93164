"""The pure layers must import and work with vLLM and torch absent.

The list is derived from the package layout: every module of ``core``, ``storage`` and
``replay``, and the ``kvdisk`` tool's modules in ``ops``. Only the modules that face vLLM
are left out, by name (``FACES_VLLM``); a new module in a pure layer is checked without
anyone adding it here.
"""

import pathlib
import subprocess
import sys

import vllm_kvdisk

PURE_PACKAGES = ("core", "storage", "replay", "ops")
FACES_VLLM = {"replay.plugin", "ops.metrics"}


def pure_modules() -> list[str]:
    root = pathlib.Path(vllm_kvdisk.__file__).parent
    names = []
    for pkg in PURE_PACKAGES:
        for path in sorted((root / pkg).glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            if name not in FACES_VLLM:
                names.append(name)
    return names


def test_the_pure_list_covers_the_layers():
    names = pure_modules()
    for expected in (
        "core.format",
        "core.index",
        "storage.store",
        "storage.scan",
        "replay.log",
        "ops.cli",
    ):
        assert expected in names
    assert not FACES_VLLM & set(names)


def test_core_imports_without_vllm_or_torch():
    code = (
        "import sys\n"
        "for name in ('vllm', 'torch', 'transformers'):\n"
        "    sys.modules[name] = None  # any import of it now raises ImportError\n"
        + "".join(f"import vllm_kvdisk.{m}\n" for m in pure_modules())
        + "from vllm_kvdisk.ops.cli import main\n"
        "assert main(['stats', '.']) == 0\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
