"""Maps the top-level folders onto the shoal.* namespace (see docs/design.md, Layout).

`operator` is a standard-library module and `kernels` a Hugging Face package, so the
folders are never importable under their own names.
"""
from setuptools import find_packages, setup

ROOTS = {"shoal": "shoal", "shoal.runtime": "runtime", "shoal.kernels": "kernels", "shoal.operator": "operator"}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    packages.append(name)
    package_dir[name] = folder
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
