"""The optional C extension of prompt analysis (gateway/analysis/_native.c); everything else is
in pyproject.toml. Without a C compiler the build skips it and analysis runs in Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gateway.analysis._native",
            ["gateway/analysis/_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
