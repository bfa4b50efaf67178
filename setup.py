"""Where each package's folder is, for setuptools (the rest of the build is in pyproject.toml).

Import folders are named as imported (core/rlcore, plugins/rlcore_plugins): discovery finds every subpackage, so none
can be left out of the wheel. The recipes live once, in the top-level configs/ folder, and install as the package
rlcore.presets (YAML presets + bundled HF configs as its package data), so `rlcore run <name>` finds them by name from
an editable checkout and from a wheel alike. pyproject.toml cannot say this: its package discovery overrides any
package-dir entry and cannot add a package from elsewhere.
"""
from setuptools import find_namespace_packages, setup

IMPORT_ROOTS = ("core", "plugins")
PRESETS = ("rlcore.presets", "configs")

package_dir = {package: f"{root}/{package.replace('.', '/')}"
               for root in IMPORT_ROOTS for package in find_namespace_packages(root, include=["rlcore*"])}
package_dir[PRESETS[0]] = PRESETS[1]
setup(packages=sorted(package_dir), package_dir=package_dir)
