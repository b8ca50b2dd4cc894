"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s golden -- cpu_ref``, ``nox -s bench``."""

import nox

nox.options.sessions = ["tests", "lint"]
TORCH = "torch==2.13.0"  # the CPU build; GPU hosts install their own torch first and use --no-venv
PACKAGES = ["-e", ".[test]", "-e", "backends/cpu_ref", "-e", "backends/nvidia_sm100", "-e", "backends/ascend_950",
            "-e", "plugins/deepinfer-example-kernels"]


@nox.session
def tests(session):
    session.install(TORCH, *PACKAGES)
    session.install("--no-deps", "xgrammar", "apache-tvm-ffi")  # its metadata would pull triton
    session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session):
    session.install("ruff>=0.5")
    session.run("ruff", "check", "deepinfer_core", "backends", "plugins", "tests", "examples")


@nox.session
def golden(session):
    """Op conformance of one backend against cpu_ref: ``nox -s golden -- nvidia_sm100``."""
    backend = session.posargs[0] if session.posargs else "cpu_ref"
    session.install(TORCH, *PACKAGES)
    session.run("pytest", "-q", "tests/ops/test_conformance.py", f"--backend={backend}", "-m", "not gpu",
                *session.posargs[1:])


@nox.session
def bench(session):
    session.install(TORCH, *PACKAGES, "matplotlib")
    session.run("deepinfer", "bench", *session.posargs)
