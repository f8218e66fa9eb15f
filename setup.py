"""The build's one compiled part; everything else is in pyproject.toml.

The direct path's inner loops and the caller above them in C (transport/native.py).
Optional: where it cannot be built, the install goes on and tensorwire runs them in Python."""

from setuptools import Extension, setup

_HERE = "src/tensorwire/transport/"
setup(ext_modules=[Extension("tensorwire.transport._native", [_HERE + "_native.c", _HERE + "_caller.c"],
                             depends=[_HERE + "_native.h"], optional=True)])
