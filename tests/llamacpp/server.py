"""llama.cpp's OpenAI-compatible server (``llama-server``, C++) for ``tests/test_llama_cpp.py``: built from source
once, into a cache directory keyed by its version, and found there (or where ``TIERGATE_LLAMA_SERVER`` says).

``python tests/llamacpp/server.py`` builds it unless it is cached (``.ci/run`` does, before the tests) and prints the
binary's path. The source is the llama.cpp that llama-cpp-python 0.3.36 vendors, from its sdist on PyPI (a registry
this project already uses: no other download): ``pip download --no-deps --no-binary :all:``, ``vendor/llama.cpp``
extracted, CMake with the flags of :data:`CMAKE_FLAGS`, ``cmake --build --target llama-server``: 430 s in all (372 s
of compiling) on this project's 2-core machine, idle; 841 s of compiling beside a test run. The cache then holds the
binary and the shared libraries it links (``libllama-server-impl``, ``libllama-common``, ``libllama``, ``libmtmd``,
``libggml``, ``libggml-base``, ``libggml-cpu``; 18 MB; the system's ``libstdc++`` and ``libgomp`` besides), and the
build tree is removed.

Why Python rather than a shell script: the tests and the build share one statement of the version, the cache path
and the environment variable (this module), and it runs wherever the tests do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
ENV = "TIERGATE_LLAMA_SERVER"  # a llama-server binary to use instead of the cached build
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",  # no model downloads: the tests write their model
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DGGML_NATIVE=OFF",  # a binary for any x86-64 with AVX2 (ggml's CPU variant), not only the building machine
    # the server's web UI comes prebuilt from a download the build tries on its own; without it the UI is empty,
    # which is all there is offline anyway (the build says "embedded 0 assets" either way)
    "-DLLAMA_USE_PREBUILT_UI=OFF",
]
BUILD_TIMEOUT = 60 * 60  # CI has 90 minutes in all; the build takes 6 to 14 on 2 cores


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/tiergate/llama-server-<llama-cpp-python version>/``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tiergate" / f"llama-server-{LLAMA_CPP_PYTHON}"


def binary() -> Path:
    """The llama-server the tests run: ``$TIERGATE_LLAMA_SERVER``, else the cached build (which may be absent)."""
    return Path(os.environ[ENV]) if os.environ.get(ENV) else cache_dir() / "llama-server"


def run_env(path: Path) -> dict[str, str]:
    """The environment to run the binary at ``path`` with: its shared libraries are beside it (the build's run path
    names the build tree, which is gone)."""
    libs = [str(path.parent), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(libs)}


def version(path: Path) -> str:
    """``llama-server --version`` (its build line), or an error naming why it does not run."""
    out = subprocess.run([str(path), "--version"], env=run_env(path), capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{path} --version exited {out.returncode}: {out.stdout}{out.stderr}")
    return "; ".join(line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip())


def install(build_bin: Path, dest: Path) -> None:
    """Copy the server and its shared libraries (symlinks kept) from a build's ``bin/`` into ``dest``, atomically:
    a half-copied cache is never found."""
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in sorted(build_bin.iterdir()):
        if item.name == "llama-server" or ".so" in item.name:
            shutil.copy2(item, staging / item.name, follow_symlinks=False)
    version(staging / "llama-server")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)


def build(dest: Path) -> None:
    """Download the sdist, build ``llama-server`` in a temporary directory beside ``dest`` and install it there."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-build-", dir=dest.parent) as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(work), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True, timeout=600)
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(work, members=members, filter="data")
        src = work / prefix
        started = time.monotonic()
        subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *CMAKE_FLAGS], check=True, timeout=600)
        subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-server",
                        f"-j{os.cpu_count() or 2}"], check=True, timeout=BUILD_TIMEOUT)
        install(src / "build" / "bin", dest)
        print(f"built llama-server in {time.monotonic() - started:.0f} s", file=sys.stderr)


def main() -> int:
    path = binary()
    if os.environ.get(ENV):
        print(f"{path} ({ENV}): {version(path)}")
        return 0
    if path.exists():
        print(f"{path} (cached): {version(path)}")
        return 0
    build(cache_dir())
    print(f"{path}: {version(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
