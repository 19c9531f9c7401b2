#!/usr/bin/env python3
"""Proves the Dockerfile's build on a machine with no Docker engine.

1. hadolint lints the Dockerfile.
2. The build stage is replayed: its COPY lines copy from the build context into a
   scratch root, and its RUN (docker/install.sh) runs there, so a file the image
   needs but the Dockerfile forgets to copy fails here too.
3. The image holds the daemon and the client (qosd, qosd-client) and not the
   simulator, the tests' harness or their libraries (qosd-sim, tritonclient,
   matplotlib).
4. The result is started with the image's ENTRYPOINT and CMD, as the image's user
   (uid 10001) when this runs as root, and must pass the image's HEALTHCHECK command
   and /readyz, then stop cleanly on SIGTERM.

    python3 scripts/check_docker.py [--hadolint PATH] [--write-constraints]

``--write-constraints`` first installs without docker/constraints.txt, then writes the
versions it got there (the image's pins), then runs the checks with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined: list[str] = []
    buffer = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        joined.append(buffer + line)
        buffer = ""
    result = []
    for line in joined:
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def stages(steps: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, rest in steps:
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    if not isinstance(value, list):
        raise SystemExit(f"expected the exec (JSON) form, got: {rest}")
    return [str(part) for part in value]


def image_python() -> Path:
    """The interpreter playing the image's: Debian's (as in the python image, outside
    any home directory, so the image's unprivileged user can run it), unless
    $QOSD_IMAGE_PYTHON names another."""
    chosen = os.environ.get("QOSD_IMAGE_PYTHON")
    if chosen is None:
        chosen = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    return Path(chosen).resolve()


def reachable_by_anyone(path: Path) -> bool:
    return all(os.stat(parent).st_mode & 0o001 for parent in path.parents) and bool(
        os.stat(path).st_mode & 0o001
    )


def replay_build(build: list[tuple[str, str]], scratch: Path, python: Path) -> Path:
    """Runs the build stage's COPY and RUN steps under ``scratch`` (the image's /),
    with ``python`` as the ``python3`` they find."""
    shims = scratch / ".shims"
    shims.mkdir()
    (shims / "python3").symlink_to(python)
    env = {**os.environ, "PATH": f"{shims}:/usr/local/bin:/usr/bin:/bin"}
    workdir = Path("/")
    for keyword, rest in build:
        if keyword == "WORKDIR":
            workdir = Path(rest)
        elif keyword == "COPY":
            *sources, destination = shlex.split(rest)
            if any(s.startswith("--from") for s in sources):
                raise SystemExit("the build stage copies from another stage; update this script")
            inside = Path(destination)
            if not inside.is_absolute():
                inside = workdir / inside
            target = scratch / inside.relative_to("/")
            for source in sources:
                origin = ROOT / source
                if origin.is_dir():
                    shutil.copytree(
                        origin,
                        target,
                        dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"),
                    )
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if destination.endswith("/"):
                        target.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(origin, target / origin.name)
                    else:
                        shutil.copy2(origin, target)
        elif keyword == "RUN":
            command = exec_form(rest)
            mapped = [str(scratch / c.lstrip("/")) if c.startswith("/") else c for c in command]
            print("+", " ".join(command), flush=True)
            subprocess.run(mapped, check=True, cwd=scratch / workdir.relative_to("/"), env=env)
    return scratch


CONSTRAINTS = ROOT / "docker" / "constraints.txt"


# What the image must not hold: the simulator and the tests' harness (sim/, qosd-sim;
# harness/, qosd-harness), their libraries, and modules of those names under qosd.
NOT_IN_IMAGE = (
    "qosd_sim", "qosd_harness", "tritonclient", "matplotlib", "qosd.sim", "qosd.testing",
    "qosd.demo",
)  # fmt: skip
IN_IMAGE = ("qosd", "qosd-client")


def check_contents(venv: Path) -> None:
    """Fails unless the image's venv has qosd and qosd-client, and nothing of the
    simulator."""
    probe = (
        "import importlib.metadata as m, importlib.util as u, json, sys\n"
        "def found(name):\n"
        "    try:\n"
        "        return u.find_spec(name) is not None\n"
        "    except ModuleNotFoundError:\n"
        "        return False\n"
        "print(json.dumps({'distributions': sorted(d.metadata['Name'].lower() "
        "for d in m.distributions()), 'modules': [n for n in sys.argv[1:] if found(n)]}))"
    )
    listing = json.loads(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", probe, *NOT_IN_IMAGE],
            check=True, capture_output=True, text=True,
        ).stdout
    )  # fmt: skip
    missing = [name for name in IN_IMAGE if name not in listing["distributions"]]
    if missing:
        raise SystemExit(f"the image lacks {', '.join(missing)}")
    if listing["modules"] or "qosd-sim" in listing["distributions"]:
        found = listing["modules"] + ["qosd-sim"] * ("qosd-sim" in listing["distributions"])
        raise SystemExit(f"the image ships the simulator or the harness: {', '.join(found)}")
    print(f"contents: {', '.join(IN_IMAGE)}; none of {', '.join(NOT_IN_IMAGE)}")


def write_constraints() -> None:
    """Installs qosd unpinned into a scratch venv and pins what it got."""
    with tempfile.TemporaryDirectory(prefix="qosd-pins-") as directory:
        venv = Path(directory) / "venv"
        subprocess.run([str(image_python()), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--no-cache-dir",
                        "--disable-pip-version-check", str(ROOT / "clients"), str(ROOT)],
                       check=True)  # fmt: skip
        listing = subprocess.run(
            [str(venv / "bin" / "python"), "-c",
             "import importlib.metadata as m; print('\\n'.join(sorted("
             "f'{d.metadata[\"Name\"]}=={d.version}' for d in m.distributions())))"],
            check=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
    keep = [
        pin
        for pin in listing
        if pin.split("==")[0].lower() not in {"qosd", "qosd-client", "pip", "setuptools"}
    ]
    CONSTRAINTS.write_text(
        "# The image's dependency versions, as CI last tested them.\n"
        "# Regenerate: python3 scripts/check_docker.py --write-constraints\n"
        + "".join(f"{pin}\n" for pin in keep)
    )
    print(f"wrote {len(keep)} pins to {CONSTRAINTS.relative_to(ROOT)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hadolint", default=shutil.which("hadolint") or "hadolint")
    parser.add_argument("--write-constraints", action="store_true")
    args = parser.parse_args()
    if args.write_constraints:
        write_constraints()
    dockerfile = ROOT / "Dockerfile"
    subprocess.run([args.hadolint, str(dockerfile)], check=True)
    print("hadolint: clean")

    build, runtime = stages(instructions(dockerfile))
    settings = dict(runtime)
    entrypoint = exec_form(settings["ENTRYPOINT"])
    command = exec_form(settings["CMD"])
    health = exec_form(settings["HEALTHCHECK"].split(" CMD ", 1)[1])
    user = settings["USER"].split(":")
    with tempfile.TemporaryDirectory(prefix="qosd-image-") as directory:
        scratch = Path(directory)
        os.chmod(scratch, 0o755)
        python = image_python()
        print(f"python: {python}")
        replay_build(build, scratch, python)
        check_contents(scratch / "opt" / "qosd")
        venv = scratch / "opt" / "qosd" / "bin"
        env = {"PATH": f"{venv}:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONUNBUFFERED": "1", "HOME": "/nonexistent"}  # fmt: skip
        prefix: list[str] = []
        if os.geteuid() == 0 and shutil.which("setpriv"):
            if not reachable_by_anyone(python):
                raise SystemExit(f"{python} is out of uid {user[0]}'s reach: set QOSD_IMAGE_PYTHON")
            prefix = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"]
            print(f"running as uid {user[0]}, as the image does")
        print("+", " ".join(prefix + entrypoint + command), flush=True)
        daemon = subprocess.Popen(prefix + entrypoint + command, env=env, cwd="/")
        try:
            deadline = time.monotonic() + 30
            while True:
                check = subprocess.run(
                    prefix + health, env=env, capture_output=True, text=True, check=False
                )
                if check.returncode == 0:
                    break
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"healthcheck never passed: {check.stderr.strip()}")
                time.sleep(0.2)
            print(f"healthcheck: {check.stdout.strip()}")
            http = next(part for part in command if part.count(":") == 1 and "9464" in part)
            with urllib.request.urlopen(f"http://{http.replace('0.0.0.0', '127.0.0.1')}/readyz",
                                        timeout=5) as ready:  # fmt: skip
                print(f"/readyz: {ready.status} {ready.read().decode().strip()}")
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                code = daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
                raise SystemExit("qosd did not stop within 30 s of SIGTERM") from None
        if code != 0:
            raise SystemExit(f"qosd exited with {code} on SIGTERM")
        print("SIGTERM: exited 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
