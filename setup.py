"""The compiled part of kvtier: `kvtier.manager._native` (manager/_native.c).

Everything else is declared in pyproject.toml; setuptools reads both. The extension needs only
a C compiler and the Python headers; kvtier runs without it (`kvtier.manager.core.native` falls back
to pure Python, with identical keys and states).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.manager._native",
            sources=["manager/_native.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Werror=implicit"],
            libraries=["dl"],
            # a machine without a C compiler still installs kvtier (pure-Python hot path);
            # tests/test_native.py fails where the build was expected and did not happen
            optional=True,
        )
    ],
)
