"""The build's one compiled part; everything else is in pyproject.toml.

The direct path's inner loops in C (transport/native.py). Optional: where it cannot be built,
the install goes on and tensorwire runs them in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tensorwire.transport._native", ["src/tensorwire/transport/_native.c"],
                             optional=True)])
