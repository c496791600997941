"""pytest plugin for //:pytest_suite: the session must use the Bazel-built extension.

run_pytest.sh sets HOCCL_EXPECTED_EXTENSION to the copy of the Bazel-built
jax_hoccl/_hoccl.so it put on PYTHONPATH; if pytest's own sys.path handling (rootdir or
conftest insertion) or a jax_hoccl installed in the venv made the session import another
one, the run fails.
"""
import os
import sys

import pytest


def _check():
    want = os.environ.get("HOCCL_EXPECTED_EXTENSION")
    mod = sys.modules.get("jax_hoccl._hoccl")
    if not want or mod is None:
        return None
    got = getattr(mod, "__file__", None)
    if got is None or os.path.realpath(got) != os.path.realpath(want):
        return "jax_hoccl._hoccl was loaded from %s, not the Bazel-built %s" % (got, want)
    return None


def pytest_report_header(config):
    return "jax_hoccl extension under test: %s" % os.environ.get("HOCCL_EXPECTED_EXTENSION")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    err = _check()
    if err:
        raise pytest.UsageError(err)


def pytest_sessionfinish(session, exitstatus):
    err = _check()
    if err:
        sys.stderr.write("bazel_pytest_plugin: %s\n" % err)
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
