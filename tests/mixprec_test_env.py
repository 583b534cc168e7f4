"""Helpers shared by tests in every directory (tests/ is on pytest's pythonpath)."""


def src_env() -> dict[str, str]:
    """Environment for subprocesses: import mixprec from this checkout's src/, installed or not."""
    import os
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
