"""In CI a skipped test is a failure unless it is about a CPU feature: a missing package cannot hide a test."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = "from tests.conftest import cpu_feature, pytest_runtest_makereport  # noqa: F401\n"
TESTS = """
import pytest
from tests.conftest import cpu_feature

def test_needs_redis():
    pytest.skip("redis-server not found on PATH")

@pytest.mark.skipif(True, reason="prometheus not installed")
def test_needs_prometheus():
    pass

@cpu_feature(True, "needs AMX-BF16, which this CPU lacks")
def test_needs_amx():
    pass

@pytest.mark.cpu_feature
def test_skips_itself_for_the_cpu():
    pytest.skip("no AMX-INT8 here")

@pytest.mark.xfail(reason="a known gap")
def test_known_gap():
    assert False
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_only_cpu_feature_skips_pass_in_ci(pytester, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_skips=TESTS)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    if ci:
        result.assert_outcomes(failed=1, errors=1, skipped=2, xfailed=1)  # a skip at setup is an error
        result.stdout.fnmatch_lines(["*skipped in CI*redis-server not found*", "*skipped in CI*prometheus*"])
    else:
        result.assert_outcomes(skipped=4, xfailed=1)
