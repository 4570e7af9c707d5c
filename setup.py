"""Build of kvfabric's optional C data plane (``kvfabric._native``, sources in csrc/).

Everything else about the package is in pyproject.toml. The extension needs
only gcc, the Python headers and the kernel's ``linux/io_uring.h``; no
liburing. If it cannot be compiled here (no compiler, no io_uring header, not
Linux), the build prints why and the package installs without it: the
``native`` and ``shm`` transports then report themselves unavailable and the
pure-Python ``tcp`` transport is used (a transport forced by
``KVFABRIC_TRANSPORT`` still raises, it never falls back silently).

``KVFABRIC_NATIVE_REQUIRED=1`` turns a failed compile into a build error
(CI uses it); ``CFLAGS``/``LDFLAGS`` pass through (the ASan build uses them).
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = [
    "csrc/kvf_module.c",
    "csrc/kvf_py_client.c",
    "csrc/kvf_py_server.c",
    "csrc/kvf_py_shm.c",
    "csrc/kvf_py_bench.c",
    "csrc/kvf_mpack.c",
    "csrc/kvf_conn.c",
    "csrc/kvf_store.c",
    "csrc/kvf_uring.c",
    "csrc/kvf_server.c",
    "csrc/kvf_send.c",
    "csrc/kvf_ops.c",
    "csrc/kvf_bench.c",
    "csrc/kvf_hash.c",
]
DEFINES = []
if platform.machine() in ("x86_64", "AMD64"):
    # run-time SSE2/AVX2/AVX-512 selection for the object checksum (vendored xxHash)
    SOURCES.append("csrc/third_party/xxhash/xxh_x86dispatch.c")
    DEFINES.append(("KVF_XXH_DISPATCH", "1"))


class OptionalBuildExt(build_ext):
    """build_ext that skips the extension instead of failing, unless required."""

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

    def _skip(self, exc: Exception) -> None:
        if os.environ.get("KVFABRIC_NATIVE_REQUIRED") == "1":
            raise exc
        print(f"kvfabric: the C extension was not built ({exc}); "
              "native and shm transports will be unavailable, tcp works", file=sys.stderr)


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
