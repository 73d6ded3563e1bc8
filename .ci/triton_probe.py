"""pytest plugin (`-p triton_probe` with .ci on PYTHONPATH): records which tests launch a Triton
kernel, by wrapping the interpreter's and the JIT's launch. Writes {nodeid: launches} to the
file named by TRITON_PROBE_OUT at the end of the session. Evidence for the `triton` marker in
tests/conftest.py: run the suite under FASTATTN_BACKEND=triton TRITON_INTERPRET=1 with it."""

import json
import os

import pytest

_launches: dict[str, int] = {}
_current: list[str] = []


def _wrap(cls):
    run = cls.run

    def counted(self, *args, **kwargs):
        if _current:
            _launches[_current[0]] = _launches.get(_current[0], 0) + 1
        return run(self, *args, **kwargs)

    cls.run = counted


def pytest_configure(config):
    from triton.runtime import interpreter, jit

    _wrap(interpreter.InterpretedFunction)
    _wrap(jit.JITFunction)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[:] = [item.nodeid]
    _launches.setdefault(item.nodeid, 0)
    try:
        return (yield)
    finally:
        _current.clear()


def pytest_sessionfinish(session):
    path = os.environ.get("TRITON_PROBE_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(_launches, f, indent=1, sort_keys=True)
