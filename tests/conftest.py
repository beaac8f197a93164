"""Shared fixtures. Engine tests run a real vLLM (CPU build) on a tiny local model."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

# Keep vLLM's caches and scratch files inside the test run, and its KV cache small.
_SCRATCH = tempfile.mkdtemp(prefix="kvdisk-tests-")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_SCRATCH, "vllm-cache"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def _vllm_has_kernels() -> bool:
    """A vLLM build that can run an engine here (the CPU build: ``vllm/_C*.so``), as
    opposed to vLLM's Python without kernels (``scripts/setup_vllm034.sh``)."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(glob.glob(os.path.join(d, "_C.*")) for d in spec.submodule_search_locations)


# Without kernels only the contract suite (tests/contract: vLLM's scheduler, no engine)
# can run; every other test file here is left uncollected.
collect_ignore_glob = [] if _vllm_has_kernels() else ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0))


@pytest.fixture(scope="session")
def other_model(tmp_path_factory):
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "other", seed=1))


@pytest.fixture(scope="session")
def gemma3_model(tmp_path_factory):
    """Tiny Gemma 3: sliding-window (256) and full-attention layers, fp32."""
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "gemma3", arch="gemma3"))


@pytest.fixture(scope="session")
def qwen3next_model(tmp_path_factory):
    """Tiny Qwen3-Next: Gated-DeltaNet and full-attention layers, bf16."""
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3next", arch="qwen3next"))


def pytest_collection_modifyitems(config, items):
    """Engine tests are recognisable by their file's name: every test marked ``engine``
    lives in a ``test_engine_*.py`` file, and those files hold engine tests only."""
    wrong = [
        item.nodeid
        for item in items
        if (item.get_closest_marker("engine") is not None)
        != item.fspath.basename.startswith("test_engine_")
    ]
    if wrong:
        raise pytest.UsageError(
            "engine tests belong in tests/test_engine_*.py, and only they: " + ", ".join(wrong[:10])
        )


GLUSTER_BASE = "/tmp/kvdisk-gluster"


@pytest.fixture(scope="module")
def gluster_mounts():
    """Two FUSE mounts of one GlusterFS volume made on the local disk for the tests of one
    module (``vllm_kvdisk.testing.gluster``), removed after them whatever happened. Where
    the volume cannot be made (not root, glusterfs not installed), each test fails with
    the reason: a test on a shared volume is never skipped."""
    from vllm_kvdisk.testing import gluster

    try:
        with gluster.volume(GLUSTER_BASE) as vol:
            yield vol.mounts
    except gluster.GlusterError as exc:
        pytest.fail(f"no GlusterFS volume for this test: {exc}", pytrace=False)


def pytest_terminal_summary(terminalreporter):
    """A size report of the package's largest modules, not a limit: a module that keeps
    growing may hold two concepts, and this is where a reader sees it first."""
    import pathlib

    package = pathlib.Path(__file__).resolve().parent.parent / "vllm_kvdisk"
    sizes = sorted(
        (
            (len(p.read_text().splitlines()), str(p.relative_to(package.parent)))
            for p in package.rglob("*.py")
        ),
        reverse=True,
    )
    terminalreporter.write_sep("-", "largest modules (lines)")
    for lines, name in sizes[:8]:
        terminalreporter.write_line(f"{lines:5d}  {name}")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A real S3 server (SeaweedFS's ``weed server -s3``) with a bucket, for the session;
    where it cannot start, each test using it fails with the reason, never skips."""
    from vllm_kvdisk.testing.seaweed import SeaweedS3

    server = SeaweedS3(str(tmp_path_factory.mktemp("seaweed")))
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(f"no S3 server for this test: {exc}", pytrace=False)
    yield server
    server.stop()
