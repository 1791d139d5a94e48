import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "hvd_dgc", "__init__.py")) as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)
with open(os.path.join(HERE, "README.md")) as f:
    LONG_DESCRIPTION = f.read()


def fused_kernel():
    """The optional C++ kernel (hvd_dgc/torch/csrc): DGC's memory update and the
    selection's block maxima in one pass over the gradient. Built when torch is
    importable at build time (pip install --no-build-isolation); without it, or if
    it fails to compile, hvd_dgc runs the same maths in eager PyTorch."""
    if os.environ.get("HVD_DGC_NO_KERNEL") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}

    class OptionalBuild(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # a missing compiler must not stop the install
                print(f"hvd_dgc: fused kernel not built ({exc}); eager PyTorch will be used")

    ext = CppExtension("hvd_dgc.torch._fused_memory", ["hvd_dgc/torch/csrc/fused_memory.cpp"],
                       extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": OptionalBuild.with_options(use_ninja=False)}


EXT_MODULES, CMDCLASS = fused_kernel()

setup(
    name="hvd_dgc",
    version=VERSION,
    description=("Deep Gradient Compression and Delayed Gradient Averaging "
                 "for Horovod (PyTorch, TensorFlow, Keras)"),
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_dgc", "hvd_dgc.*"]),
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
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
