"""The Triton kernels, shipped as atom_moe.kernels (never as a top-level `kernels`).

A Python started in a checkout's root (`python -m ...`, `python -c ...`) has the root on sys.path, so
`import kernels` finds this folder first and would shadow the PyPI package of that name, which
transformers (>= 5.25) and SGLang import. Loaded under that name, this module hands the import over
to the installed `kernels`. Where none is installed it stays an empty module, as before: transformers
5.20 imports whatever `kernels` it finds to read a version and must not fail there. Loaded as
atom_moe.kernels it does nothing.
"""


def _hand_over_to_pypi() -> None:
    """Put the installed top-level `kernels` in sys.modules in place of this one, where there is one."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != checkout])
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module  # the import statement returns what sys.modules holds once this file ran
        spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_to_pypi()
del _hand_over_to_pypi
