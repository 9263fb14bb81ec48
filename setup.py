"""The packages, found rather than listed so that none can be forgotten (pyproject.toml holds the
rest of the metadata). pyproject's `find` cannot install a folder under another name, and two are:
- the built-in trainer's config groups and presets live in the top-level conf/ and install as the
  package `pipeline.conf` (steadfast-train, installed from a wheel, reads them there);
- the launcher plugin lives in launchers/hydra_plugins/ and installs as `hydra_plugins` (a namespace
  package: Hydra's plugin scan merges every installed hydra_plugins folder).
The config folders have no __init__.py below their root: they are namespace packages, and their
YAML files travel as package data (pyproject's [tool.setuptools.package-data]).
"""

from setuptools import find_namespace_packages, setup

CODE = find_namespace_packages(".", include=["steadfast", "steadfast.*", "pipeline", "pipeline.*"], exclude=["pipeline.conf*"])
PLUGIN = find_namespace_packages("launchers", include=["hydra_plugins", "hydra_plugins.*"])
TRAINER_CONF = ["pipeline.conf"] + [f"pipeline.conf.{name}" for name in find_namespace_packages("conf")]

setup(
    packages=CODE + PLUGIN + TRAINER_CONF,
    package_dir={"pipeline.conf": "conf", "hydra_plugins": "launchers/hydra_plugins"},
)
