"""The vLLM pin and the release watch (scripts/vllm_release_watch.py), without network."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("watch", ROOT / "scripts/vllm_release_watch.py")
watch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(watch)


def test_the_gpu_extra_admits_exactly_the_releases_the_contract_suite_ran():
    pin = watch.gpu_pin((ROOT / "pyproject.toml").read_text())
    assert [v in pin for v in ("0.31.0", "0.32.0", "0.33.0", "0.34.0", "0.35.0")] == [
        False,
        True,
        True,
        True,
        False,
    ]


def test_only_final_releases_above_the_pin_are_reported():
    pin = watch.SpecifierSet(">=0.32,<0.35")
    releases = ["0.31.0", "0.32.0", "0.34.0", "0.34.1", "0.35.0rc1", "0.35.0", "0.36.0", "x"]
    assert watch.newer_than_pin(pin, releases) == ["0.35.0", "0.36.0"]
    assert watch.newer_than_pin(pin, ["0.32.0", "0.34.1"]) == []


def test_without_network_it_says_so_and_does_not_fail(capsys):
    unreachable = "--url=http://127.0.0.1:9/pypi/vllm/json"  # the discard port: refused
    assert watch.main([unreachable]) == 0
    assert "PyPI not reachable" in capsys.readouterr().out
    assert watch.main([unreachable, "--strict"]) == 2
