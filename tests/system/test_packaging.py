"""A wheel built from this tree, installed (not editable) into a fresh virtualenv, migrates and
serves: the migrations travel inside the package, nothing is looked up beside the source tree."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import anyio
import httpx
import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]


def _build_wheel(into: Path) -> Path:
    """From a copy of what a clean clone holds: an in-tree build reuses build/, which can keep
    files the tree no longer has."""
    source = into.parent / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "sql", "controlplane"):
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__"),
            )  # fmt: skip
        else:
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(into), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = into.glob("controlplane-*.whl")
    return wheel


def _fresh_venv(at: Path, wheel: Path) -> Path:
    """A virtualenv holding only the wheel; its dependencies come from this test's environment
    through a path entry, so nothing is downloaded and the package itself is the wheel's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(at)], check=True)
    python = at / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return at / "bin" / "controlplane"


async def test_a_wheel_installed_in_a_fresh_venv_migrates_and_serves(
    empty_database_url: str, tmp_path: Path
) -> None:
    wheel = _build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"controlplane/sql/{path.name}" for path in (ROOT / "sql").glob("*.sql")} <= names, (
        "the wheel lacks migrations"
    )
    pages = ROOT / "controlplane" / "web" / "ui"
    shipped = {
        f"{p.relative_to(ROOT)}" for p in [*pages.glob("templates/*"), *pages.glob("static/*")]
    }
    assert shipped and shipped <= names, "the wheel lacks the operator pages' templates or files"
    command = _fresh_venv(tmp_path / "venv", wheel)
    # Run from an empty folder: no sql/ nearby, and the import must be the installed one.
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**os.environ, "DATABASE_URL": empty_database_url, "PYTHONPATH": ""}
    with anyio.fail_after(120):
        where = await anyio.run_process(
            [str(command.parent / "python"), "-c",
             "import controlplane; print(controlplane.__file__)"],
            cwd=workdir, env=env,
        )  # fmt: skip
        assert where.stdout.decode().startswith(str(tmp_path / "venv")), where.stdout
        migrated = await anyio.run_process(
            [str(command), "migrate"], cwd=workdir, env=env, check=False
        )
    assert migrated.returncode == 0, migrated.stderr.decode()
    assert "applied 0001_queue" in migrated.stdout.decode()
    serving = subprocess.Popen(
        [str(command), "serve"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=workdir,
        env={**env, "CONTROLPLANE_SERVER_PORT": "0"},
    )  # fmt: skip
    try:
        assert serving.stdout is not None
        with anyio.fail_after(60):
            line = (await anyio.to_thread.run_sync(serving.stdout.readline)).decode()
        assert line.startswith("controlplane listening on "), line
        async with httpx.AsyncClient(base_url=line.split()[-1], timeout=10) as client:
            ready = await client.get("/readyz")
        assert ready.status_code == 200, ready.text
    finally:
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(30) == 0
