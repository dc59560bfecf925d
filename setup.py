"""Adds the one compiled part of shardpar; everything else about the package is in pyproject.toml.

`shardpar._shm` is the shared-memory intra-node transport (shardpar/csrc/shm_transport.c): plain C, no
Python API (shardpar/collectives/shm.py loads it with ctypes). It is optional: without a C compiler the
install still succeeds and `shardpar.collectives.shm.available()` says why the transport is off.
No -march=native: the wheel must run on any x86-64; the AVX2/AVX-512 kernels are selected at run time.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardpar._shm",
            sources=["shardpar/csrc/shm_transport.c"],
            depends=["shardpar/csrc/shm_transport.h"],
            extra_compile_args=["-O3", "-std=c11", "-fvisibility=hidden", "-Wall", "-Wextra"],
            libraries=["rt"],
            optional=True,
        )
    ]
)
