"""Build configuration that pyproject.toml cannot state: the shipped data as package data.

The length traces and fitted cost models live once, in the repository's top-level ``data/``
(``data/README.md``). A wheel carries them as package data of ``dynmb.data``
(``dynmb/data/traces/``, ``dynmb/data/costmodels/``) by mapping those two package folders onto
``data/traces`` and ``data/costmodels``; ``dynmb.data.shipped_dir`` reads the package data in an
installed wheel and the checkout's ``data/`` otherwise (editable install, ``PYTHONPATH``).
Everything else (metadata, dependencies, the package data patterns) is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

SHIPPED = {"dynmb.data.traces": "data/traces", "dynmb.data.costmodels": "data/costmodels"}

setup(packages=find_namespace_packages(include=["dynmb", "dynmb.*"]) + list(SHIPPED), package_dir=SHIPPED)
