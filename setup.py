"""Build of kvfabric's C data plane (``kvfabric._native``, sources in csrc/).

Everything else about the package is in pyproject.toml. The extension needs
only gcc, the Python headers and the kernel's ``linux/io_uring.h``; no
liburing. The pool server (``kvfabric serve``) is this extension, so a build
that cannot compile it fails, and says what to install, instead of hiding it
in pip's quiet output.

``KVFABRIC_NATIVE_OPTIONAL=1`` installs a client-only package when the
extension cannot be built (no compiler, not Linux): the client then has only
the pure-Python ``tcp`` transport (``native``/``shm`` report themselves
unavailable with the reason; a transport forced by ``KVFABRIC_TRANSPORT``
still raises, never falls back silently) and ``kvfabric serve`` exits with
the same advice. ``CFLAGS``/``LDFLAGS`` pass through (the ASan build uses
them).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent

# Every C file of csrc/ (scripts/c-layers.py checks that they form layers; its
# layers, top first: kvf_module.c, the bindings, the server loop ... the store).
SOURCES = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.c"))
DEFINES = []
if platform.machine() in ("x86_64", "AMD64"):
    # run-time SSE2/AVX2/AVX-512 selection for the object checksum (vendored xxHash)
    SOURCES.append("csrc/third_party/xxhash/xxh_x86dispatch.c")
    DEFINES.append(("KVF_XXH_DISPATCH", "1"))


HINT = ("install a C compiler and the Python headers (Debian/Ubuntu: apt-get install gcc python3-dev; the kernel "
        "headers must provide linux/io_uring.h) and build again, or set KVFABRIC_NATIVE_OPTIONAL=1 for a "
        "client-only install without the pool server")


class NativeBuildError(RuntimeError):
    """The extension could not be built (the message says what to install)."""


class OptionalBuildExt(build_ext):
    """build_ext that fails with what to install, or skips the extension under KVFABRIC_NATIVE_OPTIONAL=1."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing entirely
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc)

    _said = False

    def _skip(self, exc: Exception) -> None:
        if isinstance(exc, NativeBuildError):
            raise exc
        if os.environ.get("KVFABRIC_NATIVE_OPTIONAL") != "1":
            raise NativeBuildError(f"kvfabric: the C extension (the pool server's data plane) cannot be built: {exc}; "
                               + HINT) from exc
        if self._said:
            return
        self._said = True
        print(f"kvfabric: the C extension was not built ({exc}); KVFABRIC_NATIVE_OPTIONAL=1: client-only "
              "install (tcp transport only, no `kvfabric serve`)", file=sys.stderr)


ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "kvfabric._native",
            sources=SOURCES,
            include_dirs=["csrc", "csrc/third_party/xxhash"],
            define_macros=DEFINES,
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
            depends=[os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".h")]
            if os.path.isdir("csrc") else [],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
