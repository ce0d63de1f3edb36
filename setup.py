"""Package layout (the metadata is in pyproject.toml).

The Hydra configs live in the top-level ``conf/`` folder of the repository (DESIGN.md section 3) and
are shipped inside the wheel as ``lightning_roundpipe/conf/`` (package data of the mapped package
``lightning_roundpipe.conf``), so ``python -m lightning_roundpipe.train`` works from an installed
wheel too; ``lightning_roundpipe.train.CONF_DIR`` picks whichever is there.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["lightning_roundpipe", "lightning_roundpipe.*"]) + ["lightning_roundpipe.conf"],
    package_dir={"lightning_roundpipe.conf": "conf"},
    package_data={
        "lightning_roundpipe.conf": ["*.yaml", "*/*.yaml", "*/*/*.yaml"],
        "lightning_roundpipe.simulate": ["data/*.csv", "data/*.md"],
    },
)
