import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "hvd_dgc", "__init__.py")) as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)
with open(os.path.join(HERE, "README.md")) as f:
    LONG_DESCRIPTION = f.read()

setup(
    name="hvd_dgc",
    version=VERSION,
    description=("Deep Gradient Compression and Delayed Gradient Averaging "
                 "for Horovod (PyTorch, TensorFlow, Keras)"),
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_dgc", "hvd_dgc.*"]),
    python_requires=">=3.9",
    # Horovod itself is built from source by tools/install.sh (0.28.1 needs a
    # patch to build against torch 2.x); it is not a pip requirement here so
    # that pip never tries to build an unpatched copy.
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16", "tf-keras"],
        "dev": ["pytest", "pytest-timeout", "scikit-learn", "matplotlib", "pyyaml", "tqdm"],
    },
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
